"""Shampoo (runtime.optimizers.shampoo) against a dense float64 computation of its update written here
with numpy (statistics, eigendecomposition roots, grafting, SGD momentum), with roots
refreshed every step and every other step; its checkpoints; its [shampoo] config section."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn as nn

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


def inverse_fourth_root(S: np.ndarray, eps: float) -> np.ndarray:
    w, Q = np.linalg.eigh(S)
    w = np.maximum(w, 0)
    if w[-1] <= 0:
        return np.eye(len(S))
    return Q @ np.diag((w + eps * w[-1]) ** -0.25) @ Q.T


class DenseShampoo:
    """Shampoo + SGD momentum (torch.optim.SGD's rule: d = g + wd w, buf = d then μ buf + d,
    w -= lr buf) on one weight, float64 numpy, with the cycle semantics of runtime.optimizers.shampoo."""

    def __init__(self, shape, cfg: ShampooConfig):
        self.cfg = cfg
        self.L, self.R = np.zeros((shape[0],) * 2), np.zeros((shape[1],) * 2)
        self.roots = self.pending = None
        self.buf = None
        self.changed = 0.0  # largest relative change preconditioning made to a gradient

    def step(self, t: int, w: np.ndarray, G: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        refresh = t % cfg.refresh_steps == 0
        if refresh and self.pending is not None:
            self.roots, self.pending = self.pending, None
        b = cfg.beta2
        new = 1.0 if b == 1 else 1 - b
        self.L = b * self.L + new * G @ G.T
        self.R = b * self.R + new * G.T @ G
        if refresh:
            self.pending = (inverse_fourth_root(self.L, cfg.epsilon), inverse_fourth_root(self.R, cfg.epsilon))
        P = G
        if self.roots is not None:
            P = self.roots[0] @ G @ self.roots[1]
            if cfg.graft == "sgd":
                P = P * (np.linalg.norm(G) / np.linalg.norm(P))
            self.changed = max(self.changed, np.linalg.norm(P - G) / np.linalg.norm(G))
        d = P + OPTIM.weight_decay * w
        self.buf = d if self.buf is None else OPTIM.momentum * self.buf + d
        return w - OPTIM.lr * self.buf


# the original Shampoo of these tests: SGD grafting and momentum, no β1, relative ε, coupled decay
OLD = dict(graft="sgd", beta1=0.0, epsilon_mode="relative", momentum=None, weight_decay=None, beta2=0.99,
           bias_correction=False)


@pytest.mark.parametrize("cfg,steps", [
    (ShampooConfig(**{**OLD, "beta2": 0.99}, epsilon=1e-6), 4),
    (ShampooConfig(**{**OLD, "beta2": 1.0, "graft": "none"}, epsilon=1e-4), 4),
    (ShampooConfig(**{**OLD, "beta2": 0.9}, epsilon=1e-6, refresh_steps=2), 6),
])
def test_equals_dense_float64_shampoo(cfg, steps):
    """Every parameter after each step to 1e-8: the covered weights against DenseShampoo,
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
            torch.testing.assert_close(p, q, rtol=0, atol=1e-8, msg=lambda m, name=name, step=step: f"step {step} {name}: {m}")
    # The first cycle is unpreconditioned, later steps are changed substantially:
    # an unpreconditioned run would fail the comparison.
    assert min(d.changed for d in dense) > 0.05


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
    layer = ShampooLayer("blk.fc", lin, ShampooConfig())
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
    cfg = ShampooConfig(refresh_steps=k, max_preconditioner_dim=10 if k == 2 else 1024)
    model, layers, opt = shampoo_run(cfg, 3, dtype=None)
    saved = checkpoint(model, layers, opt)
    state = saved["layers"][layers[0].name]
    assert "pending_L" in state and ("snapshot_L" in state) == (k == 2)  # k = 1 keeps no snapshot copy
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
    sgd = {id(p) for g in opt.sgd.param_groups for p in g["params"]}
    assert sgd == {id(m.weight) for _, m in kfac_linears(model)}
    adamw = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    assert all(id(m.bias) in adamw for _, m in kfac_linears(model))
    with pytest.raises(ValueError, match="optimizer must be one of kfac, shampoo, soap, muon, adamw"):
        build_optimizer(model, layers, OPTIM, optimizer="lion")


