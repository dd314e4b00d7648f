#!/usr/bin/env bash
# session 34 call 4: call 3 showed the 0.5B's pp512 TTFT at 3.1-3.9 ms with the fold on against
# 2.2-3.0 off (a prefill launches nothing the fold changes); call 1 had 2.1-2.3 both ways.
# Alternating runs, graph, 9 reps each: -n 0 (the prefill's own token only) and -n 128 (decode
# steps queued behind the first token, as in the table). Carry .whl.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for n in 0 128; do
  for f in 1 0 1 0; do t "0.5b pp512 n$n fold $f"; NANOQWEN_NORM_FOLD=$f bj pp_0.5b_n${n}_fold${f}_$(date +%s) --synthetic 0.5b -p 512 -n $n -r 9 --mode graph; done
done
t "done"
} 2>&1 | tee "$OUT/s34c4_$C.log"
tar -C "$R" -czf "$OUT/s34c4_$C.tgz" . && rm -rf "$R"
