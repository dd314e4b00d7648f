"""HF checkpoint -> .nanoqwen conversion, synthetic models, and the convert/info commands.

Checkpoints are built by transformers' own `save_pretrained` (sharded, with its index), so the
test reads exactly what a real Qwen2 directory holds, at toy sizes."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import helpers
from nanoqwen.engine import convert
from nanoqwen.engine.cli import main
from nanoqwen.engine.config import ModelConfig
from nanoqwen.engine.convert import convert_hf, synthetic
from nanoqwen.engine.errors import FormatError
from nanoqwen.engine.format import expected_tensors, open_model
from nanoqwen.engine.quant import quantize

transformers = pytest.importorskip("transformers")

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VARIANTS = {  # name: (Qwen2Config kwargs, dtype saved)
    "tied-hd64-fp32": (dict(num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=True), torch.float32),
    "untied-hd128-bf16": (dict(num_attention_heads=2, num_key_value_heads=1,
                               tie_word_embeddings=False), torch.bfloat16),
}


def tokenizer_text() -> str:
    """The tiny byte-level BPE tokenizer (400 ids): it fits the test models' vocabularies."""
    return helpers.tiny_tokenizer_json()


def token_id(text: str, token: str) -> int:
    return next(t["id"] for t in json.loads(text)["added_tokens"] if t["content"] == token)


def make_checkpoint(d: Path, variant: str, shard: str | None = "200KB") -> Path:
    kwargs, dtype = VARIANTS[variant]
    cfg = transformers.Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=384,
                                   num_hidden_layers=2, max_position_embeddings=512, **kwargs)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # transformers zero-inits biases and sets norms to 1: randomise them
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
    tok = tokenizer_text()
    (d / "tokenizer.json").write_text(tok, encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    eot, im_end = token_id(tok, "<|endoftext|>"), token_id(tok, "<|im_end|>")
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [im_end, eot], "pad_token_id": eot, "temperature": 0.7, "top_p": 0.8,
         "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
         "transformers_version": transformers.__version__}))
    return d


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {v: make_checkpoint(tmp_path_factory.mktemp(v), v) for v in VARIANTS}


def load_all(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, framework="pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_convert_matches_quantize_of_the_original(tmp_path, checkpoints, variant):
    d = checkpoints[variant]
    assert len(list(d.glob("model-*.safetensors"))) >= 2, "fixture should be sharded"
    out = tmp_path / "m.nanoqwen"
    seen = []
    config = convert_hf(d, out, progress=lambda done, total, name: seen.append((done, total)))
    assert seen[-1][0] == seen[-1][1]
    src = load_all(d)
    kwargs, _ = VARIANTS[variant]
    with open_model(out, verify=True) as mf:
        assert mf.config == config
        c = mf.config
        assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size) == \
            (256, 384, 2, 1000)
        assert c.head_dim == 256 // kwargs["num_attention_heads"]
        assert c.tie_word_embeddings == kwargs["tie_word_embeddings"]
        assert c.max_position_embeddings == 512
        assert ("lm_head.weight" in mf.tensors) == (not c.tie_word_embeddings)
        for name in expected_tensors(c):
            if name.endswith(".scales"):
                continue
            if name.endswith(".qweight"):
                base = name.removesuffix(".qweight")
                q, s = quantize(src[base + ".weight"].float())
                assert torch.equal(mf.tensor(name), q), name
                assert torch.equal(mf.tensor(base + ".scales"), s), base
            else:
                want = src[name].float().half()
                assert torch.equal(mf.tensor(name).view(torch.int16), want.view(torch.int16)), name
        tok = tokenizer_text()
        assert mf.tokenizer_json == tok and mf.chat_template == TEMPLATE
        assert mf.special_tokens["eos_token_ids"] == [token_id(tok, "<|im_end|>"),
                                                      token_id(tok, "<|endoftext|>")]
        assert mf.special_tokens["pad_token_id"] == token_id(tok, "<|endoftext|>")
        assert mf.generation["temperature"] == 0.7 and mf.generation["top_k"] == 20
        assert "transformers_version" not in mf.generation


