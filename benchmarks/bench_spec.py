"""Speculative decoding on a code-editing workload (issue 13 item 4): plain vs prompt lookup.

    python benchmarks/bench_spec.py [--model FILE] [--backend reference|cuda] [-n 200] [--reps 3]
                                    [--temp T] [--json FILE]

Twelve requests that rewrite code given in the prompt (type hints, renames, docstrings, a bug
fix, f-strings, ...) and four that write new code, each answered by the bundled model (default;
trained, so the acceptance is real) on the reference backend: the same greedy turn with
speculation off and with `ngram`, from an empty cache. Per request: tokens, the effective
ms per generated token (decode time -- the steps after the first token, the backend's own
timing -- over the tokens after the first), drafted / accepted ids, and whether the tokens
are identical (they must be, greedy). Medians over --reps repetitions per request; the
summary is the median over requests of each group and of the plain / spec ratio.
`--temp T` samples instead (the app's other defaults, seed fixed per repetition): replies then
differ between plain and speculative runs (the same distribution, other draws), so their
lengths and texts differ and only the rates and the acceptance compare.

`--backend cuda` runs the same turns on the CUDA engine (its verify step). The 7B estimate of
issue 13 item 4 combines this acceptance with t(k) measured at 7B shapes:
benchmarks/bench_verify.py --acceptance THIS_JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from nanoqwen.engine.bench import spec_turn
from nanoqwen.engine.spec_workload import requests  # the one workload


def turn(be, ids, params, n, stop_ids, spec) -> dict:
    """engine/bench.py's spec_turn (the one timing of a turn, `nanoqwen bench --spec`'s too),
    with the effective ms per token of its decode steps."""
    t = spec_turn(be, ids, params, n, stop_ids, spec)
    n_dec = len(t["tokens"]) - 1
    return dict(t, n=len(t["tokens"]), ms_per_token=t["decode_ms"] / n_dec if n_dec else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .nanoqwen file (default: the bundled one)")
    ap.add_argument("-n", type=int, default=200, help="max new tokens per reply")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--temp", type=float, default=0.0, help="0: greedy (default)")
    ap.add_argument("--backend", default="reference", choices=("reference", "cuda"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from nanoqwen.engine import loader
    from nanoqwen.engine.bench import _commit
    from nanoqwen.engine.sampling import SamplerParams

    eng = loader.load(args.model, backend=args.backend)
    be, tok = eng.backend, eng.tokenizer
    params = (SamplerParams.greedy_params() if args.temp <= 0
              else SamplerParams(temperature=args.temp, seed=1234))
    rows = []
    try:
        for kind, text in requests():
            ids = tok.encode_chat([{"role": "user", "content": text}])
            res = {None: [], "ngram": []}
            for _ in range(args.reps):
                for spec in (None, "ngram"):
                    res[spec].append(turn(be, ids, params, args.n, tok.stop_ids, spec))
            p, s = res[None], res["ngram"]
            med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
            row = dict(kind=kind, request=text.splitlines()[0][:70], n_prompt=len(ids),
                       n_generated=p[0]["n"], identical=all(x["tokens"] == p[0]["tokens"]
                                                            for x in p + s),
                       plain_ms_per_token=med(p, "ms_per_token"),
                       spec_ms_per_token=med(s, "ms_per_token"),
                       drafted=s[0]["drafted"], accepted=s[0]["accepted"],
                       verify_steps=s[0]["verify_steps"])
            row["acceptance"] = row["accepted"] / row["drafted"] if row["drafted"] else None
            row["speedup"] = row["plain_ms_per_token"] / row["spec_ms_per_token"]
            rows.append(row)
            print(f"{kind:4s} {row['request'][:44]:44s} {row['n_generated']:4d} tok  plain "
                  f"{row['plain_ms_per_token']:6.2f}  ngram {row['spec_ms_per_token']:6.2f} "
                  f"ms/token  x{row['speedup']:.2f}  accepted {row['accepted']}/"
                  f"{row['drafted']}  identical {row['identical']}", flush=True)
    finally:
        eng.close()
    summary = {}
    for kind in ("edit", "new"):
        rs = [r for r in rows if r["kind"] == kind]
        summary[kind] = dict(
            requests=len(rs),
            plain_ms_per_token=statistics.median(r["plain_ms_per_token"] for r in rs),
            spec_ms_per_token=statistics.median(r["spec_ms_per_token"] for r in rs),
            speedup=statistics.median(r["speedup"] for r in rs),
            acceptance=(sum(r["accepted"] for r in rs) / max(1, sum(r["drafted"] for r in rs))))
        s = summary[kind]
        print(f"{kind}: median plain {s['plain_ms_per_token']:.2f} ms/token, ngram "
              f"{s['spec_ms_per_token']:.2f} (x{s['speedup']:.2f}), acceptance "
              f"{100 * s['acceptance']:.0f}%")
    out = dict(bench="bench_spec", model=str(args.model or loader.default_model_path()),
               backend=be.name, device=be.device_name, commit=_commit(),
               date=time.strftime("%Y-%m-%d"), n=args.n, reps=args.reps,
               sampler="greedy" if params.greedy else f"temperature {args.temp:g}, app defaults",
               all_identical=all(r["identical"] for r in rows), summary=summary, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if out["all_identical"] or not params.greedy else 1


if __name__ == "__main__":
    sys.exit(main())
