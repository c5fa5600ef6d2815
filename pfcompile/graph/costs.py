"""Op durations and memory effects, from a profile: one place for the graph and the replay.

The task graph (what a planner places) and the replay (what checks a plan) must agree
on what an op costs, so both ask a `Costs`. It knows the partition (parts of each model
stage), the covered layers of each stage, the number of replicas and the inversion method.
What an optimizer's op costs and what it keeps come from its declaration
(pfcompile.formats.optimizers): an op's `cost` key in the profile's per-layer map, a
collective's `transfer` of the state it writes, the `state` per covered layer, the step's.

Memory model (docs/design.md §5.4):
- resident per rank: parameters + gradients + optimizer state of the stages it holds
  (runtime.optimizers.stage: the declared `step_moments` per covered parameter, e.g. K-FAC's SGD
  momentum on the covered layers' weights and biases, and AdamW's two moments on the rest;
  AdamW on everything without extra work), and per covered layer held its declared `state`
  (K-FAC: accumulators A, B, factors A, B, inverses in force A, B, pending inverses A, B);
- dynamic: `fwd(s, m)` allocates the activations it saves at its start; `bwd(s, m)` frees
  them at its end. On the refresh step (step 0 of the cycle), with an optimizer whose
  micro-batch ops keep the forward's input (PASS_FWD) or the output gradient (PASS_WGRAD),
  `fwd` also allocates each layer's kept input (freed at the end of the op that reads it,
  K-FAC's `curv_a`) and `bwd` each layer's kept output gradient (K-FAC's `curv_b`).
- split backward (zero-bubble families): `bwd_input(s, m)` keeps the output gradients the
  weight pass needs (`wgrad_bytes`) from its start, and the activations stay: both are
  freed at the end of `bwd_weight(s, m)`. On the refresh step with K-FAC, the kept output
  gradients of the K-FAC layers ARE those tensors: bwd_input allocates them as kept_b
  (freed by curv_b, which runs with or after W), and the W buffer holds only the rest.
  Likewise a K-FAC layer's kept input IS the layer input W keeps (runtime.pipeline.split_backward
  and runtime.optimizers.kfac hold the same storage), inside the activations until W ends: `fwd`
  allocates no kept_a; `bwd_weight` allocates it at its END (`allocates_at_end`) unless its
  `curv_a` has already ended, and `curv_a` frees it. So kept_a is held over
  [end of W, max(end of W, end of curv_a)]: nothing when curv_a runs before W ends.
  (Non-split families hold the same tensor in `act` until `bwd` too; they still count
  kept_a from `fwd` to `curv_a`.)
Buffers are named by keys: ("act", stage, mb), ("wgrad", stage, mb), ("kept_a", layer, mb),
("kept_b", layer, mb).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pfcompile.formats.dataflow import captures, kept_passes, reads_pass
from pfcompile.formats.errors import InputError
from pfcompile.formats.ops import Op
from pfcompile.formats.optimizers import ALLREDUCE, IN, IN_BIAS, OUT, PASS_FWD, PASS_WGRAD, StateDecl
from pfcompile.formats.optimizers import optimizer as optimizer_spec
from pfcompile.formats.profile import CAPTURE_KINDS, Cluster, Profile
from pfcompile.graph.partition import stage_partition

if TYPE_CHECKING:
    from pfcompile.graph.schedules import PipelineConfig

# the buffer a micro-batch op's kept tensor is named by, per pass it reads (module doc)
KEPT_BUFFER = {PASS_FWD: "kept_a", PASS_WGRAD: "kept_b"}


@dataclass
class Costs:
    profile: Profile
    partition: list[list[str]]
    replicas: int
    inverse: str = "cholesky"
    optimizer: str = "kfac"  # whose extra work (pfcompile.formats.optimizers)
    # with a cluster: every message and collective is costed by the link it crosses
    # (pfcompile.formats.profile.Cluster); `stage_ranks[s]` are the ranks of stage s's replicas
    cluster: Cluster | None = None
    stage_ranks: list[list[int]] | None = None
    precond_owner: list | None = None  # split preconditioning: replica per layer (None: replica_share)
    split_backward: bool = False  # a zero-bubble family: kept_a shares W's kept input (module doc)
    refresh_steps: int = 1  # k: with k = 1 Shampoo's snapshot is its statistics themselves
    defer_stats: bool = False  # deferred statistics: the update keeps the raw gradient (its memory)

    def __post_init__(self):
        self.spec = optimizer_spec(self.optimizer, defer_stats=self.defer_stats)
        self.work = self.spec.has_work
        self.captures = captures(self.spec)  # its refresh step's pipeline ops carry capture_ms
        if self.spec.cost_keys():  # its ops' costs must be in the profile
            for i, layer in enumerate(self.profile.covered_layers):
                if self.optimizer not in layer.optimizer_ms:
                    raise InputError(f"profile {self.profile.name}", f"covered_layers[{i}].optimizer_ms.{self.optimizer}",
                                     f"missing: the profile has no {self.optimizer} costs (profile with "
                                     f"`pfcompile profile --optimizer {self.optimizer}`)")
        part_stage = {p: s for s, group in enumerate(self.partition) for p in group}
        self.layer_stage = [part_stage[l.part] for l in self.profile.covered_layers]
        self.stage_layers = [[i for i, s in enumerate(self.layer_stage) if s == st] for st in range(len(self.partition))]
        self._parts = [[self.profile.part(p) for p in group] for group in self.partition]
        # the runtime's per-step work is once per rank: shared by the `step` ops of the stages it holds
        first = self.stage_ranks[0][0] if self.stage_ranks and self.stage_ranks[0] else None
        self.stages_per_rank = max(1, sum(first in r for r in self.stage_ranks)) if first is not None else 1

    @property
    def num_stages(self) -> int:
        return len(self.partition)

    # --- per-stage sums ----------------------------------------------------------------------
    def fwd_ms(self, stage: int) -> float:
        return sum(p.fwd_ms for p in self._parts[stage])

    def bwd_ms(self, stage: int) -> float:
        return sum(p.bwd_ms for p in self._parts[stage])

    def bwd_input_ms(self, stage: int) -> float:
        """B of a split backward: as profiled per part (or the profile's documented 50/50
        estimate where it was not measured: pfcompile.formats.profile.Part.split_backward_ms)."""
        return sum(p.split_backward_ms()[0] for p in self._parts[stage])

    def bwd_weight_ms(self, stage: int) -> float:
        """W of a split backward (as bwd_input_ms). B + W need not equal bwd_ms."""
        return sum(p.split_backward_ms()[1] for p in self._parts[stage])

    def wgrad_bytes(self, stage: int) -> int:
        """What a weight pass keeps besides the activations: the output gradients of the
        stage's nn.Linear layers, as profiled per part (`Part.wgrad_bytes`); where a part's
        were not measured, its covered layers' kept_b (or the stage's output gradient when
        the stage has none)."""
        if all(p.wgrad_bytes is not None for p in self._parts[stage]):
            return sum(p.wgrad_bytes for p in self._parts[stage])
        layers = self.stage_layers[stage]
        if layers:
            return sum(self.profile.covered_layers[l].kept_b_bytes for l in layers)
        return self.out_bytes(stage)

    def act_bytes(self, stage: int) -> int:
        return sum(p.act_bytes for p in self._parts[stage])

    def out_bytes(self, stage: int) -> int:
        """The stage's output for one micro-batch: the activation message it sends on."""
        return self._parts[stage][-1].out_bytes

    def grad_message_bytes(self, stage: int) -> int:
        """The input-gradient stage `stage` sends back: the size of its input."""
        return self.out_bytes(stage - 1) if stage > 0 else 0

    def step_ms(self, stage: int) -> float:
        """The stage's optimizer update, as profiled per optimizer (a profile times every
        optimizer it profiles, runtime.pipeline.build.Update with its layers); where a part has
        no entry of its own (a profile made before), that of the optimizer its declaration steps
        like (`step_like`: Shampoo's and SOAP's K-FAC's, Muon's AdamW's)."""
        like = self.spec.step_like
        return sum(p.step_ms.get(self.optimizer, p.step_ms.get(like, 0.0)) for p in self._parts[stage])

    def param_bytes(self, stage: int) -> int:
        return sum(p.param_bytes for p in self._parts[stage])

    def grad_bytes(self, stage: int) -> int:
        return sum(p.grad_bytes for p in self._parts[stage])

    def owned_grad_bytes(self, stage: int) -> int:
        """Gradient bytes of the stage's covered layers that one replica owns under split
        preconditioning (replica_share), all replicas' shares together."""
        owner = self.precond_owner if self.precond_owner is not None else replica_share(self, self.replicas)
        elem = {"float64": 8, "float16": 2, "bfloat16": 2}.get(str(self.profile.model.get("dtype", "float32")), 4)
        layers = self.profile.covered_layers
        n = sum((layers[l].in_features + int(layers[l].bias)) * layers[l].out_features
                for l in self.stage_layers[stage] if owner[l] is not None)
        return min(n * elem, self.grad_bytes(stage))

    # --- durations ------------------------------------------------------------------------------
    def duration(self, op: Op, step: int | None = None) -> float:
        """Milliseconds the op occupies its rank in cycle step `step` (None: a step neither
        first nor last of its cycle): its own work (`work_ms`) and the runtime's dispatch of it
        (profile.runtime.op_ms). A send costs its posting (it completes in the background); a
        receive costs its completion once the data is there (its waiting is the message's
        lag, message_ms, not its duration); each `step` op carries its share of the
        runtime's work between steps, and the one ending a cycle the activation of the
        cycle's refreshed roots; on a refresh step (`step` = 0) a pipeline op carries what
        the optimizer's capture adds to it (capture_ms)."""
        return self.work_ms(op, step) + self.profile.runtime.op_ms

    def work_ms(self, op: Op, step: int | None = None) -> float:
        k = op.kind
        if k in CAPTURE_KINDS:  # fwd_ms, bwd_ms, bwd_input_ms or bwd_weight_ms
            return getattr(self, f"{k}_ms")(op.stage) + (self.capture_ms(op.stage, k) if step == 0 else 0.0)
        if k in ("send_act", "send_grad"):
            return self.profile.runtime.send_ms
        if k in ("recv_act", "recv_grad"):
            return self.profile.runtime.recv_ms
        decl = self.spec.op(k)
        if decl is not None and decl.cost is not None:
            return self.optimizer_op_ms(op)
        if decl is not None and decl.transfer is not None:  # a collective of the state it writes
            nbytes = self.written_bytes(decl, op.layer, op.factor)
            if decl.transfer == ALLREDUCE:
                return self._allreduce_ms(nbytes, self.layer_stage[op.layer])
            if self.cluster is not None and self.replicas > 1:
                return self._group_link(self.layer_stage[op.layer]).time_ms(nbytes)
            return self.profile.comm.bcast_ms(nbytes, self.replicas)
        if k == "sync_grad":
            return self._allreduce_ms(self.grad_bytes(op.stage), op.stage)
        if k in ("rs_grad", "ag_grad"):
            # a ring reduce-scatter or all-gather moves half an all-reduce's data; rs_grad
            # also all-reduces what no replica owns (LayerNorm, embeddings, left-over blocks)
            owned = self.owned_grad_bytes(op.stage)
            half = self._allreduce_ms(owned, op.stage) / 2 if owned else 0.0
            if k == "ag_grad":
                return half
            rest = self.grad_bytes(op.stage) - owned
            return half + (self._allreduce_ms(rest, op.stage) if rest > 0 else 0.0)
        if k == "step":
            return self.step_ms(op.stage) + self.between_steps_ms(op, step)
        raise ValueError(f"no cost for {op}")

    def optimizer_op_ms(self, op: Op) -> float:
        """An optimizer op's own work on its layer: the profile's entry of the op's declared cost
        key for this optimizer (its factor and the plan's inversion method filled in)."""
        key = self.spec.cost_key(op.kind, op.factor, self.inverse)
        if key is None:
            raise ValueError(f"no cost for {op}: {self.optimizer} declares no cost key for {op.kind!r}")
        return self.profile.covered_layers[op.layer].optimizer_ms[self.optimizer][key]

    def element_bytes(self) -> int:
        """The optimizer state's element size: float32 in every precision the runtime runs
        (bfloat16 keeps float32 state), float64 in a float64 run."""
        return 8 if str(self.profile.model.get("dtype", "float32")) == "float64" else 4

    def state_bytes(self, decl: StateDecl, layer: int) -> int:
        """One copy of a declared state tensor of a layer: the profile's byte field where the
        declaration names one (what the profiler measured), else rows x cols of the element size."""
        if decl.bytes_field is not None:
            return int(getattr(self.profile.covered_layers[layer], decl.bytes_field))
        return self.state_elements(decl, layer) * self.element_bytes()

    def state_elements(self, decl: StateDecl, layer: int) -> int:
        """rows x cols of a declared state tensor of a layer."""
        L = self.profile.covered_layers[layer]
        dims = {IN: L.in_features, IN_BIAS: L.in_features + int(L.bias), OUT: L.out_features}
        rows, cols = decl.shape
        return dims[rows] * dims[cols]

    def _state(self, name: str, factor: str | None) -> StateDecl:
        """The declared state `name` ("root:F": F is the op's factor)."""
        decl = self.spec.state_decl(name.replace(":F", f":{factor}") if factor is not None else name)
        if decl is None:
            raise ValueError(f"{self.optimizer} declares no state {name!r} (factor {factor})")
        return decl

    def written_bytes(self, op_decl, layer: int, factor: str | None) -> int:
        """What a collective moves: the state its op writes (one copy)."""
        return self.state_bytes(self._state(op_decl.writes[0], factor), layer)

    def root_bytes(self, layer: int, factor: str) -> int:
        """One refreshed matrix of a layer (the declared state root:F): K-FAC's inverse of A or
        B (A is augmented by the bias), Shampoo's inverse root of L (out x out) or R (in x in)."""
        return self.state_bytes(self._state("root:F", factor), layer)

    def capture_ms(self, stage: int, kind: str) -> float:
        """What a refresh step (step 0 of the cycle) adds to the stage's `kind` op when the
        optimizer's micro-batch ops keep the forward's input or the output gradient (K-FAC's
        hooks capture them, and the step's ops run with them held): the parts' `capture_ms`
        (0 where not profiled, and for every other optimizer)."""
        if not self.captures:
            return 0.0
        return sum((p.capture_ms or {}).get(kind, 0.0) for p in self._parts[stage])

    def between_steps_ms(self, op: Op, step: int | None = None) -> float:
        """The runtime's work between steps that a `step` op carries: its share, one per stage
        the rank holds, and in a cycle's last step (`step` = k - 1) the activation of the
        stage's layers before the next cycle's first (0 for other ops)."""
        if op.kind != "step":
            return 0.0
        last = step is not None and step == self.refresh_steps - 1
        return self.profile.runtime.step_ms / self.stages_per_rank + (self.activation_ms(op.stage) if last else 0.0)

    def activation_ms(self, stage: int) -> float:
        """The stage's layers' activation (Optimizer.activation: the refreshed roots put into
        force, once per cycle), on its busiest replica: each replica activates the layers
        whose divisible work it does. 0 where the profile has no such entry."""
        key = self.spec.activation
        if key is None or not self.work:
            return 0.0
        owner = self.precond_owner
        share: dict[int | None, float] = {}
        for l in self.stage_layers[stage]:
            who = owner[l] if owner is not None else None
            share[who] = share.get(who, 0.0) + self.profile.covered_layers[l].optimizer_ms.get(self.optimizer, {}).get(key, 0.0)
        every = share.pop(None, 0.0)  # layers every replica does
        return every + max(share.values(), default=0.0)

    def runtime_ms(self, op: Op, step: int | None = None) -> float:
        """The runtime's own work inside the op's duration, which a run times apart from the
        op: its dispatch and, in a `step` op, its share of the work between steps."""
        return self.profile.runtime.op_ms + self.between_steps_ms(op, step)

    def link_ms(self, op: Op, src: int | None = None) -> float:
        """Transfer time of a point-to-point message: its send's end to the end of a receive
        that was waiting for it; `src`: the sending rank (with a cluster, the link between it
        and `op.peer` is the one crossed)."""
        nbytes = self.out_bytes(op.stage) if op.kind.endswith("act") else self.grad_message_bytes(op.stage)
        if self.cluster is not None:
            return self.cluster.link((src, op.peer)).time_ms(nbytes)
        return self.profile.comm.p2p.time_ms(nbytes)

    def message_ms(self, op: Op, src: int | None = None) -> float:
        """The lag from a send's end to the START of its receive's completion (the receive op,
        runtime.recv_ms long). gloo and NCCL pair a send with its receive before moving the
        data, so a receive ends at max(its start + recv_ms, the send's end + link_ms): the
        completion overlaps the transfer, and the lag is what of the link is left."""
        return self.lag_of_link(self.link_ms(op, src))

    def lag_of_link(self, link_ms: float) -> float:
        """message_ms of a message whose transfer takes `link_ms`."""
        return max(0.0, link_ms - self.profile.runtime.recv_ms)

    def _group_link(self, stage: int):
        return self.cluster.link(self.stage_ranks[stage])

    def _allreduce_ms(self, nbytes: int, stage: int) -> float:
        """Ring all-reduce among the stage's replicas (at the pace of the slowest link it crosses)."""
        if self.cluster is None or self.replicas <= 1:
            return self.profile.comm.allreduce_ms(nbytes, self.replicas)
        link, r = self._group_link(stage), self.replicas
        return link.latency_ms + 2 * (r - 1) / r * nbytes / link.bytes_per_ms

    # --- memory ---------------------------------------------------------------------------------
    def allocates(self, op: Op, refresh: bool) -> list[tuple[tuple, int]]:
        """Buffers the op allocates at its start: [(key, bytes)]. `refresh`: step 0 of the cycle."""
        out: list[tuple[tuple, int]] = []
        layers = self.profile.covered_layers
        kept = kept_passes(self.spec)  # what the optimizer's micro-batch ops keep (module doc)
        if op.kind == "fwd":
            out.append((("act", op.stage, op.mb), self.act_bytes(op.stage)))
            if refresh and PASS_FWD in kept and not self.split_backward:
                out += [(("kept_a", l, op.mb), layers[l].kept_a_bytes) for l in self.stage_layers[op.stage]]
        elif op.kind in ("bwd", "bwd_input") and refresh and PASS_WGRAD in kept:
            out += [(("kept_b", l, op.mb), layers[l].kept_b_bytes) for l in self.stage_layers[op.stage]]
        if op.kind == "bwd_input":
            shared = sum(n for key, n in out if key[0] == "kept_b")
            out.append((("wgrad", op.stage, op.mb), max(0, self.wgrad_bytes(op.stage) - shared)))
        return out

    def allocates_at_end(self, op: Op, refresh: bool) -> list[tuple[tuple, int]]:
        """Buffers the op allocates at its END, each only if the op that frees it has not
        ended by then (held over [this end, max(this end, the freeing op's end)]): with a
        split backward, the covered layers' inputs W kept inside the activations, which
        outlive W until the op that reads them (K-FAC's curv_a)."""
        if op.kind == "bwd_weight" and refresh and PASS_FWD in kept_passes(self.spec) and self.split_backward:
            layers = self.profile.covered_layers
            return [(("kept_a", l, op.mb), layers[l].kept_a_bytes) for l in self.stage_layers[op.stage]]
        return []

    def frees(self, op: Op) -> list[tuple]:
        """Buffer keys the op frees at its end."""
        if op.kind == "bwd":
            return [("act", op.stage, op.mb)]
        if op.kind == "bwd_weight":
            return [("act", op.stage, op.mb), ("wgrad", op.stage, op.mb)]
        decl = self.spec.op(op.kind) if op.layer is not None else None
        kept = reads_pass(decl) if decl is not None else None
        if kept in KEPT_BUFFER:  # a micro-batch op: what it kept
            return [(KEPT_BUFFER[kept], op.layer, op.mb)]
        return []

    def covered_param_bytes(self, stage: int) -> int:
        """The stage's parameters the optimizer's own update covers: the covered layers'
        weights, and their biases too where it declares `covers_bias` (K-FAC preconditions
        [W | b]), at the element size it declares (`covered_element_of`: K-FAC's, its
        factors' as profiled); the rest is AdamW's."""
        n = 0
        of = self.spec.covered_element_of
        for l in self.stage_layers[stage]:
            L = self.profile.covered_layers[l]
            elem = self.element_bytes()
            if of is not None:  # the declared state's size over its elements
                decl = self.spec.state_decl(of)
                elem = round(self.state_bytes(decl, l) / self.state_elements(decl, l))
            n += (L.in_features + int(L.bias and self.spec.covers_bias)) * L.out_features * elem
        return n

    def optimizer_state_bytes(self, stage: int) -> int:
        """runtime.optimizers.stage's state for a stage on every replica: the declared `step_moments` per
        covered parameter (SGD's momentum: K-FAC, Shampoo; none for Muon, whose momentum is
        its declared layer state, `layer_state_bytes`), and AdamW's two moments per other
        parameter."""
        if not self.work:
            return 2 * self.param_bytes(stage)
        covered = self.covered_param_bytes(stage)
        return self.spec.step_moments * covered + 2 * max(0, self.param_bytes(stage) - covered)

    def layer_state_bytes(self, layer: int, does_its_work: bool) -> int:
        """What one replica keeps of a covered layer's optimizer state: its declared `state`
        (copies x size each), the owner-only tensors where `does_its_work` (the replica does
        the layer's divisible work: every replica, unless the work is divided and another
        replica owns the layer), and the multi-step ones only with k > 1 (with k = 1 Shampoo's
        snapshot is its statistics themselves, runtime.optimizers.shampoo)."""
        return sum(t.copies * self.state_bytes(t, layer) for t in self.spec.state
                   if (does_its_work or not t.owner_only) and (self.refresh_steps > 1 or not t.multi_step))

    def resident_bytes(self, held) -> int:
        """Parameters, gradients, optimizer state and the covered layers' state, always held by
        a rank holding `held`: (stage, replica) pairs (or a {stage: replica} dict)."""
        pairs = sorted(held.items()) if isinstance(held, dict) else list(held)
        owner = self.precond_owner
        total = 0
        for s, r in pairs:
            total += self.param_bytes(s) + self.grad_bytes(s) + self.optimizer_state_bytes(s)
            if self.work:
                for l in self.stage_layers[s]:
                    total += self.layer_state_bytes(l, owner is None or owner[l] in (None, r))
        return total


