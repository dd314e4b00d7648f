#!/usr/bin/env bash
# Session 36 call 3 (the machine still warm after call 2; the command as it was run): the landed
# tree da12805, the 0.5B and 7B benches and bench_spec --temp 0.8 on the device rows.
source benchmarks/device_prelude.sh; C=da12805; { source benchmarks/device_setup.sh; for m in 0.5b 7b; do t "bench $m"; bj "bench_${m}_final_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph,eager; done; t "bench_spec t0.8 device rows"; timeout 60 python3 benchmarks/bench_spec.py --backend cuda --temp 0.8 -n 200 --reps 3 --json $R/bench_spec_t08_final_$C.json 2>&1 | tail -2; t done; } 2>&1 | tee $OUT/call3_$C.log
