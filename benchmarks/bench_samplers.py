"""What each sampler setting the app offers adds to the decode step (issue 12 item 3).

    python benchmarks/bench_samplers.py [--preset 7b] [-p 512] [-n 128] [-r 5] [--json FILE]

One synthetic model on the GPU (random weights, `nanoqwen bench --synthetic`'s tensors), and
for each setting below `nanoqwen bench`'s own measurement (engine/bench.py run_bench: -r
repetitions after a warm-up, median of the per-repetition mean decode step, graph mode, seed
fixed so every repetition draws the same tokens): ms/token and its ratio to the greedy rows.
The target is at most 1.03 for every setting. The synthetic model's logits are nearly flat
(top-p 0.9 keeps ~80k of 152k tokens), the hardest case for the sampler's threshold searches;
a trained model's peaked rows are cheaper (bench_step.py's sampler table has both).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# name, SamplerParams fields (over the app's defaults: t 0.8, top-k 40, top-p 0.95, min-p 0.05)
SETTINGS = [
    ("greedy", dict(temperature=0.0)),
    ("app default (t 0.8, top-k 40, top-p 0.95, min-p 0.05)", {}),
    ("app default + repeat-penalty 1.1", dict(repeat_penalty=1.1)),
    ("top-k off, top-p 0.8, min-p 0, repeat-penalty 1.1 (the issue's row)",
     dict(top_k=0, top_p=0.8, min_p=0.0, repeat_penalty=1.1)),
    ("top-k off, top-p 0.9, min-p 0", dict(top_k=0, top_p=0.9, min_p=0.0)),
    ("top-k off, top-p 0.95, min-p 0.05", dict(top_k=0, top_p=0.95, min_p=0.05)),
    ("top-k off, top-p 0.999, min-p 0", dict(top_k=0, top_p=0.999, min_p=0.0)),
    ("top-k off, top-p 1, min-p 0 (temperature alone)", dict(top_k=0, top_p=1.0, min_p=0.0)),
    ("top-k off, top-p 1, min-p 0.05", dict(top_k=0, top_p=1.0, min_p=0.05)),
    ("t 1.5, top-k off, top-p 0.9, min-p 0", dict(temperature=1.5, top_k=0, top_p=0.9,
                                                 min_p=0.0)),
    ("top-k 1, t 0.8", dict(top_k=1)),
    ("top-k 200, top-p 1, min-p 0", dict(top_k=200, top_p=1.0, min_p=0.0)),
    ("top-k 1000", dict(top_k=1000)),
    ("top-k 5000", dict(top_k=5000)),
    ("top-k 50000, top-p 0.9", dict(top_k=50000, top_p=0.9)),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="7b")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("--mode", default="graph")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.bench import _commit, copy_bandwidth, run_bench, sampler_label
    from nanoqwen.engine.config import ModelConfig
    from nanoqwen.engine.sampling import SamplerParams

    cfg = ModelConfig.from_name(args.preset)
    be = CudaBackend.synthetic(cfg, seed=0, max_context=args.n_prompt + args.n_gen + 16)
    rows = []
    greedy_ms = None
    copy_gbs = copy_bandwidth(be.device)   # once for every setting's run_bench
    for name, fields in SETTINGS:
        params = SamplerParams(**{**SamplerParams().to_dict(), **fields}).validate()
        r = run_bench(be, args.n_prompt, args.n_gen, args.repetitions, [args.mode],
                      params=params, copy_gbs=copy_gbs)
        tg = next(x for x in r if x["test"].startswith("tg"))
        ms = tg["ms_per_token"]
        if greedy_ms is None:
            greedy_ms = ms
        rows.append(dict(setting=name, sampler=sampler_label(params), ms_per_token=ms,
                         ms_per_token_all=tg["ms_per_token_all"], ratio_to_greedy=ms / greedy_ms,
                         added_us=(ms - greedy_ms) * 1e3))
        print(f"{name:70s} {ms:7.3f} ms/token  x{ms / greedy_ms:.3f}  "
              f"(+{(ms - greedy_ms) * 1e3:6.1f} us)", flush=True)
    out = dict(bench="bench_samplers", preset=args.preset, model=cfg.name, device=be.device_name,
               mode=args.mode, n_prompt=args.n_prompt, n_gen=args.n_gen,
               reps=args.repetitions, commit=_commit(), date=time.strftime("%Y-%m-%d"),
               target_ratio=1.03, worst_ratio=max(r["ratio_to_greedy"] for r in rows),
               rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(f"worst ratio {out['worst_ratio']:.3f} (target <= 1.03); median of the sampled rows "
          f"{statistics.median(r['ratio_to_greedy'] for r in rows[1:]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
