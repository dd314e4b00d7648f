"""Drafting policies for greedy speculation, replayed exactly on the CPU and costed at 7B shapes.

    python benchmarks/spec_policy.py [--tk VERIFY_JSON] [--replies FILE] [--json FILE]

With greedy decoding the reply is the plain greedy reply whatever is drafted (the product checks
it: `identical` in every `bench --spec` row), and a verify step keeps the longest prefix of the
drafts that matches that reply, plus the reply's next token. So a drafter's whole behaviour on a
request -- every draft, every acceptance, every step's token count -- follows from the prompt
and the plain reply alone, without the model: this script computes the bundled model's plain
greedy replies to the code-editing workload once (engine/spec_workload.py, `nanoqwen bench
--spec`'s requests, 200 tokens, the reference backend; cached in --replies), then replays each
policy over them with the same loop as `Backend._spec_chunks` (limit = the tokens left - 1, a
stop id ends the step, `update` after a step that drafted, `extend` with what it emitted).

Cost: each step at the 7B shapes' measured time of its token count, from a bench_verify.py JSON
(--tk; default the H100 run of the committed kernels, 484a693; `--tk cpu` measures the reference
backend's forward_all here instead): a step without drafts is one
graph decode step, a verify step of T = 1 + drafts tokens costs t(T). ms per generated token =
the steps' sum over the tokens after the first (bench_verify's estimate, step by step instead of
with each request's mean draft length). The bundled model's acceptance stands for a 7B's on the
same requests (random weights at 7B shapes accept nothing real), as issue 13 item 4 says.

Check: the replay of engine/spec.py's NgramDrafter as `bench --spec ngram` ran it at 484a693
(k_min 1) must give the drafted / accepted counts measured there with the model (results/
2026-12-06_bench_spec_ngram_cpu_484a693.json: edits 884 / 540, new code 286 / 210); the script
says whether it does. The "bound" rows are not drafters: they know the reply (class Oracle).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TK = REPO / "benchmarks/results/2026-12-06_bench_verify_7b_484a693_h100.json"
N_GEN = 200


def cpu_tk(context: int = 300, reps: int = 40) -> dict:
    """t(T) of the reference backend here (the bundled model): forward_all of T = 1..16 tokens
    after `context` cached ones, T interleaved per repetition, medians; the decode step is
    T = 1. In bench_verify.py's JSON shape."""
    from nanoqwen.engine import loader
    from nanoqwen.engine.bench import _commit as commit
    from nanoqwen.engine.service import default_model_path

    be = loader.load(default_model_path(), backend="reference").backend
    be.truncate(0)
    be.forward(list(range(10, 10 + context)))
    ts: dict[int, list[float]] = {t: [] for t in range(1, 17)}
    for _ in range(reps):
        for t in ts:
            n0 = len(be.kv_tokens)
            t0 = time.perf_counter()
            be.forward_all(list(range(20, 20 + t)))
            ts[t].append((time.perf_counter() - t0) * 1e3)
            be.truncate(n0)
    rows = [dict(k=t, ms=statistics.median(v)) for t, v in ts.items()]
    return dict(rows=rows, decode_graph_ms=rows[0]["ms"], commit=commit(),
                device=f"cpu, reference backend, bundled model, context {context}, medians of "
                       f"{reps}")


def plain_replies(n_gen: int) -> list[dict]:
    """The bundled model's plain greedy replies to the workload, from an empty cache."""
    from nanoqwen.engine import loader
    from nanoqwen.engine.bench import spec_turn
    from nanoqwen.engine.sampling import SamplerParams
    from nanoqwen.engine.service import default_model_path
    from nanoqwen.engine.spec_workload import requests

    loaded = loader.load(default_model_path(), backend="reference")
    tok = loaded.tokenizer
    out = []
    counts: dict[str, int] = {}
    for kind, text in requests():
        ids = tok.encode_chat([{"role": "user", "content": text}])
        t = spec_turn(loaded.backend, ids, SamplerParams.greedy_params(), n_gen, tok.stop_ids,
                      None)
        out.append(dict(kind=kind, request=counts.get(kind, 0), prompt=ids, reply=t["tokens"],
                        stop_ids=sorted(tok.stop_ids)))
        counts[kind] = counts.get(kind, 0) + 1
    return out


