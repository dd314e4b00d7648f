"""`nanoqwen generate`: one reply (or a raw continuation), streamed to stdout as it comes.

It runs through the engine service, as the app does (engine/service.py): the same batches
(at most one write per ~40 ms window, the first text at once), the same figures. `--stats`
prints to stderr, after the reply, the engine's decode rate (tok/s and median ms/token), TTFT
as the engine measured it and as stdout saw it (wall clock from the request to the first
character written), the text rate on stdout (tokens per wall second from the first write to
the last) and the prompt's tokens/s.

Sampler settings: a flag that is given wins; otherwise the model file's generation config
(SamplerParams.from_generation_config, which falls back to transformers' defaults for keys
the file lacks), or llama.cpp's defaults when the file has no generation config at all.
`-n -1` generates until a stop token or a full context, as in llama.cpp. Every value follows the
rules the app's settings follow (sampling.SAMPLER_RULES): `--temp` is 0 (greedy) or more, and
a negative temperature is refused, not taken as greedy.
Errors go to stderr with exit code 1 (NanoqwenError, handled in cli.main); a reader that closes
stdout (`| head`) ends the reply quietly with status 141 and a full disk is one error line
(cli.main's doc says why).
"""

from __future__ import annotations

import sys

from .cli import write_stdout
from .errors import NanoqwenError
from .sampling import SamplerParams
from .service import Batch, EngineService, Failed, Finished, Note, SeenMeter, StatsUpdate

# flag name (argparse dest) -> SamplerParams field
_FLAGS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
          "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n", "seed": "seed"}


def sampler_params(args, generation: dict | None) -> SamplerParams:
    """SamplerParams from the CLI flags over the file's generation defaults (module doc)."""
    base = SamplerParams.model_defaults(generation)
    d = base.to_dict()
    for flag, fld in _FLAGS.items():
        v = getattr(args, flag, None)
        if v is not None:
            d[fld] = v
    params = SamplerParams(**d)
    try:
        return params.validate()
    except ValueError as e:
        # name the flag the user typed, not only the field
        flag = next((f"--{k.replace('_', '-')}" for k, f in _FLAGS.items()
                     if f in str(e) and getattr(args, k, None) is not None), None)
        raise NanoqwenError(f"{flag}: {e}" if flag else str(e)) from e


def cli_generate(args) -> int:
    n = args.n_predict
    if n == 0 or n < -1:
        raise NanoqwenError(f"-n {n}: give a positive number of tokens, or -1 for no limit")
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise NanoqwenError("the prompt is empty (give --prompt or text on stdin)")
    engine = EngineService.open(args.model, backend=args.backend, mode=args.mode,
                                threads=args.threads)
    try:
        info = engine.info
        params = sampler_params(args, info.generation)
        spec = getattr(args, "spec", "off")
        draft = getattr(args, "draft", None)
        if draft is not None and spec != "draft":
            raise NanoqwenError("--draft FILE goes with --spec draft")
        if spec != "off":
            try:
                engine.set_spec(spec, draft=draft)
            except ValueError as e:
                raise NanoqwenError(f"--spec {spec}: {e}") from e
        max_new = info.max_context if n == -1 else n
        if args.stats and info.fallback:
            print(f"backend: reference ({info.fallback})", file=sys.stderr)
        seen = SeenMeter()     # from the request on: what a reader of stdout sees
        if args.raw:
            events = engine.submit_raw(prompt, params, max_new)
        else:
            events = engine.submit([], prompt, params, max_new, system_prompt=args.system or "")
        failed = False
        for ev in events:
            if isinstance(ev, Batch) and ev.text:
                # a closed pipe (BrokenPipeError) or a full disk (OutputError) leaves the loop
                # here; the finally below closes the engine, which stops the reply
                write_stdout(ev.text)
                seen.wrote(ev.stats.n_generated if ev.stats else 0)
            elif isinstance(ev, Note):
                print(f"note: {ev.message}", file=sys.stderr)
            elif isinstance(ev, Failed):
                # the engine's own words (a NanoqwenError says what and where), not the app's
                msg = str(ev.exception) if isinstance(ev.exception, NanoqwenError) else ev.message
                print(f"nanoqwen generate: error: {msg}", file=sys.stderr)
                failed = True
            elif isinstance(ev, Finished) and args.stats:
                if ev.stats is not None:
                    print(format_stats(ev.stats, info.backend, seen), file=sys.stderr)
                print(f"done: {ev.reason}", file=sys.stderr)
        return 1 if failed else 0
    finally:
        engine.close()


def _num(v: float | None, fmt: str, unit: str) -> str:
    return "-" if v is None else f"{v:{fmt}} {unit}"


def format_stats(s: StatsUpdate, backend: str, seen: SeenMeter) -> str:
    """The --stats lines: the engine's figures, then what stdout saw."""
    decode = (f"{_num(s.tokens_per_s, '.1f', 'tok/s')}, median "
              f"{_num(s.median_ms, '.2f', 'ms/token')}")
    return "\n".join([
        f"backend {backend} ({s.mode}); prompt {s.n_prompt} tokens ({s.n_prefilled} prefilled, "
        f"{_num(s.prefill_tokens_per_s, '.1f', 'tok/s')}); generated {s.n_generated}; "
        f"context {s.kv_len}/{s.max_context}",
        f"engine: decode {decode}; TTFT {_num(s.ttft_ms, '.1f', 'ms')}",
        f"stdout: TTFT {_num(seen.ttft_ms, '.1f', 'ms')} (request to first character); text "
        f"{_num(seen.tokens_per_s, '.1f', 'tok/s')} (first to last write)",
    ] + ([spec_line(s)] if s.spec else []))


def spec_line(s: StatsUpdate) -> str:
    """--stats' speculation line: drafted, accepted, acceptance, effective ms per token."""
    rate = f"{100 * s.n_accepted / s.n_drafted:.0f}%" if s.n_drafted else "-"
    eff = _num(1e3 / s.tokens_per_s if s.tokens_per_s else None, ".2f", "ms/token")
    per = _num(s.tokens_per_verify_step, ".2f", "tokens")
    return (f"spec {s.spec}: drafted {s.n_drafted}, accepted {s.n_accepted} ({rate}), "
            f"{per} a verify step; effective {eff} (decode time / tokens after the first)")
