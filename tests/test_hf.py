"""A Hugging Face `transformers` model as pipeline parts (`--model hf:PATH`, runtime.models.hf):
the cut against the uncut `transformers` model (loss and gradients, float64), the pipeline
(real torchrun, gloo, 1F1B, K-FAC) against the single process and against `transformers`'
first-step gradients, the saved model loaded back into `transformers`, weights read from a
model directory (tied, sharded), the profiler, and bad input as one-line errors. Skipped
without `transformers` (pip install '.[hf]')."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    MICRO,
    SEQ,
    N,
    assert_same_params,
    chained,
    cli,
    distributed_params,
    make_plan,
    one_line_error,
    run_single,
    torchrun,
)

transformers = pytest.importorskip("transformers")


from pfcompile.formats.plan import load_plan  # noqa: E402
from runtime.config import job as job_config  # noqa: E402
from runtime.io.data import make_stream  # noqa: E402
from runtime.models import ModelSpecError, build_model, kfac_linears, load_trained, resolve_model  # noqa: E402
from runtime.train import train_reference  # noqa: E402

D64 = torch.float64
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)


def write_config(folder: Path, model_type: str = "llama", **over) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({"model_type": model_type, **SMALL, **over}))
    return path


def transformers_twin(spec, model) -> torch.nn.Module:
    """The uncut `transformers` model holding the pipeline model's weights (float64)."""
    twin = transformers.AutoModelForCausalLM.from_config(spec.hf_config).to(D64)
    twin.load_state_dict(spec.hf_state_dict(model.state_dict()))
    return twin


def windows(batch) -> torch.Tensor:
    """The token windows a next-token batch was cut from: transformers' own causal-LM loss
    on them (labels = input_ids, shifted inside) is the pipeline's loss on the batch."""
    return torch.cat([batch.tokens, batch.targets[:, -1:]], dim=1)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


CUTS = [("llama", "sdpa"), ("llama", "eager"), ("mistral", "sdpa"), ("qwen2", "eager"), ("qwen3", "sdpa")]


@pytest.mark.parametrize("model_type,attn", CUTS, ids=[f"{m}-{a}" for m, a in CUTS])
def test_cut_equals_transformers(tmp_path, model_type, attn):
    """2 stages, chained by hand, against the uncut `transformers` model and its own loss."""
    spec = resolve_model(f"hf:{write_config(tmp_path, model_type, attn_implementation=attn)}")
    assert spec.hf_config._attn_implementation == attn
    assert spec.part_names == ["embed", "block0", "block1", "head"]
    batch = make_stream("gpt", 4, 16, seed=1).batch(0)
    model = build_model(spec, seed=3, dtype=D64)
    twin = transformers_twin(spec, model)
    out = twin(input_ids=windows(batch), labels=windows(batch))
    out.loss.backward()
    loss, grads = chained(spec, 2, batch, seed=3)
    assert loss == pytest.approx(float(out.loss.detach()), rel=1e-6)  # transformers' loss is in float32
    by_hf = spec.hf_state_dict(grads)
    assert set(by_hf) == {n for n, _ in twin.named_parameters()}
    for name, p in twin.named_parameters():
        assert relative_error(by_hf[name], p.grad) < 1e-5, name
    # and exactly its logits, position by position
    torch.testing.assert_close(model(batch.tokens), twin(input_ids=batch.tokens).logits, rtol=1e-12, atol=1e-12)
    layers = [n for n, _ in kfac_linears(model)]
    assert len(layers) == 14 and layers[0] == "block0.layer.self_attn.q_proj" and layers[-1] == "block1.layer.mlp.down_proj"


