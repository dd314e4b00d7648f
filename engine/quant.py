"""INT4 symmetric group-wise quantization: the reference for the kernels' weight layout.

A linear weight W [N out, K in] (fp16/fp32) becomes
  qweight  int32 [N, K // 8]     eight 4-bit codes per 32-bit word, rows contiguous
  scales   fp16  [N, K // 128]   one scale per group of 128 consecutive inputs

Quantization (per row n, group g):  s = max|W[n, g*128:(g+1)*128]| / 7 (rounded to fp16),
q = clamp(round(W / s), -7, 7), stored code u = q + 8 in 1..15 (code 0 is never written).
Dequantization: W' = (u - 8) * s.  Round-to-nearest bounds the error by s / 2 per element.

`quantize` is the one implementation (the converter, the synthetic models on the CPU or the GPU,
the tests): torch ops that give the same bits on any device. Every step is exact or one IEEE
rounding (fp32 division, round-half-even, fp32 -> fp16), and amax / 7 divides by a tensor, not a
Python number: CUDA computes `t / scalar` as t * fp32(1/scalar), which can differ in the last bit.
`quantize_blocks` is the same over an [N, K] weight handed in row blocks (every step is per row).

Nibble order inside a word (the "interleaved" order the GEMV kernels want): word j of row n
holds inputs k = 8j .. 8j+7, and nibble position p (bits 4p .. 4p+3) holds k = 8j + ORDER[p]
with ORDER = [0, 2, 4, 6, 1, 3, 5, 7].  A kernel that does
    lo = (w >> 4i) & 0x000F000F | 0x64006400        (i = 0..3)
gets a half2 (1024 + u[2i], 1024 + u[2i+1]) -- two *consecutive* inputs -- so it can multiply
by a plain half2 load of the activations with no permutation.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .config import QUANT_GROUP_SIZE

GROUP_SIZE = QUANT_GROUP_SIZE  # the one group size of the format (config.py owns it)
# nibble position p holds in-word element ORDER[p]
NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
QMAX = 7
CODE_OFFSET = 8
# Elements quantized at once by the converter and the CPU synthetic writer. quantize() grows the
# peak by ~35 bytes per element (measured with ru_maxrss: 69 MiB for a 2.1M-element block,
# k = 1536 or 8960: its fp32 temporaries and int64 codes), and each temporary stays <= 16 MB,
# under glibc's 32 MB dynamic mmap threshold, so freed blocks can be reused from the heap
# instead of being mapped afresh for every block.
BLOCK_ELEMS = 1 << 21


def quantize(w: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (qweight int32 [N, K//8], scales fp16 [N, K//group_size])."""
    if w.dim() != 2:
        raise ValueError(f"quantize expects a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"k={k} is not a multiple of group {group_size}")
    wf = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    amax = wf.abs().amax(dim=-1)
    # a tensor divisor: a true division on the GPU too (module doc)
    scales = (amax / torch.full((), QMAX, dtype=torch.float32, device=w.device)).to(torch.float16)
    s = scales.to(torch.float32).unsqueeze(-1)
    q = torch.where(s > 0, torch.round(wf / torch.where(s > 0, s, torch.ones_like(s))),
                    torch.zeros_like(wf))
    codes = (q.clamp(-QMAX, QMAX) + CODE_OFFSET).to(torch.int64).reshape(n, k)
    return pack_codes(codes), scales


def quantize_blocks(w_rows: Iterator[tuple[int, int, torch.Tensor]], n: int, k: int,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` of an [n, k] weight given as (r0, r1, rows [r1-r0, k]) blocks on `device`:
    identical output (every step of quantize is per row), memory bounded by the output plus
    one block's temporaries."""
    qweight = torch.empty(n, k // 8, dtype=torch.int32, device=device)
    scales = torch.empty(n, k // GROUP_SIZE, dtype=torch.float16, device=device)
    for r0, r1, w in w_rows:
        qweight[r0:r1], scales[r0:r1] = quantize(w)
    return qweight, scales


# element e of a group of 8 goes to nibble position NIBBLE_ORDER.index(e): its weight in the word
_NIBBLE_WEIGHT = torch.tensor([1 << (4 * NIBBLE_ORDER.index(e)) for e in range(8)],
                              dtype=torch.int64)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes int [N, K] in 0..15 (natural k order) -> int32 [N, K//8] in the interleaved order."""
    n, k = codes.shape
    c = (codes.to(torch.int64) & 0xF).reshape(n, k // 8, 8)
    # the nibbles do not overlap, so OR-ing the shifted codes is a sum: one integer dot product
    # per word (exact in int64; ~7x faster on the CPU than eight strided shift-and-OR passes)
    weight = _NIBBLE_WEIGHT.to(c.device)
    word = c @ weight if c.device.type == "cpu" else (c * weight).sum(-1)
    # reinterpret the low 32 bits as signed int32 (torch has no uint32 arithmetic on CPU)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K//8] -> codes int64 [N, K] in natural k order (0..15)."""
    n, kw = qweight.shape
    w = qweight.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(n, kw, 8, dtype=torch.int64)
    for p, elem in enumerate(NIBBLE_ORDER):
        out[:, :, elem] = (w >> (4 * p)) & 0xF
    return out.reshape(n, kw * 8)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(qweight int32 [N, K//8], scales fp16 [N, K//G]) -> W' [N, K] in `dtype`."""
    n, kw = qweight.shape
    k = kw * 8
    if scales.shape[0] != n or k % scales.shape[1]:
        raise ValueError(f"scales shape {tuple(scales.shape)} does not fit qweight {tuple(qweight.shape)}")
    group = k // scales.shape[1]
    codes = unpack_codes(qweight.cpu())  # .cpu() is a no-op for CPU tensors
    q = (codes - CODE_OFFSET).to(torch.float32).reshape(n, k // group, group)
    w = q * scales.detach().cpu().to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k).to(dtype).to(qweight.device)
