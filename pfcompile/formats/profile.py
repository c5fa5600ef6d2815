"""The profile format: per-part and per-covered-layer costs of one model on one device.

A profile is measured by `pfcompile profile` (pfcompile.profiler) or converted from
published numbers (pfcompile.profiler.reference). This module only reads, validates and writes it,
and imports no torch, so the planner can use it anywhere.

Units: times in milliseconds for ONE micro-batch (fwd, bwd, curv) or once (inv, precond);
sizes in bytes. Every `*_ms` entry (and every entry of `optimizer_ms`) is the median of the op timed alone, and `spread[key] =
[p10, p90]` of those timings where measured, except where a run says more: in a measured
profile with `provenance.in_run`, each entry named there is its mean occupancy in the
profiler's runs of the runtime (pfcompile.profiler.runtime_probe; `in_run[path]`: that over
the median alone; older profiles' `run_tail` raised only fwd, bwd and step medians by their
kind's mean over median); in a calibrated one, every fitted entry is the calibration's
statistic (`provenance.calibration.statistic`, the mean by default) of the measured runs.

    {
      "schema": "pfcompile-profile", "schema_version": 4,
      "source": "measured" | "reference",
      "provenance": {...},                   # device, torch, dtype, host, date, repeats, ...
      "model": {"name", "kind", "layers", "hidden", "heads", "ffn", "vocab", "seq_len",
                "micro_batch", "dtype"},
      "parts": [{"name": "embed"|"block0"..|"head", "fwd_ms", "bwd_ms", "act_bytes",
                 "param_bytes", "grad_bytes", "out_bytes",
                 "step_ms": {"kfac", "adamw", ...},     # version 2; others optional
                 "bwd_input_ms", "bwd_weight_ms",       # version 3 (number or null)
                 "wgrad_bytes",                          # version 3, optional (number or null)
                 "capture_ms": {"fwd", "bwd", ...}}],    # optional: a capturing refresh step's extra
      "covered_layers": [{"name": "block0.attn.q", "part": "block0", "in_features",
                 "out_features", "bias", "kept_a_bytes", "kept_b_bytes", "factor_a_bytes",
                 "factor_b_bytes", "inverse_a_bytes", "inverse_b_bytes",
                 "optimizer_ms": {"kfac": {"curv_a", "curv_b", "inv_A.cholesky", "inv_A.eigen",
                                           "inv_B.cholesky", "inv_B.eigen", "precond"},
                                  "shampoo": {"stats", "inv_L", "inv_R", "precond"},
                                  "muon": {"orth"}}}],    # version 4; per optimizer profiled
      "comm": {"method": "measured-gloo"|"measured-nccl"|"model", "act_bytes",
               "p2p": {"latency_ms", "bytes_per_ms"},
               "allreduce": {"latency_ms", "bytes_per_ms"}},
      "runtime": {"op_ms", "step_ms", "send_ms", "recv_ms",    # optional, see below
                  "op_spread": {"fwd": [m1, ..., m20], ...},   # optional
                  "level_spread": [m1, ..., m20],              # optional
                  "busy": {"utilization": [u0, u1], "step_ms",  # optional
                           "op_spread", "level_spread"}},
      "spread": {"parts.block0.fwd_ms": [p10, p90], ...},
      "hash": "sha256:..."                   # of everything above, canonical JSON
    }

`covered_layers` (version 4; LAYERS_KEY_V3 before) are the layers an optimizer's extra work
covers (pfcompile.formats.optimizers). `optimizer_ms` maps each profiled optimizer to its
ops' costs on the layer, one entry per cost key its declaration names
(`Optimizer.cost_keys`: K-FAC's inversion once per factor and method), and its activation
where it declares one (`Optimizer.activation`, SOAP's `activate`: optional, 0 in a profile
made before it was timed); an optimizer a profile has no map for cannot be planned from it.
Versions 1 to 3 kept K-FAC's costs in fields of their own (`curv_a_ms`, `curv_b_ms`,
`inv_a_ms`/`inv_b_ms` per method, `precond_ms`) and the others' in `optimizer_ms`: they load
converted (`kfac_layer_v3`), their hash computed over the file as written (`layer_json_v3`),
so it stays verifiable and plans made from them name it.

`step_ms` (version 2) is the optimizer update of the part's parameters, once per step:
"kfac" the K-FAC optimizer (KL clip over its K-FAC layers, SGD-momentum on them, AdamW on
the rest), "adamw" the first-order baseline (AdamW on everything), both always; and, where
the profile timed another optimizer (or a calibration fitted one from its run), that
optimizer's own under its name ("muon": the scaled add on the covered weights, AdamW on the
rest). An optimizer without an entry steps like the one its declaration names
(`step_like`). A version-1 profile has
no such field: it still loads, with a one-line warning, and its step is ESTIMATED
(`estimated_step_ms`): the optimizer streams parameters, gradients and state, 7 passes over
the parameter bytes for AdamW and 5 for SGD-momentum, at 2 GB/s on a CPU (one core,
single-threaded torch; small parts run slower, where per-tensor overheads dominate) and
200 GB/s on a GPU.

`runtime` (optional in every version; absent: all 0, the ops alone) is what the runtime itself
costs around the ops, per rank: `op_ms` the interpreter's dispatch of one op (the gap between an
op's end and the next op's start when the next need not wait), `step_ms` its work between two
steps (the next batch, bookkeeping, completing the step's sends), `send_ms` posting one
point-to-point send, `recv_ms` completing a receive whose data is already there. The
message's own lag (its send's end to its data at the receiver) is `comm.p2p`. `pfcompile
profile` measures them where it can; `pfcompile calibrate` fits all four from measured runs.

`runtime.op_spread` (optional) is how an op's time varies from one run of it to the next in
the runtime, per op kind (fwd, bwd, bwd_input, bwd_weight, step, curv_a, curv_b, precond,
inv, stats, orth, send; a receive's waiting is the message's lag, which the replay makes): 20
multipliers of the entry's time at the quantile midpoints (2.5%, 7.5%, ..., 97.5%) of the
measured op's occupancy over its own mean, scaled to average exactly 1. Two more keys are
not ops: `message`, a point-to-point message's transfer (its send's end to the end of a
receive that waited for it) over the link's time for its size, and `between_steps`, the
runtime's work between a rank's steps (runtime.step_ms: the next batch, the receives posted
ahead, the checks) over its mean; their rare stalls of milliseconds (gloo on a busy CPU)
cost a step more than their means say. A plan
made from such a profile also predicts the step time a run sees when every op varies that
way (pfcompile.check.replay.expected_step_time: a late op delays the ranks waiting on it,
so the expected step is longer than the step of mean op times). Fitted from a measured run
(the profiler's runtime probe, `pfcompile calibrate`); absent, kinds missing: no spread.

`runtime.level_spread` (optional) is the part of that variation a rank's ops share within a
step: 20 multipliers like op_spread's, of a rank's LEVEL in one step (the occupancy of its
compute ops in that step over their entries' means). A slow spell of the machine, or of
the core a rank runs on, stretches every op of that rank for a while; drawn op by op, those
stretches would average out over a step's ops and the pipeline would absorb them, drawn per
rank and step they do not. With it, op_spread holds each op's variation beyond its rank's
level in its step, and expected_step_time draws both. Absent: the ops vary independently.

`runtime.busy` (optional) is the same variation in a run whose bubbles hold work:
`utilization` [u0, u1], the utilization of the plans of the run the spreads above were fitted
on and of this one; `step_ms`, the runtime's mean work between steps there; and its
`op_spread` and `level_spread`. Where the ranks fill the host's cores, a plan with fuller
bubbles stalls more (benchmarks/results/2026-12-06-busy-probe.md). A plan of utilization u
draws each instance from these with weight (u - u0) / (u1 - u0), clipped to [0, 1], and
from the spreads above otherwise, and its runtime work between steps moves to `step_ms` by
the same weight. The profiler's runtime probe fits it from a 1F1B run with K-FAC placed in
its bubbles. Absent: every plan varies as the first run did.

`bwd_input_ms` / `bwd_weight_ms` (version 3) are the two halves of a split backward
(zero-bubble families), timed as runtime.pipeline.split_backward runs them: B, the input gradient
(and the non-Linear parameters'), and W, each nn.Linear's weight gradient from the kept
input and output gradient. They need not add up to `bwd_ms`: B + W costs more than the
whole backward (two passes, and B keeps what W reads; see
benchmarks/results/2026-11-30-split-backward.md). `null` (a reference profile whose source
published only the whole backward) and version-2 profiles (which load with a
one-line warning) use the documented ESTIMATE (`Part.split_backward_ms`): half of `bwd_ms`
each, the zero-bubble paper's T_B = T_W (every nn.Linear's backward is two matmuls of equal
FLOPs, input gradient and weight gradient). `wgrad_bytes` (version 3, optional) is what the
part's W keeps besides its activations from B until it runs: the output gradient of every
nn.Linear of the part (covered layer or not), as runtime.pipeline.split_backward keeps them; absent or
null: the covered layers' `kept_b_bytes` (pfcompile.graph.costs.Costs.wgrad_bytes).

`capture_ms` (optional) is what the part's pipeline ops (`fwd`, `bwd`, `bwd_input`,
`bwd_weight`; each key optional) take longer on a refresh step of an optimizer whose
micro-batch ops keep the forward's input or the output gradient (K-FAC): its hooks save
them, and the step's ops run with them held. `fwd_ms` and the others are the ops without
it. The profiler times it alone and fits it in a run (the runtime probe's K-FAC run
refreshes every other step); absent: 0, as in profiles from before it was timed, whose
entries are the ops with capture on.

`parts` are the units the partitioner cuts into contiguous stages: embeddings first,
then the blocks in order, then the head with the loss. `out_bytes` is the size of the
part's output for one micro-batch: the point-to-point message when a stage ends there.
`act_bytes` is what the forward saves for the backward (freed by the backward);
`kept_a_bytes`/`kept_b_bytes` are the layer input / output gradient an optimizer's
micro-batch ops keep until they have run (K-FAC's curvature). `factor_*_bytes` is one factor; `inverse_*_bytes` one inverse.
"""

