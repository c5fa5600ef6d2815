"""The op vocabulary: one list, used by planner, plan file, renderer and runtime.

An `Op` is the unit a rank executes. It is plain data (hashable, ordered) with a compact
text form in the spirit of torch.distributed.pipelining's actions:

| op          | text             | fields                                   |
|-------------|------------------|------------------------------------------|
| fwd         | F3.5             | stage 3, micro-batch 5                   |
| bwd         | B3.5             | the whole backward (input and weight gradients) |
| bwd_input   | IB3.5            | split backward (zero-bubble families): input gradient only, the critical path |
| bwd_weight  | W3.5             | split backward: the weight gradients of (stage 3, mb 5), after its IB |
| send_act    | SA3.5>2          | activation made by stage 3, mb 5, to rank 2   |
| recv_act    | RA3.5<0          | activation made by stage 3, mb 5, from rank 0 |
| send_grad   | SG3.5>1          | input-gradient made by stage 3, mb 5, to rank 1 |
| recv_grad   | RG3.5<1          |                                          |
| curv_a      | CA7.5            | factor A of K-FAC layer 7, micro-batch 5 |
| curv_b      | CB7.5            | factor B of K-FAC layer 7, micro-batch 5 |
| sync_curv   | YC7.A            | all-reduce factor A of layer 7 between the stage's replicas |
| inv         | I7.A             | invert factor A of layer 7 (K-FAC), or its inverse fourth root (Shampoo: I7.L, I7.R) |
| bcast_inv   | BI7.A<2          | broadcast inverse of A of layer 7 from rank 2 to the stage's replicas |
| stats       | ST7              | Shampoo: add the step's gradient of layer 7 to its statistics L and R |
| orth        | O7               | Muon: momentum and Newton-Schulz orthogonalisation of layer 7's update |
| sync_grad   | YG3              | all-reduce stage 3's gradients between replicas |
| rs_grad     | YR3              | split preconditioning: reduce-scatter stage 3's gradients (each replica gets the sum for the layers it preconditions; the rest all-reduced) |
| ag_grad     | YA3              | split preconditioning: all-gather stage 3's preconditioned gradients (each layer's from the replica that preconditioned it) |
| precond     | P7               | precondition layer 7's gradient          |
| step        | U3               | optimizer update of stage 3              |

Conventions that every consumer relies on:
- `stage` is the model stage (0..S-1, S = stages × virtual chunks); `mb` is the global
  micro-batch index within one training step (0..M-1, M = all micro-batches of all
  replicas), so (stage, mb) names one forward exactly and the data slice is mb's.
- send and recv of one message carry the same key (kind, stage, mb): `stage` is always
  the *producing* stage (for send_grad/recv_grad the stage whose backward made the
  input-gradient). `peer` is the other rank.
- a zero-bubble family (`SPLIT_BACKWARD_SCHEDULES`) lists `bwd_input` and `bwd_weight`
  for every (stage, mb) instead of `bwd`: send_grad follows bwd_input; the weight
  gradients (sync_grad, precond, step, and curv_b, which shares the output gradients W
  keeps) wait for bwd_weight; the stage's activations live until bwd_weight ends.
- `layer` is an index into the plan's list of covered layers; `factor` is one the plan's
  optimizer refreshes (K-FAC "A"/"B", Shampoo "L"/"R"). Which optimizer's work an op is
  (and so what `inv` and `precond` compute) is the plan's `config.optimizer`
  (pfcompile.formats.optimizers declares each optimizer's ops).
- with split preconditioning (plan config `precond` "split", `precond_owner[layer]`: the
  replica that preconditions the layer, or null: every replica) a stage with owned layers
  lists rs_grad, the precond of its own and the unowned layers, ag_grad, step, instead of
  sync_grad, precond of every layer, step.
- sync_curv, bcast_inv, sync_grad, rs_grad and ag_grad are collectives over the ranks that hold a replica
  of the stage: every member lists the op, in the same order relative to its other
  collectives on that group. `peer` on bcast_inv is the source rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pfcompile.formats.errors import echo
from pfcompile.formats.optimizers import (
    ALL_FACTORS,
    ON_FORGET,
    ON_REGISTER,
    OPTIMIZER_COLLECTIVE_KINDS,
    OPTIMIZER_KINDS,
    OPTIMIZERS,
    PIPELINE_TEXT,
)
from pfcompile.formats.optimizers import FLOATING_KINDS as FLOATING_KINDS  # re-exported: the op vocabulary's

# kind -> (text prefix, fields that must be set): the pipeline's here, each optimizer op's
# from its declaration (added as the optimizer is registered, below)
OP_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fwd": ("F", ("stage", "mb")),
    "bwd": ("B", ("stage", "mb")),
    "bwd_input": ("IB", ("stage", "mb")),
    "bwd_weight": ("W", ("stage", "mb")),
    "send_act": ("SA", ("stage", "mb", "peer")),
    "recv_act": ("RA", ("stage", "mb", "peer")),
    "send_grad": ("SG", ("stage", "mb", "peer")),
    "recv_grad": ("RG", ("stage", "mb", "peer")),
    "sync_grad": ("YG", ("stage",)),
    "rs_grad": ("YR", ("stage",)),
    "ag_grad": ("YA", ("stage",)),
    "step": ("U", ("stage",)),
}
PIPELINE_KINDS = frozenset({"fwd", "bwd", "bwd_input", "bwd_weight", "send_act", "recv_act", "send_grad", "recv_grad"})
PASS_KINDS = frozenset({"fwd", "bwd", "bwd_input", "bwd_weight"})  # compute passes of (stage, mb)
# the families whose backward is split into bwd_input (B) and bwd_weight (W)
SPLIT_BACKWARD_SCHEDULES = frozenset({"zb-h1", "zb-v", "dualpipev"})


def backward_kinds(schedule: str) -> tuple[str, ...]:
    """The backward ops of every (stage, mb) in a family: ("bwd",) or ("bwd_input", "bwd_weight")."""
    return ("bwd_input", "bwd_weight") if schedule in SPLIT_BACKWARD_SCHEDULES else ("bwd",)


def input_grad_kind(schedule: str) -> str:
    """The op that makes a stage's input gradient (what send_grad waits for)."""
    return "bwd_input" if schedule in SPLIT_BACKWARD_SCHEDULES else "bwd"


