"""The optimizers a plan can place, as data: the extra work each adds per covered layer.

A covered layer is one of the model's block `nn.Linear`s (the profile's `covered_layers`, the
plan's `layers`). An optimizer declares, for every op of its work:

- `when` it may run: per micro-batch of the refresh cycle's first step (after the pass
  whose tensor it reads), once per step after the stage's gradient is synchronised, or
  once per refresh cycle of k steps (anywhere in the cycle: floating, amortised);
- what it `reads` and `writes` (the names below), from which its dependencies follow
  (pfcompile.formats.dataflow: an op waits for the latest writer, in its scope, of each
  name it reads, and for the ops that read a name it overwrites);
- whether it is `collective`: run together by every replica of the stage (a reduction of
  statistics, a broadcast of a result from the replica that computed it);
- whether the replicas of a stage may `divide` it (`--precond split|layers`: each layer's
  work on one replica, the results gathered);
- what times it: its `cost` key in the profile's per-layer map of the optimizer's costs
  (`covered_layers[].optimizer_ms.NAME`; `{factor}` stands for the op's factor, `{inverse}`
  for the plan's inversion method, INVERSE_METHODS), or, for a collective, the `transfer`
  it makes (an all-reduce or a broadcast of the tensor it writes, sized by `state`);
- for a kind the renderer has no colour of its own for, `render`: its legend label and fill;

and, for the optimizer as a whole, the `factors` it refreshes once per cycle (K-FAC's A and
B, Shampoo's L and R), the `activation`: the cost key of the per-layer work of putting a
cycle's refreshed roots into force at the next cycle's start (the layer's `activate`, which
the runtime calls between steps: SOAP rotates its first moment into the new basis), the
`state` it keeps per covered layer (each tensor's shape from the layer's in/out features or
a byte field of the profile, how many copies, whether only the replica doing the layer's
divisible work keeps it), what its step keeps per covered parameter (`step_moments`) and
whose profiled step its own falls back to (`step_like`). pfcompile.graph.costs.Costs reads
all of it: durations and memory follow the declaration.

The op kinds are shared by role (pfcompile.formats.ops): `inv` is K-FAC's damped inverse
and Shampoo's inverse fourth root, `precond` either's preconditioning; the plan's
`config.optimizer` says which. What a name in `reads`/`writes` means:

| name | what it is |
|---|---|
| `input`, `output_grad` | a micro-batch's layer input (kept from its forward) / output gradient (kept from its weight-gradient pass) |
| `grad` | the layer's gradient of the step, synchronised over the stage's replicas; the update op (`update`) overwrites it in place with the update direction, which the step applies |
| `stat:F` | factor F's statistics (K-FAC: summed per micro-batch; Shampoo: an EMA per step) |
| `stat:F@0` | factor F's statistics as of the cycle's first step (Shampoo's snapshot) |
| `root:F` | factor F's inverse (K-FAC), inverse root (Shampoo) or eigenbasis (SOAP) computed this cycle, in force next cycle |
| `momentum` | Muon's momentum buffer |
| `moments` | SOAP's Adam moments (in the eigenbasis); Shampoo's gradient average and graft's second moment |
| `kept_grad` | deferred statistics (`Optimizer.with_deferred_stats`): the raw gradient the update keeps before overwriting it, folded into the statistics in the next step |

This module is the contract: torch-, networkx- and ortools-free.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

MICRO_BATCH, STEP, CYCLE = "micro_batch", "step", "cycle"
# the passes a micro-batch op may read from: the forward (a layer's input) or the pass after
# which the micro-batch's weight gradients are complete (bwd, or a split backward's W)
PASS_FWD, PASS_WGRAD = "fwd", "wgrad"
# the prefixes of the names of a factor's statistics and of what the refresh computes from them
STAT, ROOT = "stat:", "root:"
# what a collective op does with the tensor it writes (OpDecl.transfer)
ALLREDUCE, BROADCAST = "allreduce", "broadcast"
# the methods a cost key's `{inverse}` is profiled for (K-FAC's damped inverse)
INVERSE_METHODS = ("cholesky", "eigen")
# a state tensor's dimensions, from its covered layer (StateDecl.shape)
IN, IN_BIAS, OUT = "in", "in+bias", "out"
# the raw gradient an optimizer with deferred statistics keeps for the next step's statistics
KEPT_GRAD = "kept_grad"


@dataclass(frozen=True)
class OpDecl:
    """One op of an optimizer's work (module docstring)."""

    kind: str
    when: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    factor: str | None = None  # a micro-batch op: the factor whose statistics it adds to
    divide: bool = False  # the stage's replicas may divide it layer by layer
    collective: bool = False  # run together by every replica of the stage
    cost: str | None = None  # its per-layer cost key in the profile (module doc)
    transfer: str | None = None  # a collective: ALLREDUCE or BROADCAST of what it writes
    # FLOPs on an out x in layer (m, n) for `factor`: reference profiles estimate its cost from them
    flops: Callable[[int, int, str | None], float] | None = None
    render: tuple[str, str] | None = None  # (legend label, fill colour) where the renderer has none
    text: str = ""  # the prefix of its compact text form (pfcompile.formats.ops: "CA7.5", "I3.L")

    @property
    def fields(self) -> tuple[str, ...]:
        """The op's fields (pfcompile.formats.ops.Op): a micro-batch op names its layer and
        micro-batch, a per-cycle op its layer and factor (and a broadcast its source rank),
        a per-step op its layer."""
        if self.when == MICRO_BATCH:
            return ("layer", "mb")
        if self.when == CYCLE:
            return ("layer", "factor", "peer") if self.transfer == BROADCAST else ("layer", "factor")
        return ("layer",)


