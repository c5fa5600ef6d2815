"""Deferred statistics (`pfcompile plan --defer-stats`, `--set shampoo.defer_stats=true`):
the update keeps the raw gradient, the next step's statistics fold it. Planned by real
CP-SAT solves of bert-tiny: the statistics wait for nothing of their step and land before
its backward passes, the verifier accepts the plan, the memory model counts the kept
gradient; refused, in one line, for an optimizer without per-step statistics. The maths
against dense float64 references is in tests/test_shampoo.py and tests/test_soap.py, the
pipeline against the single process in tests/test_runtime_optimizers.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from helpers import TINY_OPTIMIZERS_BEFORE_OWN_STEP, cli, one_line_error

from pfcompile.cli import main
from pfcompile.formats.errors import InputError
from pfcompile.formats.plan import load_plan, plan_from_json
from pfcompile.formats.profile import load_profile
from pfcompile.formats.verify import verify_plan
from pfcompile.graph.costs import costs_of
from pfcompile.graph.schedules import PipelineConfig
from runtime.config import job as job_config
from runtime.optimizers.shampoo import ShampooConfig, ShampooLayer
from runtime.optimizers.soap import SoapConfig, SoapLayer

# kept as it was (profiles/ is measured again from time to time): on its costs deferral
# shortens the optimal step by over a millisecond, and CP-SAT proves both plans optimal
# within the time limit
PROFILE = str(TINY_OPTIMIZERS_BEFORE_OWN_STEP)


def _plan(tmp_path, capsys, name: str, *extra: str) -> dict:
    """`pfcompile plan` in this process (its CLI's own main; the subprocess form is tested below)."""
    out = tmp_path / f"{name}.json"
    capsys.readouterr()
    rc = main(["plan", PROFILE, "--schedule", "1f1b", "--stages", "2", "--micro-batches", "4", "--optimizer", "shampoo",
               "--refresh-steps", "5", "--time-limit", "10", "--json", "-o", str(out), *extra])
    printed = capsys.readouterr()
    assert rc == 0, printed.err[-2000:]
    return {"plan": json.loads(out.read_text()), "stats": json.loads(printed.out), "path": out}


@pytest.fixture
def plans(tmp_path, capsys):
    return _plan(tmp_path, capsys, "deferred", "--defer-stats"), _plan(tmp_path, capsys, "undeferred")


def _first_backward(step: list[dict]) -> int:
    return next(i for i, o in enumerate(step) if o["op"] == "bwd")


def test_deferred_statistics_run_before_the_steps_backward_passes(plans):
    deferred, undeferred = plans
    assert deferred["plan"]["config"]["defer_stats"] is True
    assert "defer_stats" not in undeferred["plan"]["config"]
    early = 0
    for rank in deferred["plan"]["ranks"]:
        for step in rank["steps"]:
            ops = [o["op"] for o in step]
            at = {(o["op"], o.get("layer")): i for i, o in enumerate(step)}
            # each layer's update still follows its statistics (it overwrites what they read)
            layers = {layer for kind, layer in at if kind == "precond"}
            assert layers and all(at["stats", layer] < at["precond", layer] for layer in layers)
            early += sum(1 for o in ops[:_first_backward(step)] if o == "stats")
    assert early > 0  # the planner used the freedom: statistics in the bubbles before the backward
    for rank in undeferred["plan"]["ranks"]:  # without deferral they wait for the step's gradient
        for step in rank["steps"]:
            assert not any(o["op"] == "stats" for o in step[:_first_backward(step)])
    # freed from the step's critical window, the optimal step is shorter (k = 5, the bound on k)
    assert deferred["stats"]["solver_status"] == undeferred["stats"]["solver_status"] == "OPTIMAL"
    assert deferred["stats"]["step_time_ms"] < undeferred["stats"]["step_time_ms"] - 1.0
    verify_plan(load_plan(str(deferred["path"])), "deferred.json")


def test_an_undeferred_plan_listing_statistics_early_is_refused(plans):
    """The verifier holds a plan without deferral to the step's gradient: the deferred plan's
    order with defer_stats taken out is invalid."""
    obj = json.loads(json.dumps(plans[0]["plan"]))
    del obj["config"]["defer_stats"]
    with pytest.raises(InputError, match=r"ST\d+ .* runs before its dependency B"):
        verify_plan(plan_from_json(obj, "edited.json"), "edited.json")


def test_memory_counts_the_kept_gradient_once_per_layer():
    prof = load_profile(PROFILE)
    cfg = PipelineConfig("1f1b", stages=2, micro_batches=4, optimizer="soap", refresh_steps=2)
    plain = costs_of(prof, cfg)
    kept = costs_of(prof, PipelineConfig("1f1b", stages=2, micro_batches=4, optimizer="soap", refresh_steps=2,
                                         defer_stats=True))
    for s, layers in enumerate(plain.stage_layers):
        extra = kept.resident_bytes([(s, 0)]) - plain.resident_bytes([(s, 0)])
        want = sum(prof.covered_layers[l].in_features * prof.covered_layers[l].out_features * 4 for l in layers)
        assert extra == want > 0


@pytest.mark.e2e  # the command's exit code and stderr
def test_an_optimizer_without_statistics_is_refused_in_one_line(tmp_path):
    out = tmp_path / "p.json"
    r = cli("plan", PROFILE, "--schedule", "1f1b", "--stages", "2", "--micro-batches", "4", "--optimizer", "kfac",
            "--defer-stats", "-o", str(out))
    one_line_error(r, "--defer-stats", "'kfac' has no per-step statistics to defer")
    assert not out.exists()


def test_a_plan_file_deferring_kfac_names_the_field(plans):
    obj = json.loads(json.dumps(plans[1]["plan"]))
    obj["config"].update(optimizer="kfac", defer_stats=True)
    with pytest.raises(InputError, match=r"x\.json.*config\.defer_stats.*no per-step statistics"):
        plan_from_json(obj, "x.json")


def test_the_runtime_follows_the_plan_and_refuses_a_contradiction(plans):
    plan = load_plan(str(plans[0]["path"]))
    cfg = job_config.load()
    job_config.apply_plan(cfg, plan, "deferred.json")
    assert cfg.shampoo.defer_stats is True
    cfg = job_config.load(overrides=["shampoo.defer_stats=false"])
    with pytest.raises(InputError, match="shampoo.defer_stats.*deferred.json config.defer_stats"):
        job_config.apply_plan(cfg, plan, "deferred.json")


@pytest.mark.parametrize("make", [
    lambda lin: ShampooLayer("l", lin, ShampooConfig(defer_stats=True, refresh_steps=2, epsilon=1e-6)),
    lambda lin: SoapLayer("l", lin, SoapConfig(defer_stats=True, refresh_steps=2)),
], ids=["shampoo", "soap"])
def test_the_kept_gradient_is_the_raw_one_and_survives_a_checkpoint(make):
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(4, 5, generator=gen, dtype=torch.float64) for _ in range(6)]

    def run(layer, lin, ts):
        for t in ts:
            if t % 2 == 0:
                layer.activate()
            lin.weight.grad = grads[t].clone()
            layer.stats(cycle_step=t % 2)
            if t % 2 == 0:
                layer.inv(factor="L")
                layer.inv(factor="R")
            layer.precond()

    lin = nn.Linear(5, 4, bias=False, dtype=torch.float64)
    layer = make(lin)
    run(layer, lin, range(3))
    assert torch.equal(layer.gradient.kept, grads[2])  # raw, though precond overwrote weight.grad
    assert not torch.allclose(lin.weight.grad, grads[2])
    sd = layer.state_dict()
    assert torch.equal(sd["kept_grad"], grads[2])
    lin2 = nn.Linear(5, 4, bias=False, dtype=torch.float64)
    again = make(lin2)
    again.load_state_dict(sd)
    run(layer, lin, range(3, 6))
    run(again, lin2, range(3, 6))
    for a, b in zip(layer.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(lin.weight.grad, lin2.weight.grad)
