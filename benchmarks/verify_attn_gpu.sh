#!/usr/bin/env bash
# Issue 14 item 3 on the GPU: attention_decode's two page loops, the cp.async split-K kernel
# (kernel 0) and the TMA warp-specialized one on tensor cores (kernel 1, NANOQWEN_ATTN_TMA=1).
#   PART=A: install, build, tests/gpu (all of it: both kernels' op tests, compute-sanitizer
#           memcheck / racecheck / synccheck, the verify step's bit identity with each), then
#           the op alone at 128..32768 (bench_attention.py)
#   PART=B: install, build, `nanoqwen bench` at 7B with each kernel: decode after 512 (the
#           plain bench), 8192 and 30000 cached tokens
#   PART=S: install, build, the op's split sweep (bench_attention.py, 128..32768, the TMA
#           kernel at 33 and 66 splits and min_pps 1-8, the cp.async kernel at its default;
#           SWEEP_CTX, SWEEP (S:min_pps:kernel,...) and SWEEP_LAYERS narrow it)
#   PART=P: install, build, the 7B bench with each kernel at the engine's split policy after
#           2048, 8192 and 30000 cached tokens and a 512 prompt (apply
#           attempts/split-merge-policy.patch first to measure its policy: TMA one block an SM;
#           P_KERNELS="1" runs the TMA kernel only)
#   PART=T: tests/gpu; letters combine (PART=TSP); AB runs tests/gpu too
#   NANOQWEN_COMMIT=<git rev-parse --short HEAD> PART=TSP bash benchmarks/verify_attn_gpu.sh
# The JSON files come back as one $OUT/results_<PART>_<commit>.tgz, the log beside it.
# Carry .whl (the app tests' wheels).
#   NANOQWEN_COMMIT=<git rev-parse --short HEAD> PART=A bash benchmarks/verify_attn_gpu.sh
source benchmarks/device_prelude.sh
b() {  # b TMA TAG ARGS...: one 7B bench run's JSON and its figures
  local tma=$1 tag=$2; shift 2
  t "bench 7b $* (NANOQWEN_ATTN_TMA=$tma)"
  NANOQWEN_ATTN_TMA=$tma bj "bench_7b_${tag}_tma${tma}_$C" --synthetic 7b "$@"
}
{
source benchmarks/device_setup.sh
case "$P" in *A*|*T*) RUN_T=1;; *) RUN_T=0;; esac
if [ "$RUN_T" = 1 ]; then
  t "tests/gpu"; timeout ${TEST_TIMEOUT:-400} python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -40
fi
if [[ "$P" == *A* ]]; then
  t "bench_attention"; timeout 200 python3 benchmarks/bench_attention.py --json "$R/bench_attention_$C.json" 2>&1 | tail -40
fi
if [[ "$P" == *P* ]]; then
  for d in 2048 8192; do for tma in ${P_KERNELS:-1 0}; do b $tma d$d -d $d -p 64 -n 128 -r 3 --mode graph; done; done
  for tma in ${P_KERNELS:-1 0}; do b $tma d30000 -d 30000 -p 64 -n 64 -r 2 --mode graph; done
  for tma in ${P_KERNELS:-1 0}; do b $tma d0 -p 512 -n 128 -r 5 --mode graph,eager; done
fi
if [[ "$P" == *S* ]]; then
  t "split sweep"
  timeout 300 python3 benchmarks/bench_attention.py \
    --contexts ${SWEEP_CTX:-128,256,512,1024,2048,4096,8192,16384,32768} \
    --sweep ${SWEEP:-66:2:0,66:1:1,66:2:1,66:4:1,66:8:1,33:1:1,33:2:1,33:4:1} \
    --layers ${SWEEP_LAYERS:-28} --json "$R/sweep_attn_$C.json" 2>&1 | tail -80
fi
if [[ "$P" == *B* ]]; then
  if [ "${LIGHT:-0}" = 1 ]; then  # a short lease: graph mode, fewer repetitions, no 30000
    for tma in 0 1; do b $tma d0 -p 512 -n 128 -r 3 --mode graph; done
    for tma in 0 1; do b $tma d8192 -d 8192 -p 512 -n 64 -r 2 --mode graph; done
  else
    for tma in 0 1; do b $tma d0 -p 512 -n 128 -r 5 --mode graph,eager; done
    for tma in 0 1; do b $tma d8192 -d 8192 -p 512 -n 128 -r 3 --mode graph; done
    for tma in 0 1; do b $tma d30000 -d 30000 -p 64 -n 64 -r 2 --mode graph; done
  fi
fi
t "done"
} 2>&1 | tee "$OUT/verify_attn_${P}_$C.log"
tar czf "$OUT/results_${P}_$C.tgz" -C "$R" . && rm -rf "$R"
