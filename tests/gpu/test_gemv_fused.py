"""The GEMVs with the RMSNorm fused into their prologue (csrc/gemv_int4.cu, csrc/gemv_fp16.cu),
through torch.ops.nanoqwen, against an fp64 reference on fresh random data.

Reference: x = half(norm_w * (hidden * r)), r = rsqrt(mean(hidden^2) + eps) -- the rmsnorm
kernel's rounding, with r from fp64 (the kernels use rsqrtf and another reduction order, so a few
elements of x may differ in the last bit: ~1e-5 relative on the output, far below every
tolerance). Weights come from quantize_int4_gpu and are expanded with dequant_int4 (bit-exact to
engine/quant.py's dequantize, tested in test_kernels.py); dot products in fp64.

Error measure: ||out - ref|| / ||scale||, where scale per row is the size of the rounding-error
source, sqrt(sum_k (w_k x_k)^2) (plus |ref| for the output rounding; for silu(g)*u propagated
through silu'(g) and u) -- not |ref| itself, which a single row (n = 1, 7) can draw near zero by
cancellation. For large n it means the same as the usual relative L2 error.
Tolerances:
  half outputs (qkv, silu*up): 2e-3. Output rounding alone is ~3e-4 rms; the INT4 kernels sum
      products of exact q (-7..7) and fp16 x four deep in fp16 before fp32 (~4e-4 more); 2e-3
      leaves >= 3x margin.
  fp32 logits (fp16 lm_head): 1e-4. fp32 products and sums of fp16 values (~1e-6) plus the
      last-bit differences of x described above.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

EPS = 1e-6
TOL_HALF = 2e-3
TOL_LOGITS = 1e-4


def ops():
    return torch.ops.nanoqwen


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output (unwritten or overflowed)"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def scaled_err(out, ref, scale) -> float:
    out = out.double()
    assert torch.isfinite(out).all(), "non-finite output (unwritten or overflowed)"
    return float((out - ref).norm() / scale.norm().clamp_min(1e-30))


def dot_scale(w, x):  # sqrt(sum_k (w x)^2) per row
    return ((w.double() ** 2) @ (x.double() ** 2)).sqrt()


def silu_ref(wg, wu, x):
    """silu(g) * u in fp64 for g = wg x, u = wu x (x half), and its rounding-error scale for
    scaled_err: each factor's dot_scale times the derivative by it, plus |silu(g) * u|."""
    g, u = wg.double() @ x.double(), wu.double() @ x.double()
    ref = torch.nn.functional.silu(g) * u
    sig = torch.sigmoid(g)
    scale = ((sig * (1 + g * (1 - sig))).abs() * u.abs() * dot_scale(wg, x)
             + (g * sig).abs() * dot_scale(wu, x) + ref.abs())
    return ref, scale


def norm_ref(hidden: torch.Tensor, norm_w: torch.Tensor) -> torch.Tensor:
    r = torch.rsqrt(hidden.double().pow(2).mean() + EPS).float()
    return (norm_w.float() * (hidden * r)).half()


def make_hidden(k, gen, big=False):
    """fp32 residual stream with a few outliers; big=True: norm weights ~1000, so |x| reaches
    ~3000 after the norm (Qwen's massive activations) -- four such products of |q| <= 7 overflow
    fp16 (65504) unless the kernel guards against it."""
    hidden = torch.randn(k, generator=gen, device="cuda") * 4
    idx = torch.randperm(k, generator=gen, device="cuda")[:3]
    hidden[idx] = torch.tensor([90.0, -70.0, 55.0], device="cuda")
    nw = (torch.rand(k, generator=gen, device="cuda") * 2 + 0.2) * (1000.0 if big else 1.0)
    return hidden, nw.half()


def make_int4(n, k, gen, std=0.02):
    from nanoqwen.engine.ops import quantize_int4_gpu

    qw, sc = quantize_int4_gpu(torch.randn(n, k, generator=gen, device="cuda") * std)
    w = torch.empty(n, k, dtype=torch.float16, device="cuda")
    ops().dequant_int4(w, qw, sc)
    return qw, sc, w


