"""The rules of a plan, defined once: which ops a refresh cycle must hold, where each runs,
and what each waits for.

`PlanLayout(plan)`: the plan's placement and sizes as queries; `op_dependencies(layout,
rank, cycle, step, op)`: what one listed op waits for; `check_ops`: what a cycle must hold.
The verifier (pfcompile.formats.verify, run by the runtime, inspect, render and before
`pfcompile plan` writes), the replay (pfcompile.check.replay, the timing simulator) and
the drawn task graph (pfcompile.check.deps) all take their rules from here (they live in
the contract package because the runtime verifies plans and imports nothing else). What
an optimizer's op waits for comes from its declaration (pfcompile.formats.dataflow, which
the planners' task graph uses too); tests/test_deps_agree.py checks the rules agree with
that graph on every family, so a plan the runtime accepts is one the compiler's checker
accepts and the picture shows what runs.
Part of the contract package: standard library and pfcompile.formats only.

Every refusal is a PlanError (an InputError: one line naming the file, the op's place
`ranks[q].steps[t][i]`, the op as text with its rank and step, and the rule broken).
"""

from __future__ import annotations

from collections import defaultdict

from pfcompile.formats.dataflow import GRADIENT, producers
from pfcompile.formats.errors import InputError
from pfcompile.formats.ops import (
    FLOATING_KINDS,
    OP_KINDS,
    Op,
    backward_kinds,
    input_grad_kind,
    peer_stage,
    stage_served,
    weight_grad_kind,
)
from pfcompile.formats.optimizers import PASS_FWD
from pfcompile.formats.optimizers import optimizer as optimizer_spec
from pfcompile.formats.plan import Layout, Plan

FLOATING = FLOATING_KINDS  # optimizer work that may run in any step of the refresh cycle (no step in its key)
# An instance of a task in a run of several cycles: (cycle, step | None for floating work, rank, op)
Key = tuple


class PlanError(InputError):
    """A plan that breaks one of the rules: names the rank, step, op and rule."""


def op_name(q: int, t: int, op: Op, cycle: int = 0) -> str:
    return f"{op} (rank {q}, step {t}{f', cycle {cycle}' if cycle else ''})"


def op_field(q: int, t: int, i: int) -> str:
    return f"ranks[{q}].steps[{t}][{i}]"


class PlanLayout(Layout):
    """The plan's placement, sizes, covered layers and optimizer (its declaration: `spec`), as queries."""

    def __init__(self, plan: Plan):
        super().__init__(plan.placement, plan.micro_batch_replica)
        c = plan.config
        self.S = plan.num_stages
        self.R = c.replicas
        self.N = c.micro_batches
        self.k = plan.refresh_steps
        self.W = plan.world_size
        self.spec = optimizer_spec(c.optimizer, defer_stats=c.defer_stats)  # pfcompile.formats.optimizers
        self.work = self.spec.has_work
        schedule = c.schedule
        self.backward = backward_kinds(schedule)  # ("bwd",) or split: ("bwd_input", "bwd_weight")
        self.B = input_grad_kind(schedule)  # makes the input gradient (send_grad waits for it)
        self.Wk = weight_grad_kind(schedule)  # completes the weight gradients of a micro-batch
        self.mbr = self.micro_batch_replica
        self.layer_stage = plan.layer_stage
        self.stage_layers = [[l for l, s in enumerate(self.layer_stage) if s == st] for st in range(self.S)]
        # divided work (split preconditioning): the replica that does each layer's per-step
        # work (None: every one)
        owner = c.precond_owner if c.precond == "split" and self.work else None
        self.precond_owner: list[int | None] | None = list(owner) if owner is not None else None

    def split_stage(self, stage: int) -> bool:
        """Whether the stage's gradients go rs_grad -> own preconditioning -> ag_grad."""
        return self.precond_owner is not None and any(self.precond_owner[l] is not None
                                                       for l in self.stage_layers[stage])

    def preconditions(self, rank: int, stage: int) -> list[int]:
        """The covered layers of `stage` whose per-step optimizer work (`spec.step_kinds`)
        `rank` does each step."""
        if not self.work:
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

    def instance(self, c: int, t: int, q: int, op: Op) -> tuple:
        """The key of one executed op: floating K-FAC work is one instance per cycle."""
        return (c, None if op.kind in FLOATING_KINDS else t, q, op)


