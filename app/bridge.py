"""The one interface between the UI and the engine. The UI never sees a tensor.

    bridge = EngineBridge.open(path, backend="auto", mode="graph", progress=cb)
    for ev in bridge.submit(history, user_text, params, max_new_tokens):   # worker thread
        ...  # Batch(text, stats) every ~40 ms, then Finished(reason, stats) or Failed(...)
    bridge.cancel()          # from any thread; the running submit() ends with "cancelled"
    bridge.set_mode("eager") # takes effect at the next token (the backend's `mode`)

`submit` is a plain blocking iterator: the app runs it in a thread worker and forwards each
event with `post_message`. Batching lives here, not in the UI, so the UI gets one message per
~40 ms however fast the engine decodes (a message per token would swamp the event loop at
1 ms/token on the GPU).

The conversation's truth is the app's (its store); every submit hands the session the whole
history, and the session reuses the longest cached KV prefix, so reopening an old chat,
regenerating or changing the system prompt needs no special path here.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

BATCH_SECONDS = 0.04


# --- events the UI receives ------------------------------------------------------------
@dataclass(frozen=True)
class StatsUpdate:
    """The engine's figures for the reply so far: its own per-step timing (StepEvent.step_ms
    via the session's TokenIds; GPU events on CUDA), never a UI clock."""
    ttft_ms: float | None           # time to first token of this reply (prefill + sample)
    ms_per_token: float | None      # latest decode step
    median_ms: float | None         # median decode step of the reply so far
    tokens_per_s: float | None      # decode steps / their total time, reply so far
    step_ms: tuple[float, ...]      # decode steps since the previous update (sparkline)
    n_generated: int
    kv_len: int
    max_context: int
    mode: str                       # the backend's mode when the update was made
    final: bool = False             # from the session's end-of-turn Stats


@dataclass(frozen=True)
class Batch:
    text: str
    stats: StatsUpdate | None


@dataclass(frozen=True)
class Note:
    message: str                    # e.g. old turns left out to fit the context


@dataclass(frozen=True)
class Finished:
    reason: str                     # "stop" | "length" | "cancelled" | "context"
    stats: StatsUpdate | None


@dataclass(frozen=True)
class Failed:
    message: str
    kind: str                       # "oom" | "context" | "engine"


BridgeEvent = Batch | Note | Finished | Failed


@dataclass
class LoadedModel:
    path: Path
    name: str
    backend: str
    device: str
    modes: tuple[str, ...]
    max_context: int
    fallback: str | None = None     # why "auto" ended on the reference backend
    warnings: list[str] = field(default_factory=list)


def describe_error(e: BaseException) -> tuple[str, str]:
    """(kind, message) for an exception out of the engine, in words a user can act on."""
    from nanoqwen.engine.errors import ContextFullError, NanoqwenError
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "oom", ("The GPU ran out of memory. Start a new chat (shorter context) or "
                       f"use a smaller model.\n{str(e).splitlines()[0] if str(e) else ''}")
    if isinstance(e, ContextFullError):
        return "context", f"The conversation no longer fits the context: {e}. Start a new chat."
    if isinstance(e, NanoqwenError):
        return "engine", str(e)
    return "engine", f"The engine failed ({type(e).__name__}: {e})"


