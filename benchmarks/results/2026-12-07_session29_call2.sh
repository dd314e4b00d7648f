#!/usr/bin/env bash
# session 29 call 2: tests/gpu on HEAD, t(k), ncu of the column GEMVs, the app figures (greedy graph/eager, sampled graph)
export NANOQWEN_COMMIT=${NANOQWEN_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
NCU=/usr/local/cuda/bin/ncu
{
. benchmarks/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t "tests/gpu"; timeout 300 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -8
t "bench_verify"; timeout 150 python3 benchmarks/bench_verify.py --reps 20 --json "$OUT/verify_7b.json" 2>&1 | grep -v "^ *[0-9]* \+[0-9.]\+ \+[0-9.]\+ \+[0-9.]\+ \+[0-9.]\+ \+[0-9.]\+$" | tail -12
for c in 1 2 4 8; do
  t "ncu gate/up, down at $c columns"
  timeout 120 $NCU --kernel-name regex:gemv_int4 --launch-skip 2 --launch-count 2 --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats --section LaunchStats \
    python3 benchmarks/ncu_gemv.py --cols $c --ops gate/up,down > "$OUT/ncu_cols$c.txt" 2>&1
  grep -E "gemv_int4_tca|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit (Registers|Shared)|L1/TEX Hit|L2 Hit|Memory Throughput|DRAM Through|Stall|Warp Cycles Per Issued|Issued Warp Per" "$OUT/ncu_cols$c.txt" | head -60
done
t "convert 7b"; timeout 200 nanoqwen convert --synthetic 7b --tokenizer .tok/tokenizer.json -o /tmp/7b.nanoqwen 2>&1 | tail -1
for m in graph eager graph-sampled; do
  t "bench_app $m"
  timeout 150 python3 benchmarks/bench_app.py --model /tmp/7b.nanoqwen --backend cuda --mode ${m%-sampled} \
    $([ "$m" = graph-sampled ] && echo --sampled) --tokens 1024 --reps 3 --quiet --json "$OUT/app_7b_$m.json" 2>&1 | tail -8
done
t done
} 2>&1 | tee "$OUT/call2.log"
cd "$OUT" && tar czf ncu.tgz ncu_cols*.txt && rm ncu_cols*.txt
