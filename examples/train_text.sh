#!/usr/bin/env bash
# Train on your own text, end to end on CPU (2 ranks):
#
#   1. prepare_data: text -> token files          $OUT/train.bin, $OUT/train.val.bin (+ .json sidecars)
#   2. profile bert-tiny on this machine          $OUT/tiny.json
#   3. plan 2 stages of 1F1B with K-FAC           $OUT/plan.json
#   4. train with examples/train.toml             $OUT/run/{metrics.jsonl,train.toml}, $OUT/model.safetensors
#   5. evaluate the saved model in one process    loss and perplexity on the held-out file
#
# Usage: bash examples/train_text.sh [TEXT_FILE]   (default: the GPL-3 text Debian ships)
# Env: PY (python with pfcompile installed), OUT (default out/text), STEPS (default: the config's 200)
set -euo pipefail
# torchrun leaves a torchelastic_* folder in TMPDIR: it gets one of ours, removed at the end
TMPDIR=$(mktemp -d -t pfcompile-XXXXXX)
export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-out/text}
TEXT=${1:-/usr/share/common-licenses/GPL-3}
steps=(); [ -n "${STEPS:-}" ] && steps=(--steps "$STEPS")
mkdir -p "$OUT"
say() { printf '\n== %s\n' "$*"; }

say "1/5 prepare_data $TEXT (character level, 5% held out)"
"$PY" -m runtime.prepare_data "$TEXT" -o "$OUT/train.bin" --val-fraction 0.05

say "2/5 profile bert-tiny (micro-batch 4 x 64 characters)"
"$PY" -m pfcompile profile --model bert-tiny --micro-batch 4 --seq-len 64 --repeats 5 --warmup 2 \
      --entry-budget 0.5 --clock thread -o "$OUT/tiny.json" --quiet

say "3/5 plan: 2 stages, 1F1B, 4 micro-batches, K-FAC placed by CP-SAT"
"$PY" -m pfcompile plan "$OUT/tiny.json" --schedule 1f1b --stages 2 --micro-batches 4 \
      --time-limit 10 --workers 2 -o "$OUT/plan.json"

say "4/5 train with examples/train.toml"
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m runtime "$OUT/plan.json" \
      --config examples/train.toml "${steps[@]}" --data "$OUT/train.bin" --val-data "$OUT/train.val.bin" \
      --log-dir "$OUT/run" --save-model "$OUT/model.safetensors" 2>&1 | grep -v '^W[0-9]'
head -n 3 "$OUT/run/metrics.jsonl"

say "5/5 evaluate the saved model in one process"
"$PY" -m runtime.evaluate "$OUT/model.safetensors" --data "$OUT/train.val.bin"