from __future__ import annotations

import copy
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from pfcompile.formats.errors import echo
from pfcompile.formats.jsonio import Fields, canonical_hash, read_json, write_json
from pfcompile.formats.limits import MAX_BYTES, MAX_TIME_MS
from pfcompile.formats.models import DEVICE_TYPES, DTYPES, MODEL_INTS
from pfcompile.formats.optimizers import INVERSE_METHODS, OPTIMIZERS

SCHEMA = "pfcompile-profile"
SCHEMA_VERSION = 4
# op kinds whose time-to-time variation a profile may record (runtime.op_spread, module doc)
SPREAD_KINDS = ("fwd", "bwd", "bwd_input", "bwd_weight", "step", "curv_a", "curv_b", "precond", "inv", "stats",
                "orth", "send", "message", "between_steps")
# what varies but is no op's compute: a send's posting, a message's transfer, the runtime's
# work between steps
NOT_COMPUTE = ("send", "message", "between_steps")
# the op kinds a rank's level in a step is taken over and applied to (runtime.level_spread):
# its compute only
LEVEL_KINDS = tuple(k for k in SPREAD_KINDS if k not in NOT_COMPUTE)
READS_VERSIONS = (1, 2, 3, 4)
STEP_KINDS = ("kfac", "adamw")
# The estimate for version-1 profiles (see the module doc): passes over the parameter bytes
# and the streaming rate in bytes per ms.
STEP_PASSES = {"adamw": 7, "sgd": 5}
STEP_BYTES_PER_MS = {"cpu": 2e6, "gpu": 2e8}
# the pipeline ops a capturing refresh step slows (Part.capture_ms)
CAPTURE_KINDS = ("fwd", "bwd", "bwd_input", "bwd_weight")
# The estimate of a split backward where it was not measured (module doc): W's share of bwd_ms.
WEIGHT_SHARE = 0.5


@dataclass
class Part:
    name: str
    fwd_ms: float
    bwd_ms: float
    act_bytes: int
    param_bytes: int
    grad_bytes: int
    out_bytes: int
    # optimizer -> ms per step ("kfac" and "adamw" always, others where timed); parts made in
    # code (test profiles) default to free steps
    step_ms: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in STEP_KINDS})
    # split backward (version 3): B and W as measured; None: not measured (the estimate applies)
    bwd_input_ms: float | None = None
    bwd_weight_ms: float | None = None
    wgrad_bytes: int | None = None  # what W keeps from B on (None: not measured, see Costs.wgrad_bytes)
    # op kind -> ms a capturing refresh step adds to it (module doc); None: not measured (0)
    capture_ms: dict[str, float] | None = None

    @property
    def split_measured(self) -> bool:
        return self.bwd_input_ms is not None and self.bwd_weight_ms is not None

    def split_backward_ms(self) -> tuple[float, float]:
        """(B, W) of this part's split backward: measured, or the documented estimate
        (WEIGHT_SHARE of the whole backward is W, the rest B)."""
        if self.split_measured:
            return self.bwd_input_ms, self.bwd_weight_ms
        w = self.bwd_ms * WEIGHT_SHARE
        return self.bwd_ms - w, w


