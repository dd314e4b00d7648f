#!/usr/bin/env bash
# session 32 call 2 (never started; as planned then it tested 2ae9dbf, whose engine/spec.py is
# now attempts/ngram-packed-index.patch, so the patch is applied first): tests/gpu on it; then
# what a speculation step costs by T on the bundled model (lab/verify_step_wall.py, graph and
# eager); last, racecheck of the engine's eager decode (no CUDA_LAUNCH_BLOCKING: with it call
# 1's runs sat in the constructor for 60 s). Carry .whl.
source benchmarks/device_prelude.sh
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
{
patch -p1 -s < benchmarks/attempts/ngram-packed-index.patch || { echo "the patch does not apply"; exit 1; }
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "tests/gpu (the submission)"
timeout 260 python3 -m pytest tests/gpu -q --tb=line -p no:cacheprovider 2>&1 | tail -8
t "verify_step_wall (bundled model)"
timeout 90 python3 benchmarks/lab/verify_step_wall.py --json "$R/verify_step_wall_tiny.json" 2>&1 | tail -28
t "verify_step_wall (7B shapes, synthetic; added after the call was planned)"
timeout 150 python3 benchmarks/lab/verify_step_wall.py --preset 7b --reps 15 --json "$R/verify_step_wall_7b.json" 2>&1 | tail -28
t "racecheck tma=1 (engine eager decode, attn kernels instrumented)"
log="$OUT/racecheck_engine_tma1.log"
NANOQWEN_PDL=0 timeout ${RACE_S:-60} "$CS" --tool racecheck --racecheck-report all --error-exitcode 99 \
  --kernel-name kns=attn_decode python3 benchmarks/lab/racecheck_engine.py --tma 1 --steps 6 > "$log" 2>&1
echo "rc $?"; grep -m 10 -E "rror|Race|azard|Invalid" "$log"; tail -5 "$log"
t "done"
} 2>&1 | tee "$OUT/call2_$C.log"
