"""The decode step's folded RMSNorm (NANOQWEN_NORM_FOLD, csrc/common.cuh): embed_gather and the
residual GEMVs write each row's sum of squares in parts of 16 entries, and the qkv and gate/up
GEMVs form the normed x themselves from those parts. What must hold, on fresh random data at the
family's hidden sizes:
  * the parts are exactly common.cuh's order, replayed here in torch with fp32 (every step of
    it an IEEE-rounded multiply or add, so the replay is bit for bit);
  * gemv_int4_norm / gemv_int4_silu_mul_norm equal rmsnorm() followed by gemv_int4 /
    gemv_int4_silu_mul bit for bit (rmsnorm sums in the same order), so a verify step (rmsnorm
    launches) sees a decode step's numbers;
  * rmsnorm stays within its fp32 reference's tolerance (test_kernels.py) in that order;
  * the decode step with the fold on and off gives identical logits and tokens (engine level:
    test_cuda_backend.py::test_norm_fold_switch_changes_no_bit);
  * bad arguments raise with the numbers.
"""

from __future__ import annotations

import pytest
import torch

from test_gemv import rand_int4

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (H, I, q/k/v rows) of the family: 0.5B, 1.5B, 3B, 7B, 14B / 32B (H 5120)
SHAPES = [(896, 4864, 1152), (1536, 8960, 2048), (2048, 11008, 2560), (3584, 18944, 4608),
          (5120, 13824, 7168)]
EPS = 1e-6


def ops():
    return torch.ops.nanoqwen


def parts_ref(h: torch.Tensor) -> torch.Tensor:
    """common.cuh's parts of the rows of h [T, H] fp32: per 16 entries s_i = h_i^2, then
    a_i = s_i + s_{i+8}, b_i = a_i + a_{i+4}, c_i = b_i + b_{i+2}, part = c_0 + c_1."""
    s = (h * h).view(h.shape[0], -1, 16)
    s = s[..., :8] + s[..., 8:]
    s = s[..., :4] + s[..., 4:]
    s = s[..., :2] + s[..., 2:]
    return s[..., 0] + s[..., 1]


def hidden_like(H, gen, T=1):
    """A residual row with the scale spread of a real one: most entries O(1), a few massive
    activations (|h| in the hundreds, as Qwen2's residual stream has)."""
    h = torch.randn(T, H, generator=gen, device="cuda") * 2
    idx = torch.randint(0, H, (T, 4), generator=gen, device="cuda")
    h.scatter_(1, idx, 300 * torch.randn(T, 4, generator=gen, device="cuda"))
    return h


