"""The dependency rules of the plan semantics, read from a plan alone (DESIGN.md).

`PlanLayout(plan)`: the plan's placement and sizes as queries (pfcompile.formats.plan.Layout
plus the plan's stage count, cycle length, K-FAC layers). `op_dependencies(layout, rank,
cycle, step, op)`: what one listed op waits for. The replay (pfcompile.check.replay)
executes plans with these rules, and the graph drawing shows them. They are written from
the op vocabulary independently of the task graph the planners place
(pfcompile.graph.taskgraph): tests/test_deps_agree.py checks that the two agree on every
family, so the replay stays an independent check of the planners' output.

A task is one op on one rank in one step of the refresh cycle
(pfcompile.formats.plan.Task; here `step` is the step that lists it). Its dependencies:
a producer in the same step, floating K-FAC work (curvature, factor sync, inversion,
broadcast) wherever in the cycle it runs, curvature of step 0's micro-batches, and a
stage's forward after its previous step's update. Across ranks they are the messages; the
members of one collective are linked by `collective_peers` instead.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterator

from pfcompile.formats.ops import (FACTORS, FLOATING_KINDS, Op, backward_kinds, input_grad_kind, stage_served,
                                   weight_grad_kind)
from pfcompile.formats.plan import Layout, Plan, Task

# An instance of a task in a run of several cycles: (cycle, step | None for floating work, rank, op)
Key = tuple


class PlanLayout(Layout):
    """The plan's placement, sizes and K-FAC layers, as queries."""

    def __init__(self, plan: Plan):
        super().__init__(plan.placement, plan.micro_batch_replica)
        c = plan.config
        self.S = plan.num_stages
        self.R = int(c["replicas"])
        self.N = int(c["micro_batches"])
        self.k = plan.refresh_steps
        self.W = plan.world_size
        self.kfac = bool(c["kfac"])
        schedule = str(c.get("schedule", ""))
        self.backward = backward_kinds(schedule)  # ("bwd",) or split: ("bwd_input", "bwd_weight")
        self.B = input_grad_kind(schedule)  # makes the input gradient (send_grad waits for it)
        self.Wk = weight_grad_kind(schedule)  # completes the weight gradients of a micro-batch
        self.mbr = self.micro_batch_replica
        self.layer_stage = plan.layer_stage
        self.stage_layers = [[l for l, s in enumerate(self.layer_stage) if s == st] for st in range(self.S)]
        # split preconditioning: the replica that preconditions each layer (None: every one)
        owner = c.get("precond_owner") if c.get("precond") == "split" and self.kfac else None
        self.precond_owner: list[int | None] | None = list(owner) if owner is not None else None

    def split_stage(self, stage: int) -> bool:
        """Whether the stage's gradients go rs_grad -> own preconditioning -> ag_grad."""
        return self.precond_owner is not None and any(self.precond_owner[l] is not None
                                                       for l in self.stage_layers[stage])

    def preconditions(self, rank: int, stage: int) -> list[int]:
        """The K-FAC layers of `stage` that `rank` preconditions each step."""
        if not self.kfac:
            return []
        r = self.held[rank][stage]
        return [l for l in self.stage_layers[stage]
                if self.precond_owner is None or self.precond_owner[l] in (None, r)]

    def group(self, stage: int) -> list[int]:
        """The ranks of a stage's collectives, ascending."""
        return sorted(self.replica_ranks(stage))

    def stage_of(self, op: Op) -> int:
        """The stage whose rank runs the op (a receive runs on the consumer's rank)."""
        s = stage_served(op)
        return s if s is not None else self.layer_stage[op.layer]


def op_dependencies(L: PlanLayout, q: int, c: int, t: int, op: Op) -> tuple[list[Key], list[Key]]:
    """(local, remote) dependencies of `op` listed at cycle c, step t on rank q, as instance
    keys (cycle, step | None, rank, op); a remote one is a message's send, whose transfer
    time the receive waits for on top."""
    k, S = op.kind, L.S
    s = L.stage_of(op)
    r = L.held[q][s]
    mine = L.mbs_of(r)
    here = lambda o, step=t: (c, step, q, o)  # noqa: E731
    local: list[Key] = []
    remote: list[Key] = []
    if k == "fwd":
        if s > 0:
            local.append(here(Op("fwd", stage=s - 1, mb=op.mb)) if L.rank[(s - 1, r)] == q
                         else here(Op("recv_act", stage=s - 1, mb=op.mb, peer=L.rank[(s - 1, r)])))
        if t > 0:
            local.append(here(Op("step", stage=s), t - 1))
        elif c > 0:
            local.append((c - 1, L.k - 1, q, Op("step", stage=s)))
    elif k in ("bwd", "bwd_input"):
        local.append(here(Op("fwd", stage=s, mb=op.mb)))
        if s + 1 < S:
            local.append(here(Op(k, stage=s + 1, mb=op.mb)) if L.rank[(s + 1, r)] == q
                         else here(Op("recv_grad", stage=s + 1, mb=op.mb, peer=L.rank[(s + 1, r)])))
    elif k == "bwd_weight":
        local.append(here(Op("bwd_input", stage=s, mb=op.mb)))
    elif k == "send_act":
        local.append(here(Op("fwd", stage=s, mb=op.mb)))
    elif k == "send_grad":
        local.append(here(Op(L.B, stage=s, mb=op.mb)))
    elif k in ("recv_act", "recv_grad"):
        send = Op("send_" + k[5:], stage=op.stage, mb=op.mb, peer=q)
        remote.append((c, t, op.peer, send))
    elif k == "curv_a":
        local.append((c, 0, q, Op("fwd", stage=s, mb=op.mb)))
    elif k == "curv_b":  # split backward: with or after W, which shares its output gradient
        local.append((c, 0, q, Op(L.Wk, stage=s, mb=op.mb)))
    elif k == "sync_curv":
        kind = "curv_a" if op.factor == "A" else "curv_b"
        local += [(c, None, q, Op(kind, layer=op.layer, mb=m)) for m in mine]
    elif k == "inv":
        if L.R > 1:
            local += [(c, None, q, Op("sync_curv", layer=op.layer, factor=f)) for f in FACTORS]
        else:
            local += [(c, None, q, Op(kind, layer=op.layer, mb=m)) for m in mine for kind in ("curv_a", "curv_b")]
    elif k == "bcast_inv":
        if op.peer == q:
            local.append((c, None, q, Op("inv", layer=op.layer, factor=op.factor)))
    elif k in ("sync_grad", "rs_grad"):
        local += [here(Op(L.Wk, stage=s, mb=m)) for m in mine]
    elif k == "ag_grad":  # after this replica's own preconditioning
        local.append(here(Op("rs_grad", stage=s)))
        local += [here(Op("precond", layer=l)) for l in L.stage_layers[s] if L.precond_owner[l] == r]
    elif k == "precond":
        if L.split_stage(s):
            local.append(here(Op("rs_grad", stage=s)))
        else:
            local += [here(Op("sync_grad", stage=s))] if L.R > 1 else [here(Op(L.Wk, stage=s, mb=m)) for m in mine]
    elif k == "step":
        if L.split_stage(s):
            local.append(here(Op("ag_grad", stage=s)))
            local += [here(Op("precond", layer=l)) for l in L.stage_layers[s] if L.precond_owner[l] is None]
        elif L.kfac and L.stage_layers[s]:
            local += [here(Op("precond", layer=l)) for l in L.stage_layers[s]]
        else:
            local += [here(Op("sync_grad", stage=s))] if L.R > 1 else [here(Op(L.Wk, stage=s, mb=m)) for m in mine]
    return local, remote


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
