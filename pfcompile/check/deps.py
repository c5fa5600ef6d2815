"""The task graph of a plan, rebuilt from the plan alone, for drawing it.

A task is one op on one rank in one step of the refresh cycle. Its dependencies are the
replay's (pfcompile.check.replay, which derives them from the plan's placement and the op
vocabulary), so the picture shows exactly what the simulator and the runtime wait for:
a producer in the same step, floating K-FAC work (curvature, factor sync, inversion,
broadcast) wherever in the cycle it runs, curvature of step 0's micro-batches, and a
stage's forward after its previous step's update. Producers in a previous cycle give no
edge. Across ranks the edges are the messages; the members of one collective are linked
by `collective_peers` instead.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

from pfcompile.formats.ops import Op
from pfcompile.formats.plan import Plan
from pfcompile.check.replay import FLOATING as FLOATING_KINDS
from pfcompile.check.replay import _deps as _replay_deps
from pfcompile.check.replay import _Layout


@dataclass(frozen=True)
class Task:
    rank: int
    step: int
    op: Op
    start: float
    end: float

    @property
    def key(self) -> tuple[int, int, Op]:
        return (self.rank, self.step, self.op)


def tasks_of(plan: Plan) -> list[Task]:
    return [Task(q, t, p.op, p.start, p.end)
            for q, steps in enumerate(plan.ranks) for t, ops in enumerate(steps) for p in ops]


def dependencies(plan: Plan, tasks: list[Task] | None = None) -> Iterator[tuple[Task, Task]]:
    """(producer, consumer) pairs over the tasks of one refresh cycle."""
    tasks = tasks_of(plan) if tasks is None else tasks
    layout = _Layout(plan)
    at: dict[tuple, Task] = {}
    for task in tasks:
        at[(task.step, task.rank, task.op)] = task
        if task.op.kind in FLOATING_KINDS:  # the replay names floating work without a step
            at[(None, task.rank, task.op)] = task
    for task in tasks:
        local, remote = _replay_deps(layout, task.rank, 0, task.step, task.op)
        for cycle, step, rank, op in local + remote:
            producer = at.get((step, rank, op)) if cycle == 0 else None  # earlier cycles: no edge
            if producer is not None and producer.key != task.key:
                yield producer, task


def collective_peers(plan: Plan, tasks: list[Task]) -> Iterator[tuple[Task, Task]]:
    """Pairs of tasks that are the same collective on neighbouring members of its group."""
    members: dict[tuple[int, Op], list[Task]] = defaultdict(list)
    for task in tasks:
        if task.op.is_collective:
            # floating collectives (factor sync, broadcast) may sit in different steps on
            # different members: they are still one collective of the cycle
            step = None if task.op.kind in FLOATING_KINDS else task.step
            members[(step, task.op)].append(task)
    for group in members.values():
        group.sort(key=lambda t: t.rank)
        yield from zip(group, group[1:])
