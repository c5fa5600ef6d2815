"""Muon (runtime.optimizers.muon) against torch.optim.Muon and against an independent float64 evaluation
of its quintic Newton–Schulz iteration; its checkpoints; its [muon] config section."""

from __future__ import annotations

import dataclasses
import inspect
import io

import numpy as np
import pytest
import torch

from pfcompile.formats.errors import InputError
from runtime.config import job as job_config
from runtime.io.data import make_stream, split_micro_batches
from runtime.models import ModelConfig, build_model, kfac_linears
from runtime.optimizers.muon import MuonConfig, MuonLayer, make_layers, muon_config
from runtime.optimizers.stage import MuonOptimizer, OptimConfig, build_optimizer, optim_config
from runtime.train import train_reference, train_step

# fc1 is tall (64 x 32) and fc2 wide (32 x 64): both of the iteration's orientations run.
SPEC = ModelConfig("muon-test", "gpt", layers=2, hidden=32, heads=2, ffn=64, vocab=100, max_seq_len=16)
M = 2  # micro-batches
OPTIM = OptimConfig(adam_lr=1e-3, adam_betas=(0.9, 0.99), adam_weight_decay=0.01,
                    adam_no_decay="")  # the references below decay every parameter


def stream():
    return make_stream("gpt", 4, 16, seed=0, synthetic=True, vocab=SPEC.vocab)


def muon_run(cfg: MuonConfig, steps: int, dtype=None):
    """The single-process trainer with Muon: (model, layers, optimizer) after `steps` steps."""
    model = build_model(SPEC, seed=1, dtype=dtype)
    layers = make_layers(kfac_linears(model), cfg)
    opt = build_optimizer(model, layers, OPTIM, optimizer="muon")
    data = stream()
    for step in range(steps):
        train_step(model, layers, opt, data.batch(step), step, M, cfg)
    return model, layers, opt


def backward(model, batch):
    for tokens, targets in split_micro_batches(batch, M):
        (model(tokens, targets) / M).backward()


def assert_trained(model, initial):
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, initial[n])]
    assert len(moved) == len(initial), "some parameter did not move: the comparison would prove little"


@pytest.mark.parametrize("nesterov,adjust_lr_fn,weight_decay", [
    (True, None, 0.1), (False, "match_rms_adamw", 0.0), (True, "original", 0.05)])
def test_equals_torch_muon_bit_for_bit(nesterov, adjust_lr_fn, weight_decay):
    """bfloat16 Newton–Schulz, as torch.optim.Muon runs it: the same ops in the same order,
    so every parameter after 3 steps is bit-identical (the rest against torch's AdamW)."""
    cfg = MuonConfig(lr=0.02, weight_decay=weight_decay, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ours, _, _ = muon_run(cfg, 3)

    ref = build_model(SPEC, seed=1)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    weights = [m.weight for _, m in kfac_linears(ref)]
    covered = {id(p) for p in weights}
    muon = torch.optim.Muon(weights, lr=0.02, weight_decay=weight_decay, momentum=cfg.momentum, nesterov=nesterov,
                            ns_coefficients=cfg.ns_coefficients, eps=cfg.eps, ns_steps=cfg.ns_steps,
                            adjust_lr_fn=adjust_lr_fn)
    adamw = torch.optim.AdamW([p for p in ref.parameters() if id(p) not in covered], lr=OPTIM.adam_lr,
                              betas=OPTIM.adam_betas, weight_decay=OPTIM.adam_weight_decay)
    data = stream()
    for step in range(3):
        muon.zero_grad()
        adamw.zero_grad()
        backward(ref, data.batch(step))
        muon.step()
        adamw.step()
    assert_trained(ref, initial)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name}: max difference {float((p - q).abs().max()):.3g}"


def quintic_reference(U: np.ndarray, coefficients, steps: int, eps: float) -> np.ndarray:
    """X <- a X + b (X Xᵀ) X + c (X Xᵀ)² X from X = U / ‖U‖_F, dense float64. The polynomial
    commutes with transposition, so a tall U needs no special case."""
    a, b, c = coefficients
    X = U / max(np.linalg.norm(U), eps)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + b * (A @ X) + c * (A @ A @ X)
    return X


def test_float64_iteration_equals_dense_quintic():
    """ns_dtype float64 on a float64 model: 3 steps of momentum, Nesterov, Newton–Schulz,
    decoupled weight decay and the adjusted rate, against the same math written here."""
    cfg = MuonConfig(lr=0.02, weight_decay=0.1, ns_dtype="float64", adjust_lr_fn="match_rms_adamw")
    ours, layers, _ = muon_run(cfg, 3, dtype=torch.float64)
    assert layers[0].ns_dtype == torch.float64

    ref = build_model(SPEC, seed=1, dtype=torch.float64)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    weights = [m.weight for _, m in kfac_linears(ref)]
    covered = {id(p) for p in weights}
    adamw = torch.optim.AdamW([p for p in ref.parameters() if id(p) not in covered], lr=OPTIM.adam_lr,
                              betas=OPTIM.adam_betas, weight_decay=OPTIM.adam_weight_decay)
    bufs = [np.zeros(tuple(w.shape)) for w in weights]
    data = stream()
    mu = cfg.momentum
    for step in range(3):
        ref.zero_grad()
        backward(ref, data.batch(step))
        with torch.no_grad():
            for w, buf in zip(weights, bufs):
                g = w.grad.numpy()
                buf *= mu
                buf += (1 - mu) * g
                O = quintic_reference((1 - mu) * g + mu * buf, cfg.ns_coefficients, cfg.ns_steps, cfg.eps)
                rate = cfg.lr * 0.2 * max(w.shape) ** 0.5
                w.copy_(torch.from_numpy(w.numpy() * (1 - cfg.lr * cfg.weight_decay) - rate * O))
        adamw.step()
    assert_trained(ref, initial)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


