"""The INT4 decode GEMVs at the 7B shapes, and the fp16 lm_head, each launched twice (warm-up,
then the one a profiler looks at), for Nsight Compute; --cols C runs them on C activation
columns (the verify step's instances, C = 2..16), --ops picks some of them:

    ncu --kernel-name regex:gemv_int4 --launch-skip 4 --launch-count 4 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python3 benchmarks/ncu_gemv.py [--cols 4] [--ops gate/up,down]

(--launch-skip and --launch-count: the number of ops run.) Order of the profiled launches: qkv
(gemv_int4), o (gemv_int4_residual, k 3584), gate/up (gemv_int4_silu_mul), down
(gemv_int4_residual, k 18944), lm_head (gemv_fp16: at 5-16 columns gemv_fp16_rows_kernel, so
`--kernel-name regex:gemv_fp16` for it), those --ops names. Random weights (std 0.02). lm_head is
not in the default set (--ops lm_head asks for it): its 1.09 GB weight takes a while to make.
"""

from __future__ import annotations

import argparse

import torch

OPS = ("qkv", "o", "gate/up", "down", "lm_head")
DEFAULT_OPS = OPS[:4]


def main(argv=None) -> None:
    from nanoqwen.engine.ops import _ops
    from nanoqwen.engine.quant import quantize

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cols", type=int, default=1, help="activation columns (1..16)")
    ap.add_argument("--ops", default=",".join(DEFAULT_OPS),
                    help="comma-separated, from " + ", ".join(OPS))
    a = ap.parse_args(argv)
    ops = a.ops.split(",")
    bad = [op for op in ops if op not in OPS]
    if bad:
        ap.error(f"unknown op(s) {bad}: choose from {OPS}")
    o = _ops()
    g = torch.Generator(device="cuda").manual_seed(0)

    def int4(n, k):
        return quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02)

    H, I, QKV, C = 3584, 18944, 4608, a.cols
    qkv_w, o_w, gate_w, up_w, down_w = int4(QKV, H), int4(H, H), int4(I, H), int4(I, H), int4(H, I)
    x = torch.randn(C, H, generator=g, device="cuda").half()
    act = torch.randn(C, I, generator=g, device="cuda").half()
    bias = torch.zeros(QKV, dtype=torch.float16, device="cuda")
    y = torch.empty(C, QKV, dtype=torch.float16, device="cuda")
    hidden = torch.zeros(C, H, dtype=torch.float32, device="cuda")
    out = torch.empty(C, I, dtype=torch.float16, device="cuda")
    if "lm_head" in ops:
        lm_w = (torch.randn(152064, H, generator=g, device="cuda") * 0.02).half()
        logits = torch.empty(C, 152064, device="cuda")
    run = {"qkv": lambda: o.gemv_int4(y, x, *qkv_w, bias),
           "o": lambda: o.gemv_int4_residual(hidden, x, *o_w),
           "gate/up": lambda: o.gemv_int4_silu_mul(out, x, *gate_w, *up_w),
           "down": lambda: o.gemv_int4_residual(hidden, act, *down_w),
           "lm_head": lambda: o.gemv_fp16(logits, x, lm_w)}
    torch.cuda.synchronize()
    for _ in range(2):
        for op in ops:
            run[op]()
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
