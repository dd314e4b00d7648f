#!/usr/bin/env bash
# Ready for session 40 (export NANOQWEN_COMMIT; carry .whl; any one-GPU kind; ~8 min):
# attempts/verify-row-tiles.patch measured against the product on one machine (the verify step's
# column GEMVs with two 16-row tiles a block on the 7B's down_proj and gate/up rows, so each
# block's x is read once for 32 rows), then B3 (B + two row tiles on qkv and the 7B's o_proj),
# then B2 (B3 + down 16 warps x 2 stages, gate/up 3 stages), each after the column tests that
# prove its bits; then the bound on folding the verify step's norms (A without its 56 rmsnorm
# launches: timing only) and A again. B and B3 leave the decode step (one column) as it is; B2
# changes its down_proj split. If B, B3 or B2 wins by the rule in RESULTS.md (session 39), it
# lands after a tests/gpu run of its own (a second call), with the table rows as measured.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cols() { timeout 200 python3 -m pytest tests/gpu/test_verify.py -q --tb=short -p no:cacheprovider -n 4 \
  -k "columns_are_one_column or verify_rows_are_decode_steps" 2>&1 | tail -3; }
t "A: bench_verify 7b (the product)"; vb A
cp csrc/gemv_int4.cu /tmp/gemv_int4_A.cu
patch -p1 -s < benchmarks/attempts/verify-row-tiles.patch && t "B: build" && build
t "B: column and verify-row tests"; cols
t "B: bench_verify 7b"; vb B
sed -i 's/instance<Tca<OP_STORE, 4, 4, 2>>(kAnyK, "qkv")/instance<Tca<OP_STORE, 4, 4, 2, 2>>(kAnyK, "qkv")/; s/instance<Tca<OP_RESID, 4, 4, 2>>(3584, "o_proj")/instance<Tca<OP_RESID, 4, 4, 2, 2>>(3584, "o_proj")/' csrc/gemv_int4.cu
grep -n '"qkv")\|(3584, "o_proj")' csrc/gemv_int4.cu
t "B3 (B + two row tiles on qkv and the 7B's o_proj): build"; build
t "B3: column and verify-row tests"; cols
t "B3: bench_verify 7b"; vb B3
sed -i 's/instance<Tca<OP_RESID, 8, 4, 2, 2>>(18944/instance<Tca<OP_RESID, 16, 2, 2, 2>>(18944/; s/instance<Tca<OP_SILU, 2, 4, 2, 2>>(3584/instance<Tca<OP_SILU, 2, 3, 2, 2>>(3584/; s/pick(OP_RESID, 18944).ks == 8/pick(OP_RESID, 18944).ks == 16/' csrc/gemv_int4.cu
grep -n "18944, \"down_proj\"\|(3584, \"gate/up\"" csrc/gemv_int4.cu
t "B2: build"; build
t "B2: column and verify-row tests"; cols
t "B2: bench_verify 7b"; vb B2
if [ $(left) -gt 70 ]; then  # the bound: A's verify step without its 56 rmsnorm launches (wrong numbers)
  t "A without the verify step's norms (lab-verify-no-norms.patch: the most folding them can gain)"
  cp /tmp/gemv_int4_A.cu csrc/gemv_int4.cu && patch -p1 -s < benchmarks/attempts/lab-verify-no-norms.patch && build
  vb A_nonorms; fi
[ $(left) -gt 60 ] && { t "A again"; patch -R -p1 -s < benchmarks/attempts/lab-verify-no-norms.patch; build; vb A_again; }
t "the runs side by side"
vb_table A B B3 B2 A_nonorms A_again
t done
} 2>&1 | tee "$OUT/s40c1_$C.log"
tar -C "$R" -czf "$OUT/s40c1_$C.tgz" .
