"""The Llama-style built-in family: its shapes, its parts against an independent computation
(transformers' Llama, where installed), K-FAC's coverage, and the pipeline against the
single process (real torchrun, gloo, float64)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_params, chained, distributed_params, make_plan, reference_params, torchrun

from runtime.io.data import make_stream
from runtime.models import MODEL_CONFIGS, build_model, build_part, kfac_linears, resolve_config, resolve_model
from runtime.optimizers.kfac import KfacConfig, make_layers
from runtime.optimizers.stage import OptimConfig, build_optimizer
from runtime.train import train_step

D64 = torch.float64


def param_count(c) -> int:
    """Parameters of a Llama config by formula: untied embedding and head, per block four
    attention projections (k, v of kv_heads heads), three SwiGLU matrices and two norms."""
    head_dim = c.hidden // c.heads
    kv = (c.kv_heads or c.heads) * head_dim
    block = 2 * c.hidden * c.hidden + 2 * c.hidden * kv + 3 * c.hidden * c.ffn + 2 * c.hidden
    return 2 * c.vocab * c.hidden + c.layers * block + c.hidden


def test_sizes_and_published_shapes():
    shapes = {name: (c.layers, c.hidden, c.heads, c.kv_heads, c.ffn, c.vocab)
              for name, c in MODEL_CONFIGS.items() if name.startswith("llama-")}
    assert shapes == {"llama-tiny": (2, 64, 4, 2, 176, 100), "llama-mini": (4, 256, 8, 2, 688, 100),
                      "llama-small": (8, 512, 8, 2, 1376, 32000),
                      "llama-1b": (16, 2048, 32, 8, 8192, 128256), "llama-8b": (32, 4096, 32, 8, 14336, 128256)}
    assert all(c.kind == "gpt" and c.arch == "llama" for n, c in MODEL_CONFIGS.items() if n.startswith("llama-"))
    # the formula is the built model's count ...
    for name in ("llama-tiny", "llama-mini", "llama-small"):
        assert sum(p.numel() for p in build_model(name).parameters()) == param_count(MODEL_CONFIGS[name])
    # ... and gives Llama-3-8B's 8.03 B, and Llama-3.2-1B's 1.24 B plus an untied head of 0.26 B
    assert round(param_count(MODEL_CONFIGS["llama-8b"]) / 1e9, 2) == 8.03
    assert round((param_count(MODEL_CONFIGS["llama-1b"]) - 128256 * 2048) / 1e9, 2) == 1.24


def test_block_is_causal_with_grouped_query_attention():
    cfg = resolve_config("llama-tiny")
    block = build_part(cfg, "block0", 0, D64)
    assert block.attn.k.weight.shape == (2 * 16, 64) and block.attn.q.weight.shape == (64, 64)
    assert all(m.bias is None for m in block.modules() if isinstance(m, torch.nn.Linear))
    embed = build_part(cfg, "embed", 0, D64)
    t = torch.arange(10, 22)[None]
    t2 = t.clone()
    t2[0, -1] = 50  # change only the last token
    h, h2 = block(embed(t)), block(embed(t2))
    assert torch.allclose(h[0, :-1], h2[0, :-1]) and not torch.allclose(h[0, -1], h2[0, -1])
    # rotary positions: without them the last position would see only the set of earlier
    # tokens, not their order
    swapped = t.clone()
    swapped[0, [0, 1]] = t[0, [1, 0]]
    assert not torch.allclose(block(embed(t))[0, -1], block(embed(swapped))[0, -1])


def test_cut_into_1_2_3_stages_matches_uncut_model():
    spec = resolve_model("llama-tiny")
    batch = make_stream("gpt", 4, 16, seed=1).batch(0)
    whole = build_model(spec, seed=5, dtype=D64)
    loss = whole(batch.tokens, batch.targets)
    loss.backward()
    ref = {n: p.grad for n, p in whole.named_parameters()}
    for stages in (1, 2, 3):
        l, grads = chained(spec, stages, batch, seed=5)
        assert l == pytest.approx(float(loss.detach()), rel=1e-12)
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], rtol=1e-10, atol=1e-13)


def test_matches_transformers_llama():
    """An independent implementation: transformers' LlamaForCausalLM given the same weights
    (its RMSNorm normalises in float32, hence the tolerance)."""
    transformers = pytest.importorskip("transformers")
    c = resolve_config("llama-tiny")
    hf_cfg = transformers.LlamaConfig(vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.ffn,
                                      num_hidden_layers=c.layers, num_attention_heads=c.heads,
                                      num_key_value_heads=c.kv_heads, rms_norm_eps=c.norm_eps,
                                      max_position_embeddings=c.max_seq_len, tie_word_embeddings=False,
                                      rope_theta=c.rope_theta)
    hf = transformers.LlamaForCausalLM(hf_cfg).to(D64)
    ours = build_model(c, seed=2, dtype=D64)
    names = {"tok": "embed_tokens", "norm1": "input_layernorm", "norm2": "post_attention_layernorm",
             "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
             "attn.out": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
             "mlp.down": "mlp.down_proj"}
    state = {}
    for name, t in ours.state_dict().items():
        part, _, local = name.removeprefix("parts.").partition(".")
        local = local.removesuffix(".weight")
        if part == "embed":
            state[f"model.{names[local]}.weight"] = t
        elif part == "head":
            state["lm_head.weight" if local == "proj" else "model.norm.weight"] = t
        else:
            state[f"model.layers.{part[5:]}.{names[local]}.weight"] = t
    hf.load_state_dict(state)
    tokens = make_stream("gpt", 2, 24, seed=3).batch(0).tokens
    torch.testing.assert_close(ours(tokens), hf(input_ids=tokens).logits, rtol=1e-5, atol=1e-6)


def test_kfac_covers_every_block_linear_and_trains():
    model = build_model("llama-tiny", seed=0)
    names = [n for n, _ in kfac_linears(model)]
    per_block = ["attn.q", "attn.k", "attn.v", "attn.out", "mlp.gate", "mlp.up", "mlp.down"]
    assert names == [f"block{b}.{p}" for b in range(2) for p in per_block]
    block_linears = {id(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".block" in f".{n}"}
    assert {id(m) for _, m in kfac_linears(model)} == block_linears
    kcfg = KfacConfig(damping=1e-3)
    layers = make_layers(kfac_linears(model), kcfg, 2)
    opt = build_optimizer(model, layers, OptimConfig(lr=0.05))
    stream = make_stream("gpt", 16, 32, seed=0)
    losses = [train_step(model, layers, opt, stream.batch(t), t, 2, kcfg) for t in range(12)]
    assert all(l.factors for l in layers)  # every layer's curvature was computed and inverted
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


@pytest.mark.e2e
def test_pipeline_matches_single_process(tmp_path):
    """2 ranks, 1F1B, K-FAC (refresh every 2 steps), float64: the pipeline's parameters after
    3 steps equal the single-process trainer's."""
    plan = make_plan(tmp_path, "1f1b", 2, name="llama-tiny")
    r = torchrun(plan, 2, "--steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3")
    assert r.returncode == 0, r.stdout[-3000:]
    initial, want = reference_params(plan, 3)
    assert any(".mlp.gate." in n for n in want)
    assert_same_params(distributed_params(tmp_path / "ckpt", 3, plan), want, initial)
