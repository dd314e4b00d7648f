"""embed_gather, rmsnorm, silu_mul, rope_kv_write, sample_token and advance_step against an fp32 PyTorch
reference, on fresh random data with awkward sizes (odd T, shuffled page tables, GQA ratios 5-8,
head_dim 64 and 128), plus the argument checks. Tolerances are written beside each comparison
with their reason. The GEMVs and dequant_int4: test_gemv.py; attention_decode:
test_attention_fused.py; the sampler's cluster: test_sampler_cluster.py."""

from __future__ import annotations

import pytest
import torch

from nanoqwen.engine import rope

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PAGE = 16


def ops():
    return torch.ops.nanoqwen


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# ---- embedding / norm -------------------------------------------------------------------------

@pytest.mark.parametrize("T,H,V", [(1, 896, 1000), (7, 3584, 5003), (33, 256, 512)])
def test_embed_gather(gen, T, H, V):
    table = torch.randn(V, H, generator=gen, device="cuda").half()
    ids = torch.randint(0, V, (T,), generator=gen, device="cuda", dtype=torch.int32)
    out = torch.full((T, H), float("nan"), device="cuda")
    ops().embed_gather(out, table, ids)
    assert torch.equal(out, table[ids.long()].float())  # a gather + exact fp16->fp32 widening


@pytest.mark.parametrize("T,H", [(1, 896), (5, 3584), (3, 5120), (17, 128)])
def test_rmsnorm(gen, T, H):
    x = torch.randn(T, H, generator=gen, device="cuda") * 3
    w = (1 + 0.1 * torch.randn(H, generator=gen, device="cuda")).half()
    out = torch.full((T, H), float("nan"), device="cuda").half()
    ops().rmsnorm(out, x, w, 1e-6)
    ref = w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    # fp32 math, then one rounding to fp16: half an fp16 ulp is 2^-11 relative
    torch.testing.assert_close(out.float(), ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("T,I", [(1, 4864), (15, 18944), (17, 8), (511, 8960)])
def test_silu_mul(gen, T, I):
    """The fp16 prefill's SiLU*mul: out [T, I] from the gate/up GEMM's rows gu [T, 2I]."""
    gu = (3 * torch.randn(T, 2 * I, generator=gen, device="cuda")).half()
    buf = torch.full((T * I + 64,), float("nan"), device="cuda").half()
    out = buf[:T * I].view(T, I)
    ops().silu_mul(out, gu)
    g, u = gu[:, :I].double(), gu[:, I:].double()
    ref = torch.nn.functional.silu(g) * u
    # fp32 math on exact fp16 inputs (__expf: a few fp32 ulps, ~1e-6 relative at |g| <= 15),
    # then one rounding to fp16: half an fp16 ulp is 2^-11 relative; atol for results rounded
    # into fp16's subnormals (steps of 6e-8)
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-7)
    assert torch.isnan(buf[T * I:]).all()   # nothing written past the T x I outputs


def test_silu_mul_rejects_bad_arguments(gen):
    gu = torch.randn(4, 32, generator=gen, device="cuda").half()
    with pytest.raises(RuntimeError, match="it must be 2I with I a multiple of 8"):
        ops().silu_mul(torch.empty(4, 12, device="cuda").half(), gu[:, :24].contiguous())
    with pytest.raises(RuntimeError, match=r"out has shape \[4, 8\], expected \[4, 16\]"):
        ops().silu_mul(torch.empty(4, 8, device="cuda").half(), gu)
    with pytest.raises(RuntimeError, match="gu must be Half"):
        ops().silu_mul(torch.empty(4, 16, device="cuda").half(), gu.float())
    off = torch.empty(4 * 32 + 1, device="cuda").half()[1:].view(4, 32)   # 2 bytes off 16
    with pytest.raises(RuntimeError, match="must be 16-byte aligned"):
        ops().silu_mul(torch.empty(4, 16, device="cuda").half(), off)


# ---- RoPE + KV write --------------------------------------------------------------------------

def rope_tables(n_pos: int, d: int, theta: float):
    """The engine's cos/sin tables [n_pos, d/2] (engine/rope.py), on the GPU."""
    cos, sin = rope.rope_tables(n_pos, d, theta)
    return cos.cuda(), sin.cuda()


def apply_rope_ref(x, cos, sin):  # x [T, h, d] fp32, cos/sin [T, d/2]
    c = torch.cat([cos, cos], -1)[:, None, :]
    s = torch.cat([sin, sin], -1)[:, None, :]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * c + rot * s