@pytest.mark.e2e
def test_pipeline_equals_single_process_and_transformers(tmp_path, monkeypatch):
    """2 ranks, 1F1B, K-FAC, float64, a relative hf: path (resolved from the current folder,
    where the runtime runs too). After step 1 the K-FAC layers moved by -lr x gradient (SGD,
    no inverse yet, KL clip off) and the rest by AdamW's first step: both from transformers'
    gradients. After step 3 the parameters equal the single-process trainer's. The saved
    model loads into transformers and gives the pipeline's logits."""
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path / "tiny")
    name = "hf:tiny"
    plan = make_plan(tmp_path, "1f1b", 2, name=name)
    saved = tmp_path / "saved" / "model.safetensors"
    settings = ["kfac.kl_clip=0", "optimizer.adam_weight_decay=0"]
    r = torchrun(plan, 2, "--steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1",
                 "--keep", "3", "--log-dir", str(tmp_path / "log"), "--save-model", str(saved),
                 *[a for s in settings for a in ("--set", s)])
    assert r.returncode == 0, r.stdout[-3000:]

    spec = resolve_model(name)
    cfg = job_config.load(None, settings)
    initial = build_model(spec, seed=0, dtype=D64)
    p0 = {n: t.clone() for n, t in initial.state_dict().items()}
    stream = make_stream("gpt", MICRO * N, SEQ, seed=0)
    twin = transformers_twin(spec, initial)
    out = twin(input_ids=windows(stream.batch(0)), labels=windows(stream.batch(0)))
    out.loss.backward()
    grads = spec.pipeline_state_dict({n: p.grad for n, p in twin.named_parameters()})

    step1 = json.loads((tmp_path / "log" / "metrics.jsonl").read_text().splitlines()[0])
    assert step1["step"] == 1 and step1["loss"] == pytest.approx(float(out.loss.detach()), rel=1e-6)
    got1 = distributed_params(tmp_path / "ckpt", 1, plan)
    kfac_params = {f"parts.{n}.weight" for n, _ in kfac_linears(initial)}
    o = cfg.optimizer
    for n, g in grads.items():
        moved = got1[n] - p0[n]
        if n in kfac_params:
            want = -o.lr * g
        else:  # AdamW's first update: m / (sqrt(v) + eps) with m = g, v = g^2
            want = -o.adam_lr * g / (g.abs() + 1e-8)
        assert relative_error(moved, want) < 1e-5, n
    assert len(kfac_params) == 14 and any("embed_tokens" in n for n in grads)

    plan_obj = load_plan(str(plan))
    job_config.apply_plan(cfg, plan_obj, str(plan))
    stage_of = dict(zip(plan_obj.layers, plan_obj.layer_stage))

    def per_stage(layers):
        return [g for g in ([l for l in layers if stage_of[l.name] == s] for s in range(2)) if g]
    ref, _ = train_reference(spec, cfg, stream, N, kl_groups_of=per_stage, dtype=D64, steps=3)
    got3 = distributed_params(tmp_path / "ckpt", 3, plan)
    assert_same_params(got3, ref.state_dict(), p0)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(saved.parent), dtype=D64)
    assert loaded.config.tie_word_embeddings is False
    tokens = stream.batch(5).tokens
    torch.testing.assert_close(loaded(input_ids=tokens).logits, ref(tokens), rtol=1e-9, atol=1e-9)
    back, meta = load_trained(str(saved))
    assert meta["model"] == name
    torch.testing.assert_close(back(tokens), ref(tokens), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shards", [False, True], ids=["one-file", "sharded"])
def test_weights_from_a_model_directory(tmp_path, shards):
    """hf:DIR with weights: every part reads its tensors; a tied head starts as the embedding."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("qwen2", **{**SMALL, "tie_word_embeddings": True})
    source = transformers.AutoModelForCausalLM.from_config(config)
    source.save_pretrained(str(tmp_path / "m"), max_shard_size="20KB" if shards else "1GB")
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file() == shards
    spec = resolve_model(f"hf:{tmp_path / 'm'}")
    model = build_model(spec, seed=123, dtype=D64)  # the seed is irrelevant: the weights are loaded
    head = model.parts["head"].lm_head.weight
    torch.testing.assert_close(head, source.model.embed_tokens.weight.to(D64), rtol=0, atol=0)
    tokens = make_stream("gpt", 2, 16, seed=4).batch(0).tokens
    torch.testing.assert_close(model(tokens), source.to(D64)(input_ids=tokens).logits, rtol=1e-12, atol=1e-12)


def test_random_tied_head_starts_as_the_embedding(tmp_path):
    spec = resolve_model(f"hf:{write_config(tmp_path, tie_word_embeddings=True)}")
    model = build_model(spec, seed=9)
    assert torch.equal(model.parts["head"].lm_head.weight, model.parts["embed"].embed_tokens.weight)
    assert not torch.equal(build_model(spec, seed=8).parts["embed"].embed_tokens.weight,
                           model.parts["embed"].embed_tokens.weight)


def test_profile_an_hf_config(tmp_path):
    from pfcompile.profiler import profile_model

    prof = profile_model(f"hf:{write_config(tmp_path)}", 1, 8, repeats=1, warmup=0, comm=False, entry_budget_s=0.05,
                         progress=False)
    assert [p.name for p in prof.parts] == ["embed", "block0", "block1", "head"]
    assert all(p.fwd_ms > 0 and p.bwd_ms > 0 for p in prof.parts)
    assert len(prof.layers_of("block1")) == 7 and prof.model["vocab"] == 128


@pytest.mark.e2e
def test_bad_hf_models_are_one_line_errors(tmp_path):
    cases = {"missing": (f"hf:{tmp_path / 'nope.json'}", "no such file")}
    (tmp_path / "bad.json").write_text("{not json")
    cases["bad json"] = (f"hf:{tmp_path / 'bad.json'}", "model_type")
    cases["gpt2"] = (f"hf:{write_config(tmp_path / 'g', 'gpt2')}", "'gpt2' is not one of the Llama layout")
    for what, (name, needle) in cases.items():
        with pytest.raises(ModelSpecError) as e:
            resolve_model(name)
        assert "\n" not in str(e.value) and needle in str(e.value), what
    mistral = f"hf:{write_config(tmp_path / 'w', 'mistral', sliding_window=8)}"
    with pytest.raises(ModelSpecError, match="sliding_window 8 is shorter than seq_len 16"):
        resolve_model(mistral, seq_len=16)
    # a weights folder that lacks a tensor: named when the part is built
    source = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **SMALL))
    source.save_pretrained(str(tmp_path / "m"))
    from safetensors.torch import load_file, save_file
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelSpecError, match="no tensor 'model.layers.1.mlp.up_proj.weight'"):
        build_model(resolve_model(f"hf:{tmp_path / 'm'}"))
    # through the CLI: exit status 2 and one line
    one_line_error(cli("profile", "--model", f"hf:{tmp_path / 'nope.json'}", "-o", str(tmp_path / "p.json")),
                   "--model", "no such file")


@pytest.mark.e2e
def test_runtime_rejects_model_code_and_a_missing_config(tmp_path):
    """The runtime rebuilds an hf: model from the plan's name: --model-code has nothing to
    allow, and a config gone since planning is named in one line, before any collective."""

    config = write_config(tmp_path / "tiny")
    plan = make_plan(tmp_path, "1f1b", 2, name=f"hf:{config}")
    r = run_single(str(plan), "--model-code", "my_model:build", world_size=2)
    assert r.returncode == 2 and "--model-code" in r.stderr and "a transformers config" in r.stderr, r.stderr
    config.unlink()
    r = run_single(str(plan), world_size=2)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "model.name" in lines[0] and "no such file" in lines[0], r.stderr