# --- what each op waits for ----------------------------------------------------------------------

_MADE: dict[tuple, Op] = {}  # ops made by the rules, by fields: one object each (cleared past _MADE_MAX)
_MADE_MAX = 1 << 20


def _op(kind: str, stage=None, mb=None, layer=None, factor=None, peer=None) -> Op:
    """An Op from fields already validated (those of a listed op and the plan's layout),
    without Op's checks: the rules build one per dependency, for every op of a plan, so
    each distinct op is made once and then reused."""
    key = (kind, stage, mb, layer, factor, peer)
    o = _MADE.get(key)
    if o is not None:
        return o
    o = object.__new__(Op)
    for name, v in zip(("kind", "stage", "mb", "layer", "factor", "peer"), key):
        object.__setattr__(o, name, v)
    object.__setattr__(o, "_hash", hash(key))  # as Op.__post_init__
    if len(_MADE) >= _MADE_MAX:
        _MADE.clear()
    _MADE[key] = o
    return o


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
            local.append(here(_op("fwd", stage=s - 1, mb=op.mb)) if L.rank[(s - 1, r)] == q
                         else here(_op("recv_act", stage=s - 1, mb=op.mb, peer=L.rank[(s - 1, r)])))
        if t > 0:
            local.append(here(_op("step", stage=s), t - 1))
        elif c > 0:
            local.append((c - 1, L.k - 1, q, _op("step", stage=s)))
    elif k in ("bwd", "bwd_input"):
        local.append(here(_op("fwd", stage=s, mb=op.mb)))
        if s + 1 < S:
            local.append(here(_op(k, stage=s + 1, mb=op.mb)) if L.rank[(s + 1, r)] == q
                         else here(_op("recv_grad", stage=s + 1, mb=op.mb, peer=L.rank[(s + 1, r)])))
    elif k == "bwd_weight":
        local.append(here(_op("bwd_input", stage=s, mb=op.mb)))
    elif k == "send_act":
        local.append(here(_op("fwd", stage=s, mb=op.mb)))
    elif k == "send_grad":
        local.append(here(_op(L.B, stage=s, mb=op.mb)))
    elif k in ("recv_act", "recv_grad"):
        send = _op("send_" + k[5:], stage=op.stage, mb=op.mb, peer=q)
        remote.append((c, t, op.peer, send))
    elif k in ("sync_grad", "rs_grad"):
        local += [here(_op(L.Wk, stage=s, mb=m)) for m in mine]
    elif k == "ag_grad":  # after this replica's own share of the per-step work
        local.append(here(_op("rs_grad", stage=s)))
        local += [here(_op(L.spec.update, layer=l)) for l in L.stage_layers[s] if L.precond_owner[l] == r]
    elif k == "step":
        if L.split_stage(s):
            local.append(here(_op("ag_grad", stage=s)))
            local += [here(_op(L.spec.update, layer=l)) for l in L.stage_layers[s] if L.precond_owner[l] is None]
        elif L.work and L.stage_layers[s]:
            local += [here(_op(L.spec.update, layer=l)) for l in L.stage_layers[s]]
        else:
            local += _gradient(L, s, mine, here)
    elif op.is_optimizer_work:
        local += _optimizer_dependencies(L, q, c, t, s, mine, op)
    return local, remote


def _gradient(L: PlanLayout, s: int, mine: list[int], here) -> list[Key]:
    """What makes the stage's gradient of the step on this replica: its reduce-scatter
    (divided work), its all-reduce (replicas), or this replica's weight-gradient passes."""
    if L.split_stage(s):
        return [here(_op("rs_grad", stage=s))]
    return [here(_op("sync_grad", stage=s))] if L.R > 1 else [here(_op(L.Wk, stage=s, mb=m)) for m in mine]


