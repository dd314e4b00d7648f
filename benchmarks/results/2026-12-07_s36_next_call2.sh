#!/usr/bin/env bash
# Ready for session 37, second (carry .whl; any one-GPU kind; no build change): decode
# attention's split sizing per preset. Session 36 measured the 0.5B's shapes (4 pages a split
# best at 512, 8 at 2048; the product's min_pps is 2 everywhere, chosen at the 7B); this adds the
# 7B's and the 1.5B's sweeps and the presets end to end at min_pps 2 / 4 / 8 / 2 (the switch
# NANOQWEN_ATTN_MIN_PPS, read when the backend is built), at depth 0 and 2048 (-d), so that a
# per-preset (or per-context) rule can be chosen from figures, not guessed.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "bench_attention, 7B shapes"
timeout 120 python3 benchmarks/bench_attention.py --contexts 512,2048,8192 \
  --sweep 33:1:1,33:2:1,33:4:1,33:8:1,33:16:1 --json "$R/attn_7b_pps.json" 2>&1 | tail -18
t "bench_attention, 1.5B shapes"
timeout 120 python3 benchmarks/bench_attention.py --heads 12 --kv-heads 2 --head-dim 128 --layers 28 \
  --contexts 512,2048,8192 --sweep 66:1:1,66:2:1,66:4:1,66:8:1,66:16:1 \
  --json "$R/attn_1.5b_pps.json" 2>&1 | tail -18
for m in 0.5b 1.5b 7b; do
  for p in 2 4 8 2; do
    for d in 0 2048; do
      t "$m min_pps $p depth $d"
      NANOQWEN_ATTN_MIN_PPS=$p bj "pps_${m}_${p}_d${d}_$(date +%s)_$C" --synthetic $m -p 512 -n 128 \
        -r 5 -d $d --mode graph
    done
  done
done
t "done"
} 2>&1 | tee "$OUT/next2_$C.log"
tar -C "$R" -czf "$OUT/next2_$C.tgz" .
