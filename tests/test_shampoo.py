"""Shampoo (runtime.optimizers.shampoo) against a dense float64 computation of its update written here
with numpy (statistics, eigendecomposition roots, grafting, SGD momentum), with roots
refreshed every step and every other step; its checkpoints; its [shampoo] config section."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from pfcompile.formats.errors import InputError
from runtime.config import job as job_config
from runtime.io.data import make_stream, split_micro_batches
from runtime.models import ModelConfig, build_model, kfac_linears
from runtime.optimizers.kfac import NonFiniteFactorError
from runtime.optimizers.shampoo import ShampooConfig, ShampooLayer, make_layers, shampoo_config
from runtime.optimizers.stage import OptimConfig, SgdOnCoveredOptimizer, build_optimizer, optim_config
from runtime.train import train_reference, train_step

D64 = torch.float64
SPEC = ModelConfig("shampoo-test", "gpt", layers=2, hidden=16, heads=2, ffn=24, vocab=100, max_seq_len=8)
M = 2  # micro-batches
OPTIM = OptimConfig(lr=0.05, momentum=0.9, weight_decay=1e-3, adam_lr=1e-3, adam_weight_decay=0.01,
                    adam_no_decay="")  # the references below decay every parameter


def stream():
    return make_stream("gpt", 4, 8, seed=0, synthetic=True, vocab=SPEC.vocab)


def shampoo_run(cfg: ShampooConfig, steps: int, dtype=D64):
    model = build_model(SPEC, seed=1, dtype=dtype)
    layers = make_layers(kfac_linears(model), cfg)
    opt = build_optimizer(model, layers, OPTIM, optimizer="shampoo")
    data = stream()
    for step in range(steps):
        train_step(model, layers, opt, data.batch(step), step, M, cfg)
    return model, layers, opt


def damped_root(S: np.ndarray, cfg: ShampooConfig) -> np.ndarray:
    w, Q = np.linalg.eigh(S)
    w = np.maximum(w, 0)
    p = cfg.exponent_override or 0.25
    if cfg.epsilon_mode == "relative":
        if w[-1] <= 0:
            return np.eye(len(S))
        return Q @ np.diag((w + cfg.epsilon * w[-1]) ** -p) @ Q.T
    return Q @ np.diag((w + cfg.epsilon) ** -p) @ Q.T


def spans(n: int, most: int) -> list[tuple[int, int]]:
    return [(i, min(i + most, n)) for i in range(0, n, most)]


class DenseShampoo:
    """Distributed Shampoo's update on one weight, float64 numpy, with the cycle semantics of
    runtime.optimizers.shampoo, then SGD with momentum (torch.optim.SGD's rule: buf = u, then
    μ buf + u) after decoupled weight decay w <- w (1 - lr wd)."""

    def __init__(self, shape, cfg: ShampooConfig):
        self.cfg = cfg
        self.blocks = [(r, c) for r in spans(shape[0], cfg.max_preconditioner_dim)
                       for c in spans(shape[1], cfg.max_preconditioner_dim)]
        self.L = {b: np.zeros((b[0][1] - b[0][0],) * 2) for b in self.blocks}
        self.R = {b: np.zeros((b[1][1] - b[1][0],) * 2) for b in self.blocks}
        self.roots = self.pending = None
        self.A, self.m = np.zeros(shape), np.zeros(shape)
        self.t = 0
        self.buf = None
        self.changed = 0.0  # largest relative change preconditioning made to the graft's direction

    def step(self, step: int, w: np.ndarray, G: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        refresh = step % cfg.refresh_steps == 0
        if refresh and self.pending is not None:
            self.roots, self.pending = self.pending, None
        b2 = cfg.beta2
        new = 1.0 if b2 == 1 else 1 - b2
        for blk in self.blocks:
            (r0, r1), (c0, c1) = blk
            Gb = G[r0:r1, c0:c1]
            self.L[blk] = b2 * self.L[blk] + new * Gb @ Gb.T
            self.R[blk] = b2 * self.R[blk] + new * Gb.T @ Gb
        if refresh:
            self.pending = {blk: (damped_root(self.L[blk], cfg), damped_root(self.R[blk], cfg)) for blk in self.blocks}
        self.t += 1
        t = self.t
        if cfg.graft == "adagrad":
            self.A = self.A + G * G
        elif cfg.graft in ("rmsprop", "adam"):
            self.A = cfg.graft_beta2 * self.A + (1 - cfg.graft_beta2) * G * G
        self.m = cfg.beta1 * self.m + (1 - cfg.beta1) * G
        Mt = self.m / (1 - cfg.beta1 ** t) if cfg.beta1 > 0 else G
        if cfg.graft in ("adagrad", "rmsprop"):
            D = Mt / (np.sqrt(self.A) + cfg.graft_epsilon)
        elif cfg.graft == "adam":
            D = Mt / (np.sqrt(self.A / (1 - cfg.graft_beta2 ** t)) + cfg.graft_epsilon)
        else:
            D = Mt
        U = D
        if self.roots is not None and step >= cfg.start_preconditioning_step:
            U = np.zeros_like(G)
            for blk in self.blocks:
                (r0, r1), (c0, c1) = blk
                Lr, Rr = self.roots[blk]
                P = Lr @ Mt[r0:r1, c0:c1] @ Rr
                if cfg.graft != "none":
                    P = P * (np.linalg.norm(D[r0:r1, c0:c1]) / np.linalg.norm(P))
                U[r0:r1, c0:c1] = P
            self.changed = max(self.changed, np.linalg.norm(U - D) / np.linalg.norm(D))
        w = w * (1 - OPTIM.lr * cfg.weight_decay)
        self.buf = U if self.buf is None else cfg.momentum * self.buf + U
        return w - OPTIM.lr * self.buf


# The settings before Distributed Shampoo's: sgd graft, no β1, relative ε.
OLD = dict(graft="sgd", beta1=0.0, epsilon_mode="relative", momentum=0.9, weight_decay=1e-3)


# ε = 1e-12 absolute damps the null space of the rank-deficient first statistics to 1e3 times
# the gradient: eigh's rounding there reaches the weights at ~1e-10.
@pytest.mark.parametrize("cfg,steps", [
    (ShampooConfig(momentum=0.9, weight_decay=1e-3), 4),  # the defaults: adam graft, β1, absolute ε
    (ShampooConfig(**OLD, beta2=0.99, epsilon=1e-6), 4),
    (ShampooConfig(**{**OLD, "graft": "none"}, beta2=1.0, epsilon=1e-4), 4),
    (ShampooConfig(**OLD, beta2=0.9, epsilon=1e-6, refresh_steps=2), 6),
    (ShampooConfig(graft="sgd"), 4),
    (ShampooConfig(graft="adagrad", momentum=0.5), 4),
    (ShampooConfig(graft="rmsprop", graft_beta2=0.9, graft_epsilon=1e-6), 4),
    (ShampooConfig(graft="none", epsilon=1e-3), 4),
    (ShampooConfig(epsilon=1e-4, epsilon_mode="relative"), 4),
    (ShampooConfig(exponent_override=0.5, epsilon=1e-8), 4),
    (ShampooConfig(start_preconditioning_step=3), 5),
    (ShampooConfig(max_preconditioner_dim=10, refresh_steps=2, weight_decay=0.1), 6),
], ids=["defaults", "old", "old-none", "old-k2", "sgd", "adagrad", "rmsprop", "none", "relative", "exponent",
        "start", "blocks"])
def test_equals_dense_float64_shampoo(cfg, steps, request):
    """Every parameter after each step to 1e-10 (5e-10 with the default ε): the covered weights against DenseShampoo,
    the rest (biases included) against torch's AdamW fed the same gradients."""
    model = build_model(SPEC, seed=1, dtype=D64)
    layers = make_layers(kfac_linears(model), cfg)
    opt = build_optimizer(model, layers, OPTIM, optimizer="shampoo")

    ref = build_model(SPEC, seed=1, dtype=D64)
    weights = [m.weight for _, m in kfac_linears(ref)]
    covered = {id(p) for p in weights}
    adamw = torch.optim.AdamW([p for p in ref.parameters() if id(p) not in covered], lr=OPTIM.adam_lr,
                              betas=OPTIM.adam_betas, weight_decay=OPTIM.adam_weight_decay)
    dense = [DenseShampoo(tuple(w.shape), cfg) for w in weights]
    atol = 5e-10 if request.node.callspec.id == "defaults" else 1e-10
    data = stream()
    for step in range(steps):
        train_step(model, layers, opt, data.batch(step), step, M, cfg)
        ref.zero_grad()
        for tokens, targets in split_micro_batches(data.batch(step), M):
            (ref(tokens, targets) / M).backward()
        with torch.no_grad():
            for w, d in zip(weights, dense):
                w.copy_(torch.from_numpy(d.step(step, w.numpy(), w.grad.numpy())))
        adamw.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=atol, msg=lambda m, name=name, step=step: f"step {step} {name}: {m}")
    # The first cycle is unpreconditioned, later steps are changed substantially:
    # an unpreconditioned run would fail the comparison.
    assert min(d.changed for d in dense) > 0.05
    if cfg.max_preconditioner_dim < SPEC.hidden:
        assert max(len(d.blocks) for d in dense) > 2


