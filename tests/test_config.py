"""ModelConfig: the published Qwen2.5-Coder shapes, HF config.json round trips, and refusals
that name the offending field."""

import json

import pytest

from nanoqwen.engine.config import PRESETS, ConfigError, ModelConfig

# (layers, hidden, intermediate, q heads, kv heads, head_dim, vocab, tied) as published
# (../shared/qwen2-tokenizer/README.md; the 7B row is also in the project's seeds).
PUBLISHED = {
    "0.5b": (24, 896, 4864, 14, 2, 64, 151936, True),
    "1.5b": (28, 1536, 8960, 12, 2, 128, 151936, True),
    "3b": (36, 2048, 11008, 16, 2, 128, 151936, True),
    "7b": (28, 3584, 18944, 28, 4, 128, 152064, False),
    "14b": (48, 5120, 13824, 40, 8, 128, 152064, False),
    "32b": (64, 5120, 27648, 40, 8, 128, 152064, False),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_published_shapes(name):
    c = ModelConfig.from_name(name)
    got = (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads,
           c.num_key_value_heads, c.head_dim, c.vocab_size, c.tie_word_embeddings)
    assert got == PUBLISHED[name]
    assert c.rope_theta == 1e6 and c.rms_norm_eps == 1e-6 and c.max_position_embeddings == 32768
    assert c.q_size == c.hidden_size and c.gqa_ratio * c.num_key_value_heads == c.num_attention_heads


def test_preset_names_accept_full_model_names():
    assert ModelConfig.from_name("Qwen2.5-Coder-7B-Instruct").hidden_size == 3584
    with pytest.raises(ConfigError, match="unknown preset '13b'"):
        ModelConfig.from_name("13b")


def test_7b_bytes_per_token_matches_design_figure():
    # ARCHITECTURE.md: about 4.46 GB read per decoded token (INT4 g128 + fp16 lm_head).
    assert abs(ModelConfig.from_name("7b").decode_bytes_per_token() / 1e9 - 4.46) < 0.01


def test_hf_config_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    c = ModelConfig.from_name("0.5b")
    hf = transformers.Qwen2Config(**c.to_hf_config()).to_dict()
    p = tmp_path / "config.json"
    p.write_text(json.dumps(hf))
    back = ModelConfig.from_hf_config(p, name=c.name)
    assert back.to_dict() == c.to_dict()
    assert ModelConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("change, field", [
    (dict(head_dim=96, hidden_size=96 * 4, num_attention_heads=4), "head_dim=96"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3"),
    (dict(intermediate_size=1000), "intermediate_size=1000"),
    (dict(hidden_size=0), "hidden_size=0"),
    (dict(rope_theta=-1.0), "rope_theta"),
])
def test_bad_shapes_are_refused_naming_the_field(change, field):
    kw = dict(PRESETS["0.5b"], name="x")
    kw.update(change)
    with pytest.raises(ConfigError) as e:
        ModelConfig(**kw)
    assert field in str(e.value)


@pytest.mark.parametrize("change, text", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "model_type='llama'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"use_sliding_window": True}, "use_sliding_window"),
])
def test_unsupported_hf_configs_are_refused(change, text):
    hf = ModelConfig.from_name("0.5b").to_hf_config()
    hf.update(change)
    with pytest.raises(ConfigError, match=text.replace("[", r"\[")):
        ModelConfig.from_hf_config(hf)


def test_hf_config_missing_fields_named():
    hf = ModelConfig.from_name("0.5b").to_hf_config()
    del hf["intermediate_size"]
    with pytest.raises(ConfigError, match="intermediate_size"):
        ModelConfig.from_hf_config(hf)
