"""The product's prefill GEMM kernel at other block shapes (gemm_int4_shapes.cu includes
csrc/gemm_int4.cu), against cuBLAS on the resident fp16 weights and the dequant path.

    python benchmarks/lab/gemm_int4_shapes.py [--preset 7b] [--m 1,8,...,2048] [--json F]

Per 7B projection (qkv with bias, o_proj into the fp32 residual, gate/up with SiLU*mul, down_proj
into the residual), random weights (std 0.02, quantized by engine/quant.py), x ~ randn: every
variant's us per launch with split-K scratch as the engine gives it (bench_verify.us_per_launch:
20 back-to-back launches, median of 5), resident (F.linear on the fp16 weight; gate/up + fp32
SiLU*mul) and dequant (dequant_int4, then the same). Correctness of every variant at every m:
max|out - ref| / max|ref| against fp32 math on the same fp16 weights, bound 2e-3 (half's
rounding 4.9e-4, sums in another order). Per layer: the four summed, per variant and the best.

Prediction (written before the first run, session 18): the product's shapes stream the weights at
~1 TB/s at m = 1 (3x under the decode GEMV) because each stage reads 64 B of 128 rows spread
1.8 KB apart (row-major INT4), so two groups a stage (128 B runs) take 20-35% off at m <= 64 and
8-token tiles (b1) another 10-20% at m <= 8; m = 512 stays ~2x cuBLAS (the mma.sync issue rate).
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
sys.path.insert(0, str(LAB))
from bench_gemm_int4 import fp16_paths, projections  # noqa: E402  (benchmarks/)
from bench_verify import us_per_launch as timed  # noqa: E402
from lab import compile_alone  # noqa: E402

TOL = 2e-3
OPS = {"store": 0, "resid": 1, "silu": 2}


def build() -> ctypes.CDLL:
    lib = compile_alone("gemm_int4_shapes.cu")
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.gi4_gemm.argtypes = [I, I, P, P, P, P, P, P, P, I, I, I, P, L, P, P]
    lib.gi4_gemm.restype = I
    lib.gi4_count.restype = I
    lib.gi4_name.argtypes = [I]
    lib.gi4_name.restype = ctypes.c_char_p
    lib.gi4_error.restype = ctypes.c_char_p
    lib.gi4_scratch_floats.argtypes = [I, I, I, I, I]
    lib.gi4_scratch_floats.restype = L
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--m", default="1,8,16,40,64,128,512,2048")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from nanoqwen.engine.build import load_extension
    from nanoqwen.engine.config import ModelConfig
    from nanoqwen.engine.ops import dequant_int4

    load_extension()
    lib = build()
    names = [lib.gi4_name(i).decode() for i in range(lib.gi4_count())]
    cfg = ModelConfig.from_name(args.preset)
    gen = torch.Generator(device="cuda").manual_seed(0)
    stream = torch.cuda.current_stream()
    sp = ctypes.c_void_p(stream.cuda_stream)
    projs, bias = projections(cfg, gen, dequant_int4)
    counters = torch.zeros(1024, dtype=torch.int32, device="cuda")
    rows, worst = [], 0.0
    for m in [int(v) for v in args.m.split(",")]:
        for pname, op, n, k, mats in projs:
            x = torch.randn(m, k, generator=gen, device="cuda").half()
            resid = torch.randn(m, n, generator=gen, device="cuda")
            b = bias if op == "store" else None
            wds = [mt[2] for mt in mats]
            xf = x.float()
            if op == "silu":
                gt, up = xf @ wds[0].float().T, xf @ wds[1].float().T
                ref = gt * torch.sigmoid(gt) * up
            else:
                ref = xf @ wds[0].float().T + (b.float() if b is not None else 0)
            row = dict(proj=pname, m=m, n=n, k=k)

            def call(v, out, part):
                (qw, sc, _), (qw2, sc2, _) = mats[0], mats[-1]
                e = lib.gi4_gemm(v, OPS[op], out.data_ptr(), x.data_ptr(), qw.data_ptr(),
                                 sc.data_ptr(), qw2.data_ptr(), sc2.data_ptr(),
                                 b.data_ptr() if b is not None else None, m, n, k,
                                 part.data_ptr() if part is not None else None,
                                 part.numel() if part is not None else 0, counters.data_ptr(), sp)
                if e:
                    raise RuntimeError(f"{names[v]} {pname} m={m}: {lib.gi4_error().decode()}")

            for v, nm in enumerate(names):
                fl = lib.gi4_scratch_floats(v, OPS[op], m, n, k)
                part = torch.empty(fl, device="cuda") if fl else None
                out = torch.zeros(m, n, device="cuda") if op == "resid" else \
                    torch.full((m, n), float("nan"), device="cuda", dtype=torch.half)
                call(v, out, part)
                err = float((out.float() - ref).abs().max() / ref.abs().max())
                if not torch.isfinite(out).all():
                    err = float("inf")
                worst = max(worst, err)
                if err > TOL:
                    print(f"FAIL {nm} {pname} m={m}: error {err:.3g}", flush=True)
                row[f"{nm}_us"] = timed(lambda: call(v, out, part), stream)
                row[f"{nm}_splits"] = int(fl // (m * (2 * n if op == 'silu' else n))) if fl else 1

            resident, dequant = fp16_paths(op, x, mats, bias, resid,
                                           torch.ops.nanoqwen.dequant_int4,
                                           torch.ops.nanoqwen.silu_mul)
            row["resident_us"] = timed(resident, stream)
            row["dequant_us"] = timed(dequant, stream)
            best = min(names, key=lambda nm: row[f"{nm}_us"])
            row["best"], row["best_us"] = best, row[f"{best}_us"]
            rows.append(row)
            print(f"{pname} m={m}: best {best} {row['best_us']:.1f} us, resident "
                  f"{row['resident_us']:.1f}, dequant {row['dequant_us']:.1f}; "
                  + " ".join(f"{nm}={row[nm + '_us']:.1f}" for nm in names), flush=True)
    layer = {}
    for m in sorted({r["m"] for r in rows}):
        rs = [r for r in rows if r["m"] == m]
        d = {w: sum(r[f"{w}_us"] for r in rs) for w in ["resident", "dequant", "best"] + names}
        layer[m] = d
        top = sorted(names, key=lambda nm: d[nm])[:3]
        print(f"per layer m={m}: resident {d['resident']:.1f} dequant {d['dequant']:.1f} "
              f"best-per-projection {d['best']:.1f}; best one shape: "
              + ", ".join(f"{nm} {d[nm]:.1f}" for nm in top), flush=True)
    print(f"largest error {worst:.3g} (bound {TOL})")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), preset=args.preset, variants=names, rows=rows,
            per_layer=layer, largest_error=worst, tol=TOL), indent=1))
    return 0 if worst <= TOL else 1


if __name__ == "__main__":
    raise SystemExit(main())
