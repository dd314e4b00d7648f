"""The engine service: the one interface the app and `nanoqwen generate` drive the engine by.

    engine = EngineService.open(path, backend="auto", mode="graph", progress=cb)
    for ev in engine.submit(history, user_text, params, max_new_tokens, system_prompt):
        ...  # Batch(text, stats) at most once per BATCH_SECONDS, then Finished or Failed
    engine.cancel()          # from any thread; the running submit() ends with "cancelled"
    engine.set_mode("eager") # takes effect at the next token (the backend's `mode`)

`submit` returns a plain blocking iterator: the app runs it in a thread worker and forwards
each event with `post_message`; the CLI writes each Batch to stdout. The backend hands the
session its tokens one chunk per batching window (`Backend.generate_chunks`), so the worker
wakes about once per window, and the batching here makes sure a consumer never gets more than
one Batch per window whatever the backend does. The first text of a reply is sent at once:
time to first token never waits for a window.

The conversation's truth is the caller's (the app's store); every submit hands the session
the whole history, and the session reuses the longest cached KV prefix, so reopening an old
chat, regenerating or changing the system prompt needs no special path here.

Importing this module (and `nanoqwen.engine`) loads no torch: the loader, the backends and the
session are imported when a model is opened, so the app starts without paying for torch and
`describe_error` looks torch up only if something else imported it already.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ContextFullError, NanoqwenError
from .rates import median_ms, tokens_per_s  # also the app's (it imports the service only)

# The backends `open` / loader.load take ("auto": CUDA where it runs, else the reference) and
# the decode modes a backend may have (CudaBackend has both, the reference backend only eager):
# the one list of each, here where the torch-free app and the CLI's parser can read them.
BACKENDS = ("auto", "cuda", "reference")
MODES = ("graph", "eager")
# the CUDA prefill's weights (CudaBackend's prefill_weights)
PREFILL_WEIGHTS = ("auto", "resident", "dequant", "int4")
BATCH_SECONDS = 0.04     # at most one Batch per window (the UI's message rate)
ROLLING_SECONDS = 1.0    # the rolling decode figures cover the last second of decode steps


def default_model_path() -> Path:
    """The model bundled in assets/ (it may not exist; callers report that)."""
    from nanoqwen import REPO_ROOT

    return REPO_ROOT / "assets" / "tiny" / "tiny.nanoqwen"


# --- events a consumer receives ------------------------------------------------------------
@dataclass(frozen=True)
class StatsUpdate:
    """The engine's figures for the reply so far: its own per-step timing (StepEvent.step_ms
    via the session's TokenIds; GPU events on CUDA), never a consumer's clock."""
    ttft_ms: float | None           # time to first token of this reply (prefill + sample)
    ms_per_token: float | None      # latest decode step
    median_ms: float | None         # median decode step of the reply (final update only)
    tokens_per_s: float | None      # decode steps / their total time, reply so far
    step_ms: tuple[float, ...]      # decode steps since the previous update (sparkline)
    n_generated: int                # tokens of the reply so far (their text is in the Batch)
    kv_len: int
    max_context: int
    mode: str                       # the backend's mode when the update was made
    final: bool = False             # from the session's end-of-turn Stats
    rolling_tokens_per_s: float | None = None  # decode over the last ROLLING_SECONDS of steps
    rolling_median_ms: float | None = None     # median decode step, same window
    n_prompt: int | None = None                # final only: tokens of the rendered prompt
    n_prefilled: int | None = None             # final only: of those, forwarded this turn
    prefill_tokens_per_s: float | None = None  # final only: n_prefilled / TTFT
    spec: str | None = None                    # speculative decoding (spec.py) of the turn
    n_drafted: int = 0                         # ids drafted, the turn so far
    n_accepted: int = 0                        # of those, kept
    n_verify_steps: int = 0                    # multi-token forwards that verified drafts

    @property
    def tokens_per_verify_step(self) -> float | None:
        """Tokens a step that verified drafts gave: its kept drafts and one of its own."""
        return ((self.n_accepted + self.n_verify_steps) / self.n_verify_steps
                if self.n_verify_steps else None)


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
    message: str                    # for people (describe_error)
    kind: str                       # "oom" | "context" | "engine"
    exception: BaseException | None = field(default=None, compare=False, repr=False)


ServiceEvent = Batch | Note | Finished | Failed


@dataclass
class LoadedModel:
    path: Path
    name: str
    backend: str
    device: str
    modes: tuple[str, ...]
    max_context: int
    fallback: str | None = None     # why "auto" ended on the reference backend
    spec_modes: tuple[str, ...] = ()  # speculative decoding the backend verifies (spec.py)
    spec_auto: str | None = None      # what the app's "auto" speculation runs (Backend.spec_auto)
    warnings: list[str] = field(default_factory=list)
    generation: dict = field(default_factory=dict)  # the file's generation config


def describe_error(e: BaseException) -> tuple[str, str]:
    """(kind, message) for an exception out of the engine, in words a user can act on."""
    torch = sys.modules.get("torch")  # an OOM can only come from a torch that is loaded
    if torch is not None and isinstance(e, torch.cuda.OutOfMemoryError):
        return "oom", ("The GPU ran out of memory. Start a new chat (shorter context) or "
                       f"use a smaller model.\n{str(e).splitlines()[0] if str(e) else ''}")
    if isinstance(e, ContextFullError):
        # e says what does not fit and by how much; older turns were left out already, so a
        # new chat would not help, a shorter message would
        msg = str(e)
        return "context", f"{msg[:1].upper()}{msg[1:]}. Shorten the message."
    if isinstance(e, NanoqwenError):
        return "engine", str(e)
    return "engine", f"The engine failed ({type(e).__name__}: {e})"


class EngineService:
    """A loaded model and its backend; one reply at a time (`submit`), `cancel` from any
    thread. `backend`, `tokenizer`, `model_file` and `transcript` are engine-side objects:
    the app uses only the methods and `info`."""

    def __init__(self, backend, tokenizer, model_file, info: LoadedModel) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_file = model_file
        self.info = info
        self._lock = threading.Lock()          # one submit at a time
        self._cancel = threading.Event()       # the latest submit's
        self.transcript = None                 # session.Transcript of the cached conversation
        self._draft = None                     # loader.LoadedEngine of spec "draft"
        self._draft_path: Path | None = None   # its file, resolved

    # --- loading ------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, backend: str = "auto", mode: str = "graph",
             progress: Callable[[int, int, str], None] | None = None,
             threads: int | None = None) -> EngineService:
        """Load a model; "auto" falls back to the reference backend and says why.
        `threads`: the CPU backend's threads (None: one per core; loader.load).
        Raises NanoqwenError (bad file, explicit backend unavailable) with a message."""
        from . import loader

        eng = loader.load(Path(path), backend=backend, mode=mode, progress=progress,
                          threads=threads)
        be = eng.backend
        warnings = []
        if mode not in be.modes:
            warnings.append(f"decode mode {mode!r} is not available on the {be.name} backend; "
                            f"it runs {be.mode!r}")
        info = LoadedModel(path=Path(path), name=be.config.name, backend=be.name,
                           device=be.device_name, modes=tuple(be.modes),
                           max_context=be.max_context, fallback=eng.fallback_reason,
                           warnings=warnings, generation=dict(eng.model_file.generation or {}),
                           spec_modes=tuple(be.spec_modes), spec_auto=be.spec_auto)
        return cls(be, eng.tokenizer, eng.model_file, info)

    def close(self) -> None:
        self.cancel()
        self.model_file.close()
        self._close_draft()

    def _close_draft(self) -> None:
        if self._draft is not None:
            self.backend.draft_backend = None
            self._draft.close()
            self._draft = self._draft_path = None

    # --- decode mode ----------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.backend.mode

    def set_mode(self, mode: str) -> None:
        """Switch graph/eager; the backend reads it before each token, so no reload.
        Raises ValueError (with the supported modes) if the backend lacks it."""
        self.backend.mode = mode

    # --- speculative decoding -----------------------------------------------------------------
    @property
    def spec(self) -> str | None:
        return self.backend.spec

    def set_spec(self, spec: str | None, draft: str | Path | None = None) -> None:
        """Speculative decoding for the next turns: None (off) or one of the backend's
        spec_modes ("ngram": prompt lookup; "draft": the model file `draft`, loaded on the
        same backend, drafts; engine/spec.py). Raises ValueError naming what the backend has
        (both backends verify both), NanoqwenError for a draft file that cannot be loaded or
        whose tokenizer is not the model's; either way nothing changes.
        A draft file is loaded once: the same file again keeps the loaded one, and turning
        speculation off keeps it for later (it goes with another draft file or close()).
        Loading one takes as long as loading a model, so callers with a UI call this from a
        worker thread; a turn running meanwhile keeps its own drafter (the old draft model
        is closed only after it ends)."""
        if spec == "draft" and draft is not None:
            self._open_draft(Path(draft))
        self.backend.spec = spec

    @property
    def draft_path(self) -> Path | None:
        """The loaded draft model's file (spec "draft"), None without one."""
        return self._draft_path

    def _open_draft(self, path: Path) -> None:
        from . import loader

        if "draft" not in self.backend.spec_modes:
            self.backend.spec = "draft"   # raises: what this backend has
        if self._draft is not None and self._draft_path == path.resolve():
            return
        d = loader.load_draft(path, self.backend, self.tokenizer, str(self.info.path))
        with self._lock:   # not while a turn drafts with the old one
            old, self._draft, self._draft_path = self._draft, d, path.resolve()
            self.backend.draft_backend = d.backend
        if old is not None:
            old.close()

    # --- generation -------------------------------------------------------------------------
    def count_tokens(self, history: list[dict], system_prompt: str = "") -> int:
        """Tokens the conversation occupies in the context (for the context gauge)."""
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + history
        if not msgs:
            return 0
        return len(self.tokenizer.encode_chat(msgs))

    def message_room(self, user_text: str, system_prompt: str, max_new_tokens: int
                     ) -> tuple[int, int]:
        """(n, room) for a new message: n, the tokens of the smallest prompt that can carry
        it (system prompt + the message: older turns are left out to make room, session.py's
        context policy); room, the most the context leaves for a prompt (max_context less the
        reply reserve). The message can be sent when n <= room."""
        from .session import reply_reserve

        n = self.count_tokens([{"role": "user", "content": user_text}], system_prompt)
        return n, self.backend.max_context - reply_reserve(max_new_tokens)

    def cancel(self) -> None:
        """Stop the latest submit at its next token; a submit not started yet ends at once.
        A backend with its own decode loop (CUDA) is also told directly, so the GPU stops within
        a step instead of at the consumer's next wake-up (~40 ms later)."""
        self._cancel.set()
        request = getattr(self.backend, "request_cancel", None)
        if request is not None and self._lock.locked():  # only a turn that is running
            request()

    def submit(self, history: list[dict], user_text: str, params, max_new_tokens: int,
               system_prompt: str = "") -> Iterator[ServiceEvent]:
        """Generate a reply to `user_text` after `history`; blocking, batched events.

        Never raises for engine failures: they end the stream as Failed(...). The cancel
        this submit answers to exists from this call on, so a `cancel()` made before the
        first `next()` (the worker has not started yet) is not lost."""
        cancel = self._cancel = threading.Event()

        def events():
            from .session import ChatSession, Transcript

            if self.transcript is None:
                self.transcript = Transcript()
            # the session copies `history`; the transcript carries the replies' sampled ids
            # from one submit to the next (session.py), so a next turn prefills only its news
            session = ChatSession(self.backend, self.tokenizer,
                                  system_prompt=system_prompt or None,
                                  messages=history, transcript=self.transcript)
            return session.generate(user_text, params, max_new_tokens, cancel=cancel,
                                    window_s=BATCH_SECONDS)
        return self._run(events)

    def submit_raw(self, text: str, params, max_new_tokens: int) -> Iterator[ServiceEvent]:
        """Continue `text` without the chat template (`nanoqwen generate --raw`)."""
        cancel = self._cancel = threading.Event()

        def events():
            from .session import generate_raw

            return generate_raw(self.backend, self.tokenizer, text, params, max_new_tokens,
                                cancel, window_s=BATCH_SECONDS)
        return self._run(events)

    def _run(self, make_events: Callable[[], Iterator]) -> Iterator[ServiceEvent]:
        with self._lock:
            try:
                yield from self._batched(make_events())
            except Exception as e:  # noqa: BLE001 - any engine failure must reach the user
                kind, msg = describe_error(e)
                yield Failed(msg, kind, e)

    def _batched(self, events, clock: Callable[[], float] = time.perf_counter
                 ) -> Iterator[ServiceEvent]:
        """Session events -> Batch/Note/Finished/Failed. The first text of the turn goes out
        at once; after it a Batch is yielded only once BATCH_SECONDS have passed on `clock`
        since the previous one (the end of the turn and an error flush what is pending at
        once), so a consumer gets at most one Batch per window."""
        from .session import Done, Error, Notice, Stats, TextDelta, TokenIds

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
        shown = False          # has any text gone out yet
        failed = False
        try:
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
                    yield Failed(msg, kind, ev.exception)
                    failed = True
                elif isinstance(ev, Done):
                    if failed:
                        return
                    if text:  # the figures alone travel with Finished
                        yield pending()
                    yield Finished(ev.reason, acc.take())
                    return
                if not isinstance(ev, TextDelta):
                    continue  # a chunk's figures travel with its text (TokenIds comes first)
                now = clock()
                if (not shown or now - last_flush >= BATCH_SECONDS) and (batch := pending()):
                    yield batch
                    last_flush, shown = now, True
            if not failed:  # a stream that ended without Done: report what there is
                if text:
                    yield pending()
                yield Finished("stop", acc.take())
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()  # an abandoned submit ends the session's turn (and the backend's) now


