"""What one speculation step costs on the CUDA backend, by token count T, as the spec loop
calls it (Backend._verify_step's greedy path: forward_all_argmax of `last` + T - 1 drafts), in
graph and eager mode: the wall clock around the call (host work, the copies, the launch or
graph replay, the argmax and its .tolist() sync) and, apart, the GPU time of core.verify alone
(CUDA events on the engine's stream). Session 32: `bench --spec ngram` on the bundled model
lost in graph mode with more verify steps (0.86x plain) but not in eager (1.36x); this says
which T costs what. With --preset (e.g. 7b) the backend is CudaBackend.synthetic at that preset's
shapes (random weights made on the GPU, as bench_verify.py), so the 7B step's host share shows.
    python benchmarks/lab/verify_step_wall.py [--model FILE | --preset 7b] [--context 300]
                                              [--reps 30] [--json F]"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default=None, help="synthetic weights at a preset's shapes")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    if a.preset:
        from nanoqwen.engine.backends.cuda import CudaBackend
        from nanoqwen.engine.config import ModelConfig

        be = CudaBackend.synthetic(ModelConfig.from_name(a.preset), max_context=a.context + 64)
    else:
        from nanoqwen.engine import loader
        from nanoqwen.engine.service import default_model_path

        be = loader.load(a.model or default_model_path(), backend="cuda").backend
    V = be.config.vocab_size
    ids = [(i * 7919) % (V - 10) + 5 for i in range(a.context + 20)]
    out = dict(model=be.config.name, device=be.device_name, context=a.context, reps=a.reps,
               rows=[])
    for mode in ("graph", "eager"):
        be.mode = mode
        be.truncate(0)
        be.forward(ids[:a.context])
        n0 = len(be.kv_tokens)
        for T in list(range(1, 14)) * 2:          # warm-up: a graph per T captured
            be.truncate(n0)
            be.forward_all_argmax(ids[n0:n0 + T])
        wall = {T: [] for T in range(1, 14)}
        gpu = {T: [] for T in range(1, 14)}
        for _ in range(a.reps):
            for T in wall:
                be.truncate(n0)
                t0 = time.perf_counter()
                be.forward_all_argmax(ids[n0:n0 + T])
                wall[T].append((time.perf_counter() - t0) * 1e3)
        for _ in range(a.reps):   # core.verify alone, GPU time
            for T in gpu:
                be.truncate(n0)
                be._reserve(n0 + T)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(be.stream):
                    e0.record(be.stream)
                    be.core.verify(torch.tensor(ids[n0:n0 + T], dtype=torch.int32), n0,
                                   mode == "graph")
                    e1.record(be.stream)
                e1.synchronize()
                gpu[T].append(e0.elapsed_time(e1))
        be.truncate(n0)
        for T in wall:
            r = dict(mode=mode, T=T, wall_ms=statistics.median(wall[T]),
                     gpu_ms=statistics.median(gpu[T]))
            out["rows"].append(r)
            print(f"{mode:5s} T={T:2d}  wall {r['wall_ms']:.3f} ms  core.verify GPU {r['gpu_ms']:.3f} ms",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