def verify_step(drafter, drafts: list[int], reply: list[int], n_out: int, stop: set[int],
                steps: list) -> list[int]:
    """A step of `drafts` (maybe none) after the reply's first n_out ids, greedy: the ids it
    emits (the kept prefix, then the reply's own next id or the stop id), (drafts, kept) onto
    `steps`, the drafter updated after a draft and extended."""
    emitted, kept = [], 0
    for i, d in enumerate(drafts):
        t = reply[n_out + i]
        emitted.append(t)
        if t == d:
            kept += 1
        if t != d or t in stop:
            break
    else:
        emitted.append(reply[n_out + len(drafts)])
    if drafts:
        drafter.update(len(drafts), kept)
    drafter.extend(emitted)
    steps.append((len(drafts), kept))
    return emitted


def replay(make_drafter, req: dict, n_gen: int) -> list[tuple[int, int]]:
    """Backend._spec_chunks' loop over a known greedy reply: per step (drafts, accepted)."""
    reply, stop = req["reply"], set(req["stop_ids"])
    drafter = make_drafter(req["prompt"] + reply[:1], req)
    n_out, last, steps = 1, reply[0], []
    while not (last in stop or n_out >= n_gen or n_out >= len(reply)):
        limit = n_gen - n_out - 1
        drafts = drafter.draft(limit) if limit > 0 else []
        emitted = verify_step(drafter, drafts, reply, n_out, stop, steps)
        n_out += len(emitted)
        last = emitted[-1]
    assert n_out == len(reply), (n_out, len(reply))
    return steps


def replay_runs(make_drafter, req: dict, n_gen: int, overshoot: int, patience: int = 0
                ) -> tuple[list[tuple[int, int]], int]:
    """The same loop with plain runs (Backend._spec_chunks on a backend with spec_runs_plain,
    the CUDA engine since session 33): where nothing is drafted, plain steps until the drafter
    would draft after an id that is not the turn's first, then `overshoot` more ids (the steps
    already under way on the device when the host stops the run; 0 with sampling and a fixed
    seed). With `patience` p a run starts only after p steps in a row without drafts (each a
    verify of the last token alone, (0, -1)). Per step (drafts, accepted), a plain step (0, 0);
    and the runs started after the turn's first (each pays a start on the host)."""
    reply, stop = req["reply"], set(req["stop_ids"])
    drafter = make_drafter(req["prompt"], req)
    n_out, last, steps, runs, dry = 0, -1, [], 0, 0

    def over() -> bool:
        return last in stop or n_out >= n_gen or n_out >= len(reply)

    while not (n_out and over()):
        limit = n_gen - n_out - 1
        drafts = drafter.draft(limit) if n_out and limit > 0 else []
        if not drafts and n_out and dry < patience:
            dry += 1
            last = reply[n_out]
            drafter.extend([last])
            steps.append((0, -1))
            n_out += 1
            continue
        dry = 0
        if not drafts:
            runs += bool(n_out)
            stop_at = None
            while True:
                last = reply[n_out]
                drafter.extend([last])
                if n_out:
                    steps.append((0, 0))   # the turn's first id is the prefill's, not a step
                n_out += 1
                if over():
                    break
                if stop_at is None and n_out > 1 and drafter.draft(1):
                    stop_at = n_out + overshoot
                if stop_at is not None and n_out >= stop_at:
                    break
            continue
        emitted = verify_step(drafter, drafts, reply, n_out, stop, steps)
        n_out += len(emitted)
        last = emitted[-1]
    assert n_out == len(reply), (n_out, len(reply))
    return steps, runs