def _optimizer_dependencies(L: PlanLayout, q: int, c: int, t: int, s: int, mine: list[int], op: Op) -> list[Key]:
    """What an optimizer op waits for, from its declaration's reads and writes
    (pfcompile.formats.dataflow.producers) as the ops of this plan: a pass of the op's
    stage, the stage's gradient, or the optimizer's ops of the layer. A broadcast waits for
    its source's op on the source only (the others wait for it at the rendezvous)."""
    out: list[Key] = []
    for p in producers(L.spec, op.kind, op.factor, replicas=L.R > 1):
        if p.on_source and op.peer != q:
            continue
        step = 0 if p.first_step else None if p.kind in FLOATING_KINDS else t
        at = lambda o, step=step: (c, step, q, o)  # noqa: E731
        mbs = mine if p.every_micro_batch else [op.mb]
        if p.kind == GRADIENT:
            out += _gradient(L, s, mine, at)
        elif p.is_pass:
            out += [at(_op("fwd" if p.kind == PASS_FWD else L.Wk, stage=s, mb=m)) for m in mbs]
        else:
            fields = OP_KINDS[p.kind][1]
            factor = p.factor if "factor" in fields else None
            out += [at(_op(p.kind, layer=op.layer, mb=m, factor=factor)) for m in mbs] if "mb" in fields \
                else [at(_op(p.kind, layer=op.layer, factor=factor))]
    return out


def differs_by_cycle(t: int, op: Op) -> bool:
    """Whether `op_dependencies` of this listing differs between cycle 0 and a later cycle
    beyond the cycle index itself: only a first step's forward (it waits for the previous
    cycle's update). tests/test_deps_agree.py checks this against op_dependencies."""
    return t == 0 and op.kind == "fwd"


class CycleIndex:
    """Every op the plan lists as one integer id (rank by rank, step by step, in list order:
    a rank's ids are contiguous and in its execution order), and what each waits for as
    ids, derived once with `op_dependencies` for cycle 0 and cycle 1 (the rules of a cycle
    c > 1 are cycle 1's with every cycle index moved by c - 1; cycle 0's first forwards
    wait for no earlier update). The replay and the verifier execute several cycles over
    these integers: instance `c * M + j` is listing j in cycle c.

    - `ops[j]`, `rank[j]`, `step[j]`, `pos[j]`: the listing (op, rank, step, index in the step);
      `first[q]:first[q + 1]` are rank q's ids.
    - `remote[b][j]`: [(cycle offset, id)] of the sends a receive waits for, cycle b = 0 or
      1 (id -1: the send is listed nowhere, so the receive never runs).
    - `early[b][j]`: (dependency op, listed) for the first local dependency (same rank,
      same rules as the replay's) that in-order execution cannot have run before j: not
      listed at all, or listed later on the rank. Empty for a valid plan.
    - `members[j]`: for a collective, the ids of its listing on each member of the stage's
      group (ascending ranks; -1 where a member does not list it)."""

    def __init__(self, plan: Plan, L: PlanLayout):
        ops: list[Op] = []
        rank: list[int] = []
        step: list[int] = []
        pos: list[int] = []
        first: list[int] = []
        at: dict[tuple, int] = {}  # (step | None for floating work, rank, op) -> id
        for q in range(L.W):
            first.append(len(ops))
            for t in range(L.k):
                for i, po in enumerate(plan.ranks[q][t]):
                    op = po.op
                    at[(None if op.kind in FLOATING else t, q, op)] = len(ops)
                    ops.append(op)
                    rank.append(q)
                    step.append(t)
                    pos.append(i)
        first.append(len(ops))
        self.ops, self.rank, self.step, self.pos, self.first, self.M = ops, rank, step, pos, first, len(ops)
        self.remote: list[list[list[tuple[int, int]]]] = [[], []]
        self.early: list[dict[int, tuple[Op, bool]]] = [{}, {}]
        for b in (0, 1):
            remote, early = self.remote[b], self.early[b]
            for j, op in enumerate(ops):
                if b == 1 and not differs_by_cycle(step[j], op):  # cycle 0's, relative to the cycle
                    remote.append(self.remote[0][j])
                    if j in self.early[0]:
                        early[j] = self.early[0][j]
                    continue
                local, rem = op_dependencies(L, rank[j], b, step[j], op)
                for c, tt, qq, dop in local:  # always on rank[j] itself
                    d = at.get((tt, qq, dop))
                    if d is None or (c == b and d >= j):
                        early[j] = (dop, d is not None)
                        break
                remote.append([(c - b, at.get((tt, qq, dop), -1)) for c, tt, qq, dop in rem] if rem else [])
        self.members: dict[int, list[int]] = {}
        for j, op in enumerate(ops):
            if op.is_collective:
                tt = None if op.kind in FLOATING else step[j]
                self.members[j] = [at.get((tt, p, op), -1) for p in L.group(L.stage_of(op))]
        self._at = at

    def find(self, t: int | None, q: int, op: Op) -> int:
        """The id of `op` listed on rank q in step t (None: floating work, any step); -1 if not listed."""
        return self._at.get((None if op.kind in FLOATING else t, q, op), -1)


