"""The .nanoqwen file: round trip, and one clear FormatError per way a file can be wrong."""

import json
import os
import zlib

import pytest
import torch

from nanoqwen.engine.config import ModelConfig
from nanoqwen.engine.errors import FormatError
from nanoqwen.engine.format import (ALIGNMENT, HEADER_OFFSET, PREFIX, expected_tensors,
                                    open_model, write_model)

TINY = ModelConfig(name="tiny", vocab_size=96, hidden_size=128, intermediate_size=256,
                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
TIED = ModelConfig(name="tiny-tied", vocab_size=96, hidden_size=256, intermediate_size=384,
                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                   tie_word_embeddings=True)


def random_tensors(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (dtype, shape) in expected_tensors(config).items():
        if dtype == "fp16":
            out[name] = torch.randn(shape, generator=g).half()
        else:
            out[name] = torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int32)
    return out


def write(path, config=TINY, seed=0, **kw):
    tensors = random_tensors(config, seed)
    write_model(path, config, tensors.items(), **kw)
    return tensors


@pytest.fixture
def good(tmp_path):
    p = tmp_path / "m.nanoqwen"
    write(p)
    return p


def rewrite_header(path, mutate, grow=0):
    """Edit the JSON header in place and fix its length and CRC: a file whose header lies
    consistently, which only the semantic checks can catch. `grow` appends zero bytes."""
    data = bytearray(path.read_bytes()) + bytes(grow)
    f = list(PREFIX.unpack_from(data))
    hlen, data_off = f[3], f[7]
    header = json.loads(data[HEADER_OFFSET:HEADER_OFFSET + hlen])
    mutate(header)
    new = json.dumps(header).encode()
    assert HEADER_OFFSET + len(new) <= data_off, "edited header no longer fits"
    data[HEADER_OFFSET:data_off] = new + bytes(data_off - HEADER_OFFSET - len(new))
    f[3], f[4], f[6] = len(new), zlib.crc32(new), len(data)
    data[:HEADER_OFFSET] = PREFIX.pack(*f)
    path.write_bytes(bytes(data))


def entry(header, name):
    return next(t for t in header["tensors"] if t["name"] == name)


@pytest.mark.parametrize("config", [TINY, TIED], ids=["untied-hd64", "tied-hd128"])
def test_round_trip(tmp_path, config):
    p = tmp_path / "m.nanoqwen"
    special = {"eos_token_ids": [5, 7], "pad_token_id": 7}
    src = write(p, config, tokenizer_json='{"model": {}}', chat_template="{{ messages }}",
                special_tokens=special, generation={"temperature": 0.7, "top_p": 0.8})
    with open_model(p, verify=True) as mf:
        assert mf.config == config
        assert mf.tokenizer_json == '{"model": {}}' and mf.chat_template == "{{ messages }}"
        assert mf.special_tokens == special
        assert mf.generation == {"temperature": 0.7, "top_p": 0.8}
        assert list(mf.tensors) == list(expected_tensors(config))
        assert ("lm_head.weight" in mf.tensors) != config.tie_word_embeddings
        for name, t in src.items():
            info = mf.tensors[name]
            assert info.offset % ALIGNMENT == 0 and info.nbytes == t.numel() * t.element_size()
            got = mf.tensor(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name
        # zero-copy: two tensors sit in one mapping exactly their offsets apart
        a, b = "model.embed_tokens.weight", "model.norm.weight"
        assert (mf.tensor(b).data_ptr() - mf.tensor(a).data_ptr()
                == mf.tensors[b].offset - mf.tensors[a].offset)
        assert mf.tensor(a).data_ptr() % ALIGNMENT == 0
    assert os.listdir(tmp_path) == ["m.nanoqwen"]


def test_defaults_and_verify_progress(good):
    calls = []
    with open_model(good) as mf:
        assert mf.tokenizer_json is None and mf.chat_template is None
        assert mf.special_tokens == {} and mf.generation == {}
        mf.verify(progress=lambda done, total, name: calls.append((done, total, name)))
        total = sum(t.nbytes for t in mf.tensors.values())
    assert calls[-1][:2] == (total, total)
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)


def test_tensor_outlives_close(good):
    mf = open_model(good)
    t = mf.tensor("model.norm.weight")
    want = t.clone()
    mf.close()  # the live view keeps the mapping until it is freed
    assert torch.equal(t, want)


def test_wrong_magic(tmp_path):
    p = tmp_path / "x.nanoqwen"
    p.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(100))
    with pytest.raises(FormatError, match=r"not a \.nanoqwen file.*GGUF"):
        open_model(p)