def cost(steps, t_of: dict[int, float], t_plain: float, host_ms: float | None = None,
         runs: int | None = None, run_start_ms: float = 0.0) -> float:
    """A replayed request's decode time. By default a step with drafts costs t(1 + drafts)
    and one without a graph decode step (t_plain): the GPU's time alone. With --host-ms H every
    step costs t(1 + drafts) + H, as the product runs them: each speculation step, drafted or
    not, is a verify call whose ids the host reads before it launches the next (a step without
    drafts is a verify of T = 1), where plain decoding runs ahead of the host. With `runs`
    (replay_runs' count: plain runs) a step without drafts is a plain step (t_plain, run ahead),
    a verify step costs t(1 + drafts) + H, and each run started after the first run_start_ms."""
    if runs is not None:
        return sum(t_of[1 + d] + (host_ms or 0.0) if d or a < 0 else t_plain
                   for d, a in steps) + runs * run_start_ms
    if host_ms is None:
        return sum(t_of[1 + d] if d else t_plain for d, _ in steps)
    return sum(t_of[1 + d] + host_ms for d, _ in steps)


def evaluate(name: str, make_drafter, reqs, n_gen, t_of, t_plain, host_ms=None,
             overshoot: int | None = None, run_start_ms: float = 0.0, patience: int = 0) -> dict:
    row = dict(policy=name)
    for kind in ("edit", "new"):
        group = [r for r in reqs if r["kind"] == kind]
        if overshoot is None:
            per, n_runs = [replay(make_drafter, r, n_gen) for r in group], [None] * len(group)
        else:
            per, n_runs = zip(*[replay_runs(make_drafter, r, n_gen, overshoot, patience)
                                for r in group])
            row[kind + "_plain_runs"] = sum(n_runs)
        drafted = sum(d for st in per for d, _ in st)
        accepted = sum(a for st in per for d, a in st if d)
        vsteps = sum(1 for st in per for d, _ in st if d)
        after = [len(r["reply"]) - 1 for r in group]
        costs = [cost(st, t_of, t_plain, host_ms, nr, run_start_ms) for st, nr in zip(per, n_runs)]
        row[kind] = dict(requests=len(group), drafted=drafted, accepted=accepted,
                         verify_steps=vsteps, steps=sum(len(st) for st in per),
                         tokens_per_verify_step=(accepted + vsteps) / vsteps if vsteps else None,
                         est_ms_per_token_median=statistics.median(
                             c / n for c, n in zip(costs, after)),
                         est_ms_per_token_total=sum(costs) / sum(after))
    return row


class Oracle:
    """A bound, not a drafter: knows the reply and drafts exactly the ids that will be kept --
    the longest continuation of an earlier occurrence of the context's last n >= min_n tokens
    that matches the reply (any occurrence; `latest`: only the product's candidate, the latest
    occurrence of the longest n <= spec.MAX_N), at most k_max -- and nothing where none would be
    kept."""

    def __init__(self, req: dict, ctx, min_n: int = 2, k_max: int = 15, latest: bool = False):
        from nanoqwen.engine.spec import MAX_N

        self.tokens, self.full, self.min_n, self.k_max, self.latest = list(ctx), \
            req["prompt"] + req["reply"], min_n, k_max, latest
        self.max_n = MAX_N if latest else 8   # the product's candidate, or any n <= 8

    def extend(self, ids) -> None:
        self.tokens.extend(ids)

    def update(self, drafted: int, accepted: int) -> None:
        pass

    def draft(self, limit=None) -> list[int]:
        t, full = self.tokens, self.full
        n_ctx, best = len(t), []
        cap = self.k_max if limit is None else min(self.k_max, limit)
        for n in range(self.max_n, self.min_n - 1, -1):
            ends = [p for p in range(n_ctx - 2, n - 2, -1) if t[p - n + 1:p + 1] == t[-n:]]
            for p in ends[:1] if self.latest else ends:
                run = 0
                while (run < cap and p + 1 + run < n_ctx and n_ctx + run < len(full) - 1
                       and t[p + 1 + run] == full[n_ctx + run]):
                    run += 1
                if run > len(best):
                    best = t[p + 1:p + 1 + run]
            if self.latest and ends:
                break
        return best


