"""Pipeline schedule families: the configuration, the layout and the canonical per-rank orders.

A family fixes, for one training step, the order in which each rank runs the forward and
backward passes of its (stage, micro-batch) pairs; the point-to-point ops and the end of
step (sync_grad, precond, step) follow from it. Without K-FAC this is the bubble baseline.

Layout (docs/design.md §3.1): D = stages (devices per pipeline), v =
virtual_stages, S = D·v model stages, N = micro_batches of ALL replicas, R = replicas.
- gpipe / 1f1b:  rank = r·D + s, W = D·R
- interleaved:   rank = r·D + (s mod D): device d holds stages d, d+D, ..., d+(v-1)·D
- chimera:       R = 2, W = D: replica 0 ("down") stage s on rank s, replica 1 ("up")
                 stage s on rank D-1-s; N/2 micro-batches each way
- zb-h1:         as 1f1b, backward split into bwd_input (B) and bwd_weight (W)
- zb-v:          v = 2 chunks in a V: device d holds stages d and 2D-1-d (rank = r·D + d),
                 so the first and last stage share device 0; backward split as zb-h1
- dualpipev:     the layout of zb-v (DeepSeek's DualPipeV, torch's ScheduleDualPipeV);
                 needs N/R >= 2D micro-batches per replica
Replica r runs the contiguous block of micro-batches r·N/R .. (r+1)·N/R - 1.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from pfcompile.formats.errors import InputError
from pfcompile.formats.ops import SPLIT_BACKWARD_SCHEDULES, Op
from pfcompile.formats.optimizers import Optimizer, optimizer
from pfcompile.formats.plan import INVERSION_POLICIES, PRECOND_DIVISIONS, SCHEDULES, Layout
from pfcompile.formats.profile import Cluster

# the families that hold two chunks per device in a V (device d: stages d and 2D-1-d)
V_SCHEDULES = ("zb-v", "dualpipev")


@dataclass
class PipelineConfig:
    """Everything that defines a plan besides the profile.

    `inversion`: "balanced" inverts each factor on ONE replica of its stage (round-robin
    weighted by load, then broadcast; CP-SAT chooses the replica), "all" inverts on every
    replica (no broadcast), "pipefisher" PipeFisher's split (floor(blocks/R) blocks of the
    stage to each replica, the rest on every replica; costs.replica_share).
    `refresh_steps` is k, the cycle length; planners that choose k overwrite it.
    """

    schedule: str
    stages: int
    micro_batches: int
    replicas: int = 1
    virtual_stages: int = 1
    optimizer: str = "kfac"  # whose extra work to place (pfcompile.formats.optimizers; "adamw": none)
    inverse: str = "cholesky"
    refresh_steps: int = 1
    memory_limit_bytes: int | None = None
    partition: list[list[str]] | None = None
    inversion: str = "balanced"
    # the machines (pfcompile.formats.profile.Cluster; None: one node, the profile's links)
    # and where the family's ranks go on them: rank_map[family rank] = torchrun rank
    # (None: the family's numbering; pfcompile.place.topology chooses one for a cluster)
    cluster: Cluster | None = None
    rank_map: tuple[int, ...] | None = None
    precond: str = "all"  # "split": PipeFisher's split preconditioning between a stage's replicas;
    # "layers": the same, each stage's layers divided one by one (costs.precond_share)
    defer_stats: bool = False  # the optimizer's per-step statistics fold the previous step's gradient
    _layout: tuple | None = field(default=None, init=False, repr=False, compare=False)  # (shape, Layout)

    def __post_init__(self):
        if self.schedule == "chimera" and self.replicas == 1:
            self.replicas = 2  # Chimera is two pipelines by construction
        if self.schedule in V_SCHEDULES and self.virtual_stages == 1:
            self.virtual_stages = 2  # ZB-V and DualPipeV are two chunks per device by construction
        self.validate()

    def validate(self) -> None:
        D, N, R, v = self.stages, self.micro_batches, self.replicas, self.virtual_stages
        try:
            optimizer(self.optimizer)
        except ValueError as e:
            raise InputError("--optimizer", None, str(e)) from None
        try:
            optimizer(self.optimizer, defer_stats=self.defer_stats)
        except ValueError as e:
            raise InputError("--defer-stats", None, str(e)) from None
        if self.schedule not in SCHEDULES:
            raise InputError("--schedule", None, f"unknown schedule {self.schedule!r} (known: {', '.join(SCHEDULES)})")
        for flag, val in (("--stages", D), ("--micro-batches", N), ("--replicas", R), ("--virtual-stages", v)):
            if not isinstance(val, int) or val < 1:
                raise InputError(flag, None, f"must be a positive integer, got {val!r}")
        if self.refresh_steps < 1:
            raise InputError("refresh_steps", None, "must be >= 1")
        if self.precond not in PRECOND_DIVISIONS:
            raise InputError("--precond", None, f"must be one of {', '.join(PRECOND_DIVISIONS)} (auto is the planner's choice)")
        if self.inversion not in INVERSION_POLICIES:
            raise InputError("--inversion", None, f"must be one of {', '.join(INVERSION_POLICIES)}")
        if self.inverse not in ("cholesky", "eigen"):
            raise InputError("--inverse", None, "must be 'cholesky' or 'eigen'")
        if self.schedule in V_SCHEDULES and v != 2:
            raise InputError("--virtual-stages", None, f"{self.schedule} holds exactly 2 chunks per device, got {v}")
        if v != 1 and self.schedule not in ("interleaved", *V_SCHEDULES):
            raise InputError("--virtual-stages", None, f"only the interleaved schedule has virtual stages (got {v} with {self.schedule})")
        if N % R:
            raise InputError("--micro-batches", None, f"{N} micro-batches do not split evenly over {R} replicas")
        if self.schedule == "interleaved" and (N // R) % D:
            raise InputError("--micro-batches", None, f"interleaved needs the micro-batches per replica ({N // R}) to be a multiple of --stages {D}")
        if self.schedule == "chimera":
            if R != 2:
                raise InputError("--replicas", None, f"chimera is two pipelines (replicas 2), got {R}")
            if D % 2:
                raise InputError("--stages", None, f"chimera needs an even number of stages, got {D}")
            if N % 2 or N % max(1, D // 2):
                raise InputError("--micro-batches", None, f"chimera needs an even multiple of D/2 = {D // 2} micro-batches, got {N}")
        if self.schedule == "dualpipev" and N // R < 2 * D:  # torch's ScheduleDualPipeV: as many as stages
            raise InputError("--micro-batches", None, f"dualpipev needs at least 2 x --stages = {2 * D} micro-batches "
                             f"per replica, got {N // R}")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise InputError("--memory-limit", None, "must be positive")
        if self.cluster is not None and self.cluster.nodes * self.cluster.gpus_per_node != self.world_size:
            raise InputError("--nodes", None, f"{self.cluster.nodes} nodes x {self.cluster.gpus_per_node} GPUs "
                             f"per node is not the plan's {self.world_size} ranks")
        if self.rank_map is not None and sorted(self.rank_map) != list(range(self.world_size)):
            raise InputError("rank_map", None, f"must number the {self.world_size} ranks once each")

    @property
    def optimizer_spec(self) -> Optimizer:
        """The optimizer's declaration (its deferred-statistics variant with defer_stats)."""
        return optimizer(self.optimizer, defer_stats=self.defer_stats)

    @property
    def optimizer_work(self) -> bool:
        """Whether the plan holds an optimizer's extra work (every optimizer but AdamW)."""
        return self.optimizer_spec.has_work

    # --- layout ---------------------------------------------------------------------------------
    @property
    def split_backward(self) -> bool:
        """Zero-bubble families: each backward is bwd_input (B) then bwd_weight (W)."""
        return self.schedule in SPLIT_BACKWARD_SCHEDULES

    @property
    def num_stages(self) -> int:
        return self.stages * self.virtual_stages

    @property
    def world_size(self) -> int:
        return self.stages if self.schedule == "chimera" else self.stages * self.replicas

    def rank_of(self, stage: int, replica: int) -> int:
        q = self.family_rank(stage, replica)
        return q if self.rank_map is None else self.rank_map[q]

    def family_rank(self, stage: int, replica: int) -> int:
        """The rank the family's own numbering gives (stage, replica)."""
        D = self.stages
        if self.schedule == "chimera":
            return stage if replica == 0 else D - 1 - stage
        if self.schedule in V_SCHEDULES:  # the V: down the devices with chunk 0, back up with chunk 1
            return replica * D + (stage if stage < D else 2 * D - 1 - stage)
        return replica * D + stage % D

    def placement(self) -> list[dict[str, int]]:
        return [{"stage": s, "replica": r, "rank": self.rank_of(s, r)}
                for s in range(self.num_stages) for r in range(self.replicas)]

    def micro_batch_replica(self) -> list[int]:
        per = self.micro_batches // self.replicas
        return [m // per for m in range(self.micro_batches)]

    @property
    def layout(self) -> Layout:
        """The placement as queries (pfcompile.formats.plan.Layout, the plan's and the
        replay's too); `rank_of` above is the rule it is made from. Made once per shape:
        the planners ask for it in their inner loops."""
        key = (self.schedule, self.stages, self.virtual_stages, self.replicas, self.micro_batches, self.rank_map)
        if self._layout is None or self._layout[0] != key:
            self._layout = (key, Layout(self.placement(), self.micro_batch_replica()))
        return self._layout[1]

    def replica_mbs(self, replica: int) -> list[int]:
        return self.layout.mbs_of(replica)

    def stages_of(self, rank: int) -> list[tuple[int, int]]:
        """(stage, replica) pairs held by a rank, in stage order."""
        return self.layout.stages_of(rank)

    def replica_ranks(self, stage: int) -> list[int]:
        return self.layout.replica_ranks(stage)


# --- compute orders: per rank, the (kind, stage, mb) passes of one step ------------------------

Pass = tuple[str, int, int]  # ("fwd" | "bwd" | "bwd_input" | "bwd_weight", stage, mb)


def _gpipe(D: int, stage_local: int, stage: int, mbs: list[int]) -> list[Pass]:
    return [("fwd", stage, m) for m in mbs] + [("bwd", stage, m) for m in mbs]


def _one_f_one_b(D: int, s: int, stage: int, mbs: list[int]) -> list[Pass]:
    """PipeDream-flush: D-s-1 warm-up forwards, then alternate, then drain: at most D-s in flight."""
    warm = min(D - s - 1, len(mbs))
    order: list[Pass] = [("fwd", stage, m) for m in mbs[:warm]]
    for i in range(len(mbs) - warm):
        order += [("fwd", stage, mbs[warm + i]), ("bwd", stage, mbs[i])]
    order += [("bwd", stage, m) for m in mbs[len(mbs) - warm:]]
    return order


def _interleaved(D: int, v: int, d: int, mbs: list[int]) -> list[Pass]:
    """Megatron-LM's interleaved 1F1B on device d (chunks d, d+D, ...; len(mbs) a multiple of D)."""
    n = len(mbs)
    total = n * v

    def virtual(k: int, forward: bool) -> Pass:
        chunk = (k % (D * v)) // D
        if not forward:
            chunk = v - 1 - chunk
        m = mbs[(k // (D * v)) * D + k % D]
        return ("fwd" if forward else "bwd", chunk * D + d, m)

    # Megatron's warm-up count (for N = D Megatron runs all forwards first; the same count
    # keeps fewer activations alive at the same bubble); v = 1 is plain 1F1B
    warm = min((D - d - 1) * 2 + (v - 1) * D if v > 1 else D - d - 1, total)
    order = [virtual(k, True) for k in range(warm)]
    for i in range(total - warm):
        order += [virtual(warm + i, True), virtual(i, False)]
    order += [virtual(k, False) for k in range(total - warm, total)]
    return order


def _zb_h1(D: int, d: int, stage: int, mbs: list[int]) -> list[Pass]:
    """ZB-H1 (Qi et al., ICLR 2024, as torch's ScheduleInterleavedZeroBubble with one
    chunk): 1F1B's forwards and input-backwards (B), and device d holds back the weight
    pass W of its first d micro-batches, so W fills the cool-down wait the earlier devices
    have in 1F1B: after B of the j-th micro-batch comes W of the (j-d)-th, the last d W's
    close the step. In flight: at most D activations per device, 1F1B's peak."""
    n = len(mbs)
    warm = min(D - d - 1, n)
    order: list[Pass] = [("fwd", stage, m) for m in mbs[:warm]]
    w_next = 0

    def b_then_w(j: int) -> None:
        nonlocal w_next
        order.append(("bwd_input", stage, mbs[j]))
        if j >= d:
            order.append(("bwd_weight", stage, mbs[w_next]))
            w_next += 1

    for i in range(n - warm):
        order.append(("fwd", stage, mbs[warm + i]))
        b_then_w(i)
    for j in range(n - warm, n):
        b_then_w(j)
    order += [("bwd_weight", stage, m) for m in mbs[w_next:]]
    return order


def _zb_v(D: int, d: int, mbs: list[int]) -> list[Pass]:
    """ZB-V (Qi et al., "Pipeline parallelism with controllable memory", 2024; torch's
    ScheduleZBVZeroBubble) on device d, chunks c0 = stage d (going down) and c1 = stage
    2D-1-d (coming back up). Warm-up: 2(D-d)-1 forwards of c0, then d pairs (F c1, F c0),
    then D-d rounds of (F c1, B c1, W c1); steady: (F c0, B c0, W c0, F c1, B c1, W c1)
    until all forwards are issued; cool-down: d pairs (B c0, B c1), D-d pairs (B c0, W c0
    of the oldest pending), then the pending W's of c1, then of c0. The order is built
    for max(N, 2D-1) micro-batches (what the V needs to fill) and the absent ones dropped."""
    n_real = len(mbs)
    n = max(n_real, 2 * D - 1)
    c0, c1 = d, 2 * D - 1 - d
    count = {("fwd", c0): 0, ("fwd", c1): 0, ("bwd_input", c0): 0, ("bwd_input", c1): 0}
    order: list[tuple[str, int, int]] = []  # (kind, stage, local micro-batch index)

    def run(kind: str, stage: int) -> None:
        i = count[(kind, stage)]
        count[(kind, stage)] = i + 1
        order.append((kind, stage, i))

    def weight(stage: int, i: int) -> None:
        order.append(("bwd_weight", stage, i))

    for _ in range(2 * (D - d) - 1):
        run("fwd", c0)
    for _ in range(d):
        run("fwd", c1)
        run("fwd", c0)
    for _ in range(D - d):
        run("fwd", c1)
        i = count[("bwd_input", c1)]
        run("bwd_input", c1)
        weight(c1, i)
    while count[("fwd", c1)] < count[("fwd", c0)] or count[("fwd", c0)] < n:
        if count[("fwd", c0)] < n:
            run("fwd", c0)
        for c in (c0, c1):
            if c == c1:
                run("fwd", c1)
            i = count[("bwd_input", c)]
            run("bwd_input", c)
            weight(c, i)
    w = {c0: count[("bwd_input", c0)], c1: count[("bwd_input", c1)]}
    for _ in range(d):
        run("bwd_input", c0)
        run("bwd_input", c1)
    for _ in range(D - d):
        run("bwd_input", c0)
        weight(c0, w[c0])
        w[c0] += 1
    for c in (c1, c0):
        while w[c] < count[("bwd_input", c)]:
            weight(c, w[c])
            w[c] += 1
    return [(kind, s, mbs[i]) for kind, s, i in order if i < n_real]


def _dualpipev(D: int, d: int, mbs: list[int]) -> list[Pass]:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V; torch's ScheduleDualPipeV,
    `_calculate_single_rank_operations`, step for step) on device d, chunks c0 = stage d
    and c1 = stage 2D-1-d, n = len(mbs) >= 2D. Torch's actions map to ours:
    F -> fwd; I -> bwd_input, whose W torch queues; W -> bwd_weight of the oldest queued
    input backward; B (a full backward) -> bwd_input then bwd_weight of the same (stage,
    mb) at once (a plan's family splits every backward or none; B then W at once is the
    full backward's arithmetic); OVERLAP_F_B(F, B) -> the forward, then the backward as
    B (one compute stream per rank runs the pair in sequence).
    Steps: 2(D-d-1) F c0; d+1 pairs (F c0, F c1); D-d-1 rounds (I c1, W, F c1);
    n-2D+d+1 rounds (F c0 + B c1, F c1 + B c0); D-d-1 rounds (B c1, F c1 + B c0); d+1
    pairs (c1, c0) of B, switching to I from the middle pair on (odd d: before its c1,
    even d: before its c0); D-d-1 rounds (W, B-or-I c0); then d+1 W's."""
    c0, c1 = d, 2 * D - 1 - d
    count = {("fwd", c0): 0, ("fwd", c1): 0, ("bwd", c0): 0, ("bwd", c1): 0}
    queued_weights: list[tuple[int, int]] = []  # (stage, local mb) of input backwards, oldest first
    order: list[tuple[str, int, int]] = []  # (kind, stage, local micro-batch index)

    def next_mb(kind: str, stage: int) -> int:
        i = count[(kind, stage)]
        count[(kind, stage)] = i + 1
        return i

    def fwd(stage: int) -> None:
        order.append(("fwd", stage, next_mb("fwd", stage)))

    def bwd(stage: int, split: bool = False) -> None:
        i = next_mb("bwd", stage)
        order.append(("bwd_input", stage, i))
        if split:
            queued_weights.append((stage, i))
        else:
            order.append(("bwd_weight", stage, i))

    def weight() -> None:
        if queued_weights:
            stage, i = queued_weights.pop(0)
            order.append(("bwd_weight", stage, i))

    for _ in range(2 * (D - d - 1)):
        fwd(c0)
    for _ in range(d + 1):
        fwd(c0)
        fwd(c1)
    for _ in range(D - d - 1):
        bwd(c1, split=True)
        weight()
        fwd(c1)
    for _ in range(len(mbs) - 2 * D + d + 1):
        fwd(c0)  # torch's first round on the last device runs these two apart, the rest overlapped
        bwd(c1)
        fwd(c1)
        bwd(c0)
    for _ in range(D - d - 1):
        bwd(c1)
        fwd(c1)
        bwd(c0)
    split = False
    for i in range(d + 1):
        split = split or (i == (d + 1) // 2 and d % 2 == 1)
        bwd(c1, split)
        split = split or (i == (d + 1) // 2 and d % 2 == 0)
        bwd(c0, split)
    for _ in range(D - d - 1):
        weight()
        bwd(c0, split)
    for _ in range(d + 1):
        weight()
    return [(kind, s, mbs[i]) for kind, s, i in order]


def _chimera(cfg: PipelineConfig) -> dict[int, list[Pass]]:
    """Chimera's merged bidirectional schedule, by list scheduling in slots (the paper draws
    forward and backward as equal slots): a free worker runs a ready backward first
    (lowest stage first, to drain), else the ready forward deepest in its pipeline (it is
    on the critical path), down before up on ties. For N = D this is
    the paper's basic unit, D-2 bubble slots per worker against 1F1B's 2(D-1); more
    micro-batches concatenate units (tests/test_schedules.py checks the counts)."""
    D, S = cfg.stages, cfg.num_stages
    dur = {"fwd": 1, "bwd": 1}
    replica_of = cfg.micro_batch_replica()
    ready: dict[int, list] = {q: [] for q in range(D)}  # rank -> [(is_fwd, depth, ready_t, replica, seq, pass)]
    running: list[tuple[int, int, Pass]] = []  # heap of (end, seq, pass)
    order: dict[int, list[Pass]] = {q: [] for q in range(D)}
    busy_until = [0] * D
    seq = 0

    def make_ready(t: int, p: Pass) -> None:
        nonlocal seq
        kind, s, m = p
        depth = s if kind == "bwd" else -s
        ready[cfg.rank_of(s, replica_of[m])].append((kind == "fwd", depth, t, replica_of[m], seq, p))
        seq += 1

    for m in range(cfg.micro_batches):
        make_ready(0, ("fwd", 0, m))
    t = 0
    while True:
        for q in range(D):
            if busy_until[q] <= t and ready[q]:
                best = min(ready[q])
                ready[q].remove(best)
                p = best[-1]
                order[q].append(p)
                busy_until[q] = t + dur[p[0]]
                heapq.heappush(running, (busy_until[q], seq, p))
                seq += 1
        if not running:
            return order
        t = running[0][0]
        while running and running[0][0] == t:
            _, _, (kind, s, m) = heapq.heappop(running)
            if kind == "fwd":
                make_ready(t, ("fwd", s + 1, m) if s + 1 < S else ("bwd", s, m))
            elif s > 0:
                make_ready(t, ("bwd", s - 1, m))


def compute_orders(cfg: PipelineConfig) -> dict[int, list[Pass]]:
    """rank -> the fwd/bwd passes of one step in the family's order."""
    if cfg.schedule == "chimera":
        return _chimera(cfg)
    orders: dict[int, list[Pass]] = {}
    D = cfg.stages
    for r in range(cfg.replicas):
        mbs = cfg.replica_mbs(r)
        for d in range(D):
            q = cfg.rank_of(d, r)
            if cfg.schedule == "gpipe":
                orders[q] = _gpipe(D, d, d, mbs)
            elif cfg.schedule == "1f1b":
                orders[q] = _one_f_one_b(D, d, d, mbs)
            elif cfg.schedule == "zb-h1":
                orders[q] = _zb_h1(D, d, d, mbs)
            elif cfg.schedule == "zb-v":
                orders[q] = _zb_v(D, d, mbs)
            elif cfg.schedule == "dualpipev":
                orders[q] = _dualpipev(D, d, mbs)
            else:
                orders[q] = _interleaved(D, cfg.virtual_stages, d, mbs)
    return orders


def canonical_orders(cfg: PipelineConfig, stage_layers: list[list[int]],
                     precond_owner: list[int | None] | None = None) -> dict[int, list[Op]]:
    """rank -> the ops of one step: passes with their receives before and sends after, then,
    for each stage held in ascending stage order (one global order, so the collectives of
    ranks sharing two groups never cross), sync_grad (R > 1), each covered layer's per-step
    optimizer ops (`Optimizer.step_kinds`: Shampoo's stats, then the update: precond or
    orth), step. `stage_layers[s]`: the covered layer indices of stage s.
    `precond_owner` (divided work): per layer the replica that does its per-step work (None:
    every replica); a stage with owned layers runs rs_grad, the per-layer ops of its
    replica's and the unowned layers, ag_grad, step."""
    S = cfg.num_stages
    replica_of = cfg.micro_batch_replica()
    out: dict[int, list[Op]] = {}
    for q, passes in compute_orders(cfg).items():
        ops: list[Op] = []
        for kind, s, m in passes:
            r = replica_of[m]
            if kind == "fwd":
                if s > 0 and cfg.rank_of(s - 1, r) != q:
                    ops.append(Op("recv_act", stage=s - 1, mb=m, peer=cfg.rank_of(s - 1, r)))
                ops.append(Op("fwd", stage=s, mb=m))
                if s + 1 < S and cfg.rank_of(s + 1, r) != q:
                    ops.append(Op("send_act", stage=s, mb=m, peer=cfg.rank_of(s + 1, r)))
            elif kind == "bwd_weight":  # local: it needs nothing from another rank
                ops.append(Op("bwd_weight", stage=s, mb=m))
            else:  # bwd or bwd_input: what makes the input gradient
                if s + 1 < S and cfg.rank_of(s + 1, r) != q:
                    ops.append(Op("recv_grad", stage=s + 1, mb=m, peer=cfg.rank_of(s + 1, r)))
                ops.append(Op(kind, stage=s, mb=m))
                if s > 0 and cfg.rank_of(s - 1, r) != q:
                    ops.append(Op("send_grad", stage=s, mb=m, peer=cfg.rank_of(s - 1, r)))
        for s, r in cfg.stages_of(q):
            split = precond_owner is not None and cfg.optimizer_work and \
                any(precond_owner[l] is not None for l in stage_layers[s])
            per_layer = cfg.optimizer_spec.step_kinds  # each layer's statistics, then its update
            if split:
                ops.append(Op("rs_grad", stage=s))
                ops += [Op(kind, layer=l) for l in stage_layers[s] if precond_owner[l] in (None, r) for kind in per_layer]
                ops.append(Op("ag_grad", stage=s))
            else:
                if cfg.replicas > 1:
                    ops.append(Op("sync_grad", stage=s))
                ops += [Op(kind, layer=l) for l in stage_layers[s] for kind in per_layer]
            ops.append(Op("step", stage=s))
        out[q] = ops
    return dict(sorted(out.items()))
