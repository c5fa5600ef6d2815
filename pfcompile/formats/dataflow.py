"""What each optimizer op waits for, derived from its declaration's `reads` and `writes`.

One pass, used by the verifier and the replay (pfcompile.formats.rules) and by the task
graph the planners place (pfcompile.graph.taskgraph): `producers(spec, kind, factor,
replicas=...)` says, at the level of the declaration, which ops an op of `kind` (of the
factor `factor`, for an op keyed by one) waits for; each caller turns that into the ops
of its plan or graph.

The writers of a name, in order: what the pipeline makes (`PIPELINE_WRITES`: a
micro-batch's layer input after its forward, its output gradient after the pass that
completes its weight gradients, the stage's gradient of the step), then the optimizer's
ops in the order they are declared. An op waits for

- the latest writer before it, in its scope, of each name it reads (read after write);
- the ops before it, in its scope, that read a name it overwrites since that name's
  latest write (write after read: Shampoo's statistics read the gradient that the
  preconditioning then overwrites with the update);

and of these, not for one that another of them already waits for (the dependency holds
through it). An op keyed by a factor reads and writes that factor's names (`stat:F` of
sync_curv A is `stat:A`). A collective is present only when the stage has replicas.

Scopes: a per-step op reads what the same step writes; what a per-cycle op (or a
micro-batch op) writes is, for a per-step op, the previous cycle's, in force since the
cycle began and run before it on the same rank: no dependency. A per-cycle or micro-batch
op reads what the cycle writes, and what a step or a pass writes as of the cycle's first
step; a micro-batch op reads its own micro-batch's, a per-cycle op every micro-batch's of
its replica. A collective with a peer (a broadcast) reads on its peer, the source; every
other op on its own rank (a collective's members each wait for their own writers, then
for each other). An op does not wait for its own earlier instances (the previous step's:
they ran before it on its rank).

Part of the contract package: standard library and pfcompile.formats only.
"""

from __future__ import annotations

from dataclasses import dataclass

from pfcompile.formats.ops import OP_KINDS
from pfcompile.formats.optimizers import CYCLE, MICRO_BATCH, PASS_FWD, PASS_WGRAD, STEP, OpDecl, Optimizer

# the stage's gradient of the step on a replica: its all-reduce (sync_grad), its reduce-scatter
# (rs_grad, divided work) or the replica's own weight-gradient passes (the pipeline's rules
# say which: pfcompile.formats.rules, pfcompile.graph.taskgraph)
GRADIENT = "gradient"
# what the pipeline makes that an optimizer op may read: name -> (writer, when)
PIPELINE_WRITES: dict[str, tuple[str, str]] = {
    "input": (PASS_FWD, MICRO_BATCH),
    "output_grad": (PASS_WGRAD, MICRO_BATCH),
    "grad": (GRADIENT, STEP),
}
FACTOR = ":F"  # the factor placeholder in a name: `stat:F` of an op keyed by factor A is `stat:A`


@dataclass(frozen=True)
class Producer:
    """One thing an op waits for.

    `kind`: an optimizer op kind, a pass (PASS_FWD, PASS_WGRAD: of the op's stage) or
    GRADIENT; `factor`: the producer's factor, for an op keyed by one; `first_step`: the
    instance of the cycle's first step (a floating op reading what a step or a pass
    makes); `every_micro_batch`: one per micro-batch of the replica (a per-cycle op
    reading what micro-batch ops or passes make; a micro-batch op reads its own
    micro-batch's); `on_source`: on the reader's peer rank (a broadcast's source), not its
    own; `name`: the name read or overwritten that makes the dependency."""

    kind: str
    name: str
    factor: str | None = None
    first_step: bool = False
    every_micro_batch: bool = False
    on_source: bool = False

    @property
    def is_pass(self) -> bool:
        return self.kind in (PASS_FWD, PASS_WGRAD)


@dataclass(frozen=True)
class _Writer:
    kind: str
    when: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    collective: bool = False
    keyed_by_factor: bool = False


def _writers(spec: Optimizer) -> tuple[_Writer, ...]:
    pipeline = tuple(_Writer(kind, when, (), (name,)) for name, (kind, when) in PIPELINE_WRITES.items())
    return pipeline + tuple(_Writer(d.kind, d.when, d.reads, d.writes, d.collective, _keyed_by_factor(d))
                            for d in spec.ops)


def _keyed_by_factor(d: OpDecl) -> bool:
    return "factor" in OP_KINDS[d.kind][1]


def _bind(name: str, factor: str | None) -> str:
    if FACTOR not in name:
        return name
    if factor is None:
        raise ValueError(f"{name!r} names a factor, but its op is not keyed by one")
    return name.replace(FACTOR, ":" + factor)


def _match(written: str, w: _Writer, name: str, factors: tuple[str, ...]) -> tuple[bool, str | None]:
    """Whether `w`'s declared `written` is `name`, and the factor of the instance that writes it."""
    if FACTOR in written and w.keyed_by_factor:
        for f in factors:
            if written.replace(FACTOR, ":" + f) == name:
                return True, f
        return False, None
    return written == name, None


def _floating(when: str) -> bool:
    return when in (MICRO_BATCH, CYCLE)