@dataclass(frozen=True)
class StateDecl:
    """A tensor an optimizer keeps per covered layer, for the memory model. Its size: the
    profile's per-layer byte field `bytes_field` where given (what the profiler measured),
    else rows x cols of the state's element size."""

    name: str  # as in reads/writes: "stat:A", "root:L", "momentum"
    shape: tuple[str, str] = (OUT, IN)  # (rows, cols), each IN, IN_BIAS or OUT
    copies: int = 1
    owner_only: bool = False  # kept only where the layer's divisible work runs (its owner)
    multi_step: bool = False  # kept only with a refresh cycle of k > 1 steps (a snapshot)
    bytes_field: str | None = None


@dataclass(frozen=True)
class Optimizer:
    """An optimizer's work per covered layer. `update` is the per-step op that turns the
    synchronised gradient into the layer's update direction (None: the step applies the
    gradient as it is, the first-order baseline)."""

    name: str
    ops: tuple[OpDecl, ...]
    factors: tuple[str, ...] = ()
    update: str | None = None
    doc: str = ""
    title: str = ""  # how pictures name its work ("" : the name)
    state: tuple[StateDecl, ...] = ()
    covers_bias: bool = False  # its update covers the layers' biases too (K-FAC's [W | b])
    step_moments: int = 0  # tensors its step keeps per covered parameter (SGD's momentum: 1)
    # the state whose element size, as profiled, the covered parameters are counted at (K-FAC:
    # its factors', "stat:A"); None: the state element size (float32, float64 in a float64 run)
    covered_element_of: str | None = None
    step_like: str = "adamw"  # whose profiled per-part step entry its step uses where it has none
    deferred_stats: bool = False  # its per-step statistics fold the previous step's kept gradient
    # the cost key of a layer's activation (module doc); optional in a profile (older ones: 0),
    # and its FLOPs on an out x in layer, for reference profiles
    activation: str | None = None
    activation_flops: Callable[[int, int, str | None], float] | None = None

    @property
    def label(self) -> str:
        return self.title or self.name

    def cost_keys(self) -> tuple[str, ...]:
        """Its per-layer cost entries in a profile, in the order its ops run: each op's `cost`
        key, expanded over its factors and the inversion methods where the key names them."""
        keys: list[str] = []
        for d in self.ops:
            if d.cost is None:
                continue
            for f in (self.factors if "{factor}" in d.cost else (None,)):
                for m in (INVERSE_METHODS if "{inverse}" in d.cost else (None,)):
                    keys.append(d.cost.format(factor=f, inverse=m))
        return tuple(dict.fromkeys(keys))

    def cost_key(self, kind: str, factor: str | None, inverse: str) -> str | None:
        """The profile entry that times one op of `kind` (None: not a per-layer compute op)."""
        d = self.op(kind)
        return None if d is None or d.cost is None else d.cost.format(factor=factor, inverse=inverse)

    def state_decl(self, name: str) -> StateDecl | None:
        return next((t for t in self.state if t.name == name), None)

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(d.kind for d in self.ops)

    def op(self, kind: str) -> OpDecl | None:
        return next((d for d in self.ops if d.kind == kind), None)

    @property
    def micro_batch_ops(self) -> tuple[OpDecl, ...]:
        return tuple(d for d in self.ops if d.when == MICRO_BATCH)

    @property
    def step_stats(self) -> str | None:
        """The per-step op that adds the step's gradient to the statistics (Shampoo's), if any."""
        return next((d.kind for d in self.ops if d.when == STEP and d.kind != self.update), None)

    @property
    def step_kinds(self) -> tuple[str, ...]:
        """The per-layer ops of every step, in the order they run: statistics, then the update."""
        return tuple(k for k in (self.step_stats, self.update) if k is not None)

    def _cycle_op(self, prefix: str, collective: bool) -> str | None:
        return next((d.kind for d in self.ops if d.when == CYCLE and d.collective == collective
                     and any(w.startswith(prefix) for w in d.writes)), None)

    @property
    def reduction(self) -> str | None:
        """The collective that sums the statistics over the stage's replicas (K-FAC's sync_curv), if any."""
        return self._cycle_op(STAT, collective=True)

    @property
    def reduces(self) -> bool:
        """Whether the micro-batch statistics are summed over the replicas."""
        return self.reduction is not None

    @property
    def refresh(self) -> str | None:
        """The per-cycle op that computes each factor's root from its statistics (inv), if any."""
        return self._cycle_op(ROOT, collective=False)

    @property
    def broadcast(self) -> str | None:
        """The collective that copies a factor's root from the replica that computed it to
        the others (bcast_inv; its `peer` is that source), if any."""
        return self._cycle_op(ROOT, collective=True)

    @property
    def refreshes(self) -> bool:
        """Whether it computes something once per refresh cycle (factors' inverses or roots)."""
        return bool(self.factors)

    @property
    def has_work(self) -> bool:
        return bool(self.ops)

    @property
    def divisible(self) -> bool:
        """Whether the replicas of a stage may divide the per-layer work (--precond split|layers)."""
        return any(d.divide for d in self.ops)

    @property
    def can_defer_stats(self) -> bool:
        """Whether it has per-step statistics of the gradient that its update overwrites."""
        stats, update = self.op(self.step_stats or ""), self.op(self.update or "")
        return stats is not None and update is not None and "grad" in stats.reads and "grad" in update.writes

    def with_deferred_stats(self) -> Optimizer:
        """The same optimizer with deferred statistics: the update keeps the raw gradient
        (`kept_grad`) before overwriting it, and the next step's statistics fold that one.
        The statistics then wait for nothing of their own step, only the update waits for
        them (it overwrites what they read): the planner may put them into any bubble of
        the step, before the step's gradient exists. The cost: one gradient-sized buffer
        per layer, and roots one step older."""
        if self.deferred_stats:
            return self
        if not self.can_defer_stats:
            raise ValueError(f"optimizer {self.name!r} has no per-step statistics to defer")
        ops = []
        for d in self.ops:
            if d.kind == self.step_stats:
                d = replace(d, reads=tuple(KEPT_GRAD if r == "grad" else r for r in d.reads))
            elif d.kind == self.update:
                d = replace(d, writes=(*d.writes, KEPT_GRAD))
            ops.append(d)
        return replace(self, ops=tuple(ops), deferred_stats=True,
                       state=(*self.state, StateDecl(KEPT_GRAD, (OUT, IN), owner_only=True)))


