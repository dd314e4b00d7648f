"""Decode attention at the 7B's shape over context lengths: a sweep of the fused
attention_decode's split sizing (RoPE + K/V write + split-K attention + split merge, one
launch; num_splits = the ws size, min_pps = the op's minimum-pages-per-split argument, which the
engine takes from NANOQWEN_ATTN_MIN_PPS), and with --pair the unfused pair it replaced
(rope_kv_write + paged_attention = three launches; paged_attention is in the lab library,
benchmarks/lab/, built on first use, ~25 s).

    python benchmarks/bench_attention.py [--heads 28 --kv-heads 4 --head-dim 128] [--pair]
        [--sweep S:MIN_PPS[:KERNEL],...] [--json FILE]

KERNEL is the op's page loop (0 the cp.async split-K kernel, 1 the TMA warp-specialized one on
tensor cores; csrc/kernels.h). --json writes every row with the device, the commit and the date.

Times a CUDA graph of 50 back-to-back calls, median of 7 replays (us per call), and reports the
K/V bytes read per call against the measured 4276 GB/s copy bandwidth. Each call reads a
different layer's cache (28 layers) so the L2 does not serve repeats. All kernels are launched
with PDL (NANOQWEN_PDL=1 unless set), so back-to-back calls overlap one call's start with the
previous one's tail; in the engine the kernel before attention_decode is the qkv GEMV.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch

COPY_GBS = 4276.0
CONTEXTS = (128, 512, 2048, 8192, 32768)


def time_graph(fn, reps: int = 50, trials: int = 7) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
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
    return statistics.median(times)  # us per call


def main() -> None:
    from nanoqwen.engine.build import load_extension

    load_extension()
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--contexts", type=str, default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--sweep", type=str, default="66:2:0,66:2:1,66:1:0,66:1:1,66:4:1,132:2:1",
                    help="fused variants as num_splits:min_pps[:kernel] (kernel 0 cp.async, "
                         "1 TMA; default 0)")
    ap.add_argument("--json", type=str, default=None, help="write the rows to this file")
    ap.add_argument("--pair", action="store_true",
                    help="also time the unfused pair (builds the lab library)")
    a = ap.parse_args()
    lab = None
    if a.pair:
        sys.path.insert(0, str(Path(__file__).resolve().parent / "lab"))
        from lab import load, ptr, stream

        lab = load()
    nh, nkv, d = a.heads, a.kv_heads, a.head_dim
    ops = torch.ops.nanoqwen
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # S:min_pps[:kernel], the kernel 0 where left out (a fourth field fails the unpacking below)
    variants = [tuple(int(x) for x in v.split(":")) + ((0,) if v.count(":") == 1 else ())
                for v in a.sweep.split(",")]
    rows, records = [], []
    for L in (int(x) for x in a.contexts.split(",")):
        pages = -(-L // 16)
        k = torch.randn(a.layers, pages, 16, nkv, d, device="cuda").half()
        v = torch.randn_like(k)
        table = torch.randperm(pages, device="cuda").int()
        qkv = torch.randn(1, (nh + 2 * nkv) * d, device="cuda").half()
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
        f = torch.arange(pages * 16, device="cuda").float()[:, None] * inv[None]
        cos, sin = f.cos().contiguous(), f.sin().contiguous()
        pos = torch.tensor([L - 1], dtype=torch.int32, device="cuda")
        S_eng = max(1, min(pages, -(-2 * sms // nkv)))  # engine/backends/cuda.py's formula
        out = torch.empty(nh, d, device="cuda").half()
        q = torch.empty(1, nh, d, device="cuda").half()
        ws = torch.empty(nh, S_eng, d, device="cuda"), torch.empty(nh, S_eng, 2, device="cuda")

        def pair(i):
            kl, vl = k[i % a.layers], v[i % a.layers]
            ops.rope_kv_write(q, kl, vl, qkv, cos, sin, pos, table)
            lab.call("paged_attention", ptr(out), ptr(ws[0]), ptr(ws[1]), ptr(q[0]), ptr(kl),
                     ptr(vl), ptr(table), pages, ptr(pos), nh, nkv, d, S_eng, d ** -0.5, stream())

        mb = 2 * L * nkv * d * 2 / 1e6
        res = {"pair": (S_eng, time_graph(pair))} if lab is not None else {}
        counters = torch.zeros(nkv, dtype=torch.int32, device="cuda")
        for S, mp, kern in variants:
            S = max(1, min(pages, S))
            wsf = torch.empty(nh, S, d, device="cuda"), torch.empty(nh, S, 2, device="cuda")
            # min_pps and kernel are launch arguments, so each variant's graph captures its own
            name = f"{'tma' if kern == 1 else 'cp.async'} S={S} min_pps={mp}"
            res[name] = (S, time_graph(
                lambda i: ops.attention_decode(out, *wsf, counters, qkv, k[i % a.layers],
                                               v[i % a.layers], cos, sin, table, pos, mp,
                                               kern)))
        assert int(counters.abs().sum()) == 0
        for name, (S, us) in res.items():
            gbs = mb * 1e6 / (us * 1e-6) / 1e9
            rows.append(f"| {L} | {name} | {us:.2f} | {mb:.2f} | {gbs:.0f} | "
                        f"{100 * gbs / COPY_GBS:.1f} |")
            records.append({"context": L, "variant": name, "num_splits": S, "us_per_call": us,
                            "kv_mb": mb, "gb_s": gbs})
        print("\n".join(rows[-len(res):]), flush=True)
        del k, v
    print(f"\nnh={nh} nkv={nkv} d={d} SMs={sms} PDL={os.environ.get('NANOQWEN_PDL', '1')}")
    print("| context | variant | us/call | KV MB | GB/s | % of 4276 |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    if a.json:
        from nanoqwen.engine.bench import _commit  # NANOQWEN_COMMIT on the device (no .git)

        commit = _commit()
        Path(a.json).write_text(json.dumps({
            "bench": "bench_attention", "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name(0), "commit": commit,
            "shape": {"heads": nh, "kv_heads": nkv, "head_dim": d, "layers": a.layers},
            "pdl": os.environ.get("NANOQWEN_PDL", "1"), "method": "CUDA graph of 50 calls, each on "
            "another layer's cache, median of 7 replays", "rows": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