def _producer(reader: _Writer, w: _Writer, name: str, factor: str | None) -> Producer | None:
    """What `reader` waits for when `w` made (or read) `name` before it; None: nothing in its scope."""
    if not _floating(reader.when):  # per step
        if _floating(w.when):
            return None  # the previous cycle's, in force since the cycle began
        return Producer(w.kind, name, factor)
    return Producer(w.kind, name, factor, first_step=not _floating(w.when) or w.kind in (PASS_FWD, PASS_WGRAD),
                    every_micro_batch=reader.when == CYCLE and w.when == MICRO_BATCH,
                    on_source=reader.collective and "peer" in OP_KINDS[reader.kind][1])


# (optimizer name, kind, factor, replicas) -> (the declaration, its producers): the rules ask
# for every listed op, and hashing a whole declaration per ask would cost more than the answer
_DERIVED: dict[tuple, tuple[Optimizer, tuple[Producer, ...]]] = {}


def producers(spec: Optimizer, kind: str, factor: str | None = None, *, replicas: bool) -> tuple[Producer, ...]:
    """What an op of `kind` (keyed by `factor`, when its kind is) waits for in a plan of
    `spec`; `replicas`: whether the stage has replicas (collectives are present). In the
    order of its reads, then of what it overwrites (module docstring)."""
    key = (spec.name, spec.deferred_stats, kind, factor, replicas)
    got = _DERIVED.get(key)
    if got is None or got[0] is not spec:
        got = _DERIVED[key] = (spec, _derive(spec, kind, factor, replicas))
    return got[1]


def _derive(spec: Optimizer, kind: str, factor: str | None, replicas: bool) -> tuple[Producer, ...]:
    writers = _writers(spec)
    at = next((i for i, w in enumerate(writers) if w.kind == kind and i >= len(PIPELINE_WRITES)), None)
    if at is None:
        raise ValueError(f"optimizer {spec.name!r} declares no op {kind!r}")
    reader = writers[at]
    before = [w for w in writers[:at] if replicas or not w.collective]
    found: list[Producer] = []

    def latest_writer(name: str) -> tuple[int, str | None]:
        """(index in `before`, factor of the instance) of the latest writer of `name`; (-1, None): none."""
        for i in range(len(before) - 1, -1, -1):
            for written in before[i].writes:
                hit, f = _match(written, before[i], name, spec.factors)
                if hit:
                    return i, f
        return -1, None

    for read in reader.reads:
        name = _bind(read, factor)
        if not any(_match(written, w, name, spec.factors)[0] for w in writers for written in w.writes):
            # a misspelt name would silently wait for nothing
            raise ValueError(f"optimizer {spec.name!r}: {kind} reads {name!r}, which nothing writes")
        i, f = latest_writer(name)
        p = _producer(reader, before[i], name, f) if i >= 0 else None
        if p is not None:
            found.append(p)
    for written in reader.writes:  # write after read: who read it since its latest write
        name = _bind(written, factor)
        i, _ = latest_writer(name)
        for w in before[i + 1:]:
            if _floating(w.when) != _floating(reader.when):  # another scope reads another instance
                continue
            for read in w.reads:
                f = factor if w.keyed_by_factor else None
                if (FACTOR not in read or f is not None) and _bind(read, f) == name:
                    p = _producer(reader, w, name, f)
                    if p is not None and p not in found:
                        found.append(p)
    # not what another of them already waits for (in the same scope)
    implied = set()
    for p in found:
        if p.is_pass or p.kind == GRADIENT:
            continue
        for kind_factor in _ancestors(spec, p.kind, p.factor, replicas):
            implied.add((*kind_factor, p.first_step, p.every_micro_batch, p.on_source))
    return tuple(p for p in found if (p.kind, p.factor, p.first_step, p.every_micro_batch, p.on_source) not in implied)


def _ancestors(spec: Optimizer, kind: str, factor: str | None, replicas: bool) -> set[tuple[str, str | None]]:
    """The (kind, factor) an op waits for in its own scope (same step or cycle, same
    micro-batch and rank), directly or through others."""
    out: set[tuple[str, str | None]] = set()
    for p in producers(spec, kind, factor, replicas=replicas):
        if p.first_step or p.every_micro_batch or p.on_source:
            continue
        out.add((p.kind, p.factor))
        if not (p.is_pass or p.kind == GRADIENT):
            out |= _ancestors(spec, p.kind, p.factor, replicas)
    return out


def reads_pass(decl: OpDecl) -> str | None:
    """The pass (PASS_*) whose micro-batch tensor a micro-batch op reads, and so keeps from
    that pass until it has run; None for any other op."""
    if decl.when != MICRO_BATCH:
        return None
    return next((PIPELINE_WRITES[n][0] for n in decl.reads if PIPELINE_WRITES.get(n, (None, None))[1] == MICRO_BATCH),
                None)


def kept_passes(spec: Optimizer) -> tuple[str, ...]:
    """The passes whose tensors the optimizer's micro-batch ops keep until they have run."""
    return tuple(dict.fromkeys(p for p in map(reads_pass, spec.micro_batch_ops) if p is not None))


def captures(spec: Optimizer) -> bool:
    """Whether the optimizer's refresh step captures: its micro-batch ops keep a pass (K-FAC's
    hooks save each layer's input and output gradient), which slows that step's pipeline
    ops (pfcompile.formats.profile.Part.capture_ms)."""
    return spec.has_work and bool(kept_passes(spec))
