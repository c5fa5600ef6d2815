"""Wall-clock budget of one planning command, and where its time went.

`--time-limit S` is a hard limit for the whole command, Python included: the command
makes a `Budget(S)` at its start; every CP-SAT call asks `budget.cap(share)` for its limit
(its share, or what is left after keeping `reserve` seconds for the work that must follow:
assembling and replaying the plan, writing it), and loops stop trying more when
`budget.left()` runs out. `budget.stage("graph")` accumulates the seconds of each stage
(graph, warm start, solve, replay) for the plan's stats and the benchmark's table.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

from pfcompile.check.replay import EXPECTED_STEP_MAX_OPS, spread_replay_cycles

MIN_SOLVE_S = 0.05  # a CP-SAT call shorter than this finds nothing: skip it instead
# a budget's reserve for what follows the search (assembling, replaying, verifying and
# writing the plan): a fixed part, plus this many replays at this run's measured seconds per
# op (before one is measured, the guess below, a slow machine's figure so the limit holds)
RESERVE_FIXED_S = 2.0
RESERVE_REPLAYS = 2
REPLAY_S_PER_OP_GUESS = 8e-4
# and, where the profile has an op-time spread, the expected step time
# (check.replay.expected_step_time): a Monte Carlo replay whose own sampling spread must sit
# well under the points its overhead is read at: at least this many steps (a few refresh
# cycles read a slow draw as the plan's step); a drawn op instance costs about this many
# seconds before the run has measured its own (a slow machine's figure)
EXPECTED_STEP_MIN_STEPS = 1000
SPREAD_S_PER_OP_GUESS = 2e-5


def least_expected_replay_ops(k: int, ops_per_cycle: int) -> int:
    """The drawn op instances of the expected step time's least replay: whole refresh cycles
    of EXPECTED_STEP_MIN_STEPS steps or more, within check.replay's bound on instances."""
    return spread_replay_cycles(k, ops_per_cycle, EXPECTED_STEP_MIN_STEPS, EXPECTED_STEP_MAX_OPS) * ops_per_cycle


class Budget:
    def __init__(self, seconds: float | None = None, started: float | None = None):
        self.t0 = time.monotonic() if started is None else started  # time.monotonic() of the start
        self.deadline = None if seconds is None else self.t0 + seconds
        self.reserve = 0.0  # seconds kept for what follows the search (set from the plan's size)
        self.replay_s_per_op: float | None = None  # measured on this run's first replay (the load counts)
        self.spread_s_per_op: float | None = None  # a drawn op instance of the expected step's replay, measured
        self.seconds: dict[str, float] = defaultdict(float)

    def left(self) -> float:
        """Seconds left for searching (infinite without a limit)."""
        if self.deadline is None:
            return float("inf")
        return self.deadline - time.monotonic() - self.reserve

    def deadline_for_search(self) -> float | None:
        """The time.monotonic() by which a search must end (None: no limit)."""
        return None if self.deadline is None else self.deadline - self.reserve

    def cap(self, share: float) -> float:
        """A CP-SAT limit: the share, or what is left if less (0 when nothing is)."""
        left = self.left()
        return share if left >= share else (left if left >= MIN_SOLVE_S else 0.0)

    @contextmanager
    def share(self, fraction: float):
        """Within it, the deadline is `fraction` of the time left from now (one of several
        plannings that share the limit: a planning that cannot prove its optimum would
        otherwise spend the others' time); what it leaves unused goes to the next."""
        saved = self.deadline
        if saved is not None:
            self.deadline = min(saved, time.monotonic() + self.reserve + fraction * max(0.0, self.left()))
        try:
            yield
        finally:
            self.deadline = saved

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    @contextmanager
    def stage(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t

    def report(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.seconds.items()}

