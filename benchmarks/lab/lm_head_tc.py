"""The lm_head on tensor cores (lm_head_tc_lab.cu) against csrc's gemv_fp16, by columns.

    python benchmarks/lab/lm_head_tc.py [--json FILE]

At the 7B's lm_head (152064 x 3584 fp16, random, std 0.02) and x [16, 3584] (randn): for cols 1,
2, 4, 8, 9, 13, 16, each kernel's time per launch (20 back-to-back launches, median of 5 runs of
them), its error against fp64 (||out - ref|| / ||sqrt(sum_k (w x)^2) + |ref|||, tests/gpu/
test_gemv.py's measure; TOL_FP16 there is 1e-5), whether the tensor-core kernel's columns are
bit-identical to its one-column calls, and how many columns' argmax the two kernels disagree on.

Prediction (written before the first run, session 15): gemv_fp16 is memory-bound to 4 columns
and FMA-bound past them (342 / 358 / 599 / 1294 us at 1 / 4 / 8 / 16 columns in
results/2026-12-06_bench_verify_7b_9cab2f3.json); on tensor cores the products cost nothing
next to the 1.09 GB, so 345-380 us at every column count up to 16 (the second n8 tile's x loads
may add a little past 8), its error ~1e-7 (fp32 sums in another order), argmax the same.
Measured (results/2026-12-06_lab_lm_head_tc_3ba9530.json): 397 / 478 / 493 / 597 us at 1 / 4 /
8 / 16 columns (U = 4), error 2.2e-6, columns bit-identical, no argmax differs. The one-column
miss: 9504 tiles over 8448 warps, two waves, the second one eighth full.

Prediction for the split-K variants (splitk2/4/8: each tile's K over 2, 4 or 8 warps, partials
summed in shared memory in warp order; written before their first run, session 15): 345-370 us
at every column count up to 16, the error of the same order, columns bit-identical; splitk4 or
splitk8 best (more independent loads in flight per tile).
Measured (session 16, results/2026-12-06_lab_lm_head_tc_{splitk_5c82f06,sweep_5c82f06+wip}_h100.json):
354-369 us at 1-8 columns (8 warps), 363-419 at 9-16 (U = 2); at one column 4-5% over the FMA
kernel's 341 in every variant, in the product too (RESULTS.md, session 16).

The loads alone (lm_head_read, added after session 16's last device run, not yet run):
tile_loads_us times the split-K tile's loads (8 rows x 64 bytes a warp-wide load), row_loads_us
gemv_fp16's (512 contiguous bytes). Prediction, written before any run: if the loads' shape is the
5%, tile 355-360 us and row 335-342; if both read at 335-342, the gap is the tile kernel's own
(the block's reduction and barrier, its 9504 short blocks) and the load shape is not worth changing.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import torch

LAB = Path(__file__).resolve().parent
sys.path.insert(0, str(LAB.parent))
sys.path.insert(0, str(LAB))   # lab.py before the benchmarks/lab directory
from bench_verify import us_per_launch as timed  # noqa: E402  (benchmarks/, one timing helper)
COLS = (1, 2, 4, 8, 9, 13, 16)


def build() -> ctypes.CDLL:
    from lab import compile_alone

    lib = compile_alone("lm_head_tc_lab.cu", show=lambda line: "Compiling entry" in line
                        or "registers" in line or "spill" in line)
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.lm_head_tc.argtypes = [P, P, P, I, I, I, I, P]
    lib.lm_head_tc_splitk.argtypes = [P, P, P, I, I, I, I, I, P]
    lib.lm_head_read.argtypes = [P, P, I, I, I, P]
    lib.lm_head_read.restype = I
    for name in ("lm_head_tc", "lm_head_tc_splitk"):
        getattr(lib, name).restype = I
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from nanoqwen.engine.build import load_extension

    load_extension()
    lib = build()
    o = torch.ops.nanoqwen
    n, k = 152064, 3584
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).half()
    x = torch.randn(16, k, generator=gen, device="cuda").half()
    stream = torch.cuda.current_stream()
    sp = ctypes.c_void_p(stream.cuda_stream)
    wd = w.double()
    w2 = wd ** 2
    rows = []

    # variants: (name, entry, its int argument): the unroll of the tile-per-warp kernel, the
    # warps a tile of the split-K one
    # (the split-K ones: (warps, unroll))
    variants = [("tc_u4", lib.lm_head_tc, (4,)), ("splitk4", lib.lm_head_tc_splitk, (4, 4)),
                ("splitk8_u2", lib.lm_head_tc_splitk, (8, 2)),
                ("splitk8", lib.lm_head_tc_splitk, (8, 4)),
                ("splitk8_u7", lib.lm_head_tc_splitk, (8, 7)),
                ("splitk8_u14", lib.lm_head_tc_splitk, (8, 14))]

    def launch(entry, arg, out, xs):
        e = entry(out.data_ptr(), xs.data_ptr(), w.data_ptr(), n, k, xs.shape[0], *arg, sp)
        if e:
            raise RuntimeError(f"lm_head_tc: CUDA error {e}")

    singles = {}   # each variant's one-column outputs
    for name, entry, arg in variants:
        for c in range(16):
            o1 = torch.empty(1, n, device="cuda")
            launch(entry, arg, o1, x[c:c + 1].contiguous())
            singles[name, c] = o1[0]
    for c in COLS:
        xs = x[:c].contiguous()
        ref = (xd := xs.double()) @ wd.T                                  # [c, n]
        scale = (w2 @ (xd ** 2).T).T.sqrt() + ref.abs()
        out_f = torch.full((c, n), float("nan"), device="cuda")
        o.gemv_fp16(out_f, xs, w)
        row = dict(cols=c, csrc_us=timed(lambda: o.gemv_fp16(out_f, xs, w), stream))
        row["csrc_err"] = float((out_f.double() - ref).norm() / scale.norm())
        for name, entry, arg in variants:
            out_t = torch.full((c, n), float("nan"), device="cuda")
            launch(entry, arg, out_t, xs)
            row[f"{name}_us"] = timed(lambda: launch(entry, arg, out_t, xs), stream)
            row[f"{name}_err"] = float((out_t.double() - ref).norm() / scale.norm())
            row[f"{name}_columns_bit_identical"] = all(torch.equal(out_t[i], singles[name, i])
                                                       for i in range(c))
            row[f"{name}_argmax_differs"] = int((out_t.argmax(1) != out_f.argmax(1)).sum())
        rows.append(row)
        print(" ".join(f"{key}={val:.3g}" if isinstance(val, float) else f"{key}={val}"
                       for key, val in row.items()), flush=True)
        del ref, scale
    # the loads alone, in each kernel's shape (lm_head_read; session 16's question)
    sink = torch.empty(32 * n, dtype=torch.int32, device="cuda")
    reads = {}
    for pattern, name in ((0, "tile_loads_us"), (1, "row_loads_us")):
        def read(pattern=pattern):
            e = lib.lm_head_read(sink.data_ptr(), w.data_ptr(), n, k, pattern, sp)
            if e:
                raise RuntimeError(f"lm_head_read: CUDA error {e}")
        reads[name] = timed(read, stream)
    print(" ".join(f"{key}={val:.3g}" for key, val in reads.items()), flush=True)
    out = dict(bench="lab/lm_head_tc", device=torch.cuda.get_device_name(), n=n, k=k,
               date=time.strftime("%Y-%m-%d"), rows=rows, loads_only=reads)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
