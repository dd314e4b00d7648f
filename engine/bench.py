"""`nanoqwen bench`: prompt processing and token generation speed in llama-bench's terms.

    nanoqwen bench [--model FILE | --synthetic PRESET] [--backend auto|cuda|reference] [-d N] ...
    nanoqwen bench [--model FILE] --spec ngram|draft [--draft FILE] [-n N] [-r R] ...

For each decode mode of the backend: `-r` timed repetitions (after one warm-up) of: empty
cache, prefill `-p` random prompt ids, then `-n` tokens (no stop ids), greedy unless a sampler
flag is given (`--temp --top-k --top-p --min-p --repeat-penalty --repeat-last-n --seed`, as
`nanoqwen generate` takes them, over the app's defaults; the seed is fixed: every repetition
draws the same tokens, so the sampler's cost is the difference to the greedy rows). All times are the
backend's own per-step timing (StepEvent.step_ms: CUDA events on the GPU; on the reference
backend the wall clock around each step of its compute thread, the consumer's time excluded):
  TTFT      the first event's step_ms: prefill of the prompt + the first sample
  pp t/s    p / TTFT (llama-bench's pp is prompt processing; our first sample adds ~0.1 ms)
  ms/token  mean decode step of a repetition (forward + sample + advance)
  tg t/s    1000 / ms/token
  GB/s      CUDA only: (weight bytes per token + K/V bytes read at the mean context) /
            ms/token, and its share of the device's copy bandwidth, measured by the bench
            itself on the card it runs on (copy_bandwidth: a device-to-device copy, read +
            write; 4276 GB/s on the H200, about 3 TB/s on an H100 SXM: a fixed H200 figure
            made an H100's share look 20-30% worse than it is). The reference backend runs
            fp32 weights dequantized at load: no INT4 traffic, no GB/s
Each figure is the median over repetitions. `-d N` (llama-bench's depth) puts N random ids in
the cache before each repetition (untimed): TTFT is then the prompt's prefill after N cached
tokens and the decode steps read N + p + i, the long-context figures; rows read "pp512 @ d8192".

`--spec ngram|draft [--draft FILE]`: speculative decoding instead of the pp/tg rows, on the
code-editing workload (engine/spec_workload.py: 12 requests rewriting code given in the
prompt, 4 writing new code), each reply from an empty cache, at most -n tokens, to the
tokenizer's stop ids; plain and speculative rows per request group and mode: the effective
ms per token (decode time over the tokens after each reply's first), the same over the wall
clock a consumer of the stream sees, drafted / accepted ids, tokens a verify step, the
speedup over plain decoding and whether the greedy replies are identical (run_spec_bench).
A random-weight model accepts nothing real: measure acceptance on a trained model.

The model: `--model FILE` (default: the bundled model), loaded as `nanoqwen generate` loads it
(engine/loader.py: "auto" is CUDA where it runs, else the reference backend on the CPU), or
`--synthetic PRESET`: random weights made directly on the GPU (CUDA only; no file), the very
tensors `nanoqwen convert --synthetic PRESET` writes (seed 0; engine/synthetic.py).
`--json` prints the rows with source, backend, device, commit and date (benchmarks/results/).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

DEFAULT_N_PROMPT = 512    # -p
COPY_BYTES = 512 * 2**20   # the copy_bandwidth buffer: far past the 50-60 MB L2 of Hopper
COPY_REPS = 10


def copy_bandwidth(device) -> float | None:
    """GB/s of a device-to-device copy on `device` (bytes read + bytes written over the
    median of COPY_REPS timed copies after one warm-up), the ceiling `pct_of_copy_bw` is a
    share of; None where it cannot be measured (not CUDA, or no room for the two buffers next
    to the model: then the rows carry no share rather than one against another card)."""
    import torch

    from .rates import median_ms

    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
    except torch.cuda.OutOfMemoryError:
        return None
    with torch.cuda.device(device):
        dst.copy_(src)
        times = []
        for _ in range(COPY_REPS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    del src, dst
    return 2 * COPY_BYTES / (median_ms(times) * 1e-3) / 1e9


def _commit() -> str:
    """The commit a benchmark's JSON records: NANOQWEN_COMMIT when set (the GPU machine runs on
    a copy of the working tree without .git, so the caller names it: benchmarks/verify_gpu.sh's
    usage line shows how), else this checkout's short HEAD with "-dirty" when tracked files
    differ from it, else "unknown" (an installed copy, or no git). The one implementation the
    CLI's bench and benchmarks/ use."""
    if os.environ.get("NANOQWEN_COMMIT"):
        return os.environ["NANOQWEN_COMMIT"]
    try:
        from nanoqwen import REPO_ROOT

        if not (REPO_ROOT / ".git").exists():  # an installed copy: no checkout to ask
            return "unknown"
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=5)
        sha = out.stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
        return sha + ("-dirty" if dirty.stdout.strip() else "")
    except Exception:
        return "unknown"


