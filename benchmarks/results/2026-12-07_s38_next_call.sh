#!/usr/bin/env bash
# Ready for session 39 (carry .whl; any one-GPU kind): session 38's measured product changes,
# which no tests/gpu run covered (no machine started for call 2), applied first
# (attempts/session38-measured.patch: CudaBackend.spec_auto = "ngram", spec_draft as the
# speculative graph's own halt gate, attention's min_pps default 2 -> 8), then tests/gpu on that
# tree, then t(k) at 7B, the speculative turn's cost, the presets and the family rows (measured
# only) as session 38's call 2 would have run them. If tests/gpu passes: `git apply` the patch
# and commit it as the tested tree (the rows need their own tests/gpu run to land).
patch -p1 -s < benchmarks/attempts/session38-measured.patch || { echo "the patch does not apply"; exit 1; }
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "tests/gpu, 4 workers (HEAD + session38-measured.patch)"
timeout 240 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -n 4 \
  --dist loadfile 2>&1 | tail -8
t "bench_verify 7b (t(k) at min_pps 8)"
timeout 100 python3 benchmarks/bench_verify.py --preset 7b --reps 10 \
  --json "$R/bench_verify_7b_$C.json" 2>&1 | grep -vE "^(qkv|o |gate|down|lm_head|op |GEMV)" | head -24
t "bench_verify 7b at min_pps 2 (t(k) before the change, same machine)"
NANOQWEN_ATTN_MIN_PPS=2 timeout 100 python3 benchmarks/bench_verify.py --preset 7b --reps 10 \
  --json "$R/bench_verify_7b_pps2_$C.json" 2>&1 | grep -vE "^(qkv|o |gate|down|lm_head|op |GEMV)" | head -24
t "bench_spec_device 7b"
timeout 60 python3 benchmarks/bench_spec_device.py --synthetic 7b --reps 3 -n 128 \
  --json "$R/bench_spec_device_7b_$C.json" 2>&1 | tail -7
P="0.5b 1.5b 3b 7b 14b 32b"
for m in $P; do [ $(left) -gt 150 ] || break; t "bench $m (A: the product)"
  bj "rows_${m}_A_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph; done
if [ $(left) -gt 130 ]; then
  patch -p1 -s < benchmarks/attempts/gemv-family-rows.patch && build
  for m in 3b 14b 32b 0.5b 1.5b; do [ $(left) -gt 40 ] || break; t "bench $m (B: + the rows)"
    bj "rows_${m}_B_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph; done
  if [ $(left) -gt 40 ]; then t "GEMV tests with the rows"
    timeout $(( $(left) - 10 )) python3 -m pytest tests/gpu/test_gemv.py -q --tb=short \
      -p no:cacheprovider -n 4 2>&1 | tail -3; fi
fi
for m in 0.5b 7b; do for d in 0 2048; do
  [ $(left) -gt 20 ] || break 2
  t "$m min_pps 16 depth $d (against 8, the new default: the presets above and call 1)"
  NANOQWEN_ATTN_MIN_PPS=16 bj "pps_${m}_16_d${d}_$C" --synthetic $m -p 512 -n 128 -r 5 -d $d --mode graph
done; done
t "done"
} 2>&1 | tee "$OUT/s39c1_$C.log"
tar -C "$R" -czf "$OUT/s39c1_$C.tgz" .