def test_config_section_and_reference_trainer(tmp_path):
    path = tmp_path / "shampoo.toml"
    path.write_text("[train]\nsteps = 3\n\n[shampoo]\nbeta2 = 0.95\nepsilon = 1e-5\n\n[kfac]\nrefresh_steps = 2\n")
    cfg = job_config.load(str(path))
    sc = shampoo_config(cfg)
    assert (sc.beta2, sc.epsilon, sc.graft, sc.refresh_steps) == (0.95, 1e-5, "adam", 2)
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


# --- Distributed Shampoo's options (issue 38) against a numpy float64 reference ------------------
def _dense_ds(cfg: ShampooConfig, grads, w0, lr: float, k: int):
    """Distributed Shampoo's step on one weight, written out: statistics (bias-corrected), roots
    of the cycle's first step's statistics in force one cycle later, β1's average (bias-corrected),
    the graft, its norm on Shampoo's direction, decoupled weight decay, heavy-ball momentum."""
    m_, n_ = w0.shape
    L, R, w = np.zeros((m_, m_)), np.zeros((n_, n_)), w0.copy()
    roots = pending = None
    avg, sq, buf, s_steps = np.zeros_like(w), np.zeros_like(w), None, 0
    p = cfg.exponent_override or 4.0

    def root(S, t):
        if cfg.bias_correction and cfg.beta2 < 1 and t:
            S = S / (1 - cfg.beta2 ** t)
        lam, Q = np.linalg.eigh(S)
        lam = np.maximum(lam, 0)
        if lam[-1] <= 0:  # no gradient folded yet (deferred statistics' first step)
            return np.eye(len(S))
        eps = cfg.epsilon * lam[-1] if cfg.epsilon_mode == "relative" else cfg.epsilon
        return Q @ np.diag((lam + eps) ** (-1 / p)) @ Q.T

    for t, g in enumerate(grads):
        if t % k == 0 and pending is not None:
            roots, pending = pending, None
        b2 = cfg.beta2
        a = 1.0 if b2 == 1 else 1 - b2  # β2 = 1: plain sums
        # deferred statistics: step t folds the previous step's gradient (none at the first)
        folded = (grads[t - 1] if t else None) if cfg.defer_stats else g
        if folded is not None:
            L = b2 * L + a * folded @ folded.T
            R = b2 * R + a * folded.T @ folded
            s_steps += 1
        if t % k == 0:
            pending = (root(L, s_steps), root(R, s_steps))
        avg = cfg.beta1 * avg + (1 - cfg.beta1) * g
        bc = cfg.bias_correction
        mhat = (avg / (1 - cfg.beta1 ** (t + 1)) if bc else avg) if cfg.beta1 > 0 else g
        gb = cfg.graft_beta2
        if cfg.graft == "adagrad":
            sq = sq + g * g
        elif cfg.graft in ("rmsprop", "adam"):
            sq = gb * sq + (1 - gb) * g * g
        vhat = sq / (1 - gb ** (t + 1)) if cfg.graft == "adam" and bc else sq
        graft = mhat / (np.sqrt(vhat) + cfg.graft_epsilon) if cfg.graft in ("adagrad", "rmsprop", "adam") else mhat
        if roots is None or t + 1 <= cfg.start_preconditioning_step:
            d = graft
        else:
            d = roots[0] @ mhat @ roots[1]
            if cfg.graft != "none":
                d = d * np.linalg.norm(graft) / np.linalg.norm(d)
        w = w * (1 - lr * cfg.weight_decay)
        buf = d if buf is None else cfg.momentum * buf + d
        w = w - lr * buf
    return w


def _run(lin, layer, opt, grads, k: int) -> None:
    """The layer's ops in a trainer's order, one step per given gradient, then the step."""
    for t, g in enumerate(grads):
        if t % k == 0:
            layer.activate()
        lin.weight.grad, lin.bias.grad = g.clone(), None
        layer.stats(cycle_step=t % k)
        if t % k == 0:
            layer.inv(factor="L")
            layer.inv(factor="R")
        layer.precond()
        opt.step()


