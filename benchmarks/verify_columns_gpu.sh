#!/usr/bin/env bash
# Issue 13 item 3 on the GPU: the verify step's t(k) across the family, this tree (A) against
# patches of its column GEMVs, in one device call. Install and build, then per variant (A, then
# each patch of PATCHES applied alone, rebuilt) `bench_verify.py --preset P` for each preset of
# PRESETS, and one table: the decode step, t(2), t(4), t(8) and the mean of t(k)/t_A(k) over
# k = 2..8 per preset and variant. TESTS=<patch> then applies that patch and runs all of
# tests/gpu (TESTS=A: this tree). KERNELS=1 (the default) adds `bench_verify.py --kernels` at the
# 7B on this tree: each kernel's GPU time per eager step, PDL off. PRETESTS="<pytest args>" runs
# those tests on this tree first. JSONs in $OUT/results_columns_<commit>.tgz, the log beside it.
#   NANOQWEN_COMMIT=<git rev-parse --short HEAD> [PRESETS="3b 7b 14b 32b"] [REPS=10] \
#     [PATCHES="benchmarks/attempts/verify-gateup-same-waves.patch ..."] [TESTS=A|<patch>] \
#     [PRETESTS="tests/gpu/test_verify.py"] \
#     bash benchmarks/verify_columns_gpu.sh                                     (carry .whl)
source benchmarks/device_prelude.sh
PRESETS=${PRESETS:-3b 7b 14b 32b}
PATCHES=${PATCHES-benchmarks/attempts/verify-gateup-same-waves.patch benchmarks/attempts/verify-stage-unroll2.patch}
build() { timeout 200 python3 -c "from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -1; }
verify() {   # variant name: bench_verify for every preset, the decode and t(k) lines only
  for m in $PRESETS; do
    t "$1: bench_verify $m"
    timeout 200 python3 benchmarks/bench_verify.py --preset $m --reps ${REPS:-10} \
      --json "$R/verify_${m}_$1.json" 2>&1 | grep -E "decode step|^ ?[1-8] " | head -9
  done
}
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -n "${PRETESTS:-}" ]; then   # quick correctness on this tree before any figure
  t "pytest $PRETESTS"; timeout 300 python3 -m pytest $PRETESTS -q --tb=short -p no:cacheprovider 2>&1 | tail -8
fi
verify A
if [ "${KERNELS:-1}" = 1 ]; then   # where this tree's verify step spends its time (7B, eager)
  t "A: bench_verify --kernels (7b, NANOQWEN_PDL=0: with PDL the profiler counts each kernel's wait)"
  NANOQWEN_PDL=0 timeout 200 python3 benchmarks/bench_verify.py --preset 7b --reps 10 --kernels \
    --json "$R/verify_kernels_7b_A.json" 2>&1 | sed -n '/GPU time per eager step/,$p' | head -40
fi
for p in $PATCHES; do
  v=$(basename "$p" .patch)
  t "variant $v"; patch -p1 -s < "$p" && build && verify "$v"; patch -R -p1 -s < "$p"
done
python3 - "$R" $PRESETS <<'PY'
import json, pathlib, sys
r = pathlib.Path(sys.argv[1])
print("| preset | variant | decode ms | t(2) | t(4) | t(8) | mean t(k)/t_A(k), k = 2..8 |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for m in sys.argv[2:]:
    a = r / f"verify_{m}_A.json"
    if not a.exists():
        continue
    A = {x["k"]: x["ms"] for x in json.loads(a.read_text())["rows"]}
    for f in sorted(r.glob(f"verify_{m}_*.json"), key=lambda f: (f.stem != f"verify_{m}_A", f.stem)):
        d = json.loads(f.read_text())
        t = {x["k"]: x["ms"] for x in d["rows"]}
        rel = sum(t[k] / A[k] for k in range(2, 9)) / 7
        print(f"| {m} | {f.stem[len(f'verify_{m}_'):]} | {d['decode_graph_ms']:.3f} | {t[2]:.3f} | "
              f"{t[4]:.3f} | {t[8]:.3f} | {rel:.4f} |")
PY
if [ -n "${TESTS:-}" ]; then
  [ "$TESTS" != A ] && { patch -p1 -s < "$TESTS" && build; }
  t "tests/gpu ($TESTS)"; timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -8
  [ "$TESTS" != A ] && patch -R -p1 -s < "$TESTS"
fi
t "done"
} 2>&1 | tee "$OUT/verify_columns_$C.log"
tar -C "$R" -czf "$OUT/results_columns_$C.tgz" . && rm -rf "$R"