def weight_grad_kind(schedule: str) -> str:
    """The op after which a stage's weight gradients of one micro-batch are complete."""
    return "bwd_weight" if schedule in SPLIT_BACKWARD_SCHEDULES else "bwd"

P2P_KINDS = frozenset({"send_act", "recv_act", "send_grad", "recv_grad"})
# the pipeline's collectives and those the optimizers declare (pfcompile.formats.optimizers)
COLLECTIVE_KINDS = {"sync_grad", "rs_grad", "ag_grad"} | OPTIMIZER_COLLECTIVE_KINDS
# An optimizer's work (pfcompile.formats.optimizers). FLOATING_KINDS, from there: the
# refresh's work, which a plan may put in any step of the cycle (it is named without a
# step: listed once per cycle on its rank); every other op is listed once per step.
# Ops whose time counts as the device being busy (communication is waiting).
# The optimizers' ops are compute unless they are declared collective.
COMPUTE_KINDS = {"fwd", "bwd", "bwd_input", "bwd_weight", "step"} | (OPTIMIZER_KINDS - COLLECTIVE_KINDS)
FACTORS = ALL_FACTORS
STREAMS = ("compute", "p2p", "collective", "runtime")  # display order too (pfcompile.formats.trace)
# The runtime's own work between a rank's ops, which a measured trace records on its
# "runtime" row (runtime.observe.measure.Timeline.span) and `pfcompile inspect --against`
# splits "between ops" by: name -> what it is.
RUNTIME_SPANS = {
    "batch": "the step's batch made and split into micro-batches",
    "activate": "the refresh's new inverses or roots put into force",
    "post_recv": "the step's receives posted ahead",
    "drain": "the step's sends completed",
    "verdict": "the divergence check (the last one read, this one posted)",
    "finish": "the clipped updates after the global norm's all-reduce",
    "flush": "the logged losses' reduction posted",
    "gc": "the garbage collector",
}