def _size_str(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


_MEASURE = object()   # run_bench's copy_gbs default: measure the card's copy bandwidth


def run_bench(backend, n_prompt: int, n_gen: int, reps: int, modes: list[str],
              seed: int = 0, params=None, depth: int = 0, copy_gbs=_MEASURE) -> list[dict]:
    """llama-bench's pp/tg rows per mode; decode samples with `params` (SamplerParams;
    None: greedy, llama-bench's and the figures' default). `copy_gbs`: the card's copy
    bandwidth (GB/s) the rows' share is of; measured here (copy_bandwidth) unless a caller
    that runs many benches on one card passes its one measurement (or None: no share). `depth` (llama-bench's -d): each
    repetition first forwards that many random ids, untimed, so the prompt is prefilled after
    `depth` cached tokens and the decode steps read depth + n_prompt + i of them; the rows'
    test names then end in " @ d<depth>", as llama-bench's do."""
    import torch

    from .rates import median_ms, tokens_per_s
    from .sampling import SamplerParams

    cfg = backend.config
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (n_prompt,), generator=g).tolist()
    context = torch.randint(0, cfg.vocab_size, (depth,), generator=g).tolist()
    at = f" @ d{depth}" if depth else ""
    sampler = params if params is not None else SamplerParams.greedy_params()
    if not sampler.greedy and sampler.seed < 0:
        sampler = dataclasses.replace(sampler, seed=seed)  # the same draws every repetition
    rows = []
    on_gpu = backend.name == "cuda"   # INT4 weights on the card: GB/s and its share apply
    if copy_gbs is _MEASURE:
        copy_gbs = copy_bandwidth(backend.device) if on_gpu else None
    for mode in modes:
        backend.mode = mode
        ttft, mspt = [], []
        for r in range(reps + 1):  # repetition 0 warms up (graph upload, cuBLAS handles)
            backend.truncate(0)
            if context:
                backend.forward(context)   # the cached context, untimed
            events = list(backend.generate(prompt, sampler, max_new_tokens=n_gen + 1))
            if r == 0:
                continue
            ttft.append(events[0].step_ms)
            steps = [e.step_ms for e in events[1:]]
            mspt.append(sum(steps) / len(steps))
        backend.truncate(0)
        t_ms = median_ms(ttft)
        d_ms = median_ms(mspt)
        mean_ctx = depth + n_prompt + n_gen / 2
        kv_bytes = 2 * cfg.num_hidden_layers * mean_ctx * cfg.kv_size * 2
        gbs = (cfg.decode_bytes_per_token() + kv_bytes) / (d_ms * 1e-3) / 1e9
        common = dict(model=cfg.name, backend=backend.name, device=backend.device_name,
                      mode=mode, reps=reps, sampler=sampler_label(sampler), depth=depth)
        rows.append(dict(common, test=f"pp{n_prompt}{at}", tokens_per_s=tokens_per_s(n_prompt, t_ms),
                         ttft_ms=t_ms, ttft_all=ttft))
        bw = dict(gb_per_s=gbs) if on_gpu else {}
        if on_gpu and copy_gbs:
            bw.update(copy_gb_per_s=copy_gbs, pct_of_copy_bw=100 * gbs / copy_gbs)
        rows.append(dict(common, test=f"tg{n_gen}{at}", tokens_per_s=tokens_per_s(1, d_ms),
                         ms_per_token=d_ms, **bw, ms_per_token_all=mspt))
    return rows


