"""`nanoqwen bench`: prompt processing and token generation speed in llama-bench's terms.

    nanoqwen bench [--model FILE | --synthetic PRESET] [--backend auto|cuda|reference] [-d N] ...

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
    # The GPU machine runs on a copy of the working tree without .git: the caller passes the
    # commit in NANOQWEN_COMMIT (benchmarks/verify_gpu.sh's usage line shows how).
    if os.environ.get("NANOQWEN_COMMIT"):
        return os.environ["NANOQWEN_COMMIT"]
    try:
        from nanoqwen import REPO_ROOT

        if not (REPO_ROOT / ".git").exists():  # an installed copy: no checkout to ask
            return "unknown"
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
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
    for name in ("n_prompt", "n_gen", "repetitions"):
        if getattr(args, name) < 1:
            raise NanoqwenError(f"--{name.replace('_', '-')} must be at least 1")
    if args.depth < 0:
        raise NanoqwenError(f"--depth {args.depth}: the cached tokens before each test, 0 or more")
    params = bench_sampler(args)

    # a repetition forwards the cached context and the prompt and makes n decode steps: d + p + n
    # positions (the last of its n + 1 tokens is sampled, not forwarded); the cache gets 16
    # more where the model has them
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

        backend = CudaBackend.synthetic(cfg, seed=0, max_context=_cache_size(positions, cfg))
        source = f"synthetic {args.synthetic} (random weights, std 0.02)"
        size = backend._weight_bytes()
    else:
        from . import loader
        from .format import open_model

        path = args.model or loader.default_model_path()
        with open_model(path) as mf:  # the header only: the context the model allows
            cfg = mf.config
        cfg.check_context(positions, "-d + -p + -n")
        loaded = loader.load(path, backend=args.backend, max_context=_cache_size(positions, cfg),
                             threads=args.threads)
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


def _cache_size(positions: int, cfg) -> int:
    return min(positions + 16, cfg.max_position_embeddings)


def _threads(backend) -> int | None:
    """The CPU backend's threads (what the figure used), as its compute thread has them."""
    if backend.device_name != "cpu":
        return None
    from .backends.reference import set_cpu_threads

    return set_cpu_threads(None)
