"""The optimizers a plan can place, as data: the extra work each adds per covered layer.

A covered layer is one of the model's block `nn.Linear`s (the profile's `kfac_layers`, the
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

and, for the layer as a whole, the `factors` it refreshes once per cycle (K-FAC's A and B,
Shampoo's L and R) and the state it keeps (`state`, in pfcompile.graph.costs.Costs).

The op kinds are shared by role (pfcompile.formats.ops): `inv` is K-FAC's damped inverse
and Shampoo's inverse fourth root, `precond` either's preconditioning; the plan's
`config.optimizer` says which. What a name in `reads`/`writes` means:

| name | what it is |
|---|---|
| `input`, `output_grad` | a micro-batch's layer input (kept from its forward) / output gradient (kept from its weight-gradient pass) |
| `grad` | the layer's gradient of the step, synchronised over the stage's replicas; the update op (`update`) overwrites it in place with the update direction, which the step applies |
| `stat:F` | factor F's statistics (K-FAC: summed per micro-batch; Shampoo: an EMA per step) |
| `stat:F@0` | factor F's statistics as of the cycle's first step (Shampoo's snapshot) |
| `root:F` | factor F's inverse (K-FAC) or inverse root (Shampoo) computed this cycle, in force next cycle |
| `momentum` | Muon's momentum buffer |

This module is the contract: torch-, networkx- and ortools-free.
"""

from __future__ import annotations

from dataclasses import dataclass

MICRO_BATCH, STEP, CYCLE = "micro_batch", "step", "cycle"
# the passes a micro-batch op may read from: the forward (a layer's input) or the pass after
# which the micro-batch's weight gradients are complete (bwd, or a split backward's W)
PASS_FWD, PASS_WGRAD = "fwd", "wgrad"
# the prefixes of the names of a factor's statistics and of what the refresh computes from them
STAT, ROOT = "stat:", "root:"


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


KFAC = Optimizer(
    name="kfac",
    factors=("A", "B"),
    update="precond",
    doc="K-FAC: Kronecker factors A (layer inputs) and B (output gradients) from the cycle's "
        "first step, inverted once per cycle; every step's gradient preconditioned B^-1 G A^-1",
    ops=(
        OpDecl("curv_a", MICRO_BATCH, reads=("input",), writes=("stat:A",), factor="A"),
        OpDecl("curv_b", MICRO_BATCH, reads=("output_grad",), writes=("stat:B",), factor="B"),
        OpDecl("sync_curv", CYCLE, reads=("stat:F",), writes=("stat:F",), collective=True),
        # both factors: the pi-corrected damping splits the damping by their traces
        OpDecl("inv", CYCLE, reads=("stat:A", "stat:B"), writes=("root:F",), divide=True),
        OpDecl("bcast_inv", CYCLE, reads=("root:F",), writes=("root:F",), collective=True),
        OpDecl("precond", STEP, reads=("grad", "root:A", "root:B"), writes=("grad",), divide=True),
    ),
)

SHAMPOO = Optimizer(
    name="shampoo",
    factors=("L", "R"),
    update="precond",
    doc="Shampoo: L <- b L + (1-b) G G^T and R <- b R + (1-b) G^T G every step from the "
        "synchronised gradient; their inverse fourth roots once per cycle (from the cycle's "
        "first step's statistics); every step L^-1/4 G R^-1/4, grafted to the gradient's norm",
    ops=(
        OpDecl("stats", STEP, reads=("grad",), writes=("stat:L", "stat:R", "stat:L@0", "stat:R@0"), divide=True),
        OpDecl("inv", CYCLE, reads=("stat:F@0",), writes=("root:F",), divide=True),
        OpDecl("bcast_inv", CYCLE, reads=("root:F",), writes=("root:F",), collective=True),
        OpDecl("precond", STEP, reads=("grad", "root:L", "root:R"), writes=("grad",), divide=True),
    ),
)

MUON = Optimizer(
    name="muon",
    update="orth",
    doc="Muon: momentum, then five Newton-Schulz iterations orthogonalise each covered weight's "
        "update every step (torch.optim.Muon's); AdamW updates the rest",
    ops=(
        OpDecl("orth", STEP, reads=("grad", "momentum"), writes=("momentum", "grad"), divide=True),
    ),
)

ADAMW = Optimizer(name="adamw", ops=(), doc="AdamW on every parameter: the first-order baseline, no extra work")

OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (KFAC, SHAMPOO, MUON, ADAMW)}
NAMES = tuple(OPTIMIZERS)
# every kind some optimizer uses, and the factor letters any of them refreshes
OPTIMIZER_KINDS = frozenset().union(*(o.kinds for o in OPTIMIZERS.values()))
ALL_FACTORS = tuple(dict.fromkeys(f for o in OPTIMIZERS.values() for f in o.factors))
# ops that may run anywhere in the refresh cycle (listed once per cycle, on some step)
FLOATING_KINDS = frozenset(d.kind for o in OPTIMIZERS.values() for d in o.ops if d.when in (MICRO_BATCH, CYCLE))
# the optimizer ops that every replica of a stage runs together
OPTIMIZER_COLLECTIVE_KINDS = frozenset(d.kind for o in OPTIMIZERS.values() for d in o.ops if d.collective)


def optimizer(name: str) -> Optimizer:
    """The declaration of `name`; a ValueError lists the known ones."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r} (known: {', '.join(NAMES)})") from None
