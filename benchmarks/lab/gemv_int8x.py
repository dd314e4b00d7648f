"""INT8 against fp16 activations in the decode GEMV (gemv_int8x_lab.cu; issue 12 item 4).

    python benchmarks/lab/gemv_int8x.py [--json FILE]     # GPU: check, time, error
    python benchmarks/lab/gemv_int8x.py --emulate         # CPU: the int8 path's byte order

At the four 7B decode GEMVs (qkv 4608x3584 +bias, o_proj 3584x3584 and down_proj 3584x18944 into
the fp32 residual, gate/up 2x18944x3584 with SiLU*mul), random weights (quant.quantize of std
0.02) and x ~ randn, and again with outliers (x[:8] = +-60, as massive activations): per GEMV
the time per launch (bench_verify.us_per_launch: 20 back-to-back launches, median of 5) of
  csrc     torch.ops.nanoqwen's product GEMV,
  fp16     the lab's copy of it (MATH 0: must time and compute as csrc does -- the control),
  int8     MATH 1, plus int8x_quantize (its own launch: x -> x8, group sums, scale),
and each one's error against fp64 (test_gemv.py's measure: ||out - ref|| / ||sqrt(sum_k (w x)^2)
+ |ref|||).

Prediction (written before any run, session 17): the decode GEMVs read their weights at 70-82%
of the copy bandwidth and the fp16 math is hidden behind the loads, so int8 saves no time on the
GEMV itself (within +-3% of fp16) and the quantize launch adds ~2-3 us per GEMV input (x is
shared by qkv / gate-up, so 2 launches a layer): slower end to end. Its error: x8's rounding,
~1/254 of max|x| per element: ~2e-3 scaled error on randn x (fp16: ~3e-4, the output rounding),
and ~5e-2 with outliers (the scale is set by the outlier). So the fp16 activations stay; the
INT8 path is the loser that leaves (it is not in the product) unless the run says otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

LAB = Path(__file__).resolve().parent
sys.path.insert(0, str(LAB.parent))
sys.path.insert(0, str(LAB))   # lab.py before the benchmarks/lab directory

NIBBLE_POS = (0, 2, 4, 6, 1, 3, 5, 7)   # quant.py ORDER: nibble p holds in-word k ORDER[p]
BYTE_POS = (0, 2, 4, 6, 1, 3, 5, 7)     # x8: in-word k -> byte position (k0 k4 k1 k5 k2 k6 k3 k7)


def emulate() -> int:
    """The int8 path's data layout on the CPU: one 16-row tile, one group, lane by lane with
    mma.m16n8k32 u8.s8's fragment layouts (PTX ISA: a0..a3 = (g, 4t..4t+3), (g+8, 4t..),
    (g, 4t+16..), (g+8, 4t+16..); b0, b1 = (4t.., g), (4t+16.., g); d0, d2 = (g, 2t), (g+8, 2t)),
    the weight words as engine/quant.py packs them, x8 as the quantizer stores it."""
    import numpy as np
    import torch

    from nanoqwen.engine.quant import pack_codes

    rng = np.random.default_rng(0)
    codes = rng.integers(1, 16, size=(16, 128))
    words = pack_codes(torch.from_numpy(codes)).numpy().view(np.uint32)   # [16, 16]
    x8 = rng.integers(-127, 128, size=128)
    stored = np.zeros(128, dtype=np.int8)
    for k in range(128):
        stored[8 * (k // 8) + BYTE_POS[k % 8]] = x8[k]
    xsum = int(x8.sum())
    d = np.zeros((32, 4), dtype=np.int64)
    for j in range(4):          # the group's four mmas (word j of each lane's chunk)
        A = np.zeros((16, 32), dtype=np.int64)
        B = np.zeros((32, 8), dtype=np.int64)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for r, row in ((0, g), (1, g + 8)):
                w = int(words[row, 4 * t + j])
                lo, hi = w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F
                for i in range(4):
                    A[row, 4 * t + i] = (lo >> (8 * i)) & 0xFF
                    A[row, 4 * t + 16 + i] = (hi >> (8 * i)) & 0xFF
            xb = stored[32 * t + 8 * j: 32 * t + 8 * j + 8]
            for i in range(4):
                B[4 * t + i, g] = xb[i]
                B[4 * t + 16 + i, g] = xb[4 + i]
        D = A @ B
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            d[lane] += (D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1])
    want = (codes - 8) @ x8
    got = np.array([d[4 * (r % 8), 0 if r < 8 else 2] - 8 * xsum for r in range(16)])
    ok = bool((got == want).all())
    print("int8 path's byte order and fragment layout, emulated: rows exact:", ok)
    return 0 if ok else 1


def build() -> ctypes.CDLL:
    from lab import compile_alone

    lib = compile_alone("gemv_int8x_lab.cu")
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.int8x_quantize.argtypes = [P, P, P, P, I, P]
    lib.int8x_quantize.restype = I
    lib.int8x_gemv.argtypes = [I, I, P, P, P, P, P, P, P, P, P, I, I, P]
    lib.int8x_gemv.restype = I
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--emulate", action="store_true", help="the CPU check only")
    a = ap.parse_args(argv)
    if a.emulate:
        return emulate()
    import torch

    from bench_verify import us_per_launch as timed
    from nanoqwen.engine import quant
    from nanoqwen.engine.build import load_extension

    load_extension()
    lib = build()
    o = torch.ops.nanoqwen
    gen = torch.Generator(device="cuda").manual_seed(0)
    stream = torch.cuda.current_stream()
    sp = ctypes.c_void_p(stream.cuda_stream)

    def mat(n, k):
        w = torch.randn(n, k, generator=gen, device="cuda") * 0.02
        qw, sc = quant.quantize(w)
        return qw, sc, quant.dequantize(qw.cpu(), sc.cpu(), torch.float32).cuda().double()

    def ptr(t):
        return ctypes.c_void_p(t.data_ptr()) if t is not None else None

    rows = []
    for name, op, n, k in (("qkv", 0, 4608, 3584), ("o_proj", 1, 3584, 3584),
                           ("gate/up", 2, 18944, 3584), ("down_proj", 1, 3584, 18944)):
        m1 = mat(n, k)
        m2 = mat(n, k) if op == 2 else m1
        bias = (torch.randn(n, generator=gen, device="cuda") * 0.1).half() if op == 0 else None
        x8 = torch.empty(k, dtype=torch.int8, device="cuda")
        xsum = torch.empty(k // 128, dtype=torch.int32, device="cuda")
        sx = torch.empty(1, dtype=torch.float32, device="cuda")
        for case in ("randn", "outliers"):
            x = torch.randn(k, generator=gen, device="cuda")
            if case == "outliers":
                x[:8] = torch.tensor([60.0, -60.0] * 4, device="cuda")
            x = x.half()
            xd = x.double()
            if op == 2:
                gv, uv = m1[2] @ xd, m2[2] @ xd
                ref = torch.nn.functional.silu(gv) * uv
            else:
                ref = m1[2] @ xd + (bias.double() if bias is not None else 0)
            scale = ((m1[2] ** 2) @ (xd ** 2)).sqrt() + ref.abs()
            h0 = torch.randn(n, generator=gen, device="cuda")

            def fresh():
                return h0.clone() if op == 1 else torch.empty(n, dtype=torch.half, device="cuda")

            def csrc(out):
                if op == 0:
                    o.gemv_int4(out, x, m1[0], m1[1], bias)
                elif op == 1:
                    o.gemv_int4_residual(out, x, m1[0], m1[1])
                else:
                    o.gemv_int4_silu_mul(out, x, m1[0], m1[1], m2[0], m2[1])

            def lab(math, out):
                if math:
                    e = lib.int8x_quantize(ptr(x8), ptr(xsum), ptr(sx), ptr(x), k, sp)
                    if e:
                        raise RuntimeError(f"int8x_quantize: CUDA error {e}")
                e = lib.int8x_gemv(math, op, ptr(out), ptr(x8 if math else x), ptr(xsum),
                                   ptr(sx), ptr(m1[0]), ptr(m1[1]), ptr(m2[0]), ptr(m2[1]),
                                   ptr(bias), n, k, sp)
                if e:
                    raise RuntimeError(f"int8x_gemv {name} math {math}: CUDA error {e}")

            row = dict(gemv=name, n=n, k=k, x=case)
            for label, fn in (("csrc", csrc), ("fp16", lambda out: lab(0, out)),
                              ("int8", lambda out: lab(1, out))):
                out = fresh()
                fn(out)
                torch.cuda.synchronize()
                got = (out.double() - h0.double()) if op == 1 else out.double()
                row[f"{label}_err"] = float((got - ref).norm() / scale.norm())
                buf = fresh()
                row[f"{label}_us"] = timed(lambda: fn(buf), stream)
            row["quantize_us"] = timed(lambda: lib.int8x_quantize(ptr(x8), ptr(xsum), ptr(sx),
                                                                  ptr(x), k, sp), stream)
            rows.append(row)
            print(" ".join(f"{kk}={v:.3g}" if isinstance(v, float) else f"{kk}={v}"
                           for kk, v in row.items()), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows),
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