def test_blocks_travel_as_one_tensor():
    """A factor's pending roots of every block survive pending -> set_pending (bcast_inv)."""
    cfg = ShampooConfig(max_preconditioner_dim=4)
    lin = torch.nn.Linear(10, 6, dtype=D64)
    src, dst = ShampooLayer("lin", lin, cfg), ShampooLayer("lin", lin, cfg)
    assert len(src.blocks) == 6 and src.block_dims["L"] == [4, 4, 4, 2, 2, 2]
    lin.weight.grad = torch.randn(6, 10, dtype=D64, generator=torch.Generator().manual_seed(0))
    src.update_stats(True)
    for f in ("L", "R"):
        src.compute_root(f)
        sent = src.pending(f)
        assert tuple(sent.shape) == dst.pending_shape(f)
        dst.set_pending(f, sent.clone())
    src.activate()
    dst.activate()
    for f in ("L", "R"):
        assert all(torch.equal(a, b) for a, b in zip(src.roots[f], dst.roots[f]))


def test_root_is_the_damped_inverse_fourth_root():
    lin = torch.nn.Linear(5, 3, dtype=D64)
    layer = ShampooLayer("lin", lin, ShampooConfig(**OLD, epsilon=1e-3, refresh_steps=2))
    g = torch.Generator().manual_seed(0)
    for snapshot in (True, False):
        lin.weight.grad = torch.randn(3, 5, dtype=D64, generator=g)
        layer.update_stats(snapshot)
    assert not torch.equal(layer.snapshots["L"][0], layer.statistics["L"][0])  # the snapshot is the cycle's first step's
    for f in ("L", "R"):
        layer.compute_root(f)
        S = layer.snapshots[f][0]
        top = float(torch.linalg.eigvalsh(S).max())
        damped = S + 1e-3 * top * torch.eye(len(S), dtype=D64)
        X = layer.pending(f)
        torch.testing.assert_close(torch.linalg.matrix_power(X, 4) @ damped, torch.eye(len(S), dtype=D64),
                                   rtol=0, atol=1e-10)
    assert layer.roots == {}  # pending until activate()
    G = lin.weight.grad.clone()
    layer.precondition()
    assert torch.equal(lin.weight.grad, G)
    layer.activate()
    layer.precondition()
    assert not torch.allclose(lin.weight.grad, G)
    torch.testing.assert_close(lin.weight.grad.norm(), G.norm())  # grafted onto the raw norm


