"""Model configuration for the Qwen2 / Qwen2.5-Coder family.

One dataclass describes every model the engine runs: the six published Qwen2.5-Coder
sizes are presets, a Hugging Face `config.json` converts into it, and the `.nanoqwen`
header stores it as a plain dict. Everything the kernels need to specialise on
(head_dim, GQA ratio, tied embeddings) is a field here, so a new size is config, not code.

Invariants checked in `__post_init__` (each failure names the field):
  hidden_size == num_attention_heads * head_dim
  num_attention_heads % num_key_value_heads == 0
  head_dim in {64, 128}            (the kernels specialise on these)
  hidden_size and intermediate_size are multiples of group_size (INT4 groups along K)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_HEAD_DIMS = (64, 128)
QUANT_GROUP_SIZE = 128
KV_PAGE_SIZE = 16


from .errors import NanoqwenError


class ConfigError(NanoqwenError, ValueError):
    """A model configuration the engine cannot run; the message names the field."""


@dataclass
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: derived as hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    group_size: int = QUANT_GROUP_SIZE
    # derived
    q_size: int = field(init=False)
    kv_size: int = field(init=False)
    gqa_ratio: int = field(init=False)

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{f}={v!r} must be a positive integer")
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.num_attention_heads}")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ConfigError(f"head_dim={self.head_dim} is not supported "
                              f"(supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})")
        if self.num_attention_heads * self.head_dim != self.hidden_size:
            raise ConfigError(
                f"num_attention_heads*head_dim={self.num_attention_heads * self.head_dim} "
                f"!= hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.group_size != QUANT_GROUP_SIZE:
            raise ConfigError(f"group_size={self.group_size} is not supported (only {QUANT_GROUP_SIZE})")
        for f in ("hidden_size", "intermediate_size"):
            if getattr(self, f) % self.group_size:
                raise ConfigError(f"{f}={getattr(self, f)} is not a multiple of "
                                  f"the INT4 group size {self.group_size}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps} must be > 0")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta={self.rope_theta} must be > 0")
        self.q_size = self.num_attention_heads * self.head_dim
        self.kv_size = self.num_key_value_heads * self.head_dim
        self.gqa_ratio = self.num_attention_heads // self.num_key_value_heads

    # --- construction -----------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        key = name.lower().removeprefix("qwen2.5-coder-").removesuffix("-instruct")
        if key not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
        return cls(name=f"Qwen2.5-Coder-{key.upper()}-Instruct", **PRESETS[key])

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any] | str | Path, name: str | None = None) -> "ModelConfig":
        """From a Hugging Face Qwen2 `config.json` (a dict or a path to the file)."""
        if not isinstance(hf, dict):
            hf = json.loads(Path(hf).read_text())
        # transformers builds the model from model_type (AutoConfig's key); `architectures`
        # only names the head class. So a "llama" config is Llama (no q/k/v bias) whatever
        # its architectures say.
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        if model_type != "qwen2":
            why = (f" (architectures={archs!r} does not decide it: transformers reads this "
                   f"checkpoint as {model_type!r})" if model_type and archs else "")
            raise ConfigError(f"model_type={model_type!r} is not supported: only model_type "
                              f"'qwen2' with architectures ['Qwen2ForCausalLM'] (Qwen2, "
                              f"Qwen2.5, Qwen2.5-Coder){why}")
        if archs and "Qwen2ForCausalLM" not in archs:
            raise ConfigError(f"architectures={archs!r} is not supported: only "
                              "Qwen2ForCausalLM (a causal LM head)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={hf['hidden_act']!r} is not supported (only silu)")
        rs = hf.get("rope_scaling")
        if rs and rs.get("type", rs.get("rope_type")) not in (None, "default"):
            raise ConfigError(f"rope_scaling={rs!r} is not supported (only plain RoPE)")
        if hf.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests it under rope_parameters
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        return cls(
            name=name or str(hf.get("_name_or_path") or "qwen2").rstrip("/").split("/")[-1]
            or "qwen2",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            head_dim=hf.get("head_dim") or 0,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A transformers `Qwen2Config` kwargs dict (used by tests and the synthetic writer)."""
        return dict(
            architectures=["Qwen2ForCausalLM"], model_type="qwen2",
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, hidden_act="silu",
            use_sliding_window=False, attention_dropout=0.0,
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config fields: {', '.join(sorted(unknown))}")
        return cls(**d)

    # --- sizes --------------------------------------------------------------------------
    def check_context(self, n: int, what: str = "max_context") -> int:
        """n (a context asked for: a backend's max_context, a benchmark's -p + -n) if the model
        holds it, else NanoqwenError with the numbers: the one check of a context length."""
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise NanoqwenError(f"{what} = {n!r} must be a positive integer")
        if n > self.max_position_embeddings:
            raise NanoqwenError(f"{what} = {n} exceeds the model's context "
                                f"{self.max_position_embeddings} (max_position_embeddings)")
        return n

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """The seven INT4 projections of one layer: name -> (out_features N, in_features K)."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "self_attn.q_proj": (self.q_size, h),
            "self_attn.k_proj": (self.kv_size, h),
            "self_attn.v_proj": (self.kv_size, h),
            "self_attn.o_proj": (h, self.q_size),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
        }

    def decode_bytes_per_token(self) -> int:
        """Bytes of weights a batch-1 decode step must read (INT4 + fp16 scales + fp16 lm_head).

        The KV cache read is excluded: it depends on the context length.
        """
        per_layer = 0
        for n, k in self.projection_shapes().values():
            per_layer += n * k // 2 + n * (k // self.group_size) * 2
        per_layer += (self.q_size + 2 * self.kv_size) * 2 + 2 * self.hidden_size * 2
        return (self.num_hidden_layers * per_layer + self.vocab_size * self.hidden_size * 2
                + self.hidden_size * 2)


# The published Qwen2.5-Coder shapes (see ../shared/qwen2-tokenizer/README.md).
PRESETS: dict[str, dict[str, Any]] = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "14b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "32b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
}
