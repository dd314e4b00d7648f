"""What a backend is: a model with a single-sequence KV cache that appends tokens and
returns logits, plus a sampling loop on top.

The one invariant every caller relies on: `kv_tokens` is exactly the list of token ids whose
K/V are in the cache, in order, after every call returns or raises and whenever a
`generate()` iterator is suspended, exhausted, closed or abandoned. A token that was sampled
but never forwarded is not in it. Sessions use it to reuse the longest common prefix.

Subclasses implement two primitives and the base class keeps the bookkeeping:
    _forward(tokens, pos) -> fp32 logits [V] of the last token   (K/V written at pos..)
    _truncate(n)          -> free the storage of positions n..
`forward()` checks the tokens, calls `_forward`, and on success appends them to
`kv_tokens`; on an exception it calls `_truncate(len(kv_tokens))` so half-written K/V and
their pages are released. A backend with its own decode loop (CUDA graphs, GPU sampling)
may override `generate()`, keeping the contract written in docs/INTERFACES.md.

`generate_chunks()` is the same stream in lists of tokens, one list per ~window: the first
token alone and at once, then whatever is ready each time the window has passed. A consumer
that wakes per list rather than per token (the app's worker, the CLI) pays its per-wake
costs (GIL hand-off, detokenizing, posting) once per window. The default groups
`generate()`'s events; a backend with its own loop may override it with a native one
(the CUDA backend does: one C++ wait per window on its pinned host ring).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import ContextFullError


@dataclass(frozen=True)
class StepEvent:
    """One sampled token. `step_ms`: for the first event the time to first token (prefill of
    the new tokens + sampling), for later ones the decode step (forward + sample)."""
    token_id: int
    step_ms: float
    first: bool


class Backend:
    name: str = "base"
    device_name: str = "cpu"
    modes: tuple[str, ...] = ("eager",)
    # speculative decoding this backend can verify (engine/spec.py; needs forward_all)
    spec_modes: tuple[str, ...] = ()
    # the speculation the app's "auto" setting turns on here (None: none): only one measured
    # faster on screen than plain decoding on this backend (benchmarks/RESULTS.md)
    spec_auto: str | None = None

    def __init__(self, config: ModelConfig, max_context: int) -> None:
        self.config = config
        self.max_context = config.check_context(max_context)  # NanoqwenError with the numbers
        self.kv_tokens: list[int] = []
        self._mode = self.modes[0]
        self._spec: str | None = None
        self.draft_backend: Backend | None = None   # spec "draft": the draft model's backend
        # the latest turn's speculation figures: drafted / accepted ids, verify steps
        self.spec_stats: dict[str, int] = {}

    # --- mode -------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        # Read once per token by generate(), so a change takes effect at the next token.
        if value not in self.modes:
            raise ValueError(f"mode {value!r} is not supported by the {self.name} backend "
                             f"(supported: {', '.join(self.modes)})")
        self._mode = value

    # --- speculative decoding ------------------------------------------------------------
    @property
    def spec(self) -> str | None:
        return self._spec

    @spec.setter
    def spec(self, value: str | None) -> None:
        # Read when a turn starts (generate_chunks): a change applies from the next turn.
        if value is not None and value not in self.spec_modes:
            have = ", ".join(self.spec_modes) or "none yet"
            raise ValueError(f"speculative decoding {value!r} is not available on the "
                             f"{self.name} backend (available: {have})")
        if value == "draft" and self.draft_backend is None:
            raise ValueError("speculative decoding 'draft' needs a draft model (a .nanoqwen of "
                             "the same tokenizer; nanoqwen generate --draft FILE)")
        self._spec = value

    # --- primitives for subclasses ------------------------------------------------------
    def _forward(self, tokens: list[int], pos: int) -> torch.Tensor:
        raise NotImplementedError

    def _truncate(self, n: int) -> None:
        raise NotImplementedError

    # --- cache ----------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        """Keep the first n cached tokens (0 <= n <= len(kv_tokens))."""
        if not 0 <= n <= len(self.kv_tokens):
            raise ValueError(f"truncate({n}): the cache holds {len(self.kv_tokens)} tokens")
        self._truncate(n)
        del self.kv_tokens[n:]

    def check_fits(self, n_new: int) -> None:
        """ContextFullError (with the numbers) unless n_new more tokens fit in the cache."""
        have = len(self.kv_tokens)
        if have + n_new > self.max_context:
            raise ContextFullError(
                f"{n_new} new tokens after {have} cached ones need {have + n_new} positions; "
                f"the context holds {self.max_context}")

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append `tokens` at positions len(kv_tokens)..; fp32 logits [V] of the last one (CPU)."""
        tokens = self._checked(tokens)
        return self._append(tokens, self._forward)

    def _checked(self, tokens: Sequence[int]) -> list[int]:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("forward() needs at least one token")
        bad = [t for t in tokens if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary "
                             f"0..{self.config.vocab_size - 1}")
        self.check_fits(len(tokens))
        return tokens

    def _append(self, tokens: list[int], fn) -> torch.Tensor:
        n0 = len(self.kv_tokens)
        try:
            out = fn(tokens, n0)
        except BaseException:
            self._truncate(n0)  # release K/V and pages written past the old length
            raise
        self.kv_tokens.extend(tokens)
        return out

    # --- sampling loop ----------------------------------------------------------------------
    def generate(self, new_tokens: Sequence[int], params, max_new_tokens: int,
                 stop_ids: frozenset[int] = frozenset(),
                 cancel: threading.Event | None = None) -> Iterator[StepEvent]:
        """Prefill `new_tokens` after the cached prefix, then yield each sampled token.

        Checks run now, before any work: ContextFullError if the prompt does not fit,
        ValueError for bad arguments. With no new tokens the last cached token is
        re-forwarded (its logits are not kept), so a fully cached prompt still works.
        Ends after a stop id (yielded), `max_new_tokens` tokens, `cancel` being set, or the
        cache being full (the last token is yielded but cannot be forwarded).
        """
        from ..sampling import Sampler  # lazily: sampling.py is optional for forward-only use

        new_tokens = self.prepare_generate(new_tokens, params, max_new_tokens)
        return self._generate(new_tokens, Sampler(params), max_new_tokens,
                              frozenset(stop_ids), cancel)

    def generate_chunks(self, new_tokens: Sequence[int], params, max_new_tokens: int,
                        stop_ids: frozenset[int] = frozenset(),
                        cancel: threading.Event | None = None,
                        window_s: float = 0.03) -> Iterator[list[StepEvent]]:
        """`generate()`'s events in non-empty lists, in order (docs/INTERFACES.md).

        The same checks as `generate()`, raised now. The first token comes alone, as soon as
        it is sampled; after that a list is yielded when a token is ready and `window_s` has
        passed since the previous yield, or when the turn ends. `kv_tokens` holds every
        yielded token but the last one at each suspension, as with `generate()`.
        """
        if self._spec is not None:
            from ..sampling import Sampler

            new = self.prepare_generate(new_tokens, params, max_new_tokens)
            return self._spec_chunks(new, Sampler(params), max_new_tokens, frozenset(stop_ids),
                                     cancel, window_s)
        return group_steps(self.generate(new_tokens, params, max_new_tokens, stop_ids, cancel),
                           window_s)

    def _compute(self, fn: Callable, *args):
        """Run fn(*args) where this backend computes (the reference backend's compute thread)."""
        return fn(*args)

    # A backend with its own run-ahead decode loop sets this and implements _plain_run: then
    # speculation hands it the steps that have nothing to verify (engine/spec.py, below).
    spec_runs_plain = False

    def _plain_run(self, new_tokens: list[int], params, max_new_tokens: int,
                   stop_ids: frozenset[int], cancel: threading.Event | None,
                   until: Callable[[int], bool], seed: int, watch_n: int = 0,
                   first_run: bool = False) -> Iterator[list[StepEvent]]:
        """Plain decoding for speculation: prefill `new_tokens`, then sample and decode as
        generate_chunks does (stop ids, max_new_tokens, a full cache, cancel end it), calling
        until(id) with every sampled id in order; once it returns True the run stops at once,
        keeping the ids of the steps already under way (every one of them is a valid sample,
        so none is thrown away). Yields non-empty lists as they land, with the cache exact
        at each (kv_tokens = every id but the last); `seed` is the run's sampler seed.
        watch_n > 0: until() returns True exactly where the last watch_n ids of the whole
        context occurred before (NgramDrafter.will_draft), except at the run's first id when
        `first_run`; a backend may find that point itself, where the ids are made, so that
        no step runs past it."""
        raise NotImplementedError(f"the {self.name} backend has no plain run for speculation")

    def _spec_chunks(self, new_tokens: list[int], sampler, max_new_tokens: int,
                     stop_ids: frozenset[int], cancel: threading.Event | None, window_s: float
                     ) -> Iterator[list[StepEvent]]:
        """generate_chunks with speculation (engine/spec.py): each step drafts up to k ids,
        forwards the last token and the drafts in one multi-token forward (forward_all) and
        keeps what Sampler.verify accepts plus one token of the sampler's own; the rejected
        drafts' K/V are truncated away before anything is yielded. A step's tokens are never
        split across lists, so at every suspension kv_tokens == the cached prefix + the new
        tokens + every yielded token but the last, as without speculation; each token's
        step_ms is its step's time shared equally (the effective rate). The turn ends as
        generate()'s does (stop id, max_new_tokens, cancel -- checked per step --, full cache);
        drafts are capped so that neither limit can be overrun.

        When the drafter has nothing (and for the first token), a backend with
        `spec_runs_plain` decodes plainly, running ahead of the host as without speculation,
        until the drafter has a draft (_plain_run; each run's sampler seed its own, from the
        turn's), instead of one synchronous one-token forward per token; its tokens are the
        plain loop's own. Otherwise the first token comes from forward(new tokens) and a step
        without drafts forwards the last token alone."""
        from ..spec import ModelDrafter, NgramDrafter

        stats = self.spec_stats = dict(drafted=0, accepted=0, verify_steps=0)
        if cancel is not None and cancel.is_set():
            return
        context = self.kv_tokens + new_tokens
        drafter = (ModelDrafter(self.draft_backend, context, self.config.vocab_size)
                   if self._spec == "draft" else NgramDrafter(context))
        params, seed = sampler.params, sampler.seed   # (the resolved seed: -1 drew one)
        n_runs = 0

        watch_n = drafter.watch_n   # > 0 where until() is an n-gram's repeat

        def until(token: int) -> bool:   # a plain run's sampled id: does a draft start here?
            drafter.extend((token,))
            # not at the turn's first id: that one is yielded alone, the moment it lands, and
            # the ids of the steps already under way when a run stops come with the stop's
            return len(drafter.tokens) > len(context) + 1 and drafter.will_draft()

        n_out, last = 0, -1
        pending: list[StepEvent] = []
        last_yield = time.perf_counter()
        while not (n_out and (last in stop_ids or n_out >= max_new_tokens
                              or len(self.kv_tokens) >= self.max_context)
                   or (cancel is not None and cancel.is_set())):
            # room for the drafts after `last`, and at most one token past them to emit
            limit = min(self.max_context - len(self.kv_tokens) - 1, max_new_tokens - n_out - 1)
            t0 = time.perf_counter()
            drafts = drafter.draft(limit) if n_out and limit > 0 else []
            if not drafts and self.spec_runs_plain:
                # seeds 2^64 / golden ratio apart: each run's draws are its own
                run_seed = (seed + n_runs * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
                n_runs += 1
                got = 0
                run = self._plain_run(new_tokens if not n_out else [last], params,
                                      max_new_tokens - n_out, stop_ids, cancel, until, run_seed,
                                      watch_n, not n_out)
                try:   # closed here when this generator is (the run's cache stays exact)
                    for chunk in run:
                        if not got:   # the run's first id: its wall time from the request on
                            chunk[0] = StepEvent(chunk[0].token_id,
                                                 (time.perf_counter() - t0) * 1e3, not n_out)
                        got += len(chunk)
                        n_out += len(chunk)
                        last = chunk[-1].token_id
                        # the cache holds every id taken but the last: all of them are yielded
                        # at each suspension; the first token (a list of its own: the run takes
                        # it alone and never stops there) never waits for a window
                        pending.extend(chunk)
                        now = time.perf_counter()
                        if chunk[0].first or now - last_yield >= window_s:
                            last_yield = now
                            yield pending
                            pending = []
                finally:
                    run.close()
                if not got:
                    break   # cancelled, or another call took the cache over
                continue
            if not n_out:
                token = self._compute(lambda: sampler.sample(self.forward(new_tokens),
                                                             self.kv_tokens))
                drafter.extend((token,))
                n_out, last = 1, token
                yield [StepEvent(token, (time.perf_counter() - t0) * 1e3, True)]
                last_yield = time.perf_counter()
                continue
            draft_ms = (time.perf_counter() - t0) * 1e3   # a draft model's steps count too
            emitted, ms, accepted = self._compute(self._verify_step, last, drafts, sampler,
                                                  stop_ids)
            ms += draft_ms
            if drafts:
                stats["drafted"] += len(drafts)
                stats["accepted"] += accepted
                stats["verify_steps"] += 1
                drafter.update(len(drafts), accepted)
            drafter.extend(emitted)
            share = ms / len(emitted)
            pending.extend(StepEvent(t, share, False) for t in emitted)
            n_out += len(emitted)
            last = emitted[-1]
            now = time.perf_counter()
            if now - last_yield >= window_s:
                last_yield = now
                yield pending
                pending = []
        if pending:
            yield pending

    def _verify_step(self, last: int, drafts: list[int], sampler, stop_ids: frozenset[int]
                     ) -> tuple[list[int], float, int]:
        """Forward `last` (+ `drafts` in the same forward); (emitted ids, ms, drafts kept).
        The cache ends holding `last` and every emitted id but the last one.

        Each row's id is the sampler's pick after it (Sampler.verify's rule: draft i is kept
        iff row i's id is the draft). Greedy without a penalty needs only each row's argmax
        (Sampler.sample's first maximum), which a backend may find where the logits are; a
        backend that samples on the device (`samples_rows`) draws every row there, as its
        decode step would at that position; otherwise the rows come back and the sampler draws
        them, one by one, only as far as the drafts are kept. Either way one id per row, not a
        vocabulary of logits (600 KB at Qwen's 152064), crosses to the host where it can."""
        t0 = time.perf_counter()
        n0 = len(self.kv_tokens)
        greedy = sampler.params.greedy and sampler.params.repeat_penalty == 1.0
        tokens = [last] + drafts
        rows = picks = None
        if greedy:
            picks = self.forward_all_argmax(tokens)      # the cache holds them all
        elif self.samples_rows:
            picks = self.forward_all_sample(tokens, sampler)
        elif drafts:
            rows = self.forward_all(tokens)              # [1 + k, V]
        else:
            rows = [self.forward(tokens)]
        # what plain decoding would have cached, for the sampler's penalty window (the CPU
        # draws only; greedy needs none: a copy of the whole context every step otherwise)
        history = self.kv_tokens[:n0 + 1] if rows is not None else None
        emitted: list[int] = []
        kept = 0
        try:
            for i, d in enumerate(drafts):
                token, ok = (picks[i], picks[i] == d) if rows is None else \
                    sampler.verify(rows[i], history, d)
                emitted.append(token)
                if not ok:
                    break
                kept += 1
                if history is not None:
                    history.append(token)
                if token in stop_ids:
                    break
            else:   # every draft kept
                emitted.append(picks[len(drafts)] if rows is None
                               else sampler.sample(rows[len(drafts)], history))
        except BaseException:
            self.truncate(n0 + 1)                    # `last` is forwarded, nothing after it
            raise
        self.truncate(n0 + len(emitted))             # last + emitted[:-1] (= accepted drafts)
        return emitted, (time.perf_counter() - t0) * 1e3, kept

    # A backend that samples the verify step's rows where its logits are sets this and
    # implements forward_all_sample.
    samples_rows = False

    def forward_all_sample(self, tokens: Sequence[int], sampler) -> list[int]:
        """forward_all(tokens), then row i sampled with `sampler`'s settings as a decode step
        at its position would sample it (the penalty window: the context through tokens[i]);
        each row's draw its own. Only with samples_rows."""
        raise NotImplementedError(f"the {self.name} backend does not sample rows itself")

    def forward_all_argmax(self, tokens: Sequence[int]) -> list[int]:
        """forward_all(tokens), then each row's argmax (lowest id on ties): the greedy pick
        after every token. A backend whose logits live elsewhere overrides it to bring back
        the ids alone."""
        return [int(torch.argmax(row)) for row in self.forward_all(tokens)]

    def prepare_generate(self, new_tokens: Sequence[int], params, max_new_tokens: int
                         ) -> list[int]:
        """The checks `generate` makes before any work (shared with overriding backends):
        returns the tokens to prefill (the last cached one, uncached, when there are none)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
        params.validate()
        new_tokens = [int(t) for t in new_tokens]
        if not new_tokens:
            if not self.kv_tokens:
                raise ValueError("generate() needs new tokens or a cached prefix")
            new_tokens = [self.kv_tokens[-1]]
            self.truncate(len(self.kv_tokens) - 1)
        return self._checked(new_tokens)

    def _generate(self, new_tokens: list[int], sampler, max_new_tokens: int,
                  stop_ids: frozenset[int], cancel: threading.Event | None
                  ) -> Iterator[StepEvent]:
        # kv_tokens stays exact at every suspension point because the only mutation is
        # forward(), which is atomic; a token is yielded before it is forwarded, so an
        # abandoned iterator leaves it out of the cache.
        if cancel is not None and cancel.is_set():
            return
        t0 = time.perf_counter()
        logits = self.forward(new_tokens)
        for i in range(max_new_tokens):
            token = sampler.sample(logits, self.kv_tokens)
            step_ms = (time.perf_counter() - t0) * 1e3
            yield StepEvent(token, step_ms, i == 0)
            if (token in stop_ids or i + 1 == max_new_tokens
                    or len(self.kv_tokens) >= self.max_context
                    or (cancel is not None and cancel.is_set())):
                return
            t0 = time.perf_counter()  # the consumer's time between steps is not counted
            logits = self.forward([token])


def group_steps(steps: Iterable[StepEvent], window_s: float,
                clock: Callable[[], float] = time.perf_counter) -> Iterator[list[StepEvent]]:
    """Group a `generate()` stream into `generate_chunks()` lists, timed on `clock`.

    The window runs from the previous yield (the consumer's time counts towards it) and is
    checked when a token arrives: a list closes with the first token that finds the window
    passed. Pulling the next token is what forwards the previous one, so at every yield the
    last token of the list is sampled, not forwarded, exactly as `generate()` leaves it. If
    `steps` raises, the tokens it yielded before are still delivered (one list), then the
    exception. Closing this iterator closes `steps` at once.
    """
    it = iter(steps)
    try:
        first = next(it, None)
        if first is None:
            return
        last = clock()
        yield [first]               # TTFT never waits for a window
        chunk: list[StepEvent] = []
        while True:
            try:
                ev = next(it)
            except StopIteration:   # the turn ended: stop, length, cancel, context full
                break
            except Exception:
                if chunk:
                    yield chunk
                raise
            chunk.append(ev)
            now = clock()
            if now - last >= window_s:
                last = now
                yield chunk
                chunk = []
        if chunk:
            yield chunk
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


class ModelFileTensors(Mapping):
    """A ModelFile's tensors as a Mapping (name -> zero-copy CPU tensor), read one at a time
    when indexed, so loading a backend never holds a second copy of the whole file."""

    def __init__(self, mf) -> None:
        self._mf = mf

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._mf.tensors:
            raise KeyError(f"tensor {name!r} is missing from {self._mf.path}")
        return self._mf.tensor(name)

    def __iter__(self):
        return iter(self._mf.tensors)

    def __len__(self) -> int:
        return len(self._mf.tensors)
