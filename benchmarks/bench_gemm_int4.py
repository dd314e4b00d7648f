"""The product's prefill GEMM (csrc/gemm_int4.cu through torch.ops.nanoqwen) against the two
fp16 prefills, per projection of a preset and per prompt length m: where gemm_int4 should take a
prompt chunk (engine/switches.py's NANOQWEN_INT4_MAX_M).

    python benchmarks/bench_gemm_int4.py [--preset 7b] [--m 1,8,16,...,512] [--json F]

Per projection (qkv with bias, o_proj into the fp32 residual, gate/up with SiLU*mul, down_proj
into the residual), random weights (std 0.02, quantized by engine/quant.py), x ~ randn, us per
call (bench_verify.us_per_launch: 20 back-to-back calls, median of 5 runs):
  int4:     the op, as the engine's prefill calls it (split-K where the shape takes it; the op
            allocates its scratch and zeroes its counters each call, which the engine does not);
  resident: F.linear on the fp16 weight (gate/up: on the stacked pair, then the silu_mul op,
            as the prefill does; resident_aten_chain_us: the fp32 ATen chain it replaced);
  dequant:  dequant_int4 of the matrix, then the same F.linear (the prefill without the copy).
The per-layer sums say where int4 wins; m = 40 is a next turn. Correctness is tests/gpu's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_verify import us_per_launch as timed  # noqa: E402

F = torch.nn.functional


def projections(cfg, gen: torch.Generator, dequant, device="cuda"):
    """The preset's four prefill projections, random weights (std 0.02) quantized by
    engine/quant.py: ([(name, epilogue, n, k, mats)], qkv's bias), epilogue "store" (qkv, with
    the bias), "resid" (o, down: into the fp32 residual) or "silu" (gate/up: two matrices);
    mats [(qweight, scales, fp16 weight from `dequant`)]. Also lab/gemm_int4_shapes.py's."""
    from nanoqwen.engine.quant import quantize

    def mat(n, k):
        qw, sc = quantize(torch.randn(n, k, generator=gen, device=device) * 0.02)
        return qw.contiguous(), sc.contiguous(), dequant(qw, sc)

    H, I = cfg.hidden_size, cfg.intermediate_size
    nq = cfg.q_size + 2 * cfg.kv_size
    bias = (torch.randn(nq, generator=gen, device=device) * 0.1).half()
    return [("qkv", "store", nq, H, [mat(nq, H)]),
            ("o", "resid", H, cfg.q_size, [mat(H, cfg.q_size)]),
            ("gate_up", "silu", I, H, [mat(I, H), mat(I, H)]),
            ("down", "resid", H, I, [mat(H, I)])], bias


def fp16_paths(epilogue: str, x, mats, bias, resid, dequant_into, silu_mul=None):
    """(resident, dequant): one projection as the prefill runs it on fp16 weights -- F.linear
    on the fp16 weights (gate/up: one GEMM on the two matrices stacked, as the engine keeps
    them, then `silu_mul` -- the op the prefill launches -- or, when None, the ATen chain of fp32
    copies it replaced in session 21; o/down: added to `resid`), and the same after
    `dequant_into(out, qweight, scales)` of each matrix into scratch. Also the lab's."""
    if epilogue == "silu":
        n = mats[0][2].shape[0]
        scratch = [torch.empty(2 * n, mats[0][2].shape[1], dtype=torch.half, device=x.device)]
        halves = [scratch[0][:n], scratch[0][n:]]
        stacked = [torch.cat([mats[0][2], mats[1][2]])]
        act = torch.empty(x.shape[0], n, dtype=torch.half, device=x.device)
    else:
        halves = scratch = [torch.empty_like(mt[2]) for mt in mats]
        stacked = [mt[2] for mt in mats]

    def dense(wl):
        if epilogue == "silu":
            gu = F.linear(x, wl[0])
            if silu_mul is not None:
                silu_mul(act, gu)
                return act
            n = gu.shape[1] // 2
            gu = gu.float()
            return (F.silu(gu[:, :n]) * gu[:, n:]).half()
        out = F.linear(x, wl[0], bias if epilogue == "store" else None)
        return out if epilogue == "store" else resid.add_(out)

    def dequant():
        for (qw, sc, _), o in zip(mats, halves):
            dequant_into(o, qw, sc)
        return dense(scratch)

    return (lambda: dense(stacked)), dequant


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--m", default="1,8,16,32,40,64,96,128,256,512")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from nanoqwen.engine.bench import _commit
    from nanoqwen.engine.build import load_extension
    from nanoqwen.engine.config import ModelConfig
    from nanoqwen.engine.ops import dequant_int4

    load_extension()
    ops = torch.ops.nanoqwen
    cfg = ModelConfig.from_name(args.preset)
    gen = torch.Generator(device="cuda").manual_seed(0)
    stream = torch.cuda.current_stream()
    projs, bias = projections(cfg, gen, dequant_int4)
    rows = []
    for m in [int(v) for v in args.m.split(",")]:
        for name, epilogue, n, k, mats in projs:
            x = torch.randn(m, k, generator=gen, device="cuda").half()
            resid = torch.zeros(m, n, device="cuda")
            y = torch.empty(m, n, device="cuda", dtype=torch.half)

            def int4():
                if epilogue == "store":
                    ops.gemm_int4(y, x, mats[0][0], mats[0][1], bias)
                elif epilogue == "silu":
                    ops.gemm_int4_silu_mul(y, x, mats[0][0], mats[0][1], mats[1][0], mats[1][1])
                else:
                    ops.gemm_int4_residual(resid, x, mats[0][0], mats[0][1])

            resident, dequant = fp16_paths(epilogue, x, mats, bias, resid, ops.dequant_int4,
                                           ops.silu_mul)
            row = dict(proj=name, m=m, n=n, k=k, int4_us=timed(int4, stream),
                       resident_us=timed(resident, stream), dequant_us=timed(dequant, stream))
            if epilogue == "silu":   # the ATen chain the prefill ran before silu_mul
                chain, _ = fp16_paths(epilogue, x, mats, bias, resid, ops.dequant_int4)
                row["resident_aten_chain_us"] = timed(chain, stream)
            rows.append(row)
            print(" ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}"
                           for a, b in row.items()), flush=True)
    layer = {}
    for m in sorted({r["m"] for r in rows}):
        rs = [r for r in rows if r["m"] == m]
        layer[m] = {f"{w}_us": sum(r[f"{w}_us"] for r in rs)
                    for w in ("int4", "resident", "dequant")}
        print(f"per layer m={m}: " + " ".join(f"{a}={b:.1f}" for a, b in layer[m].items()),
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), preset=args.preset, commit=_commit(),
            date=time.strftime("%Y-%m-%d"), rows=rows, per_layer=layer), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
