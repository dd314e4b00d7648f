#!/usr/bin/env bash
# Session 35 call 2: what fits the last ~200 s of device time after sixteen refused starts
# (call 1's script never got a machine): the 0.5B and 7B rows of issue 12's table, the GEMV
# family lab at the 0.5B, 1.5B and 7B shapes, then the other presets' rows. Carry .whl.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for m in 0.5b 7b; do
  t "bench $m"
  bj "bench_${m}_p512_n128_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph
done
t "lab/gemv_int4_family.py 0.5b,1.5b,7b"
timeout 120 python3 benchmarks/lab/gemv_int4_family.py --presets 0.5b,1.5b,7b \
  --json "$R/gemv_int4_family.json" 2>&1 | tail -14
for m in 1.5b 3b 14b 32b; do
  t "bench $m"
  bj "bench_${m}_p512_n128_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph
done
t "done"
} 2>&1 | tee "$OUT/call2_$C.log"
tar -C "$R" -czf "$OUT/call2_$C.tgz" . && rm -rf "$R"
