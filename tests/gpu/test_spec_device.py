"""Prompt lookup on the device (csrc/spec.cu; NANOQWEN_SPEC_DEVICE, on by default): every step of
a speculative turn drafts on the GPU (spec_draft over ctx_tokens) and is a decode step or a
verify step whose rows are drawn by sample_token and accepted by spec_accept, all inside the
engine's loop (one graph replay a step, run ahead of the host like plain decoding).

Each id of a verify step is drawn as the decode step of that id draws it: the same logits bit
for bit (launch_verify's promise, tests/gpu/test_verify.py), the same penalty window, the same
Philox(seed, the id's index in the turn). A draft is kept iff it is that id. So with ANY
sampler and a fixed seed a speculative reply is the plain reply token for token, which is what
these tests compare (the host loop only keeps the distribution: its rows take seeds of their
own). The bundled model is trained, so drafts are really kept."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from nanoqwen.engine.sampling import SamplerParams

GREEDY = SamplerParams.greedy_params()
SAMPLERS = {
    "greedy": GREEDY,
    "greedy-penalty": SamplerParams(temperature=0.0, repeat_penalty=1.1, repeat_last_n=64),
    "t0.8-topk-topp": SamplerParams(temperature=0.8, top_k=40, top_p=0.95, seed=7),
    "t0.7-penalty": SamplerParams(temperature=0.7, top_k=0, top_p=0.8, min_p=0.0,
                                  repeat_penalty=1.2, repeat_last_n=64, seed=3),
}


def _on_device(be, on: bool) -> None:
    be.switches = dataclasses.replace(be.switches, spec_device=on)


@pytest.fixture()
def be(bundled):
    """The bundled model's backend, left in graph mode with speculation on the device."""
    backend = bundled.backend
    yield backend
    backend.mode = "graph"
    backend.spec = None
    _on_device(backend, True)


