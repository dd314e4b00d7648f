#!/usr/bin/env bash
# session 32 call 1, ordered by what a short budget most needs:
# (1) build this tree (the new drafter, 0cb035c's attention) and run all of tests/gpu on it;
# (2) bench_verify 7b/3b on it (the pairs' A); (3) nanoqwen bench --spec ngram on the bundled model,
# new drafter, then the old one (out/newdrafter.patch reversed), then restored;
# (4) the pairs patch: rebuild, its op tests, bench_verify 7b/3b, --kernels at T = 8 (PDL off);
# (5) the engine-level racecheck (benchmarks/racecheck_engine_gpu.sh's loop, racecheck only).
source benchmarks/device_prelude.sh
PAIRS=benchmarks/attempts/verify-attn-pairs.patch
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
bv() { for m in 7b 3b; do t "$1: bench_verify $m"
  timeout 60 python3 benchmarks/bench_verify.py --preset $m --reps 10 --json "$R/verify_${m}_$1.json" \
    2>&1 | grep -E "decode step|^ ?[1-8] " | head -9; done; }
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "tests/gpu (this tree)"
timeout 260 python3 -m pytest tests/gpu -q --tb=line -p no:cacheprovider 2>&1 | tail -8
bv one
for d in new old; do
  [ $d = old ] && patch -R -p1 -s < out/newdrafter.patch
  t "bench --spec ngram, $d drafter"
  timeout 70 nanoqwen bench --backend cuda --spec ngram -n 200 -r 3 --json > "$R/bench_spec_ngram_cuda_$d.json" \
    && python3 benchmarks/spec_rows.py "$R/bench_spec_ngram_cuda_$d.json" 2>&1 | tail -6
done
patch -p1 -s < out/newdrafter.patch
t "pairs: patch, rebuild"
patch -p1 -s < "$PAIRS" && timeout 120 python3 -c \
  "from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -1
t "pairs: op tests"
timeout 90 python3 -m pytest tests/gpu/test_attention_fused.py -q --tb=line -p no:cacheprovider -k verify 2>&1 | tail -4
bv pairs
t "pairs: --kernels 7b (PDL off)"
NANOQWEN_PDL=0 timeout 60 python3 benchmarks/bench_verify.py --preset 7b --reps 10 --kernels \
  --json "$R/verify_kernels_7b_pairs.json" 2>&1 | grep -E "attn_decode|^sum"
patch -R -p1 -s < "$PAIRS"
t "racecheck (engine, tree's attention)"
timeout 30 python3 -c "from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -1
for tma in 1 0; do
  log="$OUT/racecheck_engine_tma${tma}.log"
  t "racecheck tma=$tma"
  CUDA_LAUNCH_BLOCKING=1 NANOQWEN_PDL=0 timeout 60 "$CS" --tool racecheck --racecheck-report all \
    --error-exitcode 99 --kernel-name kns=attn_decode \
    python3 benchmarks/lab/racecheck_engine.py --tma $tma --steps 10 > "$log" 2>&1
  echo "rc $?"; grep -m 8 -E "rror|Race|azard|Invalid" "$log"; tail -4 "$log"
done
t "done"
} 2>&1 | tee "$OUT/call1_$C.log"
