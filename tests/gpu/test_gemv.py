"""The decode GEMVs the engine launches (csrc/gemv_int4.cu, csrc/gemv_fp16.cu) and dequant_int4,
through torch.ops.nanoqwen, against an fp64 reference on fresh random data: awkward n (1, 3, 7,
643 = 5*128 + 3, 4609) and k from 128 to 27648 (the family's largest intermediate size), every
output poisoned with NaN before the call (a row the kernel skips fails), weights from
engine/quant.py's own quantize and from random codes, massive activations (|x| up to 3000), each
of the table's instances (o_proj and down_proj are one op split by k), determinism, and bad
shapes raising with the numbers -- among them a k no instance can run (no fallback kernel).

Error measure: ||out - ref|| / ||scale||, where scale per row is the size of the rounding-error
source, sqrt(sum_k (w_k x_k)^2), plus |ref| for the output rounding (for silu(g)*u propagated
through silu'(g) and u) -- not |ref| itself, which a single row (n = 1) can draw near zero by
cancellation. For large n it means the same as the usual relative L2 error.
Tolerances:
  TOL_HALF = 1e-3 for half outputs (qkv, silu*up): the output's rounding to fp16 dominates (at
      most 2^-11 = 4.9e-4 of |out| per element, ~2.8e-4 rms); the fp32 tensor-core sums add
      ~1e-6. 2x over the worst case of the rounding.
  TOL_F32 = 1e-4 for the fp32 residual outputs: exact q times fp16 x accumulated in fp32 by the
      tensor cores, group scales applied in fp32 (~1e-6; Hopper's mma accumulation order and
      truncation are unspecified, so 100x margin); a regression to fp16 partial sums (~4e-4,
      GEMV_NOTES.md runs 1-2) fails it.
  TOL_FP16 = 1e-5 for gemv_fp16's fp32 logits: exact fp16 -> fp32 products, fp32 sums over
      k <= 27648 (measured 1.4e-7, GEMV_NOTES.md run 1).
  dequant_int4: bit-exact to quant.dequantize(...).half() ((u-8)*s is exact before its one
      rounding).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL_HALF = 1e-3
TOL_F32 = 1e-4
TOL_FP16 = 1e-5
NAN = float("nan")


def ops():
    return torch.ops.nanoqwen


def scaled_err(out, ref, scale) -> float:
    out = out.double()
    assert torch.isfinite(out).all(), "non-finite output (a row left unwritten, or an overflow)"
    return float((out - ref).norm() / scale.norm().clamp_min(1e-30))


def dot_scale(w, x):
    """sqrt(sum_k (w x)^2) per row, in fp64: the size of the products a row's sum rounds."""
    return ((w.double() ** 2) @ (x.double() ** 2)).sqrt()


def silu_ref(wg, wu, x):
    """silu(g) * u in fp64 for g = wg x, u = wu x (x half), and its rounding-error scale for
    scaled_err: each factor's dot_scale times the derivative by it, plus |silu(g) * u|, at
    least 2^-14 (fp16's smallest normal: below it fp16 rounds to a fixed step of 2^-24, so its
    error is 2^-11 * max(|v|, 2^-14)). A row with g << 0 (outlier activations) has a result far
    below that: 1e-23 and 2.9e-8 were seen, both stored as 0 (seeds 422982756, 991663076)."""
    g, u = wg.double() @ x.double(), wu.double() @ x.double()
    ref = torch.nn.functional.silu(g) * u
    sig = torch.sigmoid(g)
    scale = ((sig * (1 + g * (1 - sig))).abs() * u.abs() * dot_scale(wg, x)
             + (g * sig).abs() * dot_scale(wu, x) + ref.abs()).clamp_min(2.0 ** -14)
    return ref, scale


