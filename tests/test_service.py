"""The engine service (engine/service.py): the one interface the app and `nanoqwen generate`
use. The real tiny model on the reference backend; greedy replies are compared with a direct
ChatSession run. Batching and the rolling figures are checked on an injected clock, so no
result depends on this machine's speed.
"""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest

from nanoqwen.engine import (BATCH_SECONDS, Batch, EngineService, Failed, Finished, SeenMeter,
                             describe_error)
from nanoqwen.engine.sampling import SamplerParams
from nanoqwen.engine.session import Done, Stats, TextDelta, TokenIds

from test_app import greedy_reply

GREEDY = SamplerParams.greedy_params()
APP_DIR = Path(__file__).resolve().parent.parent / "app"


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = EngineService.open(tiny_model_path, backend="reference")
    yield eng
    eng.close()


def batches_of(out):
    return [e for e in out if isinstance(e, Batch)]


# --- batching ----------------------------------------------------------------------------------
def test_service_batches_text_by_its_window_not_per_token(engine):
    """What the service guarantees, on its own clock: the first text at once (TTFT never waits
    for a window), then a Batch only once BATCH_SECONDS have passed since the previous one;
    the end of the turn flushes at once; no text is lost or reordered. The clock is the
    test's: 1/64 s per engine event (exact in binary, so no rounding decides a window edge),
    so the result does not depend on this machine's speed."""
    now = [0.0]

    def events():
        for i in range(100):
            now[0] += 1 / 64
            yield TokenIds((i,), (1.0,))
            yield TextDelta(f"t{i} ")
        yield Stats(ttft_ms=1.0, ms_per_token=1.0, tokens_per_s=1000.0, n_prompt=3,
                    n_generated=100, kv_len=103, max_context=256, mode="eager")
        yield Done("length")

    out = list(engine._batched(events(), clock=lambda: now[0]))
    batches = batches_of(out)
    assert isinstance(out[-1], Finished) and out[-1].reason == "length"
    assert "".join(b.text for b in batches) == "".join(f"t{i} " for i in range(100))
    # the first token's text alone, then a Batch after every `per` events (the first clock
    # reading at or past the window), then the closing flush with the rest
    per = math.ceil(BATCH_SECONDS * 64)
    sizes = [1] + [per] * (99 // per) + ([99 % per] if 99 % per else [])
    assert [b.text.count(" ") for b in batches] == sizes
    assert out[-1].stats.n_generated == 100 and out[-1].stats.final


def test_rolling_decode_figures_cover_the_last_second_of_steps(engine):
    """The rolling rate is over the last second of decode steps (by their own times), not the
    last token and not the whole reply: 50 steps of 20 ms, then 100 of 10 ms -> 100 tok/s."""
    tick = [0.0]

    def clock():
        tick[0] += 1.0   # every text flushes: one Batch per chunk
        return tick[0]

    def events():
        yield TokenIds((0,), (5.0,))                  # TTFT
        yield TextDelta("a")
        for ms in [20.0] * 50 + [10.0] * 100:
            yield TokenIds((1,), (ms,))
            yield TextDelta("b")
        yield Stats(ttft_ms=5.0, ms_per_token=10.0, tokens_per_s=150 / 2.0, n_prompt=7,
                    n_generated=151, kv_len=157, max_context=256, mode="eager", n_prefilled=7,
                    n_reused=0, prefill_tokens_per_s=1400.0, backend="reference")
        yield Done("length")

    out = list(engine._batched(events(), clock=clock))
    ups = [b.stats for b in batches_of(out)]
    assert ups[0].ttft_ms == 5.0 and ups[0].rolling_tokens_per_s is None   # no decode step yet
    at_50 = ups[50]                                   # 50 steps of 20 ms: exactly 1 s
    assert (at_50.rolling_tokens_per_s, at_50.rolling_median_ms) == (50.0, 20.0)
    assert at_50.median_ms is None and at_50.tokens_per_s == 50.0 and not at_50.final
    end = out[-1].stats
    assert end.final and (end.rolling_tokens_per_s, end.rolling_median_ms) == (100.0, 10.0)
    assert (end.n_prompt, end.n_prefilled, end.prefill_tokens_per_s) == (7, 7, 1400.0)
    assert sum(len(u.step_ms) for u in ups + [end]) == 150    # every decode step, once


# --- the real engine through the service ----------------------------------------------------------
def test_service_streams_the_engine_reply_whole(engine, tiny_model_path):
    """The batches add up to the session's own reply (greedy), the turn ends Finished with
    every token counted and the session's figures, and there are never more batches than
    tokens (+1 for the closing flush) whatever the machine's speed."""
    n = 80
    out = list(engine.submit([], "hello", GREEDY, n))
    batches = batches_of(out)
    assert "".join(b.text for b in batches) == greedy_reply(tiny_model_path, [], "hello", n)
    assert len(batches) <= n + 1
    end = out[-1]
    assert isinstance(end, Finished) and end.reason == "length" and end.stats.final
    s = end.stats
    prompt = len(engine.tokenizer.encode_chat([{"role": "user", "content": "hello"}]))
    assert (s.n_generated, s.n_prompt, s.kv_len) == (n, prompt, prompt + n - 1)
    assert s.ttft_ms > 0 and s.prefill_tokens_per_s == pytest.approx(s.n_prefilled / s.ttft_ms * 1e3)
    assert s.rolling_tokens_per_s > 0 and s.median_ms > 0
    assert sum(len(b.stats.step_ms) for b in batches if b.stats) + len(s.step_ms) == n - 1


def test_a_second_turn_reuses_the_cache_and_matches_a_fresh_session(engine, tiny_model_path):
    history = [{"role": "user", "content": "hello"}]
    first = "".join(b.text for b in batches_of(engine.submit([], "hello", GREEDY, 12)))
    history.append({"role": "assistant", "content": first})
    # the random model's reply (byte tokens, U+FFFD) does not re-encode to its sampled ids
    reply_ids = engine.backend.kv_tokens[len(engine.tokenizer.encode_chat(history[:1])):]
    assert first and engine.tokenizer.encode(first)[:len(reply_ids)] != reply_ids
    cached = len(engine.backend.kv_tokens)
    transcript = engine.transcript.copy()
    out = list(engine.submit(history, "second", GREEDY, 12))
    assert "".join(b.text for b in batches_of(out)) == greedy_reply(
        tiny_model_path, history, "second", 12, transcript=transcript)
    # the whole first turn came from the cache, its reply as sampled (a random model's
    # reply need not re-encode to the same ids): only the reply's last token (sampled, never
    # forwarded) and the new message were prefilled
    s = out[-1].stats
    assert s.n_prefilled == s.n_prompt - cached
    assert s.n_prefilled == 1 + len(engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\n"
                                                            "second<|im_end|>\n"
                                                            "<|im_start|>assistant\n"))


