"""The CUDA backend's decode step under compute-sanitizer (session 31's open crash: racecheck with
only the attention kernels instrumented faulted in the constructor's first eager decode step,
reported at advance_kernel's launch). This is the body the sanitizer runs: build a CudaBackend
(tests' tiny config, random weights) with the given attention kernel, then prefill a prompt and
run eager decode steps, printing a line after each so that the log shows how far it got.
    compute-sanitizer --tool racecheck --kernel-name kns=attn_decode \
        python benchmarks/lab/racecheck_engine.py --tma 1 [--config TINY_UNTIED] [--steps 40]
(With CUDA_LAUNCH_BLOCKING=1 the constructor did not finish in 60 s: session 32, call 1.)"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tma", type=int, default=1)
    ap.add_argument("--config", default="TINY_UNTIED")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-context", type=int, default=128)
    a = ap.parse_args()
    import torch

    import helpers
    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.switches import ATTN_TMA

    os.environ[ATTN_TMA] = str(a.tma)
    cfg = getattr(helpers, a.config)
    print(f"config {a.config}: heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} "
          f"head_dim {cfg.head_dim}, tma {a.tma}", flush=True)
    print("constructing (its warm-up: one eager decode step at position 0)", flush=True)
    be = CudaBackend(cfg, helpers.file_tensors(cfg, helpers.random_weights(cfg, seed=1)),
                     max_context=a.max_context, mode="eager")
    print(f"constructed: num_splits {be.num_splits} min_pps {be.attn_min_pps}", flush=True)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=g).tolist()
    be.forward(ids)
    print("prefill of 20 done", flush=True)
    t = ids[-1]
    for i in range(a.steps):
        t = int(be.forward([t]).argmax())
        print(f"eager decode step {i} at position {len(be.kv_tokens) - 1} done", flush=True)
    torch.cuda.synchronize()
    print("all done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
