"""The one-column INT4 decode GEMVs at every family preset's shapes: the product's instance
(kInt4Table, chosen at the 7B's shapes) against other K splits and rings of the same kernel
(gemv_int4_family_lab.cu), each in the decode step's form (qkv: folded norm + bias; o and down:
residual add + parts; gate/up: folded norm + SiLU * up).

    python benchmarks/lab/gemv_int4_family.py [--presets 0.5b,1.5b,...] [--json FILE]

Timing: a CUDA graph of 50 back-to-back launches (PDL, as in the step), each launch on the next
of C weight copies with C * bytes >= 200 MB (4x the L2: the step reads every layer's weights
from DRAM once a token), median of 7 replays (bench_attention.time_graph); us per launch.
Checks: every variant's output against the product op's on the same inputs, relative L2 error
<= 1e-5 for the residual (fp32 out: only the split's summation order differs, fp32 sums of ~k
products), <= 2e-3 for the half outputs (one half rounding, ~3e-4 rms, and order), parts of o /
down likewise <= 1e-5.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import time
from pathlib import Path

import torch

LAB = Path(__file__).resolve().parent
sys.path.insert(0, str(LAB.parent))
sys.path.insert(0, str(LAB))
from bench_attention import time_graph  # noqa: E402


def build() -> ctypes.CDLL:
    from lab import compile_alone

    lib = compile_alone("gemv_int4_family_lab.cu")
    P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.family_count.restype = I
    lib.family_shape.argtypes = [I, ctypes.POINTER(I)]
    lib.family_launch.argtypes = [I, P, P, P, P, P, P, P, I, I, P, P, P, F, P, P]
    lib.family_launch.restype = I
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="0.5b,1.5b,3b,7b,14b,32b")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from nanoqwen.engine.build import load_extension
    from nanoqwen.engine.config import ModelConfig

    load_extension()
    lib = build()
    o = torch.ops.nanoqwen
    variants = []
    for v in range(lib.family_count()):
        s = (ctypes.c_int * 4)()
        lib.family_shape(v, s)
        variants.append((v, s[0], f"K{s[1]}S{s[2]}G{s[3]}"))
    dev, gen = "cuda", torch.Generator(device="cuda").manual_seed(0)
    eps = 1e-6
    rows, ok = [], True
    for preset in args.presets.split(","):
        cfg = ModelConfig.from_name(preset)
        H, I = cfg.hidden_size, cfg.intermediate_size
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for name, op, n, k in (("qkv", 0, (nh + 2 * nkv) * d, H), ("o", 1, H, nh * d),
                               ("gate/up", 2, I, H), ("down", 1, H, I)):
            nm = 2 if op == 2 else 1
            nbytes = nm * (n * k // 2 + n * (k // 128) * 2)
            C = max(2, min(64, math.ceil(200e6 / nbytes)))
            qw = [torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=gen, device=dev,
                                dtype=torch.int32) for _ in range(C * nm)]
            sc = [(torch.rand(n, k // 128, generator=gen, device=dev) * 0.02 + 0.001).half()
                  for _ in range(C * nm)]
            hid = torch.randn(k, generator=gen, device=dev)
            parts = hid.view(-1, 16).pow(2).sum(1)
            ln = (torch.rand(k, generator=gen, device=dev) + 0.5).half()
            bias = (torch.randn(n, generator=gen, device=dev) * 0.1).half()
            x = torch.randn(1, k, generator=gen, device=dev).half()
            hidden0 = torch.randn(1, n, generator=gen, device=dev)
            out = hidden0.clone() if op == 1 else torch.empty(n, dtype=torch.float16, device=dev)
            pout = torch.zeros((n + 15) // 16, device=dev)
            sp = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731

            def product(i):
                j = (i % C) * nm
                if op == 0:
                    o.gemv_int4_norm(out, hid, parts, ln, eps, qw[j], sc[j], bias)
                elif op == 1:
                    o.gemv_int4_residual(out, x, qw[j], sc[j], pout)
                else:
                    o.gemv_int4_silu_mul_norm(out, hid, parts, ln, eps, qw[j], sc[j],
                                              qw[j + 1], sc[j + 1])

            def lab(v, i):
                j = (i % C) * nm
                e = lib.family_launch(v, out.data_ptr(), x.data_ptr(), qw[j].data_ptr(),
                                      sc[j].data_ptr(), qw[j + nm - 1].data_ptr(),
                                      sc[j + nm - 1].data_ptr(), bias.data_ptr(), n, k,
                                      hid.data_ptr(), parts.data_ptr(), ln.data_ptr(), eps,
                                      pout.data_ptr(), sp())
                if e:
                    raise RuntimeError(f"variant {v}: CUDA error {e}")

            def run_once(fn):
                out.copy_(hidden0.view_as(out) if op == 1 else torch.zeros_like(out))
                pout.zero_()
                fn(0)
                torch.cuda.synchronize()
                return out.float().clone(), pout.clone()

            with torch.inference_mode():
                ref, pref = run_once(product)
                row = dict(preset=preset, op=name, n=n, k=k, copies=C,
                           product_us=time_graph(product))
                for v, vop, vname in variants:
                    if vop != op:
                        continue
                    try:
                        got, pgot = run_once(lambda i: lab(v, i))
                    except RuntimeError as e:   # a shape the instance cannot take (smem)
                        row[vname] = None
                        print(f"  {preset} {name} {vname}: {e}", flush=True)
                        continue
                    tol = 1e-5 if op == 1 else 2e-3
                    err = ((got - ref).norm() / ref.norm()).item()
                    perr = ((pgot - pref).norm() / pref.norm().clamp_min(1e-30)).item() if op == 1 else 0.0
                    if not (err <= tol and perr <= 1e-5):
                        print(f"MISMATCH {preset} {name} {vname}: rel err {err:.3g}, parts {perr:.3g}",
                              flush=True)
                        ok = False
                    row[vname] = time_graph(lambda i: lab(v, i))
            qw.clear()
            sc.clear()
            torch.cuda.empty_cache()
            rows.append(row)
            best = min((val, key) for key, val in row.items()
                       if key not in ("preset", "op", "n", "k", "copies") and val is not None)
            print(f"{preset:5s} {name:8s} n={n:6d} k={k:6d} product {row['product_us']:7.2f} us | "
                  + " ".join(f"{key} {val:.2f}" for key, val in row.items()
                             if key[0] == "K" and val is not None)
                  + f" | best {best[1]} {best[0]:.2f}", flush=True)
    res = dict(bench="lab/gemv_int4_family", device=torch.cuda.get_device_name(),
               date=time.strftime("%Y-%m-%d"), all_within_tolerance=ok, rows=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
