"""attention_decode (RoPE + K/V write + split-K paged attention + in-kernel split merge, one
launch) against an fp32 PyTorch reference, on fresh random data: partial last pages, shuffled
page tables, head_dim 64 and 128, GQA 1/5/7/8, split counts 1..66, split-sizing policies (the
min_pps argument: the number of split slots written must follow it).
Also: the cache after the call equals rope_kv_write's (the prefill's op) bit for bit, the
per-kv-head counters are back to zero, repeated calls and a CUDA-graph replay are bitwise equal
to an eager call, pos beyond the table, a multi-step decode across a page boundary, and bad
shapes raising. (The unfused pair it replaced, rope_kv_write + paged_attention, is in
benchmarks/lab/ with its own test.) attention_verify (the verify step's T queries) against T
attention_decode calls, bit for bit: outputs and the cache."""

from __future__ import annotations

import math

import pytest
import torch

from nanoqwen.engine import rope
from nanoqwen.engine.switches import ATTN_MIN_PPS_DEFAULT

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PAGE = 16
MAX_CTX = 2048
THETA = 1_000_000.0
KERNELS = {"cpasync": 0, "tma": 1}  # csrc/kernels.h kAttnCpAsync, kAttnTma


@pytest.fixture(params=list(KERNELS.values()), ids=list(KERNELS))
def kernel(request):
    return request.param


def ops():
    return torch.ops.nanoqwen


def rope_tables(n_pos: int, d: int):
    """The engine's cos/sin tables [n_pos, d/2] (engine/rope.py), on the GPU."""
    cos, sin = rope.rope_tables(n_pos, d, THETA)
    return cos.cuda(), sin.cuda()


def rope_ref(x, c, s):
    """x [h, d] fp32 rotated by one position's cos/sin rows [d/2] (HF rotate_half)."""
    half = x.shape[-1] // 2
    c = torch.cat([c, c])[None]
    s = torch.cat([s, s])[None]
    return x * c + torch.cat([-x[:, half:], x[:, :half]], -1) * s