def test_cancel_before_the_worker_starts_is_not_lost(engine):
    events = engine.submit([], "hello", GREEDY, 500)   # built, not started (the app's Enter)
    engine.cancel()                                     # Esc before the worker's first next()
    out = list(events)
    assert isinstance(out[-1], Finished) and out[-1].reason == "cancelled"
    assert "".join(b.text for b in batches_of(out)) == ""
    # the cancel was for that submit only
    assert list(engine.submit([], "hello", GREEDY, 5))[-1].reason == "length"


def test_an_abandoned_submit_ends_its_turn_and_the_next_one_matches(engine, tiny_model_path):
    events = engine.submit([], "go on", GREEDY, 3000)
    first = next(e for e in events if isinstance(e, Batch) and e.text)
    events.close()                           # the app quit mid-reply
    history = [{"role": "user", "content": "go on"}, {"role": "assistant", "content": first.text}]
    transcript = engine.transcript.copy()   # its reply ran past the text the app kept
    out = list(engine.submit(history, "next", GREEDY, 8))   # not blocked by the old one
    assert "".join(b.text for b in batches_of(out)) == greedy_reply(
        tiny_model_path, history, "next", 8, transcript=transcript)


def test_a_prompt_that_cannot_fit_fails_with_the_numbers(engine):
    out = list(engine.submit([], "word " * (engine.info.max_context + 100), GREEDY, 5))
    assert len(out) == 1 and isinstance(out[0], Failed) and out[0].kind == "context"
    assert f"context holds {engine.info.max_context} tokens" in str(out[0].exception)


