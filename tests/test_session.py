"""ChatSession on the reference backend with a real (tiny, byte-level BPE) tokenizer.

The central property: however a session got its KV cache (prefix reuse, cancellation, an
abandoned stream, a failure), its next turn gives the same greedy tokens as a fresh session
(new backend, empty cache) handed the same messages and transcript (the replies' sampled ids).
Weights are random, so replies are gibberish; the reused and the
fresh run differ only in fp32 op order (chunked vs whole prefill), ~1e-6 on logits whose
top-1 margins here are >1e-3, so greedy tokens must agree exactly.
"""

from __future__ import annotations

import threading

import pytest

from helpers import CHATML_TEMPLATE, TINY_UNTIED, file_tensors, random_weights, tiny_tokenizer_json
from nanoqwen.engine.backends.reference import ReferenceBackend
from nanoqwen.engine.errors import ContextFullError
from nanoqwen.engine.sampling import SamplerParams
from nanoqwen.engine.session import (ChatSession, Done, Error, Notice, Stats, TextDelta, TokenIds,
                                     Transcript)
from nanoqwen.engine.tokenizer import Tokenizer

GREEDY = SamplerParams.greedy_params()
SYSTEM = "You are a helpful assistant."
USERS = ["write a function that adds two numbers", "now make it a class", "print it 10 times"]


@pytest.fixture(scope="module")
def tensors():
    return file_tensors(TINY_UNTIED, random_weights(TINY_UNTIED, seed=0))


