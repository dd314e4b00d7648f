#!/usr/bin/env bash
# Session 38, call 2 (carry .whl; any one-GPU kind): attempts/gemv-family-rows.patch decided on
# this machine, then tests/gpu on exactly the tree that stays. A = the tree as committed; B = A +
# the rows. The presets the rows change (0.5B, 1.5B, 3B, 14B, 32B) A then B; B stays if it is
# faster by >= 1% summed over the 3B, 14B and 32B (the predicted gains: -37, -150, -670 us on an
# H100) and no preset is slower by more than 1%; otherwise the patch is reversed and rebuilt.
# The log says which tree tests/gpu ran on ("rows kept" / "rows reversed").
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
P="0.5b 1.5b 3b 7b 14b 32b"
for m in $P; do t "bench $m (A)"; bj "rows_${m}_A_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph; done
patch -p1 -s < benchmarks/attempts/gemv-family-rows.patch && build
for m in $P; do t "bench $m (B)"; bj "rows_${m}_B_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph; done
keep=$(python3 - "$R" "$C" <<'PY'
import json, sys
R, C = sys.argv[1:]
def ms(m, ab):
    d = json.load(open(f"{R}/rows_{m}_{ab}_{C}.json"))
    return [r["ms_per_token"] for r in d["rows"] if r.get("ms_per_token")][0]
a = {m: ms(m, "A") for m in "0.5b 1.5b 3b 7b 14b 32b".split()}
b = {m: ms(m, "B") for m in a}
gain = sum(a[m] - b[m] for m in ("3b", "14b", "32b")) / sum(a[m] for m in ("3b", "14b", "32b"))
worst = max((b[m] - a[m]) / a[m] for m in a)
print(1 if gain >= 0.01 and worst <= 0.01 else 0,
      f"gain {gain:+.2%} over 3B+14B+32B, worst preset {worst:+.2%}", file=sys.stdout)
PY
)
echo "decision: $keep"
if [ "${keep%% *}" = 1 ]; then t "rows kept"; else
  patch -R -p1 -s < benchmarks/attempts/gemv-family-rows.patch && build; t "rows reversed"; fi
t "tests/gpu, 4 workers"
timeout $(( $(left) - 110 )) python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -n 4 \
  --dist loadfile 2>&1 | tail -8
t "bench_verify 7b (t(k) at min_pps 8)"
timeout 100 python3 benchmarks/bench_verify.py --preset 7b --reps 10 \
  --json "$R/bench_verify_7b_$C.json" 2>&1 | grep -vE "^(qkv|o |gate|down|lm_head|op |GEMV)" | head -24
t "bench_spec_device 7b (final tree)"
timeout 60 python3 benchmarks/bench_spec_device.py --synthetic 7b --reps 3 -n 128 \
  --json "$R/bench_spec_device_7b_$C.json" 2>&1 | tail -7
for m in 0.5b 7b; do for d in 0 2048; do for p in 8 16; do
  [ $(left) -gt 20 ] || break 3
  t "$m min_pps $p depth $d"
  NANOQWEN_ATTN_MIN_PPS=$p bj "pps_${m}_${p}_d${d}_$C" --synthetic $m -p 512 -n 128 -r 5 -d $d --mode graph
done; done; done
t "done"
} 2>&1 | tee "$OUT/s38c2_$C.log"
tar -C "$R" -czf "$OUT/s38c2_$C.tgz" .
