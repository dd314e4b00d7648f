"""paged_attention (split-K decode attention) at the 7B's shape over context lengths.

    python benchmarks/bench_attention.py [--heads 28 --kv-heads 4 --head-dim 128]

Times a CUDA graph of 50 back-to-back launches (split + combine kernels), median of 7 replays,
and reports the K/V bytes read per launch against the measured 4276 GB/s copy bandwidth.
Each launch reads a different layer's cache (28 layers) so the L2 does not serve repeats.
"""

from __future__ import annotations

import argparse
import statistics

import torch

COPY_GBS = 4276.0


def time_graph(fn, reps: int = 50, trials: int = 7) -> float:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn(0)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for i in range(reps):
                fn(i)
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(trials):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            g.replay()
            b.record(s)
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)  # us per launch


def main() -> None:
    from nanoqwen.engine.build import load_extension

    load_extension()
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28)
    a = ap.parse_args()
    nh, nkv, d = a.heads, a.kv_heads, a.head_dim
    ops = torch.ops.nanoqwen
    print(f"| context | splits | us/launch | KV MB | GB/s | % of {COPY_GBS:.0f} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for L in (1, 128, 512, 1024, 4096, 16384, 32768):
        pages = -(-L // 16)
        k = torch.randn(a.layers, pages, 16, nkv, d, device="cuda").half()
        v = torch.randn_like(k)
        table = torch.randperm(pages, device="cuda").int()
        q = torch.randn(nh, d, device="cuda").half()
        pos = torch.tensor([L - 1], dtype=torch.int32, device="cuda")
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        S = max(1, min(pages, -(-2 * sms // nkv)))
        out = torch.empty(nh, d, device="cuda").half()
        ws = torch.empty(nh, S, d, device="cuda"), torch.empty(nh, S, 2, device="cuda")
        us = time_graph(lambda i: ops.paged_attention(out, *ws, q, k[i % a.layers],
                                                      v[i % a.layers], table, pos))
        mb = 2 * L * nkv * d * 2 / 1e6
        gbs = mb * 1e6 / (us * 1e-6) / 1e9
        print(f"| {L} | {S} | {us:.2f} | {mb:.2f} | {gbs:.0f} | {100 * gbs / COPY_GBS:.1f} |")
        del k, v


if __name__ == "__main__":
    main()
