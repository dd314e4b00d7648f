"""The prefill's INT4 GEMMs (csrc/gemm_int4.cu: gemm_int4, gemm_int4_residual, gemm_int4_silu_mul)
through torch.ops.nanoqwen, and the prefill that uses them (prefill_weights="int4"), on fresh
random data: every projection shape of the family (0.5B-32B), token counts 1, 15, 17, 64, 65, 100,
127, 128, 129 and 511 (every block shape of the mma.sync kernel below 128 tokens and of the wgmma
kernel from 128, partial tiles), random codes 1..15 and scales, outputs poisoned with
NaN (a skipped row or token fails), and bad shapes raising with the numbers.

Reference: fp64 math on the fp16 weight dequant_int4 gives (bit-exact to quant.dequantize(...)
.half(), tests/gpu/test_gemv.py; the weight cuBLAS multiplied before this kernel, and the one it
forms: q*s rounded once to fp16). Error measure and tolerances as test_gemv.py's (scaled by
sqrt(sum_k (w x)^2) + |ref|): TOL_HALF 1e-3 for half outputs (their rounding: <= 4.9e-4 per
element), TOL_F32 1e-4 for the fp32 residual (fp32 tensor-core sums, ~1e-6; 100x margin).
The prefill: the last token's logits with prefill_weights="int4" against "resident" (cuBLAS on
the same fp16 weights, another summation order and fp16-rounded gate/up before the SiLU where
gemm_int4_silu_mul keeps fp32): relative L2 difference <= 2e-2 at 0.5B shapes after 24 layers of
random weights; the K/V written to the cache likewise.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL_HALF = 1e-3
TOL_F32 = 1e-4
NAN = float("nan")
MS = (1, 15, 17, 64, 65, 100, 127, 128, 129, 511)   # 128 on: the wgmma kernel


def ops():
    return torch.ops.nanoqwen


def family_shapes() -> list[tuple[int, int]]:
    from nanoqwen.engine.config import PRESETS, ModelConfig

    shapes = set()
    for name in PRESETS:
        c = ModelConfig.from_name(name)
        shapes |= {(c.q_size + 2 * c.kv_size, c.hidden_size), (c.hidden_size, c.q_size),
                   (c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)}
    return sorted(shapes)


def rand_int4(n, k, gen):
    """Random codes 1..15 and scales on the GPU; (qweight, scales, the fp16 weight)."""
    from nanoqwen.engine import quant

    codes = torch.randint(1, 16, (n, k), generator=gen, device="cuda")
    qweight = quant.pack_codes(codes)
    scales = (torch.rand(n, k // 128, generator=gen, device="cuda") * 0.02 + 0.001).half()
    w16 = torch.empty(n, k, dtype=torch.float16, device="cuda")
    ops().dequant_int4(w16, qweight, scales)
    return qweight, scales, w16


def scaled_err(out, ref, scale) -> float:
    out = out.double()
    assert torch.isfinite(out).all(), "non-finite output (a row or token left unwritten)"
    return float((out - ref).norm() / scale.norm().clamp_min(1e-30))


def dot_scale(w, x):
    """[m, n]: sqrt(sum_k (w x)^2) of every output."""
    return ((x.double() ** 2) @ (w.double() ** 2).T).sqrt()


@pytest.mark.parametrize("n,k", family_shapes())
def test_gemm_int4_matches_fp64_at_every_family_shape(n, k, gen):
    qw, sc, w = rand_int4(n, k, gen)
    bias = (torch.randn(n, generator=gen, device="cuda") * 0.5).half()
    for m in (MS if max(n, k) <= 8960 else (1, 17, 100, 300)):   # the largest: fewer m
        x = (torch.randn(m, k, generator=gen, device="cuda")).half()
        ref = x.double() @ w.double().T
        s = dot_scale(w, x)
        for b in (bias, None):
            want = ref + (b.double() if b is not None else 0)
            y = torch.full((m, n), NAN, dtype=torch.float16, device="cuda")
            ops().gemm_int4(y, x, qw, sc, b)
            assert scaled_err(y, want, s + want.abs()) < TOL_HALF, (m, b is not None)
        h0 = torch.randn(m, n, generator=gen, device="cuda") * 3
        h = h0.clone()
        ops().gemm_int4_residual(h, x, qw, sc)
        assert scaled_err(h - h0, ref, s) < TOL_F32, m


@pytest.mark.parametrize("n,k", [(4864, 896), (18944, 3584), (27648, 5120)])
def test_gemm_int4_silu_mul_matches_fp64(n, k, gen):
    qg, sg, wg = rand_int4(n, k, gen)
    qu, su, wu = rand_int4(n, k, gen)
    for m in (1, 12, 17, 65, 100, 128, 300):   # every block shape the SiLU epilogue takes
        x = torch.randn(m, k, generator=gen, device="cuda").half()
        g, u = x.double() @ wg.double().T, x.double() @ wu.double().T
        ref = torch.nn.functional.silu(g) * u
        sig = torch.sigmoid(g)
        scale = ((sig * (1 + g * (1 - sig))).abs() * u.abs() * dot_scale(wg, x)
                 + (g * sig).abs() * dot_scale(wu, x) + ref.abs()).clamp_min(2.0 ** -14)
        out = torch.full((m, n), NAN, dtype=torch.float16, device="cuda")
        ops().gemm_int4_silu_mul(out, x, qg, sg, qu, su)
        assert scaled_err(out, ref, scale) < TOL_HALF, m


@pytest.mark.parametrize("m", [40, 300])
def test_gemm_int4_is_deterministic(m, gen):
    """m = 40 splits K across blocks (7B down_proj: 56 output tiles), whose partials the tile's
    last block sums in split order whichever block comes last; m = 300 (the wgmma kernel) does
    not split."""
    qw, sc, _ = rand_int4(3584, 18944, gen)
    x = torch.randn(m, 18944, generator=gen, device="cuda").half()
    outs = []
    for _ in range(3):
        h = torch.zeros(m, 3584, device="cuda")
        ops().gemm_int4_residual(h, x, qw, sc)
        outs.append(h)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_gemm_int4_at_4097_tokens(gen):
    """Past two prefill chunks' worth of token blocks, a partial last one (issue 14's count)."""
    qw, sc, w = rand_int4(4864, 896, gen)
    x = torch.randn(4097, 896, generator=gen, device="cuda").half()
    ref = x.double() @ w.double().T
    y = torch.full((4097, 4864), NAN, dtype=torch.float16, device="cuda")
    ops().gemm_int4(y, x, qw, sc, None)
    assert scaled_err(y, ref, dot_scale(w, x) + ref.abs()) < TOL_HALF


@pytest.mark.parametrize("what,make,says", [
    ("k not a multiple of 128",
     lambda q, s, x: (q[:, :20].contiguous(), s[:, :1].contiguous(), x[:, :160].contiguous()),
     "not a multiple of group 128"),
    ("x of another k", lambda q, s, x: (q, s, x[:, :128].contiguous()), "expected \\[m, k\\]"),
    ("no tokens", lambda q, s, x: (q, s, x[:0]), "m >= 1"),
    ("x not 16-byte aligned", lambda q, s, x: (q, s, x.flatten()[1:1 + 2 * 256].view(2, 256)),
     "16-byte aligned"),
    ("scales not 4-byte aligned",
     lambda q, s, x: (q, torch.cat([s.flatten()[:1], s.flatten()])[1:].view(s.shape), x[:2]),
     "4-byte aligned"),
])
def test_gemm_int4_bad_shapes_raise_with_the_numbers(what, make, says, gen):
    qw, sc, _ = rand_int4(64, 256, gen)
    x = torch.randn(4, 256, generator=gen, device="cuda").half()
    q, s, xx = make(qw, sc, x)
    y = torch.empty(2, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match=says):
        ops().gemm_int4(y, xx, q, s, None)


def test_the_int4_prefill_matches_the_resident_one():
    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.config import ModelConfig

    cfg = ModelConfig.from_name("0.5b")
    ids = list(range(100, 100 + 300))   # > int4_max_m: the resident prefill runs cuBLAS
    out = {}
    for pw in ("resident", "int4"):
        be = CudaBackend.synthetic(cfg, max_context=512, prefill_weights=pw)
        assert be.prefill_weights == pw
        logits = be.forward(ids).double()
        k0 = be.k_layers[cfg.num_hidden_layers - 1].double().clone()
        out[pw] = logits, k0
        del be
        torch.cuda.empty_cache()
    (la, ka), (lb, kb) = out["resident"], out["int4"]
    assert float((la - lb).norm() / la.norm()) < 2e-2
    assert float((ka - kb).norm() / ka.norm()) < 2e-2


def test_a_short_prompt_goes_through_gemm_int4_and_matches_cublas(monkeypatch):
    """With dequant prefill weights, a next turn's few tokens (at most NANOQWEN_INT4_MAX_M) go
    through gemm_int4; with the switch at 0 the dequantized layer's cuBLAS GEMMs take them. The
    same logits within the int4 prefill's tolerance above, K/V of the new tokens too, and a
    repeat of the same turn is bit-identical (the engine's split-K counters are left zeroed)."""
    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.config import ModelConfig
    from nanoqwen.engine.switches import INT4_MAX_M

    cfg = ModelConfig.from_name("0.5b")
    ctx, turn = list(range(100, 400)), list(range(500, 540))
    out = {}
    for limit in ("0", "64"):
        monkeypatch.setenv(INT4_MAX_M, limit)
        be = CudaBackend.synthetic(cfg, max_context=512, prefill_weights="dequant")
        be.forward(ctx)
        first = be.forward(turn).double()
        k = be.k_layers[cfg.num_hidden_layers - 1].double().clone()
        be.truncate(len(ctx))
        again = be.forward(turn).double()
        assert torch.equal(first, again), limit
        out[limit] = first, k
        del be
        torch.cuda.empty_cache()
    (la, ka), (lb, kb) = out["0"], out["64"]
    assert float((la - lb).norm() / la.norm()) < 2e-2
    assert float((ka - kb).norm() / ka.norm()) < 2e-2


def test_dequant_prefill_equals_resident(monkeypatch):
    """The dequant prefill -- each layer's fp16 copy written on a side stream into one of two
    scratch sets while the previous layer's GEMMs read the other -- computes what the resident
    prefill does, bit for bit (the same fp16 weights, the same cuBLAS GEMMs): a missing wait
    would let a layer read a set still being written or already overwritten. A 300-token
    prompt and a 200-token next turn (INT4_MAX_M 0: no chunk through gemm_int4)."""
    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.config import ModelConfig
    from nanoqwen.engine.switches import INT4_MAX_M

    monkeypatch.setenv(INT4_MAX_M, "0")
    cfg = ModelConfig.from_name("0.5b")
    ctx, turn = list(range(100, 400)), list(range(500, 700))
    out = {}
    for weights in ("resident", "dequant"):
        be = CudaBackend.synthetic(cfg, max_context=1024, prefill_weights=weights)
        out[weights] = be.forward(ctx), be.forward(turn), be.forward(turn[:50])
        del be
        torch.cuda.empty_cache()
    for a, b in zip(out["resident"], out["dequant"]):
        assert torch.equal(a, b)
