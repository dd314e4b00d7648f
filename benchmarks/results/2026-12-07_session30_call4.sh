#!/usr/bin/env bash
# session 30 call 4: tests/gpu/test_sanitizer.py (attention + the new gemv_fp16 rows cases) on the final tree
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
{
. benchmarks/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t "tests/gpu/test_sanitizer.py"; timeout 400 python3 -m pytest tests/gpu/test_sanitizer.py -q -rA --tb=short -p no:cacheprovider 2>&1 | grep -E "passed|failed|error|SUMMARY|columns equal .* False" | tail -20
t done
} 2>&1 | tee "$OUT/call4.log"
