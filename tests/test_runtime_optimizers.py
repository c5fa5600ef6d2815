"""Shampoo, SOAP and Muon through the pipeline against their single-process trainer: real
`pfcompile plan` outputs (1F1B, Chimera with the work divided between its replicas, ZB-V),
real torchrun/gloo, float64; the parameters after two refresh cycles and one more step
equal the single process's to 1e-5 relative."""

from __future__ import annotations

import json

import pytest
from helpers import (
    ROOT,
    assert_same_params,
    distributed_params,
    optimizer_reference_params,
    plan_in_process,
    tiered,
    torchrun,
)

pytestmark = pytest.mark.e2e  # every test here starts processes

PROFILE = ROOT / "profiles" / "bert-tiny-cpu.json"


def plan_with(tmp_path, optimizer: str, schedule: str, D: int, method: str, *extra: str):
    """`pfcompile plan` of bert-tiny with `optimizer`'s work (its costs estimated into a copy
    of the committed profile when it has none: the plan's timing does not matter here)."""
    from pfcompile.formats.profile import load_profile
    from pfcompile.profiler.optimizer_layers import estimated_optimizer_ms

    prof = load_profile(str(PROFILE))
    for layer in prof.covered_layers:
        layer.optimizer_ms.setdefault(optimizer, estimated_optimizer_ms(optimizer, layer.in_features,
                                                                        layer.out_features, 1e6))
    profile = tmp_path / "profile.json"
    prof.save(str(profile))
    plan = tmp_path / "plan.json"
    plan_in_process(profile, "--schedule", schedule, "--stages", D, "--micro-batches", 4, "--optimizer", optimizer,
                    "--method", method, "--time-limit", 8, "-o", plan, *extra)
    return plan, json.loads(plan.read_text())




# (ZB-V runs SOAP's ops, the same kinds and dependencies as Shampoo's: one case covers both.)
# Shampoo's k is fixed at 3: the planner's own choice on 1F1B (k = 12) would make the run
# 25 steps long, and any k tests the same thing, a whole cycle with roots in force.
K3 = ("--refresh-steps", "3")
SPLIT = ("--precond", "layers")
DEFER = ("--defer-stats",)  # the statistics in the bubbles, folding the previous step's kept gradient
CASES = [("shampoo", "1f1b", 2, "cpsat", K3), ("shampoo", "chimera", 2, "cpsat", (*K3, *SPLIT)),
         ("shampoo", "1f1b", 2, "cpsat", (*K3, *DEFER)), ("soap", "chimera", 2, "cpsat", (*K3, *SPLIT, *DEFER)),
         ("soap", "1f1b", 2, "cpsat", K3),
         ("soap", "chimera", 2, "cpsat", (*K3, *SPLIT)), ("soap", "zb-v", 2, "cpsat", K3),
         ("muon", "1f1b", 2, "cpsat", ()),
         ("muon", "chimera", 2, "cpsat", SPLIT), ("muon", "zb-v", 2, "none", ())]


# CI: Shampoo deferred, SOAP split and deferred, Muon on a zero-bubble family
@pytest.mark.parametrize("optimizer,schedule,D,method,extra", tiered(
    CASES, [f"{o}-{s}-{m}{'-split' if '--precond' in e else ''}{'-deferred' if DEFER[0] in e else ''}"
            for o, s, _, m, e in CASES], ci={2, 3, 9}))
