"""The reference backend against transformers' Qwen2ForCausalLM, and the paged KV cache.

Both models hold the same weights (INT4 projections dequantized to fp32, fp16 tensors
upcast) and compute in fp32; they differ only in operation order (einsum vs matmul, where
the softmax scale is applied, fused vs separate bias adds). fp32 rounding of ~1e-7 per op
accumulated over a few layers gives absolute logit differences of ~1e-6 on logits of size
~1, so we allow 1e-4 absolute + 1e-4 relative: two orders of margin, yet a wrong RoPE
convention, mask or GQA mapping moves logits by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

from helpers import TINY_TIED, TINY_UNTIED, file_tensors, hf_model, random_weights
from nanoqwen.engine.backends.reference import ReferenceBackend
from nanoqwen.engine.config import KV_PAGE_SIZE
from nanoqwen.engine.errors import ContextFullError
from nanoqwen.engine.kv_cache import KVCache, OutOfPagesError, PageAllocator
from nanoqwen.engine.sampling import SamplerParams

ATOL = RTOL = 1e-4
CONFIGS = [pytest.param(TINY_UNTIED, id="untied-hd128"), pytest.param(TINY_TIED, id="tied-hd64")]


@pytest.fixture(scope="module", params=CONFIGS)
def pair(request):
    """(config, our backend factory, transformers model) over the same weights."""
    cfg = request.param
    tensors = file_tensors(cfg, random_weights(cfg, seed=1))
    return cfg, (lambda **kw: ReferenceBackend(cfg, tensors, **kw)), hf_model(cfg, tensors)


def _prompt(cfg, n, seed=0):
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_and_decode_logits_match_transformers(pair):
    cfg, make, hf = pair
    ids = _prompt(cfg, 21)   # 21: the prefill spans a full page and a partial second one
    be = make()
    ours = be.forward_all(ids[:13])                                      # [13, V] prefill
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]                          # [21, V]
    torch.testing.assert_close(ours, ref[:13], atol=ATOL, rtol=RTOL)
    for i in range(13, 21):                                              # decode, one by one
        torch.testing.assert_close(be.forward([ids[i]]), ref[i], atol=ATOL, rtol=RTOL)
    assert be.kv_tokens == ids and be.cache.length == 21


def test_greedy_64_tokens_match_transformers_across_pages(pair):
    cfg, make, hf = pair
    prompt = _prompt(cfg, 13, seed=2)      # 13 + 64 = 77 = 4 full pages + 13 on the fifth
    be = make()
    steps = list(be.generate(prompt, SamplerParams.greedy_params(), 64))
    ours = [s.token_id for s in steps]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == out[0, 13:].tolist()
    assert len(be.kv_tokens) == 13 + 63 and be.kv_tokens == prompt + ours[:-1]
    assert len(be.cache.page_table) == 5 and (13 + 63) % KV_PAGE_SIZE != 0
    assert steps[0].first and not any(s.first for s in steps[1:])


def test_truncate_and_refill_gives_the_same_logits(pair):
    cfg, make, _ = pair
    ids = _prompt(cfg, 40, seed=3)
    be = make()
    full = be.forward_all(ids)
    be.truncate(17)                         # back into the middle of the second page
    assert len(be.cache.page_table) == 2 and be.kv_tokens == ids[:17]
    torch.testing.assert_close(be.forward_all(ids[17:]), full[17:], atol=ATOL, rtol=RTOL)


def test_failed_forward_leaves_cache_consistent(pair):
    cfg, make, _ = pair
    be = make(max_context=32)
    be.forward(_prompt(cfg, 20))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        be.forward([1, cfg.vocab_size])
    with pytest.raises(ContextFullError, match="need 33 positions; the context holds 32"):
        be.forward([1] * 13)
    # an exception inside the model (not a checked argument) releases the pages it took
    layer0 = be.layers[0]
    w = layer0.w["mlp.down_proj"]
    layer0.w["mlp.down_proj"] = w[:, :-1]
    with pytest.raises(RuntimeError):
        be.forward([1] * 12)
    layer0.w["mlp.down_proj"] = w
    assert len(be.kv_tokens) == be.cache.length == 20 and len(be.cache.page_table) == 2


def test_generate_checks_context_before_anything():
    be = ReferenceBackend(TINY_UNTIED, file_tensors(TINY_UNTIED, random_weights(TINY_UNTIED)),
                          max_context=16)
    with pytest.raises(ContextFullError, match="17 positions; the context holds 16"):
        be.generate(list(range(3, 20)), SamplerParams.greedy_params(), 5)
    assert be.kv_tokens == [] and be.cache.page_table == []
    # a prompt that fits stops with the cache full: 15 + 1 forwarded, 2 sampled
    steps = list(be.generate(list(range(3, 18)), SamplerParams.greedy_params(), 100))
    assert len(steps) == 2 and len(be.kv_tokens) == 16


# --- KV cache -------------------------------------------------------------------------------

def test_allocator_hands_out_lowest_first_and_errors_when_empty():
    a = PageAllocator(3)
    assert [a.alloc(), a.alloc(), a.alloc()] == [0, 1, 2]
    with pytest.raises(OutOfPagesError, match="all 3 pages .48 tokens. are in use"):
        a.alloc()
    a.free(1)
    assert a.alloc() == 1
    with pytest.raises(ValueError, match="freed twice"):
        a.free(0), a.free(0)


def test_kv_cache_layout_write_gather_truncate():
    c = KVCache(num_layers=2, n_kv_heads=2, head_dim=64, max_tokens=40)
    assert c.k.shape == (2, 3, KV_PAGE_SIZE, 2, 64) and c.capacity == 48
    k = torch.randn(35, 2, 64)
    v = torch.randn(35, 2, 64)
    c.reserve(35)
    c.write(1, 0, k, v)
    c.length = 35
    assert c.page_table == [0, 1, 2]
    # the documented layout: position p is at [layer, page_table[p // 16], p % 16]
    assert torch.equal(c.k[1, c.page_table[20 // 16], 20 % 16], k[20])
    gk, gv = c.gather(1, 35)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    c.truncate(16)                            # exactly one full page left
    assert c.page_table == [0] and c.allocator.num_free == 2
    # re-extend: pages come back from the free list; the gather follows the page table
    c.reserve(20)
    c.write(1, 16, k[16:20] * 2, v[16:20] * 2)
    c.length = 20
    gk, _ = c.gather(1, 20)
    assert torch.equal(gk[:16], k[:16]) and torch.equal(gk[16:], k[16:20] * 2)
    c.truncate(0)
    assert c.page_table == [] and c.allocator.num_free == 3


def test_kv_cache_reserve_is_all_or_nothing():
    c = KVCache(1, 1, 64, max_tokens=32)
    c.reserve(20)
    with pytest.raises(OutOfPagesError, match="40 tokens need 3 KV pages, the cache has 2"):
        c.reserve(40)
    assert c.page_table == [0, 1] and c.allocator.num_free == 0
    with pytest.raises(ValueError, match="truncate.5.: the cache holds 0"):
        c.truncate(5)


def test_kv_dtype_is_configurable():
    be = ReferenceBackend(TINY_TIED, file_tensors(TINY_TIED, random_weights(TINY_TIED)),
                          max_context=64, kv_dtype=torch.float16)
    assert be.cache.k.dtype == torch.float16 and be.max_context == 64
    assert be.forward([5, 6, 7]).dtype == torch.float32