def replica_share(costs: Costs, replicas: int) -> list[int | None]:
    """PipeFisher's division of a stage's covered layers between its replicas (pipe-fisher
    main_bert.py, `module_partitions`): the stage's B blocks (its parts that hold covered
    layers, in model order) give floor(B/R) consecutive blocks to each replica in turn;
    the B mod R blocks left over belong to every replica (None). Per covered layer: the
    replica that owns it, or None."""
    layers = costs.profile.covered_layers
    owner: list[int | None] = [None] * len(layers)
    for ls in costs.stage_layers:
        blocks = list(dict.fromkeys(layers[l].part for l in ls))
        size = len(blocks) // replicas
        for l in ls:
            j = blocks.index(layers[l].part)
            owner[l] = j // size if size and j < size * replicas else None
    return owner


def _divisible_work_ms(costs: Costs, spec, layer: int) -> float:
    """A layer's work that one replica does when the work is divided: its per-step ops and
    each factor's refresh (summed in that order, left to right)."""
    total = 0.0
    for kind in spec.step_kinds:
        total += costs.optimizer_op_ms(Op(kind, layer=layer))
    for f in spec.factors:
        total += costs.optimizer_op_ms(Op("inv", layer=layer, factor=f))
    return total


def precond_share(costs: Costs, replicas: int, mode: str) -> list[int | None]:
    """Who preconditions (and inverts) each covered layer under split preconditioning:
    "split" is PipeFisher's block division (replica_share: left-over blocks on every
    replica); "layers" divides each stage's layers one by one, longest preconditioning and
    inversion first, to the replica with the least such work so far (LPT): every layer has
    one owner and the replicas' shares differ by at most one layer's work."""
    if mode == "split":
        return replica_share(costs, replicas)
    layers = costs.profile.covered_layers
    owner: list[int | None] = [None] * len(layers)
    spec = costs.spec
    for ls in costs.stage_layers:
        load = [0.0] * replicas
        work = {l: _divisible_work_ms(costs, spec, l) for l in ls}
        for l in sorted(ls, key=lambda l: (-work[l], l)):
            r = min(range(replicas), key=lambda r: (load[r], r))
            owner[l] = r
            load[r] += work[l]
    return owner


def costs_of(profile: Profile, cfg: PipelineConfig) -> Costs:
    """The Costs of `cfg`: its partition (graph.partition.stage_partition), its ranks and,
    with replicas, its division of the preconditioning."""
    partition = stage_partition(profile, cfg)
    costs = Costs(profile, partition, cfg.replicas, cfg.inverse, cfg.optimizer, cluster=cfg.cluster,
                  stage_ranks=[cfg.replica_ranks(s) for s in range(cfg.num_stages)],
                  split_backward=cfg.split_backward, refresh_steps=cfg.refresh_steps, defer_stats=cfg.defer_stats)
    if cfg.optimizer_work and cfg.replicas > 1 and cfg.precond != "all":
        costs.precond_owner = precond_share(costs, cfg.replicas, cfg.precond)
    return costs