@pytest.mark.parametrize("nh,nkv,d,T,pos0", [(28, 4, 128, 1, 0), (28, 4, 128, 1, 49),
                                              (14, 2, 64, 19, 13), (40, 8, 128, 33, 1000),
                                              (12, 2, 128, 5, 15)])
def test_rope_kv_write(gen, nh, nkv, d, T, pos0):
    num_pages = 80
    table = torch.randperm(num_pages, generator=gen, device="cuda").int()  # pages out of order
    cos, sin = rope_tables(num_pages * PAGE, d, 1_000_000.0)
    qkv = torch.randn(T, (nh + 2 * nkv) * d, generator=gen, device="cuda").half()
    kc = torch.full((num_pages, PAGE, nkv, d), 7.0, device="cuda").half()  # poison
    vc = kc.clone()
    q = torch.full((T, nh, d), float("nan"), device="cuda").half()
    pos = torch.tensor([pos0], dtype=torch.int32, device="cuda")
    ops().rope_kv_write(q, kc, vc, qkv, cos, sin, pos, table)
    x = qkv.float()
    qr = x[:, :nh * d].view(T, nh, d)
    kr = x[:, nh * d:(nh + nkv) * d].view(T, nkv, d)
    vr = x[:, (nh + nkv) * d:].view(T, nkv, d)
    p = torch.arange(pos0, pos0 + T, device="cuda")
    # fp32 rotation of fp16 inputs, one rounding to fp16 (2^-11 relative) on |x| up to ~5
    torch.testing.assert_close(q.float(), apply_rope_ref(qr, cos[p], sin[p]), rtol=1e-3, atol=2e-3)
    pages, slots = table[p // PAGE].long(), p % PAGE
    torch.testing.assert_close(kc[pages, slots].float(), apply_rope_ref(kr, cos[p], sin[p]),
                               rtol=1e-3, atol=2e-3)
    assert torch.equal(vc[pages, slots], vr.half())          # V is copied, not rounded again
    written = torch.zeros(num_pages, PAGE, dtype=torch.bool, device="cuda")
    written[pages, slots] = True
    assert bool((kc[~written] == 7.0).all()) and bool((vc[~written] == 7.0).all())


# ---- sampling -------------------------------------------------------------------------------------

def sampler_state(params, seed, V, ctx_ids):
    from nanoqwen.engine.ops import sampler_tensors

    pf, pi = sampler_tensors(params, seed, "cuda")
    ctx = torch.zeros(4096, dtype=torch.int32, device="cuda")
    ctx[:len(ctx_ids)] = torch.tensor(ctx_ids, dtype=torch.int32)
    pos = torch.tensor([len(ctx_ids) - 1], dtype=torch.int32, device="cuda")
    return pf, pi, ctx, pos


def draw(logits, pf, pi, ctx, pos, counter_value):
    out = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    work = torch.empty_like(logits)
    counter = torch.tensor([counter_value], dtype=torch.int64, device="cuda")
    ops().sample_token(out, work, logits, ctx, pos, pf, pi, counter)
    return int(out)


@pytest.mark.parametrize("V", [152064, 151936, 1000, 5])
def test_sample_greedy_and_ties(gen, V):
    from nanoqwen.engine.sampling import SamplerParams

    logits = torch.randn(V, generator=gen, device="cuda")
    params = SamplerParams.greedy_params()
    pf, pi, ctx, pos = sampler_state(params, 0, V, [0])
    assert draw(logits, pf, pi, ctx, pos, 0) == int(torch.argmax(logits.cpu()))
    hi = float(logits.max()) + 1
    logits[V - 1] = hi
    logits[V // 2] = hi  # a tie: the lowest id wins
    assert draw(logits, pf, pi, ctx, pos, 0) == V // 2


def test_sample_repeat_penalty(gen):
    from nanoqwen.engine.sampling import SamplerParams, apply_repeat_penalty

    V = 152064
    logits = torch.randn(V, generator=gen, device="cuda")
    top = torch.topk(logits, 5).indices.tolist()
    logits[top[0]] = -abs(float(logits[top[0]]))  # a negative logit, penalised by multiplying
    history = [top[0], top[1], top[2], top[1], top[3], 17] * 20  # duplicates penalised once
    for last_n in (64, 3, -1, 0):
        params = SamplerParams(temperature=0.0, repeat_penalty=1.7, repeat_last_n=last_n)
        pf, pi, ctx, pos = sampler_state(params, 0, V, history)
        ref = apply_repeat_penalty(logits.cpu(), history, 1.7, last_n)
        assert draw(logits, pf, pi, ctx, pos, 0) == int(torch.argmax(ref))


@pytest.mark.parametrize("kw", [dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
                                dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
                                dict(temperature=1.5, top_k=20, top_p=1.0, min_p=0.0),
                                dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.1),
                                dict(temperature=1.0, top_k=1, top_p=0.5, min_p=0.0)])
def test_sample_distribution(gen, kw):
    """Every draw lies in the reference sampler's candidate set, draws are a deterministic
    function of the counter, and the frequencies match the reference probabilities."""
    from nanoqwen.engine.sampling import SamplerParams, _candidates

    V = 152064
    # a peaked distribution like a real model's: ~98% of the mass on a few dozen tokens, so
    # 3000 draws estimate every kept token's probability (a flat 152k-way one could not)
    logits = torch.randn(V, generator=gen, device="cuda") * 2
    logits[:50] += 14
    params = SamplerParams(**kw)
    vals, ids = _candidates(logits.cpu(), params)
    probs = torch.softmax(vals / params.temperature, 0)
    ref = dict(zip(ids.tolist(), probs.tolist()))
    pf, pi, ctx, pos = sampler_state(params, 1234, V, [1, 2, 3])
    n = 3000
    counts: dict[int, int] = {}
    for i in range(n):
        t = draw(logits, pf, pi, ctx, pos, i)
        assert t in ref, f"token {t} outside the candidate set (size {len(ref)})"
        counts[t] = counts.get(t, 0) + 1
    assert draw(logits, pf, pi, ctx, pos, 5) == draw(logits, pf, pi, ctx, pos, 5)
    tv = 0.5 * sum(abs(counts.get(t, 0) / n - p) for t, p in ref.items())
    # total variation of 3000 draws from <= 50 outcomes: sampling noise is ~0.05
    assert tv < 0.1, tv


def test_sample_top_k_keeps_every_tie(gen):
    """top-k keeps every token tied at the k-th value: with all logits equal, top_k=40 keeps
    the whole vocabulary, and the kernel must draw uniformly over all 152064 ids (every
    block's slice)."""
    from nanoqwen.engine.sampling import SamplerParams

    V = 152064
    logits = torch.zeros(V, device="cuda")
    params = SamplerParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0)
    pf, pi, ctx, pos = sampler_state(params, 99, V, [1])
    draws = [draw(logits, pf, pi, ctx, pos, i) for i in range(300)]
    assert all(0 <= t < V for t in draws)
    # 300 uniform draws over 152064 ids: a repeat is unlikely (expected ~0.3 pairs); a path
    # that wrongly kept only 40 tokens would repeat ~1000 times
    assert len(set(draws)) >= 295, len(set(draws))
    assert max(draws) > 1024 * 40  # ids far beyond any 40-token (or 1024-token) prefix


