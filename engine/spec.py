"""Speculative decoding's drafters: prompt lookup (n-gram matching over the conversation) and a
draft model (a smaller model of the same tokenizer, decoding greedily ahead of the target).

A coding assistant's reply often repeats what it was shown ("add type hints to this",
"rename x to y"). The drafter proposes the tokens that followed the most recent earlier
occurrence of the context's last n tokens (n from MAX_N down to MIN_N, the longest match
first); the backend verifies them all in one multi-token forward and keeps the longest prefix
the sampler accepts (Sampler.verify: exact for greedy and for sampling), plus one token of its
own. Nothing is drafted when nothing matches, and the draft length follows the acceptance:
longer after a fully accepted draft, shorter after a rejection (not below NGRAM_K_MIN).

The index maps every n-gram (n <= MAX_N) ending at each position to its latest end position,
updated as tokens are appended, so a draft costs a few dict lookups whatever the context's
length (the conversation is indexed once per turn: O(context) dict operations).
"""

from __future__ import annotations

from collections.abc import Sequence

SPEC_MODES = ("ngram", "draft")  # Backend.spec values besides None (off)

MAX_N = 4        # longest n-gram matched
MIN_N = 2        # shortest n-gram matched (one token drafts too often wrong to pay)
K_MIN, K_START, K_MAX = 1, 4, 12  # draft length bounds and start
# Prompt lookup drafts at least this many ids (when it drafts at all): after a rejection its
# next draft is not cut to the one past what was kept. A draft costs nothing to make, and the
# verify step's time hardly grows from two tokens to four -- 2.69 / 2.71 / 2.84 ms at 7B shapes
# on the H100 against a 2.19 ms decode step (results/2026-12-06_bench_verify_7b_484a693_h100.json)
# -- while every kept id saves a step. Replayed on the bundled model's replies to the
# code-editing workload (benchmarks/spec_policy.py, RESULTS.md session 17): 7B estimate 1.606 ->
# 1.446 ms per token on the edits (median), 1.772 -> 1.755 on new code. A draft model's ids
# cost its own steps, so ModelDrafter keeps K_MIN.
# Session 32 replayed 1-token matches, n up to 8 and 4 ids at the 7B's newer t(k) (edits 1.344
# against 1.436 there), but on the device the bundled model in graph mode, the product's
# default, lost with them (`bench --spec ngram`: 0.86x plain decoding against 1.23x), and the
# reference backend lost too (RESULTS.md session 32): the replay prices a verify step at its
# GPU time alone.
NGRAM_K_MIN = 3
_ID_BITS = 20     # n-gram keys: ids below 2**20 - 1 (Qwen2's vocabulary is 151936)


class _Drafter:
    """What both drafters share: the draft length k, adapted to the acceptance."""

    def __init__(self, k_start: int, k_min: int, k_max: int) -> None:
        if not 1 <= k_min <= k_start <= k_max:
            raise ValueError(f"draft lengths {k_min} <= {k_start} <= {k_max} do not hold")
        self.k, self.k_min, self.k_max = k_start, k_min, k_max

    def update(self, drafted: int, accepted: int) -> None:
        """Adapt the draft length to the last verify step's acceptance."""
        if drafted <= 0:
            return
        if accepted == drafted:
            self.k = min(self.k_max, self.k + 2)
        else:
            self.k = max(self.k_min, accepted + 1)


