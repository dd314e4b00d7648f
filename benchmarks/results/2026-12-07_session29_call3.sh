#!/usr/bin/env bash
# session 29 call 3: gate/up column instance at the one-column instance's blocks/SM (out/p_pad.patch), A/B + tests
export NANOQWEN_COMMIT=${NANOQWEN_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
NCU=/usr/local/cuda/bin/ncu
build() { timeout 200 python3 -c "from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -1; }
F='^ *[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$'
{
. benchmarks/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t "A: HEAD"; timeout 150 python3 benchmarks/bench_verify.py --reps 20 --json "$OUT/verify_A.json" 2>&1 | grep -Ev "$F" | tail -8
t "B: padded"; patch -p1 -s < out/p_pad.patch && build
timeout 150 python3 benchmarks/bench_verify.py --reps 20 --json "$OUT/verify_B.json" 2>&1 | grep -Ev "$F" | tail -8
timeout 60 $NCU --kernel-name regex:gemv_int4 --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
  python3 benchmarks/ncu_gemv.py --cols 2 --ops gate/up 2>&1 | grep -E "Duration|Elapsed Cycles|SM Active|Waves|Block Limit Shared|Achieved Active"
python3 -c "
import json,sys; a,b=(json.load(open(f'$OUT/verify_{x}.json')) for x in 'AB')
r=[rb['ms']/ra['ms'] for ra,rb in zip(a['rows'],b['rows']) if 2<=ra['k']<=8]
m=sum(r)/len(r); print('B/A t(2..8) mean', round(m,4), 'decode', round(a['decode_graph_ms'],3), round(b['decode_graph_ms'],3)); sys.exit(0 if m<0.99 else 1)" && { t "B tests/gpu"; timeout 300 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -4; }
t done
} 2>&1 | tee "$OUT/call3.log"