@pytest.mark.parametrize("system", ["", "You are terse. " * 40])
def test_message_room_says_exactly_what_the_engine_accepts(engine, system):
    """message_room's n <= room holds exactly when a turn with that message starts (older
    turns can always be left out), at lengths on both sides of the limit."""
    ctx = engine.info.max_context
    assert engine.message_room("hi", system, 5)[1] == ctx - 5

    def fits(k):
        n, r = engine.message_room("word " * k, system, 5)
        return n <= r
    lo, hi = 0, ctx                   # the most words that fit: fits(lo), not fits(hi)
    while hi - lo > 1:
        lo, hi = ((lo + hi) // 2, hi) if fits((lo + hi) // 2) else (lo, (lo + hi) // 2)
    seen = set()
    for k in (lo - 1, lo, hi, hi + 50):
        text = "word " * k
        n, r = engine.message_room(text, system, 5)
        out = list(engine.submit([{"role": "user", "content": "earlier"},
                                  {"role": "assistant", "content": "reply " * 50}],
                                 text, GREEDY, 5, system))
        refused = isinstance(out[0], Failed) and out[0].kind == "context"
        assert refused == (n > r), (k, n, r)
        seen.add(refused)
    assert seen == {True, False}      # both sides of the limit were tried


def test_info_and_modes(engine, tiny_model_path):
    info = engine.info
    assert (info.path, info.backend, info.device, info.modes) == (tiny_model_path, "reference",
                                                                  "cpu", ("eager",))
    assert engine.mode == "eager" and info.max_context == 4096
    with pytest.raises(ValueError, match="supported: eager"):
        engine.set_mode("graph")
    assert engine.count_tokens([]) == 0
    msgs = [{"role": "user", "content": "hi"}]
    assert engine.count_tokens(msgs, "sys") == len(engine.tokenizer.encode_chat(
        [{"role": "system", "content": "sys"}] + msgs))


def test_engine_errors_are_described_for_people():
    import torch
    from nanoqwen.engine.errors import ContextFullError, FormatError

    kind, msg = describe_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried 2 GiB"))
    assert kind == "oom" and "ran out of memory" in msg and "Tried 2 GiB" in msg
    assert describe_error(ContextFullError("the message does not fit: 9000 > 4096")) == (
        "context", "The message does not fit: 9000 > 4096. Shorten the message.")
    assert describe_error(FormatError("bad magic")) == ("engine", "bad magic")
    assert describe_error(RuntimeError("boom")) == ("engine",
                                                    "The engine failed (RuntimeError: boom)")


def test_seen_meter():
    m = SeenMeter(clock=lambda: 10.0)
    m.start()                                # t0 = 10.0 (the request)
    assert m.ttft_ms is None and m.tokens_per_s is None
    m.wrote(1, 10.25)                        # the first text: TTFT seen 250 ms
    assert m.ttft_ms == 250.0 and m.tokens_per_s is None
    m.wrote(9, 10.75)
    m.wrote(33, 11.25)                       # 32 tokens in 1 s after the first write
    assert m.ttft_ms == 250.0 and m.tokens_per_s == 32.0
    m.start(20.0)
    assert m.ttft_ms is None and m.tokens_per_s is None


# --- the app side of the seam ------------------------------------------------------------------
IMPORT_CHECK = r"""
import os, sys
from pathlib import Path
os.environ["XDG_CONFIG_HOME"] = sys.argv[2]
os.environ["XDG_DATA_HOME"] = sys.argv[2]
import nanoqwen.app.main as main
import nanoqwen.engine
app = main.NanoqwenApp(model=sys.argv[1])
path = app.initial_model_path()
from nanoqwen.engine import EngineService, Finished, default_model_path, describe_error
describe_error(RuntimeError("x"))
default_model_path()
assert "torch" not in sys.modules, "torch was imported before a model was opened"
engine = EngineService.open(path, backend="reference")
assert "torch" in sys.modules
from nanoqwen.engine.sampling import SamplerParams
out = list(engine.submit([], "hi", SamplerParams.greedy_params(), 4))
assert isinstance(out[-1], Finished) and out[-1].stats.n_generated == 4, out[-1]
print("ok", engine.info.backend)
"""


def test_the_app_loads_no_torch_until_the_service_opens_a_model(tiny_model_path, tmp_path):
    r = subprocess.run([sys.executable, "-c", IMPORT_CHECK, str(tiny_model_path), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok reference", r.stderr[-3000:]


# the engine modules the app may import: the service (+ the package), the sampler settings
# (SamplerParams, torch-free at import) and the error types
APP_MAY_IMPORT = {"nanoqwen.engine", "nanoqwen.engine.service", "nanoqwen.engine.sampling",
                  "nanoqwen.engine.errors"}


@pytest.mark.parametrize("path", sorted(APP_DIR.glob("*.py")), ids=lambda p: p.name)
def test_app_reaches_the_engine_only_through_the_service(path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        else:
            names = []
        for name in names:
            assert not name.startswith("torch"), f"{path.name}:{node.lineno} imports {name}"
            if name.startswith("nanoqwen.engine"):
                assert name in APP_MAY_IMPORT, f"{path.name}:{node.lineno} imports {name}"
        if isinstance(node, ast.Attribute):   # no backend internals read from the app
            assert node.attr not in ("kv_tokens", "tokenizer", "model_file"), \
                f"{path.name}:{node.lineno} reads .{node.attr}"
        if isinstance(node, ast.Attribute) and node.attr == "backend":
            src = ast.unparse(node.value)
            assert src.endswith("info") or src == "args", \
                f"{path.name}:{node.lineno} reads {src}.backend"