# the copy of a factor's refreshed root from the replica that computed it to the others (all three refreshers')
ROOT_BROADCAST = OpDecl("bcast_inv", CYCLE, text="BI", reads=("root:F",), writes=("root:F",), collective=True,
                        transfer=BROADCAST)

KFAC = Optimizer(
    name="kfac",
    title="K-FAC",
    factors=("A", "B"),
    update="precond",
    covers_bias=True,
    step_moments=1,
    covered_element_of="stat:A",
    step_like="kfac",
    # accumulator and factor of A and B on every replica (each adds its micro-batches' curvature);
    # the inverses in force and pending where it preconditions; sized as the profiler measured them
    state=(
        StateDecl("stat:A", (IN_BIAS, IN_BIAS), copies=2, bytes_field="factor_a_bytes"),
        StateDecl("stat:B", (OUT, OUT), copies=2, bytes_field="factor_b_bytes"),
        StateDecl("root:A", (IN_BIAS, IN_BIAS), copies=2, owner_only=True, bytes_field="inverse_a_bytes"),
        StateDecl("root:B", (OUT, OUT), copies=2, owner_only=True, bytes_field="inverse_b_bytes"),
    ),
    doc="K-FAC: Kronecker factors A (layer inputs) and B (output gradients) from the cycle's "
        "first step, inverted once per cycle; every step's gradient preconditioned B^-1 G A^-1",
    ops=(
        OpDecl("curv_a", MICRO_BATCH, text="CA", reads=("input",), writes=("stat:A",), factor="A",
               cost="curv_a"),
        OpDecl("curv_b", MICRO_BATCH, text="CB", reads=("output_grad",), writes=("stat:B",), factor="B",
               cost="curv_b"),
        OpDecl("sync_curv", CYCLE, text="YC", reads=("stat:F",), writes=("stat:F",), collective=True, transfer=ALLREDUCE),
        # both factors: the pi-corrected damping splits the damping by their traces
        OpDecl("inv", CYCLE, text="I", reads=("stat:A", "stat:B"), writes=("root:F",), divide=True,
               cost="inv_{factor}.{inverse}"),
        ROOT_BROADCAST,
        OpDecl("precond", STEP, text="P", reads=("grad", "root:A", "root:B"), writes=("grad",), divide=True, cost="precond"),
    ),
)