def test_orthogonalize_writes_the_iteration_into_grad_and_keeps_the_buffer():
    """Without Nesterov the update is the momentum buffer itself: the iteration must not
    normalise it in place (torch's .bfloat16() would alias a bfloat16 one)."""
    lin = torch.nn.Linear(6, 9, dtype=torch.float64)
    g = torch.randn(9, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    layer = MuonLayer("lin", lin, MuonConfig(nesterov=False, ns_dtype=None, momentum=0.5))
    lin.weight.grad = g.clone()
    layer.orthogonalize()
    np.testing.assert_allclose(layer.momentum_buffer.numpy(), 0.5 * g.numpy(), rtol=0, atol=0)
    want = quintic_reference(0.5 * g.numpy(), layer.cfg.ns_coefficients, 5, 1e-7)
    np.testing.assert_allclose(lin.weight.grad.numpy(), want, rtol=0, atol=1e-12)
    s = np.linalg.svd(want, compute_uv=False)
    assert 0.5 < s.min() and s.max() < 1.5  # roughly orthogonal, as the iteration promises


def checkpoint(model, layers, opt) -> dict:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "layers": {l.name: l.state_dict() for l in layers}}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_checkpoint_round_trip_continues_identically():
    cfg = MuonConfig(lr=0.02)
    model, layers, opt = muon_run(cfg, 2)
    saved = checkpoint(model, layers, opt)
    fresh = build_model(SPEC, seed=99)
    fresh_layers = make_layers(kfac_linears(fresh), cfg)
    fresh_opt = build_optimizer(fresh, fresh_layers, OPTIM, optimizer="muon")
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    for l in fresh_layers:
        l.load_state_dict(saved["layers"][l.name])
    assert fresh_opt.steps == 2 and fresh_layers[0].momentum_buffer is not None
    data = stream()
    for step in (2, 3):
        for m, ls, o in ((model, layers, opt), (fresh, fresh_layers, fresh_opt)):
            train_step(m, ls, o, data.batch(step), step, M, cfg)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
    # Without the buffers the continuation differs: the round trip carried them.
    other = build_model(SPEC, seed=99)
    other.load_state_dict(saved["model"])
    other_layers = make_layers(kfac_linears(other), cfg)
    other_opt = build_optimizer(other, other_layers, OPTIM, optimizer="muon")
    other_opt.load_state_dict(saved["opt"])
    for step in (2, 3):
        train_step(other, other_layers, other_opt, data.batch(step), step, M, cfg)
    assert not torch.equal(other_layers[0].module.weight, layers[0].module.weight)


def test_optimizer_covers_weights_only_and_follows_the_schedule():
    model = build_model(SPEC, seed=1)
    layers = make_layers(kfac_linears(model), MuonConfig(lr=0.02))
    opt = build_optimizer(model, layers, OptimConfig(warmup_steps=4), optimizer="muon")
    assert isinstance(opt, MuonOptimizer)
    adamw_params = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    for _, lin in kfac_linears(model):
        assert id(lin.weight) not in adamw_params and id(lin.bias) in adamw_params
    assert len(adamw_params) + len(layers) == len(list(model.parameters()))
    assert opt.lr == pytest.approx(0.02 / 4)  # the first warm-up step's rate
    with pytest.raises(ValueError, match="another kind"):
        build_optimizer(model, layers, OPTIM, optimizer="shampoo")


def test_config_section_and_reference_trainer(tmp_path):
    path = tmp_path / "muon.toml"
    path.write_text("[train]\nsteps = 2\n\n[muon]\nlr = 0.03\nnesterov = false\nns_dtype = \"float32\"\n"
                    "adjust_lr_fn = \"original\"\nns_coefficients = [3.0, -4.0, 2.0]\n")
    cfg = job_config.load(str(path))
    mc = muon_config(cfg)
    assert (mc.lr, mc.nesterov, mc.ns_dtype, mc.adjust_lr_fn) == (0.03, False, "float32", "original")
    assert mc.ns_coefficients == (3.0, -4.0, 2.0) and mc.weight_decay == 0.1
    assert job_config.load(None).muon.adjust_lr_fn == "match_rms_adamw"
    assert "[muon]" in cfg.to_toml() and job_config.load(None).to_toml().count("ns_steps = 5") == 1

    model, losses = train_reference(SPEC, cfg, stream(), M, optimizer="muon")
    assert len(losses) == 2 and all(np.isfinite(losses))
    ref = build_model(SPEC, seed=0)
    layers = make_layers(kfac_linears(ref), mc)
    opt = build_optimizer(ref, layers, optim_config(cfg), optimizer="muon")
    data = stream()
    for step in range(2):
        train_step(ref, layers, opt, data.batch(step), step, M, mc)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)

    bad = tmp_path / "bad.toml"
    bad.write_text("[muon]\nns_dtype = \"float16\"\n")
    with pytest.raises(InputError, match=r"muon\.ns_dtype: must be one of float32, float64, bfloat16"):
        job_config.load(str(bad))


def test_config_mirrors_torch_defaults_and_checks():
    defaults = inspect.signature(torch.optim.Muon).parameters
    for name, value in dataclasses.asdict(MuonConfig()).items():
        if name != "ns_dtype":
            assert defaults[name].default == value, name
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        MuonConfig(adjust_lr_fn="sqrt")
    with pytest.raises(ValueError, match="ns_steps"):
        MuonConfig(ns_steps=100)