def test_pipelined_optimizer_equals_single_process(tmp_path, optimizer, schedule, D, method, extra):
    plan, loaded = plan_with(tmp_path, optimizer, schedule, D, method, *extra)
    kinds = {o["op"] for r in loaded["ranks"] for s in r["steps"] for o in s}
    want = {"shampoo": {"stats", "inv", "precond"}, "soap": {"stats", "inv", "precond"}, "muon": {"orth"}}[optimizer]
    assert want <= kinds and not kinds & {"curv_a", "curv_b", "sync_curv"}
    if "--precond" in extra:  # the work divided between the replicas: gathered after each replica's share
        assert {"rs_grad", "ag_grad"} <= kinds and loaded["config"]["precond"] == "split"
    k = loaded["config"]["refresh_steps"]
    steps = 2 * k + 1  # a whole cycle with roots in force, and the first step of the next
    # Shampoo's default ε (1e-12, absolute) on the first cycle's singular statistics amplifies
    # rounding by ~1e3, and replicas sum the gradient in another order than one process
    settings = ("shampoo.epsilon=1e-6",) if optimizer == "shampoo" else ()
    r = torchrun(plan, loaded["config"]["world_size"], "--steps", str(steps), *(x for v in settings for x in ("--set", v)),
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", str(steps))
    assert r.returncode == 0, r.stdout[-3000:]
    if DEFER[0] in extra:  # the plan sets it on the pipeline; the single process is told the same
        assert loaded["config"]["defer_stats"] is True
        early = [o for r in loaded["ranks"] for s in r["steps"]
                 for o in s[:next(i for i, o in enumerate(s) if o["op"] in ("bwd", "bwd_input"))] if o["op"] == "stats"]
        assert early  # listed before the step's backward: it cannot read that step's gradient
        settings += (f"{optimizer}.defer_stats=true",)
    initial, want_params = optimizer_reference_params(plan, steps, settings=settings)
    # The attention's key bias has an exactly zero gradient (softmax ignores a shift shared by
    # every key): what it gets is rounding noise, ~1e-17, which the replicas' all-reduce sums in
    # another order and AdamW (it covers the biases here, without weight decay) normalises into
    # moves of the rate's size in the noise's direction. It is left out; norms below the floor
    # are compared absolutely.
    got = distributed_params(tmp_path / "ckpt", steps, plan)
    noise = [n for n in want_params if n.endswith("attn.k.bias")]
    assert noise
    for n in noise:
        del got[n], want_params[n]
    assert_same_params(got, want_params, initial, floor=1e-9)


# Clipping: Muon's global norm is taken over every stage of every rank before any layer is
# orthogonalised (runtime.pipeline.build.Update defers its orth ops into the clipped update);
# Shampoo's and K-FAC's after their preconditioning (linear in the gradient). 0.05 is below
# every step's norm here (asserted), so every update is scaled.
CLIP = 0.05
CLIPPED = [("muon", "1f1b", 2, "cpsat", ()), ("muon", "chimera", 2, "cpsat", SPLIT),
           ("shampoo", "1f1b", 2, "cpsat", K3)]


@pytest.mark.parametrize("optimizer,schedule,D,method,extra", tiered(
    CLIPPED, [f"{o}-{s}{'-split' if '--precond' in e else ''}" for o, s, _, m, e in CLIPPED], ci={1}))
def test_clipped_pipeline_equals_clipped_single_process(tmp_path, optimizer, schedule, D, method, extra):
    import torch

    plan, loaded = plan_with(tmp_path, optimizer, schedule, D, method, *extra)
    k = loaded["config"]["refresh_steps"]
    steps = 2 * k + 1 if k > 1 else 3
    r = torchrun(plan, loaded["config"]["world_size"], "--steps", str(steps), "--log-dir", str(tmp_path / "log"),
                 "--set", f"optimizer.max_grad_norm={CLIP}",
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", str(steps))
    assert r.returncode == 0, r.stdout[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    norms = [row["grad_norm"] for row in rows if "grad_norm" in row]
    assert len(norms) == steps and min(norms) > 2 * CLIP, norms  # every step clipped
    initial, want = optimizer_reference_params(plan, steps, max_grad_norm=CLIP)
    got = distributed_params(tmp_path / "ckpt", steps, plan)
    _, unclipped = optimizer_reference_params(plan, steps)
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    assert worst <= 1e-8, worst
    # and clipping changed the run: the unclipped reference is far from it
    assert max(float((unclipped[n] - want[n]).abs().max()) for n in want) > 1e-4
    assert all(torch.isfinite(t).all() for t in got.values())
