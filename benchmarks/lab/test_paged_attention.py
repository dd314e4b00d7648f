"""paged_attention (the lab's split + combine decode attention, attention_lab.cu) against an fp32
PyTorch reference: the tests that covered it in tests/gpu/test_kernels.py until it left csrc/.
Run on the GPU machine with `pytest benchmarks/lab -q` (builds the lab library, ~25 s); skipped
without CUDA. Not part of the README's test command (testpaths = tests)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab import load, ptr, stream  # noqa: E402

PAGE = 16
MAX_CTX = 2048


@pytest.fixture
def gen():
    seed = torch.randint(0, 2**31 - 1, (1,)).item()
    print(f"seed={seed}")
    return torch.Generator(device="cuda").manual_seed(seed)


def paged_attention(out, ws_acc, ws_ml, q, kc, vc, table, pos):
    nh, d = q.shape
    load().call("paged_attention", ptr(out), ptr(ws_acc), ptr(ws_ml), ptr(q), ptr(kc), ptr(vc),
                ptr(table), table.numel(), ptr(pos), nh, kc.shape[2], d, ws_acc.shape[1],
                1.0 / math.sqrt(d), stream())


def attention_ref(q, kc, vc, table, L):
    """q [nh, d]; positions 0..L-1 through the page table; fp32."""
    nh, d = q.shape
    nkv = kc.shape[2]
    p = torch.arange(L, device="cuda")
    k = kc[table[p // PAGE].long(), p % PAGE].float()            # [L, nkv, d]
    v = vc[table[p // PAGE].long(), p % PAGE].float()
    g = nh // nkv
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("hd,lhd->hl", q.float(), k) / math.sqrt(d)
    return torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("d,nh,nkv", [(128, 28, 4), (64, 14, 2), (128, 12, 2), (128, 40, 8),
                                      (128, 16, 2), (64, 8, 8)])
@pytest.mark.parametrize("L", [1, 15, 16, 17, 49, 1000, MAX_CTX])
def test_paged_attention(gen, d, nh, nkv, L):
    num_pages = MAX_CTX // PAGE
    table = torch.randperm(num_pages, generator=gen, device="cuda").int()
    kc = torch.randn(num_pages, PAGE, nkv, d, generator=gen, device="cuda").half()
    vc = torch.randn(num_pages, PAGE, nkv, d, generator=gen, device="cuda").half()
    # scores of a realistic spread (|q.k|/sqrt(d) up to ~10) so softmax is not flat
    q = (torch.randn(nh, d, generator=gen, device="cuda") * 2).half()
    pos = torch.tensor([L - 1], dtype=torch.int32, device="cuda")
    ref = attention_ref(q, kc, vc, table, L)
    for splits in (1, 7, 66):
        out = torch.full((nh, d), float("nan"), device="cuda").half()
        ws_acc = torch.full((nh, splits, d), float("nan"), device="cuda")
        ws_ml = torch.full((nh, splits, 2), float("nan"), device="cuda")
        paged_attention(out, ws_acc, ws_ml, q, kc, vc, table, pos)
        torch.cuda.synchronize()
        assert not out.isnan().any()
        # fp32 softmax/accumulation; the output is rounded once to fp16 (2^-11 relative)
        torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)


def test_paged_attention_stale_tail_ignored(gen):
    """Slots past the length on a partial last page hold garbage that must not leak in."""
    nh, nkv, d, L = 28, 4, 128, 17
    table = torch.arange(4, dtype=torch.int32, device="cuda")
    kc = torch.randn(4, PAGE, nkv, d, generator=gen, device="cuda").half()
    vc = torch.randn(4, PAGE, nkv, d, generator=gen, device="cuda").half()
    q = torch.randn(nh, d, generator=gen, device="cuda").half()
    pos = torch.tensor([L - 1], dtype=torch.int32, device="cuda")
    a = torch.empty(nh, d, device="cuda").half()
    ws = (torch.empty(nh, 8, d, device="cuda"), torch.empty(nh, 8, 2, device="cuda"))
    paged_attention(a, *ws, q, kc, vc, table, pos)
    kc[1, 1:] = 1e4  # positions 17.. (stale tail of page 1) and beyond
    vc[1, 1:] = float("inf")
    b = torch.empty_like(a)
    paged_attention(b, *ws, q, kc, vc, table, pos)
    torch.cuda.synchronize()
    assert torch.equal(a, b)


def test_paged_attention_bad_shape_fails_with_numbers():
    kc = torch.zeros(4, PAGE, 1, 128, device="cuda").half()
    out, q = torch.empty(9, 128, device="cuda").half(), torch.empty(9, 128, device="cuda").half()
    ws = torch.empty(9, 1, 128, device="cuda"), torch.empty(9, 1, 2, device="cuda")
    table, pos = torch.zeros(4, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int32,
                                                                             device="cuda")
    with pytest.raises(RuntimeError, match="n_heads=9 n_kv=1"):
        paged_attention(out, *ws, q, kc, kc, table, pos)