@dataclass
class CoveredLayer:
    name: str
    part: str
    in_features: int
    out_features: int
    bias: bool
    kept_a_bytes: int
    kept_b_bytes: int
    factor_a_bytes: int
    factor_b_bytes: int
    inverse_a_bytes: int
    inverse_b_bytes: int
    # optimizer -> cost key -> ms: its ops on this layer (Optimizer.cost_keys), where profiled or estimated
    optimizer_ms: dict[str, dict[str, float]] = field(default_factory=dict)

    def factor_bytes(self, factor: str) -> int:
        return self.factor_a_bytes if factor == "A" else self.factor_b_bytes

    def inverse_bytes(self, factor: str) -> int:
        return self.inverse_a_bytes if factor == "A" else self.inverse_b_bytes

    def kept_bytes(self, factor: str) -> int:  # a K-FAC factor's kept tensor (A: input, B: output gradient)
        return self.kept_a_bytes if factor == "A" else self.kept_b_bytes

    @property
    def weight_elements(self) -> int:
        return self.in_features * self.out_features

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


LAYERS_KEY_V3 = "kfac_layers"  # the covered layers' key in schema 3 and older (K-FAC's name)
# schema 3's K-FAC fields of a covered layer -> their cost keys in schema 4's optimizer_ms.kfac
KFAC_FIELDS_V3 = {"curv_a_ms": "curv_a", "curv_b_ms": "curv_b", "precond_ms": "precond"}
KFAC_INVERSE_FIELDS_V3 = {"inv_a_ms": "inv_A", "inv_b_ms": "inv_B"}


def spread_key_v3(key: str) -> str:
    """A spread entry's name as a version-3 file (or older) writes it, the inverse of
    `upgraded`'s renaming: `covered_layers.L.optimizer_ms.kfac.inv_A.cholesky` ->
    LAYERS_KEY_V3 + `.L.inv_a_ms.cholesky`; other optimizers keep their map."""
    prefix = "covered_layers."
    if not key.startswith(prefix):
        return key
    layer, sep, rest = key[len(prefix):].partition(".optimizer_ms.")
    if not sep:
        return LAYERS_KEY_V3 + "." + key[len(prefix):]
    opt, _, entry = rest.partition(".")
    if opt != "kfac":
        return f"{LAYERS_KEY_V3}.{layer}.optimizer_ms.{rest}"
    fields = {v: k for k, v in KFAC_FIELDS_V3.items()}
    inverses = {v: k for k, v in KFAC_INVERSE_FIELDS_V3.items()}
    head, _, method = entry.partition(".")
    field = fields.get(entry) or (f"{inverses[head]}.{method}" if head in inverses and method else entry)
    return f"{LAYERS_KEY_V3}.{layer}.{field}"


def kfac_layer_v3(fields: dict[str, Any]) -> dict[str, float]:
    """A schema-3 layer's K-FAC fields (read and checked) as schema 4's optimizer_ms.kfac."""
    costs = {"curv_a": fields["curv_a_ms"], "curv_b": fields["curv_b_ms"]}
    for f, key in KFAC_INVERSE_FIELDS_V3.items():
        costs.update({f"{key}.{m}": fields[f][m] for m in INVERSE_METHODS})
    costs["precond"] = fields["precond_ms"]  # in the order of Optimizer.cost_keys
    return costs


def layer_json_v3(layer: CoveredLayer) -> dict[str, Any]:
    """The layer as a schema-3 file has it (its hash is over that form): K-FAC's costs in
    fields of their own, the other optimizers' in optimizer_ms, absent where there are none."""
    d = asdict(layer)
    other = {o: c for o, c in d.pop("optimizer_ms").items() if o != "kfac"}
    kfac = layer.optimizer_ms["kfac"]
    for f, key in KFAC_FIELDS_V3.items():
        d[f] = kfac[key]
    for f, key in KFAC_INVERSE_FIELDS_V3.items():
        d[f] = {m: kfac[f"{key}.{m}"] for m in INVERSE_METHODS}
    if other:
        d["optimizer_ms"] = other
    return d


@dataclass
class LinkModel:
    """Time of one message of n bytes: latency_ms + n / bytes_per_ms."""

    latency_ms: float
    bytes_per_ms: float

    def time_ms(self, nbytes: int) -> float:
        return self.latency_ms + nbytes / self.bytes_per_ms


def cost_keys() -> dict[str, tuple[str, ...]]:
    """Optimizer -> its per-layer cost keys, for every declared optimizer with any (read at call
    time: an optimizer declared after import counts)."""
    return {name: o.cost_keys() for name, o in OPTIMIZERS.items() if o.cost_keys()}


def fit_link(points: list[tuple[int, float]]) -> LinkModel:
    """Fit time = latency + bytes / bandwidth to (bytes, ms) points, minimising RELATIVE error
    (plain least squares would let the largest message decide alone and push the latency to
    noise), kept physical: latency >= 0 (else refitted through the origin), bandwidth > 0
    (else the largest message's average rate). Used by the profiler's message benchmark and
    by `pfcompile calibrate`."""
    w = [1.0 / max(ms, 1e-12) ** 2 for _, ms in points]  # squared residual / ms^2
    sw = sum(w)
    mx = sum(wi * n for wi, (n, _) in zip(w, points)) / sw
    my = sum(wi * ms for wi, (_, ms) in zip(w, points)) / sw
    sxx = sum(wi * (n - mx) ** 2 for wi, (n, _) in zip(w, points))
    slope = sum(wi * (n - mx) * (ms - my) for wi, (n, ms) in zip(w, points)) / sxx if sxx > 0 else 0.0
    latency = my - slope * mx
    if latency < 0:  # through the origin, same weights
        latency = 0.0
        slope = sum(wi * n * ms for wi, (n, ms) in zip(w, points)) / sum(wi * n * n for wi, (n, _) in zip(w, points))
    if slope <= 0:  # flat or noisy: the largest message's average rate
        n, ms = max(points)
        slope = ms / n
    return LinkModel(latency_ms=float(latency), bytes_per_ms=float(1.0 / slope))


