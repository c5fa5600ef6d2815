"""The plan verifier: one check every reader of a plan runs before trusting it.

Run by the runtime on load (before any collective), by `pfcompile inspect` and `render`,
and by `pfcompile plan` before it writes. Torch-free and solver-free (the contract
package): it needs no profile and no costs, only the plan, the rules of
pfcompile.formats.rules and the built-in models of pfcompile.formats.models. Everything
the runtime checks of a plan before it trains is here, so no file passes one and fails
the other; what the runtime checks besides depends on the job, not the file (world size,
--model-code, the data, the device present). It refuses, with one line naming the rank, step, op and rule:

- config: the configuration, placement and micro-batch split agree with each other;
- model: the model spec is the one the plan was made for (`profile.model_hash`, written
  by the planner, binds the spec to the hash of the profile it was costed from: a changed
  micro-batch, width or depth would train something the plan's times and memory were not
  computed for), with the micro-batch, sequence length, dtype and device the runtime
  needs; given the profile (`pfcompile plan`), the plan's profile hash and each field of
  its spec must be the profile's;
- parts: the partition cuts the model's parts in order and each K-FAC layer lies in a part
  of its stage, the parts being those the plan recorded from its profile (`profile.parts`),
  whatever the model's name: planning needs no model code (a reference or synthetic
  profile plans as well as a measured one), and the runtime alone refuses a model it
  cannot build. A built-in model's sizes, parts and layers must also be the built-in's
  (pfcompile.formats.models); a user model's parts are checked once more by the runtime
  against its code;
- times: every predicted start/end finite and within a day of the cycle's start (checked
  first), and in each rank's execution order (checked last: any reordering breaks it,
  and the rules before it name what the reordering broke);
- ops: each op of the cycle exactly once where it belongs, and nothing else
  (rules.check_ops);
- pair order: for every ordered pair of ranks, the sends of each step are received in the
  order they are sent (NCCL matches a pair's messages in issue order and ignores tags;
  two swapped messages of one shape would silently exchange activations);
- order: the ranks' lists executed as the runtime executes them — receives and
  collectives block, sends are posted and completed at the end of their step — over two
  cycles: every op's dependencies have run before it on its rank, and no rank waits
  forever (a deadlock names each rank's stuck op).
"""

from __future__ import annotations

import math
from collections import defaultdict

from pfcompile.formats.errors import cut, echo
from pfcompile.formats.jsonio import canonical_hash
from pfcompile.formats.limits import MAX_TIME_MS
from pfcompile.formats.models import (
    BLOCK_LINEARS,
    BUILTIN_MODELS,
    DEVICE_TYPES,
    DTYPES,
    MODEL_INTS,
    is_user_model,
    kfac_layer_names,
    part_names,
)
from pfcompile.formats.plan import Plan
from pfcompile.formats.rules import CycleIndex, PlanError, PlanLayout, check_ops, op_field, op_name

# The planner rounds times to 1e-6 ms; consecutive ops may touch within that.
_TIME_TOLERANCE_MS = 1e-5
MODEL_REQUIRED = ("micro_batch", "seq_len")  # the runtime's batches are made of them


def verify_plan(plan: Plan, where: str = "<plan>", *, profile_model: dict | None = None,
                profile_hash: str | None = None, cycles: int = 2) -> PlanLayout:
    """Raise PlanError on the first rule the plan breaks; returns the plan's PlanLayout.
    `profile_model`, `profile_hash`: the spec and content hash of the profile the plan is
    said to be made from, where the reader has it."""
    check_config(plan, where)
    check_model(plan, where, profile_model)
    if profile_hash is not None:
        check_profile_hash(plan, where, profile_hash)
    check_parts(plan, where)
    check_time_values(plan, where)
    L = PlanLayout(plan)
    check_ops(plan, L, where)
    check_order(plan, L, where, cycles=cycles)
    check_pair_order(plan, L, where)  # after: a missing message is named by its consumer first
    check_time_order(plan, where)  # last: any reordering breaks it, the rules above say why
    return L


# --- config ---------------------------------------------------------------------------------------

