#!/usr/bin/env bash
# The prepared GPU check (issue 13): run it on a machine with one GPU, under 8 minutes.
#
#   benchmarks/gpu_check.sh                 # cuda:0: bert-base and bert-large
#   benchmarks/gpu_check.sh --device cpu    # the same steps on the CPU with bert-tiny (the test suite runs this)
#
# 1. profile bert-base and bert-large on the device (CUDA-event timing), written to
#    $OUT/profiles/<model>-<device>.json, ready to commit to profiles/;
# 2. plan 1 stage with K-FAC from the first profile and run it with the runtime on the device
#    (NCCL on CUDA, gloo on CPU; CUDA-event op timing; measured vs predicted peak memory);
# 3. run the single-process trainer on the device and compare K-FAC factors and the
#    preconditioned gradient with the CPU float64 ones (benchmarks/gpu_check.py): a table.
# Environment: PYTHON (default python3), OUT (default out/gpu-check).
set -euo pipefail
# torchrun leaves a torchelastic_* folder in TMPDIR: it gets one of ours, removed at the end
TMPDIR=$(mktemp -d -t pfcompile-XXXXXX)
export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT
cd "$(dirname "$0")/.."

DEVICE=cuda
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --device=*) DEVICE="${1#--device=}"; shift ;;
    *) echo "gpu_check.sh: error: unknown argument $1 (use --device cpu|cuda)" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-python3}"
OUT="${OUT:-out/gpu-check}"
mkdir -p "$OUT/profiles"

case "$DEVICE" in
  cuda|cuda:0)
    DEV=cuda:0; KIND=cuda
    MODELS="bert-base bert-large"; MB=8; SEQ=128
    PROFILE_FLAGS="--repeats 10 --warmup 3 --entry-budget 0.5"
    CHECK_MODEL=bert-base; CHECK_FLAGS="--micro-batch 8 --seq-len 128" ;;
  cpu)
    DEV=cpu; KIND=cpu
    MODELS="bert-tiny"; MB=2; SEQ=16
    PROFILE_FLAGS="--repeats 3 --warmup 1 --entry-budget 0.2 --no-comm"
    CHECK_MODEL=bert-tiny; CHECK_FLAGS="--micro-batch 2 --seq-len 16" ;;
  *) echo "gpu_check.sh: error: --device $DEVICE: use cpu or cuda" >&2; exit 2 ;;
esac

start=$(date +%s)
echo "== gpu_check on $DEV ($($PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'))"
uptime || true

echo "== 1. profiles ($MODELS; micro-batch $MB, seq-len $SEQ)"
for m in $MODELS; do
  t0=$(date +%s)
  $PY -m pfcompile profile --model "$m" --device "$DEV" --micro-batch "$MB" --seq-len "$SEQ" $PROFILE_FLAGS \
      --quiet -o "$OUT/profiles/$m-$KIND.json" > "$OUT/$m-$KIND.profile.txt"
  echo "$m: $OUT/profiles/$m-$KIND.json ($(( $(date +%s) - t0 )) s); clock: $($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['provenance']['clock'])" "$OUT/profiles/$m-$KIND.json")"
done

FIRST=${MODELS%% *}
echo "== 2. a 1-stage K-FAC plan of $FIRST, run by the runtime on $KIND"
$PY -m pfcompile plan "$OUT/profiles/$FIRST-$KIND.json" --schedule gpipe --stages 1 --micro-batches 4 \
    --method greedy -o "$OUT/plan-1stage.json" > /dev/null
$PY -m torch.distributed.run --standalone --nproc-per-node 1 -m runtime "$OUT/plan-1stage.json" \
    --device "$KIND" --data synthetic --steps 6 --trace "$OUT/measured-1stage.trace.json" --log-dir "$OUT/run-1stage" \
    | tail -4

echo "== 3. single-process trainer and K-FAC on $DEV vs CPU float64 ($CHECK_MODEL)"
$PY benchmarks/gpu_check.py --device "$DEV" --model "$CHECK_MODEL" $CHECK_FLAGS
if [ "$KIND" = cuda ]; then
  $PY benchmarks/gpu_check.py --device "$DEV" --model "$CHECK_MODEL" $CHECK_FLAGS --dtype bfloat16 --show 3
fi
echo "== done in $(( $(date +%s) - start )) s"
