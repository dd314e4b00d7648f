#!/usr/bin/env bash
# Session 39 call 3 (export NANOQWEN_COMMIT END; carry .whl .tok): the submitted tree, no product
# change (tests/gpu ran on it in call 2). On an H200, the card issues 12-14 name: the presets
# (issue 12's table) and t(k) at 7B (issue 13 item 3: t(8) <= 1.3x). On an H100 (call 2 has
# those): what a person sees with a 7B file now that "auto" turns prompt lookup on on the GPU,
# bench_app --spec off against ngram (random weights draft nothing: the cost of auto where it
# cannot help), greedy, graph, 1024 ids.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G"
if [[ "$G" == *H200* ]]; then
  for m in 7b 0.5b 1.5b 3b 14b 32b; do [ $(left) -gt 25 ] || break; t "bench $m"
    bj "presets_${m}_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph; done
  if [ $(left) -gt 25 ]; then t "bench_verify 7b"
  timeout $(( $(left) - 5 )) python3 benchmarks/bench_verify.py --preset 7b --reps 10 \
    --json "$R/bench_verify_7b_$C.json" 2>&1 | grep -vE "^(qkv|o |gate|down|lm_head|op |GEMV)" | head -24; fi
else
  t "convert 7b"; timeout 120 nanoqwen convert --synthetic 7b --tokenizer .tok/tokenizer.json -o /tmp/7b.nanoqwen 2>&1 | tail -1
  for s in off ngram; do [ $(left) -gt 40 ] || break; t "bench_app 7b graph --spec $s"
    timeout $(( $(left) - 5 )) python3 benchmarks/bench_app.py --model /tmp/7b.nanoqwen --backend cuda \
      --mode graph --spec $s --tokens 1024 --reps 3 --quiet --json "$R/app_7b_graph_spec-${s}_$C.json" 2>&1 | tail -8
  done
fi
t done
} 2>&1 | tee "$OUT/s39c3_$C.log"
tar -C "$R" -czf "$OUT/s39c3_$C.tgz" .
