#!/usr/bin/env bash
# session 33 call 2: speculation's plain runs (steps without drafts run ahead on the device,
# which halts the run itself where prompt lookup matches: advance_step's n-gram watch).
# (1) build this tree and run all of tests/gpu on it; (2) nanoqwen bench --spec ngram on the
# bundled model: this tree (B), then the previous loop (out/runahead.patch reversed: A), on one
# machine; (3) the 7B preset's plain decode with the new advance kernel (256 threads, watch
# off). Carry .whl and out. out/runahead.patch (git-ignored) was
#   git diff a556d7c 46b39d8 -- engine/backends/base.py engine/backends/cuda.py engine/spec.py
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "tests/gpu (this tree)"
timeout 280 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -40
for d in B A; do
  [ $d = A ] && patch -R -p1 -s < out/runahead.patch
  t "bench --spec ngram, $d"
  timeout 80 nanoqwen bench --backend cuda --spec ngram -n 200 -r 3 --json > "$R/bench_spec_ngram_$d.json" \
    && python3 benchmarks/spec_rows.py "$R/bench_spec_ngram_$d.json" 2>&1 | tail -7
done
patch -p1 -s < out/runahead.patch
t "7b plain decode (graph), this tree"
bj bench_7b_p512_n128 --synthetic 7b -p 512 -n 128 -r 5 --mode graph
t "done"
} 2>&1 | tee "$OUT/call2_$C.log"