def test_single_file_checkpoint_and_optional_files_absent(tmp_path):
    d = make_checkpoint(tmp_path / "hf", "tied-hd64-fp32", shard=None)
    assert (d / "model.safetensors").is_file()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (d / f).unlink()
    convert_hf(d, tmp_path / "m.nanoqwen", max_context=128)
    with open_model(tmp_path / "m.nanoqwen", verify=True) as mf:
        assert mf.tokenizer_json is None and mf.chat_template is None
        assert mf.special_tokens["eos_token_ids"] == [] and mf.generation == {}
        assert mf.config.max_position_embeddings == 128


def test_missing_config(tmp_path, checkpoints):
    d = tmp_path / "hf"
    shutil.copytree(checkpoints["tied-hd64-fp32"], d)
    (d / "config.json").unlink()
    with pytest.raises(FormatError, match="no config.json"):
        convert_hf(d, tmp_path / "m.nanoqwen")
    with pytest.raises(FormatError, match="not a directory"):
        convert_hf(tmp_path / "nope", tmp_path / "m.nanoqwen")
    assert not (tmp_path / "m.nanoqwen").exists()


@pytest.mark.parametrize("archs", [["LlamaForCausalLM"], ["Qwen2ForCausalLM"]])
def test_model_type_decides_the_architecture(tmp_path, checkpoints, capsys, archs):
    # transformers builds a "llama" config as Llama (no q/k/v bias) whatever `architectures`
    # says; so do we, and refuse it saying what is supported
    d = tmp_path / "hf"
    shutil.copytree(checkpoints["tied-hd64-fp32"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="llama", architectures=archs)
    (d / "config.json").write_text(json.dumps(cfg))
    assert type(transformers.AutoConfig.from_pretrained(d)).__name__ == "LlamaConfig"
    err = refused(d, tmp_path / "out", capsys)
    assert "config.json: model_type='llama' is not supported: only model_type 'qwen2'" in err
    assert "Qwen2ForCausalLM" in err


def test_missing_tensor(tmp_path, checkpoints):
    d = tmp_path / "hf"
    shutil.copytree(checkpoints["untied-hd128-bf16"], d)
    name = "model.layers.1.self_attn.v_proj.bias"
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / idx["weight_map"].pop(name)
    kept = {k: v for k, v in load_all_file(shard).items() if k != name}
    save_file(kept, shard)
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(FormatError, match=rf"lacks 1 tensor.*{name}"):
        convert_hf(d, tmp_path / "m.nanoqwen")


def load_all_file(f: Path) -> dict[str, torch.Tensor]:
    with safe_open(f, framework="pt") as s:
        return {k: s.get_tensor(k) for k in s.keys()}


def test_missing_shard(tmp_path, checkpoints):
    d = tmp_path / "hf"
    shutil.copytree(checkpoints["untied-hd128-bf16"], d)
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FormatError, match=f"shard {victim.name}, which is missing"):
        convert_hf(d, tmp_path / "m.nanoqwen")


def test_wrong_shape(tmp_path, checkpoints):
    d = tmp_path / "hf"
    shutil.copytree(checkpoints["tied-hd64-fp32"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 512
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape "
                                          r"\[384, 256\], the config expects \[512, 256\]"):
        convert_hf(d, tmp_path / "m.nanoqwen")
    assert not (tmp_path / "m.nanoqwen").exists() and not list(tmp_path.glob(".*tmp"))


def test_fp16_overflow_and_foreign_tensor(tmp_path):
    d = make_checkpoint(tmp_path / "hf", "tied-hd64-fp32", shard=None)
    tensors = load_all_file(d / "model.safetensors")
    tensors["model.norm.weight"][3] = 1e5
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FormatError, match=r"'model.norm.weight' has a value of magnitude 100000"):
        convert_hf(d, tmp_path / "m.nanoqwen")
    tensors["model.norm.weight"][3] = 1.0
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(64)  # a Qwen3-style extra
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FormatError, match="does not use.*q_norm"):
        convert_hf(d, tmp_path / "m.nanoqwen")


