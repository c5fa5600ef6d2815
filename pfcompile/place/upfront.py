"""Bounds that cost nothing, checked before the task graph is built: a request no plan can
satisfy is refused in well under a second instead of after minutes of planning.

- memory (the greedy and `none`, which place without a memory model): a rank always holds
  its stages' parameters, gradients, optimizer and K-FAC state (Costs.resident_bytes) and,
  at some moment, one micro-batch's activations of each stage it runs; above the limit,
  no order of its ops fits. (CP-SAT names the smallest feasible limit itself, from its
  task graph.)
- the greedy's refresh cycle: its bubbles are those of the family's step with the K-FAC
  work left out (`family_step`: the step's ops in the family's order, timed as soon as
  possible, in plain Python over the ops of one step, without the task graph), and each
  rank's curvature work alone (a part of its refresh work) must fit them over the cycle:
  k >= work / bubble. Over MAX_REFRESH_STEPS, or over MAX_TASKS ops for the cycle, the
  greedy would refuse after building its graph; here it is refused first.

`family_step` is the greedy's own step timing (greedy.time_fixed_order over the task
graph's edges) without the graph: the same ops, durations and message lags, a receive
after its send's end plus the lag, a collective's members starting together.
tests/test_bounds.py checks the two agree on every family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pfcompile.formats.errors import InputError
from pfcompile.formats.limits import MAX_REFRESH_STEPS, MAX_TASKS
from pfcompile.formats.ops import Op
from pfcompile.formats.profile import Profile
from pfcompile.graph.costs import Costs, costs_of
from pfcompile.graph.schedules import PipelineConfig, canonical_orders


class CycleTooLong(InputError):
    """The bubbles would need a refresh cycle over the limit to hold the optimizer's refresh work."""

    def __init__(self, k: int, rank: int, work_ms: float, bubble_ms: float):
        where = f"rank {rank}: {work_ms:.1f} ms of the refresh's work, {bubble_ms:.2f} ms of bubble per step"
        self.short = f"{where}; bubbles alone need a refresh cycle of at least {k} steps"
        super().__init__("--micro-batches", None, f"the optimizer's refresh work needs a refresh cycle of at least {k} steps to "
                         f"fit the bubbles ({where}), over the limit of {MAX_REFRESH_STEPS}: fewer micro-batches or "
                         "more stages give more bubble per unit of work; --method cpsat stretches the step to hold "
                         "it, --method none appends it to every step")


@dataclass
class FamilyStep:
    """The family's step without the refresh work: its length and each rank's busy time."""
    costs: Costs
    orders: dict[int, list[Op]]
    step_ms: float
    busy_ms: dict[int, float]

    @property
    def bubble_ms(self) -> dict[int, float]:
        return {q: self.step_ms - b for q, b in self.busy_ms.items()}


def family_step(profile: Profile, cfg: PipelineConfig) -> FamilyStep:
    """Each rank runs its ops of one step in the family's order, each as soon as the op
    before it on the rank has ended and, for a receive, its send has ended plus the
    message's lag; a collective starts when every member is at it."""
    costs = costs_of(profile, cfg)
    orders = canonical_orders(cfg, costs.stage_layers, costs.precond_owner)
    dur = {q: [costs.duration(op) for op in ops] for q, ops in orders.items()}
    pos = dict.fromkeys(orders, 0)
    clock = dict.fromkeys(orders, 0.0)
    sent: dict[tuple, float] = {}  # message key -> when its receive may start
    waiting: dict[Op, dict[int, float]] = {}  # collective -> member rank -> ready time
    left = sum(len(ops) for ops in orders.values())
    while left:
        moved = False
        for q, ops in orders.items():
            while pos[q] < len(ops):
                op, d = ops[pos[q]], dur[q][pos[q]]
                if op.is_p2p and op.kind.startswith("recv_"):
                    ready = sent.get(op.message_key())
                    if ready is None:
                        break
                    start = max(clock[q], ready)
                elif op.is_collective:
                    members = waiting.setdefault(op, {})
                    members[q] = clock[q]
                    group = cfg.replica_ranks(op.stage)
                    if len(members) < len(group):
                        break
                    start = max(members.values())
                    for m in group:  # all start together; the others move past it now
                        clock[m] = start + d
                        if m != q:
                            pos[m] += 1
                    del waiting[op]
                    pos[q] += 1
                    left -= len(group)
                    moved = True
                    continue
                else:
                    start = clock[q]
                clock[q] = start + d
                if op.is_p2p:  # a send: its receive may start at its end plus the lag
                    sent[op.message_key()] = clock[q] + costs.message_ms(op, q)
                pos[q] += 1
                left -= 1
                moved = True
        if not moved:  # the family's order cannot deadlock; a bug here must not hang the command
            raise AssertionError("family_step: the family's order deadlocks")
    step_ms = max(clock.values(), default=0.0) or 1.0  # all-zero costs: any unit will do (as the greedy)
    return FamilyStep(costs, orders, step_ms, {q: sum(d) for q, d in dur.items()})


