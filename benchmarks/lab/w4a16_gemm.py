"""The W4A16 prefill GEMM (w4a16_gemm_lab.cu) against today's prefill GEMMs, per 7B projection.

    python benchmarks/lab/w4a16_gemm.py [--preset 7b] [--json FILE]

For each projection of the preset (qkv with bias, o_proj into the fp32 residual, gate/up with
SiLU*mul, down_proj into the residual) at m = 40 (a next turn), 512 and 2048 prompt tokens, random
weights (std 0.02) quantized by engine/quant.py and x ~ randn: each lab variant's time per launch
(bench_verify.us_per_launch: 20 back-to-back launches, median of 5 runs) against
  resident: torch's F.linear on the fp16 weight (the prefill with the resident copy; for gate/up
            also its fp32 SiLU*mul, as csrc/bindings.cpp's prefill does), and
  dequant:  the product's dequant_int4 of the layer's matrix, then the same F.linear (the prefill
            without the copy: 24.5 ms TTFT 512 at 7B on the H200 against 15.7).
Correctness of every variant at m = 1, 15, 17, 100, 511 and the timed m: against fp32 math on
the same fp16 weights (the kernel forms q*s exactly as dequant_int4 does), error =
max|out - ref| / max|ref|; the kernel's sums are fp32 in another order and its output rounded
to half, so the bound is 2e-3 (half's relative rounding 4.9e-4, with margin for the sums).

Prediction (written before the first run, session 17): the mma.sync kernels peak near 60-65% of
the H100's dense fp16 rate (~600 TFLOPS for cuBLAS' wgmma kernels at these shapes), the dequant
and B-fragment loads taking issue slots: at m = 512 the best variant 1.3-1.8x the resident
F.linear's time per layer and 0.7-1.0x the dequant path's (whose dequant alone writes 0.47 GB a
layer at 7B: ~0.2 ms); at m = 40 faster than both (the weights' 0.12 GB a layer bound it, read once
instead of dequantized and reread).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch

LAB = Path(__file__).resolve().parent
sys.path.insert(0, str(LAB.parent))
sys.path.insert(0, str(LAB))   # lab.py before the benchmarks/lab directory
from bench_verify import us_per_launch as timed  # noqa: E402  (benchmarks/, one timing helper)
from lab import compile_alone  # noqa: E402

TOL = 2e-3
CHECK_M = (1, 15, 17, 100, 511)
OPS = {"store": 0, "resid": 1, "silu": 2}


def build() -> ctypes.CDLL:
    lib = compile_alone("w4a16_gemm_lab.cu")
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.w4a16_gemm.argtypes = [I, I, P, P, P, P, P, P, P, I, I, I, P]
    lib.w4a16_gemm.restype = I
    lib.w4a16_num_variants.restype = I
    lib.w4a16_variant_name.argtypes = [I]
    lib.w4a16_variant_name.restype = ctypes.c_char_p
    return lib


def quantized(n: int, k: int, gen: torch.Generator):
    from nanoqwen.engine.quant import quantize
    from nanoqwen.engine.ops import dequant_int4

    w = torch.randn(n, k, generator=gen, device="cuda") * 0.02
    qw, sc = quantize(w)
    return qw.contiguous(), sc.contiguous(), dequant_int4(qw, sc)   # fp16 [n, k]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--m", default="40,512,2048")
    ap.add_argument("--variants", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from nanoqwen.engine.build import load_extension
    from nanoqwen.engine.config import ModelConfig
    from nanoqwen.engine.ops import dequant_int4

    load_extension()
    lib = build()
    names = [lib.w4a16_variant_name(i).decode() for i in range(lib.w4a16_num_variants())]
    wanted = None if args.variants is None else args.variants.split(",")
    pick = [i for i, nm in enumerate(names) if wanted is None or nm in wanted]
    cfg = ModelConfig.from_name(args.preset)
    H, I = cfg.hidden_size, cfg.intermediate_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    stream = torch.cuda.current_stream()
    sp = ctypes.c_void_p(stream.cuda_stream)
    F = torch.nn.functional
    ms = [int(v) for v in args.m.split(",")]

    # (name, op, n, k, matrices)
    qkv = quantized(cfg.q_size + 2 * cfg.kv_size, H, gen)
    bias = (torch.randn(cfg.q_size + 2 * cfg.kv_size, generator=gen, device="cuda") * 0.1).half()
    projs = [("qkv", "store", qkv[0].shape[0], H, [qkv]),
             ("o", "resid", H, cfg.q_size, [quantized(H, cfg.q_size, gen)]),
             ("gate_up", "silu", I, H, [quantized(I, H, gen), quantized(I, H, gen)]),
             ("down", "resid", H, I, [quantized(H, I, gen)])]

    def call(v, op, out, x, mats, n, k, b=None):
        (qw, sc, _), (qw2, sc2, _) = mats[0], mats[-1]
        e = lib.w4a16_gemm(v, OPS[op], out.data_ptr(), x.data_ptr(), qw.data_ptr(), sc.data_ptr(),
                           qw2.data_ptr(), sc2.data_ptr(), b.data_ptr() if b is not None else None,
                           x.shape[0], n, k, sp)
        if e:
            raise RuntimeError(f"w4a16_gemm {names[v]} {op} m={x.shape[0]} n={n} k={k}: "
                               f"CUDA error {e}")

    def reference(op, x, mats, b, resid):
        xf = x.float()
        if op == "silu":
            gt = xf @ mats[0][2].float().T
            up = xf @ mats[1][2].float().T
            return (gt * torch.sigmoid(gt) * up).half().float()
        y = xf @ mats[0][2].float().T
        if op == "store":
            return (y + b.float()).half().float()
        return resid + y

    def run_one(v, op, x, mats, n, k, b, resid):
        if op == "resid":
            out = resid.clone()
        else:
            out = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=torch.half)
        call(v, op, out, x, mats, n, k, b)
        return out

    rows = []
    errors = {}
    for pname, op, n, k, mats in projs:
        b = bias if op == "store" else None
        for m in sorted(set(CHECK_M) | set(ms)):
            x = torch.randn(m, k, generator=gen, device="cuda").half()
            resid = torch.randn(m, n, generator=gen, device="cuda")
            ref = reference(op, x, mats, b, resid)
            for v in pick:
                out = run_one(v, op, x, mats, n, k, b, resid).float()
                err = float((out - ref).abs().max() / ref.abs().max())
                if not torch.isfinite(out).all():
                    err = float("inf")
                errors[names[v], pname, m] = err
                if err > TOL:
                    print(f"FAIL {names[v]} {pname} m={m}: error {err:.3g} > {TOL}", flush=True)
        for m in ms:
            x = torch.randn(m, k, generator=gen, device="cuda").half()
            resid = torch.randn(m, n, generator=gen, device="cuda")
            row = dict(proj=pname, m=m, n=n, k=k)
            wds = [mt[2] for mt in mats]
            dq_out = [torch.empty_like(w) for w in wds]

            def resident():
                if op == "silu":
                    g_, u_ = F.linear(x, wds[0]).float(), F.linear(x, wds[1]).float()
                    return (F.silu(g_) * u_).half()
                y = F.linear(x, wds[0], b)
                return resid.add_(y) if op == "resid" else y

            def dequant_path():
                for (qw, sc, _), o in zip(mats, dq_out):
                    dequant_int4(qw, sc, o)
                if op == "silu":
                    g_, u_ = F.linear(x, dq_out[0]).float(), F.linear(x, dq_out[1]).float()
                    return (F.silu(g_) * u_).half()
                y = F.linear(x, dq_out[0], b)
                return resid.add_(y) if op == "resid" else y

            flops = 2.0 * m * n * k * len(mats)
            row["resident_us"] = timed(resident, stream)
            row["dequant_us"] = timed(dequant_path, stream)
            out = resid.clone() if op == "resid" else \
                torch.empty(m, n, device="cuda", dtype=torch.half)
            for v in pick:
                row[f"{names[v]}_us"] = timed(lambda: call(v, op, out, x, mats, n, k, b), stream)
            best = min(pick, key=lambda v: row[f"{names[v]}_us"])
            row["best"] = names[best]
            row["best_us"] = row[f"{names[best]}_us"]
            row["best_tflops"] = flops / row["best_us"] / 1e6
            row["resident_tflops"] = flops / row["resident_us"] / 1e6
            rows.append(row)
            print(" ".join(f"{kk}={vv:.4g}" if isinstance(vv, float) else f"{kk}={vv}"
                           for kk, vv in row.items()), flush=True)
    # per layer: the four projections summed, each with its best variant and with one variant
    layer = {}
    for m in ms:
        rs = [r for r in rows if r["m"] == m]
        d = dict(resident_us=sum(r["resident_us"] for r in rs),
                 dequant_us=sum(r["dequant_us"] for r in rs),
                 best_us=sum(r["best_us"] for r in rs))
        for v in pick:
            d[f"{names[v]}_us"] = sum(r[f"{names[v]}_us"] for r in rs)
        layer[m] = d
        print(f"per layer m={m}: " + " ".join(f"{kk}={vv:.1f}" for kk, vv in d.items()), flush=True)
    worst = max(errors.values())
    print(f"largest error over all variants, projections and m: {worst:.3g} (bound {TOL})")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), preset=args.preset,
            variants=[names[v] for v in pick],
            rows=rows, per_layer=layer, largest_error=worst, tol=TOL,
            errors={f"{a}|{b}|{c}": e for (a, b, c), e in errors.items()}), indent=1))
    return 0 if worst <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())
