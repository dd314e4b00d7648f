"""Speculation on the device against plain decoding and the host loop, where the drafter finds
nothing (a synthetic preset's random weights and a random prompt: what a speculative turn costs
when it never drafts) and where it does (the bundled model on the code-editing workload).

    python3 benchmarks/bench_spec_device.py --synthetic 7b [-n 256] [--reps 5] [--json FILE]
    python3 benchmarks/bench_spec_device.py [--model FILE] ...    (the bundled model)

For each mode (graph, eager) and decoding (plain; prompt lookup on the device; prompt lookup in
the host loop, NANOQWEN_SPEC_DEVICE's 0) the median over --reps replies (after a warm-up) of
the decode time per generated id (engine.bench.spec_turn: the ids' step times after the first)
and of the consumer's wall clock per id, with the drafter's figures. Greedy; the replies of the
three decodings must be identical (checked). CUDA only."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    import torch

    from nanoqwen.engine.bench import _commit, spec_turn
    from nanoqwen.engine.sampling import SamplerParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", default=None, help="a preset (random weights, random prompt)")
    ap.add_argument("--model", default=None, help="a .nanoqwen file (default: the bundled one)")
    ap.add_argument("-n", type=int, default=256, help="max new ids per reply")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_spec_device: CUDA only", file=sys.stderr)
        return 2
    greedy = SamplerParams.greedy_params()
    if args.synthetic:
        from nanoqwen.engine.backends.cuda import CudaBackend
        from nanoqwen.engine.config import ModelConfig

        cfg = ModelConfig.from_name(args.synthetic)
        be = CudaBackend.synthetic(cfg, max_context=4096)
        g = torch.Generator().manual_seed(0)
        prompts = {"random": torch.randint(0, cfg.vocab_size, (512,), generator=g).tolist()}
        stops: frozenset[int] = frozenset()
        label = f"synthetic {args.synthetic}"
    else:
        from nanoqwen.engine.loader import load
        from nanoqwen.engine.spec_workload import requests

        model = Path(args.model) if args.model else ROOT / "assets" / "tiny" / "tiny.nanoqwen"
        eng = load(model, backend="cuda")
        be, tok = eng.backend, eng.tokenizer
        reqs = requests()
        prompts = {f"{kind}{i}": tok.encode_chat([{"role": "user", "content": text}])
                   for i, (kind, text) in enumerate(reqs)}
        stops = frozenset(tok.stop_ids)
        label = str(model.name)
    rows = []

    def decoding(name: str):
        be.switches = dataclasses.replace(be.switches, spec_device=name != "host")
        return None if name == "plain" else "ngram"

    for mode in ("graph", "eager"):
        be.mode = mode
        for name in ("plain", "device", "host"):   # warm-up: graphs, the speculative graph
            spec_turn(be, next(iter(prompts.values())), greedy, args.n, stops, decoding(name))
        for pname, ids in prompts.items():
            got = {}
            for name in ("plain", "device", "host"):
                per = []
                for _ in range(args.reps):
                    r = spec_turn(be, ids, greedy, args.n, stops, decoding(name))
                    per.append(r)
                n = len(per[0]["tokens"])
                got[name] = per[0]["tokens"]
                rows.append(dict(
                    mode=mode, prompt=pname, decoding=name, n_tokens=n,
                    decode_ms_per_token=statistics.median(p["decode_ms"] / max(1, n - 1)
                                                          for p in per),
                    wall_ms_per_token=statistics.median(p["wall_ms"] / max(1, n - 1) for p in per),
                    drafted=per[0]["drafted"], accepted=per[0]["accepted"],
                    verify_steps=per[0]["verify_steps"]))
                r = rows[-1]
                print(f"{mode:5} {pname:8} {name:6} {n:4} ids  decode {r['decode_ms_per_token']:.4f}"
                      f"  wall {r['wall_ms_per_token']:.4f} ms/id  drafted {r['drafted']}"
                      f"  kept {r['accepted']}  verify steps {r['verify_steps']}", flush=True)
            same = got["plain"] == got["device"] == got["host"]
            rows[-1]["identical"] = same
            if not same:
                print(f"  NOT IDENTICAL: {pname} {mode}", flush=True)
    be.mode = "graph"
    be.switches = dataclasses.replace(be.switches, spec_device=True)
    note = be.core.spec_note()
    for mode in ("graph", "eager"):
        for name in ("plain", "device", "host"):
            sel = [r for r in rows if r["mode"] == mode and r["decoding"] == name]
            print(f"{mode:5} {name:6} median decode "
                  f"{statistics.median(r['decode_ms_per_token'] for r in sel):.4f}  wall "
                  f"{statistics.median(r['wall_ms_per_token'] for r in sel):.4f} ms/id")
    if note:
        print("spec_note:", note)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            model=label, device=torch.cuda.get_device_name(), commit=_commit(), n=args.n,
            reps=args.reps, spec_note=note, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
