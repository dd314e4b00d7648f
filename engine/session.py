"""A chat session: multi-turn history over one backend, streamed as events.

Each turn renders the whole conversation with the model's chat template, encodes it (the
`Transcript` below), keeps the longest common prefix of those ids with `backend.kv_tokens`
(truncating the rest) and prefills only the new tokens. The prompt ids are a pure function of
the messages and the transcript, never of the cache: a session that reused its cache
produces the same tokens (greedy) as a fresh backend given the same messages and transcript;
cancellation and errors only ever shorten the cache, never desynchronise it.

The transcript keeps a reply as the ids the model sampled. Re-encoding a reply's text need not
give them back (a model may emit a split the BPE merges would not make: random weights do it
at the first tokens, trained models now and then), and every id after the first difference
would be prefilled again at the next turn: ~1000 tokens, tens of ms at 7B, on every turn.
With the transcript a next turn prefills only what is new (its user message and the template
around it), and its ids still decode to exactly the rendered conversation. A conversation the
transcript does not continue (another chat, old turns left out, an edited message) is encoded
from its text, as a fresh session would.

Events (all frozen dataclasses), in order for one turn:
    Notice?  (only when old turns had to be left out to fit the context)
    per chunk of tokens (backend.generate_chunks: the first token alone, then one chunk per
    `window_s`; the default 0 makes every token a chunk): TokenIds with the chunk's ids,
    then one TextDelta with the chunk's text if it completed any
    TextDelta? (the detokenizer's held tail), Stats, Done(reason)
A failure inside the backend is reported as Error(message) followed by Done("error").

Context policy: when the conversation does not fit (prompt + a reserve of
min(max_new_tokens, min_reply_tokens) reply tokens > max_context), the oldest turns (a user
message with the replies that follow it) are left out of the prompt, the system prompt
always kept; a Notice says how many. A turn that continues the previous one keeps its cut
while the prompt fits, so it still continues the cache; a new cut leaves out turns until a
quarter of the context is free for the turns to come (or, when no cut does, until it fits).
Cutting afresh at every turn would change the prompt from its start each time, and a chat at
the context's end would prefill its whole window on every turn (~2000 tokens with the
bundled model on the CPU). `messages` keeps the whole conversation. If the system prompt +
the new message alone do not fit, ContextFullError is raised (with the numbers) before
anything is changed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .errors import ContextFullError, NanoqwenError
from .rates import median_ms, tokens_per_s
from .tokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class TokenIds:
    ids: tuple[int, ...]
    step_ms: tuple[float, ...]       # per id; the first id of a turn carries the TTFT


@dataclass(frozen=True)
class Stats:
    ttft_ms: float                   # prefill of the new tokens + first sample
    ms_per_token: float | None       # median decode step (None: no decode step happened)
    tokens_per_s: float | None       # decode steps / their total time
    n_prompt: int                    # tokens of the rendered prompt
    n_generated: int                 # sampled tokens, a stop token included
    kv_len: int                      # tokens in the cache after the turn
    max_context: int
    mode: str
    n_prefilled: int = 0             # prompt tokens actually forwarded this turn
    n_reused: int = 0                # prompt tokens whose K/V came from the cache
    prefill_tokens_per_s: float | None = None
    backend: str = ""
    spec: str | None = None          # speculative decoding of the turn (engine/spec.py)
    n_drafted: int = 0               # ids the drafter proposed
    n_accepted: int = 0              # of those, kept (each also saved a decode step)
    n_verify_steps: int = 0          # multi-token forwards that verified a draft


@dataclass(frozen=True)
class Notice:
    message: str
    dropped_messages: int = 0


@dataclass(frozen=True)
class Done:
    reason: str                      # "stop" | "length" | "cancelled" | "context" | "error"


@dataclass(frozen=True)
class Error:
    message: str
    exception: BaseException | None = field(default=None, compare=False, repr=False)


Event = TextDelta | TokenIds | Stats | Notice | Done | Error


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class _Reply:
    """What a turn has produced so far; read by the session even if the stream is abandoned."""

    def __init__(self, tokenizer) -> None:
        self.ids: list[int] = []
        self.parts: list[str] = []
        self.detok = IncrementalDetokenizer(tokenizer)

    def text(self) -> str:
        return "".join(self.parts) + self.detok.flush()


# How long the backend gathers tokens into one chunk (one TokenIds + one TextDelta) after
# the first. 0: every token is its own chunk, the events a plain loop over a session wants;
# the engine service (the app, `nanoqwen generate`) asks for its batching window instead.
CHUNK_SECONDS = 0.0


def run_turn(backend, tokenizer, prompt_ids: Sequence[int], params, max_new_tokens: int,
             cancel: threading.Event, reply: _Reply | None = None,
             window_s: float = CHUNK_SECONDS) -> Iterator[Event]:
    """Generate after `prompt_ids`, reusing the cached prefix; yield events (module doc).

    The caller has checked that the prompt fits. Usable without a ChatSession (raw prompts).
    """
    reply = reply if reply is not None else _Reply(tokenizer)
    prompt_ids = list(prompt_ids)
    # Keep at least one prompt token to forward: its logits give the first reply token.
    n_reuse = min(common_prefix_len(backend.kv_tokens, prompt_ids), len(prompt_ids) - 1)
    stop_ids = tokenizer.stop_ids
    step_ms: list[float] = []
    last = None
    try:
        backend.truncate(n_reuse)
        steps = backend.generate_chunks(prompt_ids[n_reuse:], params, max_new_tokens,
                                        stop_ids, cancel, window_s)
        try:
            for chunk in steps:
                n0, texts = len(step_ms), []
                for ev in chunk:
                    reply.ids.append(ev.token_id)
                    step_ms.append(ev.step_ms)
                    # Recorded before yielding, so a stream abandoned at either yield still
                    # leaves every token it showed in the reply text.
                    text = "" if ev.token_id in stop_ids else reply.detok.push(ev.token_id)
                    if text:
                        reply.parts.append(text)
                        texts.append(text)
                last = chunk[-1].token_id
                yield TokenIds(tuple(reply.ids[n0:]), tuple(step_ms[n0:]))
                if texts:
                    yield TextDelta("".join(texts))
        finally:
            steps.close()  # the backend's loop ends now, not whenever it is collected
    except Exception as e:  # noqa: BLE001 - reported to the consumer, cache stays consistent
        msg = str(e) if isinstance(e, NanoqwenError) else f"{type(e).__name__}: {e}"
        yield Error(msg, e)
        yield Done("error")
        return
    tail = reply.detok.flush()
    if tail:
        reply.parts.append(tail)
        yield TextDelta(tail)
    if last is not None and last in stop_ids:
        reason = "stop"
    elif len(reply.ids) >= max_new_tokens:
        reason = "length"
    elif cancel.is_set():
        reason = "cancelled"
    else:
        reason = "context"
    decode = step_ms[1:]
    spec = backend.spec
    sst = backend.spec_stats if spec else {}
    n_prefilled = len(prompt_ids) - n_reuse
    yield Stats(
        ttft_ms=step_ms[0] if step_ms else 0.0,
        ms_per_token=median_ms(decode),
        tokens_per_s=tokens_per_s(len(decode), sum(decode)),
        n_prompt=len(prompt_ids), n_generated=len(reply.ids), kv_len=len(backend.kv_tokens),
        max_context=backend.max_context, mode=backend.mode, n_prefilled=n_prefilled,
        n_reused=n_reuse,
        prefill_tokens_per_s=tokens_per_s(n_prefilled, step_ms[0]) if step_ms else None,
        backend=backend.name, spec=spec, n_drafted=sst.get("drafted", 0),
        n_accepted=sst.get("accepted", 0), n_verify_steps=sst.get("verify_steps", 0))
    yield Done(reason)


def generate_raw(backend, tokenizer, text: str, params, max_new_tokens: int,
                 cancel: threading.Event | None = None,
                 window_s: float = CHUNK_SECONDS) -> Iterator[Event]:
    """Continue `text` as-is (no chat template), reusing the cache like a session turn."""
    ids = tokenizer.encode(text)
    if not ids:
        raise NanoqwenError("the prompt is empty")
    if len(ids) + 1 > backend.max_context:
        raise ContextFullError(f"the prompt is {len(ids)} tokens; the context holds "
                               f"{backend.max_context} and at least 1 is needed for the reply")
    return run_turn(backend, tokenizer, ids, params, max_new_tokens,
                    cancel if cancel is not None else threading.Event(), window_s=window_s)


class Transcript:
    """The latest conversation's text and the ids the model saw it as (its prompts as
    encoded, its replies as sampled), with marks where a prefix of the text is exactly the
    decode of a prefix of the ids: the end of each turn's prompt and of each reply.

    `encode(text)` continues the longest marked prefix that `text` starts with: the mark's ids
    + the encoding of the rest (the rest starts at a template boundary, so it encodes as it
    would inside the whole text); with no mark, the plain encoding. Owned by whoever keeps
    the backend across sessions (the engine service): one per backend, like its cache."""

    def __init__(self) -> None:
        self.text = ""
        self.ids: list[int] = []
        self.marks: list[tuple[int, int]] = []   # (chars, ids), increasing
        self.dropped = 0    # messages the latest turn's prompt left out (the context policy)

    def copy(self) -> Transcript:
        t = Transcript()
        t.text, t.ids, t.marks, t.dropped = self.text, list(self.ids), list(self.marks), \
            self.dropped
        return t

    def continues(self, text: str) -> bool:
        """Does `text` start with a marked prefix (a previous prompt or reply)?"""
        return self._mark_for(text)[0] > 0

    def _mark_for(self, text: str) -> tuple[int, int]:
        for chars, n in reversed(self.marks):
            if text.startswith(self.text[:chars]):
                return chars, n
        return 0, 0

    def encode(self, tokenizer, text: str) -> list[int]:
        chars, n = self._mark_for(text)
        return self.ids[:n] + tokenizer.encode(text[chars:])

    def begin_turn(self, text: str, ids: list[int], dropped: int = 0) -> None:
        """`ids` (from `encode(text)`) are the prompt of the turn starting now, which left
        out the conversation's first `dropped` messages."""
        self.dropped = dropped
        chars, _ = self._mark_for(text)
        self.marks = [m for m in self.marks if m[0] <= chars]
        self.text, self.ids = text, list(ids)
        if not self.marks or self.marks[-1] != (len(text), len(ids)):
            self.marks.append((len(text), len(ids)))

    def add_reply(self, tokenizer, reply_ids: Sequence[int]) -> None:
        """The turn's sampled ids, stop tokens left out (the template writes its own end)."""
        ids = [i for i in reply_ids if i not in tokenizer.stop_ids]
        text = tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
        if not text:
            # ids that decode to nothing would give the prompt's text a second mark with
            # more ids: a regenerated turn (the same prompt text) must find the prompt's
            return
        self.text += text
        self.ids += ids
        self.marks.append((len(self.text), len(self.ids)))


