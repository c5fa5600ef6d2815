#!/usr/bin/env bash
# Decoder LLMs on the CPU (2 ranks): the built-in Llama-style model, then a Hugging Face
# `transformers` config, each profiled, planned (2 stages of 1F1B, K-FAC in the bubbles) and
# trained on the pydoc corpus.
#
#   1. llama-tiny: profile, plan, train                 $OUT/llama-tiny.json, $OUT/llama-plan.json, $OUT/llama-run/
#   2. hf:examples/tiny-llama (a config.json folder):   $OUT/hf.json, $OUT/hf-plan.json, $OUT/hf-run/,
#      profile, plan, train, save                       $OUT/hf-model/{model.safetensors,config.json}
#   3. the saved model in `transformers` (from_pretrained) and in runtime.evaluate
#
# llama-tiny/llama-mini train here; llama-1b and llama-8b (Llama-3.2-1B, Llama-3-8B shapes)
# are for profiling on a GPU. hf:PATH is a config.json (random weights) or a folder with
# config.json and safetensors weights, of the Llama layout (llama, mistral, qwen2, qwen3);
# a relative PATH is resolved from the current folder by every command (run them from one
# folder). It is data, not code: the runtime needs no --model-code. Steps 2-3 need
# `transformers` (pip install '.[hf]'; make setup installs it) and are skipped without it.
#
# Usage: bash examples/llama.sh
# Env: PY (python with pfcompile installed), OUT (default out/llama), STEPS (default 40)
set -euo pipefail
# torchrun leaves a torchelastic_* folder in TMPDIR: it gets one of ours, removed at the end
TMPDIR=$(mktemp -d -t pfcompile-XXXXXX)
export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-out/llama}
STEPS=${STEPS:-40}
mkdir -p "$OUT"
say() { printf '\n== %s\n' "$*"; }
profile() { "$PY" -m pfcompile profile --model "$1" --micro-batch 4 --seq-len 64 --repeats 5 --warmup 2 \
                  --entry-budget 0.5 --clock thread -o "$2" --quiet | tail -n 1; }
plan() { "$PY" -m pfcompile plan "$1" --schedule 1f1b --stages 2 --micro-batches 4 --time-limit 10 --workers 2 \
               -o "$2" | grep -E "^plan:|^  step_time_ms "; }
train() { OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m runtime "$1" \
                --steps "$STEPS" --log-dir "${@:2}" 2>&1 | grep -v '^W[0-9]' | grep -E '^runtime: (eval|[0-9]+ steps)'; }

say "1/3 llama-tiny: RMSNorm, rotary, SwiGLU, grouped-query attention (2 layers, hidden 64)"
profile llama-tiny "$OUT/llama-tiny.json"
plan "$OUT/llama-tiny.json" "$OUT/llama-plan.json"
train "$OUT/llama-plan.json" "$OUT/llama-run"

if ! "$PY" -c "import transformers" 2>/dev/null; then
  say "transformers is not installed (pip install '.[hf]'): skipping the hf: model"; exit 0
fi
say "2/3 hf:examples/tiny-llama: a transformers LlamaForCausalLM cut into embed, decoder layers, norm + head"
profile hf:examples/tiny-llama "$OUT/hf.json"
plan "$OUT/hf.json" "$OUT/hf-plan.json"
train "$OUT/hf-plan.json" "$OUT/hf-run" --save-model "$OUT/hf-model/model.safetensors"

say "3/3 the saved model back in transformers, and evaluated in one process"
HF_HUB_OFFLINE=1 "$PY" - "$OUT/hf-model" <<'PYTHON'
import sys
import torch
from transformers import AutoModelForCausalLM
from runtime.models import load_trained
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
ours, _ = load_trained(f"{sys.argv[1]}/model.safetensors")
tokens = torch.randint(4, 100, (2, 32))
with torch.no_grad():
    diff = (model(input_ids=tokens).logits - ours(tokens)).abs().max().item()
print(f"{type(model).__name__} from {sys.argv[1]}: {sum(p.numel() for p in model.parameters())} parameters, "
      f"logits equal the pipeline model's (max difference {diff:.1e})")
PYTHON
"$PY" -m runtime.evaluate "$OUT/hf-model/model.safetensors" --data pydoc