def stream_of(kind: str) -> str:
    """The stream an op kind runs on (the same rule for the planner, the plan's and the
    runtime's traces)."""
    if kind in P2P_KINDS:
        return "p2p"
    if kind in COLLECTIVE_KINDS:
        return "collective"
    return "compute"


def stage_served(op: Op) -> int | None:
    """The model stage whose rank runs `op`: a receive carries the producing stage but runs
    on the neighbouring stage it feeds (recv_act on stage + 1, recv_grad on stage - 1).
    None for ops named by layer (their stage is the plan's layer_stage)."""
    if op.kind == "recv_act":
        return op.stage + 1
    if op.kind == "recv_grad":
        return op.stage - 1
    return op.stage


def peer_stage(op: Op) -> int:
    """The stage at the other end of a point-to-point op: the consumer for a send, the
    producer (the op's own `stage`) for a receive."""
    if op.kind == "send_act":
        return op.stage + 1
    if op.kind == "send_grad":
        return op.stage - 1
    if op.kind in ("recv_act", "recv_grad"):
        return op.stage
    raise ValueError(f"{op} is not a point-to-point op")


_FIELDS = ("stage", "mb", "layer", "factor", "peer")
# kind -> for each of _FIELDS, whether the kind needs it (checked on every Op made: hot)
_NEED = {kind: tuple(f in need for f in _FIELDS) for kind, (_, need) in OP_KINDS.items()}


@dataclass(frozen=True, order=True)
class Op:
    kind: str
    stage: int | None = None
    mb: int | None = None
    layer: int | None = None
    factor: str | None = None
    peer: int | None = None
    # the hash, computed once: ops key every dict and graph of the planner (millions of
    # lookups on a 32 x 128 cycle); equal ops have equal fields, hence equal hashes
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:  # the generated one builds two tuples per comparison
        if self is other:
            return True
        if other.__class__ is not Op:
            return NotImplemented
        return (self._hash == other._hash and self.kind == other.kind and self.stage == other.stage
                and self.mb == other.mb and self.layer == other.layer and self.factor == other.factor
                and self.peer == other.peer)

    def __post_init__(self):
        kind = self.kind
        values = (self.stage, self.mb, self.layer, self.factor, self.peer)
        object.__setattr__(self, "_hash", hash((kind,) + values))
        need = _NEED.get(kind)
        if need is None:
            raise ValueError(f"unknown op {echo(kind)} (known: {', '.join(OP_KINDS)})")
        for f, v, needed in zip(_FIELDS, values, need):
            if v is None:
                if needed:
                    raise ValueError(f"op {kind} needs field {f!r}")
            elif not needed:
                raise ValueError(f"op {kind} takes no field {echo(f)}")
            elif f == "factor":
                if v not in FACTORS:
                    raise ValueError(f"factor must be one of {', '.join(FACTORS)}, got {echo(v)}")
            elif type(v) is not int or v < 0:  # not a bool either (type(True) is bool)
                raise ValueError(f"field {f!r} must be a non-negative int, got {echo(v)}")

    # --- text form -------------------------------------------------------------------
    def __str__(self) -> str:
        prefix, fields = OP_KINDS[self.kind]
        if fields[0] == "stage":
            head = f"{prefix}{self.stage}" + (f".{self.mb}" if self.mb is not None else "")
        else:
            head = f"{prefix}{self.layer}" + (f".{self.mb}" if self.mb is not None else "") + (
                f".{self.factor}" if self.factor is not None else "")
        if self.peer is None:
            return head
        return head + (">" if self.kind.startswith("send") else "<") + str(self.peer)

    @property
    def text(self) -> str:
        return str(self)

    # --- dict form (the plan file) ------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.kind}
        for f in _FIELDS:
            v = getattr(self, f)
            if v is not None:
                d[f] = v
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Op:
        """Build from a plan-file dict; extra keys (start, end, ...) are ignored. Raises ValueError."""
        if not isinstance(d, dict):
            raise ValueError(f"expected an object, got {type(d).__name__}")
        kind = d.get("op")
        if not isinstance(kind, str):
            raise ValueError("missing 'op'")
        return Op(kind, **{f: d.get(f) for f in _FIELDS})

    @property
    def is_optimizer_work(self) -> bool:
        """An op of an optimizer's extra work (pfcompile.formats.optimizers), not the pipeline's."""
        return self.kind in OPTIMIZER_KINDS

    @property
    def is_p2p(self) -> bool:
        return self.kind in P2P_KINDS

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS

    def message_key(self) -> tuple:
        """The key shared by a send and its receive (kind without direction, stage, mb)."""
        assert self.is_p2p
        return ("act" if self.kind.endswith("act") else "grad", self.stage, self.mb)


