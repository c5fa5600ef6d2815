"""The dependency rules of the plan semantics, read from a plan alone (docs/design.md §4.1), as the
task graph of a plan. The rules are defined in pfcompile.formats.rules (the contract
package: the runtime's verifier applies them too) and re-exported here.

`PlanLayout(plan)`: the plan's placement and sizes as queries (pfcompile.formats.plan.Layout
plus the plan's stage count, cycle length, K-FAC layers). `op_dependencies(layout, rank,
cycle, step, op)`: what one listed op waits for. The replay (pfcompile.check.replay)
executes plans with these rules, and the graph drawing shows them. The pipeline's rules are
written from the op vocabulary apart from the task graph the planners place
(pfcompile.graph.taskgraph); an optimizer op's come, in both, from its declaration
(pfcompile.formats.dataflow). tests/test_deps_agree.py checks that the two agree on every
family.

A task is one op on one rank in one step of the refresh cycle
(pfcompile.formats.plan.Task; here `step` is the step that lists it). Its dependencies:
a producer in the same step, floating K-FAC work (curvature, factor sync, inversion,
broadcast) wherever in the cycle it runs, curvature of step 0's micro-batches, and a
stage's forward after its previous step's update. Across ranks they are the messages; the
members of one collective are linked by `collective_peers` instead.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from pfcompile.formats.ops import FLOATING_KINDS, Op
from pfcompile.formats.plan import Plan, Task

# The rules themselves live in the contract package (the runtime's verifier applies them too).
from pfcompile.formats.rules import Key, PlanLayout, op_dependencies  # noqa: F401  (re-exported)

# --- the plan's tasks and their edges (one cycle) ----------------------------------------------

def tasks_of(plan: Plan) -> list[Task]:
    """Every listed op as a Task (step: the step that lists it), rank by rank, in list order."""
    return [Task(t, q, p.op) for q, steps in enumerate(plan.ranks) for t, ops in enumerate(steps) for p in ops]


def planned_times(plan: Plan) -> dict[Task, tuple[float, float]]:
    """The plan's (start, end) of every listed task."""
    return {Task(t, q, p.op): (p.start, p.end)
            for q, steps in enumerate(plan.ranks) for t, ops in enumerate(steps) for p in ops}


def dependencies(plan: Plan, tasks: list[Task] | None = None) -> Iterator[tuple[Task, Task]]:
    """(producer, consumer) pairs over the tasks of one refresh cycle (producers in an
    earlier cycle give no edge)."""
    tasks = tasks_of(plan) if tasks is None else tasks
    layout = PlanLayout(plan)
    at: dict[tuple, Task] = {}
    for task in tasks:
        at[(task.step, task.rank, task.op)] = task
        if task.op.kind in FLOATING_KINDS:  # the rules name floating work without a step
            at[(None, task.rank, task.op)] = task
    for task in tasks:
        local, remote = op_dependencies(layout, task.rank, 0, task.step, task.op)
        for cycle, step, rank, op in local + remote:
            producer = at.get((step, rank, op)) if cycle == 0 else None
            if producer is not None and producer != task:
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