# --- what the cycle must hold, each op once where it belongs --------------------------------------

def check_ops(plan: Plan, L: PlanLayout, where: str) -> dict[tuple[int, Op], int]:
    """Every op on a rank that holds its stage, for a micro-batch of that replica, with the
    right peer; nothing twice; every op the configuration implies present and nothing else.
    -> {(rank, floating op): step it is listed in}."""
    floating_seen: dict[tuple[int, Op], int] = {}
    for q in range(L.W):
        for t in range(L.k):
            seen: dict[Op, int] = {}
            for i, po in enumerate(plan.ranks[q][t]):
                op = po.op
                at, name = op_field(q, t, i), op_name(q, t, op)
                if op.kind in ("bwd", "bwd_input", "bwd_weight") and op.kind not in L.backward:
                    raise PlanError(where, at, f"{name}: the {plan.config.schedule} family's backward ops "
                                    f"are {', '.join(L.backward)} (rule: ops)")
                if op.is_optimizer_work and op.kind not in L.spec.kinds:
                    raise PlanError(where, at, f"{name} is not an op of the plan's optimizer "
                                    f"({plan.config.optimizer}) (rule: ops)")
                if op.factor is not None and op.factor not in L.spec.factors:
                    raise PlanError(where, at, f"{name}: the plan's optimizer ({plan.config.optimizer}) has no factor "
                                    f"{op.factor} (rule: ops)")
                s = L.stage_of(op)
                if not 0 <= s < L.S or s not in L.held[q]:
                    raise PlanError(where, at, f"{name}: rank {q} holds no replica of stage {s} (rule: placement)")
                r = L.held[q][s]
                if op.mb is not None and L.mbr[op.mb] != r:
                    raise PlanError(where, at, f"{name}: micro-batch {op.mb} runs on replica {L.mbr[op.mb]}, "
                                    f"rank {q} holds replica {r} (rule: placement)")
                _check_peer(L, q, op, at, name, where)
                if op.is_collective and L.R == 1:
                    raise PlanError(where, at, f"{name}: a collective between replicas in a plan with one "
                                    f"replica (rule: ops)")
                if op.kind in ("rs_grad", "ag_grad") and not L.split_stage(s) or \
                        op.kind == "sync_grad" and L.split_stage(s) or \
                        op.kind in L.spec.step_kinds and op.layer not in L.preconditions(q, s):
                    raise PlanError(where, at, f"{name}: not an op of this rank under the plan's "
                                    f"preconditioning (config.precond) (rule: ops)")
                if op.kind in FLOATING:
                    if (q, op) in floating_seen:
                        raise PlanError(where, at, f"{name} is listed twice in the cycle (also in step "
                                        f"{floating_seen[(q, op)]}) (rule: once)")
                    floating_seen[(q, op)] = t
                elif op in seen:
                    raise PlanError(where, at, f"{name} is listed twice in step {t} (also at [{seen[op]}]) (rule: once)")
                seen[op] = i
            _check_step_complete(L, q, t, set(seen), where)
    if L.spec.refreshes:
        _check_refresh_complete(L, floating_seen, where)
    return floating_seen


def _check_peer(L: PlanLayout, q: int, op: Op, at: str, name: str, where: str) -> None:
    if op.kind == L.spec.broadcast:  # its peer is the source, a member of the stage's group
        if op.peer not in L.group(L.stage_of(op)):
            raise PlanError(where, at, f"{name}: rank {op.peer} holds no replica of stage {L.stage_of(op)} (rule: peer)")
        return
    if not op.is_p2p:
        return
    other = peer_stage(op)
    if not 0 <= other < L.S:
        raise PlanError(where, at, f"{name}: there is no stage {other} to exchange with (rule: peer)")
    expected = L.rank[(other, L.mbr[op.mb])]
    if expected == q:
        raise PlanError(where, at, f"{name}: stage {other} is on rank {q} itself, no message is sent (rule: peer)")
    if op.peer != expected:
        raise PlanError(where, at, f"{name}: the peer of this message is rank {expected}, not {op.peer} (rule: peer)")