def order_peak_bytes(step: FamilyStep, cfg: PipelineConfig) -> dict[int, int]:
    """Per rank, what it holds at most running its ops of a step without refresh work in the
    family's order: its resident state and the activations (and zero-bubble weight-pass
    buffers) alive at once. A step of the cycle that refreshes keeps more, so no plan that
    keeps the family's order fits a limit below this."""
    peak = {}
    for q, ops in step.orders.items():
        held = now = 0
        alive: dict[tuple, int] = {}
        for op in ops:
            for key, n in step.costs.allocates(op, refresh=False):
                alive[key] = n
                now += n
            held = max(held, now)
            for key in step.costs.frees(op):
                now -= alive.pop(key, 0)
        peak[q] = step.costs.resident_bytes(cfg.stages_of(q)) + held
    return peak


def curvature_ms(costs: Costs, cfg: PipelineConfig) -> dict[int, float]:
    """Per rank, the micro-batch work of one refresh (K-FAC's curv_a and curv_b of every layer
    of its stages for every micro-batch of its replica): part of its refresh work, the part
    no division between replicas moves (none for Shampoo and Muon)."""
    kinds = [d.kind for d in cfg.optimizer_spec.micro_batch_ops]
    replica_of = cfg.micro_batch_replica()
    count = {r: replica_of.count(r) for r in range(cfg.replicas)}
    work: dict[int, float] = {}
    for s in range(cfg.num_stages):
        for r in range(cfg.replicas):
            q = cfg.rank_of(s, r)
            for l in costs.stage_layers[s]:
                per_mb = sum(costs.duration(Op(kind, layer=l, mb=0)) for kind in kinds)
                work[q] = work.get(q, 0.0) + count[r] * per_mb
    return work


def check_memory(costs: Costs, cfg: PipelineConfig) -> None:
    """Refuse a memory limit below what a rank holds whatever the order of its ops."""
    limit = cfg.memory_limit_bytes
    if limit is None:
        return
    for q in range(cfg.world_size):
        held = cfg.stages_of(q)
        need = costs.resident_bytes(held) + max(costs.act_bytes(s) for s, _ in held)
        if need > limit:
            raise InputError("--memory-limit", None, f"rank {q} needs at least {need} bytes whatever its order "
                             f"({costs.resident_bytes(held)} always held: parameters, gradients, the optimizer's "
                             f"state of its stages; and one micro-batch's activations), over the limit of {limit}")


def check_cycle(step: FamilyStep, cfg: PipelineConfig) -> int:
    """The greedy's refresh cycle k >= curvature work / bubble per step, on every rank;
    refused over MAX_REFRESH_STEPS (CycleTooLong, as the greedy would) or over MAX_TASKS
    ops for the cycle. Returns the bound (1 without micro-batch work: K-FAC's alone has it)."""
    if not cfg.optimizer_spec.micro_batch_ops:
        return 1
    work, bubble = curvature_ms(step.costs, cfg), step.bubble_ms
    need = {q: math.ceil(w / bubble[q] - 1e-9) for q, w in work.items() if w > 0 and bubble.get(q, 0.0) > 1e-9}
    if not need:
        return 1
    q = max(need, key=need.get)
    k = need[q]
    if k > MAX_REFRESH_STEPS:
        raise CycleTooLong(k, q, work[q], bubble[q])
    per_step = sum(len(ops) for ops in step.orders.values())
    if k * per_step > MAX_TASKS:
        raise InputError("--micro-batches", None, f"a refresh cycle of at least {k} steps of {per_step} ops is over "
                         f"the limit of {MAX_TASKS} tasks (the greedy's state would not fit in memory; see "
                         "pfcompile/formats/limits.py)")
    return k


def check_before_planning(profile: Profile, cfg: PipelineConfig, method: str) -> None:
    """The bounds of the module docstring: memory for the greedy and `none`, the cycle for
    the greedy (CP-SAT stretches the step instead; `none` appends the work to every step)."""
    cycle = method == "greedy" and cfg.optimizer_spec.refreshes and cfg.cluster is None  # (on a cluster the ranks' places change the lags)
    if method == "cpsat" or (cfg.memory_limit_bytes is None and not cycle):
        return
    if cycle:
        step = family_step(profile, cfg)
        check_memory(step.costs, cfg)
        check_cycle(step, cfg)
    else:
        check_memory(costs_of(profile, cfg), cfg)