def test_zero_statistic_root_is_identity_and_nonfinite_is_an_error():
    lin = torch.nn.Linear(4, 3, dtype=D64)
    layer = ShampooLayer("blk.fc", lin, ShampooConfig(epsilon_mode="relative"))
    lin.weight.grad = torch.zeros(3, 4, dtype=D64)
    layer.update_stats(True)
    layer.compute_root("R")
    assert torch.equal(layer.pending("R"), torch.eye(4, dtype=D64))
    lin.weight.grad = torch.full((3, 4), float("nan"), dtype=D64)
    layer.update_stats(True)
    with pytest.raises(NonFiniteFactorError, match="Shampoo layer blk.fc: statistic L"):
        layer.compute_root("L")


def checkpoint(model, layers, opt) -> dict:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "layers": {l.name: l.state_dict() for l in layers}}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("k", [1, 2])
def test_checkpoint_round_trip_continues_identically(k):
    """Saved after step 2 (with k = 2: mid-cycle, snapshot taken and roots pending, and blocks)."""
    cfg = ShampooConfig(refresh_steps=k, momentum=0.9, max_preconditioner_dim=10 if k == 2 else 1024)
    model, layers, opt = shampoo_run(cfg, 3, dtype=None)
    saved = checkpoint(model, layers, opt)
    state = saved["layers"][layers[0].name]
    assert "pending_L" in state and ("snapshot_L" in state) == (k == 2)  # k = 1 keeps no snapshot copy
    assert state["steps"] == 3 and "graft" in state and "filtered" in state
    fresh = build_model(SPEC, seed=99)
    fresh_layers = make_layers(kfac_linears(fresh), cfg)
    fresh_opt = build_optimizer(fresh, fresh_layers, OPTIM, optimizer="shampoo")
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    for l in fresh_layers:
        l.load_state_dict(saved["layers"][l.name])
    data = stream()
    for step in (3, 4, 5):
        for m, ls, o in ((model, layers, opt), (fresh, fresh_layers, fresh_opt)):
            train_step(m, ls, o, data.batch(step), step, M, cfg)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name