def check_config(plan: Plan, where: str) -> None:
    c = plan.config
    S, R, W, N = plan.num_stages, c.replicas, plan.world_size, c.micro_batches
    v = c.virtual_stages
    if S != c.stages * v:
        raise PlanError(where, "partition", f"{S} stages but config.stages x virtual_stages is "
                        f"{c.stages} x {v} (rule: config)")
    replicas: dict[int, set[int]] = defaultdict(set)
    on_rank: dict[tuple[int, int], int] = {}
    for i, p in enumerate(plan.placement):
        s, r, q = p["stage"], p["replica"], p["rank"]
        replicas[s].add(r)
        if (q, s) in on_rank:
            raise PlanError(where, f"placement[{i}]", f"rank {q} holds two replicas of stage {s} (rule: config)")
        on_rank[(q, s)] = r
    for s in range(S):
        if replicas[s] != set(range(R)):
            raise PlanError(where, "placement", f"stage {s} has replicas {sorted(replicas[s])}, config.replicas "
                            f"is {R} (rule: config)")
    idle = sorted(set(range(W)) - {q for q, _ in on_rank})
    if idle:
        raise PlanError(where, "placement", f"rank {idle[0]} holds no stage (rule: config)")
    mbr = plan.micro_batch_replica
    if len(mbr) != N:
        raise PlanError(where, "micro_batch_replica", f"has {len(mbr)} entries for config.micro_batches {N} "
                        "(rule: config)")
    bad = next((m for m, r in enumerate(mbr) if r >= R), None)
    if bad is not None:
        raise PlanError(where, f"micro_batch_replica[{bad}]", f"replica {mbr[bad]} of {R} (rule: config)")


# --- model ----------------------------------------------------------------------------------------

def model_hash(model: dict, profile_hash: str) -> str:
    """The plan's `profile.model_hash`: its model spec bound to the content hash of the
    profile its times were costed from (which covers the profile's own spec), so a spec
    edited after planning fails even where only the spec's own hash was recomputed."""
    return canonical_hash({"model": model, "profile_hash": profile_hash})


def check_model(plan: Plan, where: str, profile_model: dict | None = None) -> None:
    m = plan.model
    if not isinstance(m.get("name"), str) or not m["name"]:
        raise PlanError(where, "model.name", "must be a non-empty string (rule: model)")
    for key in MODEL_INTS:
        v = m.get(key)
        if v is not None or key in MODEL_REQUIRED:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(where, f"model.{key}", f"must be a positive integer, got {echo(v)} (rule: model)")
    if "kind" in m and not isinstance(m["kind"], str):
        raise PlanError(where, "model.kind", f"must be a string, got {echo(m['kind'])} (rule: model)")
    if m.get("dtype") is not None and m["dtype"] not in DTYPES:
        raise PlanError(where, "model.dtype", f"{echo(m['dtype'])} is not one the runtime runs "
                        f"({', '.join(DTYPES)}) (rule: model)")
    device = plan.profile.get("device_type") if isinstance(plan.profile, dict) else None
    if device is not None and device not in DEVICE_TYPES:
        raise PlanError(where, "profile.device_type", f"{echo(device)} is not one the runtime runs "
                        f"({', '.join(DEVICE_TYPES)}) (rule: model)")
    want = plan.profile.get("model_hash") if isinstance(plan.profile, dict) else None
    if want is None:
        raise PlanError(where, "profile.model_hash", "missing: the plan does not say which model spec it was "
                        "made for (remake it with this pfcompile) (rule: model)")
    profile_hash = plan.profile.get("hash")
    if not isinstance(profile_hash, str):
        raise PlanError(where, "profile.hash", f"must be the profile's content hash, got {echo(profile_hash)} "
                        "(rule: model)")
    if model_hash(m, profile_hash) != want:
        raise PlanError(where, "model", "differs from the spec the plan's times and memory were computed for "
                        "(profile.model_hash, of the spec and profile.hash); remake the plan from a profile of "
                        "this model (rule: model)")
    if profile_model is not None and m != profile_model:
        diff = sorted(k for k in set(m) | set(profile_model) if m.get(k) != profile_model.get(k))
        raise PlanError(where, f"model.{diff[0]}", f"{echo(m.get(diff[0]))} but the profile's is "
                        f"{echo(profile_model.get(diff[0]))} (rule: model)")


