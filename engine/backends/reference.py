"""The reference backend: a plain-PyTorch Qwen2 forward over the `.nanoqwen` weights.

It is the oracle for every CUDA kernel and the CPU fallback of the app, so it is written to
be read, not to be fast: one function per block, shapes beside each line, fp32 compute.
The INT4 projections are dequantized once at load (`quant.dequantize`) and held in `dtype`;
fp16 tensors (embeddings, norms, biases, lm_head) are upcast to `dtype` too.

Math, as Hugging Face's Qwen2ForCausalLM:
    x = embed[ids]
    per layer:  h = rmsnorm(x) ; q,k,v = h W^T + b ; RoPE(q, k) (rotate_half, theta from
                config) ; K/V into the paged cache ; causal GQA softmax(q k^T / sqrt(d)) v ;
                x += o_proj(attn) ; h = rmsnorm(x) ; x += down(silu(gate(h)) * up(h))
    logits = lm_head(rmsnorm(x))    (lm_head = embed when tied)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kv_cache import KVCache
from ..quant import dequantize
from .base import Backend, ModelFileTensors

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
CPU_MAX_CONTEXT = 4096  # the CPU fallback is for small models and short chats


@dataclass
class _Layer:
    ln1: torch.Tensor                 # [H]
    ln2: torch.Tensor                 # [H]
    w: dict[str, torch.Tensor]        # projection name -> W [N, K]
    bq: torch.Tensor                  # [q_size]
    bk: torch.Tensor                  # [kv_size]
    bv: torch.Tensor                  # [kv_size]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> x / sqrt(mean(x^2) + eps) * weight, the variance taken in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for integer positions [T] (frequencies repeated twice, as HF)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]          # [T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)                          # [T, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]: x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x[d/2:], x[:d/2])."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int) -> torch.Tensor:
    """Causal GQA attention.

    q [T, n_heads, d] at positions pos0..pos0+T-1; k, v [S, n_kv, d] at positions 0..S-1
    (S = pos0 + T). Query head h reads kv head h // (n_heads / n_kv), as HF's repeat_kv.
    Returns [T, n_heads * d].
    """
    t, n_heads, d = q.shape
    s, n_kv, _ = k.shape
    ratio = n_heads // n_kv
    k = k.repeat_interleave(ratio, dim=1)                            # [S, n_heads, d]
    v = v.repeat_interleave(ratio, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)       # [n_heads, T, S]
    q_pos = torch.arange(pos0, pos0 + t)[:, None]
    k_pos = torch.arange(s)[None, :]
    scores = scores.masked_fill((k_pos > q_pos).to(scores.device), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = torch.einsum("hts,shd->thd", probs, v)                     # [T, n_heads, d]
    return out.reshape(t, n_heads * d)


class ReferenceBackend(Backend):
    name = "reference"
    modes = ("eager",)

    def __init__(self, config: ModelConfig, tensors: Mapping[str, torch.Tensor],
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 max_context: int | None = None, kv_dtype: torch.dtype | None = None,
                 progress: Callable[[int, int, str], None] | None = None) -> None:
        device = torch.device(device)
        if max_context is None:
            max_context = config.max_position_embeddings
            if device.type == "cpu":
                max_context = min(max_context, CPU_MAX_CONTEXT)
        if max_context > config.max_position_embeddings:
            raise ValueError(f"max_context={max_context} exceeds the model's "
                             f"max_position_embeddings={config.max_position_embeddings}")
        super().__init__(config, max_context)
        self.device, self.dtype = device, dtype
        self.device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else "cpu")
        self._load(tensors, progress)
        self.cache = KVCache(config.num_hidden_layers, config.num_key_value_heads,
                             config.head_dim, max_context, kv_dtype or dtype, device)

    @classmethod
    def from_model_file(cls, mf, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, max_context: int | None = None,
                        progress: Callable[[int, int, str], None] | None = None
                        ) -> "ReferenceBackend":
        """From an open `format.ModelFile` (tensors are read lazily from its mmap)."""
        return cls(mf.config, ModelFileTensors(mf), device=device, dtype=dtype,
                   max_context=max_context, progress=progress)

    # --- weights ---------------------------------------------------------------------------
    def _load(self, tensors: Mapping[str, torch.Tensor],
              progress: Callable[[int, int, str], None] | None) -> None:
        # progress(done, total, what) as format.Progress, counted in layers here
        c = self.config

        def get(name: str) -> torch.Tensor:
            if name not in tensors:
                raise KeyError(f"tensor {name!r} is missing")
            return tensors[name].to(device=self.device, dtype=self.dtype)

        self.embed = get("model.embed_tokens.weight")                   # [V, H]
        self.norm = get("model.norm.weight")                            # [H]
        self.lm_head = self.embed if c.tie_word_embeddings else get("lm_head.weight")
        self.layers: list[_Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            w = {}
            for proj in PROJECTIONS:
                qweight, scales = tensors[p + proj + ".qweight"], tensors[p + proj + ".scales"]
                w[proj] = dequantize(qweight, scales, self.dtype).to(self.device)  # [N, K]
            self.layers.append(_Layer(
                ln1=get(p + "input_layernorm.weight"), ln2=get(p + "post_attention_layernorm.weight"),
                w=w, bq=get(p + "self_attn.q_proj.bias"), bk=get(p + "self_attn.k_proj.bias"),
                bv=get(p + "self_attn.v_proj.bias")))
            if progress is not None:
                progress(i + 1, c.num_hidden_layers, f"layer {i}")

    # --- forward ---------------------------------------------------------------------------
    def forward_all(self, tokens) -> torch.Tensor:
        """Like forward() but returns fp32 logits of every token, [T, V] (for tests/oracles)."""
        tokens = self._checked(tokens)
        return self._append(tokens, lambda t, pos: self._run(t, pos, all_logits=True))

    def _forward(self, tokens: list[int], pos: int) -> torch.Tensor:
        return self._run(tokens, pos, all_logits=False)

    def _truncate(self, n: int) -> None:
        self.cache.rollback(n)

    @torch.inference_mode()
    def _run(self, tokens: list[int], pos0: int, all_logits: bool) -> torch.Tensor:
        c = self.config
        nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        t = len(tokens)
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        x = self.embed[ids]                                              # [T, H]
        cos, sin = rope_cos_sin(torch.arange(pos0, pos0 + t), d, c.rope_theta, self.dtype)
        cos, sin = cos.to(self.device), sin.to(self.device)
        self.cache.reserve(pos0 + t)
        for li, layer in enumerate(self.layers):
            h = rms_norm(x, layer.ln1, c.rms_norm_eps)
            q = (h @ layer.w["self_attn.q_proj"].T + layer.bq).view(t, nh, d)
            k = (h @ layer.w["self_attn.k_proj"].T + layer.bk).view(t, nkv, d)
            v = (h @ layer.w["self_attn.v_proj"].T + layer.bv).view(t, nkv, d)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self.cache.write(li, pos0, k, v)
            k_all, v_all = self.cache.gather(li, pos0 + t)               # [S, n_kv, d]
            a = attention(q, k_all.to(self.dtype), v_all.to(self.dtype), pos0)  # [T, q_size]
            x = x + a @ layer.w["self_attn.o_proj"].T
            h = rms_norm(x, layer.ln2, c.rms_norm_eps)
            g = F.silu(h @ layer.w["mlp.gate_proj"].T) * (h @ layer.w["mlp.up_proj"].T)
            x = x + g @ layer.w["mlp.down_proj"].T
        x = x if all_logits else x[-1:]
        logits = rms_norm(x, self.norm, c.rms_norm_eps) @ self.lm_head.T  # [T or 1, V]
        self.cache.length = pos0 + t
        logits = logits.float().cpu()
        return logits if all_logits else logits[0]