@dataclass
class RuntimeOverheads:
    """What the runtime costs a rank around the ops (module doc), ms."""

    op_ms: float = 0.0
    step_ms: float = 0.0
    send_ms: float = 0.0
    recv_ms: float = 0.0
    op_spread: dict[str, list[float]] = field(default_factory=dict)  # op kind -> multipliers (module doc)
    level_spread: list[float] = field(default_factory=list)  # a rank's level in a step: multipliers (module doc)
    busy: BusySpread | None = None  # the same with the bubbles filled (module doc)

    def has_spread(self) -> bool:
        """Whether op times vary here (op_spread or level_spread): what check.replay's
        expected step time needs."""
        return bool(self.op_spread) or bool(self.level_spread)

    def any(self) -> bool:
        return any(v > 0 for v in (self.op_ms, self.step_ms, self.send_ms, self.recv_ms)) or self.has_spread()

    def busy_weight(self, utilization: float) -> float:
        """How much of a plan's variation is the busy run's (module doc): 0 at the base
        run's utilization or below, 1 at the busy run's or above, linear between."""
        b = self.busy
        if b is None or b.utilization[1] <= b.utilization[0]:
            return 0.0
        return min(1.0, max(0.0, (utilization - b.utilization[0]) / (b.utilization[1] - b.utilization[0])))

    def to_json(self) -> dict[str, Any]:
        d = {**asdict(self), "busy": self.busy.to_json() if self.busy is not None else None}
        return _without_empty(d, ("op_spread", "level_spread", "busy"))