def check_profile_hash(plan: Plan, where: str, profile_hash: str) -> None:
    """The plan names the profile the reader holds (its times were costed from that one)."""
    got = plan.profile.get("hash") if isinstance(plan.profile, dict) else None
    if got != profile_hash:
        raise PlanError(where, "profile.hash", f"{echo(got)} is not the hash of the profile given "
                        f"({echo(profile_hash)}): the plan was made from another profile (rule: model)")


# --- parts ----------------------------------------------------------------------------------------

def model_parts(plan: Plan, where: str) -> list[str] | None:
    """The parts of the plan's model, in order, as its profile recorded them
    (`profile.parts`), for any model name: planning needs no model code, and a plan made
    from a reference or synthetic profile is as checkable as one of a built-in model. A
    built-in model's spec must also have the built-in's sizes, and its recorded parts be
    the built-in's (a plan that records none is checked against the built-in's). None: a
    user model's plan made before plans recorded parts (the runtime alone checks those)."""
    m, name = plan.model, plan.model["name"]
    recorded = plan.profile.get("parts") if isinstance(plan.profile, dict) else None
    if recorded is not None and (not isinstance(recorded, list) or not recorded
                                 or not all(isinstance(p, str) for p in recorded)):
        raise PlanError(where, "profile.parts", "must be a non-empty list of part names (rule: model)")
    sizes = BUILTIN_MODELS.get(name)
    if sizes is None:
        if recorded is None and not is_user_model(name):
            raise PlanError(where, "profile.parts", f"missing: {echo(name)} is not a built-in model "
                            f"({', '.join(BUILTIN_MODELS)}), so the plan must record its profile's parts "
                            "(remake it with this pfcompile) (rule: model)")
        return recorded
    for key in ("kind", "layers", "hidden", "heads", "ffn"):
        if key in m and m[key] != sizes[key]:
            raise PlanError(where, f"model.{key}", f"{echo(m[key])} but the built-in model {name!r} has "
                            f"{sizes[key]!r} (rule: model)")
    built_in = part_names(sizes["layers"])
    if recorded is not None and recorded != built_in:
        raise PlanError(where, "profile.parts", f"{echo(recorded)} are not the parts of the built-in model "
                        f"{name!r} (embed, block0..block{sizes['layers'] - 1}, head) (rule: model)")
    return built_in


def check_parts(plan: Plan, where: str) -> None:
    """The partition cuts the model's parts in order; each K-FAC layer is a layer of a
    part its stage holds (a built-in model's: one K-FAC covers), named once."""
    parts = model_parts(plan, where)
    if parts is not None:
        names = [cut(p) for p in parts]  # a user model's, from the file: any length
        shown = ", ".join(names) if len(names) <= 6 else f"{names[0]}, {names[1]}, ..., {names[-1]}"
        i = 0
        for s, stage in enumerate(plan.partition):
            for j, part in enumerate(stage):
                if i >= len(parts) or part != parts[i]:
                    is_not = (f"is not the model's next part {echo(parts[i])}" if i < len(parts)
                              else f"lies past the model's last part {echo(parts[-1])}")
                    raise PlanError(where, f"partition[{s}][{j}]", f"{echo(part)} {is_not} (the partition cuts the parts "
                                    f"of {echo(plan.model['name'])}, {shown}, into stages in order) (rule: model)")
                i += 1
        if i < len(parts):
            raise PlanError(where, "partition", f"ends before the model's part {echo(parts[i])} (the partition cuts "
                            f"the parts of {echo(plan.model['name'])}, {shown}, into stages in order) (rule: model)")
    sizes = BUILTIN_MODELS.get(plan.model["name"])  # another model's layers: those its profile listed
    covered = set(kfac_layer_names(sizes["layers"], sizes.get("arch", "gpt2"))) if sizes is not None else None
    seen: set[str] = set()
    for i, (name, s) in enumerate(zip(plan.layers, plan.layer_stage)):
        if name in seen:
            raise PlanError(where, f"layers[{i}]", f"{echo(name)} is listed twice (rule: model)")
        seen.add(name)
        if covered is not None and name not in covered:
            raise PlanError(where, f"layers[{i}]", f"{echo(name)} is not a layer the optimizers cover in "
                            f"{plan.model['name']!r} (block<i>.{'|'.join(BLOCK_LINEARS[sizes.get('arch', 'gpt2')])}) "
                            f"(rule: model)")
        part = name.split(".", 1)[0]
        if part not in plan.partition[s]:
            raise PlanError(where, f"layers[{i}]", f"{echo(name)} is not in a part of its stage {s} "
                            f"(layer_stage[{i}]; the stage holds {echo(plan.partition[s])}) (rule: model)")


