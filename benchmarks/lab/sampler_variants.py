"""sample_token alone (bench_step.py's timing: a graph of 50 launches, median of 7 replays) per
sampler setting on a flat row (the synthetic model's kind: N(0, 0.6^2)) and a peaked one, for
whichever build of the extension NANOQWEN_CSRC points at (sampler_variants.sh builds the
variants it compares); one JSON line per row.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from bench_attention import time_graph
from nanoqwen.engine.build import load_extension

load_extension()
o = torch.ops.nanoqwen
V = 152064
g = torch.Generator(device="cuda").manual_seed(0)
flat = torch.randn(V, generator=g, device="cuda") * 0.6
peaked = torch.randn(V, generator=g, device="cuda") * 2
peaked[torch.randperm(V, generator=g, device="cuda")[:50]] += 14
out = torch.zeros(1, dtype=torch.int32, device="cuda")
work = torch.empty(V, device="cuda")
ctx = torch.randint(0, V, (600,), dtype=torch.int32, device="cuda")
pos = torch.tensor([599], dtype=torch.int32, device="cuda")
counter = torch.zeros(1, dtype=torch.int64, device="cuda")
ROWS = [("greedy", 0.0, 0, 1.0, 0.0, 1.0), ("app default", 0.8, 40, 0.95, 0.05, 1.0),
        ("app default + penalty 1.1", 0.8, 40, 0.95, 0.05, 1.1),
        ("top-k off, top-p 0.9", 0.8, 0, 0.9, 0.0, 1.0),
        ("top-k off, top-p 0.95, min-p 0.05", 0.8, 0, 0.95, 0.05, 1.0),
        ("temperature alone", 0.8, 0, 1.0, 0.0, 1.0), ("top-k 1000", 0.8, 1000, 0.95, 0.05, 1.0),
        ("top-k 5000", 0.8, 5000, 0.95, 0.05, 1.0)]
for label, logits in (("flat", flat), ("peaked", peaked)):
    for name, t, k, p, mp, pen in ROWS:
        pf = torch.tensor([t, p, mp, pen], device="cuda")
        pi = torch.tensor([k, 64, 1234, 0], dtype=torch.int64, device="cuda")
        us = time_graph(lambda i: o.sample_token(out, work, logits, ctx, pos, pf, pi, counter))
        print(json.dumps(dict(variant=os.environ.get("VARIANT", "?"), logits=label, setting=name,
                              us=round(us, 2))), flush=True)