def rand_int4(n, k, gen):
    """Random codes 1..15 in quant.py's layout and random scales (every code, both signs);
    returns (qweight, scales, W fp32) on the GPU, W from quant.dequantize (the reference)."""
    from nanoqwen.engine import quant

    cpu = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen,
                                                          device="cuda")))
    codes = torch.randint(1, 16, (n, k), generator=cpu)
    qweight = quant.pack_codes(codes)
    scales = (torch.rand(n, k // 128, generator=cpu) * 0.02 + 0.001).to(torch.float16)
    w = quant.dequantize(qweight, scales, torch.float32)
    return qweight.cuda(), scales.cuda(), w.cuda()


def quantized_randn(n, k, gen, std=0.02):
    """Weights the engine's converter would make: quant.quantize of a normal matrix."""
    from nanoqwen.engine import quant

    w0 = torch.randn(n, k, generator=gen, device="cuda").cpu() * std
    qweight, scales = quant.quantize(w0)
    return qweight.cuda(), scales.cuda(), quant.dequantize(qweight, scales, torch.float32).cuda()


def check_all_int4(qw, sc, w, x, gen, tol_half=TOL_HALF, tol_f32=TOL_F32):
    """gemv_int4 with and without bias, gemv_int4_residual and gemv_int4_silu_mul (up = the
    rows shuffled) on one matrix and x, against fp64; outputs start as NaN."""
    n = qw.shape[0]
    ref = w.double() @ x.double()
    s = dot_scale(w, x)
    bias = (torch.randn(n, generator=gen, device="cuda") * 0.5).half()
    for b in (bias, None):
        want = ref + (b.double() if b is not None else 0)
        y = torch.full((n,), NAN, dtype=torch.float16, device="cuda")
        ops().gemv_int4(y, x, qw, sc, b)
        assert scaled_err(y, want, s + want.abs()) < tol_half, "gemv_int4" + (" +bias" * (b is not None))
    h0 = torch.randn(n, generator=gen, device="cuda") * 3
    h = h0.clone()
    ops().gemv_int4_residual(h, x, qw, sc)
    # h - h0 rounds at |h0| (2^-24 * 3): far below the tolerance for every tested shape
    assert scaled_err(h - h0, ref, s) < tol_f32, "gemv_int4_residual"
    perm = torch.randperm(n, generator=gen, device="cuda")
    qu, su, wu = qw[perm].contiguous(), sc[perm].contiguous(), w[perm]
    want, scale = silu_ref(w, wu, x)
    if torch.isfinite(want.half()).all():  # outliers can push silu(g)*u past fp16 legitimately
        o = torch.full((n,), NAN, dtype=torch.float16, device="cuda")
        ops().gemv_int4_silu_mul(o, x, qw, sc, qu, su)
        assert scaled_err(o, want, scale) < tol_half, "gemv_int4_silu_mul"


# n x k: n = 1 and 3 (one partial 16-row tile), 643 (40 tiles + 3 rows), 4608 (qkv); k = 128 (one
# group: fewer groups than K-splitting warps), 256, 896 (0.5B hidden), 1152, 3584 (7B hidden),
# 18944 and 27648 (7B and 32B intermediate: down_proj's instance, k > 8192)
SHAPES = [(1, 128), (3, 256), (643, 896), (77, 1152), (643, 3584), (4608, 3584), (37, 18944),
          (29, 27648), (643, 18944)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_int4_launchers_random_codes(gen, n, k):
    qw, sc, w = rand_int4(n, k, gen)
    x = torch.randn(k, generator=gen, device="cuda").half()
    check_all_int4(qw, sc, w, x, gen)


def test_int4_launchers_quantized_weights(gen):
    """Weights through quant.quantize (the converter's exact path), 0.5B-like 643 x 896."""
    qw, sc, w = quantized_randn(643, 896, gen)
    check_all_int4(qw, sc, w, torch.randn(896, generator=gen, device="cuda").half(), gen)


@pytest.mark.parametrize("n,k", [(643, 3584), (5, 18944), (1, 896), (29, 27648)])
def test_int4_launchers_outliers(gen, n, k):
    """A few massive activations (+-1000, as Qwen's down_proj inputs have) among normal ones."""
    qw, sc, w = rand_int4(n, k, gen)
    x = torch.randn(k, generator=gen, device="cuda")
    x[torch.randperm(k, generator=gen, device="cuda")[:4]] = torch.tensor(
        [1000.0, -1000.0, 800.0, -600.0], device="cuda")
    check_all_int4(qw, sc, w, x.half(), gen)


def test_int4_residual_large_x(gen):
    """o_proj / down_proj inputs with |x| up to 3000 (fp16 four-deep partial sums, as the old
    v2 kernels used, overflowed above 2339): fp32 sums stay finite and accurate."""
    for n, k in [(33, 3584), (7, 18944)]:
        qw, sc, w = quantized_randn(n, k, gen)
        x = (torch.randn(k, generator=gen, device="cuda") * 1000).clamp(-3000, 3000).half()
        h0 = torch.randn(n, generator=gen, device="cuda")
        h = h0.clone()
        ops().gemv_int4_residual(h, x, qw, sc)
        assert scaled_err(h - h0, w.double() @ x.double(), dot_scale(w, x)) < TOL_F32


def test_int4_store_and_silu_large_x(gen):
    """qkv and gate/up inputs with |x| up to 3000: finite and accurate (fp32 sums, no |x| limit).
    Weights std 2e-4 keep silu(g)*u inside the fp16 output."""
    for n, k in [(37, 3584), (4609, 3584), (5, 18944)]:
        x = (torch.randn(k, generator=gen, device="cuda") * 1000).clamp(-3000, 3000).half()
        qw, sc, w = quantized_randn(n, k, gen, 2e-4)
        y = torch.full((n,), NAN, dtype=torch.float16, device="cuda")
        ops().gemv_int4(y, x, qw, sc, None)
        ref = w.double() @ x.double()
        assert scaled_err(y, ref, dot_scale(w, x) + ref.abs()) < TOL_HALF
        qu, su, wu = quantized_randn(n, k, gen, 2e-4)
        want, scale = silu_ref(w, wu, x)
        assert torch.isfinite(want.half()).all(), "test data: silu(g)*u exceeds fp16"
        out = torch.full((n,), NAN, dtype=torch.float16, device="cuda")
        ops().gemv_int4_silu_mul(out, x, qw, sc, qu, su)
        assert scaled_err(out, want, scale) < TOL_HALF


def random_words(n, k, gen):
    """Random qweight words (every nibble 0..15) and scales, on the GPU, no reference needed."""
    qw = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=gen, device="cuda",
                       dtype=torch.int32)
    return qw, (torch.rand(n, k // 128, generator=gen, device="cuda") * 0.02 + 0.001).half()


def test_int4_deterministic(gen):
    """Every output is written by one thread after a fixed-order reduction: repeats are
    bit-identical (qkv, o, down, gate/up instances at the 7B's shapes)."""
    for n, k in [(4608, 3584), (3584, 3584), (3584, 18944), (18944, 3584)]:
        qw, sc = random_words(n, k, gen)
        x = torch.randn(k, generator=gen, device="cuda").half()
        y1, y2 = (torch.full((n,), NAN, dtype=torch.float16, device="cuda") for _ in range(2))
        ops().gemv_int4(y1, x, qw, sc, None)
        ops().gemv_int4(y2, x, qw, sc, None)
        assert torch.equal(y1.view(torch.int16), y2.view(torch.int16))
        h1, h2 = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
        ops().gemv_int4_residual(h1, x, qw, sc)
        ops().gemv_int4_residual(h2, x, qw, sc)
        assert torch.equal(h1, h2)
        o1, o2 = (torch.full((n,), NAN, dtype=torch.float16, device="cuda") for _ in range(2))
        ops().gemv_int4_silu_mul(o1, x, qw, sc, qw, sc)
        ops().gemv_int4_silu_mul(o2, x, qw, sc, qw, sc)
        assert torch.equal(o1.view(torch.int16), o2.view(torch.int16))


@pytest.mark.parametrize("n,k", [(1, 128), (3, 256), (643, 896), (37, 18944), (29, 27648),
                                 (18944, 3584)])
def test_dequant_int4_bit_exact(gen, n, k):
    qw, sc, w = rand_int4(n, k, gen)
    d = torch.full((n, k), NAN, dtype=torch.float16, device="cuda")
    ops().dequant_int4(d, qw, sc)
    assert torch.equal(d.view(torch.int16), w.half().view(torch.int16))


@pytest.mark.parametrize("n,k", [(1, 8), (643, 896), (1003, 3584), (77, 27648), (152064, 3584)])
def test_gemv_fp16(gen, n, k):
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).half()
    x = torch.randn(k, generator=gen, device="cuda").half()
    ref = w.double() @ x.double()
    out = torch.full((n,), NAN, device="cuda")
    ops().gemv_fp16(out, x, w)
    assert scaled_err(out, ref, dot_scale(w, x) + ref.abs()) < TOL_FP16
    out2 = torch.full((n,), NAN, device="cuda")
    ops().gemv_fp16(out2, x, w)
    assert torch.equal(out, out2)


def test_bad_shapes_raise_with_numbers():
    dev = "cuda"
    qw = torch.zeros(8, 32, dtype=torch.int32, device=dev)  # k = 256
    sc = torch.ones(8, 2, dtype=torch.float16, device=dev)
    x = torch.zeros(256, dtype=torch.float16, device=dev)
    y = torch.empty(8, dtype=torch.float16, device=dev)
    with pytest.raises(RuntimeError, match="k=96 is not a multiple of group 128"):
        ops().gemv_int4(y, x[:96], torch.zeros(8, 12, dtype=torch.int32, device=dev), sc, None)
    with pytest.raises(RuntimeError, match=r"x is \[255\], expected \[k\] or \[cols, k\] with k=256"):
        ops().gemv_int4(y, x[:255], qw, sc, None)
    with pytest.raises(RuntimeError, match=r"y has 7 elements, expected cols\*n=8"):
        ops().gemv_int4(y[:7], x, qw, sc, None)
    with pytest.raises(RuntimeError, match="bias has 9 elements, expected n=8"):
        ops().gemv_int4(y, x, qw, sc, torch.zeros(9, dtype=torch.float16, device=dev))
    with pytest.raises(RuntimeError, match=r"hidden has 9 elements, expected cols\*n=8"):
        ops().gemv_int4_residual(torch.zeros(9, device=dev), x, qw, sc)
    with pytest.raises(RuntimeError, match="hidden must be Float"):
        ops().gemv_int4_residual(y, x, qw, sc)
    with pytest.raises(RuntimeError, match="gate has n=8 rows but up has 4"):
        ops().gemv_int4_silu_mul(y, x, qw, sc, qw[:4], sc[:4])
    with pytest.raises(RuntimeError, match=r"scales has shape \[8, 3\], expected \[8, 2\]"):
        ops().gemv_int4(y, x, qw, torch.ones(8, 3, dtype=torch.float16, device=dev), None)
    with pytest.raises(RuntimeError, match=r"logits has 4 elements, expected cols\*n=5"):
        ops().gemv_fp16(torch.empty(4, device=dev), x, torch.zeros(5, 256, dtype=torch.float16,
                                                                   device=dev))
    with pytest.raises(RuntimeError, match=r"w has shape \[8, 384\], expected \[8, 256\]"):
        ops().dequant_int4(torch.empty(8, 384, dtype=torch.float16, device=dev), qw, sc)


def test_launcher_messages_reach_the_exception():
    """What only the launcher can see (a 16-byte-misaligned x: a contiguous view one element in)
    fails with its own message, appended by the binding (kernels.h's error convention)."""
    dev = "cuda"
    qw = torch.zeros(8, 32, dtype=torch.int32, device=dev)
    sc = torch.ones(8, 2, dtype=torch.float16, device=dev)
    xbig = torch.zeros(264, dtype=torch.float16, device=dev)
    x = xbig[1:257]  # contiguous, 2 bytes past a 16-byte boundary
    y = torch.empty(8, dtype=torch.float16, device=dev)
    with pytest.raises(RuntimeError, match=r"gemv_int4 failed: .*gemv_int4: x=0x[0-9a-f]+ and "
                                           r"qweight=0x[0-9a-f]+ must be 16-byte aligned"):
        ops().gemv_int4(y, x, qw, sc, None)
    with pytest.raises(RuntimeError, match="gemv_int4_silu_mul: x=.* must be 16-byte aligned"):
        ops().gemv_int4_silu_mul(y, x, qw, sc, qw, sc)
    with pytest.raises(RuntimeError, match="gemv_fp16: x=.* must be 16-byte aligned"):
        ops().gemv_fp16(torch.empty(8, device=dev), x, torch.zeros(8, 256, dtype=torch.float16,
                                                                   device=dev))
    # the next, valid call succeeds and a later failure does not show the earlier message
    ops().gemv_int4(y, xbig[:256], qw, sc, None)
    with pytest.raises(RuntimeError) as ei:
        ops().gemv_int4_residual(torch.zeros(8, device=dev), x, qw, sc)
    assert "gemv_int4_residual: x=" in str(ei.value) and "gemv_fp16" not in str(ei.value)


@pytest.mark.parametrize("op", ["gemv_int4", "gemv_int4_residual", "gemv_int4_silu_mul"])
def test_shape_no_instance_can_run_is_refused(op):
    """k = 90112 (704 groups) needs more shared memory than any instance has (x alone is 176 KB;
    the table's instances top out at k ~ 74000-88000): refused with n and k, nothing launched,
    no fallback kernel. The outputs stay as they were."""
    dev = "cuda"
    n, k = 1, 90112
    qw = torch.zeros(n, k // 8, dtype=torch.int32, device=dev)
    sc = torch.ones(n, k // 128, dtype=torch.float16, device=dev)
    x = torch.zeros(k, dtype=torch.float16, device=dev)
    if op == "gemv_int4_residual":
        out = torch.full((n,), 5.0, device=dev)
        call = lambda: ops().gemv_int4_residual(out, x, qw, sc)  # noqa: E731
    elif op == "gemv_int4":
        out = torch.full((n,), 5.0, dtype=torch.float16, device=dev)
        call = lambda: ops().gemv_int4(out, x, qw, sc, None)  # noqa: E731
    else:
        out = torch.full((n,), 5.0, dtype=torch.float16, device=dev)
        call = lambda: ops().gemv_int4_silu_mul(out, x, qw, sc, qw, sc)  # noqa: E731
    with pytest.raises(RuntimeError, match=rf"{op}: n=1 k=90112 needs \d+ bytes of shared memory "
                                           r"per block .*the limit is 232448; no other kernel"):
        call()
    torch.cuda.synchronize()
    assert bool((out.float() == 5.0).all())
