"""How to plan (`PlanOptions`), and the state of one planning run (`Planning`).

`pfcompile plan` turns its flags into one `PlanOptions` and hands it, unchanged, through
`build_plan` to the solver; nothing in between re-reads a flag or adds a keyword. A
`Planning` is what a single run carries besides: its wall-clock budget, its progress
reports and the task graphs it has built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pfcompile.formats.errors import InputError
from pfcompile.formats.plan import METHODS, PRECOND_DIVISIONS
from pfcompile.formats.profile import Profile
from pfcompile.place.budget import Budget

if TYPE_CHECKING:  # the graphs need networkx, which the command loads only once it plans
    from pfcompile.graph.taskgraph import TaskGraphs

PRECOND_CHOICES = ("auto", *PRECOND_DIVISIONS)
PLACEMENTS = ("auto", "family")


@dataclass(frozen=True)
class PlanOptions:
    """What the planner is asked to do; every field has the CLI's default.

    `method`: "none" (the family's order, K-FAC appended to each step), "greedy"
    (PipeFisher's first fit into the bubbles) or "cpsat". `precond`: the division of
    preconditioning between replicas ("auto" plans each and keeps the fastest; None keeps
    the configuration's). `placement`: with a cluster, "auto" searches where the ranks go,
    "family" keeps the family's numbering. `partition` "auto": the stages' cut is chosen
    with the plan (pfcompile.place.partition). The rest steer CP-SAT's k search
    (pfcompile.place.solver): `time_limit` is the seconds of one k's solve and
    `total_time_limit`, when set, is shared by all the k tried."""

    method: str = "cpsat"
    time_limit: float = 60.0
    workers: int = 2
    fixed_order: bool = True
    refresh_steps: int | None = None
    steady_state: bool = True  # minimise the cycle as it repeats (False: the makespan from idle)
    precond: str | None = None
    placement: str = "auto"
    partition: str | None = None  # "auto": the stages' cut chosen with the plan; None: the configuration's
    # the k rule: accept the first k whose step time is within `tolerance` of the same k steps
    # without refresh work, trying at most `extra_steps` past the lower bound
    tolerance: float = 0.005
    extra_steps: int = 2
    group_curvature: bool | None = None  # None: when the curvature ops alone are many (solver.GROUP_ABOVE)
    total_time_limit: float | None = None
    # return the greedy's plan when CP-SAT found none faster in its time; off: CP-SAT's own
    fall_back_to_greedy: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise InputError("--method", None, f"unknown method {self.method!r} (known: {', '.join(METHODS)})")
        if not self.time_limit > 0:
            raise InputError("--time-limit", None, f"must be positive, got {self.time_limit}")
        if self.workers < 1:
            raise InputError("--workers", None, f"must be at least 1, got {self.workers}")
        if self.refresh_steps is not None and self.refresh_steps < 1:
            raise InputError("--refresh-steps", None, f"must be at least 1, got {self.refresh_steps}")
        if self.precond is not None and self.precond not in PRECOND_CHOICES:
            raise InputError("--precond", None, f"must be one of {', '.join(PRECOND_CHOICES)}")
        if self.partition not in (None, "auto"):
            raise InputError("--partition", None, f"a planning option is 'auto' or none, got {self.partition!r}")
        if self.placement not in PLACEMENTS:
            raise InputError("--placement", None, f"must be one of {', '.join(PLACEMENTS)}")


@dataclass
class Planning:
    """One planning run: its clock (`budget`: `--time-limit` for the whole command), where it
    reports progress (`progress(done, total)`, `describe(text)`), the task graphs it has
    built (one set per profile) and the baselines of the plans it made."""

    budget: Budget = field(default_factory=Budget)
    progress: Callable[[int, int], None] | None = None
    describe: Callable[[str], None] | None = None
    graphs: TaskGraphs | None = None
    # each plan made (by id) -> its first-order baseline Plan: the kept one's expected step
    # with the ops' spread is replayed beside the plan's (place.build._add_expected_step_time)
    baselines: dict = field(default_factory=dict)

    def graphs_of(self, profile: Profile) -> TaskGraphs:
        """The run's graphs of `profile` (made on first use)."""
        if self.graphs is None or self.graphs.profile is not profile:
            from pfcompile.graph.taskgraph import TaskGraphs

            self.graphs = TaskGraphs(profile)
        return self.graphs

    def report(self, done: int, total: int) -> None:
        if self.progress:
            self.progress(done, total)

    def say(self, text: str) -> None:
        if self.describe:
            self.describe(text)
