"""RoPE's angle tables, the one definition every user of them builds on (the reference forward,
the CUDA backend's cos/sin buffers, the kernel tests).

As Hugging Face's Qwen2RotaryEmbedding: inv_freq[i] = 1 / theta^(2i / head_dim), computed in
fp32 from an int64 arange, and the angle of position p is fp32(p) * inv_freq[i]. The tables are
built on the CPU (the callers move them), so every backend rotates by the same fp32 angles.
"""

from __future__ import annotations

import torch


def rope_freqs(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Angles fp32 [T, head_dim/2] for integer positions [T] (CPU)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return positions.float()[:, None] * inv_freq[None, :]


def rope_tables(n_pos: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [n_pos, head_dim/2] of positions 0..n_pos-1 (CPU): the half tables the
    kernels read (rope_kv_write, attention_decode), each frequency once."""
    freqs = rope_freqs(torch.arange(n_pos), head_dim, theta)
    return freqs.cos().contiguous(), freqs.sin().contiguous()
