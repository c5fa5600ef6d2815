"""K-FAC math against independent float64 computations (closed forms, dense solves)."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.io.data import Batch, make_stream, split_micro_batches
from runtime.models import build_model, kfac_linears, lm_loss, resolve_config
from runtime.optimizers.kfac import (
    KfacConfig,
    KfacLayer,
    NonFiniteFactorError,
    apply_kl_clip,
    capturing,
    kl_clip_scale,
    make_layers,
)
from runtime.optimizers.stage import OptimConfig, build_optimizer
from runtime.train import train_step

D64 = torch.float64


class SoftmaxModel(nn.Module):
    """tokens -> fixed random features (6) -> Linear(6, 5) logits: the K-FAC layer is the
    softmax output layer, whose factors and Fisher have closed forms."""

    def __init__(self, vocab=7, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.features = nn.Parameter(torch.randn(vocab, 6, generator=g, dtype=D64), requires_grad=False)
        self.out = nn.Linear(6, 5).to(D64)
        with torch.no_grad():
            self.out.weight.copy_(torch.randn(5, 6, generator=g, dtype=D64) * 0.5)
            self.out.bias.copy_(torch.randn(5, generator=g, dtype=D64) * 0.5)

    def forward(self, tokens, targets=None):
        logits = self.out(self.features[tokens])
        return logits if targets is None else lm_loss(logits, targets)


def softmax_batch(rows, T=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randint(0, 7, (rows, T), generator=g), torch.randint(0, 5, (rows, T), generator=g))


def explicit_factors(model, batch):
    """Per-token loops in float64: A = mean [x,1][x,1]^T, B = mean (p - e_y)(p - e_y)^T
    (the softmax cross-entropy gradient of each token's own loss)."""
    x = model.features[batch.tokens].reshape(-1, 6)
    y = batch.targets.reshape(-1)
    A = torch.zeros(7, 7, dtype=D64)
    B = torch.zeros(5, 5, dtype=D64)
    with torch.no_grad():
        for i in range(len(y)):
            a = torch.cat([x[i], torch.ones(1, dtype=D64)])
            A += torch.outer(a, a)
            p = (model.out.weight @ x[i] + model.out.bias).softmax(0)
            g = p - F.one_hot(y[i], 5).to(D64)
            B += torch.outer(g, g)
    return A / len(y), B / len(y)


def capture_step(model, layers, batch, M):
    for l in layers:
        l.loss_divisor = M
    for m, (tok, tgt) in enumerate(split_micro_batches(batch, M)):
        with capturing(layers, m):
            (model(tok, tgt) / M).backward()
        for l in layers:
            l.curv_a(m)
            l.curv_b(m)
    for l in layers:
        l.update_factors()


def test_factors_equal_per_token_float64_computation():
    model = SoftmaxModel()
    batch = softmax_batch(3)
    [layer] = make_layers([("out", model.out)], KfacConfig())
    capture_step(model, [layer], batch, 1)
    A, B = explicit_factors(model, batch)
    torch.testing.assert_close(layer.factors["A"], A, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.factors["B"], B, rtol=1e-12, atol=1e-12)


def test_four_micro_batches_equal_one_batch_four_times_the_size():
    cfg = resolve_config("bert-tiny")
    batch = make_stream("bert", 8, 16, seed=3).batch(0)
    results = []
    for M in (1, 4):
        model = build_model(cfg, seed=1, dtype=D64)
        layers = make_layers(kfac_linears(model), KfacConfig())
        capture_step(model, layers, batch, M)
        results.append(({l.name: (l.factors["A"], l.factors["B"]) for l in layers},
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
    (f1, g1), (f4, g4) = results
    assert len(f1) == 12
    for name in f1:
        torch.testing.assert_close(f4[name][0], f1[name][0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(f4[name][1], f1[name][1], rtol=1e-10, atol=1e-12)
    for name in g1:
        torch.testing.assert_close(g4[name], g1[name], rtol=1e-10, atol=1e-12)


def layer_with_factors(cfg, seed=0):
    """A Linear(6, 5) whose K-FAC factors come from a real capture, and a gradient G."""
    model = SoftmaxModel(seed=seed)
    [layer] = make_layers([("out", model.out)], cfg)
    capture_step(model, [layer], softmax_batch(4, seed=seed), 1)
    for f in ("A", "B"):
        layer.invert(f)
    layer.activate()
    return model, layer


def vec(G):  # column-major vec: vec(B X A) = (A^T ⊗ B) vec(X)
    return G.t().reshape(-1)


@pytest.mark.parametrize("mode", ["plain", "pi"])
def test_preconditioned_gradient_equals_dense_kronecker_solve(mode):
    lam = 0.05
    cfg = KfacConfig(damping=lam, damping_mode=mode, inverse="eigen")
    model, layer = layer_with_factors(cfg)
    A, B = layer.factors["A"], layer.factors["B"]
    G = torch.randn(5, 7, dtype=D64, generator=torch.Generator().manual_seed(9))
    layer.set_grad_matrix(G.clone())
    layer.precondition()
    if mode == "plain":
        dense = torch.kron(A, B) + lam * torch.eye(35, dtype=D64)
    else:
        pi = math.sqrt((A.trace() / 7) / (B.trace() / 5))
        dense = torch.kron(A + pi * math.sqrt(lam) * torch.eye(7, dtype=D64),
                           B + math.sqrt(lam) / pi * torch.eye(5, dtype=D64))
    expected = torch.linalg.solve(dense, vec(G))
    torch.testing.assert_close(vec(layer.grad_matrix()), expected, rtol=1e-9, atol=1e-10)


def test_cholesky_and_eigen_give_the_same_preconditioned_gradient():
    G = torch.randn(5, 7, dtype=D64, generator=torch.Generator().manual_seed(5))
    out = []
    for inverse in ("cholesky", "eigen"):
        _, layer = layer_with_factors(KfacConfig(damping=1e-2, inverse=inverse))
        layer.set_grad_matrix(G.clone())
        layer.precondition()
        out.append(layer.grad_matrix())
    torch.testing.assert_close(out[0], out[1], rtol=1e-9, atol=1e-11)
    assert not torch.allclose(out[0], G)  # preconditioning did something


def test_monte_carlo_fisher_approaches_exact_softmax_fisher():
    model = SoftmaxModel(seed=2)
    tokens = softmax_batch(2000, seed=2).tokens  # 8000 tokens, one sampled target each
    batch = Batch(tokens, torch.zeros_like(tokens))  # labels all 0: the empirical Fisher differs
    cfg = KfacConfig(fisher="mc", kl_clip=None)
    layers = make_layers([("out", model.out)], cfg)
    opt = build_optimizer(model, layers, OptimConfig(lr=0.0, adam_lr=0.0))
    with torch.no_grad():
        p = model(batch.tokens).reshape(-1, 5).softmax(-1)
    exact_B = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]).mean(0)
    train_step(model, layers, opt, batch, 0, 4, cfg, seed=0)
    B = layers[0].factors["B"]
    assert (B - exact_B).abs().max() < 0.05 * exact_B.abs().max()
    # ... while the empirical Fisher (true labels, which the model does not fit) is far off.
    _, emp_B = explicit_factors(model, batch)
    assert (emp_B - exact_B).abs().max() > 0.2 * exact_B.abs().max()


def test_stale_inverses_step2_uses_step0_curvature():
    """k=2: steps 0 and 1 are unpreconditioned; steps 2 and 3 use inverses from step 0's
    curvature (computed by hand here), not from step 2's."""
    lam = 1e-2
    cfg = KfacConfig(damping=lam, refresh_steps=2, kl_clip=None, ema=0.5)
    model = SoftmaxModel(seed=4)
    layers = make_layers([("out", model.out)], cfg)
    opt = build_optimizer(model, layers, OptimConfig(lr=0.5, momentum=0.0, adam_lr=0.0))
    batches = [softmax_batch(4, seed=10 + t) for t in range(4)]

    def raw_grad(batch):  # closed form: mean over tokens of (p - e_y) [x, 1]^T
        x = model.features[batch.tokens].reshape(-1, 6)
        a = torch.cat([x, torch.ones(len(x), 1, dtype=D64)], 1)
        with torch.no_grad():
            p = model(batch.tokens).reshape(-1, 5).softmax(-1)
        return (p - F.one_hot(batch.targets.reshape(-1), 5).to(D64)).t() @ a / len(x)

    def damped_inverse(A, B):
        pi = math.sqrt((A.trace() / 7) / (B.trace() / 5))
        s = math.sqrt(lam)
        return (torch.linalg.inv(A + pi * s * torch.eye(7, dtype=D64)),
                torch.linalg.inv(B + s / pi * torch.eye(5, dtype=D64)))

    A0, B0 = explicit_factors(model, batches[0])
    for t in range(4):
        G = raw_grad(batches[t])
        if t == 2:
            A2, B2 = explicit_factors(model, batches[2])
        train_step(model, layers, opt, batches[t], t, 2, cfg)
        got = layers[0].grad_matrix()
        if t < 2:
            torch.testing.assert_close(got, G, rtol=1e-10, atol=1e-12)
        else:
            IA, IB = damped_inverse(A0, B0)
            torch.testing.assert_close(got, IB @ G @ IA, rtol=1e-9, atol=1e-11)
            IA2, IB2 = damped_inverse(0.5 * A0 + 0.5 * A2, 0.5 * B0 + 0.5 * B2)
            assert not torch.allclose(got, IB2 @ G @ IA2, rtol=1e-4, atol=1e-6)
    # the EMA'd step-2 curvature is pending, in force from step 4
    torch.testing.assert_close(layers[0].factors["A"], 0.5 * A0 + 0.5 * A2)


def test_non_finite_factor_raises_naming_the_layer():
    lin = nn.Linear(3, 2)
    layer = KfacLayer("block1.ffn.fc2", lin, KfacConfig())
    layer.save_input(0, torch.tensor([[1.0, float("nan"), 0.0]]))
    layer.save_grad(0, torch.ones(1, 2))
    layer.curv_a(0)
    layer.curv_b(0)
    with pytest.raises(NonFiniteFactorError, match=r"block1\.ffn\.fc2.*factor A.*non-finite"):
        layer.invert("A")


def test_kl_clip_scale_matches_formula_and_scales_grads():
    _, layer = layer_with_factors(KfacConfig(damping=1e-2))
    G = torch.randn(5, 7, dtype=D64, generator=torch.Generator().manual_seed(1))
    layer.set_grad_matrix(G.clone())
    layer.precondition()
    P = layer.grad_matrix()
    lr, clip = 0.3, 1e-4
    expected = min(1.0, math.sqrt(clip / (lr * lr * float((P * G).sum()))))
    assert expected < 1
    assert kl_clip_scale([layer], lr, clip) == pytest.approx(expected, rel=1e-12)
    apply_kl_clip([layer], lr, clip)
    torch.testing.assert_close(layer.grad_matrix(), P * expected)


def test_state_dict_round_trips_through_weights_only_load():
    model, layer = layer_with_factors(KfacConfig(inverse="eigen"))
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    fresh = KfacLayer("out", model.out, KfacConfig(inverse="eigen"))
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    G = torch.randn(5, 7, dtype=D64)
    for l in (layer, fresh):
        l.set_grad_matrix(G.clone())
        l.precondition()
    torch.testing.assert_close(fresh.grad_matrix(), layer.grad_matrix())


def test_plain_damping_needs_eigen():
    with pytest.raises(ValueError, match="eigen"):
        KfacConfig(damping_mode="plain", inverse="cholesky")


@pytest.mark.parametrize("order", [("A", "B"), ("B", "A")])
def test_each_inversion_updates_only_its_factor_in_either_order(order):
    """The planner costs each inversion as a fixed op, its factor's EMA included, whichever
    of a layer's two it places first: an inversion updates only its own factor, and the
    other factor's π term comes from its would-be diagonal. Both orders give the dense
    float64 damped inverses of the EMA'd factors."""
    ema, lam = 0.8, 1e-2
    cfg = KfacConfig(damping=lam, ema=ema)
    model = SoftmaxModel(seed=3)
    [layer] = make_layers([("out", model.out)], cfg)
    capture_step(model, [layer], softmax_batch(4, seed=1), 1)  # cycle 0: factors = F0
    F0 = {f: layer.factors[f].clone() for f in ("A", "B")}
    layer.activate()
    model.zero_grad()
    with capturing([layer], 0):
        (model(*softmax_batch(3, seed=2)) / 1).backward()
    layer.curv_a(0)
    layer.curv_b(0)
    A1, B1 = explicit_factors(model, softmax_batch(3, seed=2))
    want = {"A": ema * F0["A"] + (1 - ema) * A1, "B": ema * F0["B"] + (1 - ema) * B1}
    first, second = order
    layer.invert(first)
    torch.testing.assert_close(layer.factors[second], F0[second])  # untouched until its own inversion
    layer.invert(second)
    pi = math.sqrt((want["A"].trace() / 7) / (want["B"].trace() / 5))
    damp = {"A": math.sqrt(lam) * pi, "B": math.sqrt(lam) / pi}
    for f, d in (("A", 7), ("B", 5)):
        torch.testing.assert_close(layer.factors[f], want[f], rtol=1e-12, atol=1e-14)
        dense = torch.linalg.inv(want[f] + damp[f] * torch.eye(d, dtype=D64))
        torch.testing.assert_close(layer.pending(f), dense, rtol=1e-9, atol=1e-11)


def test_raw_gradient_norm_equals_float64_sum_of_squares():
    """The metric and clipping norm (runtime.optimizers.stage.raw_grad_norm_sq): every gradient's norm in
    one multi-tensor kernel, against the float64 sum of squares of the same gradients (K-FAC
    layers' own raw terms: the pipeline-against-single-process tests)."""
    from runtime.optimizers.stage import raw_grad_norm_sq

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 3
    want = sum(float(p.grad.double().square().sum()) for p in model.parameters())
    assert float(raw_grad_norm_sq(model, [])) == pytest.approx(want, rel=1e-6)
