"""The split backward (B then W, runtime.pipeline.split_backward) against the single-process
trainer: real `pfcompile plan` outputs of the zero-bubble families, real torchrun/gloo,
float64, K-FAC on; parameters after a refresh cycle and one step with its inverses in
force must equal the single process's to 1e-5."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT, assert_same_params, distributed_params, plan_in_process, reference_params, tiered, torchrun

ZB_CASES = [("zb-v", 2, "none"), ("zb-h1", 4, "greedy"), ("dualpipev", 2, "cpsat")]


@pytest.mark.e2e
@pytest.mark.parametrize("schedule,D,method", tiered(ZB_CASES, [f"{s}-{d}-{m}" for s, d, m in ZB_CASES], ci={2}))
def test_split_backward_matches_single_process(tmp_path, schedule, D, method):
    plan = tmp_path / "plan.json"
    plan_in_process(ROOT / "profiles" / "bert-tiny-cpu.json", "--schedule", schedule, "--stages", D,
                    "--micro-batches", 4, "--method", method, "-o", plan)
    loaded = json.loads(plan.read_text())
    kinds = {o["op"] for r in loaded["ranks"] for s in r["steps"] for o in s}
    assert {"bwd_input", "bwd_weight", "curv_b"} <= kinds and "bwd" not in kinds
    steps = loaded["config"]["refresh_steps"] + 1
    r = torchrun(plan, loaded["config"]["world_size"], "--steps", str(steps),
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", str(steps))
    assert r.returncode == 0, r.stdout[-3000:]
    initial, want = reference_params(plan, steps)
    assert_same_params(distributed_params(tmp_path / "ckpt", steps, plan), want, initial)


def test_weight_pass_from_kept_tensors_equals_autograd():
    """B then W gives autograd's gradients exactly, and B alone leaves the Linear weights untouched."""
    from runtime.pipeline.split_backward import WeightPasses

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.GELU(), torch.nn.Linear(7, 3))
    net = net.double()
    x = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(2, 4, 3, dtype=torch.float64)
    net(x).backward(gy)
    want = {n: p.grad.clone() for n, p in net.named_parameters()}
    want_x = x.grad.clone()
    net.zero_grad(set_to_none=True)
    x.grad = None
    split = WeightPasses(net)
    with split.recording(0):
        out = net(x)
    split.backward_input(0, out, gy, x)
    assert net[0].weight.grad is None and net[3].weight.grad is None and net[1].weight.grad is not None
    torch.testing.assert_close(x.grad, want_x, rtol=1e-12, atol=1e-12)
    split.backward_weight(0)
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-12, atol=1e-12)


def test_kfac_kept_input_is_the_weight_pass_input_and_counts_once():
    """K-FAC's captured layer input is the very tensor W keeps (same storage, no copy), so
    the memory meter counts it inside the activations while W holds it, and on its own from
    W's end to its curv_a (the planner's model: pfcompile.graph.costs)."""
    from types import SimpleNamespace

    from runtime.models import build_stage, kfac_linears, resolve_config, resolve_model
    from runtime.observe.memory import MemoryMeter, nbytes
    from runtime.optimizers import kfac
    from runtime.pipeline.split_backward import WeightPasses

    torch.manual_seed(0)
    cfg = resolve_config("bert-tiny", seq_len=8)
    stage = build_stage(resolve_model(cfg), ["block0"], seed=0)
    layers = kfac.make_layers(kfac_linears(stage), kfac.KfacConfig())
    split = WeightPasses(stage)
    meter = MemoryMeter({0: SimpleNamespace(module=stage, layers={l.name: l for l in layers})}, torch.device("cpu"))
    meter.split = {0: split}
    x = torch.randn(2, 8, cfg.hidden, requires_grad=True)
    with kfac.capturing(layers, 0), split.recording(0):
        out = stage(x)
    w_inputs = {id(lin): saved[0] for lin, saved in zip(split.linears, split.saved[0]) if saved is not None}
    for l in layers:
        (a,) = l.kept_tensors("A")
        assert a.untyped_storage().data_ptr() == w_inputs[id(l.module)].untyped_storage().data_ptr()
    a_bytes = sum(nbytes(t) for l in layers for t in l.kept_tensors("A"))
    assert a_bytes > 0 and meter._kept() == 0  # inside the activations
    with kfac.capturing(layers, 0):
        split.backward_input(0, out, torch.randn_like(out), x)
    w_grads = {id(lin): g for lin, _, g in split.kept[0]}
    for l in layers:  # the output gradients too (the k projection's is not contiguous: no reshape copy)
        (b,) = l.kept_tensors("B")
        assert b.untyped_storage().data_ptr() == w_grads[id(l.module)].untyped_storage().data_ptr()
    b_bytes = sum(nbytes(t) for l in layers for t in l.kept_tensors("B"))
    assert b_bytes > 0 and meter._kept() == b_bytes  # every Linear of the block is a K-FAC layer
    split.backward_weight(0)
    assert meter._kept() == b_bytes + a_bytes  # W is done: the inputs are K-FAC's alone
    for l in layers:
        l.curv_a(0)
    assert meter._kept() == b_bytes
    split.close()


@pytest.mark.e2e
def test_adamw_with_its_weight_passes_placed_matches_single_process(tmp_path):
    """The first-order ZB-H1 plan CP-SAT makes (its W passes moved from the family's places)
    trains as the single process does."""
    plan = tmp_path / "plan.json"
    plan_in_process(ROOT / "profiles" / "bert-tiny-cpu.json", "--schedule", "zb-h1", "--stages", 2,
                    "--micro-batches", 4, "--optimizer", "adamw", "--method", "cpsat", "--time-limit", 5, "-o", plan)
    loaded = json.loads(plan.read_text())
    assert loaded["stats"]["step_overhead"] < 0  # placed, not the family's order
    r = torchrun(plan, 2, "--steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3")
    assert r.returncode == 0, r.stdout[-3000:]
    initial, want = reference_params(plan, 3, kfac=False)
    # The attention keys' biases get a zero gradient in exact arithmetic (the softmax ignores
    # a shift common to all keys): AdamW turns its rounding, which the W passes' other order of
    # summing the micro-batches changes, into moves of 1e-14. Below a norm of 1e-8 a
    # parameter is compared absolutely (to 1e-13).
    assert_same_params(distributed_params(tmp_path / "ckpt", 3, plan), want, initial, floor=1e-8)
