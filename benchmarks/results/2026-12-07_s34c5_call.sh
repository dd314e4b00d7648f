#!/usr/bin/env bash
# session 34 call 5 (no code change; the product of 0b49d4b): attention is 28% of the 0.5B step
# after the fold (bench_step: 164.5 of 595 us, 6.85 us a layer at context 512). Its split sizing
# is a switch: NANOQWEN_ATTN_MIN_PPS (default 2 pages a split, chosen at 7B). Graph,
# `-p 512 -n 128 -r 5`: the 0.5B at min_pps 2, 4, 8, 16, then 2 again; the 7B at 4 and 2. Carry .whl.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for p in 2 4 8 16 2; do t "0.5b min_pps $p"; NANOQWEN_ATTN_MIN_PPS=$p bj pps_0.5b_${p}_$(date +%s) --synthetic 0.5b -p 512 -n 128 -r 5 --mode graph; done
for p in 4 2; do t "7b min_pps $p"; NANOQWEN_ATTN_MIN_PPS=$p bj pps_7b_${p}_$(date +%s) --synthetic 7b -p 512 -n 128 -r 5 --mode graph; done
t "done"
} 2>&1 | tee "$OUT/s34c5_$C.log"
tar -C "$R" -czf "$OUT/s34c5_$C.tgz" . && rm -rf "$R"