def _without_empty(d: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """`d` less its optional `keys` that are empty: absent as written before they existed
    (a profile's hash stays)."""
    return {k: v for k, v in d.items() if k not in keys or v}


@dataclass
class BusySpread:
    """runtime.busy (module doc): the runtime's variation in a run whose bubbles hold work."""

    utilization: list[float]  # [the base run's plan, this run's plan]
    step_ms: float  # the runtime's mean work between steps there
    op_spread: dict[str, list[float]] = field(default_factory=dict)
    level_spread: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return _without_empty(asdict(self), ("op_spread", "level_spread"))


@dataclass
class Comm:
    method: str
    act_bytes: int
    p2p: LinkModel
    allreduce: LinkModel

    def allreduce_ms(self, nbytes: int, ranks: int) -> float:
        """Ring all-reduce: 2(r-1)/r of the bytes cross each link; nothing for one rank."""
        if ranks <= 1:
            return 0.0
        return self.allreduce.latency_ms + 2 * (ranks - 1) / ranks * nbytes / self.allreduce.bytes_per_ms

    def bcast_ms(self, nbytes: int, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return self.p2p.time_ms(nbytes)


@dataclass(frozen=True)
class Cluster:
    """The machines a plan runs on: `nodes` x `gpus_per_node` ranks, numbered as torchrun
    numbers them with --nnodes N --nproc-per-node G (node n holds ranks n·G .. n·G+G-1).
    A message or collective between ranks of one node crosses the `intra` link, one that
    spans nodes the `inter` link (a ring collective moves at the pace of its slowest link)."""

    nodes: int
    gpus_per_node: int
    intra: LinkModel
    inter: LinkModel

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link(self, ranks) -> LinkModel:
        return self.intra if len({self.node_of(q) for q in ranks}) <= 1 else self.inter

    def to_json(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "intra": {"latency_ms": self.intra.latency_ms, "bytes_per_ms": self.intra.bytes_per_ms},
                "inter": {"latency_ms": self.inter.latency_ms, "bytes_per_ms": self.inter.bytes_per_ms}}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Cluster:
        return Cluster(int(d["nodes"]), int(d["gpus_per_node"]), LinkModel(**d["intra"]), LinkModel(**d["inter"]))


@dataclass
class Profile:
    source: str
    provenance: dict[str, Any]
    model: dict[str, Any]
    parts: list[Part]
    covered_layers: list[CoveredLayer]
    comm: Comm
    spread: dict[str, list[float]] = field(default_factory=dict)
    runtime: RuntimeOverheads = field(default_factory=RuntimeOverheads)
    hash: str = ""
    schema_version: int = SCHEMA_VERSION  # a loaded version-1 profile keeps its hash as written

    # --- queries the planner uses ---------------------------------------------------------
    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(name)

    def layers_of(self, part_name: str) -> list[int]:
        """Indices (into covered_layers) of the covered layers inside one part, in order."""
        return [i for i, l in enumerate(self.covered_layers) if l.part == part_name]

    @property
    def name(self) -> str:
        return str(self.model.get("name", "?"))

    # --- serialisation ----------------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": self.schema_version,
            "source": self.source,
            "provenance": self.provenance,
            "model": self.model,
            "parts": [self._part_json(p) for p in self.parts],
            # as written: a version-3 file (or older) keeps its layers' form, and so its hash
            **({"covered_layers": [l.to_json() for l in self.covered_layers]} if self.schema_version >= 4
               else {LAYERS_KEY_V3: [layer_json_v3(l) for l in self.covered_layers]}),
            "comm": asdict(self.comm),
            **({"runtime": self.runtime.to_json()} if self.runtime.any() else {}),  # absent: as before
            "spread": {k if self.schema_version >= 4 else spread_key_v3(k): v for k, v in self.spread.items()
                       if self._has_time(k)},
        }

    def _has_time(self, spread_key: str) -> bool:
        """Whether this schema version has the time a spread entry names (an older one has no
        split backward, or no step, of a part: its spread cannot name them)."""
        if self.schema_version < 3 and spread_key.endswith((".bwd_input_ms", ".bwd_weight_ms")):
            return False
        return self.schema_version >= 2 or ".step_ms" not in spread_key

    def _part_json(self, p: Part) -> dict[str, Any]:
        d = asdict(p)
        if self.schema_version < 2:  # as written: its step_ms is an estimate, not part of the file
            d.pop("step_ms")
        if self.schema_version < 3:  # as written: no split backward fields
            d.pop("bwd_input_ms")
            d.pop("bwd_weight_ms")
            d.pop("wgrad_bytes")
        if d.get("wgrad_bytes", 0) is None:  # optional: absent as written before it existed
            d.pop("wgrad_bytes", None)
        if d.get("capture_ms", 0) is None:  # optional, likewise
            d.pop("capture_ms", None)
        return d

    def to_json(self) -> dict[str, Any]:
        body = self.body()
        self.hash = canonical_hash(body)
        return {**body, "hash": self.hash}

    def save(self, path: str) -> None:
        write_json(path, self.to_json())


def _schema_version(top: Fields) -> int:
    """The file's schema must be ours and its version one this pfcompile reads."""
    got = top.req("schema", str)
    if got != SCHEMA:
        raise top.fail("schema", f"expected {SCHEMA!r}, got {echo(got)} (is this a profile?)")
    v = top.req("schema_version", int)
    if v not in READS_VERSIONS:
        raise top.fail("schema_version", f"unsupported version {v} (this pfcompile reads {', '.join(map(str, READS_VERSIONS))})")
    return v


def estimated_step_ms(profile: Profile, part: Part) -> dict[str, float]:
    """The documented estimate of a part's optimizer step for profiles that did not measure it:
    bytes streamed (passes over the parameter bytes) at the device's rate (module doc)."""
    rate = STEP_BYTES_PER_MS["cpu" if profile.provenance.get("device_type") == "cpu" else "gpu"]
    covered = 0  # parameter bytes of the part's covered layers (K-FAC's SGD-momentum); the rest is AdamW
    for l in profile.covered_layers:
        if l.part == part.name:
            d_a = l.in_features + (1 if l.bias else 0)
            covered += d_a * l.out_features * round(l.factor_a_bytes / (d_a * d_a))
    covered = min(covered, part.param_bytes)
    kfac = (STEP_PASSES["sgd"] * covered + STEP_PASSES["adamw"] * (part.param_bytes - covered)) / rate
    return {"kfac": kfac, "adamw": STEP_PASSES["adamw"] * part.param_bytes / rate}


def _pos(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v >= 0


# --- the checks of what the reader above takes as typed: each field's meaning, in its own
# function (the format's layout changes, these rules stay) --------------------------------------

# the sections of a profile whose entries (objects with a "name") hold op times, as `spread`
# names them: the parts and the covered layers (under their schema's key)
def _spread_sections(version: int) -> tuple[str, str]:
    return ("parts", "covered_layers" if version >= 4 else LAYERS_KEY_V3)


def _multipliers(f: Fields, key: str, mult) -> list[float]:
    """A spread's multipliers (module doc), or the one-line error naming `key`."""
    if not (isinstance(mult, list) and mult and all(_pos(m) for m in mult)):
        raise f.fail(key, "must be a non-empty list of finite numbers >= 0")
    # multipliers move an op around its entry, never the entry itself (module doc);
    # averaging 1 also bounds each by their count, so no draw overflows a replay
    if abs(sum(mult) / len(mult) - 1.0) > 1e-3:
        raise f.fail(key, f"must average 1 (they scale the entry's time), got {sum(mult) / len(mult):.6g}")
    return [float(m) for m in mult]


def _op_spread(sf: Fields) -> dict[str, list[float]]:
    """An op_spread object (module doc), or the one-line error naming the bad kind."""
    out = {}
    for kind, mult in sf.obj.items():
        if kind not in SPREAD_KINDS:
            raise sf.fail(kind, f"is not an op kind with a spread (known: {', '.join(SPREAD_KINDS)})")
        out[kind] = _multipliers(sf, kind, mult)
    return out


def _busy_spread(bf: Fields) -> BusySpread:
    """runtime.busy (module doc), or the one-line error naming the bad field."""
    u = bf.req("utilization", list, check=lambda v: len(v) == 2 and all(_pos(x) and x <= 1 for x in v) and v[0] < v[1],
               why="must be [the base run's, the busy run's] utilization, each in [0, 1], the first the smaller")
    busy = BusySpread(utilization=[float(x) for x in u],
                      step_ms=bf.req("step_ms", float, check=_pos, why="must be a finite number >= 0"))
    if bf.opt("op_spread", dict) is not None:
        busy.op_spread = _op_spread(bf.sub("op_spread"))
    if bf.opt("level_spread", list) is not None:
        busy.level_spread = _multipliers(bf, "level_spread", bf.obj["level_spread"])
    return busy


def _check_provenance(pf: Fields) -> None:
    """Provenance is the record of how a profile was made, free-form but for what the
    planner reads of it: the device type (the runtime's device and backend follow it)."""
    device = pf.opt("device_type", str)
    if device is not None and device not in DEVICE_TYPES:
        raise pf.fail("device_type", f"{echo(device)} is not one the runtime runs ({', '.join(DEVICE_TYPES)})")


def _check_model(mf: Fields) -> None:
    """The model spec the profile's costs are of: a name, positive sizes, a dtype the runtime runs."""
    mf.req("name", str, check=lambda v: v != "", why="must be a non-empty string")
    for key in MODEL_INTS:
        mf.opt(key, int, check=lambda v: v > 0, why="must be a positive integer")
    mf.opt("kind", str)
    mf.opt("dtype", str, check=lambda v: v in DTYPES, why=f"must be one the runtime runs ({', '.join(DTYPES)})")


def _check_layer_names(top: Fields, layers: list[CoveredLayer], layers_key: str) -> None:
    """Each covered layer once, named `<part>.<module>` after its part (the plan's layers
    are found in their stage's parts by that prefix)."""
    seen: set[str] = set()
    for i, l in enumerate(layers):
        if l.name in seen:
            raise top.fail(f"{layers_key}[{i}].name", f"{echo(l.name)} is listed twice")
        seen.add(l.name)
        if l.name.split(".", 1)[0] != l.part or "." not in l.name:
            raise top.fail(f"{layers_key}[{i}].name", f"{echo(l.name)} is not a layer of its part {echo(l.part)} "
                           f"(named {echo(l.part + '.<module>')})")


def _magnitude_error(key: str, v) -> str | None:
    if key.endswith("_bytes") and key != "bytes_per_ms" and v > MAX_BYTES:
        return f"{echo(v)} bytes is more than any device holds (at most 2**60)"
    if key.endswith("_ms") and key != "bytes_per_ms" and v > MAX_TIME_MS:
        return f"{echo(v)} ms is more than a day (at most {MAX_TIME_MS:g}): not a time this profile measured"
    return None


def _check_magnitudes(top: Fields) -> None:
    """Every time (`*_ms`) at most a day and every size (`*_bytes`) at most an exbibyte,
    wherever it lies: the reader has checked their types and signs, these bound them (a
    time of 2**64 ms would make every plan's predicted times refused, or overflow a
    replay's sums)."""
    stack = [(key, v, key) for key, v in top.obj.items() if key not in ("provenance", "model", "spread")]
    while stack:
        key, v, path = stack.pop()
        if isinstance(v, dict):
            inner = key if key.endswith("_ms") else None  # a map of times: {"cholesky": ms, ...}
            stack.extend((inner or k, x, f"{path}.{k}") for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((key, x, f"{path}[{i}]") for i, x in enumerate(v))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            why = _magnitude_error(key, v)
            if why is not None:
                raise top.fail(path, why)


def _time_entries(top: Fields, version: int) -> set[str]:
    """The names `spread` gives the profile's op times: "parts.<part>.fwd_ms",
    "covered_layers.<layer>.optimizer_ms.kfac.inv_A.cholesky", ...: every measured
    (non-null) time of an entry of the parts and covered layers, maps of times by their keys."""
    names: set[str] = set()

    def add(prefix: str, key: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                add(f"{prefix}.{key}", k, x)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            names.add(f"{prefix}.{key}")

    for section in _spread_sections(version):
        for entry in top.obj.get(section) or ():
            for key, v in entry.items():
                if key.endswith("_ms"):
                    add(f"{section}.{entry['name']}", key, v)
    return names


def _spread_from_json(top: Fields, version: int) -> dict[str, list[float]]:
    """`spread`: for an op time of this profile, [p10, p90] of its timings: two finite
    times, 0 <= p10 <= p90 <= a day, under the name of a measured time (_time_entries)."""
    if top.opt("spread", dict) is None:
        return {}
    sf = top.sub("spread")
    entries = _time_entries(top, version)
    spread = {}
    for key, pair in sf.obj.items():
        if key not in entries:
            raise sf.fail(key, "names no measured time of this profile (parts.<part>.<key>_ms, "
                               "covered_layers.<layer>.optimizer_ms.<optimizer>.<key>, a map's times by their key)")
        if not (isinstance(pair, list) and len(pair) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair)):
            raise sf.fail(key, f"must be [p10, p90], two times in ms, got {echo(pair)}")
        p10, p90 = pair
        if not all(math.isfinite(v) and 0 <= v <= MAX_TIME_MS for v in pair):
            raise sf.fail(key, f"must be two finite times in 0..{MAX_TIME_MS:g} ms, got {echo(pair)}")
        if p10 > p90:
            raise sf.fail(key, f"p10 {p10!r} is above p90 {p90!r}")
        spread[key] = [p10, p90]
    return spread


def load_profile(path: str, *, check_hash: bool = True) -> Profile:
    """Read and validate a profile; any problem is an InputError naming the file and field."""
    return profile_from_json(read_json(path), str(path), check_hash=check_hash)


def profile_from_json(obj: Any, where: str = "<profile>", *, check_hash: bool = True) -> Profile:
    top = Fields(obj, where)
    version = _schema_version(top)
    source = top.req("source", str, check=lambda s: s in ("measured", "reference"), why="must be 'measured' or 'reference'")
    provenance = top.req("provenance", dict)
    _check_provenance(top.sub("provenance"))
    model = top.req("model", dict)
    mf = top.sub("model")
    mf.req("name", str)
    for k in ("micro_batch", "seq_len"):
        mf.req(k, int, check=lambda v: v > 0, why="must be a positive integer")
    _check_model(mf)

    parts_raw = top.req("parts", list, check=lambda v: len(v) > 0, why="must list at least one part")
    parts = []
    for i, p in enumerate(parts_raw):
        f = Fields(p, where, f"parts[{i}]")
        step = {}
        if version >= 2:
            sf = f.sub("step_ms")
            # K-FAC's and AdamW's always; another optimizer's where profiled or calibrated from its run
            step = {k: sf.req(k, float, check=_pos, why="must be a finite number >= 0")
                    for k in dict.fromkeys((*STEP_KINDS, *sf.obj))}
        split = {}
        if version >= 3:
            split = {k: f.req(k, (float, type(None)), check=lambda v: v is None or _pos(v),
                              why="must be a finite number >= 0, or null (not measured)")
                     for k in ("bwd_input_ms", "bwd_weight_ms")}
            if (split["bwd_input_ms"] is None) != (split["bwd_weight_ms"] is None):
                raise f.fail("bwd_weight_ms", "bwd_input_ms and bwd_weight_ms are both numbers or both null")
            split["wgrad_bytes"] = f.opt("wgrad_bytes", int, check=_pos, why="must be an integer >= 0, or null")
        capture = None
        if f.opt("capture_ms", dict) is not None:
            cf = f.sub("capture_ms")
            unknown = sorted(set(cf.obj) - set(CAPTURE_KINDS))
            if unknown:
                raise cf.fail(unknown[0], f"not an op a capture slows (have: {', '.join(CAPTURE_KINDS)})")
            capture = {k: cf.req(k, float, check=_pos, why="must be a finite number >= 0") for k in cf.obj}
        parts.append(Part(
            name=f.req("name", str),
            **{k: f.req(k, float, check=_pos, why="must be a finite number >= 0") for k in ("fwd_ms", "bwd_ms")},
            **{k: f.req(k, int, check=_pos, why="must be an integer >= 0")
               for k in ("act_bytes", "param_bytes", "grad_bytes", "out_bytes")},
            step_ms=step, **split, capture_ms=capture,
        ))
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise top.fail("parts", "part names must be unique")

    layers_key = "covered_layers" if version >= 4 else LAYERS_KEY_V3
    layers = [_covered_layer(Fields(l, where, f"{layers_key}[{i}]"), l, version, names)
              for i, l in enumerate(top.req(layers_key, list))]

    _check_layer_names(top, layers, layers_key)

    cf = top.sub("comm")
    links = {}
    for key in ("p2p", "allreduce"):
        lf = cf.sub(key)
        links[key] = LinkModel(
            latency_ms=lf.req("latency_ms", float, check=_pos, why="must be a finite number >= 0"),
            bytes_per_ms=lf.req("bytes_per_ms", float, check=lambda v: _pos(v) and v > 0, why="must be positive"),
        )
    comm = Comm(method=cf.req("method", str), act_bytes=cf.req("act_bytes", int, check=_pos, why="must be >= 0"), **links)
    _check_magnitudes(top)
    spread = _spread_from_json(top, version)
    runtime = RuntimeOverheads()
    if top.opt("runtime", dict) is not None:
        rf = top.sub("runtime")
        runtime = RuntimeOverheads(**{k: rf.req(k, float, check=_pos, why="must be a finite number >= 0")
                                      for k in ("op_ms", "step_ms", "send_ms", "recv_ms")})
        if rf.opt("op_spread", dict) is not None:
            runtime.op_spread = _op_spread(rf.sub("op_spread"))
        if rf.opt("level_spread", list) is not None:
            runtime.level_spread = _multipliers(rf, "level_spread", rf.obj["level_spread"])
        if rf.opt("busy", dict) is not None:
            runtime.busy = _busy_spread(rf.sub("busy"))

    prof = Profile(source=source, provenance=provenance, model=model, parts=parts,
                   covered_layers=layers, comm=comm, spread=spread, runtime=runtime, schema_version=version)
    missing, estimates = [], []
    if version < 2:
        for p in parts:
            p.step_ms = estimated_step_ms(prof, p)
        missing.append("optimizer-step costs")
        estimates.append("the step from parameter bytes (pfcompile.formats.profile.estimated_step_ms)")
    if version < 3:
        missing.append("split-backward costs")
        estimates.append("a zero-bubble family's B and W as half the backward each (pfcompile.formats.profile.WEIGHT_SHARE)")
    if missing:  # one line, whatever is missing
        print(f"warning: {where}: profile schema_version {version} has no {' and no '.join(missing)}; estimated: "
              f"{'; '.join(estimates)}; re-profile to measure", file=sys.stderr)
    stored = top.opt("hash", str)
    actual = canonical_hash(prof.body())
    if check_hash and stored is not None and stored != actual:
        raise top.fail("hash", "does not match the content (the file was edited or truncated)")
    prof.hash = actual
    return prof


_SPREAD_V3 = re.compile(re.escape(LAYERS_KEY_V3) + r"\.(?P<layer>.+?)\.(?:(?P<own>curv_a_ms|curv_b_ms|precond_ms)"
                        r"|(?P<inv>inv_a_ms|inv_b_ms)\.(?P<method>\w+)|optimizer_ms\.(?P<other>.+))")


def upgraded(profile: Profile) -> Profile:
    """A copy of a version-3 (or older) profile in the current schema, as `pfcompile profile`
    writes it now: its covered layers' costs in optimizer_ms, and the spread's and the
    provenance's names of layer entries renamed to match (LAYERS_KEY_V3 + `.L.curv_a_ms` ->
    `covered_layers.L.optimizer_ms.kfac.curv_a`). The costs are the same; the hash is new."""
    def rename(key: str) -> str:
        m = _SPREAD_V3.fullmatch(key)
        if m is None:
            return key.replace(LAYERS_KEY_V3, "covered_layers", 1) if key.startswith(LAYERS_KEY_V3) else key
        entry = (KFAC_FIELDS_V3.get(m["own"]) if m["own"] else
                 f"{KFAC_INVERSE_FIELDS_V3[m['inv']]}.{m['method']}" if m["inv"] else None)
        return f"covered_layers.{m['layer']}.optimizer_ms." + (f"kfac.{entry}" if entry else m["other"])

    new = copy.deepcopy(profile)
    new.schema_version = SCHEMA_VERSION
    new.spread = {rename(k): v for k, v in profile.spread.items()}
    if isinstance(new.provenance.get("estimated"), list):
        new.provenance["estimated"] = [rename(e) if isinstance(e, str) else e for e in new.provenance["estimated"]]
    new.to_json()
    return new


def _covered_layer(f: Fields, raw: Any, version: int, parts: list[str]) -> CoveredLayer:
    """One covered layer of a version-`version` file: every optimizer's costs into optimizer_ms
    (version 3 and older: K-FAC's from its own fields, kfac_layer_v3)."""
    part = f.req("part", str)
    if part not in parts:
        raise f.fail("part", f"names no part of this profile: {echo(part)}")
    ms = dict(check=_pos, why="must be a finite number >= 0")
    costs: dict[str, dict[str, float]] = {}
    if version < 4:
        v3 = {k: f.req(k, float, **ms) for k in ("curv_a_ms", "curv_b_ms", "precond_ms")}
        for key in KFAC_INVERSE_FIELDS_V3:
            sub = f.sub(key)
            v3[key] = {m: sub.req(m, float, **ms) for m in INVERSE_METHODS}
        costs["kfac"] = kfac_layer_v3(v3)
    known = cost_keys()
    if version >= 4 or (isinstance(raw, dict) and raw.get("optimizer_ms") is not None):
        om = f.sub("optimizer_ms")
        if not isinstance(om.obj, dict):
            raise f.fail("optimizer_ms", "must be an object")
        for opt in om.obj:
            if opt not in known or (version < 4 and opt == "kfac"):
                raise om.fail(None, f"unknown optimizer {opt!r:.40} (known: {', '.join(known)})")
            of = om.sub(opt)
            costs[opt] = {k: of.req(k, float, **ms) for k in known[opt]}
            act = OPTIMIZERS[opt].activation  # optional: profiles from before it was timed have none
            if act is not None and (ms_act := of.opt(act, float, **ms)) is not None:
                costs[opt][act] = ms_act
    positive = dict(check=lambda v: v > 0, why="must be positive")
    return CoveredLayer(
        name=f.req("name", str), part=part, optimizer_ms=costs,
        in_features=f.req("in_features", int, **positive), out_features=f.req("out_features", int, **positive),
        bias=f.req("bias", bool),
        **{k: f.req(k, int, check=_pos, why="must be an integer >= 0")
           for k in ("kept_a_bytes", "kept_b_bytes", "factor_a_bytes", "factor_b_bytes",
                     "inverse_a_bytes", "inverse_b_bytes")},
    )


# --- the table `pfcompile inspect PROFILE` prints ---------------------------------------------
def _table(headers: list[str], rows: list[list[str]]) -> str:
    """Plain aligned columns: first column left, the numbers right (no rich, no torch)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _ms(v: float) -> str:
    return f"{v:.3f}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f}"


def format_profile(profile: Profile) -> str:
    """Human-readable summary: provenance, per-part costs, the covered layers' sizes and each
    profiled optimizer's costs on them, communication."""
    m, pv = profile.model, profile.provenance
    shape = ", ".join(f"{k} {m[k]}" for k in ("layers", "hidden", "heads", "ffn", "vocab",
                                               "micro_batch", "seq_len", "dtype") if k in m)
    head = [f"profile {profile.name} ({profile.source}) {profile.hash}", f"model: {shape}"]
    prov_keys = ("device", "torch", "cuda", "threads", "ranks", "clock", "repeats", "warmup", "host", "date",
                 "created", "wall_s", "load_avg", "pfcompile", "source", "file")
    prov = ", ".join(f"{k} {pv[k]}" for k in prov_keys if pv.get(k) not in (None, ""))
    if prov:
        head.append(f"provenance: {prov}")
    if pv.get("note"):
        head.append(f"note: {pv['note']}")

    def split(p: Part, i: int) -> str:  # an estimate in parentheses (module doc)
        v = _ms(p.split_backward_ms()[i])
        return v if p.split_measured else f"({v})"

    # each optimizer's own step where the profile has one (module doc: K-FAC's and AdamW's always)
    steps = list(dict.fromkeys(k for p in profile.parts for k in p.step_ms)) or list(STEP_KINDS)
    parts = _table(
        ["part", "fwd ms", "bwd ms", "B ms", "W ms",
         *(f"step ms {OPTIMIZERS[k].title if k in OPTIMIZERS else k}" for k in steps),
         "act MiB", "param MiB", "grad MiB", "out MiB", "covered layers"],
        [[p.name, _ms(p.fwd_ms), _ms(p.bwd_ms), split(p, 0), split(p, 1),
          *(_ms(p.step_ms[k]) if k in p.step_ms else "" for k in steps),
          _mib(p.act_bytes), _mib(p.param_bytes), _mib(p.grad_bytes), _mib(p.out_bytes),
          str(len(profile.layers_of(p.name)))] for p in profile.parts]
        + [["total", _ms(sum(p.fwd_ms for p in profile.parts)), _ms(sum(p.bwd_ms for p in profile.parts)),
            _ms(sum(p.split_backward_ms()[0] for p in profile.parts)),
            _ms(sum(p.split_backward_ms()[1] for p in profile.parts)),
            *(_ms(sum(p.step_ms.get(k, 0.0) for p in profile.parts)) for k in steps),
            _mib(sum(p.act_bytes for p in profile.parts)), _mib(sum(p.param_bytes for p in profile.parts)),
            _mib(sum(p.grad_bytes for p in profile.parts)), "", str(len(profile.covered_layers))]],
    )
    layers = _table(
        ["covered layer", "in", "out", "kept A MiB", "kept B MiB", "factors MiB", "inverses MiB"],
        [[l.name, str(l.in_features), str(l.out_features), _mib(l.kept_a_bytes), _mib(l.kept_b_bytes),
          _mib(l.factor_a_bytes + l.factor_b_bytes), _mib(l.inverse_a_bytes + l.inverse_b_bytes)]
         for l in profile.covered_layers],
    )
    sections = [layers]
    if any(p.capture_ms for p in profile.parts):
        sections.append("what capturing adds to a pipeline op on a refresh step (K-FAC; ms per op)\n" + _table(
            ["part", *CAPTURE_KINDS], [[p.name, *(_ms((p.capture_ms or {}).get(k, 0.0)) for k in CAPTURE_KINDS)]
                                       for p in profile.parts]))
    # one table per optimizer the profile has costs for, its entries in its declaration's order
    for name, keys in cost_keys().items():
        if not any(name in l.optimizer_ms for l in profile.covered_layers):
            continue
        act = OPTIMIZERS[name].activation
        once = "inversions and roots"
        if act is not None and any(act in l.optimizer_ms.get(name, {}) for l in profile.covered_layers):
            keys, once = (*keys, act), "roots and their activation"  # at the next cycle's start
        sections.append(
            f"{OPTIMIZERS[name].label} per layer (ms per micro-batch or step; {once} once per refresh)\n"
            + _table(["layer", *keys], [[l.name, *(_ms(l.optimizer_ms[name].get(k, 0.0)) if name in l.optimizer_ms
                                                   else "-" for k in keys)] for l in profile.covered_layers]))
    if pv.get("optimizer_note") and len(sections) > 1:
        sections[1] = f"{pv['optimizer_note']}\n{sections[1]}"
    c = profile.comm
    comm = (f"communication ({c.method}): message {_mib(c.act_bytes)} MiB; "
            f"p2p {c.p2p.latency_ms:.4f} ms + {c.p2p.bytes_per_ms / 1e6:.3f} GB/s "
            f"-> {c.p2p.time_ms(c.act_bytes):.3f} ms per message; "
            f"all-reduce {c.allreduce.latency_ms:.4f} ms + {c.allreduce.bytes_per_ms / 1e6:.3f} GB/s")
    r = profile.runtime
    if r.any():
        comm += (f"\nruntime overheads per rank: {r.op_ms:.4f} ms per op, {r.step_ms:.3f} ms per step, "
                 f"{r.send_ms:.3f} ms per send, {r.recv_ms:.3f} ms per receive whose data is there")
        if r.op_spread:
            comm += ("\nop times from run to run (runtime.op_spread, 12.5% / 87.5% quantiles over the mean): "
                     + ", ".join(f"{k} {v[2]:.2f}/{v[-3]:.2f}" if len(v) == 20 else k for k, v in r.op_spread.items()))
        if len(r.level_spread) == 20:
            comm += (f"\na rank's level from step to step (runtime.level_spread, 12.5% / 87.5%): "
                     f"{r.level_spread[2]:.2f}/{r.level_spread[-3]:.2f}; op_spread is each op's beyond it")
        if r.busy is not None:
            b = r.busy
            comm += (f"\nwith the bubbles filled (runtime.busy: utilization {b.utilization[1]:.3f} against "
                     f"{b.utilization[0]:.3f}): {b.step_ms:.3f} ms per step between steps; 97.5% quantiles "
                     + ", ".join(f"{k} {b.op_spread[k][-1]:.2f} ({r.op_spread[k][-1]:.2f})"
                                 for k in ("message", "between_steps", "send")
                                 if len(b.op_spread.get(k, [])) == 20 and len(r.op_spread.get(k, [])) == 20)
                     + " (the base run's)")
    else:
        comm += "\nruntime overheads: not in this profile (costed as 0)"
    spread = (f"spread: p10/p90 recorded for {len(profile.spread)} entries" if profile.spread
              else "spread: none recorded")
    if not all(p.split_measured for p in profile.parts):
        parts += "\n(B, W in parentheses: not measured, estimated as half the backward each)"
    return "\n\n".join(["\n".join(head), parts, *sections, comm + "\n" + spread])