def _two_sided_flops(m: int, n: int, factor: str | None) -> float:
    """G G^T and G^T G (Shampoo's statistics), or L^-1/4 G R^-1/4 (its preconditioning)."""
    return 2 * m * m * n + 2 * m * n * n


# FLOPs of a symmetric eigendecomposition with eigenvectors (LAPACK syevd, about 9 d^3) and of
# rebuilding the root from it (Q diag Q^T, 2 d^3)
EIGH_FLOPS_PER_D3 = 9 + 2
NS_STEPS = 5  # torch.optim.Muon's Newton-Schulz iterations


def _root_flops(m: int, n: int, factor: str | None) -> float:
    d = m if factor == "L" else n
    return EIGH_FLOPS_PER_D3 * d ** 3


def _newton_schulz_flops(m: int, n: int, factor: str | None) -> float:
    """NS_STEPS iterations on the p x q update (p <= q): X X^T, a A + b A^2, (..) X."""
    p, q = min(m, n), max(m, n)
    return NS_STEPS * (4 * p * p * q + 2 * p ** 3)


# Shampoo's statistics of both sides, their cycle's snapshot and what is refreshed from it,
# where it preconditions (with k = 1 the snapshot is the statistics themselves): SOAP's too
TWO_SIDED_STATE = (
        StateDecl("stat:L", (OUT, OUT), owner_only=True),
        StateDecl("stat:L@0", (OUT, OUT), owner_only=True, multi_step=True),
        StateDecl("root:L", (OUT, OUT), copies=2, owner_only=True),
        StateDecl("stat:R", (IN, IN), owner_only=True),
        StateDecl("stat:R@0", (IN, IN), owner_only=True, multi_step=True),
        StateDecl("root:R", (IN, IN), copies=2, owner_only=True),
)
TWO_SIDED_STATS = OpDecl("stats", STEP, text="ST", reads=("grad",), writes=("stat:L", "stat:R", "stat:L@0", "stat:R@0"),
                         divide=True, cost="stats", flops=_two_sided_flops)


# a factor's root (Shampoo) or eigenbasis (SOAP) from the cycle's snapshot, timed as an eigh
TWO_SIDED_REFRESH = OpDecl("inv", CYCLE, text="I", reads=("stat:F@0",), writes=("root:F",), divide=True,
                           cost="inv_{factor}", flops=_root_flops)


