"""The split backward (B then W, runtime.split_backward) against the single-process
trainer: real `pfcompile plan` outputs of the zero-bubble families, real torchrun/gloo,
float64, K-FAC on; parameters after a refresh cycle and one step with its inverses in
force must equal the single process's to 1e-5."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from test_runtime import ROOT, assert_same_params, distributed_params, reference_params, torchrun


@pytest.mark.parametrize("schedule,D,method", [("zb-v", 2, "none"), ("zb-h1", 4, "greedy")])
def test_split_backward_matches_single_process(tmp_path, schedule, D, method):
    plan = tmp_path / "plan.json"
    made = subprocess.run([sys.executable, "-m", "pfcompile", "plan", str(ROOT / "profiles" / "bert-tiny-cpu.json"),
                           "--schedule", schedule, "--stages", str(D), "--micro-batches", "4", "--method", method,
                           "-o", str(plan)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]
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
    from runtime.split_backward import WeightPasses

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