def test_advance_step():
    """The end of a step: next input, position, context id, the pinned ring slot {id, seq =
    counter + 1, GPU time} and the halt flag, which only a stop id sets."""
    token_in = torch.zeros(1, dtype=torch.int32, device="cuda")
    pos = torch.tensor([41], dtype=torch.int32, device="cuda")
    ctx = torch.zeros(64, dtype=torch.int32, device="cuda")
    counter = torch.tensor([9], dtype=torch.int64, device="cuda")
    ring = torch.full((8, 4), -1, dtype=torch.int32).pin_memory()
    halt = torch.zeros(1, dtype=torch.int32).pin_memory()
    stops = torch.zeros(9, dtype=torch.int32, device="cuda")
    stops[:3] = torch.tensor([2, 5, 778])              # two stop ids, 777 is not one
    sampled = torch.tensor([777], dtype=torch.int32, device="cuda")
    ops().advance_step(token_in, pos, ctx, counter, ring, sampled, stops, halt)
    torch.cuda.synchronize()
    assert int(token_in) == 777 and int(pos) == 42 and int(ctx[42]) == 777
    slot = ring[9 % 8]
    assert int(counter) == 10 and int(slot[0]) == 777 and int(slot[1]) == 10
    t0 = (int(slot[2]) & 0xFFFFFFFF) | (int(slot[3]) << 32)
    assert t0 > 0 and int(halt) == 0
    sampled.fill_(778)                                  # a stop id: halt is set
    ops().advance_step(token_in, pos, ctx, counter, ring, sampled, stops, halt)
    torch.cuda.synchronize()
    slot = ring[10 % 8]
    t1 = (int(slot[2]) & 0xFFFFFFFF) | (int(slot[3]) << 32)
    assert int(slot[0]) == 778 and int(slot[1]) == 11 and int(halt) == 1 and t1 >= t0

    # the n-gram watch is off without params_i and with params_i[3] == 0
    pi = torch.zeros(4, dtype=torch.int64, device="cuda")
    halt.zero_()
    sampled.fill_(777)
    ops().advance_step(token_in, pos, ctx, counter, ring, sampled, stops, halt, pi)
    torch.cuda.synchronize()
    assert int(halt) == 0 and int(ctx[44]) == 777      # 777 at 42 before it: no watch, no halt

    with pytest.raises(RuntimeError, match="host_ring must be a pinned CPU tensor"):
        z = torch.zeros(1, dtype=torch.int32, device="cuda")
        ops().advance_step(z, z.clone(), torch.zeros(8, dtype=torch.int32, device="cuda"),
                           torch.zeros(1, dtype=torch.int64, device="cuda"),
                           torch.zeros(4, 4, dtype=torch.int32), z.clone(),
                           torch.zeros(9, dtype=torch.int32, device="cuda"),
                           torch.zeros(1, dtype=torch.int32).pin_memory())


