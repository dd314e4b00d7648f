"""attention_prefill (csrc/attention_prefill.cu: the prefill's causal GQA attention over the paged
K/V cache, FlashAttention-2 style on tensor cores) against an fp64 reference, on fresh random
data: shuffled page tables, chunks from an empty cache and after a cached prefix (q0 > 0), odd
lengths and partial last pages (1, 15, 16, 17, 49, 100, 511, 1000, 2048 rows), head_dim 64 and
128, GQA 1/2/5/7/8; the rows a chunk does not own left alone, the caches unchanged, repeated
calls bitwise equal, bad arguments raising; and the engine's prefill with it against the same
prefill through SDPA (NANOQWEN_PREFILL_ATTN_MAX=0)."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PAGE = 16


def ops():
    return torch.ops.nanoqwen


def make(gen, nh, nkv, d, q0, T, spare_pages=3, q_scale=2.0):
    """A shuffled paged cache holding positions 0..q0+T-1 (plus spare pages never referenced),
    and q [T, nh, d] scaled so |q.k|/sqrt(d) reaches ~10: softmax is far from flat."""
    n_pos = q0 + T
    used = -(-n_pos // PAGE)
    num_pages = used + spare_pages
    table = torch.randperm(num_pages, generator=gen, device="cuda").int()[:used].contiguous()
    kc = torch.randn(num_pages, PAGE, nkv, d, generator=gen, device="cuda").half()
    vc = torch.randn(num_pages, PAGE, nkv, d, generator=gen, device="cuda").half()
    q = (q_scale * torch.randn(T, nh, d, generator=gen, device="cuda")).half()
    return q, kc, vc, table


def reference(q, kc, vc, table, q0):
    """fp64 causal attention: query i at position q0 + i over positions 0..q0 + i."""
    T, nh, d = q.shape
    nkv = kc.shape[2]
    n = q0 + T
    k = kc[table.long()].reshape(-1, nkv, d)[:n].double()          # [n, nkv, d]
    v = vc[table.long()].reshape(-1, nkv, d)[:n].double()
    g = nh // nkv
    k = k.repeat_interleave(g, dim=1).permute(1, 0, 2)              # [nh, n, d]
    v = v.repeat_interleave(g, dim=1).permute(1, 0, 2)
    s = torch.einsum("thd,hnd->htn", q.double(), k) / math.sqrt(d)   # [nh, T, n]
    pos = torch.arange(q0, n, device=q.device)[:, None]
    s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > pos, float("-inf"))
    o = torch.einsum("htn,hnd->thd", torch.softmax(s, -1), v)        # [T, nh, d]
    return o.reshape(T, nh * d)


def run(q, kc, vc, table, q0, pad=0):
    T, nh, d = q.shape
    buf = torch.full(((T + pad) * nh * d,), float("nan"), device="cuda").half()
    out = buf[:T * nh * d].view(T, nh * d)
    ops().attention_prefill(out, q, kc, vc, table, q0)
    return out, buf[T * nh * d:]


# (n_heads, n_kv, head_dim): 7B (28/4/128), 0.5B (14/2/64), 1.5B (12/2/128), 14B (40/8/128),
# 32B (40/8/128 too: ratio 5), a ratio of 8, and plain MHA
SHAPES = [(28, 4, 128), (14, 2, 64), (12, 2, 128), (40, 8, 128), (16, 2, 64), (4, 4, 64)]


@pytest.mark.parametrize("nh,nkv,d", SHAPES)
@pytest.mark.parametrize("q0,T", [(0, 1), (0, 15), (0, 16), (0, 17), (0, 100), (0, 511),
                                  (5, 49), (1000, 49), (16, 64), (33, 1)])
def test_matches_fp64_reference(gen, nh, nkv, d, q0, T):
    q, kc, vc, table = make(gen, nh, nkv, d, q0, T)
    kc0, vc0 = kc.clone(), vc.clone()
    out, tail = run(q, kc, vc, table, q0, pad=3)
    ref = reference(q, kc, vc, table, q0)
    err = (out.double() - ref).abs()
    # fp32 scores and softmax; P rounded to fp16 (2^-11 relative) before P V, fp32 sums, the
    # output rounded to fp16 (2^-11 relative of |o| <= max|v| ~ 4.5): 4e-3 absolute leaves
    # ~2x margin over the worst element seen with either rounding alone at these sizes
    assert torch.isfinite(out).all()
    assert err.max().item() < 4e-3, f"max abs error {err.max().item():.3g}"
    assert (err.norm() / ref.norm()).item() < 1.5e-3
    assert torch.isnan(tail).all()               # nothing past the chunk's rows
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)   # the caches are only read


@pytest.mark.parametrize("nh,nkv,d", [(28, 4, 128), (14, 2, 64)])
def test_long_chunk_after_a_prefix(gen, nh, nkv, d):
    """An engine-sized chunk (2048 rows) after 1000 cached positions: 48 key tiles a block."""
    q, kc, vc, table = make(gen, nh, nkv, d, 1000, 2048, q_scale=1.0)
    out, _ = run(q, kc, vc, table, 1000)
    ref = reference(q, kc, vc, table, 1000)
    err = (out.double() - ref).abs()
    assert err.max().item() < 4e-3 and (err.norm() / ref.norm()).item() < 1.5e-3


def test_repeatable_bitwise(gen):
    q, kc, vc, table = make(gen, 28, 4, 128, 37, 200)
    a, _ = run(q, kc, vc, table, 37)
    b, _ = run(q, kc, vc, table, 37)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_chunks_equal_one_call(gen):
    """Rows of a prompt computed in two chunks (the engine's chunking) equal the one-call rows:
    each row's result depends only on its own position and the cache, not on the chunk."""
    q, kc, vc, table = make(gen, 14, 2, 64, 0, 300)
    whole, _ = run(q, kc, vc, table, 0)
    first, _ = run(q[:128].contiguous(), kc, vc, table, 0)
    second, _ = run(q[128:].contiguous(), kc, vc, table, 128)
    # a row's key tiles and warp-local order are the same whichever block holds it only when
    # its block starts at the same multiple of 64 rows: 128 keeps the row tiles aligned
    assert torch.equal(torch.cat([first, second]).view(torch.int16), whole.view(torch.int16))


def test_rejects_bad_arguments(gen):
    q, kc, vc, table = make(gen, 28, 4, 128, 0, 20)
    out = torch.empty(20, 28 * 128, device="cuda").half()
    with pytest.raises(RuntimeError, match="not covered by the page table"):
        ops().attention_prefill(out, q, kc, vc, table[:1].contiguous(), 0)
    with pytest.raises(RuntimeError, match="not covered by the page table"):
        ops().attention_prefill(out, q, kc, vc, table, -1)
    with pytest.raises(RuntimeError, match="whole multiple of the cache's 4 kv heads"):
        q6 = q[:, :6].contiguous()
        ops().attention_prefill(torch.empty(20, 6 * 128, device="cuda").half(), q6, kc, vc,
                                table, 0)
    with pytest.raises(RuntimeError, match=r"out has shape \[20, 3583\], expected \[20, 3584\]"):
        ops().attention_prefill(torch.empty(20, 3583, device="cuda").half(), q, kc, vc, table, 0)
    with pytest.raises(RuntimeError, match="head_dim=96 is not supported"):
        k96 = torch.zeros(kc.shape[0], PAGE, 4, 96, device="cuda").half()
        ops().attention_prefill(out, q, k96, k96, table, 0)
    with pytest.raises(RuntimeError, match="q must be Half"):
        ops().attention_prefill(out, q.float(), kc, vc, table, 0)
    with pytest.raises(RuntimeError, match="page_table must be Int"):
        ops().attention_prefill(out, q, kc, vc, table.long(), 0)


def test_engine_prefill_matches_sdpa_path(monkeypatch):
    """The engine's prefill with the paged kernel (the default) against the same engine taking
    SDPA over gathered K/V (NANOQWEN_PREFILL_ATTN_MAX=0) on a synthetic 0.5B-shaped model: a
    prompt of three chunks' worth is not needed -- one 300-token prompt, then a 40-token next
    turn on top (q0 > 0). Logits within fp16 attention noise of each other, and the same
    cache contents (the K/V writes do not depend on the attention)."""
    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.config import ModelConfig

    cfg = ModelConfig.from_name("0.5b")
    ids = torch.randint(0, cfg.vocab_size, (340,), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, value in (("kernel", ""), ("sdpa", "0")):
        monkeypatch.setenv("NANOQWEN_PREFILL_ATTN_MAX", value)
        b = CudaBackend.synthetic(cfg, seed=0, max_context=512)
        first = b.forward(ids[:300].tolist())
        second = b.forward(ids[300:].tolist())
        out[name] = (first, second)
        del b   # its cache and buffers go before the next backend is made
    for a, s in zip(out["kernel"], out["sdpa"]):
        # both attentions round P and the output to fp16, at different points: through 24
        # layers that moves the logits by ~1e-3 of their norm; a wrong key, row or mask moves
        # them by O(0.1-1) of it
        assert torch.isfinite(a).all()
        assert ((a - s).norm() / s.norm()).item() < 1e-2