SHAMPOO = Optimizer(
    name="shampoo",
    title="Shampoo",
    factors=("L", "R"),
    update="precond",
    step_moments=1,
    step_like="kfac",  # SGD-momentum on the covered weights, AdamW on the rest, as K-FAC's step
    # where it preconditions: statistics, the cycle's snapshot (k > 1; with k = 1 the snapshot is
    # the statistics themselves), the roots in force and pending
    state=(
        *TWO_SIDED_STATE,
        StateDecl("moments", (OUT, IN), copies=2, owner_only=True),  # β1's average, the graft's second moment
    ),
    doc="Shampoo: L <- b L + (1-b) G G^T and R <- b R + (1-b) G^T G every step from the "
        "synchronised gradient; their inverse fourth roots once per cycle (from the cycle's "
        "first step's statistics); every step L^-1/4 m R^-1/4 of the gradient's average m, "
        "grafted to the norm of Adam's (AdaGrad's, RMSprop's, SGD's) direction",
    ops=(
        TWO_SIDED_STATS,
        TWO_SIDED_REFRESH,
        ROOT_BROADCAST,
        OpDecl("precond", STEP, text="P", reads=("grad", "root:L", "root:R", "moments"), writes=("grad", "moments"),
               divide=True, cost="precond", flops=_two_sided_flops),
    ),
)


def _rotations_flops(m: int, n: int, factor: str | None) -> float:
    """SOAP's update: G into the basis and Adam's direction back out, two two-sided products."""
    return 2 * _two_sided_flops(m, n, factor)


SOAP = Optimizer(
    name="soap",
    title="SOAP",
    factors=("L", "R"),
    update="precond",
    step_like="kfac",  # SGD (no momentum) on the covered weights, AdamW on the rest
    # where it preconditions: Shampoo's statistics and snapshots, the bases in force and
    # pending, Adam's two moments
    state=(
        *TWO_SIDED_STATE,
        StateDecl("moments", (OUT, IN), copies=2, owner_only=True),
    ),
    doc="SOAP: Shampoo's statistics every step; their eigenbasis once per cycle (an eigh, then "
        "one power-iteration-and-QR step per refresh); every step Adam in that basis",
    ops=(
        TWO_SIDED_STATS,
        TWO_SIDED_REFRESH,  # timed and estimated as the first refresh (an eigh): an upper bound on the QR steps
        ROOT_BROADCAST,
        OpDecl("precond", STEP, text="P", reads=("grad", "root:L", "root:R", "moments"), writes=("grad", "moments"),
               divide=True, cost="precond", flops=_rotations_flops),
    ),
    # the first moment out of the old basis and into the new one: two two-sided products
    activation="activate",
    activation_flops=_rotations_flops,
)

MUON = Optimizer(
    name="muon",
    title="Muon",
    update="orth",
    state=(StateDecl("momentum", (OUT, IN), owner_only=True),),  # where it orthogonalises
    doc="Muon: momentum, then five Newton-Schulz iterations orthogonalise each covered weight's "
        "update every step (torch.optim.Muon's); AdamW updates the rest",
    ops=(
        OpDecl("orth", STEP, text="O", reads=("grad", "momentum"), writes=("momentum", "grad"), divide=True, cost="orth",
               flops=_newton_schulz_flops),
    ),
)

ADAMW = Optimizer(name="adamw", title="AdamW", ops=(), doc="AdamW on every parameter: the first-order baseline, no extra work")

OPTIMIZERS: dict[str, Optimizer] = {}
# every kind some optimizer uses, and the factor letters any of them refreshes (grown by register)
OPTIMIZER_KINDS: set[str] = set()
ALL_FACTORS: list[str] = []
# ops that may run anywhere in the refresh cycle (listed once per cycle, on some step)
FLOATING_KINDS: set[str] = set()
# the optimizer ops that every replica of a stage runs together
OPTIMIZER_COLLECTIVE_KINDS: set[str] = set()
# what the op vocabulary learns of each new kind (pfcompile.formats.ops adds itself)
ON_REGISTER: list[Callable[[OpDecl], None]] = []  # listener(decl): a kind new to the vocabulary
# the text prefixes of the pipeline's own ops (pfcompile.formats.ops.OP_KINDS checks it has these)
PIPELINE_TEXT = frozenset({"F", "B", "IB", "W", "SA", "RA", "SG", "RG", "YG", "YR", "YA", "U"})
ON_FORGET: list[Callable[[str], None]] = []  # listener(kind): no optimizer declares it any more


