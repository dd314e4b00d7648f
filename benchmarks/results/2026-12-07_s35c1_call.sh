#!/usr/bin/env bash
# Session 35 call 1 (asks for an H200: issue 12 item 2 and issue 13 item 3 name it; carry
# .whl): (1) issue 12's table with the folded norms, every preset (verify_presets_gpu.sh);
# (2) t(k) at 7B against the (faster) decode step; (3) decode attention's split sizing at the
# 0.5B's and the 7B's shapes (attention is 28% of the 0.5B step now: bench_step, session 34),
# num_splits as the engine sizes them with the TMA kernel (66 at the 0.5B's 2 kv heads, 33 at
# the 7B's 4), min_pps 1..32, contexts 512 and 2048; then (4) the 0.5B preset end to end at the
# sweep's best min_pps against the default (NANOQWEN_ATTN_MIN_PPS; no code change); (5) the
# one-split patch's tests and sweep. Added before it ran: lab/gemv_int4_family.py after (2).
source benchmarks/device_prelude.sh
{
TESTS=0 PRESETS="0.5b 1.5b 3b 7b 14b 32b" bash benchmarks/verify_presets_gpu.sh 2>&1 | tail -12
export PYTHONPATH=/tmp/site; mkdir -p "$R"   # verify_presets_gpu.sh tarred and removed $R
t "bench_verify 7b"
timeout 150 python3 benchmarks/bench_verify.py --preset 7b --reps 10 --json "$R/bench_verify_7b.json" \
  2>&1 | grep -E "decode step|^ ?[1-8] |^16 " | head -10
t "lab/gemv_int4_family.py (the INT4 GEMV instances at every preset's shapes)"
timeout 200 python3 benchmarks/lab/gemv_int4_family.py --json "$R/gemv_int4_family.json" 2>&1 | tail -30
t "bench_attention, 0.5B shapes"
timeout 120 python3 benchmarks/bench_attention.py --heads 14 --kv-heads 2 --head-dim 64 --layers 24 \
  --contexts 512,2048 --sweep 66:1:1,66:2:1,66:4:1,66:8:1,66:16:1,66:32:1 \
  --json "$R/attn_0.5b_pps.json" 2>&1 | tail -16
t "bench_attention, 7B shapes"
timeout 120 python3 benchmarks/bench_attention.py --contexts 512,2048 \
  --sweep 33:1:1,33:2:1,33:4:1,33:8:1,33:16:1 --json "$R/attn_7b_pps.json" 2>&1 | tail -14
for p in 2 4 8 16 2; do
  t "0.5b min_pps $p"
  NANOQWEN_ATTN_MIN_PPS=$p bj pps_0.5b_${p}_$(date +%s) --synthetic 0.5b -p 512 -n 128 -r 5 --mode graph
done
# (5) attempts/attn-one-split.patch (a kv head with one active split writes out itself, no ws
# round trip; bit for bit the merge's result): its tests, then the 0.5B sweep again
patch -p1 -s < benchmarks/attempts/attn-one-split.patch && t "build (one-split patch)" && timeout 200 python3 -c "
from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -3
t "test_attention_fused.py + test_verify.py (patch)"
timeout 200 python3 -m pytest tests/gpu/test_attention_fused.py tests/gpu/test_verify.py -q --tb=short -p no:cacheprovider 2>&1 | tail -5
t "bench_attention, 0.5B shapes (patch)"
timeout 120 python3 benchmarks/bench_attention.py --heads 14 --kv-heads 2 --head-dim 64 --layers 24 \
  --contexts 512,2048 --sweep 66:2:1,66:8:1,66:16:1,66:32:1,66:128:1 \
  --json "$R/attn_0.5b_pps_one-split.json" 2>&1 | tail -12
patch -R -p1 -s < benchmarks/attempts/attn-one-split.patch
t "done"
} 2>&1 | tee "$OUT/next_$C.log"
tar -C "$R" -czf "$OUT/next_$C.tgz" . && rm -rf "$R"
