#!/usr/bin/env bash
# `make demo`: the whole pfcompile story on CPU, in a few minutes on 2 cores.
#
#   1. profile bert-tiny with the runtime's own code       -> $OUT/bert-tiny.json
#   2. plan 2 stages, 1F1B, K-FAC in the bubbles (CP-SAT)  -> $OUT/plan.json
#   3. render the plan: task graph, timeline, Perfetto trace -> $OUT/plan.{svg,png,trace.json}
#   4. run the plan with torchrun on 2 ranks               -> loss, predicted vs measured step time,
#                                                             $OUT/measured.trace.json
#   5. where the time went (per op kind), calibrate the profile from the run, re-plan from
#      the calibrated profile, run again; both predictions against their measurements, the
#      calibrated profile against the run it was fitted on (the model's own error), and the
#      first plan run once more (how far two runs of one plan lie apart on this machine)
#
# Each piece says so and carries on (or stops) if a command it needs is missing.
# Env: PY (python with pfcompile installed), OUT (output folder), STEPS (training steps, 300),
# PROFILE=fresh|committed (default fresh: measure; committed: reuse profiles/bert-tiny-cpu.json),
# PROFILE_FLAGS (more flags for pfcompile profile).
set -euo pipefail
# torchrun leaves a torchelastic_* folder in TMPDIR: it gets one of ours, removed at the end
TMPDIR=$(mktemp -d -t pfcompile-XXXXXX)
export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT
PY=${PY:-python}
OUT=${OUT:-out}
# 300 steps, ~9 s a run: a shared host's slow spells last seconds, and a shorter run's mean
# step is one draw of them
STEPS=${STEPS:-300}
PROFILE=${PROFILE:-fresh}
PROFILE_FLAGS=${PROFILE_FLAGS:-}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

say() { printf '\n== %s\n' "$*"; }
has_command() { "$PY" -m pfcompile "$1" --help >/dev/null 2>&1; }
# A run's summary line, shortened: measured, predicted and their ratio, from the plan's op
# means and (where the profile has the op times' spread) with that spread.
ratios() {
  grep '^runtime: [0-9]* steps' "$1" | "$PY" -c '
import re, sys
line = sys.stdin.read()
m = re.search(r"measured ([0-9.]+ ms/step).*?predicted ([0-9.]+ ms/step), measured/predicted ([0-9.]+)", line)
e = re.search(r"spread: predicted ([0-9.]+ ms/step), measured/predicted ([0-9.]+)", line)
print(f"measured {m[1]}, predicted {m[2]}, measured/predicted {m[3]}" if m else "n/a", end="")
print(f"; with the op times spread: predicted {e[1]}, measured/predicted {e[2]}" if e else "")'
}

say "1/5 profile bert-tiny (micro-batch 8 x 64 tokens, one thread) as the plan will run: 2 ranks"
if [ "$PROFILE" = fresh ] && has_command profile; then
  # A short budget per entry keeps this under a minute; the committed profile used more.
  # --ranks 2: the ops are timed while a second process works, as the 2-rank plan runs;
  # --cold-cache: each from cold caches, as in a run where other ops ran in between; the
  # profile ends with a short run of the runtime itself (its costs around the ops).
  "$PY" -m pfcompile profile --model bert-tiny --repeats 10 --warmup 3 --entry-budget 0.5 \
        --ranks 2 --cold-cache $PROFILE_FLAGS -o "$OUT/bert-tiny.json" --quiet \
    || { echo "profiling failed; using the committed profile"; cp profiles/bert-tiny-cpu.json "$OUT/bert-tiny.json"; }
else
  [ "$PROFILE" = fresh ] && echo "pfcompile profile is not available; using the committed profile"
  cp profiles/bert-tiny-cpu.json "$OUT/bert-tiny.json"
fi
"$PY" -m pfcompile inspect "$OUT/bert-tiny.json" 2>/dev/null | head -n 20 || true

say "2/5 plan: 2 stages, 1F1B, 4 micro-batches, K-FAC placed by CP-SAT"
if ! has_command plan; then
  echo "pfcompile plan is not available yet: stopping here (profile is in $OUT)"; exit 0