MIN_REPLY_TOKENS = 16   # the least room a prompt leaves for the reply (the context policy)


def reply_reserve(max_new_tokens: int, min_reply_tokens: int = MIN_REPLY_TOKENS) -> int:
    """Context positions a prompt leaves free for the reply (the module doc's policy)."""
    return max(1, min(max_new_tokens, min_reply_tokens))


class ChatSession:
    """Multi-turn chat over `backend`. Not thread-safe, except `cancel()`."""

    def __init__(self, backend, tokenizer, system_prompt: str | None = None,
                 messages: Sequence[dict] | None = None,
                 min_reply_tokens: int = MIN_REPLY_TOKENS,
                 transcript: Transcript | None = None) -> None:
        self.backend, self.tokenizer = backend, tokenizer
        # shared by the sessions of one backend (the engine service's), else this session's
        self.transcript = transcript if transcript is not None else Transcript()
        self.system_prompt = system_prompt
        self.min_reply_tokens = min_reply_tokens
        self.history: list[dict] = []    # user/assistant messages, oldest first
        if messages:
            messages = [dict(m) for m in messages]
            if messages[0]["role"] == "system":
                if system_prompt is not None and system_prompt != messages[0]["content"]:
                    raise ValueError("system_prompt and messages[0] (a system message) differ")
                self.system_prompt = messages.pop(0)["content"]
            self.history = messages
        self._cancel = threading.Event()

    @property
    def messages(self) -> list[dict]:
        """The whole conversation, the system message first when there is one."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [dict(m) for m in self.history]

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays; the cache is reused as it fits)."""
        self.history = []

    def cancel(self) -> None:
        """Stop the running turn at the next token (callable from any thread). Called while
        no turn runs, it stops the next one before it starts: a cancel that races the start
        of a turn is never lost."""
        self._cancel.set()

    def generate(self, user_text: str, params, max_new_tokens: int = 512,
                 cancel: threading.Event | None = None,
                 window_s: float = CHUNK_SECONDS) -> Iterator[Event]:
        """Add a user message and stream the reply. Raises ContextFullError now if it cannot fit.
        `window_s`: how long the backend gathers tokens into one TokenIds/TextDelta pair."""
        return self._turn(list(self.history), user_text, params, max_new_tokens, cancel,
                          window_s)

    def regenerate(self, params, max_new_tokens: int = 512,
                   cancel: threading.Event | None = None,
                   window_s: float = CHUNK_SECONDS) -> Iterator[Event]:
        """Replace the reply to the last user message with a new one."""
        users = [i for i, m in enumerate(self.history) if m["role"] == "user"]
        if not users:
            raise NanoqwenError("there is no user message to regenerate a reply for")
        i = users[-1]
        return self._turn(self.history[:i], self.history[i]["content"], params,
                          max_new_tokens, cancel, window_s)

    # --- internals --------------------------------------------------------------------------
    def _turn(self, base: list[dict], user_text: str, params, max_new_tokens: int,
              cancel: threading.Event | None, window_s: float) -> Iterator[Event]:
        user = {"role": "user", "content": user_text}
        prompt_text, prompt_ids, dropped = self._fit(base, user, max_new_tokens)
        params.validate()
        if cancel is not None:
            if self._cancel.is_set():  # a cancel() that came before this turn started
                cancel.set()
            self._cancel = cancel
        return self._stream(base, user, prompt_text, prompt_ids, dropped, params,
                            max_new_tokens, self._cancel, window_s)

    def _stream(self, base, user, prompt_text, prompt_ids, dropped, params, max_new_tokens,
                cancel, window_s):
        # History (and the transcript) change only once the stream starts, so an iterator
        # that is never started leaves the session untouched.
        self.history = base + [user]
        self.transcript.begin_turn(prompt_text, prompt_ids, dropped)
        if dropped:
            yield Notice(f"the conversation is longer than the context ({self.backend.max_context} "
                         f"tokens): the oldest {dropped} messages are left out of the prompt",
                         dropped)
        reply = _Reply(self.tokenizer)
        try:
            yield from run_turn(self.backend, self.tokenizer, prompt_ids, params,
                                max_new_tokens, cancel, reply, window_s)
        finally:
            # Also on cancel, error or an abandoned stream: the partial reply is kept.
            self.history.append({"role": "assistant", "content": reply.text()})
            self.transcript.add_reply(self.tokenizer, reply.ids)
            self._cancel = threading.Event()  # this turn's cancel does not outlive it

    def _encode(self, messages: list[dict]) -> tuple[str, list[int]]:
        text = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        return text, self.transcript.encode(self.tokenizer, text)

    def _fit(self, base: list[dict], user: dict, max_new_tokens: int
             ) -> tuple[str, list[int], int]:
        """Prompt text and ids of system + base[k:] + user for the smallest k (at a turn
        boundary) that leaves room for the reply reserve; (text, ids, k)."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        limit = self.backend.max_context - reply_reserve(max_new_tokens, self.min_reply_tokens)
        # turn boundaries: each user message starts a turn; never split a user from its reply
        starts = [i for i, m in enumerate(base) if m["role"] == "user" and i > 0] + [len(base)]
        text, ids = self._encode(system + base + [user])
        if len(ids) <= limit:
            return text, ids, 0
        # the previous turn's cut, while this turn continues it and fits (the module doc)
        k = self.transcript.dropped
        if k in starts:
            text, ids = self._encode(system + base[k:] + [user])
            if len(ids) <= limit and self.transcript.continues(text):
                return text, ids, k
        # a new cut: a quarter of the context free after it, else the least that fits
        room = limit - self.backend.max_context // 4
        fits = None
        for k in starts:
            text, ids = self._encode(system + base[k:] + [user])
            if len(ids) <= room:
                return text, ids, k
            if fits is None and len(ids) <= limit:
                fits = text, ids, k
        if fits is not None:
            return fits
        reserve = self.backend.max_context - limit
        raise ContextFullError(
            f"the message does not fit the context: the prompt (system prompt + this message) "
            f"is {len(ids)} tokens, {reserve} more are reserved for the reply, and the context "
            f"holds {self.backend.max_context} tokens")