def test_optimizer_puts_biases_on_adamw():
    model = build_model(SPEC, seed=1)
    layers = make_layers(kfac_linears(model), ShampooConfig())
    opt = build_optimizer(model, layers, OPTIM, optimizer="shampoo")
    assert isinstance(opt, SgdOnCoveredOptimizer)
    # [shampoo]'s momentum and weight decay (0 by default), decoupled; not the optimizer's
    assert (opt.cfg.momentum, opt.cfg.weight_decay, opt.cfg.decoupled_weight_decay) == (0.0, 0.0, True)
    sgd = {id(p) for g in opt.sgd.param_groups for p in g["params"]}
    assert sgd == {id(m.weight) for _, m in kfac_linears(model)}
    adamw = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    assert all(id(m.bias) in adamw for _, m in kfac_linears(model))
    with pytest.raises(ValueError, match="optimizer must be one of kfac, shampoo, muon, adamw"):
        build_optimizer(model, layers, OPTIM, optimizer="lion")


def test_config_section_and_reference_trainer(tmp_path):
    path = tmp_path / "shampoo.toml"
    path.write_text("[train]\nsteps = 3\n\n[shampoo]\nbeta2 = 0.95\nepsilon = 1e-5\n\n[kfac]\nrefresh_steps = 2\n")
    cfg = job_config.load(str(path))
    sc = shampoo_config(cfg)
    assert (sc.beta2, sc.epsilon, sc.graft, sc.refresh_steps) == (0.95, 1e-5, "adam", 2)
    assert (sc.beta1, sc.epsilon_mode, sc.graft_beta2, sc.momentum, sc.max_preconditioner_dim) == \
        (0.9, "absolute", 0.999, 0.0, 1024)
    model, losses = train_reference(SPEC, cfg, stream(), M, optimizer="shampoo", dtype=D64)
    ref = build_model(SPEC, seed=0, dtype=D64)
    layers = make_layers(kfac_linears(ref), sc)
    opt = build_optimizer(ref, layers, optim_config(cfg), optimizer="shampoo")
    data = stream()
    for step in range(3):
        train_step(ref, layers, opt, data.batch(step), step, M, sc)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert len(losses) == 3 and all(np.isfinite(losses))
    bad = tmp_path / "bad.toml"
    bad.write_text("[shampoo]\nbeta2 = 0\n")
    with pytest.raises(InputError, match=r"shampoo\.beta2: must be in \(0, 1\], got 0"):
        job_config.load(str(bad))
    bad.write_text("[shampoo]\ngraft = \"lion\"\n")
    with pytest.raises(InputError, match=r"shampoo\.graft: must be one of sgd, adagrad"):
        job_config.load(str(bad))
