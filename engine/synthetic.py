"""Synthetic (random-weight) models: the one generator behind `nanoqwen convert --synthetic`
(a file, made on the CPU) and `nanoqwen bench --synthetic` / CudaBackend.synthetic (made on the
GPU, no file). The same (config, seed) gives the same tensors on either device.

Every element is a pure function of (seed, tensor name, element index): a counter-based hash in
torch int64 ops whose top 16 bits pick one of 2^16 quantiles of the distribution, a table built
once on the CPU in float64. Why this way: torch's CPU and CUDA generators give different
streams, and transcendental functions (Box-Muller's log and cos) differ in the last bit between
devices; integer ops and a gather are exact everywhere, so no arithmetic that could round
differently runs before the projections are quantized (quant.quantize: the same bits on any
device). So a tensor does not depend on the device, the block size it is made in, or the order
of reads. Every intermediate stays below 2^63 (the multipliers are < 2^31), so no op overflows.

Distributions (transformers' Qwen2 initialisation, std 0.02): embeddings, lm_head, the seven
projections (quantized from the fp32 values) and the q/k/v biases N(0, 0.02) -- biases drawn, not
zeroed as transformers does, so that a bias the engine forgot shows in the logits; norm weights
1 + 0.1 N(0, 1), not 1, so that a kernel ignoring the norm weight shows too. The quantile table
is the normal distribution to 2^-16 in probability (tails cut at +-4.2 sigma).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping

import torch

from .config import ModelConfig
from .format import expected_tensors
from .quant import BLOCK_ELEMS, quantize_blocks

INIT_STD = 0.02        # transformers' Qwen2 initializer_range
NORM_STD = 0.1         # norm weights: 1 + NORM_STD * N(0, 1)
GPU_BLOCK_ELEMS = 1 << 26  # elements generated at once on a GPU (~0.5 GB per int64 temporary)
_TABLE_BITS = 16
_M32 = 0xFFFFFFFF
# the two-round 32-bit integer hash from Chris Wellons' hash-prospector (multipliers < 2^31)
_MUL1, _MUL2 = 0x21F0AAAD, 0x735A2D97


def _key(seed: int, name: str) -> tuple[int, int]:
    """The tensor's (odd multiplier < 2^31, offset < 2^32): element i hashes (i * a + b) mod 2^32."""
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return (int.from_bytes(h[:4], "little") & 0x7FFFFFFF) | 1, int.from_bytes(h[4:8], "little")


def hash_index(start: int, count: int, key: tuple[int, int], device) -> torch.Tensor:
    """int64 [count] in 0 .. 2^16-1: the table index of elements start .. start+count-1."""
    a, b = key
    x = torch.arange(start, start + count, dtype=torch.int64, device=device)
    x.mul_(a).bitwise_and_(_M32).add_(b).bitwise_and_(_M32)   # < 2^32 * 2^31 before the mask
    x.bitwise_xor_(x >> 16)
    x.mul_(_MUL1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL2).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    return x >> (32 - _TABLE_BITS)


def _normal_quantiles() -> torch.Tensor:
    """float64 [2^16]: N(0, 1) at the midpoints of 2^16 equal probability bins."""
    n = 1 << _TABLE_BITS
    return torch.special.ndtri((torch.arange(n, dtype=torch.float64) + 0.5) / n)


class SyntheticWeights(Mapping):
    """A model's tensors in the file's naming (format.expected_tensors), generated on `device`
    when indexed: fp16 tensors as stored, projections as INT4 .qweight/.scales. Blocks of
    `block_elems` elements bound the temporaries (default: quant.BLOCK_ELEMS on the CPU,
    GPU_BLOCK_ELEMS on a GPU); any block size gives the same bits."""

    def __init__(self, config: ModelConfig, seed: int = 0, device="cpu", std: float = INIT_STD,
                 block_elems: int | None = None) -> None:
        self.config, self.seed, self.device, self.std = config, seed, torch.device(device), std
        self.block_elems = block_elems or (BLOCK_ELEMS if self.device.type == "cpu"
                                           else GPU_BLOCK_ELEMS)
        self._names = expected_tensors(config)
        q = _normal_quantiles()
        weight = (q * std).to(torch.float32)                    # rounded once, on the CPU
        norm = (1.0 + NORM_STD * q).to(torch.float32)
        self._tables = {"weight": weight.to(self.device),
                        "weight16": weight.to(torch.float16).to(self.device),
                        "norm16": norm.to(torch.float16).to(self.device)}
        self._last: tuple[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    def _values(self, name: str, table: str, start: int, count: int) -> torch.Tensor:
        return self._tables[table][hash_index(start, count, _key(self.seed, name), self.device)]

    def _rows(self, name: str, table: str, n: int, k: int
              ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(r0, r1, values [r1-r0, k]) of an [n, k] tensor, about block_elems at a time."""
        if n * k >= 2**32:
            raise ValueError(f"{name}: {n} x {k} elements is beyond the 2^32 the hash indexes")
        step = max(1, self.block_elems // k)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            yield r0, r1, self._values(name, table, r0 * k, (r1 - r0) * k).view(r1 - r0, k)

    def quantized(self, base: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(qweight, scales) of the projection `base` (e.g. "model.layers.0.mlp.up_proj"):
        quant.quantize of its fp32 N(0, std) weight, named `base + ".weight"` for the hash."""
        n, k8 = self._names[base + ".qweight"][1]
        k = k8 * 8
        return quantize_blocks(self._rows(base + ".weight", "weight", n, k), n, k, self.device)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        if name.endswith(".qweight") or name.endswith(".scales"):
            base = name.rsplit(".", 1)[0]
            if self._last is None or self._last[0] != base:  # .qweight then .scales: one pass
                self._last = (base, self.quantized(base))
            return self._last[1][0 if name.endswith(".qweight") else 1]
        shape = self._names[name][1]
        table = "norm16" if name.endswith("norm.weight") else "weight16"
        n = shape[0]
        k = shape[1] if len(shape) == 2 else 1
        out = torch.empty(n, k, dtype=torch.float16, device=self.device)
        for r0, r1, rows in self._rows(name, table, n, k):
            out[r0:r1] = rows
        return out.view(shape)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
