#!/usr/bin/env bash
# Issue 12 item 2 on the GPU: the decode targets table in one device call. Install, build, then
# for each preset `nanoqwen bench --synthetic P -p 512 -n 128 -r 5 --mode graph --json` (the
# issue's command), and one table: ms/token against the issue's target, GB/s and the share of
# the card's own copy bandwidth (both from the bench's JSON). TESTS=1 then runs all of tests/gpu.
# The JSON files come back as one $OUT/results_presets_<commit>.tgz, the log beside it.
#   NANOQWEN_COMMIT=<git rev-parse --short HEAD> [PRESETS="0.5b 7b"] [TESTS=1] \
#     bash benchmarks/verify_presets_gpu.sh                                      (carry .whl)
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for m in ${PRESETS:-0.5b 1.5b 3b 7b 14b 32b}; do
  t "bench $m"
  bj "bench_${m}_p512_n128_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph
done
python3 - "$R" "$C" <<'EOF'
import json, pathlib, sys
# issue 12's targets (ms/token, H200, graph, context 512)
TARGET = {"0.5b": 0.25, "1.5b": 0.45, "3b": 0.75, "7b": 1.45, "14b": 2.7, "32b": 5.6}
print("| preset | ms/token | target | GB/s | % of copy bandwidth | device |")
print("| --- | --- | --- | --- | --- | --- |")
for m in TARGET:
    f = pathlib.Path(sys.argv[1]) / f"bench_{m}_p512_n128_{sys.argv[2]}.json"
    if not f.exists():
        continue
    d = json.loads(f.read_text())
    r = next(r for r in d["rows"] if "ms_per_token" in r)
    print(f"| {m} | {r['ms_per_token']:.3f} | {TARGET[m]} | {r['gb_per_s']:.0f} | "
          f"{r['pct_of_copy_bw']:.1f} | {d['device']} |")
EOF
if [ "${TESTS:-0}" = 1 ]; then
  t "tests/gpu"; timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -30
fi
t "done"
} 2>&1 | tee "$OUT/verify_presets_$C.log"
tar -C "$R" -czf "$OUT/results_presets_$C.tgz" . && rm -rf "$R"
