#!/usr/bin/env bash
# Session 39 call 3 (export NANOQWEN_COMMIT END; carry .whl; kind nvidia-h200): the submitted
# tree's figures on an H200, the card issues 12-14 name: the presets (issue 12's table), t(k)
# at 7B (issue 13 item 3: t(8) <= 1.3x), 7B decode at depth 8192 (issue 14's row), as the
# call's time allows. No product change: tests/gpu ran on this tree in call 2 (an H100).
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for m in 7b 0.5b 1.5b 3b 14b 32b; do [ $(left) -gt 25 ] || break; t "bench $m"
  bj "presets_${m}_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph; done
if [ $(left) -gt 25 ]; then t "bench_verify 7b"
timeout $(( $(left) - 5 )) python3 benchmarks/bench_verify.py --preset 7b --reps 10 \
  --json "$R/bench_verify_7b_$C.json" 2>&1 | grep -vE "^(qkv|o |gate|down|lm_head|op |GEMV)" | head -24; fi
[ $(left) -gt 25 ] && { t "7b depth 8192"; bj "depth_7b_d8192_$C" --synthetic 7b -p 512 -n 64 -r 3 -d 8192 --mode graph; }
t done
} 2>&1 | tee "$OUT/s39c3_$C.log"
tar -C "$R" -czf "$OUT/s39c3_$C.tgz" .
