#!/usr/bin/env bash
# Issue 14 on the GPU: the prefill's TTFT at 7B by prompt length and weights, and its GEMM
# epilogues per projection.
#   PART=T: install, build, tests/gpu (all of it)
#   PART=G: bench_gemm_int4.py at 7B, m = 1, 128, 512, 2048 (gate/up also as the ATen chain of
#           fp32 copies the prefill ran before silu_mul: resident_aten_chain_us)
#   PART=F: `nanoqwen bench --synthetic 7b` TTFT: pp512 (resident, dequant), 0.5B and 1.5B pp512,
#           7B pp2048, pp8192, pp30000 (resident), graph mode
#   PART=K: the paged prefill attention against SDPA (NANOQWEN_PREFILL_ATTN_MAX=0) on one
#           machine: 0.5B, 1.5B, 7B pp512, a 40-token next turn after 1024, 7B pp2048, pp8192,
#           pp30000; JSON names say _paD (the default) / _pa0
#   PART=X: profile_prefill.py: host enqueue against GPU time, ops and kernels (0.5B p512, 7B p512
#           and p8192)
#   PART=W: lab/gemm_w4_wgmma.py: the prefill GEMM on wgmma against fp32 math, cuBLAS resident,
#           dequant + cuBLAS and gemm_int4 (7B, m = 64, 127, 512, 2048: the prefill's chunks are at most
#           2048); then 7B TTFT pp512 and pp2048 with --prefill-weights int4; runs first (a
#           failed check turns the product's wgmma kernel off before T)
#   PART=R: G and F (those in PART) again on the baseline: `patch -R` of AB_PATCH (the change as
#           a diff against the baseline), rebuild; their JSON names say _A (the change's _B)
#   NANOQWEN_COMMIT=<git rev-parse --short HEAD> PART=GFXR AB_PATCH=F \
#     bash benchmarks/verify_prefill_gpu.sh                                        (carry .whl)
# The JSON files come back as one $OUT/results_<PART>_<commit>.tgz, the log beside it.
source benchmarks/device_prelude.sh
f() {  # f LABEL: the TTFT runs
  local L=$1 w m p
  for w in resident dequant; do
    t "bench 7b pp512 $w ($L)"
    bj "bench_7b_pp512_${w}_${L}_$C" --synthetic 7b -p 512 -n 8 -r 5 --mode graph --prefill-weights $w
  done
  for m in 0.5b 1.5b; do   # small models: bound by the host's per-op costs (issue 14)
    t "bench $m pp512 resident ($L)"
    bj "bench_${m}_pp512_resident_${L}_$C" --synthetic $m -p 512 -n 8 -r 5 --mode graph \
      --prefill-weights resident
  done
  for p in 2048 8192 30000; do
    t "bench 7b pp$p resident ($L)"
    bj "bench_7b_pp${p}_resident_${L}_$C" --synthetic 7b -p $p -n 4 \
      -r $([ $p = 30000 ] && echo 2 || echo 3) --mode graph --prefill-weights resident
  done
}
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
if [[ "$P" == *W* ]]; then
  t "lab gemm_w4_wgmma 7b"
  timeout 180 python3 benchmarks/lab/gemm_w4_wgmma.py --json "$R/lab_gemm_w4_wgmma_7b_$C.json" \
    2>&1 | tail -60
  if [ $? != 0 ]; then   # wrong somewhere: the product without the wgmma kernel for tests/gpu
    t "lab failed: kWgmmaMinM = 1 << 30 (the wgmma kernel never taken), rebuild"
    sed -i 's/constexpr int kWgmmaMinM = 128;/constexpr int kWgmmaMinM = 1 << 30;/' csrc/gemm_int4.cu
    grep -n "constexpr int kWgmmaMinM" csrc/gemm_int4.cu
    timeout 200 python3 -c "from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -3
  fi
  for p in 512 2048; do   # the prefill on the INT4 weights, gemm_int4 for every chunk
    t "bench 7b pp$p int4"
    bj "bench_7b_pp${p}_int4_$C" --synthetic 7b -p $p -n 8 -r 5 --mode graph --prefill-weights int4
  done
fi
if [[ "$P" == *T* ]]; then
  t "tests/gpu"; timeout ${TEST_TIMEOUT:-400} python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -40
fi
g() {  # g LABEL: the per-projection GEMM bench
  t "bench_gemm_int4 7b ($1)"
  timeout 150 python3 benchmarks/bench_gemm_int4.py --m 1,128,512,2048 \
    --json "$R/bench_gemm_int4_7b_$1_$C.json" 2>&1 | tail -20
}
[[ "$P" == *G* ]] && g B
[[ "$P" == *F* ]] && f B
k() {  # k TAG PRESET ARGS...: a TTFT bench with the paged prefill attention, then with SDPA
  local tag=$1 m=$2 v; shift 2
  for v in "" 0; do
    t "bench $m $tag NANOQWEN_PREFILL_ATTN_MAX=${v:-default}"
    NANOQWEN_PREFILL_ATTN_MAX=$v bj "bench_${m}_${tag}_pa${v:-D}_$C" --synthetic $m "$@" --mode graph
  done
}
if [[ "$P" == *K* ]]; then   # LIGHT=1: a short lease's four
  k pp512 0.5b -p 512 -n 8 -r 5
  [ "${LIGHT:-0}" = 1 ] || k pp512 1.5b -p 512 -n 8 -r 5
  k pp512 7b -p 512 -n 8 -r 5 --prefill-weights resident
  k pp40d1024 7b -d 1024 -p 40 -n 8 -r 5 --prefill-weights resident
  [ "${LIGHT:-0}" = 1 ] || k pp2048 7b -p 2048 -n 4 -r 3 --prefill-weights resident
  k pp8192 7b -p 8192 -n 4 -r 2 --prefill-weights resident
  [ "${LIGHT:-0}" = 1 ] || k pp30000 7b -p 30000 -n 4 -r 2 --prefill-weights resident
fi
if [[ "$P" == *X* ]]; then
  for a in "0.5b 512" "7b 512" "7b 8192"; do
    set -- $a
    t "profile_prefill $1 p$2"
    timeout 120 python3 benchmarks/profile_prefill.py --preset $1 -p $2 \
      --json "$R/profile_prefill_${1}_p$2_$C.json" 2>&1 | cut -c1-200
  done
fi
if [[ "$P" == *R* && -n "${AB_PATCH:-}" ]]; then
  t "patch -R $AB_PATCH"; patch -R -p1 < "$AB_PATCH" | tail -3
  t "rebuild (A)"; timeout 200 python3 -c "from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -3
  [[ "$P" == *G* ]] && g A
  [[ "$P" == *F* ]] && f A
  t "patch $AB_PATCH (back)"; patch -p1 < "$AB_PATCH" | tail -3
fi
t "done"
} 2>&1 | tee "$OUT/verify_prefill_${P}_$C.log"
tar -C "$R" -czf "$OUT/results_${P}_$C.tgz" . && rm -rf "$R"
