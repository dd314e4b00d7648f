"""Eager sample_token launches for a profiler (Nsight Compute): one launch per setting, on a
Qwen-sized row of N(0, sigma^2) logits (sigma 1.2: a 7B synthetic model's logits, weights std
0.02 over 3584 unit-RMS features), so `ncu -k regex:sample_kernel` sees exactly these launches
in this order: temperature alone, top-k 200, top-p 0.9, top-k 5000 (the select-heavy ones of
bench_samplers.py against the one without a select). Prints each launch's token.

usage: ncu --set full -k regex:sample_kernel python benchmarks/lab/sampler_profile.py
"""
import torch

from nanoqwen.engine import ops
from nanoqwen.engine.sampling import SamplerParams

SETTINGS = [  # name, SamplerParams
    ("temperature alone", SamplerParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0)),
    ("top-k 200", SamplerParams(temperature=0.8, top_k=200, top_p=1.0, min_p=0.0)),
    ("top-p 0.9", SamplerParams(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0)),
    ("top-k 5000", SamplerParams(temperature=0.8, top_k=5000, top_p=1.0, min_p=0.0)),
]


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(152064, generator=g, device=dev) * 1.2
    ctx = torch.zeros(64, dtype=torch.int32, device=dev)
    pos = torch.zeros(1, dtype=torch.int32, device=dev)
    counter = torch.zeros(1, dtype=torch.int64, device=dev)
    for name, p in SETTINGS:
        pf, pi = ops.sampler_tensors(p, 1234, dev)
        tok = ops.sample_token(logits, ctx, pos, pf, pi, counter)
        torch.cuda.synchronize()
        print(f"{name}: token {int(tok)}", flush=True)


if __name__ == "__main__":
    main()
