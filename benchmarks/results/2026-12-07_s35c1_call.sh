#!/usr/bin/env bash
# Session 35 call 1 (asks for an H200: issue 12 item 2 and issue 13 item 3 name it; carry .whl).
# Session 34's ready call (2026-12-07_s34_next_call.sh) reordered to fit one call, the
# device being scarce (eight refused starts before this; the csrc change of f2100cb was backed
# out, so the product is the one tests/gpu passed on in session 34 and no tests run here):
# (1) issue 12's table with the folded norms, every
# preset, (2) lab/gemv_int4_family.py (the INT4 decode GEMV's instances at every preset's shapes),
# (3) decode attention's split sizing at the 0.5B's and the 7B's shapes (min_pps 1..32, contexts
# 512 and 2048), (4) the 0.5B preset end to end at min_pps 2/4/8/16/2 (NANOQWEN_ATTN_MIN_PPS),
# (5) bench_verify 7B, (6) the one-split patch's test and sweep, as far as time allows.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for m in 0.5b 1.5b 3b 7b 14b 32b; do
  t "bench $m"
  bj "bench_${m}_p512_n128_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph
done
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
t "bench_verify 7b"
timeout 150 python3 benchmarks/bench_verify.py --preset 7b --reps 10 --json "$R/bench_verify_7b.json" \
  2>&1 | grep -E "decode step|^ ?[1-8] |^16 " | head -10
t "one-split patch: build, test_attention_fused, the 0.5B sweep (as far as time allows)"
patch -p1 -s < benchmarks/attempts/attn-one-split.patch && timeout 200 python3 -c "
from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -1
timeout 120 python3 -m pytest tests/gpu/test_attention_fused.py -q --tb=short -p no:cacheprovider 2>&1 | tail -3
timeout 100 python3 benchmarks/bench_attention.py --heads 14 --kv-heads 2 --head-dim 64 --layers 24 \
  --contexts 512,2048 --sweep 66:2:1,66:8:1,66:16:1,66:32:1,66:128:1 \
  --json "$R/attn_0.5b_pps_one-split.json" 2>&1 | tail -12
patch -R -p1 -s < benchmarks/attempts/attn-one-split.patch
t "done"
} 2>&1 | tee "$OUT/call1_$C.log"
tar -C "$R" -czf "$OUT/call1_$C.tgz" . && rm -rf "$R"
