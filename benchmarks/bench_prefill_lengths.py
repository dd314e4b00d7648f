"""TTFT of the CUDA engine at prompt lengths it has not prefilled before, against the same
lengths again: every chat turn has a new length, so the first figure is what a person waits.

Synthetic 7B weights (CudaBackend.synthetic), greedy, 2 tokens per turn; each row is one
turn after truncate(0), or after a cached prefix of n0 ids ("cached prefix"). `ttft` is the
engine's (prefill + first sample, GPU clock), `wall` the call's, `allocs` the caching
allocator's new device allocations during the turn. Writes $OUT/ttft_lengths.json.
usage (on the GPU machine): python3 benchmarks/bench_prefill_lengths.py
"""
import json
import os
import time

import torch

from nanoqwen.engine.backends.cuda import CudaBackend
from nanoqwen.engine.config import ModelConfig
from nanoqwen.engine.sampling import SamplerParams

be = CudaBackend.synthetic(ModelConfig.from_name(os.environ.get("PRESET", "7b")), seed=0,
                           max_context=4096)
g = torch.Generator().manual_seed(0)
greedy = SamplerParams.greedy_params()


def allocs() -> int:
    return torch.cuda.memory_stats().get("num_device_alloc", 0)


out = []


def run(n: int, n0: int = 0, tag: str = "") -> None:
    be.truncate(0)
    if n0:
        list(be.generate(torch.randint(0, 1000, (n0,), generator=g).tolist(), greedy, 1))
    prompt = torch.randint(0, 1000, (n,), generator=g).tolist()
    a0, t = allocs(), time.perf_counter()
    ev = list(be.generate(prompt, greedy, max_new_tokens=2))
    row = dict(L=n, n0=n0, ttft=round(ev[0].step_ms, 2),
               wall=round((time.perf_counter() - t) * 1e3, 2), allocs=allocs() - a0, tag=tag)
    out.append(row)
    print(row, flush=True)


for n in [512, 512, 45, 45, 42, 42, 47, 61, 61, 100, 200, 200, 1114, 1114, 1082, 33, 33]:
    run(n)
for n0, n in [(45, 40), (45, 40), (100, 37), (1100, 41), (1100, 41)]:
    run(n, n0, "cached prefix")
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/ttft_lengths.json", "w"), indent=1)