class CountingBackend(ReferenceBackend):
    """The real reference backend, recording how many tokens each forward() call appends."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.forwarded: list[int] = []

    def forward(self, tokens):
        self.forwarded.append(len(tokens))
        return super().forward(tokens)


@pytest.fixture
def make(tensors):
    return lambda cls=CountingBackend, **kw: cls(TINY_UNTIED, tensors, **kw)


def run(events):
    """Drain a turn: (ids, text, stats, done, all events)."""
    evs = list(events)
    ids = [i for e in evs if isinstance(e, TokenIds) for i in e.ids]
    text = "".join(e.text for e in evs if isinstance(e, TextDelta))
    stats = next(e for e in evs if isinstance(e, Stats))
    return ids, text, stats, evs[-1], evs


def fresh_turn(make, tok, messages, user, n, transcript=None):
    """The same turn from scratch: a new backend, a session restored from `messages` (and a
    copy of `transcript`, the sampled ids of the replies)."""
    return run(ChatSession(make(), tok, messages=messages,
                           transcript=transcript.copy() if transcript else None
                           ).generate(user, GREEDY, n))


def test_multi_turn_reuses_the_whole_previous_turn_and_matches_fresh_sessions(make,
                                                                             tiny_tokenizer):
    tok = tiny_tokenizer
    be = make()
    s = ChatSession(be, tok, system_prompt=SYSTEM)
    re_encoded_differs = []
    for turn, user in enumerate(USERS):
        cached = list(be.kv_tokens)
        before = s.messages
        transcript = s.transcript.copy()
        be.forwarded.clear()
        ids, text, stats, done, _ = run(s.generate(user, GREEDY, 24))
        messages = before + [{"role": "user", "content": user}]
        prompt = be.kv_tokens[:stats.n_prompt]
        # the prompt ids decode to exactly the rendered conversation ...
        assert tok.decode(prompt, skip_special_tokens=False) == tok.render_chat(messages)
        # ... and continue the cache: the previous prompt and the reply as sampled (its last
        # token was never forwarded) are all reused; only the new message's tokens are
        # prefilled, then one per decode step
        assert stats.n_reused == len(cached) and prompt[:len(cached)] == cached
        assert be.forwarded == [len(prompt) - len(cached)] + [1] * (len(ids) - 1)
        assert (stats.n_prompt, stats.n_prefilled) == (len(prompt), len(prompt) - len(cached))
        assert be.kv_tokens == prompt + ids[:-1]
        # the plain encoding of the text: random weights emit splits BPE would not make, so
        # it would have ended the reused prefix inside the previous reply
        re_encoded_differs.append(tok.encode_chat(messages) != prompt)
        f_ids, f_text, f_stats, _, _ = fresh_turn(make, tok, before, user, 24, transcript)
        assert (ids, text) == (f_ids, f_text) and f_stats.n_reused == 0
        assert done == Done("length") and s.history[-1] == {"role": "assistant", "content": text}
    assert [m["role"] for m in s.messages] == ["system"] + ["user", "assistant"] * 3
    assert re_encoded_differs[0] is False and any(re_encoded_differs[1:])


def test_a_session_without_the_transcript_encodes_the_text(make, tiny_tokenizer):
    """Messages from elsewhere (a chat reopened from the store) are encoded as text, and an
    edited reply, a regenerated turn or dropped old turns fall back to the longest prefix the
    transcript still matches."""
    tok = tiny_tokenizer
    s = ChatSession(make(), tok, system_prompt=SYSTEM)
    run(s.generate(USERS[0], GREEDY, 12))
    before = s.messages
    messages = before + [{"role": "user", "content": USERS[1]}]
    _, _, stats, _, _ = fresh_turn(make, tok, before, USERS[1], 4)
    assert stats.n_prompt == len(tok.encode_chat(messages))
    # an edited reply: the previous prompt's ids are kept, the rest is encoded from its text
    edited = before[:-1] + [{"role": "assistant", "content": "edited"}]
    t = s.transcript.copy()
    first_prompt = s.backend.kv_tokens[:len(tok.encode_chat(before[:-1]))]
    ids = t.encode(tok, tok.render_chat(edited + [messages[-1]]))
    assert ids[:len(first_prompt)] == first_prompt
    assert tok.decode(ids, skip_special_tokens=False) == tok.render_chat(edited + [messages[-1]])
    # another conversation altogether: its plain encoding
    other = [{"role": "user", "content": "hello"}]
    assert t.encode(tok, tok.render_chat(other)) == tok.encode_chat(other)


def test_cancel_via_event_after_k_tokens(make, tiny_tokenizer):
    be = make()
    s = ChatSession(be, tiny_tokenizer, system_prompt=SYSTEM)
    run(s.generate(USERS[0], GREEDY, 10))
    cancel = threading.Event()
    got = []
    for ev in s.generate(USERS[1], GREEDY, 100, cancel=cancel):
        got.append(ev)
        if isinstance(ev, TokenIds) and sum(isinstance(e, TokenIds) for e in got) == 5:
            cancel.set()
    ids = [i for e in got if isinstance(e, TokenIds) for i in e.ids]
    assert len(ids) == 5 and got[-1] == Done("cancelled")
    partial = "".join(e.text for e in got if isinstance(e, TextDelta))
    assert s.history[-1] == {"role": "assistant", "content": partial}
    assert be.kv_tokens[-4:] == ids[:4]  # the 5th token was sampled, never forwarded
    _check_next_turn_matches_fresh(make, s)


def test_cancel_from_another_thread(make, tiny_tokenizer):
    # The app's shape: a worker thread drains events, the UI thread calls cancel().
    be = make()
    s = ChatSession(be, tiny_tokenizer, system_prompt=SYSTEM)
    got, started = [], threading.Event()

    def worker():
        for ev in s.generate(USERS[0], GREEDY, 3000):
            got.append(ev)
            if len(got) >= 6:
                started.set()

    t = threading.Thread(target=worker)
    t.start()
    assert started.wait(30)
    s.cancel()
    t.join(30)
    n = sum(isinstance(e, TokenIds) for e in got)
    assert got[-1] == Done("cancelled") and 3 <= n < 3000
    stats = next(e for e in got if isinstance(e, Stats))
    assert stats.n_generated == n and stats.kv_len == len(be.kv_tokens) == stats.n_prompt + n - 1
    _check_next_turn_matches_fresh(make, s)


def test_abandoned_stream_keeps_partial_reply(make, tiny_tokenizer):
    be = make()
    s = ChatSession(be, tiny_tokenizer, system_prompt=SYSTEM)
    stream = s.generate(USERS[0], GREEDY, 50)
    ids = [next(e for e in stream if isinstance(e, TokenIds)).ids[0] for _ in range(7)]
    stream.close()
    assert s.history[-1]["role"] == "assistant"
    assert s.history[-1]["content"] == tiny_tokenizer.decode(ids)
    assert be.kv_tokens[-6:] == ids[:6]
    _check_next_turn_matches_fresh(make, s)


def test_unstarted_stream_changes_nothing(make, tiny_tokenizer):
    s = ChatSession(make(), tiny_tokenizer, system_prompt=SYSTEM)
    s.generate(USERS[0], GREEDY, 5)
    assert s.history == []


def test_a_reply_that_decodes_to_nothing_leaves_the_prompt_as_it_was(tiny_tokenizer):
    # ids past the tokenizer's vocabulary (a model's embedding may have more rows) decode to
    # nothing: marking them would give the prompt's text a second, longer id sequence, and a
    # regenerated turn (the same text) would carry the old reply's ids into its prompt
    tok = tiny_tokenizer
    t = Transcript()
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    ids = t.encode(tok, text)
    assert ids == tok.encode(text)
    t.begin_turn(text, ids)
    blank = list(range(tok.vocab_size, tok.vocab_size + 3))
    assert tok.decode(blank, skip_special_tokens=False) == ""
    t.add_reply(tok, blank)
    assert t.encode(tok, text) == ids
    t.add_reply(tok, tok.encode("ok"))
    assert t.encode(tok, text) == ids and t.encode(tok, text + "ok") == ids + tok.encode("ok")


def _check_next_turn_matches_fresh(make, s):
    before = s.messages
    transcript = s.transcript.copy()
    ids, text, _, done, _ = run(s.generate(USERS[2], GREEDY, 16))
    f_ids, f_text, _, _, _ = fresh_turn(make, s.tokenizer, before, USERS[2], 16, transcript)
    assert (ids, text) == (f_ids, f_text) and done == Done("length")


def test_backend_failure_is_an_error_event_and_the_session_recovers(make, tiny_tokenizer):
    class FailingOnce(CountingBackend):
        fail_at = 4  # raise inside the 4th forward (prefill + 3rd decode step), once

        def _forward(self, tokens, pos):
            if len(self.forwarded) == self.fail_at:
                self.fail_at = -1
                raise RuntimeError("injected failure")
            return super()._forward(tokens, pos)

    be = make(FailingOnce)
    s = ChatSession(be, tiny_tokenizer, system_prompt=SYSTEM)
    evs = list(s.generate(USERS[0], GREEDY, 20))
    assert evs[-2] == Error("RuntimeError: injected failure") and evs[-1] == Done("error")
    ids = [i for e in evs if isinstance(e, TokenIds) for i in e.ids]
    assert len(ids) == 3 and be.kv_tokens[-2:] == ids[:2]  # the 3rd failed to forward
    _check_next_turn_matches_fresh(make, s)


def test_regenerate_replaces_the_last_reply(make, tiny_tokenizer):
    s = ChatSession(make(), tiny_tokenizer, system_prompt=SYSTEM)
    first, *_ = run(s.generate(USERS[0], GREEDY, 12))
    again, _, stats, _, _ = run(s.regenerate(GREEDY, 12))
    assert again == first and len(s.history) == 2
    assert stats.n_prefilled == 1  # the whole prompt was cached: only its last token re-runs


def test_stop_token_ends_the_turn(make, tensors):
    # Random weights rarely emit <|im_end|>; declare a token greedy decoding reaches a few
    # steps in a stop id instead (one the tokenizer knows: the model's vocab has padding rows).
    probe, *_ = run(ChatSession(make(), _tok([2]), system_prompt=SYSTEM).generate(USERS[0], GREEDY, 20))
    k = next(i for i, t in enumerate(probe) if i >= 2 and t < 400 and t not in probe[:i])
    tok = _tok([probe[k]])
    be = make()
    s = ChatSession(be, tok, system_prompt=SYSTEM)
    ids, text, stats, done, _ = run(s.generate(USERS[0], GREEDY, 20))
    assert ids == probe[:k + 1] and done == Done("stop") and text == tok.decode(ids[:k])
    assert be.kv_tokens[-k:] == ids[:k] and stats.n_generated == k + 1


def _tok(eos):
    return Tokenizer(tiny_tokenizer_json(), CHATML_TEMPLATE, eos_token_ids=eos)


def test_events_and_stats_are_sane(make, tiny_tokenizer):
    be = make()
    ids, text, st, done, evs = run(ChatSession(be, tiny_tokenizer).generate(USERS[0], GREEDY, 20))
    assert isinstance(evs[0], TokenIds) and evs[-2] is st and done == Done("length")
    assert text == tiny_tokenizer.decode(ids)
    steps = [ms for e in evs if isinstance(e, TokenIds) for ms in e.step_ms]
    assert st.ttft_ms == steps[0] > 0 and 0 < st.ms_per_token < 1e4
    assert st.tokens_per_s == pytest.approx(19 / sum(steps[1:]) * 1e3)
    assert (st.n_generated, st.kv_len, st.max_context, st.mode, st.backend) == \
        (20, len(be.kv_tokens), be.max_context, "eager", "reference")


def test_context_fills_during_the_reply(make, tiny_tokenizer):
    be = make(max_context=48)
    ids, _, st, done, _ = run(ChatSession(be, tiny_tokenizer).generate("hi", GREEDY, 500))
    assert done == Done("context") and len(be.kv_tokens) == 48 == st.kv_len
    assert st.n_prompt + len(ids) - 1 == 48


def test_long_conversation_drops_oldest_turns(make, tiny_tokenizer):
    tok = tiny_tokenizer
    s = ChatSession(make(max_context=128), tok, system_prompt=SYSTEM, min_reply_tokens=8)
    notices = []
    for user in USERS:
        before = s.messages
        ids, text, stats, done, evs = run(s.generate(user, GREEDY, 24))
        notices = [e for e in evs if isinstance(e, Notice)]
        if notices:
            break
    else:
        pytest.fail("the conversation never outgrew the context")
    k = notices[0].dropped_messages
    assert k % 2 == 0 and k >= 2 and "128" in notices[0].message
    full = before + [{"role": "user", "content": user}]
    assert len(tok.encode_chat(full)) + 8 > 128                  # it really did not fit
    kept = full[:1] + full[1 + k:]                               # system prompt kept
    assert stats.n_prompt == len(tok.encode_chat(kept)) <= 128 - 8
    # a new cut leaves a quarter of the context free, with as few turns left out as that
    # takes (or, when no cut does, as few as fit)
    less = len(tok.encode_chat(full[:1] + full[1 + k - 2:]))
    if stats.n_prompt <= 128 - 8 - 128 // 4:
        assert less > 128 - 8 - 128 // 4
    else:
        assert less + 8 > 128
    assert s.messages[:len(before)] == before                    # history keeps everything
    # a fresh session applies the same policy to the same messages
    f_ids, *_ = run(ChatSession(make(max_context=128), tok, messages=before,
                                min_reply_tokens=8).generate(user, GREEDY, 24))
    assert f_ids == ids


def test_a_chat_at_the_context_end_keeps_its_cut_and_its_cache(make, tiny_tokenizer):
    """Once old turns are left out, the next turns keep that cut while they fit, so each
    reuses everything cached (only its own message is prefilled); a new cut frees a quarter
    of the context. Cutting afresh each turn would change the prompt from its start: the
    whole window prefilled on every turn."""
    tok = tiny_tokenizer
    ctx, reserve = 256, 8
    s = ChatSession(make(max_context=ctx), tok, system_prompt=SYSTEM, min_reply_tokens=reserve)
    turns = []
    for i in range(14):
        cached = len(s.backend.kv_tokens)
        _, _, stats, done, evs = run(s.generate(f"tell me more about item {i}", GREEDY, 12))
        notice = next((e for e in evs if isinstance(e, Notice)), None)
        turns.append((notice.dropped_messages if notice else 0, stats, cached))
        assert stats.n_prompt <= ctx - reserve
    kept = new = 0
    for (k0, _, _), (k1, st, cached) in zip(turns, turns[1:]):
        if k1 and k1 == k0:        # the cut kept: the cache continued
            kept += 1
            assert st.n_reused == cached and st.n_prefilled == st.n_prompt - cached
        elif k1:                   # a new cut: a quarter free (these prompts are short)
            new += 1
            assert st.n_prompt <= ctx - reserve - ctx // 4
    assert new >= 1 and kept >= 2, turns


def test_message_alone_too_long_raises_with_the_numbers(make, tiny_tokenizer):
    be = make(max_context=64)
    s = ChatSession(be, tiny_tokenizer, system_prompt=SYSTEM, min_reply_tokens=8)
    run(s.generate("hi", GREEDY, 8))
    history, cached = list(s.history), list(be.kv_tokens)
    long = "the quick brown fox " * 30
    n = len(tiny_tokenizer.encode_chat([{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": long}]))
    with pytest.raises(ContextFullError, match=f"is {n} tokens, 8 more are reserved for the "
                                               f"reply, and the context holds 64 tokens"):
        s.generate(long, GREEDY, 100)
    assert s.history == history and be.kv_tokens == cached


def test_cancel_before_the_stream_starts_is_not_lost(make, tiny_tokenizer):
    # The app creates a session, then iterates in a worker; Esc may land in between.
    s = ChatSession(make(), tiny_tokenizer, system_prompt=SYSTEM)
    stream = s.generate(USERS[0], GREEDY, 50)
    s.cancel()
    ids, _, _, done, _ = run(stream)
    assert ids == [] and done == Done("cancelled") and s.history[-1]["content"] == ""
    ids, *_ = run(s.generate(USERS[1], GREEDY, 5))  # the cancel was for that turn only
    assert len(ids) == 5


# --- chunked generation (Backend.generate_chunks, the session's window_s) -------------------
def test_chunked_turn_is_the_per_token_turn(make, tiny_tokenizer):
    """However the tokens are grouped, a turn gives the same ids, text, stats and cache; an
    endless window gives exactly two chunks: the first token alone, then the rest."""
    per_token = make()
    ids, text, st, done, evs = run(ChatSession(per_token, tiny_tokenizer).generate(
        USERS[0], GREEDY, 20))
    assert [len(e.ids) for e in evs if isinstance(e, TokenIds)] == [1] * 20
    chunked = make()
    c_ids, c_text, c_st, c_done, c_evs = run(ChatSession(chunked, tiny_tokenizer).generate(
        USERS[0], GREEDY, 20, window_s=float("inf")))
    toks = [e for e in c_evs if isinstance(e, TokenIds)]
    assert [len(e.ids) for e in toks] == [1, 19]
    assert (c_ids, c_text, c_done) == (ids, text, done) and chunked.kv_tokens == per_token.kv_tokens
    assert [ms for e in toks for ms in e.step_ms][0] == c_st.ttft_ms      # step_ms stays per token
    assert (c_st.n_generated, c_st.kv_len, c_st.n_prefilled) == (st.n_generated, st.kv_len,
                                                                  st.n_prefilled)
    # at most one TextDelta per chunk, right after its TokenIds (+ the detokenizer's tail)
    kinds = [type(e) for e in c_evs if isinstance(e, (TokenIds, TextDelta))]
    assert all(a is TokenIds for a, b in zip(kinds, kinds[1:-1]) if b is TextDelta)
    assert kinds.count(TextDelta) <= len(toks) + 1


def _prompt(tok, text=USERS[0]) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": text}])


def test_group_steps_windows_on_its_clock_and_keeps_the_cache_exact(make, tiny_tokenizer):
    """The default generate_chunks on a test clock (1/64 s per reading, exact in binary): the
    first token alone, then a chunk each time a token finds the window passed, the rest at the
    end; at every suspension the cache holds every yielded token but the last."""
    from nanoqwen.engine.backends.base import group_steps

    be = make()
    prompt = _prompt(tiny_tokenizer)
    ref = make()
    expected = [e.token_id for e in ref.generate(prompt, GREEDY, 40)]
    now = [0.0]

    def clock():
        now[0] += 1 / 64
        return now[0]

    seen, sizes = [], []
    for chunk in group_steps(be.generate(prompt, GREEDY, 40), 0.04, clock=clock):
        seen += [e.token_id for e in chunk]
        sizes.append(len(chunk))
        assert be.kv_tokens == prompt + seen[:-1]
    assert seen == expected
    # readings: 1 for the first token, then one per token; 0.04 s = 2.56 readings -> 3 tokens
    assert sizes == [1] + [3] * 13
    assert be.kv_tokens == prompt + seen[:-1]


def test_generate_chunks_checks_at_the_call_and_honours_cancel_and_close(make, tiny_tokenizer):
    be = make(max_context=64)
    prompt = _prompt(tiny_tokenizer, "hi")
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        be.generate_chunks(prompt, GREEDY, 0)
    with pytest.raises(ContextFullError, match="the context holds 64"):
        be.generate_chunks(prompt * 10, GREEDY, 5)
    assert be.kv_tokens == [] and be.forwarded == []          # no work was done
    # a cancel set while suspended after the first chunk ends the stream there
    cancel = threading.Event()
    chunks = be.generate_chunks(prompt, GREEDY, 30, cancel=cancel, window_s=float("inf"))
    first = next(chunks)
    cancel.set()
    assert list(chunks) == [] and len(first) == 1 and be.kv_tokens == prompt
    # a stream closed after a chunk leaves that chunk's last token out of the cache
    chunks = be.generate_chunks([], GREEDY, 30, window_s=0.0)
    got = [next(chunks)[0].token_id for _ in range(5)]
    chunks.close()
    assert be.kv_tokens == prompt + got[:4]


def test_failure_inside_a_chunk_delivers_the_tokens_before_it(make, tiny_tokenizer):
    class FailingOnce(CountingBackend):
        def _forward(self, tokens, pos):
            if len(self.forwarded) == 4:   # prefill + 2 decode steps succeed
                raise RuntimeError("injected failure")
            return super()._forward(tokens, pos)

    be = make(FailingOnce)
    evs = list(ChatSession(be, tiny_tokenizer).generate(USERS[0], GREEDY, 20,
                                                        window_s=float("inf")))
    assert [len(e.ids) for e in evs if isinstance(e, TokenIds)] == [1, 2]
    ids = [i for e in evs if isinstance(e, TokenIds) for i in e.ids]
    assert evs[-2] == Error("RuntimeError: injected failure") and evs[-1] == Done("error")
    assert be.kv_tokens[-2:] == ids[:2]  # the 3rd token's forward failed