# --- times ----------------------------------------------------------------------------------------

def check_time_values(plan: Plan, where: str) -> None:
    for q, steps in enumerate(plan.ranks):
        for t, ops in enumerate(steps):
            for i, po in enumerate(ops):
                at, name = op_field(q, t, i), op_name(q, t, po.op)
                for key, v in (("start", po.start), ("end", po.end)):
                    if not math.isfinite(v) or not 0.0 <= v <= MAX_TIME_MS:
                        raise PlanError(where, f"{at}.{key}", f"{name}: {v!r} is not a time in 0..{MAX_TIME_MS:g} ms "
                                        "(rule: times)")
                if po.end < po.start:
                    raise PlanError(where, f"{at}.end", f"{name} ends before it starts (rule: times)")
    for key, v in plan.stats.items():
        vals = v if isinstance(v, list) else [v]
        if any(isinstance(x, float) and not math.isfinite(x) for x in vals):
            raise PlanError(where, f"stats.{key}", "is not finite (rule: times)")


def check_time_order(plan: Plan, where: str) -> None:
    """A rank runs its ops one after another: predicted times follow the list order."""
    for q, steps in enumerate(plan.ranks):
        prev_end, prev_at = 0.0, None
        for t, ops in enumerate(steps):
            for i, po in enumerate(ops):
                if po.start < prev_end - _TIME_TOLERANCE_MS:
                    raise PlanError(where, f"{op_field(q, t, i)}.start", f"{op_name(q, t, po.op)} starts at "
                                    f"{po.start:g} ms, before the op before it ({prev_at}) ends at {prev_end:g} ms "
                                    "(rule: times)")
                prev_end, prev_at = po.end, f"[{t}][{i}]"


# --- per-pair message order (the NCCL rule) ----------------------------------------------------------

def check_pair_order(plan: Plan, L: PlanLayout, where: str) -> None:
    """For every ordered pair (a, b) and step, a's sends to b are b's receives from a, in order."""
    for t in range(L.k):
        sends: dict[tuple[int, int], list[tuple[tuple, int]]] = defaultdict(list)
        recvs: dict[tuple[int, int], list[tuple[tuple, int]]] = defaultdict(list)
        for q in range(L.W):
            for i, po in enumerate(plan.ranks[q][t]):
                op = po.op
                if op.kind.startswith("send_"):
                    sends[(q, op.peer)].append((op.message_key(), i))
                elif op.kind.startswith("recv_"):
                    recvs[(op.peer, q)].append((op.message_key(), i))
        for a, b in sorted(set(sends) | set(recvs)):
            out, inn = sends.get((a, b), []), recvs.get((a, b), [])
            for n in range(max(len(out), len(inn))):
                s = out[n] if n < len(out) else None
                r = inn[n] if n < len(inn) else None
                if s is not None and r is not None and s[0] == r[0]:
                    continue
                send_text = (f"send #{n + 1} {_msg(s[0], 'S', b, '>')} at ranks[{a}].steps[{t}][{s[1]}]"
                             if s else f"no send #{n + 1}")
                recv_text = (f"receive #{n + 1} {_msg(r[0], 'R', a, '<')} at ranks[{b}].steps[{t}][{r[1]}]"
                             if r else f"no receive #{n + 1}")
                field = op_field(b, t, r[1]) if r else op_field(a, t, s[1])
                raise PlanError(where, field, f"messages from rank {a} to rank {b} in step {t} do not match in "
                                f"order: {send_text} meets {recv_text} (rule: pair order; NCCL matches a pair's "
                                "messages in the order they are issued)")