@pytest.mark.parametrize("H", [s[0] for s in SHAPES] + [128])
def test_embed_gather_parts_are_the_order(gen, H):
    V, T = 1000, 3
    table = (torch.randn(V, H, generator=gen, device="cuda") * 4).half()
    ids = torch.randint(0, V, (T,), generator=gen, device="cuda", dtype=torch.int32)
    hidden = torch.full((T, H), float("nan"), device="cuda")
    parts = torch.full((T, H // 16), float("nan"), device="cuda")
    ops().embed_gather(hidden, table, ids, parts)
    assert torch.equal(hidden, table[ids.long()].float())
    assert torch.equal(parts, parts_ref(hidden))


@pytest.mark.parametrize("H,I,_qkv", SHAPES)
def test_residual_parts_are_the_order(gen, H, I, _qkv):
    for k in (H, I):  # o_proj (k = q size = H) and down_proj (k = I): the table's two instances
        qw, sc, _ = rand_int4(H, k, gen)
        x = torch.randn(k, generator=gen, device="cuda").half()
        h0 = hidden_like(H, gen)[0]
        want = h0.clone()
        ops().gemv_int4_residual(want, x, qw, sc)  # the plain op: the same adds
        got = h0.clone()
        parts = torch.full((H // 16,), float("nan"), device="cuda")
        ops().gemv_int4_residual(got, x, qw, sc, parts)
        assert torch.equal(got, want)
        assert torch.equal(parts, parts_ref(got[None])[0])


@pytest.mark.parametrize("H,I,qkv_n", SHAPES)
def test_folded_norm_gemvs_equal_rmsnorm_then_gemv(gen, H, I, qkv_n):
    h = hidden_like(H, gen)
    parts = parts_ref(h)[0].contiguous()
    ln1 = (1 + 0.2 * torch.randn(H, generator=gen, device="cuda")).half()
    ln2 = (1 + 0.2 * torch.randn(H, generator=gen, device="cuda")).half()
    xn = torch.empty(1, H, device="cuda").half()

    qw, sc, _ = rand_int4(qkv_n, H, gen)
    bias = torch.randn(qkv_n, generator=gen, device="cuda").half()
    ops().rmsnorm(xn, h, ln1, EPS)
    want = torch.full((qkv_n,), float("nan"), device="cuda").half()
    ops().gemv_int4(want, xn[0], qw, sc, bias)
    got = torch.full((qkv_n,), float("nan"), device="cuda").half()
    ops().gemv_int4_norm(got, h[0], parts, ln1, EPS, qw, sc, bias)
    assert torch.equal(got, want)

    gq, gs, _ = rand_int4(I, H, gen)
    uq, us, _ = rand_int4(I, H, gen)
    ops().rmsnorm(xn, h, ln2, EPS)
    want = torch.full((I,), float("nan"), device="cuda").half()
    ops().gemv_int4_silu_mul(want, xn[0], gq, gs, uq, us)
    got = torch.full((I,), float("nan"), device="cuda").half()
    ops().gemv_int4_silu_mul_norm(got, h[0], parts, ln2, EPS, gq, gs, uq, us)
    assert torch.equal(got, want)


def test_rmsnorm_rows_are_independent_of_the_chunk(gen):
    """A row normed alone (the decode step's T = 1) and inside a prefill chunk is the same."""
    H = 3584
    h = hidden_like(H, gen, T=9)
    w = (1 + 0.2 * torch.randn(H, generator=gen, device="cuda")).half()
    all_rows = torch.empty(9, H, device="cuda").half()
    ops().rmsnorm(all_rows, h, w, EPS)
    one = torch.empty(1, H, device="cuda").half()
    for t in (0, 4, 8):
        ops().rmsnorm(one, h[t:t + 1].contiguous(), w, EPS)
        assert torch.equal(one[0], all_rows[t])


def test_folded_norm_ops_reject_bad_arguments(gen):
    H, n = 896, 1152
    qw, sc, _ = rand_int4(n, H, gen)
    h = torch.randn(H, device="cuda")
    parts = parts_ref(h[None])[0].contiguous()
    ln = torch.ones(H, device="cuda").half()
    y = torch.empty(n, device="cuda").half()
    with pytest.raises(RuntimeError, match=r"parts has shape \[55\], expected \[56\]"):
        ops().gemv_int4_norm(y, h, parts[:55].contiguous(), ln, EPS, qw, sc, None)
    with pytest.raises(RuntimeError, match=r"eps=0(\.0*)? must be > 0"):
        ops().gemv_int4_norm(y, h, parts, ln, 0.0, qw, sc, None)
    with pytest.raises(RuntimeError, match=r"ln has shape \[895\], expected \[896\]"):
        ops().gemv_int4_norm(y, h, parts, ln[:895].contiguous(), EPS, qw, sc, None)
    with pytest.raises(RuntimeError, match="hidden has 895 elements, expected k=896"):
        ops().gemv_int4_norm(y, h[:895].contiguous(), parts, ln, EPS, qw, sc, None)
    with pytest.raises(RuntimeError, match="parts must be Float"):
        ops().gemv_int4_norm(y, h, parts.half(), ln, EPS, qw, sc, None)
    gq, gs, _ = rand_int4(64, H, gen)
    uq, us, _ = rand_int4(32, H, gen)
    with pytest.raises(RuntimeError, match=r"gate is \[64, 896\] but up is \[32, 896\]"):
        ops().gemv_int4_silu_mul_norm(torch.empty(64, device="cuda").half(), h, parts, ln, EPS,
                                      gq, gs, uq, us)
    # the residual's parts: one column only, ceil(n / 16) of them
    oq, os_, _ = rand_int4(H, H, gen)
    with pytest.raises(RuntimeError, match="parts are written for one column only, x has 2"):
        ops().gemv_int4_residual(torch.zeros(2, H, device="cuda"),
                                 torch.zeros(2, H, device="cuda").half(), oq, os_, parts)
    with pytest.raises(RuntimeError, match=r"parts has shape \[55\], expected \[56\]"):
        ops().gemv_int4_residual(torch.zeros(H, device="cuda"), torch.zeros(H, device="cuda").half(),
                                 oq, os_, parts[:55].contiguous())
    with pytest.raises(RuntimeError, match=r"parts has shape \[2, 56\], expected \[1, 56\]"):
        ops().embed_gather(torch.empty(1, H, device="cuda"), torch.zeros(10, H, device="cuda").half(),
                           torch.zeros(1, device="cuda", dtype=torch.int32),
                           torch.empty(2, 56, device="cuda"))