TINY_SYN = ModelConfig(name="syn", vocab_size=512, hidden_size=256, intermediate_size=384,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def test_synthetic(tmp_path):
    tok = tokenizer_text()
    a, b, c = (tmp_path / n for n in ("a.nanoqwen", "b.nanoqwen", "c.nanoqwen"))
    synthetic(TINY_SYN, a, seed=1, tokenizer_json=tok, chat_template=TEMPLATE)
    synthetic(TINY_SYN, b, seed=1, tokenizer_json=tok, chat_template=TEMPLATE)
    synthetic(TINY_SYN, c, seed=2)
    assert a.read_bytes() == b.read_bytes()  # same seed, same file
    with open_model(a, verify=True) as ma, open_model(c, verify=True) as mc:
        assert ma.config == TINY_SYN and ma.tokenizer_json == tok
        assert ma.chat_template == TEMPLATE and mc.tokenizer_json is None
        assert ma.special_tokens["eos_token_ids"] == [token_id(tok, "<|im_end|>"),
                                                      token_id(tok, "<|endoftext|>")]
        assert mc.special_tokens["eos_token_ids"] == []
        emb = ma.tensor("model.embed_tokens.weight").float()
        assert abs(emb.mean()) < 0.002 and 0.019 < emb.std() < 0.021  # N(0, 0.02)
        norm = ma.tensor("model.layers.1.input_layernorm.weight").float()
        assert abs(norm.mean() - 1) < 0.02 and 0.08 < norm.std() < 0.12  # 1 + 0.1 N(0, 1)
        bias = ma.tensor("model.layers.0.self_attn.q_proj.bias").float()
        assert 0.015 < bias.std() < 0.025  # drawn, not zero (exercises the bias path)
        # a 256x256 N(0, 0.02) weight: amax per group of 128 is ~2.6 sigma -> scale ~0.0075
        s = ma.tensor("model.layers.0.self_attn.q_proj.scales").float()
        assert 0.005 < s.mean() < 0.011
        assert not torch.equal(ma.tensor("model.layers.0.mlp.up_proj.qweight"),
                               mc.tensor("model.layers.0.mlp.up_proj.qweight"))


def test_cli_convert_and_info(tmp_path, checkpoints, capsys):
    out = tmp_path / "m.nanoqwen"
    assert main(["convert", str(checkpoints["untied-hd128-bf16"]), "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["info", str(out), "--verify"]) == 0
    text = capsys.readouterr().out
    for want in ("hidden_size: 256", "intermediate_size: 384", "num_attention_heads: 2",
                 "tie_word_embeddings: False", "tokenizer:   embedded", "chat template: embedded",
                 "tensors:     ", "decode reads per token", "checksums OK"):
        assert want in text, want
    with open_model(out) as mf:
        off = mf.tensors["model.layers.0.mlp.down_proj.qweight"].offset
    data = bytearray(out.read_bytes())
    data[off] ^= 0xFF
    out.write_bytes(bytes(data))
    assert main(["info", str(out)]) == 0  # header is fine; only --verify reads the data
    capsys.readouterr()
    assert main(["info", str(out), "--verify"]) == 1
    err = capsys.readouterr().err
    assert "nanoqwen info: error:" in err and "down_proj.qweight" in err and "checksum" in err
    (tmp_path / "junk").write_bytes(b"hello world")
    assert main(["info", str(tmp_path / "junk")]) == 1
    assert "not a .nanoqwen file" in capsys.readouterr().err


def test_cli_convert_argument_errors(tmp_path, capsys):
    assert main(["convert", "-o", str(tmp_path / "x")]) == 1
    assert "exactly one" in capsys.readouterr().err
    assert main(["convert", str(tmp_path), "--tokenizer", "t.json", "-o", str(tmp_path / "x")]) == 1
    assert "--tokenizer goes with --synthetic" in capsys.readouterr().err
    assert main(["convert", "--synthetic", "9b", "-o", str(tmp_path / "x")]) == 1
    assert "unknown preset" in capsys.readouterr().err
    assert main(["convert", "--synthetic", "0.5b", "--tokenizer", str(tmp_path / "none.json"),
                 "-o", str(tmp_path / "x")]) == 1
    assert "cannot read --tokenizer" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# --- bad checkpoints: one line naming the file or field, nothing left at -o ------------------
def refused(d: Path, out_dir: Path, capsys) -> str:
    """Run `nanoqwen convert d -o out_dir/m.nanoqwen`; assert it fails with exactly one line
    on stderr and leaves nothing (no file, no temp file) in out_dir; return that line."""
    out_dir.mkdir(exist_ok=True)
    capsys.readouterr()
    assert main(["convert", str(d), "-o", str(out_dir / "m.nanoqwen")]) == 1
    cap = capsys.readouterr()
    lines = cap.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanoqwen convert: error: "), cap.err
    assert "Traceback" not in cap.err and cap.out == ""
    assert list(out_dir.iterdir()) == []
    return lines[0]


@pytest.fixture
def bf16_copy(tmp_path, checkpoints) -> Path:
    d = tmp_path / "hf"
    shutil.copytree(checkpoints["untied-hd128-bf16"], d)
    return d


def test_truncated_shard(tmp_path, bf16_copy, capsys):
    shard = sorted(bf16_copy.glob("model-*.safetensors"))[1]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(Exception) as e:  # what the safetensors library itself says
        safe_open(shard, framework="pt")
    assert type(e.value).__name__ == "SafetensorError"
    err = refused(bf16_copy, tmp_path / "out", capsys)
    assert f"{shard} is truncated: its header describes {size:,} bytes, the file has " \
        f"{size - 1000:,} (1,000 missing)" in err


@pytest.mark.parametrize("garbage, says", [
    (lambda b: b"\xff" * 8 + b[8:], "its first 8 bytes give a header of 18,446,744,073,709,551,615"),
    (lambda b: b[:8] + b"#" * 40 + b[48:], "garbage safetensors header (not UTF-8 JSON"),
    (lambda b: b[:8] + json.dumps([1]).encode().ljust(int.from_bytes(b[:8], "little")) +
     b[8 + int.from_bytes(b[:8], "little"):], "garbage safetensors header (a JSON list"),
])
def test_garbage_shard_header(tmp_path, bf16_copy, capsys, garbage, says):
    shard = sorted(bf16_copy.glob("model-*.safetensors"))[0]
    shard.write_bytes(garbage(shard.read_bytes()))
    err = refused(bf16_copy, tmp_path / "out", capsys)
    assert f"{shard}: " in err and says in err, err


def test_index_names_a_tensor_its_shard_lacks(tmp_path, bf16_copy, capsys):
    index = bf16_copy / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    name = "model.layers.1.mlp.down_proj.weight"
    shards = sorted(set(idx["weight_map"].values()))
    wrong = next(s for s in shards if s != idx["weight_map"][name])
    idx["weight_map"][name] = wrong
    index.write_text(json.dumps(idx))
    err = refused(bf16_copy, tmp_path / "out", capsys)
    assert f"{index}: weight_map puts tensor '{name}' in {wrong}, which does not hold it" in err


def big_tokenizer(n: int) -> str:
    """A word-level tokenizer.json with ids 0..n-1 (the last one an added special token)."""
    from tokenizers import Tokenizer, models
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n - 1)}, "w0"))
    tok.add_special_tokens(["<|im_end|>"])
    return tok.to_str()