@pytest.mark.parametrize("params", SAMPLERS.values(), ids=SAMPLERS.keys())
@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_speculative_reply_is_the_plain_reply(bundled, be, mode, params):
    from test_spec import PROMPTS, invariant, prompt_ids, run

    be.mode = mode
    drafted = 0
    for text in PROMPTS:
        ids = prompt_ids(bundled, text)
        plain = run(be, ids, params, 160, None, bundled.tokenizer.stop_ids)
        out = run(be, ids, params, 160, "ngram", bundled.tokenizer.stop_ids,
                  check=invariant(be, ids))
        assert out == plain
        st = be.spec_stats
        assert 0 <= st["accepted"] <= st["drafted"] and st["verify_steps"] <= len(out)
        drafted += st["drafted"]
        if params.greedy and text != PROMPTS[-1]:
            assert st["accepted"] > 0, st   # a code edit repeats its input: drafts are kept
    assert drafted > 0
    if mode == "graph":   # the speculative graph was captured (else it says why)
        assert be.core.spec_note() == ""


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_the_budget_a_full_context_and_the_ring(bundled, be, mode):
    """max_new_tokens is kept exactly whatever the drafts (the device stops at the budget in
    the middle of a drafted run); a context that fills in the middle of one ends as plain
    decoding ends; and a reply of 700 ids, many of them from kept drafts, wraps the 256-slot
    ring (the launcher counts ids, not steps, before it launches a step)."""
    from test_spec import PROMPTS, invariant, prompt_ids, run

    be.mode = mode
    ids = prompt_ids(bundled, PROMPTS[1])
    plain = run(be, ids, GREEDY, 700, None)   # no stop ids: the whole budget
    for n in (1, 2, 3, 5, 17, 38, 700):
        out = run(be, ids, GREEDY, n, "ngram", check=invariant(be, ids))
        assert out == plain[:n], n
        assert be.kv_tokens == ids + out[:-1]
    assert be.spec_stats["accepted"] > 0, be.spec_stats
    # a prompt that leaves 40 positions: the plain reply's length is the context's
    long = (ids * (be.max_context // len(ids) + 1))[:be.max_context - 40]
    plain = run(be, long, GREEDY, 200, None)
    out = run(be, long, GREEDY, 200, "ngram", check=invariant(be, long))
    assert out == plain and len(be.kv_tokens) <= be.max_context
    assert be.spec_stats["verify_steps"] > 0


def test_cancel_and_a_mode_switch_in_the_middle_of_a_turn(bundled, be):
    """The app's keys: eager/graph switched between chunks of a speculative turn (the next
    step launches in the new mode, the drafter's state lives on the device), and a cancel: the
    ids taken are the plain reply's, the cache exact; the device never runs further ahead than
    the ring's 256 ids, so a cancel after the 10th id ends the turn long before its budget."""
    from test_spec import PROMPTS, prompt_ids, run

    ids = prompt_ids(bundled, PROMPTS[0])
    budget = min(1000, be.max_context - len(ids) - 1)
    plain = run(be, ids, GREEDY, budget, None)
    be.truncate(0)
    be.spec = "ngram"
    got: list[int] = []
    for chunk in be.generate_chunks(ids, GREEDY, budget, frozenset(), None, 0.0):
        got += [e.token_id for e in chunk]
        be.mode = "eager" if be.mode == "graph" else "graph"
    assert got == plain
    assert be.kv_tokens == ids + got[:-1]
    cancel = threading.Event()
    be.truncate(0)
    got = []
    for chunk in be.generate_chunks(ids, GREEDY, budget, frozenset(), cancel, 0.0):
        got += [e.token_id for e in chunk]
        if len(got) >= 10:
            cancel.set()
    assert got == plain[:len(got)] and len(got) <= 10 + 256 + 16 < budget
    assert be.kv_tokens == ids + got[:-1]
    assert be.cache.length == len(be.kv_tokens)


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_stop_id_inside_a_drafted_run(bundled, be, mode):
    """A stop id that the drafts carry (it occurs in the prompt) ends the turn at it, inside a
    verify step: the ids after it in that step are not emitted and the cache holds the reply
    but its last id."""
    from test_spec import PROMPTS, invariant, prompt_ids, run

    be.mode = mode
    ids = prompt_ids(bundled, PROMPTS[1])
    plain = run(be, ids, GREEDY, 300, None)
    counts: dict[int, int] = {}
    for t in plain:
        counts[t] = counts.get(t, 0) + 1
    for stop in [t for t in plain[30:] if counts[t] >= 3][:3]:
        out = run(be, ids, GREEDY, 300, "ngram", frozenset({stop}), check=invariant(be, ids))
        assert out == plain[:plain.index(stop) + 1]
        assert be.kv_tokens == ids + out[:-1]


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_the_host_loop_with_the_switch_off(bundled, be, mode):
    """NANOQWEN_SPEC_DEVICE=0: prompt lookup is Backend's loop again (plain runs halted by the
    device's watch, verify steps from the host), greedy replies the plain ones."""
    from test_spec import PROMPTS, prompt_ids, same_as_plain

    be.mode = mode
    _on_device(be, False)
    ids = prompt_ids(bundled, PROMPTS[0])
    same_as_plain(be, ids, 120, "ngram", bundled.tokenizer.stop_ids)
    assert be.spec_stats["verify_steps"] > 0 and be.spec_stats["accepted"] > 0


def test_after_a_speculative_turn_the_history_is_the_reply(bundled, be):
    """The device's sampler history (ctx_tokens) after a speculative turn is kv_tokens (the
    drafts it wrote and rejected are overwritten), and the engine's position and last id are
    the plain turn's: a plain turn after it continues exactly as after the plain reply."""
    from test_spec import PROMPTS, prompt_ids, run

    ids = prompt_ids(bundled, PROMPTS[0])
    params = SamplerParams(temperature=0.7, seed=11, repeat_penalty=1.3, repeat_last_n=64)

    def turns(spec):
        torch.cuda.synchronize()
        with torch.inference_mode():
            be.ctx_tokens.fill_(0)
        torch.cuda.synchronize()
        reply = run(be, ids, GREEDY, 90, spec)
        n = len(be.kv_tokens)
        assert be.ctx_tokens[:n].tolist() == be.kv_tokens
        follow = [e.token_id for c in be.generate_chunks([reply[-1]] + ids[-6:], params, 40)
                  for e in c]
        return reply, follow

    assert turns("ngram") == turns(None)
