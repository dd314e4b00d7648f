"""The verify step's lm_head at 2-16 columns, rows a warp (lm_head_cols_lab.cu) against csrc's
gemv_fp16, with every column checked bit-identical to csrc's one-column call (the decode step's).

    python benchmarks/lab/lm_head_cols.py [--json FILE]

At the 7B's lm_head (152064 x 3584 fp16, std 0.02) and x [16, 3584] (randn): us per launch
(bench_verify.us_per_launch: 20 back-to-back launches, median of 5 runs) for cols 1, 2, 4, 5, 8,
9, 12, 16 of csrc and of each variant that takes that many columns; then each variant's columns
against csrc's one-column outputs with torch.equal, at the 7B shape and at ragged ones (n not a
multiple of any R; k = 896, 264 and 8: lanes with fewer chunks than others, and fewer chunks than
lanes).

Prediction (written before the first run, session 30): csrc 342 / 358 / 599 / 1294 us at 1 / 4 / 8
/ 16 columns (session 15's figures). A warp owning R = 4 rows needs ~11 instructions a weight at 8
columns against csrc's ~18 (an x chunk's load and conversion serve R rows), about 210 us of issue
on an H100 against the 1.09 GB's ~335 us at the copy rate, so the best variant reads at close to
the copy rate: 345-380 us at 5-8 columns, and at 16 columns (R = 2, 16 FMAs a weight, ~300 us of
FMA issue alone) 420-520 us. The register-ring variants keep only R*U*512 B a warp in flight with
1-2 blocks an SM, which may not cover DRAM's latency; the cp.async rings hold 64-128 KB an SM
without registers, so a ring variant is expected to win at 8 columns. Every column bit-identical.
Measured (session 30, H100; RESULTS.md): every column bit-identical; the best at 8 columns 402 us
(the exactly-NC ring, now the product's), at 16 columns 907 (4 rows a warp; 2 rows: 1245, no
better than csrc's one row a warp). The prediction missed at both.
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
sys.path.insert(0, str(LAB))
from bench_verify import us_per_launch as timed  # noqa: E402
COLS = (1, 2, 4, 5, 6, 8, 9, 12, 16)
SHAPES = ((152064, 3584), (19013, 896), (1001, 264), (37, 8))   # bit-identity checks


def build() -> ctypes.CDLL:
    from lab import compile_alone

    lib = compile_alone("lm_head_cols_lab.cu", show=lambda line: "registers" in line
                        or "spill" in line and not line.strip().startswith("0 bytes stack"))
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.lm_head_cols.argtypes = [I, P, P, P, I, I, I, P]
    lib.lm_head_cols.restype = I
    lib.lm_head_cols_name.restype = ctypes.c_char_p
    lib.lm_head_cols_name.argtypes = [I]
    lib.lm_head_cols_max.argtypes = [I]
    lib.lm_head_cols_max.restype = I
    lib.lm_head_cols_count.restype = I
    lib.lm_head_cols_exact.argtypes = [I]
    lib.lm_head_cols_exact.restype = I
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from nanoqwen.engine.build import load_extension

    load_extension()
    lib = build()
    o = torch.ops.nanoqwen
    stream = torch.cuda.current_stream()
    sp = ctypes.c_void_p(stream.cuda_stream)
    variants = [(v, lib.lm_head_cols_name(v).decode(), lib.lm_head_cols_max(v))
                for v in range(lib.lm_head_cols_count())]
    exact = {v for v, _, _ in variants if lib.lm_head_cols_exact(v)}

    def takes(v, mx, c):   # the exactly-NC instances take NC columns only
        return c == mx if v in exact else c <= mx

    def launch(v, out, xs, w):
        e = lib.lm_head_cols(v, out.data_ptr(), xs.data_ptr(), w.data_ptr(), w.shape[0],
                             w.shape[1], xs.shape[0], sp)
        if e:
            raise RuntimeError(f"lm_head_cols variant {v}: CUDA error {e}")

    gen = torch.Generator(device="cuda").manual_seed(0)
    identical = {name: True for _, name, _ in variants}
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).half()
        x = torch.randn(16, k, generator=gen, device="cuda").half()
        ones = torch.empty(16, n, device="cuda")
        for c in range(16):
            o.gemv_fp16(ones[c], x[c], w)
        for v, name, mx in variants:
            for c in (2, 5, 8, 12, 16):
                if not takes(v, mx, c):
                    continue
                out = torch.full((c, n), float("nan"), device="cuda")
                launch(v, out, x[:c].contiguous(), w)
                if not torch.equal(out, ones[:c]):
                    bad = [i for i in range(c) if not torch.equal(out[i], ones[i])]
                    print(f"NOT IDENTICAL: {name} n={n} k={k} cols={c} columns {bad}", flush=True)
                    identical[name] = False
    print("bit-identical to csrc's one-column calls:", identical, flush=True)

    n, k = SHAPES[0]
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).half()
    x = torch.randn(16, k, generator=gen, device="cuda").half()
    rows = []
    for c in COLS:
        xs = x[:c].contiguous()
        out = torch.empty(c, n, device="cuda")
        row = dict(cols=c, csrc_us=timed(lambda: o.gemv_fp16(out, xs, w), stream))
        for v, name, mx in variants:
            if takes(v, mx, c):
                row[f"{name}_us"] = timed(lambda: launch(v, out, xs, w), stream)
        rows.append(row)
        print(" ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}"
                       for key, val in row.items()), flush=True)
    res = dict(bench="lab/lm_head_cols", device=torch.cuda.get_device_name(), n=n, k=k,
               date=time.strftime("%Y-%m-%d"), bit_identical=identical, rows=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