_BY_PREFIX = {prefix: kind for kind, (prefix, _) in OP_KINDS.items()}
_TEXT: dict[tuple[int, int], re.Pattern] = {}  # by (kinds, factors) known: a plugin may add either


def _text_pattern() -> re.Pattern:
    key = (len(_BY_PREFIX), len(FACTORS))
    if key not in _TEXT:
        prefixes = "|".join(sorted(_BY_PREFIX, key=lambda p: (-len(p), p)))  # longest first: "IB" before "I"
        factors = "|".join(re.escape(f) for f in FACTORS)
        _TEXT[key] = re.compile(rf"^({prefixes})(\d+)(?:\.(\d+|{factors}))?(?:([<>])(\d+))?$")
    return _TEXT[key]


def parse_op(text: str) -> Op:
    """Inverse of str(op). Raises ValueError on anything else."""
    m = _text_pattern().match(text.strip())
    if not m:
        raise ValueError(f"not an op: {echo(text)}")
    prefix, a, b, arrow, peer = m.groups()
    kind = _BY_PREFIX[prefix]
    fields = OP_KINDS[kind][1]
    values = {fields[0]: int(a)}
    if "mb" in fields:
        if b is None or not b.isdigit():
            raise ValueError(f"not an op: {echo(text)}")
        values["mb"] = int(b)
    elif "factor" in fields:
        if b not in FACTORS:
            raise ValueError(f"not an op: {echo(text)}")
        values["factor"] = b
    elif b is not None:
        raise ValueError(f"not an op: {echo(text)}")
    if "peer" in fields:
        if peer is None or arrow != (">" if kind.startswith("send") else "<"):
            raise ValueError(f"not an op: {echo(text)}")
        values["peer"] = int(peer)
    elif peer is not None:
        raise ValueError(f"not an op: {echo(text)}")
    return Op(kind, **values)


def _learn(decl) -> None:
    """A registered optimizer's new op kind joins the vocabulary: its text prefix (register
    checked it is its own), fields, stream and whether it is compute."""
    OP_KINDS[decl.kind] = (decl.text, decl.fields)
    _NEED[decl.kind] = tuple(f in decl.fields for f in _FIELDS)
    _BY_PREFIX[decl.text] = decl.kind
    (COLLECTIVE_KINDS if decl.collective else COMPUTE_KINDS).add(decl.kind)


def _forget(kind: str) -> None:
    """An unregistered optimizer's kind leaves the vocabulary."""
    prefix, _ = OP_KINDS.pop(kind)
    _NEED.pop(kind, None)
    _BY_PREFIX.pop(prefix, None)
    COMPUTE_KINDS.discard(kind)
    COLLECTIVE_KINDS.discard(kind)


assert {prefix for prefix, _ in OP_KINDS.values()} == PIPELINE_TEXT, "the pipeline's prefixes, as optimizers know them"
# the built-in optimizers' kinds, then every one registered later
for _decl in {d.kind: d for o in OPTIMIZERS.values() for d in o.ops}.values():
    _learn(_decl)
ON_REGISTER.append(_learn)
ON_FORGET.append(_forget)
