"""`nanoqwen generate`: one reply (or a raw continuation), streamed to stdout as it comes.

Sampler settings: a flag that is given wins; otherwise the model file's generation config
(SamplerParams.from_generation_config, which falls back to transformers' defaults for keys
the file lacks), or llama.cpp's defaults when the file has no generation config at all.
`-n -1` generates until a stop token or a full context, as in llama.cpp.
Errors go to stderr with exit code 1 (NanoqwenError, handled in cli.main).
"""

from __future__ import annotations

import sys

from .errors import NanoqwenError
from .loader import load
from .sampling import SamplerParams
from .session import ChatSession, Done, Error, Notice, Stats, TextDelta, generate_raw

# flag name (argparse dest) -> SamplerParams field
_FLAGS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
          "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n", "seed": "seed"}


def sampler_params(args, generation: dict | None) -> SamplerParams:
    """SamplerParams from the CLI flags over the file's generation defaults (module doc)."""
    base = SamplerParams.from_generation_config(generation) if generation else SamplerParams()
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
    engine = load(args.model, backend=args.backend, mode=args.mode)
    try:
        params = sampler_params(args, engine.model_file.generation)
        backend, tok = engine.backend, engine.tokenizer
        max_new = backend.max_context if n == -1 else n
        if args.stats and engine.fallback_reason:
            print(f"backend: reference ({engine.fallback_reason})", file=sys.stderr)
        if args.raw:
            events = generate_raw(backend, tok, prompt, params, max_new)
        else:
            events = ChatSession(backend, tok, system_prompt=args.system).generate(
                prompt, params, max_new)
        failed = False
        for ev in events:
            if isinstance(ev, TextDelta):
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            elif isinstance(ev, Notice):
                print(f"note: {ev.message}", file=sys.stderr)
            elif isinstance(ev, Error):
                print(f"nanoqwen generate: error: {ev.message}", file=sys.stderr)
                failed = True
            elif isinstance(ev, Stats) and args.stats:
                print(_format_stats(ev), file=sys.stderr)
            elif isinstance(ev, Done) and args.stats:
                print(f"done: {ev.reason}", file=sys.stderr)
        return 1 if failed else 0
    finally:
        engine.close()


def _format_stats(s: Stats) -> str:
    ms = f"{s.ms_per_token:.2f} ms/token ({s.tokens_per_s:.1f} t/s)" if s.ms_per_token else "-"
    return (f"backend {s.backend} ({s.mode}); prompt {s.n_prompt} tokens "
            f"({s.n_prefilled} prefilled), TTFT {s.ttft_ms:.1f} ms; "
            f"generated {s.n_generated}: decode {ms}; context {s.kv_len}/{s.max_context}")