def _msg(key: tuple, prefix: str, peer: int, arrow: str) -> str:
    kind, stage, mb = key
    return f"{prefix}{'A' if kind == 'act' else 'G'}{stage}.{mb}{arrow}{peer}"


# --- execution order: dependencies and deadlock ---------------------------------------------------------



def check_order(plan: Plan, L: PlanLayout, where: str, *, cycles: int = 2) -> None:
    """Execute the lists as the runtime does, without times: a local dependency must have run
    earlier on its rank; a receive waits for its send; a collective waits for every member of
    the stage's group to reach it; a step ends once its sends are received. Over the integer
    ids of CycleIndex (instance c * M + j: listing j in cycle c)."""
    X = CycleIndex(plan, L)
    M, ops = X.M, X.ops
    # each rank's sequence of one cycle: its ids step by step, each step closed by a drain (-1 - step)
    seq: list[list[int]] = []
    for q in range(L.W):
        s: list[int] = []
        j = X.first[q]
        for t in range(L.k):
            while j < X.first[q + 1] and X.step[j] == t:
                s.append(j)
                j += 1
            s.append(-1 - t)
        seq.append(s)
    done = bytearray(cycles * M)
    unreceived = [0] * (L.W * cycles * L.k)  # (rank, cycle, step) -> sends in flight
    kind = [0] * M  # 1: send, 2: receive, 3: collective
    for j, op in enumerate(ops):
        kind[j] = 1 if op.kind.startswith("send_") else 2 if op.kind.startswith("recv_") else 3 if op.is_collective else 0
    pos = [0] * L.W

    def at(q: int) -> tuple[int, int]:
        """(cycle, entry) of rank q's next entry: an id, or a drain -1 - step."""
        c, i = divmod(pos[q], len(seq[q]))
        return c, seq[q][i]

    def local_ok(c: int, j: int) -> None:
        bad = X.early[1 if c else 0].get(j)
        if bad is not None:
            dop, listed = bad
            q, t, i, op = X.rank[j], X.step[j], X.pos[j], ops[j]
            if listed:
                raise PlanError(where, op_field(q, t, i), f"{op_name(q, t, op, c)} runs before its dependency "
                                f"{dop} on the same rank (rule: dependency)")
            raise PlanError(where, op_field(q, t, i), f"{op_name(q, t, op, c)} depends on {dop}, which rank {q} "
                            "never runs (rule: dependency)")

    def execute(q: int, c: int, j: int) -> None:
        done[c * M + j] = 1
        if kind[j] == 1:
            unreceived[(q * cycles + c) * L.k + X.step[j]] += 1
        elif kind[j] == 2:
            unreceived[(ops[j].peer * cycles + c) * L.k + X.step[j]] -= 1
        pos[q] += 1

    remaining = sum(len(s) for s in seq) * cycles
    while remaining:
        moved = False
        for q in range(L.W):
            last = cycles * len(seq[q])
            while pos[q] < last:
                c, j = at(q)
                if j < 0:  # the end of step -1 - j
                    if unreceived[(q * cycles + c) * L.k - 1 - j] > 0:
                        break
                    pos[q] += 1
                    remaining -= 1
                    moved = True
                    continue
                if kind[j] == 3:
                    members = X.members[j]
                    if not all(m >= 0 and pos[X.rank[m]] < cycles * len(seq[X.rank[m]]) and at(X.rank[m]) == (c, m)
                               for m in members):
                        break
                    for m in members:
                        local_ok(c, m)
                    for m in members:
                        execute(X.rank[m], c, m)
                    remaining -= len(members)
                    moved = True
                    continue
                local_ok(c, j)
                if kind[j] == 2:
                    dc, d = X.remote[1 if c else 0][j][0]
                    if d < 0 or not done[(c + dc) * M + d]:
                        break
                execute(q, c, j)
                remaining -= 1
                moved = True
        if not moved:
            stuck = []
            for q in range(L.W):
                if pos[q] < cycles * len(seq[q]):
                    c, j = at(q)
                    stuck.append(f"rank {q} at " + (f"the end of step {-1 - j} (its sends not yet received)"
                                                    if j < 0 else op_name(q, X.step[j], ops[j], c)))
            raise PlanError(where, "ranks", "deadlock: " + "; ".join(stuck) + " (rule: order)")