def spec_turn(backend, ids: list[int], params, n_gen: int, stop_ids, spec: str | None) -> dict:
    """One reply from an empty cache with speculation `spec` (None: plain decoding): its ids,
    the backend's decode time (step_ms of the tokens after the first: CUDA events per step in
    plain decoding on the GPU, the wall clock around each verify step in speculation) and the
    wall clock from the first token's arrival to the last's, as a consumer of the stream sees
    it; the TTFT (the first token's step_ms); the drafter's figures. benchmarks/bench_spec.py
    times its turns with it too."""
    backend.truncate(0)
    backend.spec = spec
    try:
        events, t_first = [], None
        for chunk in backend.generate_chunks(ids, params, n_gen, stop_ids, None, 0.0):
            if t_first is None:
                t_first = time.perf_counter()
            events += chunk
        wall_ms = (time.perf_counter() - t_first) * 1e3
    finally:
        backend.spec = None
        backend.truncate(0)
    st = dict(backend.spec_stats) if spec else {}
    return dict(tokens=[e.token_id for e in events], decode_ms=sum(e.step_ms for e in events[1:]),
                wall_ms=wall_ms, ttft_ms=events[0].step_ms, drafted=st.get("drafted", 0),
                accepted=st.get("accepted", 0), verify_steps=st.get("verify_steps", 0))


def run_spec_bench(backend, tokenizer, spec: str, n_gen: int, reps: int, modes: list[str],
                   params=None) -> list[dict]:
    """`nanoqwen bench --spec`: the code-editing workload (spec_workload: 12 requests that
    rewrite code given in the prompt, 4 that write new code), each answered from an empty cache
    with plain decoding and with `spec` (the backend's spec must be settable to it), at most
    `n_gen` tokens a reply, stopping at the tokenizer's stop ids. Per mode and group ("edit12",
    "new4") a plain row and a spec row; each figure is the median over `reps` repetitions (after
    a warm-up turn per decoding) of the group's totals: ms_per_token = decode time / tokens
    after each reply's first (the effective rate), wall_ms_per_token the same over the
    consumer's wall clock; the spec row adds drafted / accepted ids, acceptance, tokens per
    verify step (accepted + its own token, over the steps that verified drafts), speedup =
    the plain row's wall_ms_per_token over its own, and `identical` (greedy: every reply the
    plain reply token for token; None when sampling)."""
    from .rates import median_ms, tokens_per_s
    from .sampling import SamplerParams
    from .spec_workload import requests

    sampler = params if params is not None else SamplerParams.greedy_params()
    if not sampler.greedy and sampler.seed < 0:
        sampler = dataclasses.replace(sampler, seed=0)   # the same draws every repetition
    prompts: dict[str, list[list[int]]] = {}
    for kind, text in requests():
        prompts.setdefault(kind, []).append(tokenizer.encode_chat([{"role": "user",
                                                                    "content": text}]))
    stop = tokenizer.stop_ids
    rows = []
    for mode in modes:
        backend.mode = mode
        for decoding in (None, spec):    # warm-up: graphs per verify length, cuBLAS handles
            spec_turn(backend, prompts["edit"][0], sampler, n_gen, stop, decoding)
        for kind, group in prompts.items():
            runs = {None: [], spec: []}   # per repetition: one turn per request
            for _ in range(reps):
                for decoding in (None, spec):
                    runs[decoding].append([spec_turn(backend, ids, sampler, n_gen, stop,
                                                      decoding) for ids in group])
            plain_ids = [t["tokens"] for t in runs[None][0]]
            common = dict(model=backend.config.name, backend=backend.name,
                          device=backend.device_name, mode=mode, reps=reps,
                          sampler=sampler_label(sampler), requests=len(group))
            for decoding in (None, spec):
                per_rep = runs[decoding]
                n_dec = [sum(len(t["tokens"]) - 1 for t in rep) for rep in per_rep]
                ms = median_ms([sum(t["decode_ms"] for t in rep) / max(1, n)
                                for rep, n in zip(per_rep, n_dec)])
                wall = median_ms([sum(t["wall_ms"] for t in rep) / max(1, n)
                                  for rep, n in zip(per_rep, n_dec)])
                test = f"{kind}{len(group)} tg{n_gen}" + (f" spec={spec}" if decoding else "")
                row = dict(common, test=test, spec=decoding, n_generated=sum(
                    len(t["tokens"]) for t in per_rep[0]), ms_per_token=ms,
                    wall_ms_per_token=wall, tokens_per_s=tokens_per_s(1, wall))
                if decoding:
                    first = per_rep[0]
                    drafted = sum(t["drafted"] for t in first)
                    accepted = sum(t["accepted"] for t in first)
                    steps = sum(t["verify_steps"] for t in first)
                    row.update(drafted=drafted, accepted=accepted,
                               acceptance=accepted / drafted if drafted else None,
                               tokens_per_verify_step=(accepted + steps) / steps if steps else None,
                               speedup=rows[-1]["wall_ms_per_token"] / wall,
                               identical=(all([t["tokens"] for t in rep] == plain_ids
                                              for rep in per_rep) if sampler.greedy else None))
                rows.append(row)
    return rows