def _adaptive_n(full_n: int, reject_n: int):
    """NgramDrafter whose shortest n-gram follows the last verify step: `full_n` after a draft
    kept whole, `reject_n` after a rejection (issue 13 item 2's "n-gram sizes adapt")."""
    from nanoqwen.engine import spec

    class AdaptiveN(spec.NgramDrafter):
        def __init__(self, ctx) -> None:
            super().__init__(ctx, min_n=1)
            self.cur_n = spec.MIN_N

        def update(self, drafted: int, accepted: int) -> None:
            super().update(drafted, accepted)
            if drafted > 0:
                self.cur_n = full_n if accepted == drafted else reject_n

        def draft(self, limit=None) -> list[int]:
            self.min_n, saved = self.cur_n, self.min_n
            try:
                return super().draft(limit)
            finally:
                self.min_n = saved

    return AdaptiveN


def policies() -> dict:
    """name -> make_drafter(context, request)."""
    from nanoqwen.engine import spec

    return {
        "product NgramDrafter": lambda ctx, req: spec.NgramDrafter(ctx),
        "k_min 1 (session 16 product)": lambda ctx, req: spec.NgramDrafter(
            ctx, k_min=1, min_n=2, max_n=4),
        "n 1..8, k_min 4 (session 32's replay pick)": lambda ctx, req: spec.NgramDrafter(
            ctx, min_n=1, max_n=8, k_min=4),
        "n 1..4, k_min 3": lambda ctx, req: spec.NgramDrafter(ctx, min_n=1),
        "n 1..8, k_min 3": lambda ctx, req: spec.NgramDrafter(ctx, min_n=1, max_n=8),
        "n 1..8, k_min 5": lambda ctx, req: spec.NgramDrafter(ctx, min_n=1, max_n=8, k_min=5,
                                                              k_start=5),
        "n 2..8, k_min 4": lambda ctx, req: spec.NgramDrafter(ctx, max_n=8, k_min=4),
        "k_max 15": lambda ctx, req: spec.NgramDrafter(ctx, k_max=15),
        "n >= 1 after a kept draft, >= 2 after a rejection": lambda ctx, req: _adaptive_n(1, 2)(
            ctx),
        "n >= 1 after a kept draft, >= 3 after a rejection": lambda ctx, req: _adaptive_n(1, 3)(
            ctx),
        "bound: product's candidate, exact length": lambda ctx, req: Oracle(req, ctx,
                                                                             latest=True),
        "bound: any n >= 2 occurrence, exact length": lambda ctx, req: Oracle(req, ctx),
        "bound: any n >= 1 occurrence, exact length": lambda ctx, req: Oracle(req, ctx, min_n=1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tk", default=str(DEFAULT_TK),
                    help="a bench_verify.py JSON (t(k)), or 'cpu': measure the reference "
                         "backend's here")
    ap.add_argument("--what-if", choices=["ideal", "target"], default=None,
                    help="hypothetical t(k) from the measured decode step: 'ideal' every T <= 8 "
                         "at one decode step (+10%% past 8), 'target' every T <= 8 at most 1.3x "
                         "(issue 13 item 3)")
    ap.add_argument("--host-ms", type=float, default=None,
                    help="price every speculation step as t(1 + drafts) + this host round trip "
                         "(ms) instead of the GPU time alone (see cost())")
    ap.add_argument("--runs-plain", type=int, default=None, metavar="OVERSHOOT",
                    help="replay the loop with plain runs (replay_runs): steps without drafts run "
                         "ahead at the plain step's cost, a run stops OVERSHOOT ids after the "
                         "drafter matches; --host-ms then prices verify steps only")
    ap.add_argument("--run-start-ms", type=float, default=0.0,
                    help="with --runs-plain: the host's cost of starting each run (start_turn)")
    ap.add_argument("--patience", type=int, default=0,
                    help="with --runs-plain: steps without drafts (each a verify of one token) "
                         "before a run starts")
    ap.add_argument("--replies", default="/tmp/nanoqwen_spec_replies.json")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from nanoqwen.engine.bench import _commit as commit

    tk = cpu_tk() if a.tk == "cpu" else json.loads(Path(a.tk).read_text())
    if a.what_if:   # hypothetical verify steps, from the measured decode step
        d = tk["decode_graph_ms"]
        for r in tk["rows"]:
            if a.what_if == "ideal":      # memory-bound: T <= 8 at one step's time, then +10%
                r["ms"] = d * (1.0 if r["k"] <= 8 else 1.1)
            elif r["k"] <= 8:             # issue 13 item 3's target: t(8) <= 1.3x, so every T <= 8
                r["ms"] = min(r["ms"], 1.3 * d)
        tk["device"] += f", what-if {a.what_if}"
    t_of = {r["k"]: r["ms"] for r in tk["rows"]}
    t_plain = tk["decode_graph_ms"]
    rp = Path(a.replies)
    if rp.exists():
        reqs = json.loads(rp.read_text())
    else:
        t0 = time.perf_counter()
        reqs = plain_replies(N_GEN)
        rp.write_text(json.dumps(reqs))
        print(f"plain greedy replies computed in {time.perf_counter() - t0:.0f} s -> {rp}")
    rows = [evaluate(name, mk, reqs, N_GEN, t_of, t_plain, a.host_ms, a.runs_plain,
                     a.run_start_ms, a.patience) for name, mk in policies().items()]
    print(f"t(k) from {a.tk} ({tk['device']}, {tk['commit']}): plain decode {t_plain:.3f} ms"
          + (f", host round trip {a.host_ms} ms a speculation step" if a.host_ms is not None
             else "")
          + (f"; plain runs, overshoot {a.runs_plain}, {a.run_start_ms} ms a run's start, "
             f"patience {a.patience}" if a.runs_plain is not None else ""))
    print(f"{'policy':52s} {'kind':4s} {'drafted':>7s} {'kept':>5s} {'vsteps':>6s} "
          f"{'steps':>5s} {'tok/vstep':>9s} {'est ms/tok (median, total)':>27s}")
    for r in rows:
        for kind in ("edit", "new"):
            g = r[kind]
            print(f"{r['policy']:52s} {kind:4s} {g['drafted']:7d} {g['accepted']:5d} "
                  f"{g['verify_steps']:6d} {g['steps']:5d} {g['tokens_per_verify_step']:9.2f} "
                  f"{g['est_ms_per_token_median']:13.3f} {g['est_ms_per_token_total']:13.3f}")
    base = rows[1]
    ok = (base["edit"]["drafted"], base["edit"]["accepted"], base["new"]["drafted"],
          base["new"]["accepted"]) == (884, 540, 286, 210)
    if a.runs_plain is None:
        print("replay of the k_min 1 drafter matches bench --spec ngram's counts at 484a693 "
              "(884/540, 286/210):", ok)
    else:   # a loop that was not the product's at 484a693: nothing to check against
        ok = None
    if a.json:
        Path(a.json).write_text(json.dumps(dict(
            what="drafting policies replayed on the bundled model's plain greedy replies "
                 "(benchmarks/spec_policy.py), costed with t(k) at 7B shapes",
            tk_from=a.tk, what_if=a.what_if, host_ms=a.host_ms, runs_plain=a.runs_plain,
            run_start_ms=a.run_start_ms, patience=a.patience, tk_device=tk["device"],
            tk_commit=tk["commit"],
            n_gen=N_GEN,
            tk=[dict(k=r["k"], ms=r["ms"]) for r in tk["rows"]],
            plain_decode_ms=t_plain, replay_matches_bench=ok, rows=rows,
            date=time.strftime("%Y-%m-%d"), commit=commit()), indent=1))
    return 0 if ok is not False else 1


if __name__ == "__main__":
    sys.exit(main())
