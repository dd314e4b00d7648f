"""INT4 quantizer: the error bound and the exact bit layout the kernels read (engine/quant.py,
docs/FORMAT.md)."""

import pytest
import torch

from nanoqwen.engine.quant import (CODE_OFFSET, NIBBLE_ORDER, dequantize, pack_codes, quantize,
                                   unpack_codes)


def _to_u32(x: int) -> int:
    return x & 0xFFFFFFFF


@pytest.mark.parametrize("n,k", [(1, 128), (3, 384), (17, 640), (130, 256)])
def test_round_trip_error_within_half_a_step(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    # rows spanning six orders of magnitude, so groups of very different scale share a tensor
    # (smallest amax/7 is ~1e-4: still an fp16 normal, where the bound below holds)
    w = torch.randn(n, k, generator=g) * 10 ** (torch.rand(n, 1, generator=g) * 6 - 3)
    qweight, scales = quantize(w)
    assert qweight.dtype == torch.int32 and qweight.shape == (n, k // 8)
    assert scales.dtype == torch.float16 and scales.shape == (n, k // 128)
    codes = unpack_codes(qweight)
    assert codes.min() >= 1 and codes.max() <= 15  # code 0 is never written
    err = (dequantize(qweight, scales) - w).abs().reshape(n, k // 128, 128)
    s = scales.float().unsqueeze(-1)
    # Round-to-nearest gives |err| <= s/2. The scale is amax/7 rounded to fp16 (relative error
    # <= 2^-11), so 7*s can fall short of amax by up to 7*s*2^-11 and the clamped extreme
    # element errs by that much more; fp32 arithmetic adds ~1e-7 relative. Margin: 7*s*2^-10.
    assert (err <= s / 2 + 7 * s * 2**-10).all(), float((err - s / 2).max())


def test_requantizing_dequantized_weights_is_exact():
    # W' = (u-8)*s has amax exactly 7*s, so quantizing it again must give the same bits
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    q1, s1 = quantize(w)
    q2, s2 = quantize(dequantize(q1, s1))
    assert torch.equal(q1, q2) and torch.equal(s1, s2)


def test_nibble_order_exact_words():
    assert NIBBLE_ORDER == (0, 2, 4, 6, 1, 3, 5, 7) and CODE_OFFSET == 8
    # codes 0..7 in natural k order: nibble p holds element ORDER[p], so reading nibbles from
    # the top: p7=7 p6=5 p5=3 p4=1 p3=6 p2=4 p1=2 p0=0 -> 0x75316420
    codes = torch.tensor([list(range(8)) + list(range(8, 16))])
    words = pack_codes(codes)
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    assert _to_u32(int(words[0, 0])) == 0x75316420
    assert _to_u32(int(words[0, 1])) == 0xFDB9ECA8  # 15,13,11,9,14,12,10,8
    assert torch.equal(unpack_codes(words), codes)


def test_pack_matches_bitwise_definition_on_random_codes():
    codes = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(2))
    words = pack_codes(codes)
    for n in range(5):
        for j in range(8):
            want = sum(int(codes[n, 8 * j + e]) << (4 * p) for p, e in enumerate(NIBBLE_ORDER))
            assert _to_u32(int(words[n, j])) == want
    assert torch.equal(unpack_codes(words), codes)


def test_hand_built_weight_gives_known_codes_and_scales():
    # one group with amax 7 -> scale exactly 1, so code = w + 8; k = 0..127 holds (k % 15) - 7
    w = torch.tensor([[(k % 15) - 7.0 for k in range(128)]])
    qweight, scales = quantize(w)
    assert scales.tolist() == [[1.0]]
    codes = [(k % 15) + 1 for k in range(128)]
    for j in range(16):
        want = sum(codes[8 * j + e] << (4 * p) for p, e in enumerate(NIBBLE_ORDER))
        assert _to_u32(int(qweight[0, j])) == want
    # the kernel's trick: (w >> 4i) & 0x000F000F picks codes of the consecutive inputs 2i, 2i+1
    word = _to_u32(int(qweight[0, 0]))
    for i in range(4):
        lo = (word >> (4 * i)) & 0x000F000F
        assert (lo & 0xF, lo >> 16) == (codes[2 * i], codes[2 * i + 1])


def test_zero_groups():
    w = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    w[1] = 0.0          # a whole row
    w[2, 128:] = 0.0    # one group of a row
    qweight, scales = quantize(w)
    assert scales[1].tolist() == [0.0, 0.0] and scales[2, 1].item() == 0.0
    codes = unpack_codes(qweight)
    assert (codes[1] == CODE_OFFSET).all() and (codes[2, 128:] == CODE_OFFSET).all()
    back = dequantize(qweight, scales)
    assert torch.isfinite(back).all()
    assert (back[1] == 0).all() and (back[2, 128:] == 0).all()


def test_k_not_a_multiple_of_the_group_is_refused_with_the_number():
    with pytest.raises(ValueError, match="k=200"):
        quantize(torch.randn(4, 200))
    with pytest.raises(ValueError, match=r"\(7,\)"):
        quantize(torch.randn(7))