def register(spec: Optimizer) -> Optimizer:
    """Make an optimizer known to the compiler (and, through pfcompile.formats.ops, its op
    kinds to the vocabulary). A kind another optimizer declares already must have the same
    text form; a new kind needs a text prefix of its own. Registering the same declaration
    again (a module imported twice) changes nothing."""
    old = OPTIMIZERS.get(spec.name)
    if old is not None:
        if old == spec:
            return old
        raise ValueError(f"optimizer {spec.name!r} is registered already, with another declaration")
    known = {d.kind: d for o in OPTIMIZERS.values() for d in o.ops}
    for d in spec.ops:
        if d.kind in known:
            if (known[d.kind].text, known[d.kind].fields) != (d.text, d.fields):
                raise ValueError(f"optimizer {spec.name!r}: op {d.kind!r} is declared with another text form "
                                 f"or fields than {known[d.kind].text!r}, {known[d.kind].fields}")
        elif not re.fullmatch(r"[A-Z]{1,3}", d.text):
            raise ValueError(f"optimizer {spec.name!r}: op {d.kind!r} needs a text prefix of 1-3 capitals (text=...)")
    new = [d.text for d in spec.ops if d.kind not in known]
    taken = PIPELINE_TEXT | {d.text for d in known.values()}
    if len(set(new)) != len(new) or set(new) & taken:
        raise ValueError(f"optimizer {spec.name!r}: its new op kinds need text prefixes of their own "
                         f"({', '.join(new)}; taken: {', '.join(sorted(taken))})")
    if spec.update is not None and spec.op(spec.update) is None:
        raise ValueError(f"optimizer {spec.name!r}: its update {spec.update!r} is not one of its ops")
    OPTIMIZERS[spec.name] = spec
    ALL_FACTORS.extend(f for f in spec.factors if f not in ALL_FACTORS)
    for d in spec.ops:
        OPTIMIZER_KINDS.add(d.kind)
        if d.when in (MICRO_BATCH, CYCLE):
            FLOATING_KINDS.add(d.kind)
        if d.collective:
            OPTIMIZER_COLLECTIVE_KINDS.add(d.kind)
        if d.kind not in known:
            for listener in ON_REGISTER:
                listener(d)
    return spec


for _builtin in (KFAC, SHAMPOO, SOAP, MUON, ADAMW):
    register(_builtin)
NAMES = tuple(OPTIMIZERS)  # the built-in ones; a plugin is named "package.module:name"


def unregister(name: str) -> None:
    """Forget an optimizer (a plugin's tests clean up after themselves): the kinds no other
    optimizer declares leave the vocabulary, the factors none refreshes are no longer valid."""
    spec = OPTIMIZERS.pop(name, None)
    if spec is None:
        return
    declared = {d.kind for o in OPTIMIZERS.values() for d in o.ops}
    for d in spec.ops:
        if d.kind not in declared:
            for kinds in (OPTIMIZER_KINDS, FLOATING_KINDS, OPTIMIZER_COLLECTIVE_KINDS):
                kinds.discard(d.kind)
            for listener in ON_FORGET:
                listener(d.kind)
    refreshed = {f for o in OPTIMIZERS.values() for f in o.factors}
    ALL_FACTORS[:] = [f for f in ALL_FACTORS if f in refreshed]


def optimizer(name: str, defer_stats: bool = False) -> Optimizer:
    """The declaration of `name` (`defer_stats`: its variant with deferred statistics,
    Optimizer.with_deferred_stats; a ValueError where it has none). A name "package.module:attribute" imports the module first:
    it registers its optimizer under that name, or its attribute is the declaration (or an
    object whose `declaration` is, as a runtime registry entry), registered now. A plugin
    keeps the declaration and its math in that one module. A ValueError lists the known ones."""
    if name not in OPTIMIZERS and isinstance(name, str) and ":" in name:
        module, _, attribute = name.partition(":")
        try:
            found = getattr(importlib.import_module(module), attribute, None)
        except Exception as e:  # noqa: BLE001 - any failure is the plugin's: one line
            raise ValueError(f"optimizer {name!r}: cannot import {module!r} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
        declared = found if isinstance(found, Optimizer) else getattr(found, "declaration", None)
        if name not in OPTIMIZERS and isinstance(declared, Optimizer) and declared.name == name:
            register(declared)
    try:
        spec = OPTIMIZERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown optimizer {name!r} (known: {', '.join(OPTIMIZERS)}, "
                         "or package.module:name for a plugin)") from None
    if not defer_stats:
        return spec
    got = _DEFERRED.get(name)
    if got is None or got[0] is not spec:  # (re-registered under the same name)
        got = _DEFERRED[name] = (spec, spec.with_deferred_stats())
    return got[1]


_DEFERRED: dict[str, tuple[Optimizer, Optimizer]] = {}  # name -> (declaration, its deferred variant)