def format_spec_table(rows: list[dict]) -> str:
    lines = ["| model | backend | mode | test | tokens | ms/token | wall ms/token | t/s | x plain "
             "| drafted | accepted | tokens a verify step | identical |", "|" + " --- |" * 13]
    for r in rows:
        sp = r["spec"] is not None
        f = lambda key, fmt: (format(r[key], fmt) if sp and r.get(key) is not None  # noqa: E731
                              else "-")
        lines.append(f"| {r['model']} | {r['backend']} | {r['mode']} | {r['test']} "
                     f"| {r['n_generated']} | {r['ms_per_token']:.3f} | {r['wall_ms_per_token']:.3f} "
                     f"| {r['tokens_per_s']:.1f} | {f('speedup', '.2f')} | {f('drafted', 'd')} "
                     f"| {f('accepted', 'd')} | {f('tokens_per_verify_step', '.2f')} "
                     f"| {r['identical'] if sp and r['identical'] is not None else '-'} |")
    return "\n".join(lines)


def format_table(rows: list[dict], size_bytes: int) -> str:
    copy = next((r["copy_gb_per_s"] for r in rows if "copy_gb_per_s" in r), None)
    head = ("| model | size | backend | mode | test | t/s | TTFT ms | ms/token | GB/s "
            f"| % of copy{f' ({copy:.0f})' if copy else ''} |")
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        ttft = f"{r['ttft_ms']:.2f}" if "ttft_ms" in r else "-"
        mspt = f"{r['ms_per_token']:.3f}" if "ms_per_token" in r else "-"
        gbs = f"{r['gb_per_s']:.0f}" if "gb_per_s" in r else "-"
        pct = f"{r['pct_of_copy_bw']:.1f}" if "pct_of_copy_bw" in r else "-"
        lines.append(f"| {r['model']} | {_size_str(size_bytes)} | {r['backend']} | {r['mode']} "
                     f"| {r['test']} | {r['tokens_per_s']:.1f} | {ttft} | {mspt} | {gbs} | {pct} |")
    return "\n".join(lines)


def sampler_label(p) -> str:
    """"greedy", or the settings that shape the draw (as llama.cpp's flags name them)."""
    if p.greedy:
        return "greedy"
    return (f"temp {p.temperature:g}, top-k {p.top_k}, top-p {p.top_p:g}, min-p {p.min_p:g}, "
            f"repeat-penalty {p.repeat_penalty:g} (last {p.repeat_last_n})")