DS_CASES = {
    "defaults (adam graft, beta1, decoupled wd)": dict(weight_decay=0.1),
    "adagrad": dict(graft="adagrad"), "rmsprop": dict(graft="rmsprop", graft_beta2=0.9),
    "sgd + momentum": dict(graft="sgd", momentum=0.9), "none": dict(graft="none", beta1=0.5),
    "relative epsilon": dict(epsilon=1e-4, epsilon_mode="relative"),
    "absolute epsilon, beta2 1": dict(epsilon=1e-3, beta2=1.0),
    "exponent 2": dict(exponent_override=2.0), "start step 5": dict(start_preconditioning_step=5),
    "no bias correction": dict(bias_correction=False, beta2=0.9),
    "deferred statistics": dict(defer_stats=True, weight_decay=0.1),
    "deferred statistics, beta2 1, no graft": dict(defer_stats=True, beta2=1.0, graft="none", epsilon=1e-3),
}


@pytest.mark.parametrize("case", list(DS_CASES))
def test_distributed_shampoo_options_equal_dense_float64(case):
    k, steps, lr = 2, 9, 0.01
    # ε 1e-6, not the default 1e-12: the first cycle's statistics are singular, and a root of
    # 1e-12 amplifies rounding in their null space by 1e3, past the 1e-10 compared
    cfg = ShampooConfig(**{"momentum": 0.0, "weight_decay": 0.0, "epsilon": 1e-6, **DS_CASES[case]}, refresh_steps=k)
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(5, 4, dtype=D64)
    grads = [torch.randn(4, 5, generator=gen, dtype=D64) * (1 + t) for t in range(steps)]
    w0 = lin.weight.detach().numpy().copy()
    layer = ShampooLayer("lin", lin, cfg)
    opt = build_optimizer(lin, [layer], OptimConfig(lr=lr, momentum=0.3, weight_decay=0.5), optimizer="shampoo")
    _run(lin, layer, opt, grads, k)
    want = _dense_ds(cfg, [g.numpy() for g in grads], w0, lr, k)
    assert np.abs(want - w0).max() > 1e-3
    # two eigensolvers meet here (torch's, numpy's LAPACK), whose float64 rounding differs
    # from CPU to CPU, most without a graft: a wrong option moves the weights by 1e-3 or
    # more, so 1e-8 still tells them apart
    np.testing.assert_allclose(lin.weight.detach().numpy(), want, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("graft", ["adam", "sgd"])
def test_blocks_equal_dense_float64_per_block(graft):
    """max_preconditioner_dim 4 on a 7 x 9 weight: blocks of rows 4, 3 and columns 4, 4, 1, each
    its own Shampoo (statistics, roots, graft norm); the elementwise state (β1's average, the
    graft's second moment, momentum, decay) is the same per block, so the update is
    _dense_ds run on each block's gradients alone."""
    k, steps, lr = 2, 7, 0.01
    cfg = ShampooConfig(graft=graft, momentum=0.5, weight_decay=0.1, epsilon=1e-6, max_preconditioner_dim=4,
                        refresh_steps=k)
    gen = torch.Generator().manual_seed(5)
    lin = nn.Linear(9, 7, dtype=D64)
    grads = [torch.randn(7, 9, generator=gen, dtype=D64) * (1 + t) for t in range(steps)]
    w0 = lin.weight.detach().numpy().copy()
    layer = ShampooLayer("lin", lin, cfg)
    assert len(layer.blocks) == 6 and layer.block_dims["R"] == [4, 4, 1, 4, 4, 1]
    opt = build_optimizer(lin, [layer], OptimConfig(lr=lr), optimizer="shampoo")
    _run(lin, layer, opt, grads, k)
    want = np.zeros_like(w0)
    for r0, r1 in ((0, 4), (4, 7)):
        for c0, c1 in ((0, 4), (4, 8), (8, 9)):
            want[r0:r1, c0:c1] = _dense_ds(cfg, [g.numpy()[r0:r1, c0:c1] for g in grads], w0[r0:r1, c0:c1], lr, k)
    assert np.abs(want - w0).max() > 1e-3
    np.testing.assert_allclose(lin.weight.detach().numpy(), want, rtol=1e-10, atol=1e-11)


def test_blocks_travel_as_one_tensor():
    """A factor's pending roots of every block survive pending -> set_pending (bcast_inv)."""
    cfg = ShampooConfig(max_preconditioner_dim=4)
    lin = nn.Linear(10, 6, dtype=D64)
    src, dst = ShampooLayer("lin", lin, cfg), ShampooLayer("lin", lin, cfg)
    assert src.block_dims["L"] == [4, 4, 4, 2, 2, 2]
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
