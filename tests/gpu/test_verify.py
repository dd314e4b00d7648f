"""The CUDA engine's verify step (csrc/engine.h launch_verify; issue 13 item 3) and speculation
on it, end to end.

What must hold is exactness, so the comparisons are bit for bit (torch.equal), not within a
tolerance:
  * every GEMV with `cols` columns (x [cols, k]) gives, column by column, exactly the one-column
    call on that row of x (gemv.h: the same products, sums and order per column);
  * forward_all (the verify step: T tokens in one pass over the weights) gives, row by row,
    exactly the logits the decode step computes when the same tokens are forwarded one at a
    time -- across page boundaries, at 7B shapes too -- and leaves the cache as they would;
  * greedy speculation on the CUDA engine is the plain greedy reply, token for token, with
    drafts kept (the bundled model is trained: code edits repeat their input), and the cache
    invariant of docs/INTERFACES.md holds at every suspension, after a stop and a cancel;
  * the verify rows sampled on the device (forward_all_sample) are the decode step's sampler's
    draws at their positions, and greedy with a repetition penalty stays the plain reply.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import helpers
from nanoqwen.engine.config import PRESETS, ModelConfig
from nanoqwen.engine.sampling import SamplerParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplerParams.greedy_params()
SEVEN_B_2L = ModelConfig(name="7b-shapes-2-layers", **{**PRESETS["7b"], "num_hidden_layers": 2})
COLS = [2, 3, 8, 9, 13, 16]


def ops():
    return torch.ops.nanoqwen


def rand_int4(n, k, gen):
    from nanoqwen.engine import quant

    codes = torch.randint(1, 16, (n, k), generator=gen)
    scales = (torch.rand(n, k // 128, generator=gen) * 0.02 + 0.001).half()
    return quant.pack_codes(codes).cuda(), scales.cuda()


# qkv, o, gate/up and down of the 7B; a partial row tile and one group (n=3, k=256); the 0.5B's
# hidden with a ragged n
SHAPES = [(4608, 3584), (3584, 3584), (18944, 3584), (3584, 18944), (3, 256), (643, 896)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("cols", COLS)
def test_int4_columns_are_one_column_calls(n, k, cols):
    gen = torch.Generator().manual_seed(n * 31 + k + cols)
    qw, sc = rand_int4(n, k, gen)
    qu, su = rand_int4(n, k, gen)
    x = (torch.randn(cols, k, generator=gen) * 2).half().cuda()
    bias = torch.randn(n, generator=gen).half().cuda()
    y = torch.full((cols, n), float("nan"), dtype=torch.float16, device="cuda")
    ops().gemv_int4(y, x, qw, sc, bias)
    h0 = (torch.randn(cols, n, generator=gen) * 3).cuda()
    h = h0.clone()
    ops().gemv_int4_residual(h, x, qw, sc)
    o = torch.full((cols, n), float("nan"), dtype=torch.float16, device="cuda")
    ops().gemv_int4_silu_mul(o, x, qw, sc, qu, su)
    for c in range(cols):
        y1 = torch.empty(n, dtype=torch.float16, device="cuda")
        ops().gemv_int4(y1, x[c], qw, sc, bias)
        assert torch.equal(y[c], y1), ("gemv_int4", c)
        h1 = h0[c].clone()
        ops().gemv_int4_residual(h1, x[c], qw, sc)
        assert torch.equal(h[c], h1), ("gemv_int4_residual", c)
        o1 = torch.empty(n, dtype=torch.float16, device="cuda")
        ops().gemv_int4_silu_mul(o1, x[c], qw, sc, qu, su)
        assert torch.equal(o[c], o1), ("gemv_int4_silu_mul", c)


# (n, k): a slice of the 7B lm_head with n ragged for every rows-a-warp (1, 2, 4); the 0.5B's
# k = 896 (112 chunks of 8: lanes 16..31 have one chunk fewer); k = 264 (33 chunks: one lane has
# two); k = 8 (one chunk, 31 idle lanes); n = 3 (fewer rows than a warp's group of 4)
FP16_SHAPES = [(152064 // 8 + 5, 3584), (4099, 896), (1001, 264), (37, 8), (3, 3584)]


@pytest.mark.parametrize("n,k", FP16_SHAPES)
@pytest.mark.parametrize("cols", COLS + [5, 6])
def test_fp16_columns_are_one_column_calls(cols, n, k):
    gen = torch.Generator().manual_seed(cols * 7 + k)
    w = (torch.randn(n, k, generator=gen) * 0.02).half().cuda()
    x = torch.randn(cols, k, generator=gen).half().cuda()
    out = torch.full((cols, n), float("nan"), device="cuda")
    ops().gemv_fp16(out, x, w)
    for c in range(cols):
        o1 = torch.empty(n, device="cuda")
        ops().gemv_fp16(o1, x[c], w)
        assert torch.equal(out[c], o1), c


def test_column_counts_are_checked():
    dev = "cuda"
    qw = torch.zeros(8, 32, dtype=torch.int32, device=dev)   # k = 256
    sc = torch.ones(8, 2, dtype=torch.float16, device=dev)
    x = torch.zeros(17, 256, dtype=torch.float16, device=dev)
    with pytest.raises(RuntimeError, match="x has 17 columns, expected 1..16"):
        ops().gemv_int4(torch.empty(17, 8, dtype=torch.float16, device=dev), x, qw, sc, None)
    with pytest.raises(RuntimeError, match="y has 8 elements, expected cols\\*n=16"):
        ops().gemv_int4(torch.empty(8, dtype=torch.float16, device=dev), x[:2], qw, sc, None)
    with pytest.raises(RuntimeError, match=r"x is \[2, 255\], expected \[k\] or \[cols, k\]"):
        ops().gemv_fp16(torch.empty(2, 8, device=dev), x[:2, :255].contiguous(),
                        torch.zeros(8, 256, dtype=torch.float16, device=dev))


# --- the verify step -----------------------------------------------------------------------------
def make_cuda(cfg, max_context=512, seed=0, attn_tma=None):
    """attn_tma: NANOQWEN_ATTN_TMA while the backend is built (the switch is read there), so
    the decode step and the verify step run that attention kernel; None: the default."""
    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.switches import ATTN_TMA

    old = os.environ.pop(ATTN_TMA, None)
    if attn_tma is not None:
        os.environ[ATTN_TMA] = str(int(attn_tma))
    try:
        be = CudaBackend(cfg, helpers.file_tensors(cfg, helpers.random_weights(cfg, seed=seed)),
                         max_context=max_context)
    finally:
        os.environ.pop(ATTN_TMA, None)
        if old is not None:
            os.environ[ATTN_TMA] = old
    assert attn_tma is None or be.switches.attn_tma is attn_tma
    return be


@pytest.fixture(scope="module", params=[False, True], ids=["cpasync", "tma"])
def tiny(request):
    return make_cuda(helpers.TINY_UNTIED, attn_tma=request.param)


@pytest.fixture(scope="module", params=[False, True], ids=["cpasync", "tma"])
def seven_b(request):
    return make_cuda(SEVEN_B_2L, max_context=1024, attn_tma=request.param)


def decode_rows(be, prefix, tokens):
    """Logits of `tokens` forwarded one decode step at a time after `prefix`."""
    be.truncate(0)
    be.forward(prefix)
    return torch.stack([be.forward([t]) for t in tokens])


@pytest.mark.parametrize("mode", ["graph", "eager"])
@pytest.mark.parametrize("n_prefix,T", [(15, 2), (16, 8), (17, 16), (49, 3), (30, 1 + 12)])
def test_verify_rows_are_decode_steps(tiny, mode, n_prefix, T):
    be = tiny
    be.mode = mode
    gen = torch.Generator().manual_seed(n_prefix * 100 + T)
    ids = torch.randint(0, be.config.vocab_size, (n_prefix + T,), generator=gen).tolist()
    want = decode_rows(be, ids[:n_prefix], ids[n_prefix:])
    be.truncate(0)
    be.forward(ids[:n_prefix])
    got = be.forward_all(ids[n_prefix:])
    assert got.shape == want.shape
    assert torch.equal(got, want)
    assert be.kv_tokens == ids and be.cache.length == len(ids)
    # the K/V it wrote are the decode steps' too: the next token's logits agree
    nxt = be.forward([ids[0]])
    be.truncate(0)
    be.forward(ids[:n_prefix])
    for t in ids[n_prefix:]:
        be.forward([t])
    assert torch.equal(nxt, be.forward([ids[0]]))
    be.mode = "graph"


@pytest.mark.parametrize("n_prefix,T", [(40, 8), (511, 13)])
def test_verify_rows_are_decode_steps_7b_shapes(seven_b, n_prefix, T):
    be = seven_b
    gen = torch.Generator().manual_seed(T)
    ids = torch.randint(0, be.config.vocab_size, (n_prefix + T,), generator=gen).tolist()
    want = decode_rows(be, ids[:n_prefix], ids[n_prefix:])
    be.truncate(0)
    be.forward(ids[:n_prefix])
    assert torch.equal(be.forward_all(ids[n_prefix:]), want)
    be.truncate(n_prefix)
    assert be.forward_all_argmax(ids[n_prefix:]) == want.argmax(1).tolist()
    assert be.kv_tokens == ids


def test_verify_refuses_what_it_cannot_run(tiny):
    be = tiny
    be.truncate(0)
    be.forward([1, 2, 3])
    with pytest.raises(ValueError, match="at most 16 tokens on the CUDA engine"):
        be.forward_all(list(range(17)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        be.forward_all([1, be.config.vocab_size])
    assert be.kv_tokens == [1, 2, 3]   # nothing was appended
    small = make_cuda(helpers.TINY_UNTIED, max_context=20)
    small.forward(list(range(15)))
    from nanoqwen.engine.errors import ContextFullError
    with pytest.raises(ContextFullError):
        small.forward_all(list(range(6)))
    assert small.kv_tokens == list(range(15))


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_verify_writes_its_ids_into_the_sampler_history(tiny, mode):
    """The verify step writes its ids into ctx_tokens at their positions, as the prefill and
    every decode step's advance write theirs: the sampler's repetition penalty reads its window
    there, so a sampled step after speculation must find them (not what was there before)."""
    be = tiny
    be.mode = mode
    gen = torch.Generator().manual_seed(41)
    ids = torch.randint(0, be.config.vocab_size, (37,), generator=gen).tolist()
    be.truncate(0)
    be.forward(ids[:20])
    torch.cuda.synchronize()
    with torch.inference_mode():   # (the engine's buffers are inference tensors)
        be.ctx_tokens[20:].fill_(be.config.vocab_size - 1)   # stale ids from an earlier turn
    torch.cuda.synchronize()
    be.forward_all(ids[20:33])
    be.forward_all(ids[33:])
    torch.cuda.synchronize()
    assert be.ctx_tokens[:37].tolist() == ids
    be.mode = "graph"


@pytest.mark.parametrize("mode", ["graph", "eager"])
@pytest.mark.parametrize("params", [
    SamplerParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.3, seed=7),
    SamplerParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=8, seed=7),
    SamplerParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7),
], ids=["app-defaults-penalty", "greedy-penalty", "hot-untruncated"])
def test_verify_sample_rows_are_the_decode_samplers_draws(tiny, mode, params):
    """forward_all_sample (the engine's verify_sample) draws row i exactly as sample_token
    draws forward_all's row i at position n0 + i -- its penalty window the ctx_tokens the verify
    step wrote -- from Philox(the seed the sampler's generator gives first, i): the same ids,
    bit for bit. So each row is the decode step's own sampler at that position (whose law
    test_sampler_cluster checks), and speculation keeps a draft iff it is that draw
    (Sampler.verify's rule, whose law tests/test_spec.py checks)."""
    from nanoqwen.engine.sampling import Sampler

    be = tiny
    be.mode = mode
    V = be.config.vocab_size
    gen = torch.Generator().manual_seed(77)
    ids = torch.randint(0, V, (40,), generator=gen).tolist()
    ids[30:36] = ids[20:26]   # repeats inside the window: the penalty has ids to push down
    n0, T = 29, 11
    try:
        be.truncate(0)
        be.forward(ids[:n0])
        got = be.forward_all_sample(ids[n0:n0 + T], Sampler(params))
        assert be.kv_tokens == ids[:n0 + T] and len(got) == T
        assert all(0 <= t < V for t in got)
        be.truncate(n0)
        rows = be.forward_all(ids[n0:n0 + T]).cuda()
        torch.cuda.synchronize()
        _, pf, pi = be._sampler_values(params, Sampler(params).draw_seed())
        dev = rows.device
        want = []
        with torch.inference_mode():   # (ctx_tokens is the engine's inference tensor)
            out = torch.empty(1, dtype=torch.int32, device=dev)
            work = torch.empty(V, device=dev)
            for i in range(T):
                ops().sample_token(out, work, rows[i].contiguous(), be.ctx_tokens,
                                   torch.tensor([n0 + i], dtype=torch.int32, device=dev),
                                   torch.tensor(pf, device=dev), torch.tensor(pi, device=dev),
                                   torch.tensor([i], device=dev))
                want.append(int(out))
        assert got == want
    finally:
        be.mode = "graph"


def test_verify_sample_refuses_what_it_cannot_run(tiny):
    from nanoqwen.engine.sampling import Sampler

    be = tiny
    be.truncate(0)
    be.forward([1, 2, 3])
    s = Sampler(SamplerParams(temperature=0.8, seed=1))
    with pytest.raises(ValueError, match="at most 16 tokens on the CUDA engine"):
        be.forward_all_sample(list(range(17)), s)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        be.forward_all_sample([1, be.config.vocab_size], s)
    with pytest.raises(RuntimeError, match="params_f and params_i hold 4 values each"):
        be.core.verify_sample(torch.tensor([1], dtype=torch.int32), 3, True, [0.8], [0, 0, 0, 0])
    assert be.kv_tokens == [1, 2, 3]   # nothing was appended


# --- speculation on the CUDA engine (the bundled model: real acceptance) ---------------------------
@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_greedy_speculation_is_plain_greedy(bundled, which, mode):
    from test_spec import PROMPTS, prompt_ids, same_as_plain

    be = bundled.backend
    be.mode = mode
    ids = prompt_ids(bundled, PROMPTS[which])
    same_as_plain(be, ids, 160, "ngram", bundled.tokenizer.stop_ids)
    st = be.spec_stats
    assert st["verify_steps"] > 0 and 0 <= st["accepted"] <= st["drafted"]
    if which != 2:
        assert st["accepted"] > 0, st   # a code edit repeats its input: drafts are kept
    be.mode = "graph"


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_greedy_speculation_with_a_penalty_is_plain_greedy(bundled, mode):
    """Greedy with a repetition penalty takes the device-sampled rows (forward_all_sample):
    each row's pick is the decode step's sampler's at that position, over the same window, so
    the reply is the plain one token for token, with drafts kept."""
    from test_spec import PROMPTS, invariant, prompt_ids, run

    be = bundled.backend
    be.mode = mode
    params = SamplerParams(temperature=0.0, repeat_penalty=1.1, repeat_last_n=64)
    try:
        for text in PROMPTS[:2]:
            ids = prompt_ids(bundled, text)
            plain = run(be, ids, params, 140, None, bundled.tokenizer.stop_ids)
            out = run(be, ids, params, 140, "ngram", bundled.tokenizer.stop_ids,
                      check=invariant(be, ids))
            assert out == plain
            st = be.spec_stats
            assert st["verify_steps"] > 0 and st["accepted"] > 0, st
    finally:
        be.mode = "graph"


def test_speculation_stop_cancel_and_sampling_keep_the_cache_exact(bundled):
    """The host loop (NANOQWEN_SPEC_DEVICE=0; its plain runs queue SPEC_RUN_AHEAD steps, which
    bounds the ids a cancel finds under way); the device's loop: test_spec_device.py."""
    import dataclasses

    from test_spec import PROMPTS, invariant, prompt_ids, run

    be = bundled.backend
    be.switches = dataclasses.replace(be.switches, spec_device=False)
    try:
        _stop_cancel_sampling(bundled, be, PROMPTS, invariant, prompt_ids, run)
    finally:
        be.switches = dataclasses.replace(be.switches, spec_device=True)


def _stop_cancel_sampling(bundled, be, PROMPTS, invariant, prompt_ids, run):
    ids = prompt_ids(bundled, PROMPTS[0])
    plain = run(be, ids, GREEDY, 160, None)
    counts: dict[int, int] = {}
    for t in plain:
        counts[t] = counts.get(t, 0) + 1
    stop = next(t for t in plain[20:] if counts[t] >= 3)
    out = run(be, ids, GREEDY, 160, "ngram", frozenset({stop}), check=invariant(be, ids))
    assert out == plain[:plain.index(stop) + 1]
    assert be.kv_tokens == ids + out[:-1]
    cancel = threading.Event()
    be.truncate(0)
    be.spec = "ngram"
    try:
        got: list[int] = []
        for chunk in be.generate_chunks(ids, GREEDY, 160, frozenset(), cancel, 0.0):
            got += [e.token_id for e in chunk]
            if len(got) >= 10:
                cancel.set()
        assert 10 <= len(got) < 40 and got == plain[:len(got)]
        assert be.kv_tokens == ids + got[:-1]
    finally:
        be.spec = None
    params = SamplerParams(temperature=0.8, seed=5, repeat_penalty=1.1)
    out = run(be, ids, params, 120, "ngram", bundled.tokenizer.stop_ids,
              check=invariant(be, ids))
    assert 1 <= len(out) <= 120 and be.spec_stats["verify_steps"] > 0


def test_a_cuda_draft_model_drafts_exactly():
    """spec "draft" on the CUDA engine through the service (loader.load_draft): the bundled
    model as its own draft model, a second CudaBackend. Greedy replies are the plain ones token
    for token, graph and eager; the draft model's greedy picks are the target's own but for
    near-ties (its cache holds the emitted ids through its prefill kernels, the target's
    through the verify step's), so at least 90% of the drafts are kept, as on the CPU."""
    from test_spec import MODEL, PROMPTS, same_as_plain

    from nanoqwen.engine.service import EngineService

    if not MODEL.is_file():
        pytest.skip("the bundled model is absent")
    svc = EngineService.open(MODEL, backend="cuda")
    try:
        svc.set_spec("draft", draft=MODEL)
        be = svc.backend
        assert be.draft_backend is not None and be.draft_backend.name == "cuda"
        for mode in ("graph", "eager"):
            be.mode = mode
            for text in PROMPTS[::2]:
                ids = svc.tokenizer.encode_chat([{"role": "user", "content": text}])
                same_as_plain(be, ids, 120, "draft", svc.tokenizer.stop_ids)
                st = be.spec_stats
                assert st["verify_steps"] > 0 and st["accepted"] >= 0.9 * st["drafted"], st
    finally:
        svc.close()


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_the_sampler_history_after_speculation_is_the_reply(bundled, mode):
    """After a speculative turn (plain runs on the device and verify steps) the device's
    sampler history (ctx_tokens) is kv_tokens, whatever it held before; so a turn sampled with
    a repetition penalty after it samples exactly as after the same reply decoded plainly."""
    from test_spec import PROMPTS, prompt_ids, run

    be = bundled.backend
    be.mode = mode
    ids = prompt_ids(bundled, PROMPTS[1])
    params = SamplerParams(temperature=0.7, seed=11, repeat_penalty=1.3, repeat_last_n=64)

    def turns(spec):
        torch.cuda.synchronize()
        with torch.inference_mode():   # (the engine's buffers are inference tensors)
            be.ctx_tokens.fill_(0)   # what an earlier conversation left
        torch.cuda.synchronize()
        reply = run(be, ids, GREEDY, 80, spec)
        n = len(be.kv_tokens)
        assert be.kv_tokens == ids + reply[:-1]
        assert be.ctx_tokens[:n].tolist() == be.kv_tokens
        if spec:
            assert be.spec_stats["verify_steps"] > 0 and be.spec_stats["accepted"] > 0
        follow = [e.token_id for c in be.generate_chunks([reply[-1]] + ids[-6:], params, 40)
                  for e in c]
        return reply, follow

    try:
        assert turns("ngram") == turns(None)
    finally:
        be.mode = "graph"


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_sampled_speculation_with_a_fixed_seed_is_reproducible(bundled, mode):
    """With sampling and a fixed seed a speculative reply does not depend on timing (how many
    steps a plain run had under way when the drafter matched): two runs give the same ids, and
    the cache invariant holds at every suspension."""
    from test_spec import PROMPTS, invariant, prompt_ids, run

    be = bundled.backend
    be.mode = mode
    ids = prompt_ids(bundled, PROMPTS[0])
    params = SamplerParams(temperature=0.9, seed=1234)
    try:
        outs = [run(be, ids, params, 120, "ngram", bundled.tokenizer.stop_ids,
                    check=invariant(be, ids)) for _ in range(3)]
        assert outs[0] == outs[1] == outs[2] and len(outs[0]) > 20
        assert be.spec_stats["verify_steps"] > 0
    finally:
        be.mode = "graph"


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_plain_run_halts_on_the_device_where_the_drafter_matches(bundled, mode):
    """A plain run with the n-gram watch (CudaBackend._plain_run, watch_n = 2) and a host side
    that never stops it: the device itself ends the run at the first id after which prompt
    lookup drafts (NgramDrafter.will_draft over the whole context), never at the turn's first
    id. Graph steps queued past it are gated off, so the run is exactly the plain reply up to
    there; eager steps already launched still run (about the run-ahead), and their ids are
    the plain reply's too. The cache is exact."""
    from test_spec import PROMPTS, prompt_ids, run

    from nanoqwen.engine.backends.cuda import SPEC_RUN_AHEAD
    from nanoqwen.engine.spec import NgramDrafter

    be = bundled.backend
    be.mode = mode
    try:
        for text in PROMPTS[:2]:
            ids = prompt_ids(bundled, text)
            plain = run(be, ids, GREEDY, 200, None)
            d = NgramDrafter(ids, min_n=2)
            j = None
            for i, t in enumerate(plain):
                d.extend([t])
                if i and d.will_draft():
                    j = i
                    break
            assert j is not None and j + 1 < len(plain)
            be.truncate(0)
            got = [e.token_id for c in be._plain_run(list(ids), GREEDY, 200, frozenset(), None,
                                                      lambda t: False, 0, 2, True) for e in c]
            if mode == "graph":
                assert got == plain[:j + 1]
            else:
                # launched before the launcher saw the halt: steps up to the host's last
                # taken id (<= j) + 1 + the run-ahead
                assert got == plain[:len(got)] and j + 1 <= len(got) <= j + 2 + SPEC_RUN_AHEAD[
                    "eager"]
            assert be.kv_tokens == ids + got[:-1] and be.cache.length == len(be.kv_tokens)
    finally:
        be.mode = "graph"


def test_a_plain_runs_watch_is_checked_before_anything_runs(bundled):
    """advance_step reads the watch's n from 8 bits (bit 8 is the first run's flag): a watch
    outside 0..255 is refused before the turn starts, and the cache is untouched."""
    be = bundled.backend
    be.truncate(0)
    before = list(be.kv_tokens)
    for bad in (-1, 256, 1000):
        with pytest.raises(ValueError, match=f"watch_n={bad}: the device watches 0..255 ids"):
            be._plain_run([5, 6, 7], GREEDY, 8, frozenset(), None, lambda t: False, 0, bad, True)
    assert be.kv_tokens == before and be.cache.length == len(before)