class _StatsAccumulator:
    """Folds per-token timings (TokenIds.step_ms: the first of a turn is the TTFT, the rest
    decode steps) and the session's end-of-turn Stats into StatsUpdates. Work per update is
    bounded by the rolling window, never by the length of the reply."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.ttft: float | None = None
        self.n = 0                       # tokens so far
        self.n_steps = 0                 # decode steps so far
        self.total_ms = 0.0              # their time
        self.latest: float | None = None
        self.window: collections.deque[float] = collections.deque()  # last ROLLING_SECONDS
        self.window_ms = 0.0
        self.new: list[float] = []       # decode steps since the last update
        self.final = None                # the session's Stats, once it came
        self.dirty = False

    def add_steps(self, step_ms) -> None:
        for ms in step_ms:
            ms = float(ms)
            if self.n == 0:
                self.ttft = ms
            else:
                self.n_steps += 1
                self.total_ms += ms
                self.latest = ms
                self.new.append(ms)
                self.window.append(ms)
                self.window_ms += ms
                while len(self.window) > 1 and self.window_ms - self.window[0] >= \
                        ROLLING_SECONDS * 1e3:
                    self.window_ms -= self.window.popleft()
            self.n += 1
        self.dirty = True

    def set_final(self, s) -> None:
        self.final = s
        self.dirty = True

    def take(self) -> StatsUpdate | None:
        if not self.dirty and self.final is None and self.n == 0:
            return None
        w = self.window
        rolling = dict(rolling_tokens_per_s=tokens_per_s(len(w), self.window_ms),
                       rolling_median_ms=median_ms(w))
        f = self.final
        if f is not None:  # the engine's own summary of the turn is the last word
            u = StatsUpdate(f.ttft_ms, self.latest, f.ms_per_token, f.tokens_per_s,
                            tuple(self.new), f.n_generated, f.kv_len, f.max_context, f.mode,
                            final=True, n_prompt=f.n_prompt, n_prefilled=f.n_prefilled,
                            prefill_tokens_per_s=f.prefill_tokens_per_s, spec=f.spec,
                            n_drafted=f.n_drafted, n_accepted=f.n_accepted,
                            n_verify_steps=f.n_verify_steps, **rolling)
        else:
            be = self.backend
            sst = be.spec_stats if be.spec else {}   # the turn's so far
            u = StatsUpdate(self.ttft, self.latest, None,
                            tokens_per_s(self.n_steps, self.total_ms),
                            tuple(self.new), self.n, len(be.kv_tokens), be.max_context,
                            be.mode, spec=be.spec, n_drafted=sst.get("drafted", 0),
                            n_accepted=sst.get("accepted", 0),
                            n_verify_steps=sst.get("verify_steps", 0), **rolling)
        self.new = []
        self.dirty = False
        return u


class SeenMeter:
    """What a person sees of a reply: when its text was written out (to the screen, to
    stdout), against when they asked for it. `start()` at the request (Enter, the CLI call),
    `wrote(n_tokens)` after each write of text, `n_tokens` being the reply's tokens whose text
    has been written by then. Times are seconds on `clock` (injectable for tests)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.start()

    def start(self, t: float | None = None) -> None:
        self.t0 = self.clock() if t is None else t
        self.first: tuple[float, int] | None = None   # (time, tokens) at the first write
        self.last: tuple[float, int] | None = None    # the latest write

    def wrote(self, n_tokens: int, t: float | None = None) -> None:
        t = self.clock() if t is None else t
        if self.first is None:
            self.first = (t, n_tokens)
        self.last = (t, n_tokens)

    @property
    def ttft_ms(self) -> float | None:
        """Request to the first character written."""
        return (self.first[0] - self.t0) * 1e3 if self.first else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens written per wall second after the first write (None until a second one)."""
        if not (self.first and self.last) or self.last[0] <= self.first[0]:
            return None
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])
