"""Models, stages, model specs and data: each checked against an independent computation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import D64, chained

from runtime.io.data import IGNORE_INDEX, MASK, VOCAB, Batch, corpus_tokens, decode, make_stream, split_micro_batches
from runtime.models import (
    MODEL_CONFIGS,
    ModelSpecError,
    build_model,
    build_part,
    build_stage,
    kfac_linears,
    part_names,
    resolve_config,
    resolve_model,
)
from runtime.optimizers.kfac import KfacConfig, make_layers
from runtime.optimizers.stage import OptimConfig, build_optimizer
from runtime.train import train_step

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"




@pytest.mark.parametrize("name", ["bert-tiny", "gpt-tiny"])
def test_cut_into_1_2_4_stages_matches_uncut_model(name):
    spec = resolve_model(name)
    kind = spec.cfg.kind
    batch = make_stream(kind, 4, 16, seed=1).batch(0)
    whole = build_model(spec, seed=7, dtype=D64)
    loss = whole(batch.tokens, batch.targets)
    loss.backward()
    ref = {n: p.grad for n, p in whole.named_parameters()}
    assert len(ref) > 20
    for stages in (1, 2, 4):
        l, grads = chained(spec, stages, batch, seed=7)
        assert l == pytest.approx(float(loss.detach()), rel=1e-12)
        assert grads.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], rtol=1e-10, atol=1e-13)


def test_gpt_is_causal_and_bert_is_not():
    for name, causal in (("gpt-tiny", True), ("bert-tiny", False)):
        cfg = resolve_config(name)
        embed, block = build_part(cfg, "embed", 0, D64), build_part(cfg, "block0", 0, D64)
        t = torch.randint(4, 100, (1, 12))
        t2 = t.clone()
        t2[0, -1] = (t[0, -1] + 1 - 4) % 96 + 4  # change only the last token
        h, h2 = block(embed(t)), block(embed(t2))
        assert torch.allclose(h[0, :-1], h2[0, :-1]) == causal


def test_parts_are_deterministic_per_seed_and_name():
    cfg = resolve_config("bert-tiny")
    whole = build_model(cfg, seed=3)
    alone = build_part(cfg, "block1", seed=3)
    for (n, p), (n2, q) in zip(whole.parts["block1"].named_parameters(), alone.named_parameters()):
        assert n == n2 and torch.equal(p, q)
    other = build_part(cfg, "block1", seed=4)
    assert not torch.equal(other.attn.q.weight, alone.attn.q.weight)
    assert not torch.equal(build_part(cfg, "block0", 3).attn.q.weight, alone.attn.q.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float32_and_float64(dtype):
    cfg = resolve_config("gpt-tiny")
    model = build_model(cfg, seed=0, dtype=dtype)
    batch = make_stream("gpt", 2, 8).batch(0)
    loss = model(batch.tokens, batch.targets)
    assert loss.dtype == dtype and torch.isfinite(loss)
    # untrained model on 100 tokens: close to log(100)
    assert abs(float(loss.detach()) - torch.log(torch.tensor(100.0))) < 0.5


def test_kfac_linears_names_order_and_coverage():
    model = build_model(resolve_config("bert-tiny"))
    names = [n for n, _ in kfac_linears(model)]
    per_block = ["attn.q", "attn.k", "attn.v", "attn.out", "ffn.fc1", "ffn.fc2"]
    assert names == [f"block{b}.{p}" for b in range(2) for p in per_block]
    with_head = [n for n, _ in kfac_linears(model, include=[r"^block\d+\.", r"^head\.proj$"])]
    assert with_head[-1] == "head.proj" and len(with_head) == 13
    only_ffn = [n for n, _ in kfac_linears(model, include=lambda n: ".ffn." in n)]
    assert only_ffn == ["block0.ffn.fc1", "block0.ffn.fc2", "block1.ffn.fc1", "block1.ffn.fc2"]
    stage = build_stage("bert-tiny", ["block1", "head"])
    assert [n for n, _ in kfac_linears(stage)] == [f"block1.{p}" for p in per_block]


def test_builtin_configs():
    for size, (n, h) in {"tiny": (2, 64), "mini": (4, 256), "base": (12, 768), "large": (24, 1024)}.items():
        for kind in ("bert", "gpt"):
            c = MODEL_CONFIGS[f"{kind}-{size}"]
            assert (c.layers, c.hidden, c.ffn, c.kind) == (n, h, 4 * h, kind)
    assert MODEL_CONFIGS["bert-base"].vocab == 30522 and MODEL_CONFIGS["bert-tiny"].vocab == len(VOCAB)
    assert resolve_config("bert-tiny", vocab=500, seq_len=256).vocab == 500
    assert part_names(MODEL_CONFIGS["bert-mini"]) == ["embed", "block0", "block1", "block2", "block3", "head"]


def test_the_contracts_table_is_the_runtimes_models():
    """What the verifier checks plans against (pfcompile.formats.models, torch-free) is what
    the runtime builds: the same names, sizes, parts and K-FAC layers (a family added to
    runtime.models without the table would be refused by every verifier)."""
    from pfcompile.formats import models as contract

    assert set(MODEL_CONFIGS) == set(contract.BUILTIN_MODELS)
    for name, cfg in MODEL_CONFIGS.items():
        assert {k: getattr(cfg, k) for k in contract.BUILTIN_MODELS[name]} == contract.BUILTIN_MODELS[name]
        assert part_names(cfg) == contract.part_names(cfg.layers)
        if cfg.hidden <= 256:  # built: the tiny and mini ones
            assert [n for n, _ in kfac_linears(build_model(cfg))] == contract.kfac_layer_names(cfg.layers, cfg.arch)


@pytest.mark.parametrize("spec", ["bert-huge", "nosuch.module:fn", "runtime.models:no_such_function",
                                  "runtime.models:part_names", "my_model:not_a_model"])
def test_bad_model_names_give_one_line_listing_valid_names(spec, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    with pytest.raises(ModelSpecError) as e:
        resolve_model(spec)
    msg = str(e.value)
    assert "\n" not in msg and spec in msg and "bert-tiny" in msg and "gpt-large" in msg


def test_user_model_from_examples(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    spec = resolve_model("my_model:build")
    assert spec.part_names[0] == "embed" and spec.part_names[-1] == "head"
    batch = make_stream(spec.cfg.kind, 4, 16, seed=0).batch(0)
    whole = build_model(spec, seed=2, dtype=D64)
    loss = whole(batch.tokens, batch.targets)
    loss.backward()
    layers = kfac_linears(whole)
    assert layers and all(n.startswith("block") for n, _ in layers)
    l2, grads = chained(spec, 2, batch, seed=2)
    assert l2 == pytest.approx(float(loss.detach()), rel=1e-12)
    for n, p in whole.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-13)


# --- data -----------------------------------------------------------------------------------
def test_corpus_split_and_vocab():
    train, val = corpus_tokens()
    assert 400_000 < len(train) + len(val) < 500_000
    assert abs(len(val) / (len(train) + len(val)) - 0.1) < 1e-3
    assert int(train.max()) < len(VOCAB) and int(train.min()) >= 0
    assert "the" in decode(train[:2000])


def test_batches_are_deterministic_in_seed_and_step():
    s1, s2 = make_stream("bert", 8, 32, seed=5), make_stream("bert", 8, 32, seed=5)
    b = s1.batch(17)
    assert torch.equal(b.tokens, s2.batch(17).tokens) and torch.equal(b.targets, s2.batch(17).targets)
    assert not torch.equal(b.tokens, s1.batch(18).tokens)
    assert not torch.equal(b.tokens, make_stream("bert", 8, 32, seed=6).batch(17).tokens)


def test_mlm_masking():
    b = make_stream("bert", 64, 40, seed=0).batch(0)
    chosen = b.targets != IGNORE_INDEX
    assert (chosen.sum(1) == 6).all()  # round(0.15 * 40) per row
    masked = (b.tokens == MASK) & chosen
    assert 0.7 < masked.sum() / chosen.sum() < 0.9
    assert not (b.tokens == MASK)[~chosen].any()
    kept = (b.tokens == b.targets) & chosen
    assert 0.03 < kept.sum() / chosen.sum() < 0.2


def test_lm_targets_are_next_tokens():
    b = make_stream("gpt", 4, 32, seed=0).batch(3)
    assert torch.equal(b.tokens[:, 1:], b.targets[:, :-1])


def test_split_micro_batches():
    b = Batch(torch.arange(24).view(8, 3), torch.arange(24).view(8, 3))
    mbs = split_micro_batches(b, 4)
    assert len(mbs) == 4 and torch.equal(mbs[2].tokens, b.tokens[4:6])
    with pytest.raises(ValueError, match="equal micro-batches"):
        split_micro_batches(b, 3)


def test_synthetic_data():
    s = make_stream("bert", 4, 16, seed=0, synthetic=True, vocab=30522)
    b = s.batch(0)
    assert b.tokens.shape == (4, 16) and int(b.targets.max()) < 30522


# --- the single-process trainer ---------------------------------------------------------------
def test_train_step_micro_batches_match_one_batch():
    """Four micro-batches or one: the same K-FAC step (losses and parameters after 3 steps)."""
    cfg = resolve_config("bert-tiny")
    stream = make_stream("bert", 8, 16, seed=2)
    kcfg = KfacConfig(damping=1e-2, refresh_steps=2)
    params = []
    for M in (1, 4):
        model = build_model(cfg, seed=0, dtype=D64)
        layers = make_layers(kfac_linears(model), kcfg)
        opt = build_optimizer(model, layers, OptimConfig(lr=0.1, adam_lr=1e-3))
        losses = [train_step(model, layers, opt, stream.batch(t), t, M, kcfg) for t in range(3)]
        params.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert params[0][0] == pytest.approx(params[1][0], rel=1e-10)
    for p, q in zip(params[0][1], params[1][1]):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11)
    assert params[0][0][2] < params[0][0][0]  # and it learns


def test_optimizer_state_round_trips_through_weights_only_load():
    import io

    cfg = resolve_config("bert-tiny")
    stream = make_stream("bert", 4, 16, seed=0)
    kcfg = KfacConfig(damping=1e-2)

    def setup():
        model = build_model(cfg, seed=0, dtype=D64)
        layers = make_layers(kfac_linears(model), kcfg)
        return model, layers, build_optimizer(model, layers, OptimConfig(lr=0.1, adam_lr=1e-3, warmup_steps=3))

    model, layers, opt = setup()
    train_step(model, layers, opt, stream.batch(0), 0, 1, kcfg)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "kfac": [l.state_dict() for l in layers]}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2, layers2, opt2 = setup()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    for l, sd in zip(layers2, saved["kfac"]):
        l.load_state_dict(sd)
    assert opt2.sgd.state and opt2.adamw.state  # momentum and Adam moments came back
    for t in (1, 2):
        train_step(model, layers, opt, stream.batch(t), t, 1, kcfg)
        train_step(model2, layers2, opt2, stream.batch(t), t, 1, kcfg)
    for p, q in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_example_trains_both_optimizers(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_kfac", EXAMPLES / "train_kfac.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--steps", "4", "--eval-every", "2"]) == 0
    rows = [l.split() for l in capsys.readouterr().out.splitlines() if l.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["2", "4"] and all(len(r) == 5 for r in rows)
    assert all(0 < float(v) < 6 for r in rows for v in r[1:])
