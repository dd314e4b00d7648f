"""Where a CUDA prefill's time goes: the host's enqueue time against the GPU's, and the ops and
kernels of both (torch.profiler), for a synthetic preset at one prompt length.

    python benchmarks/profile_prefill.py --preset 0.5b -p 512 [--prefill-weights resident]
        [--reps 5] [--json F]

The engine's prefill is one C++ call that only enqueues (engine/backends/cuda.py _prefill);
host_ms is how long that call takes, gpu_ms the CUDA events around it on the engine's stream
(medians of --reps after a warm-up). host_ms close to gpu_ms: the GPU waits for the host (the
small presets, issue 14's "per-op host costs"); host_ms far below: the GPU's own work. The
profile tables (ATen ops by self CPU time, kernels by device time) are of one more prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="0.5b")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("--prefill-weights", default="resident")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=22)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.bench import _commit
    from nanoqwen.engine.config import ModelConfig

    cfg = ModelConfig.from_name(args.preset)
    b = CudaBackend.synthetic(cfg, seed=0, max_context=args.p + 64,
                              prefill_weights=args.prefill_weights)
    ids = torch.randint(0, cfg.vocab_size, (args.p,),
                        generator=torch.Generator().manual_seed(0)).tolist()

    def once() -> tuple[float, float]:
        with torch.cuda.device(b.device), torch.cuda.stream(b.stream), torch.inference_mode():
            b.core.begin_turn([])
            b.cache.rollback(0)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            b._prefill(ids, 0, False)
            t1 = time.perf_counter()
            e1.record()
            e1.synchronize()
        return (t1 - t0) * 1e3, e0.elapsed_time(e1)

    once()
    runs = [once() for _ in range(args.reps)]
    host = statistics.median(r[0] for r in runs)
    gpu = statistics.median(r[1] for r in runs)
    print(f"{args.preset} p{args.p} {args.prefill_weights}: host enqueue {host:.2f} ms, "
          f"GPU {gpu:.2f} ms (medians of {args.reps})", flush=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        once()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows), flush=True)
    print(ka.table(sort_by="self_device_time_total", row_limit=args.rows), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), preset=args.preset, n_prompt=args.p,
            prefill_weights=args.prefill_weights, commit=_commit(),
            date=time.strftime("%Y-%m-%d"), host_ms=host, gpu_ms=gpu,
            runs=[dict(host_ms=h, gpu_ms=g) for h, g in runs],
            ops=[dict(name=e.key, count=e.count, self_cpu_us=e.self_cpu_time_total,
                      self_device_us=getattr(e, "self_device_time_total", 0.0))
                 for e in ka]), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
