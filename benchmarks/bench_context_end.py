"""A chat that outgrows its context: per turn, what the session prefills and its TTFT.

Turns of coding requests with greedy replies on one session until the conversation is well past
the context (the bundled model's 2048 tokens by default), recording per turn the messages the
context policy left out, the prompt, the tokens reused from the cache and prefilled, and the
engine's TTFT (its own step timing). The figure that matters: turns after the first cut, whose
prefill is the new message only when the cut is kept (engine/session.py's context policy), the
whole window when it is made afresh.

    .venv/bin/python benchmarks/bench_context_end.py --json benchmarks/results/DATE_context_end_COMMIT.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

REQUESTS = [
    "Write a Python function that parses a CSV line with quoted fields.",
    "Now make it handle escaped quotes inside quoted fields.",
    "Add type hints and a docstring.",
    "Write pytest tests for it.",
    "Make it a class with a method for whole files.",
    "Add a method that writes rows back.",
    "Handle a custom delimiter.",
    "Explain the time complexity.",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .nanoqwen file (default: the bundled model)")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=160, help="max new tokens per reply")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)

    from nanoqwen.engine.bench import _commit
    from nanoqwen.engine import loader
    from nanoqwen.engine.sampling import SamplerParams
    from nanoqwen.engine.session import ChatSession, Notice, Stats

    model = Path(args.model) if args.model else loader.default_model_path()
    eng = loader.load(model, backend=args.backend)
    s = ChatSession(eng.backend, eng.tokenizer)
    rows = []
    for t in range(args.turns):
        cached = len(eng.backend.kv_tokens)
        dropped, stats = 0, None
        for ev in s.generate(REQUESTS[t % len(REQUESTS)], SamplerParams.greedy_params(),
                             args.tokens):
            if isinstance(ev, Notice):
                dropped = ev.dropped_messages
            elif isinstance(ev, Stats):
                stats = ev
        rows.append(dict(turn=t, dropped=dropped, n_prompt=stats.n_prompt, cached=cached,
                         n_reused=stats.n_reused, n_prefilled=stats.n_prefilled,
                         ttft_ms=stats.ttft_ms, n_generated=stats.n_generated))
        print(f"  turn {t:2d}  left out {dropped:2d}  prompt {stats.n_prompt:5d}  reused "
              f"{stats.n_reused:5d}  prefilled {stats.n_prefilled:5d}  TTFT {stats.ttft_ms:7.1f} ms",
              flush=True)
    after = [r for r in rows if r["dropped"]]
    summary = dict(
        max_context=eng.backend.max_context, turns_past_the_first_cut=len(after),
        median_prefilled_after_cut=statistics.median(r["n_prefilled"] for r in after) if after else None,
        median_ttft_ms_after_cut=statistics.median(r["ttft_ms"] for r in after) if after else None,
        median_ttft_ms_before_cut=statistics.median(r["ttft_ms"] for r in rows[1:] if not r["dropped"])
        if len(rows) > 1 else None)
    print(summary)
    out = dict(date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               commit=_commit(), device=platform.processor() or platform.machine(),
               cpu_count=os.cpu_count(), backend=eng.backend.name, model=eng.backend.config.name,
               tokens=args.tokens, summary=summary, turns=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
