"""Python wrappers over `torch.ops.nanoqwen.*` (csrc/bindings.cpp): allocate outputs,
document shapes. Every op launches on the current CUDA stream.

The decode step and the prefill run in C++ (csrc/engine.cu, the Engine class in
csrc/bindings.cpp) on preallocated buffers; these allocating wrappers are for tests and
benchmarks. attention_decode has no wrapper: it writes the cache and needs the caller's
workspace and counters, so its callers use the raw op.

Shapes: H hidden, T tokens, nh/nkv query/kv heads, D head_dim, V vocab, N x K weights
(INT4: qweight int32 [N, K/8], scales fp16 [N, K/128]; engine/quant.py is the layout).
"""

from __future__ import annotations

import torch

from .build import load_extension


def _ops():
    load_extension()
    return torch.ops.nanoqwen


def embed_gather(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table fp16 [V, H], ids int32 [T] (device) -> hidden fp32 [T, H]."""
    out = torch.empty(ids.shape[0], table.shape[1], dtype=torch.float32, device=table.device)
    _ops().embed_gather(out, table, ids)
    return out


def rmsnorm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """hidden fp32 [T, H], weight fp16 [H] -> fp16 [T, H]."""
    out = torch.empty(hidden.shape, dtype=torch.float16, device=hidden.device)
    _ops().rmsnorm(out, hidden, weight, float(eps))
    return out


def rope_kv_write(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                  page_table: torch.Tensor, n_heads: int) -> torch.Tensor:
    """qkv fp16 [T, (nh + 2 nkv) D] at positions pos[0].. -> q fp16 [T, nh, D] (rotated).

    Rotated k and plain v go into k_cache/v_cache fp16 [num_pages, 16, nkv, D] (one layer)
    through page_table int32 [pages]. cos/sin fp32 [>= pages*16, D/2]; pos int32 [1] (device).
    """
    d = k_cache.shape[3]
    q = torch.empty(qkv.shape[0], n_heads, d, dtype=torch.float16, device=qkv.device)
    _ops().rope_kv_write(q, k_cache, v_cache, qkv, cos, sin, pos, page_table)
    return q


def sample_token(logits: torch.Tensor, ctx_tokens: torch.Tensor, pos: torch.Tensor,
                 params_f: torch.Tensor, params_i: torch.Tensor,
                 counter: torch.Tensor) -> torch.Tensor:
    """logits fp32 [V] -> int32 [1] token id. ctx_tokens int32 [C] (ids of positions
    0..pos[0] are the penalty's history), params_f fp32 [4] = (temperature, top_p, min_p,
    repeat_penalty), params_i int64 [4] = (top_k, repeat_last_n, seed, 0), counter int64 [1]."""
    out = torch.empty(1, dtype=torch.int32, device=logits.device)
    work = torch.empty_like(logits)
    _ops().sample_token(out, work, logits, ctx_tokens, pos, params_f, params_i, counter)
    return out


def sampler_values(params, seed: int) -> tuple[list[float], list[int]]:
    """sample_token's params_f and params_i (csrc/kernels.h) from a SamplerParams and a
    resolved seed, as lists."""
    pf = [params.temperature, params.top_p, params.min_p, params.repeat_penalty]
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    if seed >= 2**63:  # stored as int64 bits; the kernel reads them back as uint64
        seed -= 2**64
    return pf, [params.top_k, params.repeat_last_n, seed, 0]


def sampler_tensors(params, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(params_f, params_i) for sample_token from a SamplerParams and a resolved seed."""
    pf, pi = sampler_values(params, seed)
    return (torch.tensor(pf, dtype=torch.float32).to(device),
            torch.tensor(pi, dtype=torch.int64).to(device))


def _out_shape(x: torch.Tensor, n: int) -> tuple[int, ...]:
    """A GEMV's output shape: [N] for x [K], [cols, N] for x [cols, K] (cols <= 16)."""
    return (n,) if x.dim() == 1 else (x.shape[0], n)


def gemv_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x fp16 [K] (or [cols, K]) -> y fp16 [N] (or [cols, N]) = W x + bias."""
    y = torch.empty(_out_shape(x, qweight.shape[0]), dtype=torch.float16, device=x.device)
    _ops().gemv_int4(y, x, qweight, scales, bias)
    return y


def gemv_int4_residual_(hidden: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor,
                        scales: torch.Tensor) -> torch.Tensor:
    """hidden fp32 [N] (or [cols, N]) += W x (in place); returns hidden."""
    _ops().gemv_int4_residual(hidden, x, qweight, scales)
    return hidden


def gemv_int4_silu_mul(x: torch.Tensor, qw_gate: torch.Tensor, sc_gate: torch.Tensor,
                       qw_up: torch.Tensor, sc_up: torch.Tensor) -> torch.Tensor:
    """x fp16 [K] (or [cols, K]) -> fp16 [N] (or [cols, N]) = silu(Wg x) * (Wu x)."""
    out = torch.empty(_out_shape(x, qw_gate.shape[0]), dtype=torch.float16, device=x.device)
    _ops().gemv_int4_silu_mul(out, x, qw_gate, sc_gate, qw_up, sc_up)
    return out


def gemv_fp16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x fp16 [K] (or [cols, K]), w fp16 [N, K] -> fp32 [N] (or [cols, N])."""
    out = torch.empty(_out_shape(x, w.shape[0]), dtype=torch.float32, device=x.device)
    _ops().gemv_fp16(out, x, w)
    return out


def dequant_int4(qweight: torch.Tensor, scales: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """INT4 [N, K/8] + scales [N, K/128] -> fp16 [N, K] (into `out` when given)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    if out is None:
        out = torch.empty(n, k, dtype=torch.float16, device=qweight.device)
    _ops().dequant_int4(out, qweight, scales)
    return out
