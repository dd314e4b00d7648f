# session 31 call 2: racecheck of the verify step with PDL off (call 1's racecheck run crashed in
# the eager decode step with PDL on), then the two gate/up patches on top of the fold
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
t "racecheck, script verify, NANOQWEN_PDL=0"
NANOQWEN_PDL=0 timeout 240 $CS --tool racecheck --error-exitcode 99 --kernel-name kns=attn_decode \
  python3 tests/gpu/test_sanitizer.py verify 2>&1 | tail -14; echo "rc ${PIPESTATUS[0]}"
t "done"
} 2>&1 | tee "$OUT/call2_racecheck.log"
rm -rf "$R"
NANOQWEN_COMMIT=$C PRESETS="7b 3b" KERNELS=0 bash benchmarks/verify_columns_gpu.sh
