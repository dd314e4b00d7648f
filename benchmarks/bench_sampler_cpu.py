"""CPU reference sampler on the full 152,064-token vocabulary: median time per sample.

The sampler runs once per token on the CPU fallback path, so it should cost well under the
decode step. Run: `python benchmarks/bench_sampler_cpu.py` (single-threaded torch, as the
reference backend's sampling step sees it on a loaded 2-core machine).
"""

import statistics
import time

import torch

from nanoqwen.engine.sampling import Sampler, SamplerParams


def main() -> None:
    torch.set_num_threads(1)
    logits = torch.randn(152064, generator=torch.Generator().manual_seed(4)) * 3
    history = list(range(0, 64 * 97, 97))
    cases = {
        "defaults + repeat 1.1": SamplerParams(seed=0, repeat_penalty=1.1),
        "top-p only": SamplerParams(seed=0, top_k=0, min_p=0.0, top_p=0.95),
        "greedy": SamplerParams.greedy_params(),
    }
    print(f"{'case':<24} {'median ms':>10} {'min ms':>8}")
    for name, params in cases.items():
        s = Sampler(params)
        s.sample(logits, history)
        times = []
        for _ in range(50):
            t = time.perf_counter()
            s.sample(logits, history)
            times.append((time.perf_counter() - t) * 1e3)
        print(f"{name:<24} {statistics.median(times):>10.2f} {min(times):>8.2f}")


if __name__ == "__main__":
    main()
