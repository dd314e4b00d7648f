#!/usr/bin/env bash
# Session 31's open crash: the CUDA backend's eager decode step under compute-sanitizer racecheck
# with only the attention kernels instrumented faulted ("illegal memory access", reported at
# advance_kernel's launch). Runs benchmarks/lab/racecheck_engine.py under racecheck for each
# attention kernel (TMA 1, cp.async 0) and keeps each full sanitizer log in $OUT (not just its
# tail); then memcheck of the same body as the control. Not with CUDA_LAUNCH_BLOCKING=1: under it
# (session 32, call 1) both runs sat in the backend's constructor past a 60 s limit. Carry .whl.
#   NANOQWEN_COMMIT=<hash> [PDL=0] bash benchmarks/racecheck_engine_gpu.sh
source benchmarks/device_prelude.sh
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$CS" --version | tail -1
for tool in racecheck memcheck; do
  for tma in 1 0; do
    log="$OUT/${tool}_engine_tma${tma}_$C.log"
    t "$tool, engine eager decode, NANOQWEN_ATTN_TMA=$tma, NANOQWEN_PDL=${PDL:-0}"
    extra=(); [ $tool = racecheck ] && extra=(--racecheck-report all)
    NANOQWEN_PDL=${PDL:-0} timeout 200 "$CS" --tool $tool "${extra[@]}" \
      --error-exitcode 99 --kernel-name kns=attn_decode \
      python3 benchmarks/lab/racecheck_engine.py --tma $tma --steps 20 > "$log" 2>&1
    echo "rc $?"; grep -c "" "$log"; grep -m 12 -E "Error|error|Race|hazard|HAZARD|at 0x|Invalid" "$log"
    tail -6 "$log"
  done
done
t "done"
} 2>&1 | tee "$OUT/racecheck_engine_$C.log"