class Case:
    """One decode step's inputs: token at position pos over a shuffled paged cache."""

    def __init__(self, gen, d, nh, nkv, pos, num_pages, splits, min_pps=0, kernel=0):
        self.d, self.nh, self.nkv, self.pos0, self.splits = d, nh, nkv, pos, splits
        self.kernel = kernel
        self.min_pps = min_pps  # 0: the op's default (kDecMinPpsDefault)
        self.table = torch.randperm(num_pages, generator=gen, device="cuda").int()
        self.kc = torch.randn(num_pages, PAGE, nkv, d, generator=gen, device="cuda").half()
        self.vc = torch.randn(num_pages, PAGE, nkv, d, generator=gen, device="cuda").half()
        self.cos, self.sin = rope_tables(num_pages * PAGE, d)
        # q scaled so |q.k|/sqrt(d) reaches ~10: softmax is far from flat
        self.qkv = torch.randn(1, (nh + 2 * nkv) * d, generator=gen, device="cuda").half()
        self.qkv[:, :nh * d] *= 2
        self.pos = torch.tensor([pos], dtype=torch.int32, device="cuda")

    def ws(self):
        nan = float("nan")
        return (torch.full((self.nh, self.splits, self.d), nan, device="cuda"),
                torch.full((self.nh, self.splits, 2), nan, device="cuda"))

    def fused(self, kc=None, vc=None, counters=None, ws=None):
        kc = self.kc.clone() if kc is None else kc
        vc = self.vc.clone() if vc is None else vc
        counters = torch.zeros(self.nkv, dtype=torch.int32, device="cuda") if counters is None \
            else counters
        out = torch.full((self.nh, self.d), float("nan"), device="cuda").half()
        ops().attention_decode(out, *(self.ws() if ws is None else ws), counters, self.qkv, kc,
                               vc, self.cos, self.sin, self.table, self.pos, self.min_pps,
                               self.kernel)
        return out, kc, vc, counters

    def rope_cache(self):
        """The cache after rope_kv_write of this token (what prefill writes for a position)."""
        kc, vc = self.kc.clone(), self.vc.clone()
        q = torch.full((1, self.nh, self.d), float("nan"), device="cuda").half()
        ops().rope_kv_write(q, kc, vc, self.qkv, self.cos, self.sin, self.pos, self.table)
        return kc, vc

    def reference(self):
        """fp32: RoPE of q and k (rounded once to fp16, as the op stores them), the new k/v in
        slot pos, softmax attention over positions 0..min(pos, table end)."""
        nh, nkv, d = self.nh, self.nkv, self.d
        cap = self.table.numel() * PAGE
        p_tab = min(max(self.pos0, 0), cap - 1)
        x = self.qkv[0].float()
        q = rope_ref(x[:nh * d].view(nh, d), self.cos[p_tab], self.sin[p_tab]).half().float()
        kc, vc = self.kc.clone(), self.vc.clone()
        if 0 <= self.pos0 < cap:
            k = rope_ref(x[nh * d:(nh + nkv) * d].view(nkv, d), self.cos[p_tab], self.sin[p_tab])
            pg, sl = int(self.table[self.pos0 // PAGE]), self.pos0 % PAGE
            kc[pg, sl] = k.half()
            vc[pg, sl] = x[(nh + nkv) * d:].view(nkv, d).half()
        L = max(min(self.pos0 + 1, cap), 1)
        p = torch.arange(L, device="cuda")
        kk = kc[self.table[p // PAGE].long(), p % PAGE].float().repeat_interleave(nh // nkv, 1)
        vv = vc[self.table[p // PAGE].long(), p % PAGE].float().repeat_interleave(nh // nkv, 1)
        s = torch.einsum("hd,lhd->hl", q, kk) / math.sqrt(d)
        return torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vv), kc, vc


def check(case: Case):
    out, kc, vc, counters = case.fused()
    assert not out.isnan().any()
    ref, rkc, rvc = case.reference()
    # fp32 softmax/accumulation, output rounded once to fp16 (2^-11 relative); q/k rounded to
    # fp16 exactly where the reference rounds them
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)
    # the cache write is rope_kv_write's, bit for bit (same rotation, same rounding)
    pkc, pvc = case.rope_cache()
    assert torch.equal(kc, pkc) and torch.equal(vc, pvc)
    assert torch.equal(vc, rvc)
    torch.testing.assert_close(kc.float(), rkc.float(), rtol=1e-3, atol=2e-3)
    assert int(counters.abs().sum()) == 0  # every call leaves the counters zero
    return out


SHAPES = [(128, 28, 4), (64, 14, 2), (128, 40, 8), (128, 16, 2), (64, 8, 8)]  # GQA 7, 7, 5, 8, 1


@pytest.mark.parametrize("d,nh,nkv", SHAPES)
@pytest.mark.parametrize("L", [1, 15, 16, 17, 49, 1000, MAX_CTX])
@pytest.mark.parametrize("splits", [1, 7, 66])
def test_attention_decode(gen, kernel, d, nh, nkv, L, splits):
    check(Case(gen, d, nh, nkv, L - 1, MAX_CTX // PAGE, splits, kernel=kernel))


@pytest.mark.parametrize("min_pps", [0, 1, 2, 3, 64, 8192])
@pytest.mark.parametrize("L", [17, 49, 1000, MAX_CTX])
def test_split_sizing_policies(gen, kernel, min_pps, L):
    """The min_pps argument (minimum pages per split; 0 = the default, 8) changes only the
    summation order: every setting matches the references. And the kernel really used it:
    exactly the active splits write their ws_ml slot, n_active = ceil(pages / pps) with
    pps = max(ceil(pages / 66), min_pps), so the slots left NaN show the policy it ran."""
    c = Case(gen, 128, 28, 4, L - 1, MAX_CTX // PAGE, 66, min_pps, kernel)
    check(c)
    ws = c.ws()
    c.fused(ws=ws)
    pages = -(-L // PAGE)
    pps = max(-(-pages // 66), min_pps or ATTN_MIN_PPS_DEFAULT)
    n_active = -(-pages // pps)
    written = ~ws[1].isnan().any(-1)  # [nh, splits]
    assert written[:, :n_active].all() and not written[:, n_active:].any()


def test_min_pps_fixed_per_call_in_one_process(gen):
    """Policies switched between calls in one process (what bench_attention's sweep does):
    each call uses its own argument (the op keeps no per-process copy of it)."""
    c = Case(gen, 128, 28, 4, MAX_CTX - 1, MAX_CTX // PAGE, 66)
    # 128 pages: ceil(128 / 66) = 2 a split at min_pps 1 (64 active), 8 at the default (16)
    for min_pps, n_active in [(1, 64), (64, 2), (1, 64), (0, 128 // ATTN_MIN_PPS_DEFAULT)]:
        c.min_pps = min_pps
        ws = c.ws()
        c.fused(ws=ws)
        assert int((~ws[1].isnan().any(-1))[0].sum()) == n_active, min_pps


def test_repeat_and_graph_bitwise(gen, kernel):
    """Two eager calls and a CUDA-graph replay give the same bits (the merge order is fixed,
    whichever split block finishes last); the graph keeps the min_pps it was captured with."""
    c = Case(gen, 128, 28, 4, 777, MAX_CTX // PAGE, 66, min_pps=3, kernel=kernel)
    a, kc, vc, counters = c.fused()
    b, _, _, _ = c.fused(kc, vc, counters)  # same cache again: slot pos rewritten identically
    assert torch.equal(a, b)
    out = torch.empty_like(a)
    ws = c.ws()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            ops().attention_decode(out, *ws, counters, c.qkv, kc, vc, c.cos, c.sin, c.table, c.pos,
                                   c.min_pps, c.kernel)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, a)
    assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("beyond", [0, 5, 100])
def test_pos_beyond_table(gen, kernel, beyond):
    """pos at or past the table end: nothing is written, attention covers the whole table, q
    takes the tables' last row (as rope_kv_write)."""
    num_pages = 6
    c = Case(gen, 128, 28, 4, num_pages * PAGE + beyond, num_pages, 7, kernel=kernel)
    out = check(c)
    o2, kc, vc, _ = c.fused()
    assert torch.equal(kc, c.kc) and torch.equal(vc, c.vc)
    assert torch.equal(o2, out)


def test_stale_tail_ignored(gen, kernel):
    """Slots past pos on a partial last page hold garbage (even inf) that must not leak in."""
    c = Case(gen, 128, 28, 4, 16, 4, 8, kernel=kernel)  # L = 17: table[1] holds one live slot
    a, _, _, _ = c.fused()
    pg = int(c.table[1])
    c.kc[pg, 1:] = 1e4
    c.vc[pg, 1:] = float("inf")
    b, _, _, _ = c.fused()
    assert torch.equal(a, b)


@pytest.mark.parametrize("L", [8192 + 5, 32768])
@pytest.mark.parametrize("splits", [1, 66])
def test_long_contexts(gen, kernel, L, splits):
    """Up to the 7B's whole context (32768, a partial last page below it): one split streams
    all 2048 pages through the ring (the TMA kernel's 8 stages reused 256 times), 66 splits
    cut it as the engine does."""
    check(Case(gen, 128, 28, 4, L - 1, 32768 // PAGE, splits, kernel=kernel))


def test_decode_steps_across_page_boundary(gen, kernel):
    """Consecutive positions 13..34 on one cache and one counters tensor, as the engine runs
    it: every step matches the fp32 reference over the cache the earlier steps wrote, and the
    cache stays what rope_kv_write would have written."""
    nh, nkv, d = 28, 4, 128
    c = Case(gen, d, nh, nkv, 13, 8, 66, kernel=kernel)
    kc, vc = c.kc.clone(), c.vc.clone()
    counters = torch.zeros(nkv, dtype=torch.int32, device="cuda")
    for p in range(13, 35):
        c.pos.fill_(p)
        c.pos0 = p
        c.qkv.normal_(generator=gen)
        c.kc, c.vc = kc.clone(), vc.clone()
        ref, _, _ = c.reference()
        pkc, pvc = c.rope_cache()
        out, kc, vc, counters = c.fused(kc, vc, counters)
        # as check(): fp32 math, the output rounded once to fp16
        torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)
        assert torch.equal(kc, pkc) and torch.equal(vc, pvc)
        assert int(counters.abs().sum()) == 0


def verify_matches_decode(gen, kernel, d, nh, nkv, pos, T, pages, splits, min_pps=0):
    """attention_verify of T queries at pos.. on a random shuffled cache against T
    attention_decode calls at pos, pos + 1, .. (each writes its row before the next reads it):
    every query's output and the cache afterwards bit for bit, the counters back to zero.
    Returns whether all of it held (the sanitizer's script uses it too)."""
    table = torch.randperm(pages, generator=gen, device="cuda").int()
    kc = torch.randn(pages, PAGE, nkv, d, generator=gen, device="cuda").half()
    vc = torch.randn(pages, PAGE, nkv, d, generator=gen, device="cuda").half()
    cos, sin = rope_tables(pages * PAGE, d)
    qkv = torch.randn(T, (nh + 2 * nkv) * d, generator=gen, device="cuda").half()
    qkv[:, :nh * d] *= 2
    nan = float("nan")
    kd, vd, want = kc.clone(), vc.clone(), []
    for i in range(T):
        out = torch.full((nh, d), nan, device="cuda").half()
        ops().attention_decode(out, torch.full((nh, splits, d), nan, device="cuda"),
                               torch.full((nh, splits, 2), nan, device="cuda"),
                               torch.zeros(nkv, dtype=torch.int32, device="cuda"), qkv[i], kd, vd,
                               cos, sin, table,
                               torch.tensor([pos + i], dtype=torch.int32, device="cuda"),
                               min_pps, kernel)
        want.append(out)
    kv, vv = kc.clone(), vc.clone()
    out = torch.full((T, nh, d), nan, device="cuda").half()
    counters = torch.zeros(T, nkv, dtype=torch.int32, device="cuda")
    ops().attention_verify(out, torch.full((T, nh, splits, d), nan, device="cuda"),
                           torch.full((T, nh, splits, 2), nan, device="cuda"), counters, qkv, kv,
                           vv, cos, sin, table, torch.tensor([pos], dtype=torch.int32,
                                                             device="cuda"), min_pps, kernel)
    return (torch.equal(out, torch.stack(want)) and torch.equal(kv, kd) and torch.equal(vv, vd)
            and int(counters.abs().sum()) == 0)


# (pos, T, pages): inside a page, across one page boundary, across two (T = 16 from slot 15),
# from position 0, at the table's end and past it (positions beyond are neither written nor
# attended past the end), and a long context whose pages per split differ between the queries
# (7 splits: 63 pages make 9 a split, 64 make 10; positions 1000..1012 span both)
VERIFY_CASES = [(3, 4, 4), (14, 5, 4), (15, 16, 4), (0, 16, 2), (60, 4, 4), (61, 8, 4),
                (1000, 13, 66)]


@pytest.mark.parametrize("d,nh,nkv", SHAPES)
@pytest.mark.parametrize("pos,T,pages", VERIFY_CASES)
@pytest.mark.parametrize("splits", [1, 7])
def test_attention_verify_is_decode_steps(gen, kernel, d, nh, nkv, pos, T, pages, splits):
    """The verify step's attention computes each query's own K/V rows (and those of the step's
    earlier queries) itself and writes them once: bit-identical to decode steps, one at a time."""
    assert verify_matches_decode(gen, kernel, d, nh, nkv, pos, T, pages, splits)


def test_attention_verify_bad_arguments():
    dev = "cuda"
    kc = torch.zeros(2, PAGE, 4, 128, device=dev).half()
    cos, sin = rope_tables(2 * PAGE, 128)
    table = torch.arange(2, dtype=torch.int32, device=dev)
    pos = torch.zeros(1, dtype=torch.int32, device=dev)

    def call(T, nh=28, qkv_cols=None, counters=None):
        ops().attention_verify(
            torch.empty(T, nh, 128, device=dev).half(), torch.empty(T, nh, 2, 128, device=dev),
            torch.empty(T, nh, 2, 2, device=dev),
            torch.zeros(T, 4, dtype=torch.int32, device=dev) if counters is None else counters,
            torch.empty(T, qkv_cols or (nh + 8) * 128, device=dev).half(), kc, kc.clone(), cos,
            sin, table, pos)

    with pytest.raises(RuntimeError, match="out has 17 query rows, expected 1..16"):
        call(17)
    with pytest.raises(RuntimeError, match="qkv"):
        call(2, qkv_cols=35 * 128)
    with pytest.raises(RuntimeError, match="counters"):
        call(2, counters=torch.zeros(4, dtype=torch.int32, device=dev))


def test_bad_arguments_raise_with_numbers():
    d, nh, nkv = 128, 28, 4
    kc = torch.zeros(4, PAGE, nkv, d, device="cuda").half()
    cos = torch.zeros(64, d // 2, device="cuda")
    table = torch.zeros(4, dtype=torch.int32, device="cuda")
    pos = torch.zeros(1, dtype=torch.int32, device="cuda")

    def call(out=None, ws_acc=None, ws_ml=None, counters=None, qkv=None, k=kc, cs=cos, tab=table,
             min_pps=0, kernel=0):
        out = torch.empty(nh, d, device="cuda").half() if out is None else out
        ws_acc = torch.empty(nh, 3, d, device="cuda") if ws_acc is None else ws_acc
        ws_ml = torch.empty(nh, 3, 2, device="cuda") if ws_ml is None else ws_ml
        counters = torch.zeros(nkv, dtype=torch.int32, device="cuda") if counters is None \
            else counters
        qkv = torch.zeros(1, (nh + 2 * nkv) * d, device="cuda").half() if qkv is None else qkv
        ops().attention_decode(out, ws_acc, ws_ml, counters, qkv, k, k.clone(), cs, cs.clone(),
                               tab, pos, min_pps, kernel)

    call()  # the baseline is valid
    call(min_pps=8192)
    call(kernel=1)
    # the TMA kernel's tensor maps cover the table's pages: a larger cache is refused, not read
    with pytest.raises(RuntimeError, match=r"kernel=1 \(TMA\) needs a cache of exactly "
                                           r"page_table's 3 pages, got 4"):
        call(kernel=1, tab=table[:3].clone())
    call(kernel=0, tab=table[:3].clone())  # the cp.async kernel reads any page id of the cache
    for bad in (-1, 2, 2**31):
        with pytest.raises(RuntimeError, match=rf"kernel={bad} must be 0 \(cp.async split-K\) "
                                               r"or 1 \(TMA"):
            call(kernel=bad)
    for bad in (-1, 8193, 2**31):
        with pytest.raises(RuntimeError, match=rf"min_pps={bad} must be 0 \(the default, "
                                               rf"{ATTN_MIN_PPS_DEFAULT} KV pages per split\) "
                                               r"or 1 to 8192"):
            call(min_pps=bad)
    with pytest.raises(RuntimeError, match=r"qkv has 4607 elements, expected .* = 4608"):
        call(qkv=torch.zeros(4607, device="cuda").half())
    with pytest.raises(RuntimeError, match=r"counters has shape \[3\], expected \[4\]"):
        call(counters=torch.zeros(3, dtype=torch.int32, device="cuda"))
    with pytest.raises(RuntimeError, match=r"ws_ml has shape \[28, 2, 2\], expected \[28, 3, 2\]"):
        call(ws_ml=torch.empty(nh, 2, 2, device="cuda"))
    with pytest.raises(RuntimeError, match="n_heads=36 / n_kv_heads=4"):
        call(out=torch.empty(36, d, device="cuda").half(),
             ws_acc=torch.empty(36, 3, d, device="cuda"), ws_ml=torch.empty(36, 3, 2, device="cuda"),
             qkv=torch.zeros((36 + 8) * d, device="cuda").half())
    with pytest.raises(RuntimeError, match="head_dim=96 is not supported"):
        call(k=torch.zeros(4, PAGE, nkv, 96, device="cuda").half())
    with pytest.raises(RuntimeError, match="RoPE tables have 32 rows but the page table covers 64"):
        call(cs=torch.zeros(32, d // 2, device="cuda"))
    with pytest.raises(RuntimeError, match="counters must be Int"):
        call(counters=torch.zeros(nkv, dtype=torch.int64, device="cuda"))