def bench_sampler(args):
    """SamplerParams from bench's sampler flags: None (greedy) when none is given; otherwise
    the defaults of SamplerParams (llama.cpp's, the app's) under the flags given."""
    from .cli_generate import _FLAGS
    from .errors import NanoqwenError
    from .sampling import SamplerParams

    given = {fld: getattr(args, flag) for flag, fld in _FLAGS.items()
             if getattr(args, flag, None) is not None}
    if not given:
        return None
    try:
        return SamplerParams(**{**SamplerParams().to_dict(), **given}).validate()
    except ValueError as e:
        raise NanoqwenError(str(e)) from e


def cli_bench(args) -> int:
    from .cli import write_stdout
    from .config import ModelConfig
    from .errors import NanoqwenError
    from .service import MODES

    modes = None
    if args.mode is not None:
        modes = [m.strip() for m in args.mode.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if not modes or bad:
            raise NanoqwenError(f"--mode {args.mode!r}: use a comma list of {', '.join(MODES)}")
    spec = getattr(args, "spec", None)
    if getattr(args, "draft", None) is not None and spec != "draft":
        raise NanoqwenError("--draft FILE goes with --spec draft")
    if spec == "draft" and args.draft is None:
        raise NanoqwenError("--spec draft needs --draft FILE (a .nanoqwen of the same tokenizer)")
    if spec and args.synthetic:
        raise NanoqwenError("--spec answers the code-editing requests, which are text: bench a "
                            "file with its tokenizer (`nanoqwen convert --synthetic PRESET "
                            "--tokenizer tokenizer.json -o FILE` makes one of random weights)")
    if spec and (args.depth or args.n_prompt is not None):
        raise NanoqwenError("-p and -d do not apply to --spec: its prompts are the workload's "
                            "requests, each answered from an empty cache")
    if args.n_prompt is None:
        args.n_prompt = DEFAULT_N_PROMPT
    for name in ("n_prompt", "n_gen", "repetitions"):
        if getattr(args, name) < 1:
            raise NanoqwenError(f"--{name.replace('_', '-')} must be at least 1")
    if args.depth < 0:
        raise NanoqwenError(f"--depth {args.depth}: the cached tokens before each test, 0 or more")
    params = bench_sampler(args)
    prefill_weights = getattr(args, "prefill_weights", "auto")
    if prefill_weights != "auto" and args.backend == "reference":
        raise NanoqwenError(f"--prefill-weights {prefill_weights}: the reference backend "
                            "prefills one way (its fp32 weights)")

    # a repetition forwards the cached context and the prompt and makes n decode steps: d + p + n
    # positions (the last of its n + 1 tokens is sampled, not forwarded); the cache gets 16
    # more where the model has them. --spec: its longest request and n (bench_positions)
    positions = args.depth + args.n_prompt + args.n_gen
    t0 = time.perf_counter()
    loaded = None
    if args.synthetic:
        if args.backend == "reference":
            raise NanoqwenError("--synthetic makes its weights on the GPU (CUDA backend only); "
                                "for the reference backend bench a file: --model FILE (or "
                                "`nanoqwen convert --synthetic PRESET -o FILE` first)")
        cfg = ModelConfig.from_name(args.synthetic)
        cfg.check_context(positions, "-d + -p + -n")
        from .backends.cuda import CudaBackend

        backend = CudaBackend.synthetic(cfg, seed=0, max_context=_cache_size(positions, cfg),
                                        prefill_weights=prefill_weights)
        source = f"synthetic {args.synthetic} (random weights, std 0.02)"
        size = backend._weight_bytes()
    else:
        from . import loader
        from .format import open_model

        path = args.model or loader.default_model_path()
        with open_model(path) as mf:  # the header only: the context the model allows
            cfg = mf.config
            if spec:
                positions = _spec_positions(mf, args.n_gen)
        cfg.check_context(positions, "the longest request + -n" if spec else "-d + -p + -n")
        loaded = loader.load(path, backend=args.backend, max_context=_cache_size(positions, cfg),
                             threads=args.threads, prefill_weights=prefill_weights)
        backend = loaded.backend
        source = str(path)
        size = sum(t.nbytes for t in loaded.model_file.tensors.values())
        if loaded.fallback_reason:
            print(f"backend: reference ({loaded.fallback_reason})", file=sys.stderr)
    try:
        load_s = time.perf_counter() - t0
        if modes is None:
            modes = list(backend.modes)
        missing = [m for m in modes if m not in backend.modes]
        if missing:
            raise NanoqwenError(f"--mode {','.join(missing)}: the {backend.name} backend has "
                                f"only {', '.join(backend.modes)}")
        if spec:
            return _cli_spec_bench(args, loaded, source, modes, params, load_s)
        rows = run_bench(backend, args.n_prompt, args.n_gen, args.repetitions, modes,
                         params=params, depth=args.depth)
        prefill = getattr(backend, "prefill_weights", None)
        if args.json:
            write_stdout(json.dumps(dict(source=source, backend=backend.name,
                                  device=backend.device_name, commit=_commit(), load_s=load_s,
                                  prefill_weights=prefill, weight_bytes=size,
                                  n_prompt=args.n_prompt, n_gen=args.n_gen, depth=args.depth,
                                  sampler=rows[0]["sampler"],
                                  threads=_threads(backend), date=time.strftime("%Y-%m-%d"),
                                  rows=rows), indent=2) + "\n")
        else:
            write_stdout(f"# {source} on {backend.device_name} ({backend.name} backend), "
                         f"commit {_commit()}, {time.strftime('%Y-%m-%d')}, load {load_s:.1f} s"
                         + (f", prefill weights {prefill}" if prefill else "")
                         + f", medians of {args.repetitions} reps, sampler "
                         + rows[0]["sampler"] + "\n")
            write_stdout(format_table(rows, size) + "\n")
    finally:
        if loaded is not None:
            loaded.close()
    return 0


def _spec_positions(mf, n_gen: int) -> int:
    """--spec's context: the longest workload request (chat-formatted) + n_gen."""
    from .spec_workload import requests
    from .tokenizer import Tokenizer

    tok = Tokenizer.from_model_file(mf)
    return max(len(tok.encode_chat([{"role": "user", "content": text}]))
               for _, text in requests()) + n_gen


def _cli_spec_bench(args, loaded, source: str, modes: list[str], params, load_s: float) -> int:
    from . import loader
    from .cli import write_stdout
    from .errors import NanoqwenError

    backend = loaded.backend
    draft = None
    if args.spec == "draft":
        draft = loader.load_draft(args.draft, backend, loaded.tokenizer, source)
        backend.draft_backend = draft.backend
    try:
        try:
            backend.spec = args.spec   # refused here, before any turn, if it cannot
        except ValueError as e:
            raise NanoqwenError(f"--spec {args.spec}: {e}") from e
        backend.spec = None
        rows = run_spec_bench(backend, loaded.tokenizer, args.spec, args.n_gen, args.repetitions,
                              modes, params=params)
    finally:
        backend.draft_backend = None
        if draft is not None:
            draft.close()
    head = dict(source=source, backend=backend.name, device=backend.device_name,
                commit=_commit(), load_s=load_s, spec=args.spec,
                draft=str(args.draft) if draft else None, n_gen=args.n_gen,
                sampler=rows[0]["sampler"], date=time.strftime("%Y-%m-%d"))
    if args.json:
        write_stdout(json.dumps(dict(head, rows=rows), indent=2) + "\n")
    else:
        write_stdout(f"# {source} on {backend.device_name} ({backend.name} backend), commit "
                     f"{head['commit']}, {head['date']}, spec {args.spec}"
                     + (f" (draft {args.draft})" if draft else "")
                     + f", medians of {args.repetitions} reps, sampler {head['sampler']}\n")
        write_stdout(format_spec_table(rows) + "\n")
    return 0


def _cache_size(positions: int, cfg) -> int:
    return min(positions + 16, cfg.max_position_embeddings)


def _threads(backend) -> int | None:
    """The CPU backend's threads (what the figure used), as its compute thread has them."""
    if backend.device_name != "cpu":
        return None
    from .backends.reference import set_cpu_threads

    return set_cpu_threads(None)
