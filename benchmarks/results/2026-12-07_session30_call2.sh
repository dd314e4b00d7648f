#!/usr/bin/env bash
# session 30 call 2: lm_head_cols lab sweep (x hoisted / exact-NC variants)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
{
. benchmarks/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t "lab lm_head_cols"; timeout 300 python3 benchmarks/lab/lm_head_cols.py --json "$OUT/lab_lm_head_cols2.json" 2>&1 | grep -v "^ptxas" | tail -24
t done
} 2>&1 | tee "$OUT/call2.log"
