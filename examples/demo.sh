#!/usr/bin/env bash
# The main job on a small CPU default. Grows with the project: see README.
set -euo pipefail
PY=${PY:-python}
OUT=${OUT:-out}
mkdir -p "$OUT"
$PY examples/train_kfac.py --steps 200