@pytest.mark.parametrize("n,vocab,length", [(1, 400, 300), (2, 12, 300), (3, 5, 300),
                                            (2, 50000, 5000)])
def test_advance_step_watches_for_a_repeated_ngram(n, vocab, length):
    """advance_step's n-gram watch (params_i[3] = n; speculation's plain runs): it sets halt
    exactly where prompt lookup would draft -- NgramDrafter(min_n=n).will_draft() over the ids so
    far -- at every position of fresh random sequences (small vocabularies repeat often; a
    5000-id context with a 50000-id vocabulary has its rare matches anywhere in the strided
    scan). Bit 8 skips draw 0 (counter == 0)."""
    from nanoqwen.engine.spec import NgramDrafter

    gen = torch.Generator().manual_seed(n * 1000 + vocab)
    seq = torch.randint(0, vocab, (length,), generator=gen)
    if vocab > 1000:   # a few far repeats: the last n ids of position p copied from far back
        for p, q in [(4000, 10), (4500, 3000), (4999, 1)]:
            seq[p - n + 1:p + 1] = seq[q - n + 1:q + 1]
    ctx = torch.full((length + 8,), -1, dtype=torch.int32, device="cuda")
    ctx[:length] = seq.to(torch.int32).cuda()
    token_in = torch.zeros(1, dtype=torch.int32, device="cuda")
    pos = torch.zeros(1, dtype=torch.int32, device="cuda")
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    sampled = torch.zeros(1, dtype=torch.int32, device="cuda")
    ring = torch.zeros((8, 4), dtype=torch.int32).pin_memory()
    halt = torch.zeros(1, dtype=torch.int32).pin_memory()
    stops = torch.zeros(9, dtype=torch.int32, device="cuda")
    pi = torch.tensor([0, 0, 0, n], dtype=torch.int64, device="cuda")
    d = NgramDrafter(seq[:1].tolist(), min_n=n, max_n=n)
    positions = range(1, length) if length <= 300 else [*range(1, 40), 4000, 4001, 4500, 4999]
    want, got = [], []
    for p in positions:
        if p > len(d.tokens):
            d = NgramDrafter(seq[:p].tolist(), min_n=n, max_n=n)
        d.extend([int(seq[p])])
        pos.fill_(p - 1)
        counter.fill_(5)
        sampled.fill_(int(seq[p]))
        halt.zero_()
        ops().advance_step(token_in, pos, ctx, counter, ring, sampled, stops, halt, pi)
        torch.cuda.synchronize()
        want.append(d.will_draft())
        got.append(bool(int(halt)))
    assert got == want and True in want and False in want
    # bit 8: never at draw 0, as usual after it
    p = next(p for p, w in zip(positions, want) if w)
    for c, halts in [(0, False), (1, True)]:
        pos.fill_(p - 1)
        counter.fill_(c)
        sampled.fill_(int(seq[p]))
        halt.zero_()
        ops().advance_step(token_in, pos, ctx, counter, ring, sampled, stops, halt,
                           torch.tensor([0, 0, 0, n | 256], dtype=torch.int64, device="cuda"))
        torch.cuda.synchronize()
        assert bool(int(halt)) is halts