fi
"$PY" -m pfcompile plan "$OUT/bert-tiny.json" --schedule 1f1b --stages 2 --micro-batches 4 \
      --method cpsat --time-limit 10 --workers 2 -o "$OUT/plan.json"

say "3/5 render: graph, timeline, trace"
if has_command render; then
  if command -v dot >/dev/null 2>&1; then graph=(--graph "$OUT/plan.svg"); else
    graph=(); echo "graphviz's dot is missing: no graph picture"; fi
  "$PY" -m pfcompile render "$OUT/plan.json" "${graph[@]}" --timeline "$OUT/plan.png" \
        --trace "$OUT/plan.trace.json" \
    || echo "render failed (see above); carrying on with the run"
else
  echo "pfcompile render is not available yet: skipping pictures"
fi

say "4/5 run the plan: torchrun --nproc-per-node 2 -m runtime ($STEPS steps, pydoc MLM)"
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m runtime "$OUT/plan.json" \
      --steps "$STEPS" --trace "$OUT/measured.trace.json" --log-dir "$OUT/run1" 2>&1 | grep -v '^W[0-9]' | tee "$OUT/run1.txt" || exit 1

say "5/5 where the time went, then calibrate the profile from this run, re-plan and run again"
"$PY" -m pfcompile inspect "$OUT/measured.trace.json" --against "$OUT/plan.json" --profile "$OUT/bert-tiny.json"
"$PY" -m pfcompile calibrate "$OUT/bert-tiny.json" "$OUT/measured.trace.json" -o "$OUT/bert-tiny.calibrated.json" \
  2> "$OUT/calibrate.txt" || { cat "$OUT/calibrate.txt" >&2; exit 1; }
cat "$OUT/calibrate.txt" >&2
"$PY" -m pfcompile plan "$OUT/bert-tiny.calibrated.json" --schedule 1f1b --stages 2 --micro-batches 4 \
      --method cpsat --time-limit 10 --workers 2 -o "$OUT/plan.calibrated.json" > /dev/null
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m runtime \
      "$OUT/plan.calibrated.json" --steps "$STEPS" --seed 1 --trace "$OUT/measured.calibrated.trace.json" \
      --log-dir "$OUT/run2" 2>&1 \
  | grep -v '^W[0-9]' | tee "$OUT/run2.txt" > /dev/null || exit 1
# The first plan once more, as a yardstick: how far two runs of one plan lie apart here.
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m runtime \
      "$OUT/plan.json" --steps "$STEPS" --seed 1 --log-dir "$OUT/run3" 2>&1 | grep -v '^W[0-9]' > "$OUT/run3.txt" || exit 1
echo "the second run, replayed with its own op times:"
"$PY" -m pfcompile inspect "$OUT/measured.calibrated.trace.json" --against "$OUT/plan.calibrated.json" \
      --profile "$OUT/bert-tiny.calibrated.json" | sed -n '/replayed with/,$p' | tail -n +2
echo "before calibration: $(ratios "$OUT/run1.txt")"
echo "after calibration:  $(ratios "$OUT/run2.txt")  (a second run, seed 1)"
# The model's own error: the calibrated profile against the run it was fitted on. The
# second run's error beyond it is how that run differs from the first: the first plan run
# again shows how far two runs of one plan lie apart on this machine.
echo "the calibrated profile against the first run (the one it was fitted on): $(grep -o 'measured [0-9.]* ms/step, predicted.*' "$OUT/calibrate.txt" || echo n/a)"
measured() { grep -o 'measured [0-9.]* ms/step' "$1" | head -n 1 | grep -o '[0-9.]*' || true; }
a=$(measured "$OUT/run1.txt"); b=$(measured "$OUT/run3.txt")
[ -n "$a" ] && [ -n "$b" ] && echo "the first plan run again (seed 1): measured $b ms/step, $("$PY" -c "print(f'{$b / $a:.3f}')") x the first run's (this machine's run-to-run variation)"

say "outputs in $OUT"
ls -1 "$OUT"
echo "Open $OUT/plan.trace.json and $OUT/measured.trace.json in https://ui.perfetto.dev to compare."