def test_tokenizer_larger_than_the_vocabulary(tmp_path, bf16_copy, capsys):
    (bf16_copy / "tokenizer.json").write_text(big_tokenizer(1200))  # the model has 1000 rows
    err = refused(bf16_copy, tmp_path / "out", capsys)
    assert (f"{bf16_copy / 'tokenizer.json'}: token id 1199 ('<|im_end|>') is outside the "
            "model's vocabulary of 1000") in err
    # ids up to vocab_size - 1 fit
    (bf16_copy / "tokenizer.json").write_text(big_tokenizer(1000))
    convert_hf(bf16_copy, tmp_path / "ok.nanoqwen")


def test_stop_id_outside_the_vocabulary(tmp_path, bf16_copy, capsys):
    gen = json.loads((bf16_copy / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 151645]  # a Qwen id in a 1000-token model
    (bf16_copy / "generation_config.json").write_text(json.dumps(gen))
    err = refused(bf16_copy, tmp_path / "out", capsys)
    assert "eos_token_id 151645" in err and "vocabulary of 1000" in err


def test_synthetic_refuses_a_tokenizer_larger_than_the_vocabulary(tmp_path):
    with pytest.raises(FormatError, match="token id 599 .* vocabulary of 512"):
        synthetic(TINY_SYN, tmp_path / "s.nanoqwen", tokenizer_json=big_tokenizer(600))
    assert list(tmp_path.iterdir()) == []


def test_loading_refuses_a_file_whose_tokenizer_outgrows_the_model(tmp_path):
    # a file written without the converter's check (write_model itself does not look)
    from nanoqwen.engine.format import write_model
    from nanoqwen.engine.tokenizer import Tokenizer
    cfg = helpers.TINY_UNTIED
    path = tmp_path / "m.nanoqwen"
    write_model(path, cfg, helpers.file_tensors(cfg, helpers.random_weights(cfg)).items(),
                tokenizer_json=big_tokenizer(600), special_tokens={"eos_token_ids": [599]})
    with open_model(path) as mf, pytest.raises(FormatError, match="600 tokens, more than the "
                                                                  "model's vocabulary of 512"):
        Tokenizer.from_model_file(mf)


# --- how the converter reads: names, blocks, shards ------------------------------------------
def test_name_from_the_hugging_face_cache(tmp_path, checkpoints):
    # the layout huggingface_hub writes: snapshots/<commit> holds symlinks into blobs/
    repo = tmp_path / "hub" / "models--Qwen--Qwen2.5-Coder-7B-Instruct"
    snap = repo / "snapshots" / ("0123456789abcdef" * 3)[:40]
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in checkpoints["tied-hd64-fp32"].iterdir():
        blob = repo / "blobs" / f"{abs(hash(f.name)):x}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(blob)
    cfg = json.loads((snap / "config.json").read_text())
    assert "_name_or_path" not in cfg  # save_pretrained does not write it: the path must say
    assert convert_hf(snap, tmp_path / "m.nanoqwen").name == "Qwen2.5-Coder-7B-Instruct"
    with open_model(tmp_path / "m.nanoqwen") as mf:
        assert mf.config.name == "Qwen2.5-Coder-7B-Instruct"


@pytest.mark.parametrize("path, cfg, name", [
    ("/c/models--Qwen--Qwen2.5-Coder-1.5B/snapshots/" + "a" * 40, {"_name_or_path": "x/y"},
     "Qwen2.5-Coder-1.5B"),
    ("/c/models--gpt2/snapshots/" + "b" * 40 + "/sub", {}, "gpt2"),
    ("/m/" + "c" * 40, {"_name_or_path": "Qwen/Qwen2.5-Coder-3B-Instruct"},
     "Qwen2.5-Coder-3B-Instruct"),
    ("/m/" + "c" * 40, {"_name_or_path": "/scratch/" + "d" * 40 + "/"}, "qwen2"),
    ("/m/my-finetune", {}, "my-finetune"),
    ("/m/my-finetune", {"_name_or_path": ""}, "my-finetune"),
])
def test_model_name_rules(path, cfg, name):
    assert convert.model_name(Path(path), cfg) == name


def test_row_blocks_do_not_change_a_byte(tmp_path, checkpoints, monkeypatch):
    d = checkpoints["untied-hd128-bf16"]
    convert_hf(d, tmp_path / "a.nanoqwen")
    monkeypatch.setattr(convert, "BLOCK_ELEMS", 1000)  # 3 rows of 256 (or 1 of 384) a block
    convert_hf(d, tmp_path / "b.nanoqwen")
    assert (tmp_path / "a.nanoqwen").read_bytes() == (tmp_path / "b.nanoqwen").read_bytes()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_shards_are_read_one_at_a_time_and_never_mapped(tmp_path, checkpoints):
    import os
    d = checkpoints["untied-hd128-bf16"]
    seen = []

    def progress(done, total, what):
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds.append(os.readlink(f"/proc/self/fd/{fd}"))
            except FileNotFoundError:  # listdir's own descriptor, closed by now
                pass
        maps = Path("/proc/self/maps").read_text()
        seen.append((sum(f.endswith(".safetensors") for f in fds), ".safetensors" in maps))

    convert_hf(d, tmp_path / "m.nanoqwen", progress=progress)
    assert len(seen) == len(expected_tensors(convert_hf(d, tmp_path / "n.nanoqwen")))
    assert max(n for n, _ in seen) == 1 and not any(m for _, m in seen)