def _check_step_complete(L: PlanLayout, q: int, t: int, ops: set[Op], where: str) -> None:
    for s, r in sorted(L.held[q].items()):
        # built from the layout's own fields: unvalidated (_op), one per op of every step
        need = [_op(kind, stage=s, mb=m) for m in L.mbs_of(r) for kind in ("fwd",) + L.backward]
        need.append(_op("step", stage=s))
        if L.split_stage(s):
            need += [_op("rs_grad", stage=s), _op("ag_grad", stage=s)]
        elif L.R > 1:
            need.append(_op("sync_grad", stage=s))
        need += [_op(kind, layer=l) for l in L.preconditions(q, s) for kind in L.spec.step_kinds]
        for op in need:
            if op not in ops:
                raise PlanError(where, f"ranks[{q}].steps[{t}]", f"{op_name(q, t, op)} is missing (rule: complete)")


def _check_refresh_complete(L: PlanLayout, floating: dict, where: str) -> None:
    """The cycle's work of the plan's optimizer, once on each rank that must do it: each
    micro-batch op of every replica's micro-batches, the reductions (replicas), each factor's
    refresh on its inverters (the owner when the work is divided) and the broadcasts from one
    of them to every replica that does not refresh it itself."""
    def missing(q, op):
        return PlanError(where, f"ranks[{q}]", f"{op} (rank {q}, any step of the cycle) is missing (rule: complete)")

    spec = L.spec
    bcasts: dict[tuple[int, str], dict[int, int]] = defaultdict(dict)  # (layer, factor) -> {rank: source}
    for (q, o) in floating:
        if o.kind == spec.broadcast:
            if (o.layer, o.factor) in bcasts and q in bcasts[(o.layer, o.factor)]:
                raise PlanError(where, f"ranks[{q}]", f"{o} (rank {q}): a second broadcast of factor {o.factor} "
                                f"of layer {o.layer} (rule: once)")
            bcasts[(o.layer, o.factor)][q] = o.peer
    for l, s in enumerate(L.layer_stage):
        group = L.group(s)
        for q in group:
            for m in L.mbs_of(L.held[q][s]):
                for d in spec.micro_batch_ops:
                    if (q, Op(d.kind, layer=l, mb=m)) not in floating:
                        raise missing(q, Op(d.kind, layer=l, mb=m))
            if L.R > 1 and spec.reduces:
                for f in spec.factors:
                    if (q, Op(spec.reduction, layer=l, factor=f)) not in floating:
                        raise missing(q, Op(spec.reduction, layer=l, factor=f))
        owner = L.precond_owner[l] if L.precond_owner is not None else None
        for f in spec.factors:
            inverters = [q for q in group if (q, Op(spec.refresh, layer=l, factor=f)) in floating]
            if owner is not None:  # split preconditioning: the owner inverts, nobody else needs it
                q = L.rank[(s, owner)]
                if q not in inverters:
                    raise missing(q, Op(spec.refresh, layer=l, factor=f))
                continue
            if not inverters:
                raise missing(group[0], Op(spec.refresh, layer=l, factor=f))
            got = bcasts.get((l, f), {})
            if len(inverters) == len(group):
                if got:
                    q = min(got)
                    raise PlanError(where, f"ranks[{q}]", f"{Op(spec.broadcast, layer=l, factor=f, peer=got[q])} (rank {q}): every replica inverts "
                                    f"factor {f} of layer {l}, nothing to broadcast (rule: ops)")
                continue
            for q in group:
                if q not in got:
                    raise missing(q, Op(spec.broadcast, layer=l, factor=f, peer=inverters[0]))
            sources = set(got.values())
            for q, src in sorted(got.items()):
                if src not in inverters:
                    raise PlanError(where, f"ranks[{q}]", f"{Op(spec.broadcast, layer=l, factor=f, peer=src)} (rank {q}): rank {src} does not invert "
                                    f"factor {f} of layer {l} (rule: peer)")
                if len(sources) > 1:
                    raise PlanError(where, f"ranks[{q}]", f"{Op(spec.broadcast, layer=l, factor=f, peer=src)} (rank {q}): the members of the broadcast "
                                    f"name different sources {sorted(sources)} (rule: peer)")
