"""The four INT4 decode GEMVs at the 7B shapes, each launched twice (warm-up, then the one a
profiler looks at), for Nsight Compute:

    ncu --kernel-name regex:gemv_int4 --launch-skip 4 --launch-count 4 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python3 benchmarks/ncu_gemv.py

Order of the profiled launches: qkv (gemv_int4), o (gemv_int4_residual, k 3584), gate/up
(gemv_int4_silu_mul), down (gemv_int4_residual, k 18944). Random weights (std 0.02).
"""

from __future__ import annotations

import torch


def main() -> None:
    from nanoqwen.engine.ops import _ops
    from nanoqwen.engine.quant import quantize

    o = _ops()
    g = torch.Generator(device="cuda").manual_seed(0)

    def int4(n, k):
        return quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02)

    H, I, QKV = 3584, 18944, 4608
    qkv_w, o_w, gate_w, up_w, down_w = int4(QKV, H), int4(H, H), int4(I, H), int4(I, H), int4(H, I)
    x = torch.randn(H, generator=g, device="cuda").half()
    act = torch.randn(I, generator=g, device="cuda").half()
    bias = torch.zeros(QKV, dtype=torch.float16, device="cuda")
    y = torch.empty(QKV, dtype=torch.float16, device="cuda")
    hidden = torch.zeros(H, dtype=torch.float32, device="cuda")
    out = torch.empty(I, dtype=torch.float16, device="cuda")
    torch.cuda.synchronize()
    for _ in range(2):
        o.gemv_int4(y, x, *qkv_w, bias)
        o.gemv_int4_residual(hidden, x, *o_w)
        o.gemv_int4_silu_mul(out, x, *gate_w, *up_w)
        o.gemv_int4_residual(hidden, act, *down_w)
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