def test_missing_and_empty_file(tmp_path):
    with pytest.raises(FormatError, match="cannot open"):
        open_model(tmp_path / "nope.nanoqwen")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(FormatError, match="truncated"):
        open_model(tmp_path / "empty")


def test_newer_version(good):
    data = bytearray(good.read_bytes())
    data[8:12] = (2).to_bytes(4, "little")
    good.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"newer nanoqwen \(v2\); this one reads v1"):
        open_model(good)


def test_unknown_flags(good):
    data = bytearray(good.read_bytes())
    data[12] = 1
    good.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="unknown flags"):
        open_model(good)


def test_truncated_at_many_points(good):
    data = good.read_bytes()
    with open_model(good) as mf:
        emb = mf.tensors["model.embed_tokens.weight"]
    cuts = {"magic": 5, "prefix": 40, "header": HEADER_OFFSET + 20,
            "first tensor": emb.offset + 100, "last byte": len(data) - 1}
    for where, n in cuts.items():
        good.write_bytes(data[:n])
        with pytest.raises(FormatError, match="truncated") as e:
            open_model(good)
        assert str(good) in str(e.value), where


def test_trailing_bytes(good):
    with open(good, "ab") as f:
        f.write(b"junk")
    with pytest.raises(FormatError, match="4 unexpected bytes"):
        open_model(good)


def test_bad_header_crc(good):
    data = bytearray(good.read_bytes())
    i = data.index(b'"tiny"')
    data[i + 1] = ord("T")  # still valid JSON, so only the CRC can tell
    good.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="header checksum mismatch"):
        open_model(good)


def test_header_not_json(good):
    rewrite_header(good, lambda h: None)
    data = bytearray(good.read_bytes())
    f = list(PREFIX.unpack_from(data))
    data[HEADER_OFFSET] = ord("!")  # not JSON; the CRC is fixed below so the parser sees it
    f[4] = zlib.crc32(bytes(data[HEADER_OFFSET:HEADER_OFFSET + f[3]]))
    data[:HEADER_OFFSET] = PREFIX.pack(*f)
    good.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="not valid UTF-8 JSON"):
        open_model(good)


def test_bad_config_in_header(good):
    rewrite_header(good, lambda h: h["config"].update(head_dim=96))
    with pytest.raises(FormatError, match="header config.*head_dim=96"):
        open_model(good)


def test_tensor_offset_past_eof(good):
    size = good.stat().st_size
    rewrite_header(good, lambda h: entry(h, "model.norm.weight").update(offset=size + ALIGNMENT))
    with pytest.raises(FormatError, match=r"'model.norm.weight'.*past the end of the file"):
        open_model(good)


def test_misaligned_and_overlapping_offsets(tmp_path, good):
    data = good.read_bytes()
    rewrite_header(good, lambda h: entry(h, "model.norm.weight").update(
        offset=entry(h, "model.norm.weight")["offset"] + 2))
    with pytest.raises(FormatError, match=r"'model.norm.weight'.*not a 4096-aligned"):
        open_model(good)
    good.write_bytes(data)
    rewrite_header(good, lambda h: entry(h, "model.norm.weight").update(
        offset=entry(h, "model.embed_tokens.weight")["offset"]))
    with pytest.raises(FormatError, match="overlap"):
        open_model(good)


def test_wrong_shape_vs_config(good):
    name = "model.layers.1.mlp.down_proj.qweight"
    # consistent with itself (nbytes matches) but not with intermediate_size
    rewrite_header(good, lambda h: entry(h, name).update(shape=[256, 16], nbytes=256 * 16 * 4))
    with pytest.raises(FormatError, match=rf"'{name}' is int32 \[256, 16\] but the config "
                                          r"expects int32 \[128, 32\]"):
        open_model(good)


def test_nbytes_that_lies(good):
    rewrite_header(good, lambda h: entry(h, "model.norm.weight").update(nbytes=2))
    with pytest.raises(FormatError, match=r"'model.norm.weight': nbytes=2 but fp16 \[128\] needs 256"):
        open_model(good)


def test_missing_tensor(good):
    name = "model.layers.0.self_attn.k_proj.bias"
    rewrite_header(good, lambda h: h["tensors"].remove(entry(h, name)))
    with pytest.raises(FormatError, match=rf"missing: {name}"):
        open_model(good)


