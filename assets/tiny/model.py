"""The tiny model's architecture and shapes: a plain-PyTorch Qwen2 used for training.

Parameter names are Hugging Face's `Qwen2ForCausalLM` names (model.embed_tokens.weight,
model.layers.{i}.self_attn.q_proj.weight, ...), and the math is HF's: RMSNorm with the
variance in fp32, rotate_half RoPE, GQA, SwiGLU, bias on q/k/v only, tied lm_head. So the
trained weights load unchanged into `transformers.Qwen2ForCausalLM` and into nanoqwen's
backends (`check_against_hf` in the smoke test proves the first).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# The shipped shapes. head_dim 64 (8 heads x 64 = 512), hidden and intermediate multiples of
# the INT4 group 128, GQA 4:1, vocab 12288 = 96 x 128. About 30.5M parameters (6.3M of them
# the tied embedding). RoPE theta 10000: the model is trained at 2048 tokens, where the
# classic base resolves positions well; Qwen2's 1e6 exists for 32k+ contexts.
TINY = dict(vocab_size=12288, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
            rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True)
# The CPU smoke test's shapes: same architecture, a few seconds a step on two cores.
MICRO = dict(TINY, vocab_size=1024, hidden_size=128, intermediate_size=256,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=256)


class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope(T: int, d: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=device).float() / d))
    f = torch.arange(T, device=device).float()[:, None] * inv[None, :]
    emb = torch.cat((f, f), dim=-1)                      # [T, d]
    return emb.cos(), emb.sin()


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, d = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.d = c["num_attention_heads"], c["num_key_value_heads"], d
        self.q_proj = nn.Linear(h, self.nh * d, bias=True)
        self.k_proj = nn.Linear(h, self.nkv * d, bias=True)
        self.v_proj = nn.Linear(h, self.nkv * d, bias=True)
        self.o_proj = nn.Linear(self.nh * d, h, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.d).transpose(1, 2)    # [B, nh, T, d]
        k = self.k_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)   # [B, nkv, T, d]
        v = self.v_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv   # expand K/V so SDPA can take its flash kernel
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.nh * self.d))


class MLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Qwen2(nn.Module):
    """Qwen2ForCausalLM with tied embeddings. forward(ids [B, T]) -> logits [B, T, V], or the
    mean next-token cross-entropy when `targets` [B, T] is given (ignore_index -100)."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = dict(c)
        self.model = Body(c)
        cos, sin = rope(c["max_position_embeddings"], c["head_dim"], c["rope_theta"], "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        resid = 0.02 / math.sqrt(2 * self.c["num_hidden_layers"])  # GPT-2's residual scaling
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                std = resid if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, ids, targets=None):
        T = ids.shape[1]
        x = self.model.embed_tokens(ids)
        cos, sin = self.cos[:T], self.sin[:T]
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        logits = x @ self.model.embed_tokens.weight.t()            # tied lm_head
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100)


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def hf_config(c: dict) -> dict:
    """transformers Qwen2Config kwargs for these shapes."""
    return dict(c, architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                use_sliding_window=False, attention_dropout=0.0)


@torch.no_grad()
def check_against_hf(model: Qwen2, device="cpu") -> float:
    """Max |logit difference| between this module and transformers' Qwen2ForCausalLM on the
    same weights (fp32, random ids). Raises if transformers is missing."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(**hf_config(model.c))
    hf = Qwen2ForCausalLM(cfg).float().to(device).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected, unexpected
    assert all(k == "lm_head.weight" for k in missing), missing
    hf.tie_weights()
    ids = torch.randint(0, model.c["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    ours = model.float().eval()(ids)
    theirs = hf(ids).logits
    return (ours - theirs).abs().max().item()