class NgramDrafter(_Drafter):
    """Drafts continuations of `tokens` (the whole context so far) from its own history."""

    def __init__(self, tokens: Sequence[int] = (), max_n: int = MAX_N, min_n: int = MIN_N,
                 k_start: int = K_START, k_min: int = NGRAM_K_MIN, k_max: int = K_MAX) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes {min_n}..{max_n}: need 1 <= min_n <= max_n")
        super().__init__(k_start, k_min, k_max)
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        # _last[n]: n-gram key -> end position of its latest occurrence; _prev[n]: for the
        # n-gram ending at the last position, the end of its previous occurrence (-1: none, or
        # fewer than n ids so far); _keys[n]: that n-gram's key, its ids + 1 packed _ID_BITS
        # apiece into one int, each from the previous position's (n-1)-gram key (exact, and
        # cheaper than a tuple slice per n-gram: 30000 ids index in 0.071 s here, 0.099 with
        # tuples; 0.11 against 0.19 at n <= 8)
        self._last: list[dict[int, int]] = [{} for _ in range(max_n + 1)]
        self._prev: list[int] = [-1] * (max_n + 1)
        self._keys: list[int] = [0] * (max_n + 1)
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the context (emitted ones only: a rejected draft never enters)."""
        toks, keys, max_n = self.tokens, self._keys, self.max_n
        for t in tokens:
            t1 = int(t) + 1
            if not 0 < t1 < 1 << _ID_BITS:
                raise ValueError(f"token id {t} is outside 0..{(1 << _ID_BITS) - 2}")
            toks.append(t1 - 1)
            i = len(toks) - 1
            m = min(max_n, i + 1)
            # the n-gram ending here is the (n-1)-gram that ended at i - 1, then this id: from
            # the longest down, so that keys[n - 1] is still the previous position's
            for n in range(m, 0, -1):
                key = keys[n] = (keys[n - 1] << _ID_BITS) | t1
                d = self._last[n]
                self._prev[n] = d.get(key, -1)
                d[key] = i

    @property
    def watch_n(self) -> int:
        """will_draft() is "the last min_n ids occurred before": a plain run on the device
        watches for that itself (Backend._plain_run)."""
        return self.min_n

    def will_draft(self) -> bool:
        """Whether draft() would propose anything now (room permitting): some n-gram of
        min_n..max_n tokens ending at the last position occurred before -- exactly when its
        last min_n tokens did (a longer n-gram's earlier occurrence ends in one of them)."""
        return self._prev[self.min_n] >= 0

    def draft(self, limit: int | None = None) -> list[int]:
        """Up to min(k, limit) tokens that followed the longest matching earlier n-gram, or []."""
        k = self.k if limit is None else min(self.k, limit)
        if k <= 0:
            return []
        toks = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            p = self._prev[n]
            if p >= 0:
                cont = toks[p + 1:p + 1 + k]   # p < the last position: never empty
                if cont:
                    return cont
        return []


class ModelDrafter(_Drafter):
    """Drafts with a draft model's backend (`draft`, e.g. a 0.5B for a 7B of the same
    tokenizer): its greedy continuation of the context, k ids at a time.

    The draft backend keeps its own cache of a prefix of the context: each draft truncates it
    to the longest prefix it shares with the context (the ids it drafted and the target kept
    stay cached), then generates k ids greedily from the rest (its backend's decode loop).
    Greedy drafts are a deterministic drafter, so Sampler.verify's rule keeps the target's
    distribution exact; a draft whose context no longer fits the draft model's cache is not
    made. The interface is NgramDrafter's (extend, draft, and _Drafter's update)."""

    watch_n = 0   # will_draft() is not an n-gram's repeat: no device watch

    def __init__(self, draft, tokens: Sequence[int] = (), target_vocab: int | None = None,
                 k_start: int = K_START, k_min: int = K_MIN, k_max: int = K_MAX) -> None:
        super().__init__(k_start, k_min, k_max)
        self.backend = draft
        self.tokens: list[int] = [int(t) for t in tokens]
        # ids both models have rows for (the same tokenizer, embeddings padded differently)
        self._vocab = min(draft.config.vocab_size, target_vocab or draft.config.vocab_size)

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def will_draft(self) -> bool:
        """Whether draft() would draft now (room permitting): the context and k ids fit the
        draft model's cache. (An id past its vocabulary, which draft() also refuses, is not
        looked for here: the caller then finds no draft and asks again after the next id.)"""
        return self._fits(self.k)

    def _fits(self, k: int) -> bool:
        """A context and k drafted ids fit the draft model's cache."""
        return k > 0 and bool(self.tokens) and len(self.tokens) + k - 1 <= self.backend.max_context

    def draft(self, limit: int | None = None) -> list[int]:
        from .sampling import SamplerParams

        k = self.k if limit is None else min(self.k, limit)
        be, ctx, vocab = self.backend, self.tokens, self._vocab
        if not self._fits(k):
            return []
        keep = 0
        for a, b in zip(be.kv_tokens, ctx):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ctx) - 1)         # at least the last context id is forwarded
        new = ctx[keep:]
        if any(not 0 <= t < vocab for t in new):
            return []  # an id past the draft's embedding rows
        be.truncate(keep)
        # the draft backend's own greedy decode loop: on the CUDA engine the k steps are
        # sampled on the device and run ahead, one id each back, not a vocabulary of logits
        # per id; an id past the target's rows ends the draft there
        out: list[int] = []
        steps = be.generate(new, SamplerParams.greedy_params(), k)
        try:
            for e in steps:
                if not 0 <= e.token_id < vocab:
                    break
                out.append(e.token_id)
        finally:
            steps.close()   # an abandoned turn leaves the cache exact (INTERFACES.md)
        return out
