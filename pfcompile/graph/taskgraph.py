"""The task graph of one refresh cycle: what every planner (greedy, CP-SAT) places in time.

`build_task_graph(profile, cfg)` -> `TaskGraph`, with

- `g`: a networkx DiGraph. Nodes are `Task(step, rank, op)` (a NamedTuple):
    step   int, the step of the cycle (0..k-1) for pipeline and per-step tasks (fwd, bwd,
           send/recv, sync_grad, precond, step); None for the FLOATING K-FAC tasks
           (curv_a, curv_b, sync_curv, inv, bcast_inv), which a planner may put in any
           step of the cycle (curvature is of step 0's micro-batches; it must finish
           within the cycle: the new inverses come into force at the next cycle's start).
    rank   the rank that executes it; op the pfcompile.formats.ops.Op.
  Node attributes: op, rank, step, duration (ms), stream ("compute" | "p2p" | "collective"),
  floating (bool). A rank executes ALL its tasks one at a time, in one op list: whatever
  the stream, tasks of a rank must not overlap (sends and receives take 0 ms; a receive
  just waits for its message).
  Edges u -> v: v may start only when u has ended, plus the edge attribute `lag` (ms):
  the message's transfer time on send -> recv edges, 0 elsewhere. Edges implied by the
  shared plan semantics: fwd(s,m) -> send_act -> recv_act -> fwd(s+1,m) (direct edge if
  both stages are on one rank); last stage fwd -> bwd; bwd(s+1,m) -> send_grad -> recv_grad
  -> bwd(s,m); fwd(s,m) -> bwd(s,m); fwd(s,m)@0 -> curv_a(l,m); bwd(s,m)@0 -> curv_b(l,m);
  curv of the factor (all replicas) -> sync_curv members; sync_curv (A and B) or the
  curv ops (R = 1) -> inv (BOTH factors, for the pi-corrected damping); inv -> bcast_inv
  members; bwd of the stage (all replicas) -> sync_grad members; sync_grad (or the
  replica's bwd when R = 1) -> precond; precond (or sync_grad / bwd) -> step(s);
  step(s)@t -> fwd(s, m)@t+1. The optimizer ops' edges are what their declarations' reads
  and writes give (pfcompile.formats.dataflow.producers, the rules' too).
- `collectives`: {(step, op): [member tasks]}: blocking rendezvous, so all members start
  at the same time (sync_curv, bcast_inv have step None).
- `buffers`: [Buffer(rank, nbytes, alloc, free, key)]: allocated at the start of `alloc`,
  freed at the end of `free` (activations fwd -> bwd; K-FAC kept input fwd@0 -> curv_a;
  kept output gradient bwd@0 -> curv_b; split backward: activations fwd -> bwd_weight,
  output gradients bwd_input -> bwd_weight, kept_b bwd_input@0 -> curv_b). A buffer with
  `at_end` is allocated at the END of `alloc` and held until the later of the two ends
  (nothing held if `free` ends first): a split backward's K-FAC kept input, inside the
  activations until W, bwd_weight@0 -> curv_a (pfcompile.graph.costs, memory model).
  `resident_bytes[rank]`: always held.
- `canonical[rank][step]`: the schedule family's order of the per-step tasks of the rank
  (fwd/bwd/send/recv, then sync_grad, precond, step): the bubble baseline's op list.
- `inv_candidates[(layer, factor)]`: the ranks that could invert it (one per replica of
  the layer's stage); `inverters[(layer, factor)]`: the ranks that do in this graph
  (policy `cfg.inversion`, or the `inverters=` argument: a solver that chooses rebuilds
  the graph with its choice). With one inverter and R > 1 a bcast_inv follows.

All durations and memory come from pfcompile.graph.costs.Costs (`tg.costs`), the replay's too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace

import networkx as nx

from pfcompile.formats.dataflow import GRADIENT, producers
from pfcompile.formats.ops import FLOATING_KINDS, OP_KINDS, Op, input_grad_kind, stream_of, weight_grad_kind
from pfcompile.formats.optimizers import PASS_FWD, PASS_WGRAD
from pfcompile.formats.plan import Task
from pfcompile.formats.profile import Profile
from pfcompile.graph.costs import Costs, costs_of, replica_share
from pfcompile.graph.schedules import PipelineConfig, canonical_orders


@dataclass
class Buffer:
    rank: int
    nbytes: int
    alloc: Task
    free: Task
    key: tuple
    # allocated at the end of `alloc` instead of its start, and held over
    # [end(alloc), max(end(alloc), end(free))]: the tensor lives inside another buffer until
    # `alloc` ends (costs.Costs.allocates_at_end)
    at_end: bool = False


@dataclass
class TaskGraph:
    cfg: PipelineConfig
    costs: Costs
    partition: list[list[str]]
    g: nx.DiGraph = field(default_factory=nx.DiGraph)
    collectives: dict[tuple, list[Task]] = field(default_factory=dict)
    buffers: list[Buffer] = field(default_factory=list)
    resident_bytes: dict[int, int] = field(default_factory=dict)
    canonical: dict[int, list[list[Task]]] = field(default_factory=dict)
    inv_candidates: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    inverters: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    precond_owner: list[int | None] | None = None  # split preconditioning: replica per layer
    interned: _Interned = field(default_factory=lambda: _Interned(), repr=False, compare=False)

    # --- views ---------------------------------------------------------------------------------
    @property
    def refresh_steps(self) -> int:
        return self.cfg.refresh_steps

    @property
    def ranks(self) -> list[int]:
        return list(range(self.cfg.world_size))

    @property
    def layer_stage(self) -> list[int]:
        return self.costs.layer_stage

    def duration(self, t: Task) -> float:
        return self.g.nodes[t]["duration"]

    def tasks_of(self, rank: int) -> list[Task]:
        return [t for t in self.g.nodes if t.rank == rank]

    def floating_tasks(self, rank: int | None = None) -> list[Task]:
        return [t for t in self.g.nodes if t.step is None and (rank is None or t.rank == rank)]

    def unit_graph(self, tasks) -> nx.DiGraph:
        """The graph among `tasks` with each collective's members merged into one node, a
        tuple of tasks (others are 1-tuples): a planner that places a unit at once keeps
        every member of a collective together and in one order on all ranks."""
        tasks = set(tasks)
        unit_of = {t: (t,) for t in tasks}
        for group in self.collectives.values():
            inside = tuple(t for t in group if t in tasks)
            for t in inside:
                unit_of[t] = inside
        units = nx.DiGraph()
        units.add_nodes_from(set(unit_of.values()))
        units.add_edges_from((unit_of[u], unit_of[v]) for u, v in self.g.subgraph(tasks).edges
                             if unit_of[u] != unit_of[v])
        return units

    def add_task(self, t: Task) -> Task:
        self.g.add_node(t, op=t.op, rank=t.rank, step=t.step, duration=self.costs.duration(t.op, t.step),
                        stream=stream_of(t.op.kind), floating=t.step is None)
        return t

    def add_edge(self, u: Task, v: Task, lag: float = 0.0) -> None:
        """An edge between tasks added before (checked once the graph is built: `_check_nodes`)."""
        self.g.add_edge(u, v, lag=lag)


class _Interned:
    """Op(...) for a graph build, one object per distinct op: the builder asks for the same
    op many times (a task, then each edge to it), and equal keys that are the same object
    compare by identity (no field-by-field __eq__) and are validated once."""

    def __init__(self):
        self.ops: dict[tuple, Op] = {}

    def op(self, kind: str, stage=None, mb=None, layer=None, factor=None, peer=None) -> Op:
        key = (kind, stage, mb, layer, factor, peer)
        o = self.ops.get(key)
        if o is None:
            o = self.ops[key] = Op(kind, stage=stage, mb=mb, layer=layer, factor=factor, peer=peer)
        return o

    def same(self, op: Op) -> Op:
        """The interned op equal to `op` (op itself the first time)."""
        return self.ops.setdefault((op.kind, op.stage, op.mb, op.layer, op.factor, op.peer), op)


def _check_nodes(tg: TaskGraph) -> None:
    """Every node was added as a task: an edge to a task never added would have made a bare node."""
    bare = [t for t, data in tg.g.nodes(data=True) if "op" not in data]
    assert not bare, f"edges to tasks never added: {bare[:3]}"


class TaskGraphs:
    """The task graphs one planning run has built from one profile, by configuration: the run
    asks for the baseline's, the greedy's and each k's graph from several places, and a graph
    of thousands of tasks is worth building once. Its graphs are read-only; the profile must
    not change while the run lasts. Keeps the `keep` most recently used graphs."""

    def __init__(self, profile: Profile, keep: int = 6):
        self.profile, self.keep = profile, keep
        self._built: OrderedDict[tuple, TaskGraph] = OrderedDict()

    def get(self, cfg: PipelineConfig, inverters: dict[tuple[int, str], list[int]] | None = None) -> TaskGraph:
        key = (repr(cfg), None if inverters is None else tuple(sorted((k, tuple(v)) for k, v in inverters.items())))
        tg = self._built.get(key)
        if tg is None:
            tg = self._built[key] = _build(self.profile, replace(cfg), inverters)
            while len(self._built) > self.keep:
                self._built.popitem(last=False)
        self._built.move_to_end(key)
        return tg


def build_task_graph(profile: Profile, cfg: PipelineConfig,
                     inverters: dict[tuple[int, str], list[int]] | None = None,
                     graphs: TaskGraphs | None = None) -> TaskGraph:
    """The task graph of `cfg` (module docstring); from `graphs` when given and built there
    before (its profile must be `profile`)."""
    if graphs is None:
        return _build(profile, cfg, inverters)
    if graphs.profile is not profile:
        raise ValueError("a planning run's graphs are of one profile")
    return graphs.get(cfg, inverters)


def _build(profile: Profile, cfg: PipelineConfig, inverters: dict[tuple[int, str], list[int]] | None) -> TaskGraph:
    costs = costs_of(profile, cfg)
    tg = TaskGraph(cfg=cfg, costs=costs, partition=costs.partition)
    tg.precond_owner = costs.precond_owner
    orders = canonical_orders(cfg, costs.stage_layers, tg.precond_owner)
    for k in range(cfg.refresh_steps):
        _add_step(tg, k, orders)
    if cfg.optimizer_spec.refreshes:
        _add_refresh(tg, inverters)
    for q in tg.ranks:
        tg.resident_bytes[q] = costs.resident_bytes(cfg.stages_of(q))
    _check_nodes(tg)
    return tg


def _add_step(tg: TaskGraph, k: int, orders: dict[int, list[Op]]) -> None:
    """The per-step tasks of step k, their edges, and the activation buffers."""
    cfg, costs = tg.cfg, tg.costs
    S, R = cfg.num_stages, cfg.replicas
    rep = cfg.micro_batch_replica()
    O = tg.interned.op
    for q, ops in orders.items():
        tg.canonical.setdefault(q, []).append([tg.add_task(Task(k, q, tg.interned.same(op))) for op in ops])

    def T(op: Op, stage: int, replica: int) -> Task:
        return Task(k, cfg.rank_of(stage, replica), op)

    # split backward: bwd_input (B) makes the input gradient, bwd_weight (W) the weights'
    B = input_grad_kind(cfg.schedule)
    for m in range(cfg.micro_batches):
        r = rep[m]
        for s in range(S):
            fwd, bwd = T(O("fwd", stage=s, mb=m), s, r), T(O(B, stage=s, mb=m), s, r)
            tg.add_edge(fwd, bwd)
            done = bwd
            if cfg.split_backward:
                # W needs B's output gradients and keeps them and the activations until it ends
                done = T(O("bwd_weight", stage=s, mb=m), s, r)
                tg.add_edge(bwd, done)
                (wgrad,) = [n for key, n in costs.allocates(bwd.op, refresh=(k == 0)) if key[0] == "wgrad"]
                tg.buffers.append(Buffer(bwd.rank, wgrad, bwd, done, ("wgrad", s, m)))
            tg.buffers.append(Buffer(fwd.rank, costs.act_bytes(s), fwd, done, ("act", s, m)))
            if s + 1 < S:
                nxt_f, nxt_b = T(O("fwd", stage=s + 1, mb=m), s + 1, r), T(O(B, stage=s + 1, mb=m), s + 1, r)
                if nxt_f.rank == fwd.rank:
                    tg.add_edge(fwd, nxt_f)
                    tg.add_edge(nxt_b, bwd)
                else:
                    for kind, src, dst, stage, before, after in (
                            ("act", fwd, nxt_f, s, fwd, nxt_f), ("grad", nxt_b, bwd, s + 1, nxt_b, bwd)):
                        send = Task(k, src.rank, O(f"send_{kind}", stage=stage, mb=m, peer=dst.rank))
                        recv = Task(k, dst.rank, O(f"recv_{kind}", stage=stage, mb=m, peer=src.rank))
                        tg.add_edge(before, send)
                        tg.add_edge(send, recv, lag=costs.message_ms(send.op, send.rank))
                        tg.add_edge(recv, after)
            if k > 0:
                tg.add_edge(Task(k - 1, fwd.rank, O("step", stage=s)), fwd)

    W = weight_grad_kind(cfg.schedule)  # after it, a micro-batch's weight gradients are in
    for s in range(S):
        bwds = [T(O(W, stage=s, mb=m), s, rep[m]) for m in range(cfg.micro_batches)]
        for r in range(R):
            q = cfg.rank_of(s, r)
            before_precond = [b for b in bwds if b.rank == q]
            step = Task(k, q, O("step", stage=s))
            owner = tg.precond_owner
            if owner is not None and any(owner[l] is not None for l in costs.stage_layers[s]):
                _add_split_precond(tg, k, s, r, q, bwds, step)
                continue
            if R > 1:
                sync = Task(k, q, O("sync_grad", stage=s))
                for b in bwds:
                    tg.add_edge(b, sync)
                tg.collectives.setdefault((k, O("sync_grad", stage=s)), []).append(sync)
                before_precond = [sync]
            last = [_add_layer_work(tg, k, q, l, before_precond) for l in costs.stage_layers[s]] \
                if cfg.optimizer_work else []
            for b in last or before_precond:
                tg.add_edge(b, step)


def _add_split_precond(tg: TaskGraph, k: int, s: int, r: int, q: int, bwds: list[Task], step: Task) -> None:
    """Split preconditioning (PipeFisher's pipeline.py): the stage's gradients are
    reduce-scattered (rs_grad), each replica preconditions the layers it owns (and every
    replica the unowned ones), the preconditioned gradients are all-gathered (ag_grad),
    then the update. Each replica does 1/R of the owned layers' preconditioning."""
    owner = tg.precond_owner
    O = tg.interned.op
    rs = Task(k, q, O("rs_grad", stage=s))
    ag = Task(k, q, O("ag_grad", stage=s))
    for b in bwds:
        tg.add_edge(b, rs)
    tg.collectives.setdefault((k, rs.op), []).append(rs)
    tg.collectives.setdefault((k, ag.op), []).append(ag)
    for l in tg.costs.stage_layers[s]:
        if owner[l] not in (None, r):
            continue
        last = _add_layer_work(tg, k, q, l, [rs])
        tg.add_edge(last, ag if owner[l] == r else step)
    tg.add_edge(rs, ag)
    tg.add_edge(ag, step)


def _add_layer_work(tg: TaskGraph, k: int, q: int, layer: int, gradient: list[Task]) -> Task:
    """A covered layer's per-step optimizer ops on rank q (the declaration's `step_kinds`:
    Shampoo's statistics, then the update), each after what it waits for
    (pfcompile.formats.dataflow; `gradient`: what makes the stage's gradient on this
    replica); -> the last, which the step (or the gather of divided work) waits for."""
    task = None
    for kind in tg.cfg.optimizer_spec.step_kinds:
        task = Task(k, q, tg.interned.op(kind, layer=layer))
        for u in _producer_tasks(tg, task, gradient=gradient):
            tg.add_edge(u, task)
    return task


def _producer_tasks(tg: TaskGraph, task: Task, *, gradient: list[Task] | None = None) -> list[Task]:
    """The tasks an optimizer task waits for, from its declaration's reads and writes
    (pfcompile.formats.dataflow.producers). A collective waits for what every member's
    replica makes (the graph's collectives wait for every member's producers), a broadcast
    for its source's; every other task for its own replica's."""
    cfg, op = tg.cfg, task.op
    spec = cfg.optimizer_spec
    O = tg.interned.op
    s = tg.costs.layer_stage[op.layer]
    rep = cfg.micro_batch_replica()
    collective = op.is_collective
    out: list[Task] = []
    for p in producers(spec, op.kind, op.factor, replicas=cfg.replicas > 1):
        step = 0 if p.first_step else None if p.kind in FLOATING_KINDS else task.step
        if p.kind == GRADIENT:
            assert gradient is not None and not p.first_step, f"{op}: what makes the gradient is not known here"
            out += gradient
            continue
        if p.every_micro_batch:
            mbs = [m for m in range(cfg.micro_batches) if collective or cfg.rank_of(s, rep[m]) == task.rank]
        else:
            mbs = [op.mb]
        for m in mbs:
            rank = op.peer if p.on_source else cfg.rank_of(s, rep[m]) if m is not None else task.rank
            if p.is_pass:
                kind = "fwd" if p.kind == PASS_FWD else weight_grad_kind(cfg.schedule)
                out.append(Task(step, rank, O(kind, stage=s, mb=m)))
            else:
                fields = OP_KINDS[p.kind][1]
                out.append(Task(step, rank, O(p.kind, layer=op.layer, mb=m if "mb" in fields else None,
                                              factor=p.factor if "factor" in fields else None)))
    return out


def _add_refresh(tg: TaskGraph, inverters: dict | None) -> None:
    """The floating tasks of the cycle, as the optimizer declares them: the micro-batch ops
    of step 0 and their kept-tensor buffers (K-FAC's curvature), the reductions of their
    statistics (replicas), each factor's refresh (inversion or inverse root: on the
    inverters the policy or `inverters` names) and the broadcast of its result; each after
    what it waits for (pfcompile.formats.dataflow)."""
    cfg = tg.cfg
    spec = cfg.optimizer_spec
    R = cfg.replicas
    O = tg.interned.op
    for l, s in enumerate(tg.costs.layer_stage):
        for f in spec.factors:
            # split preconditioning: only the owner uses the layer's inverses
            own = tg.precond_owner[l] if tg.precond_owner is not None else None
            tg.inv_candidates[(l, f)] = cfg.replica_ranks(s) if own is None else [cfg.rank_of(s, own)]
    tg.inverters = dict(inverters) if inverters is not None else _inversion_policy(tg)

    def add(task: Task, collective: bool = False) -> None:
        tg.add_task(task)
        for u in _producer_tasks(tg, task):
            tg.add_edge(u, task)
        if collective:
            tg.collectives.setdefault((None, task.op), []).append(task)

    for l, s in enumerate(tg.costs.layer_stage):
        _add_micro_batch_ops(tg, l, s)
        if R > 1 and spec.reduction is not None:
            for q in cfg.replica_ranks(s):
                for f in spec.factors:
                    add(Task(None, q, O(spec.reduction, layer=l, factor=f)), collective=True)
        for f in spec.factors:
            who = tg.inverters[(l, f)]
            for q in who:
                add(Task(None, q, O(spec.refresh, layer=l, factor=f)))
            if R > 1 and spec.broadcast is not None and len(who) < len(tg.inv_candidates[(l, f)]):
                for q in cfg.replica_ranks(s):
                    add(Task(None, q, O(spec.broadcast, layer=l, factor=f, peer=who[0])), collective=True)


def _add_micro_batch_ops(tg: TaskGraph, l: int, s: int) -> None:
    """The optimizer's micro-batch ops (K-FAC's curvature): per micro-batch of step 0, one
    op after the pass whose tensor it reads, with the kept tensor's buffer."""
    cfg, layers = tg.cfg, tg.costs.profile.covered_layers
    rep = cfg.micro_batch_replica()
    O = tg.interned.op
    spec = cfg.optimizer_spec
    for m in range(cfg.micro_batches):
        q = cfg.rank_of(s, rep[m])
        for d in spec.micro_batch_ops:
            c = tg.add_task(Task(None, q, O(d.kind, layer=l, mb=m)))
            after = _producer_tasks(tg, c)
            for u in after:
                tg.add_edge(u, c)
            # the pass whose tensor the op reads, kept for it from that pass on
            (kept,) = [p.kind for p in producers(spec, d.kind, replicas=cfg.replicas > 1) if p.is_pass]
            key, nbytes = (f"kept_{d.factor.lower()}", l, m), layers[l].kept_bytes(d.factor)
            if kept == PASS_WGRAD and cfg.split_backward:
                # the output gradient is made by B and shared with W: the op runs with or
                # after W (they read the same tensors), the buffer lives from B on
                tg.buffers.append(Buffer(q, nbytes, Task(0, q, O("bwd_input", stage=s, mb=m)), c, key))
            elif kept == PASS_FWD and cfg.split_backward:
                # the input is W's kept input, inside the activations until W ends: the op
                # runs before or after W (the planner chooses) and holds it on its own only
                # from W's end to its own
                tg.buffers.append(Buffer(q, nbytes, Task(0, q, O("bwd_weight", stage=s, mb=m)), c, key, at_end=True))
            else:
                tg.buffers.append(Buffer(q, nbytes, after[0], c, key))


def _inversion_policy(tg: TaskGraph) -> dict[tuple[int, str], list[int]]:
    """"all": every replica inverts. "pipefisher": PipeFisher's split (`replica_share`):
    a layer a replica owns is inverted there only, the left-over blocks' on every replica.
    "balanced": longest inversion first, each to the candidate rank with the least
    inversion work so far (LPT), so R replicas share a stage's inversions about evenly."""
    if tg.cfg.inversion == "all":
        return {key: list(c) for key, c in tg.inv_candidates.items()}
    if tg.cfg.inversion == "pipefisher":
        owner = replica_share(tg.costs, tg.cfg.replicas)
        # candidates are in replica order (cfg.replica_ranks)
        return {key: list(c) if owner[key[0]] is None or len(c) == 1 else [c[owner[key[0]]]]
                for key, c in sorted(tg.inv_candidates.items())}
    load = {q: 0.0 for q in tg.ranks}
    out = {}
    refresh = tg.cfg.optimizer_spec.refresh
    by_cost = sorted(tg.inv_candidates, key=lambda key: -tg.costs.duration(Op(refresh, layer=key[0], factor=key[1])))
    for key in by_cost:
        q = min(tg.inv_candidates[key], key=lambda q: (load[q], q))
        load[q] += tg.costs.duration(Op(refresh, layer=key[0], factor=key[1]))
        out[key] = [q]
    return dict(sorted(out.items()))