SHAPES = [(1, 128), (7, 384), (33, 3584), (4609, 3584), (7, 18944), (33, 27648), (1, 27648)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_int4_norm(gen, n, k, big, with_bias):
    qw, sc, w = make_int4(n, k, gen)
    hidden, nw = make_hidden(k, gen, big)
    bias = (torch.randn(n, generator=gen, device="cuda") * 0.5).half() if with_bias else None
    x = norm_ref(hidden, nw)
    ref = w.double() @ x.double()
    if bias is not None:
        ref = ref + bias.double()
    y = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
    ops().gemv_int4_norm(y, hidden, nw, EPS, qw, sc, bias)
    assert scaled_err(y, ref, dot_scale(w, x) + ref.abs()) < TOL_HALF
    y2 = torch.full_like(y, float("nan"))
    ops().gemv_int4_norm(y2, hidden, nw, EPS, qw, sc, bias)
    assert torch.equal(y.view(torch.int16), y2.view(torch.int16))  # deterministic, bit for bit


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("big", [False, True])
def test_gemv_int4_silu_mul_norm(gen, n, k, big):
    # big: |x| reaches ~3e4, so the weights are scaled down (std 2e-4) to keep silu(g)*u
    # inside fp16 (the output's dtype; worst draw on a CPU replay of these shapes ~5e3): the
    # int4 codes q (-7..7) times x are what the kernel's fp16 partial sums must survive, and
    # those do not depend on the scale. Before this, most big draws overflowed the output and
    # were skipped.
    std = 2e-4 if big else 0.02
    qg, sg, wg = make_int4(n, k, gen, std)
    qu, su, wu = make_int4(n, k, gen, std)
    hidden, nw = make_hidden(k, gen, big)
    ref, scale = silu_ref(wg, wu, norm_ref(hidden, nw))
    assert torch.isfinite(ref.half()).all(), "test data: silu(g)*u exceeds fp16"
    out = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
    ops().gemv_int4_silu_mul_norm(out, hidden, nw, EPS, qg, sg, qu, su)
    assert scaled_err(out, ref, scale) < TOL_HALF


@pytest.mark.parametrize("n,k", [(1, 8), (7, 384), (33, 3584), (4609, 3584), (33, 27648),
                                 (152064, 896)])
def test_gemv_fp16_norm(gen, n, k):
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).half()
    hidden, nw = make_hidden(k, gen)
    x = norm_ref(hidden, nw)
    ref = w.double() @ x.double()
    logits = torch.full((n,), float("nan"), device="cuda")
    ops().gemv_fp16_norm(logits, hidden, nw, EPS, w)
    assert scaled_err(logits, ref, dot_scale(w, x) + ref.abs()) < TOL_LOGITS


def test_int4_residual_large_x(gen):
    """o_proj / down_proj inputs with |x| up to 3000 (the old kernels' fp16 sums overflowed above
    2339): the launchers must stay finite and accurate."""
    for n, k in [(33, 3584), (7, 18944)]:
        qw, sc, w = make_int4(n, k, gen)
        x = (torch.randn(k, generator=gen, device="cuda") * 1000).clamp(-3000, 3000).half()
        h0 = torch.randn(n, generator=gen, device="cuda")
        h = h0.clone()
        ops().gemv_int4_residual(h, x, qw, sc)
        assert scaled_err(h - h0, w.double() @ x.double(), dot_scale(w, x)) < TOL_HALF


def test_int4_store_and_silu_large_x(gen):
    """qkv and gate/up inputs with |x| up to 3000: since run 7 the plain launchers sum in fp32
    (v5 tca_exact), so they must stay finite and accurate where the v2 kernel's fp16 four-deep
    sums overflowed (|x| > 2339). Weights std 2e-4 keep silu(g)*u inside the fp16 output."""
    for n, k in [(37, 3584), (4609, 3584), (5, 18944)]:
        x = (torch.randn(k, generator=gen, device="cuda") * 1000).clamp(-3000, 3000).half()
        qw, sc, w = make_int4(n, k, gen, 2e-4)
        y = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
        ops().gemv_int4(y, x, qw, sc, None)
        ref = w.double() @ x.double()
        assert scaled_err(y, ref, dot_scale(w, x) + ref.abs()) < TOL_HALF
        qu, su, wu = make_int4(n, k, gen, 2e-4)
        want, scale = silu_ref(w, wu, x)
        assert torch.isfinite(want.half()).all(), "test data: silu(g)*u exceeds fp16"
        out = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
        ops().gemv_int4_silu_mul(out, x, qw, sc, qu, su)
        assert scaled_err(out, want, scale) < TOL_HALF


def test_fused_bad_shapes_raise_with_numbers():
    dev = "cuda"
    qw = torch.zeros(8, 32, dtype=torch.int32, device=dev)  # k = 256
    sc = torch.ones(8, 2, dtype=torch.float16, device=dev)
    y = torch.empty(8, dtype=torch.float16, device=dev)
    hidden = torch.randn(256, device=dev)
    nw = torch.ones(256, dtype=torch.float16, device=dev)
    with pytest.raises(RuntimeError, match="hidden has 200 elements, expected k=256"):
        ops().gemv_int4_norm(y, hidden[:200], nw, EPS, qw, sc, None)
    with pytest.raises(RuntimeError, match="eps=0"):
        ops().gemv_int4_norm(y, hidden, nw, 0.0, qw, sc, None)
    with pytest.raises(RuntimeError, match="k=96 is not a multiple of group 128"):
        ops().gemv_int4_norm(y, hidden, nw, EPS, torch.zeros(8, 12, dtype=torch.int32, device=dev),
                             sc, None)
    with pytest.raises(RuntimeError, match="y has 7 elements, expected n=8"):
        ops().gemv_int4_norm(y[:7], hidden, nw, EPS, qw, sc, None)
    with pytest.raises(RuntimeError, match="out has 9 elements, expected n=8"):
        ops().gemv_int4_silu_mul_norm(torch.empty(9, dtype=torch.float16, device=dev), hidden, nw,
                                      EPS, qw, sc, qw, sc)
    with pytest.raises(RuntimeError, match="hidden must be Float"):
        ops().gemv_int4_silu_mul_norm(y, hidden.half(), nw, EPS, qw, sc, qw, sc)
    w = torch.zeros(5, 256, dtype=torch.float16, device=dev)
    with pytest.raises(RuntimeError, match="logits has 4 elements, expected n=5"):
        ops().gemv_fp16_norm(torch.empty(4, device=dev), hidden, nw, EPS, w)
    with pytest.raises(RuntimeError, match=r"norm_w"):
        ops().gemv_fp16_norm(torch.empty(5, device=dev), hidden, nw[:128], EPS, w)
