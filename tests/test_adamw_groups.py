"""AdamW's parameter groups (issue 38): biases, norm weights and embeddings keep their values
under weight decay with a zero gradient, for AdamW alone and for a hybrid's AdamW part, while
a matrix decays by exactly (1 - lr wd); the kinds are configurable. And the covered weights'
decoupled weight decay against its closed form."""

from __future__ import annotations

import pytest
import torch

from runtime.config import job as job_config
from runtime.models import ModelConfig, build_model, kfac_linears
from runtime.optimizers.muon import MuonConfig
from runtime.optimizers.muon import make_layers as muon_layers
from runtime.optimizers.stage import OptimConfig, SgdOnCoveredOptimizer, build_optimizer, no_decay_ids

SPEC = ModelConfig("groups-test", "gpt", layers=1, hidden=16, heads=2, ffn=32, vocab=50, max_seq_len=8)
LR, WD = 0.1, 0.5


def _step_with_zero_grads(opt, model) -> dict[str, torch.Tensor]:
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return before


def _kinds(model) -> dict[str, str]:
    """Each parameter's kind, found independently of no_decay_ids: by name and module type."""
    kinds = {}
    for mname, m in model.named_modules():
        for pname, _ in m.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            kinds[name] = ("embedding" if isinstance(m, torch.nn.Embedding) else
                           "norm" if isinstance(m, torch.nn.LayerNorm) else "bias" if pname == "bias" else "matrix")
    return kinds


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_biases_norms_and_embeddings_keep_their_values(optimizer):
    model = build_model(SPEC, seed=0, dtype=torch.float64)
    layers = muon_layers(kfac_linears(model), MuonConfig()) if optimizer == "muon" else []
    covered = {id(p) for l in layers for p in l.covered}
    opt = build_optimizer(model, layers, OptimConfig(adam_lr=LR, adam_weight_decay=WD), optimizer=optimizer)
    before = _step_with_zero_grads(opt, model)
    kinds = _kinds(model)
    assert {"embedding", "norm", "bias", "matrix"} <= set(kinds.values())
    for name, p in model.named_parameters():
        if id(p) in covered:
            continue
        if kinds[name] == "matrix":  # AdamW with g = 0: m = v = 0, the update is the decay alone
            torch.testing.assert_close(p.detach(), before[name] * (1 - LR * WD), rtol=1e-15, atol=0)
        else:
            assert torch.equal(p.detach(), before[name]), f"{name} ({kinds[name]}) was decayed"


def test_the_kinds_are_configurable():
    model = build_model(SPEC, seed=0, dtype=torch.float64)
    opt = build_optimizer(model, [], OptimConfig(adam_lr=LR, adam_weight_decay=WD, adam_no_decay="norm"), "adamw")
    before = _step_with_zero_grads(opt, model)
    for name, p in model.named_parameters():
        decayed = _kinds(model)[name] != "norm"
        want = before[name] * (1 - LR * WD) if decayed else before[name]
        torch.testing.assert_close(p.detach(), want, rtol=1e-15, atol=0)
    assert no_decay_ids(model, "") == set()
    with pytest.raises(Exception, match="adam_no_decay"):
        job_config.load(overrides=["optimizer.adam_no_decay=bias,bogus"])


def test_decoupled_weight_decay_of_the_covered_weights():
    """p <- p (1 - lr wd), then SGD-momentum on g alone: the decay never enters the buffer."""
    lin = torch.nn.Linear(4, 3, dtype=torch.float64)

    class Layer:
        covered = (lin.weight,)

    cfg = OptimConfig(lr=LR, momentum=0.9, weight_decay=WD, decoupled_weight_decay=True, warmup_steps=2)
    opt = SgdOnCoveredOptimizer(lin, [Layer()], cfg)
    w, buf = lin.weight.detach().clone(), torch.zeros(3, 4, dtype=torch.float64)
    g = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for step in range(3):
        lin.weight.grad, lin.bias.grad = g.clone(), torch.zeros(3, dtype=torch.float64)
        opt.step()
        lr = LR * cfg.lr_factor(step)
        buf = g if step == 0 else 0.9 * buf + g
        w = w * (1 - lr * WD) - lr * buf
        torch.testing.assert_close(lin.weight.detach(), w, rtol=1e-14, atol=1e-15)
