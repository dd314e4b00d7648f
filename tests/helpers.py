"""Shared test fixtures: tiny Qwen2 configs, random weights in the `.nanoqwen` tensor naming,
a tiny real BPE tokenizer with a ChatML template, and a tiny `.nanoqwen` file writer.

Everything here is deterministic (fixed seeds; the BPE trainer is deterministic for a fixed
corpus) and needs nothing outside the repository, so app and CUDA tests can reuse it:

    from helpers import TINY_UNTIED, random_weights, file_tensors, tiny_tokenizer_json
    cfg = TINY_UNTIED
    tensors = file_tensors(cfg, random_weights(cfg, seed=0))   # what a .nanoqwen holds
    path = write_tiny_model(tmp_path / "m.nanoqwen")           # a whole file + tokenizer

Random weights follow transformers' init (normal, std 0.02) so logits have the scale of a
freshly initialised model; norm weights get a little noise around 1 so they are exercised.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from nanoqwen.engine.config import ModelConfig
from nanoqwen.engine.quant import dequantize, quantize

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# Untied embeddings, head_dim 128, GQA 2:1 (the 7B's shape family, scaled down).
TINY_UNTIED = ModelConfig(
    name="tiny-untied-hd128", vocab_size=512, hidden_size=256, intermediate_size=512,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    rope_theta=1_000_000.0, max_position_embeddings=4096, tie_word_embeddings=False)

# Tied embeddings, head_dim 64, GQA 2:1, a different RoPE theta (the 0.5B's family).
TINY_TIED = ModelConfig(
    name="tiny-tied-hd64", vocab_size=512, hidden_size=256, intermediate_size=384,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    rope_theta=10_000.0, max_position_embeddings=2048, tie_word_embeddings=True)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML as Qwen2.5 renders it, without the default system turn (tests choose the system
# prompt explicitly). trim_blocks/lstrip_blocks-safe: every block uses {%- -%} markers.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "Hello, world! How are you today? I am a helpful assistant.",
    "The quick brown fox jumps over the lazy dog.",
    "user assistant system: write a function that sorts a list of numbers",
    "日本語のテキスト, 中文, emoji 😀🎉, accents ñ é ü",
]


def random_weights(config: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Full-precision fp32 weights in Hugging Face Qwen2 naming (projections as `.weight`)."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(config.hidden_size, generator=g)

    h = config.hidden_size
    w = {"model.embed_tokens.weight": normal(config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "post_attention_layernorm.weight"] = norm_weight()
        for name, (n, k) in config.projection_shapes().items():
            w[p + name + ".weight"] = normal(n, k)
        for name, n in (("q_proj", config.q_size), ("k_proj", config.kv_size),
                        ("v_proj", config.kv_size)):
            w[p + f"self_attn.{name}.bias"] = normal(n)
    w["model.norm.weight"] = norm_weight()
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = normal(config.vocab_size, h)
    return w


def file_tensors(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights -> the tensors a `.nanoqwen` file holds (docs/INTERFACES.md):
    the seven projections as INT4 `.qweight` + `.scales`, everything else fp16."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if any(name.endswith(f".{proj}.weight") for proj in PROJECTIONS):
            base = name.removesuffix(".weight")
            out[base + ".qweight"], out[base + ".scales"] = quantize(t)
        else:
            out[name] = t.to(torch.float16)
    return out


def hf_state_dict(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """File tensors -> an fp32 state dict for transformers' Qwen2ForCausalLM holding exactly
    the weights the engine runs (projections dequantized, fp16 tensors upcast)."""
    sd: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            base = name.removesuffix(".qweight")
            sd[base + ".weight"] = dequantize(t, tensors[base + ".scales"], torch.float32)
        elif not name.endswith(".scales"):
            sd[name] = t.to(torch.float32)
    if config.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def hf_model(config: ModelConfig, tensors: dict[str, torch.Tensor]):
    """transformers' Qwen2ForCausalLM (fp32, eager attention) with the engine's weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**config.to_hf_config(), attn_implementation="eager"))
    missing, unexpected = model.load_state_dict(hf_state_dict(config, tensors), strict=False)
    # the tied head is one tensor in transformers, so lm_head may be reported either way
    assert not [m for m in missing if m != "lm_head.weight"], missing
    assert not unexpected, unexpected
    return model.float().eval()


@functools.lru_cache(maxsize=None)
def tiny_tokenizer_json(vocab_size: int = 400) -> str:
    """A byte-level BPE tokenizer.json trained on a small fixed corpus, with ChatML special
    tokens (ids 0 `<|endoftext|>`, 1 `<|im_start|>`, 2 `<|im_end|>`). Byte-level, so any
    text (CJK, emoji) encodes; `vocab_size` must stay below the model's vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok.to_str()


def tiny_tokenizer():
    """The tiny tokenizer as an engine `Tokenizer` (ChatML template, stops on <|im_end|>)."""
    from nanoqwen.engine.tokenizer import Tokenizer

    return Tokenizer(tiny_tokenizer_json(), CHATML_TEMPLATE, eos_token_ids=[2, 0])


def reference_backend(config: ModelConfig = TINY_UNTIED, seed: int = 0, **kw):
    """A ReferenceBackend over fresh random (INT4-quantized) weights."""
    from nanoqwen.engine.backends.reference import ReferenceBackend

    return ReferenceBackend(config, file_tensors(config, random_weights(config, seed)), **kw)


def write_tiny_model(path: str | Path, config: ModelConfig = TINY_UNTIED, seed: int = 0,
                     generation: dict | None = None) -> Path:
    """Write a random-weight `.nanoqwen` file embedding the tiny tokenizer and ChatML template."""
    from nanoqwen.engine.format import write_model

    path = Path(path)
    tensors = file_tensors(config, random_weights(config, seed))
    write_model(path, config, tensors.items(), tokenizer_json=tiny_tokenizer_json(),
                chat_template=CHATML_TEMPLATE,
                special_tokens={"eos_token_ids": [2, 0], "pad_token_id": 0},
                generation=generation if generation is not None else {})
    return path
