"""Synthetic models (engine/synthetic.py): the file `nanoqwen convert --synthetic` writes holds
the tensors SyntheticWeights makes (the generator `nanoqwen bench --synthetic` runs on the GPU),
and those do not depend on the block size or the device (tests/gpu/test_synthetic_gpu.py compares
the GPU's against these on a CUDA machine)."""

import torch

from nanoqwen.engine import synthetic as syn
from nanoqwen.engine.config import ModelConfig
from nanoqwen.engine.convert import synthetic
from nanoqwen.engine.format import open_model

TINY = ModelConfig(name="syn", vocab_size=512, hidden_size=256, intermediate_size=384,
                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   tie_word_embeddings=False)


def test_the_file_holds_the_synthetic_weights(tmp_path):
    path = tmp_path / "s.nanoqwen"
    synthetic(TINY, path, seed=3)
    w = syn.SyntheticWeights(TINY, seed=3, device="cpu")
    with open_model(path, verify=True) as mf:
        assert set(mf.tensors) == set(w)
        for name in mf.tensors:
            assert torch.equal(mf.tensor(name), w[name]), name


def test_block_size_and_read_order_do_not_change_a_bit():
    # the GPU makes blocks of GPU_BLOCK_ELEMS, the CPU of quant.BLOCK_ELEMS: 1000 elements
    # (3 rows of 256, 2 of 384) splits every tensor into many partial blocks
    a = syn.SyntheticWeights(TINY, seed=5, device="cpu")
    b = syn.SyntheticWeights(TINY, seed=5, device="cpu", block_elems=1000)
    names = list(a)
    for name in names:
        assert torch.equal(a[name], b[name]), name
    for name in reversed(names):  # scales before qweight, last tensor first
        assert torch.equal(a[name], b[name]), name


def _hash_py(i: int, a: int, b: int) -> int:
    x = (i * a + b) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    x ^= x >> 15
    return x >> 16


def test_hash_is_the_integer_function_it_claims():
    # exact integer arithmetic is what makes CPU and GPU agree; Python ints have no overflow
    key = syn._key(7, "model.layers.0.mlp.up_proj.weight")
    assert key[0] % 2 == 1 and key[0] < 2**31 and key[1] < 2**32
    for start in (0, 12345, 2**32 - 600):
        got = syn.hash_index(start, 500, key, "cpu").tolist()
        assert got == [_hash_py(start + i, *key) for i in range(500)]


def test_distributions_are_the_benchmarks():
    w = syn.SyntheticWeights(TINY, seed=0, device="cpu")
    emb = w["model.embed_tokens.weight"].float()
    assert emb.dtype == torch.float32 and abs(emb.mean()) < 0.002 and 0.019 < emb.std() < 0.021
    norm = w["model.layers.1.input_layernorm.weight"].float()
    assert abs(norm.mean() - 1) < 0.02 and 0.08 < norm.std() < 0.12  # 1 + 0.1 N(0, 1)
    bias = w["model.layers.0.self_attn.q_proj.bias"].float()
    assert 0.015 < bias.std() < 0.025
    # N(0, 0.02) rows: amax per group of 128 is ~2.6 sigma -> scale ~0.0075
    s = w["model.layers.0.mlp.down_proj.scales"].float()
    assert 0.006 < s.mean() < 0.009
    assert not torch.equal(w["model.layers.0.mlp.up_proj.qweight"],
                           syn.SyntheticWeights(TINY, seed=1)["model.layers.0.mlp.up_proj.qweight"])
    # different tensors are not copies of each other
    assert not torch.equal(w["model.layers.0.self_attn.k_proj.bias"],
                           w["model.layers.0.self_attn.v_proj.bias"])