class EngineBridge:
    def __init__(self, backend, tokenizer, model_file, model: LoadedModel) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_file = model_file
        self.model = model
        self._session = None
        self._lock = threading.Lock()  # one submit at a time

    # --- loading ----------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, backend: str = "auto", mode: str = "graph",
             progress: Callable[[int, int, str], None] | None = None) -> EngineBridge:
        """Load a model; "auto" falls back to the reference backend and says why.
        Raises NanoqwenError (bad file, explicit backend unavailable) with a message."""
        from nanoqwen.engine import loader

        eng = loader.load(Path(path), backend=backend, mode=mode, progress=progress)
        be = eng.backend
        warnings = []
        if mode not in be.modes:
            warnings.append(f"decode mode {mode!r} is not available on the {be.name} backend; "
                            f"it runs {be.mode!r}")
        model = LoadedModel(path=Path(path), name=be.config.name, backend=be.name,
                            device=be.device_name, modes=tuple(be.modes),
                            max_context=be.max_context, fallback=eng.fallback_reason,
                            warnings=warnings)
        return cls(be, eng.tokenizer, eng.model_file, model)

    def close(self) -> None:
        self.model_file.close()

    # --- decode mode --------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.backend.mode

    def set_mode(self, mode: str) -> None:
        """Switch graph/eager; the backend reads it before each token, so no reload.
        Raises ValueError (with the supported modes) if the backend lacks it."""
        self.backend.mode = mode

    # --- generation ----------------------------------------------------------------------
    def count_tokens(self, history: list[dict], system_prompt: str = "") -> int:
        """Tokens the conversation occupies in the context (for the context gauge)."""
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + history
        if not msgs:
            return 0
        return len(self.tokenizer.encode_chat(msgs))

    def cancel(self) -> None:
        s = self._session
        if s is not None:
            s.cancel()

    def submit(self, history: list[dict], user_text: str, params, max_new_tokens: int,
               system_prompt: str = "") -> Iterator[BridgeEvent]:
        """Generate a reply to `user_text` after `history`; blocking, batched events.

        Never raises for engine failures: they end the stream as Failed(...)."""
        from nanoqwen.engine.session import ChatSession

        with self._lock:
            try:
                session = ChatSession(self.backend, self.tokenizer,
                                      system_prompt=system_prompt or None,
                                      messages=history)  # the session copies it
                self._session = session
                yield from self._batched(session.generate(user_text, params, max_new_tokens))
            except Exception as e:  # noqa: BLE001 - any engine failure must reach the user
                kind, msg = describe_error(e)
                yield Failed(msg, kind)
            finally:
                self._session = None

    def _batched(self, events, clock: Callable[[], float] = time.perf_counter
                 ) -> Iterator[BridgeEvent]:
        """Session events -> Batch/Note/Finished/Failed. A Batch is yielded only once
        BATCH_SECONDS have passed on `clock` since the previous one (the end of the turn and an
        error flush what is pending at once), so the UI gets at most one Batch per window."""
        from nanoqwen.engine.session import Done, Error, Notice, Stats, TextDelta, TokenIds

        text: list[str] = []
        acc = _StatsAccumulator(self.backend)

        def pending() -> Batch | None:
            """The text and figures not sent yet, as one Batch (None: nothing new)."""
            if not (text or acc.dirty):
                return None
            batch = Batch("".join(text), acc.take())
            text.clear()
            return batch

        last_flush = clock()
        failed = False
        for ev in events:
            if isinstance(ev, TextDelta):
                text.append(ev.text)
            elif isinstance(ev, TokenIds):
                acc.add_steps(ev.step_ms)
            elif isinstance(ev, Stats):
                acc.set_final(ev)
            elif isinstance(ev, Notice):
                yield Note(ev.message)
            elif isinstance(ev, Error):
                if batch := pending():
                    yield batch
                kind, msg = (describe_error(ev.exception) if ev.exception is not None
                             else ("engine", ev.message))
                yield Failed(msg, kind)
                failed = True
            elif isinstance(ev, Done):
                if failed:
                    return
                if batch := pending():
                    yield batch
                yield Finished(ev.reason, acc.take())
                return
            if not isinstance(ev, TextDelta):
                continue  # a token's figures travel with its text (TokenIds comes first)
            now = clock()
            if now - last_flush >= BATCH_SECONDS and (batch := pending()):
                yield batch
                last_flush = now
        if not failed:  # a stream that ended without Done: report what there is
            if batch := pending():
                yield batch
            yield Finished("stop", acc.take())


class _StatsAccumulator:
    """Folds per-token timings (TokenIds.step_ms: the first of a turn is the TTFT, the rest
    decode steps) and the session's end-of-turn Stats into StatsUpdate batches."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.ttft: float | None = None
        self.steps: list[float] = []     # every decode step of the reply
        self.new: list[float] = []       # decode steps since the last update
        self.n = 0
        self.final = None                # the session's Stats, once it came
        self.dirty = False

    def add_steps(self, step_ms) -> None:
        for ms in step_ms:
            if self.n == 0:
                self.ttft = float(ms)
            else:
                self.steps.append(float(ms))
                self.new.append(float(ms))
            self.n += 1
        self.dirty = True

    def set_final(self, s) -> None:
        self.final = s
        self.dirty = True

    def take(self) -> StatsUpdate | None:
        if not self.dirty and self.final is None and self.n == 0:
            return None
        f = self.final
        be = self.backend
        if f is not None:  # the engine's own summary of the turn is the last word
            u = StatsUpdate(f.ttft_ms, self.steps[-1] if self.steps else None, f.ms_per_token,
                            f.tokens_per_s, tuple(self.new), f.n_generated, f.kv_len,
                            f.max_context, f.mode, final=True)
        else:
            total = sum(self.steps)
            u = StatsUpdate(self.ttft, self.steps[-1] if self.steps else None,
                            statistics.median(self.steps) if self.steps else None,
                            len(self.steps) / total * 1e3 if total > 0 else None,
                            tuple(self.new), self.n, len(be.kv_tokens), be.max_context, be.mode)
        self.new = []
        self.dirty = False
        return u
