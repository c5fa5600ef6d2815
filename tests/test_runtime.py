"""The distributed runtime against a single-process run: real torchrun, real gloo, float64.

Plans here are built by `hand_plan` below — a small list scheduler independent of the
planner — so that the runtime is tested on its own; the demo runs `pfcompile plan` outputs.
"""

from __future__ import annotations


# --- hand-made plans --------------------------------------------------------------------
def _placement(schedule: str, D: int, R: int) -> dict[tuple[int, int], int]:
    if schedule == "chimera":
        return {**{(s, 0): s for s in range(D)}, **{(s, 1): D - 1 - s for s in range(D)}}
    return {(s, r): r * D + s for s in range(D) for r in range(R)}


def _compute_order(schedule: str, D: int, s: int, mbs: list[int]) -> list[tuple[str, int]]:
    """Canonical fwd/bwd order of one stage replica over its micro-batches."""
    if schedule == "gpipe":
        return [("fwd", m) for m in mbs] + [("bwd", m) for m in mbs]
    warmup = min(D - s - 1, len(mbs))  # 1F1B (and each direction of Chimera)
    order = [("fwd", m) for m in mbs[:warmup]]
    for i, m in enumerate(mbs[warmup:]):
        order += [("fwd", m), ("bwd", mbs[i])]
    order += [("bwd", m) for m in mbs[len(mbs) - warmup:]]
    return order


def hand_plan(schedule: str, D: int, N: int, R: int, k: int, model: dict, partition: list[list[str]],
              layers: list[str], layer_stage: list[int], kfac: bool = True) -> dict:
    """A valid plan dict: per-rank op lists from a round-based simulation of the schedule.

    Every rank's list is its projection of one global order, so sends/receives pair up and
    collectives (emitted after the pipeline ops, by stage and layer index) come in the same
    order on every rank: the plan cannot deadlock. On the refresh step each layer's
    curvature follows its fwd/bwd, except the first layer of each stage whose curv_b is
    deferred to step 1 (kept gradients held across steps); factors are reduced and
    inverted in step min(1, k-1), one replica inverting per layer and broadcasting.
    """
    if schedule == "chimera":
        R = 2
    W = D if schedule == "chimera" else D * R
    place = _placement(schedule, D, R)
    per = N // R
    mbr = [m // per for m in range(N)]
    seqs: dict[int, list[list[tuple[str, int, int, int]]]] = {q: [] for q in range(W)}
    for (s, r), q in sorted(place.items()):
        mbs = [m for m in range(N) if mbr[m] == r]
        seqs[q].append([(kind, s, r, m) for kind, m in _compute_order(schedule, D, s, mbs)])

    done: set[tuple[str, int, int]] = set()

    def ready(kind, s, r, m):
        if kind == "fwd":
            return s == 0 or ("fwd", s - 1, m) in done
        return ("fwd", s, m) in done and (s == D - 1 or ("bwd", s + 1, m) in done)

    global_order: list[tuple[int, tuple]] = []
    while any(any(q) for q in seqs.values()):
        progressed = []
        for q, queues in seqs.items():
            heads = [qq[0] for qq in queues if qq and ready(*qq[0])]
            if heads:  # prefer backward (frees memory), then the earlier micro-batch
                op = min(heads, key=lambda o: (o[0] != "bwd", o[3]))
                next(qq for qq in queues if qq and qq[0] == op).pop(0)
                progressed.append((q, op))
        assert progressed, "hand_plan: schedule deadlocked"
        for q, op in progressed:
            done.add((op[0], op[1], op[3]))
            global_order.append((q, op))

    stage_layers = {s: [i for i, ls in enumerate(layer_stage) if ls == s] for s in range(D)}
    steps = {q: [[] for _ in range(k)] for q in range(W)}
    t = {q: 0.0 for q in range(W)}

    def emit(q, step, **op):
        steps[q][step].append({**op, "start": t[q], "end": t[q] + 1.0})
        t[q] += 1.0

    sync_step = min(1, k - 1)
    for step in range(k):
        refresh = kfac and step == 0
        for q, (kind, s, r, m) in global_order:
            if kind == "fwd":
                if s > 0 and place[(s - 1, r)] != q:
                    emit(q, step, op="recv_act", stage=s - 1, mb=m, peer=place[(s - 1, r)])
                emit(q, step, op="fwd", stage=s, mb=m)
                if refresh:
                    for li in stage_layers[s]:
                        emit(q, step, op="curv_a", layer=li, mb=m)
                if s < D - 1 and place[(s + 1, r)] != q:
                    emit(q, step, op="send_act", stage=s, mb=m, peer=place[(s + 1, r)])
            else:
                if s < D - 1 and place[(s + 1, r)] != q:
                    emit(q, step, op="recv_grad", stage=s + 1, mb=m, peer=place[(s + 1, r)])
                emit(q, step, op="bwd", stage=s, mb=m)
                if refresh:
                    for li in stage_layers[s]:
                        if not (k > 1 and li == stage_layers[s][0]):
                            emit(q, step, op="curv_b", layer=li, mb=m)
                if s > 0 and place[(s - 1, r)] != q:
                    emit(q, step, op="send_grad", stage=s, mb=m, peer=place[(s - 1, r)])
        for q in range(W):
            held = sorted(s for (s, r), qq in place.items() if qq == q)
            if kfac and k > 1 and step == 1:
                for s in (s for s in held if stage_layers[s]):
                    r = next(r for (ss, r), qq in place.items() if qq == q and ss == s)
                    for m in (m for m in range(N) if mbr[m] == r):
                        emit(q, step, op="curv_b", layer=stage_layers[s][0], mb=m)
            if kfac and step == sync_step:
                for s in held:
                    for li in stage_layers[s]:
                        inverter = place[(s, li % R)]
                        if R > 1:
                            for f in "AB":
                                emit(q, step, op="sync_curv", layer=li, factor=f)
                        for f in "AB":
                            if q == inverter:
                                emit(q, step, op="inv", layer=li, factor=f)
                        if R > 1:
                            for f in "AB":
                                emit(q, step, op="bcast_inv", layer=li, factor=f, peer=inverter)
            for s in held:
                if R > 1:
                    emit(q, step, op="sync_grad", stage=s)
            for s in held:
                if kfac:
                    for li in stage_layers[s]:
                        emit(q, step, op="precond", layer=li)
                emit(q, step, op="step", stage=s)

    return {
        "schema": "pfcompile-plan", "schema_version": 1,
        "config": {"schedule": schedule, "stages": D, "virtual_stages": 1, "micro_batches": N,
                   "replicas": R, "world_size": W, "method": "none", "kfac": kfac,
                   "refresh_steps": k, "inverse": "cholesky", "fixed_order": True,
                   "memory_limit_bytes": None},
        "model": model, "partition": partition, "layers": layers, "layer_stage": layer_stage,
        "placement": [{"stage": s, "replica": r, "rank": q} for (s, r), q in sorted(place.items())],
        "micro_batch_replica": mbr,
        "ranks": [{"rank": q, "steps": steps[q]} for q in range(W)],
        "stats": {"step_time_ms": max(t.values()) / k},
        "profile": {"name": "hand-made", "hash": "", "source": "test"},
    }