def test_extra_tensor(good):
    size = good.stat().st_size
    # a well-formed extra tensor in a fresh page appended to the file
    rewrite_header(good, lambda h: h["tensors"].append(
        {"name": "model.layers.0.self_attn.o_proj.bias", "dtype": "fp16", "shape": [128],
         "offset": size, "nbytes": 256, "crc32": f"{zlib.crc32(bytes(256)):08x}"}), grow=ALIGNMENT)
    with pytest.raises(FormatError, match=r"unexpected tensor.*'?model.layers.0.self_attn.o_proj.bias"):
        open_model(good)


def test_extra_tensor_named(tmp_path):
    # a tied file whose index also lists an lm_head: valid bytes, wrong for the config
    p = tmp_path / "t.nanoqwen"
    write(p, TINY)
    rewrite_header(p, lambda h: h["config"].update(tie_word_embeddings=True))
    with pytest.raises(FormatError, match=r"unexpected tensor.*lm_head\.weight"):
        open_model(p)


def test_checksum_mismatch(good):
    with open_model(good) as mf:
        info = mf.tensors["model.layers.1.mlp.up_proj.scales"]
    data = bytearray(good.read_bytes())
    data[info.offset + 7] ^= 0x10
    good.write_bytes(bytes(data))
    with open_model(good) as mf:  # a plain open does not read the data
        with pytest.raises(FormatError, match=r"checksum mismatch in tensor "
                                              r"'model.layers.1.mlp.up_proj.scales'"):
            mf.verify()
    with pytest.raises(FormatError, match="checksum mismatch") as e:
        open_model(good, verify=True)
    assert f"{info.offset}..{info.offset + info.nbytes}" in str(e.value)


@pytest.mark.parametrize("threads", [1, 3])
def test_threaded_verify_names_the_first_bad_tensor_in_file_order(good, threads):
    with open_model(good) as mf:
        late = mf.tensors["model.layers.1.mlp.down_proj.qweight"]
        early = mf.tensors["model.layers.0.self_attn.q_proj.bias"]
        calls = []
        mf.verify(threads=threads, progress=lambda d, t, n: calls.append((d, t)))
        total = sum(t.nbytes for t in mf.tensors.values())
    assert calls[-1] == (total, total) and [d for d, _ in calls] == sorted(d for d, _ in calls)
    data = bytearray(good.read_bytes())
    data[late.offset] ^= 1
    data[early.offset + early.nbytes - 1] ^= 1
    good.write_bytes(bytes(data))
    with open_model(good) as mf, pytest.raises(FormatError, match="q_proj.bias"):
        mf.verify(threads=threads)


def test_crash_during_write_leaves_nothing(tmp_path):
    p = tmp_path / "m.nanoqwen"
    write(p, seed=1)
    before = p.read_bytes()

    def exploding():
        for i, item in enumerate(random_tensors(TINY, seed=2).items()):
            if i == 5:
                raise RuntimeError("disk on fire")
            yield item

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_model(p, TINY, exploding())
    assert os.listdir(tmp_path) == ["m.nanoqwen"] and p.read_bytes() == before
    q = tmp_path / "new.nanoqwen"
    with pytest.raises(RuntimeError):
        write_model(q, TINY, exploding())
    assert os.listdir(tmp_path) == ["m.nanoqwen"]


def test_writer_refuses_wrong_tensors(tmp_path):
    p = tmp_path / "m.nanoqwen"
    src = random_tensors(TINY)
    bad_shape = dict(src, **{"model.norm.weight": torch.zeros(64, dtype=torch.float16)})
    with pytest.raises(FormatError, match=r"'model.norm.weight' is torch.float16 \[64\]"):
        write_model(p, TINY, bad_shape.items())
    bad_dtype = dict(src, **{"model.norm.weight": torch.zeros(128)})
    with pytest.raises(FormatError, match="torch.float32"):
        write_model(p, TINY, bad_dtype.items())
    with pytest.raises(FormatError, match="never given: lm_head.weight"):
        write_model(p, TINY, [(n, t) for n, t in src.items() if n != "lm_head.weight"])
    with pytest.raises(FormatError, match="not part of this config"):
        write_model(p, TINY, list(src.items()) + [("extra", torch.zeros(1))])
    assert os.listdir(tmp_path) == []


def test_writer_accepts_any_order(tmp_path):
    p = tmp_path / "m.nanoqwen"
    src = random_tensors(TINY, seed=3)
    write_model(p, TINY, reversed(list(src.items())))
    with open_model(p, verify=True) as mf:
        assert all(torch.equal(mf.tensor(n), t) for n, t in src.items())
