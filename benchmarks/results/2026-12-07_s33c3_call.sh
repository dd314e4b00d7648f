#!/usr/bin/env bash
# session 33 call 3 (asks for an H200: issue 12 item 2 names it): the preset table
# (verify_presets_gpu.sh: each preset's `nanoqwen bench --synthetic P -p 512 -n 128 -r 5 --mode
# graph --json`), then `nanoqwen bench --spec ngram` on the bundled model. Carry .whl.
bash benchmarks/verify_presets_gpu.sh
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
C=${NANOQWEN_COMMIT:-unknown}
timeout 80 nanoqwen bench --backend cuda --spec ngram -n 200 -r 3 --json > "$OUT/bench_spec_ngram_$C.json" \
  && python3 benchmarks/spec_rows.py "$OUT/bench_spec_ngram_$C.json" 2>&1 | tail -10
