#!/usr/bin/env bash
# Session 39 call 2 (export NANOQWEN_COMMIT; carry .whl): tests/gpu on the tree as submitted
# (session 38's measured changes + the family rows), then that tree's figures: the presets
# (issue 12's table), t(k) at 7B (issue 13 item 3), 7B decode at depth 2048 and prefill
# without the resident copy (issue 14's rows), as time allows.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "tests/gpu, 4 workers (the submitted tree)"
timeout 300 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -n 4 --dist loadfile 2>&1 | tail -8
for m in 0.5b 1.5b 3b 7b 14b 32b; do [ $(left) -gt 30 ] || break; t "bench $m"
  bj "presets_${m}_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph; done
if [ $(left) -gt 40 ]; then t "bench_verify 7b"
timeout $(( $(left) - 10 )) python3 benchmarks/bench_verify.py --preset 7b --reps 10 \
  --json "$R/bench_verify_7b_$C.json" 2>&1 | grep -vE "^(qkv|o |gate|down|lm_head|op |GEMV)" | head -24; fi
[ $(left) -gt 30 ] && { t "7b depth 2048"; bj "depth_7b_d2048_$C" --synthetic 7b -p 512 -n 128 -r 5 -d 2048 --mode graph; }
[ $(left) -gt 30 ] && { t "7b prefill, dequant"; bj "dequant_7b_$C" --synthetic 7b -p 512 -n 16 -r 5 --mode graph --prefill-weights dequant; }
t done
} 2>&1 | tee "$OUT/s39c2_$C.log"
tar -C "$R" -czf "$OUT/s39c2_$C.tgz" .
