"""Tokenizer tests: encode against published Qwen2 token-id vectors, chat rendering against
an independently built ChatML prompt and transformers' apply_chat_template, and the
incremental detokenizer's invariants (no half characters, deltas concatenate to the full
decode, bounded work per token).

The real Qwen2 tokenizer lives in ../shared/qwen2-tokenizer (beside the repo, never copied
in); those tests skip where it is absent. The rest use tokenizers built in-test or the
shared tiny tokenizer from helpers, so they run anywhere.
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import pytest
import tokenizers
from tokenizers import decoders, models

import helpers
from nanoqwen.engine.errors import FormatError, NanoqwenError
from nanoqwen.engine.tokenizer import (DEFAULT_SYSTEM_PROMPT, ChatTemplateError,
                                       IncrementalDetokenizer, Tokenizer)

QWEN_DIR = Path(__file__).resolve().parents[2] / "shared" / "qwen2-tokenizer"
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643

needs_qwen = pytest.mark.skipif(not (QWEN_DIR / "tokenizer.json").is_file(),
                                reason="../shared/qwen2-tokenizer is absent")

TWO_TURNS = [
    {"role": "system", "content": "You are a careful Python reviewer."},
    {"role": "user", "content": "Write `add(a, b)`."},
    {"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"},
    {"role": "user", "content": "Now 中文 docstring, please 😀"},
]


def chatml(messages, system=None) -> str:
    """Qwen2.5's documented ChatML layout, written out by hand (not via any template)."""
    out = ""
    if system is not None:
        out += f"<|im_start|>system\n{system}<|im_end|>\n"
    for m in messages:
        out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen_raw():
    if not (QWEN_DIR / "tokenizer.json").is_file():
        pytest.skip("../shared/qwen2-tokenizer is absent")
    return tokenizers.Tokenizer.from_file(str(QWEN_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def qwen(qwen_raw):
    return Tokenizer((QWEN_DIR / "tokenizer.json").read_text(encoding="utf-8"),
                     (QWEN_DIR / "chat_template.jinja").read_text(encoding="utf-8"), None)


def llamacpp_vectors() -> list[tuple[str, list[int]]]:
    if not (QWEN_DIR / "vectors-llamacpp.inp").is_file():
        return []
    # llama.cpp's convert-hf-to-gguf-update.py writes each text followed by
    # "\n__ggml_vocab_test__\n" (so the newline before a separator is not part of the
    # text); the .out file has one line of ids per text.
    inp = (QWEN_DIR / "vectors-llamacpp.inp").read_text(encoding="utf-8")
    texts = inp.split("\n__ggml_vocab_test__\n")
    assert texts[-1] == "", "the file ends with a separator"
    texts = texts[:-1]
    out = (QWEN_DIR / "vectors-llamacpp.out").read_text(encoding="utf-8").split("\n")
    assert out[-1] == ""
    ids = [[int(x) for x in line.split()] for line in out[:-1]]
    assert len(texts) == len(ids) == 46
    return list(zip(texts, ids))


def transformers_vectors() -> list[tuple[str, list[int]]]:
    if not (QWEN_DIR / "vectors-transformers.json").is_file():
        return []
    d = json.loads((QWEN_DIR / "vectors-transformers.json").read_text(encoding="utf-8"))
    return [(v["text"], v["ids"]) for v in d["vectors"]]


# --- encode / decode against the published vectors ---------------------------------------

@needs_qwen
@pytest.mark.parametrize("text,ids", llamacpp_vectors() + transformers_vectors())
def test_encode_reproduces_vectors(qwen, text, ids):
    assert qwen.encode(text) == ids
    # Byte-level BPE round-trips exactly except where NFC normalisation changed the text.
    assert qwen.decode(ids) == unicodedata.normalize("NFC", text)


@needs_qwen
def test_all_49_vectors_present():
    assert len(llamacpp_vectors()) == 46 and len(transformers_vectors()) == 3


@needs_qwen
def test_special_tokens_and_stop_ids(qwen):
    assert qwen.encode("<|im_start|>user\nhi<|im_end|>") == [IM_START, 872, 198, 6023, IM_END]
    assert qwen.stop_ids == frozenset({IM_END, ENDOFTEXT})  # defaults when the file names none
    assert qwen.vocab_size == 151665
    assert qwen.decode([IM_START, 6023, IM_END]) == "hi"
    assert qwen.decode([IM_START, 6023], skip_special_tokens=False) == "<|im_start|>hi"
    custom = Tokenizer((QWEN_DIR / "tokenizer.json").read_text(encoding="utf-8"), None, [IM_END])
    assert custom.stop_ids == frozenset({IM_END})
    with pytest.raises(FormatError, match="eos_token_ids"):
        Tokenizer((QWEN_DIR / "tokenizer.json").read_text(encoding="utf-8"), None, [10**6])


# --- chat rendering --------------------------------------------------------------------------

@needs_qwen
def test_two_turn_chat_matches_hand_built_chatml(qwen, qwen_raw):
    expected = qwen_raw.encode(chatml(TWO_TURNS[1:], system=TWO_TURNS[0]["content"]),
                               add_special_tokens=False).ids
    assert qwen.encode_chat(TWO_TURNS) == expected
    # The structure the model expects: 4 turns + the generation prompt.
    assert expected.count(IM_START) == 5 and expected.count(IM_END) == 4
    assert expected[-3:] == [IM_START, 77091, 198]  # "<|im_start|>assistant\n"


@needs_qwen
def test_two_turn_chat_matches_transformers(qwen, qwen_raw):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=qwen_raw,
        chat_template=(QWEN_DIR / "chat_template.jinja").read_text(encoding="utf-8"))
    for msgs in (TWO_TURNS, TWO_TURNS[1:]):  # with and without a system turn
        ref = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert qwen.render_chat(msgs) == ref
        ref_ids = hf(ref, add_special_tokens=False)["input_ids"]
        assert qwen.encode_chat(msgs) == ref_ids
    ref = hf.apply_chat_template(TWO_TURNS[:3], add_generation_prompt=False, tokenize=False)
    assert qwen.render_chat(TWO_TURNS[:3], add_generation_prompt=False) == ref


@needs_qwen
def test_builtin_template_equals_qwen_template(qwen):
    builtin = Tokenizer((QWEN_DIR / "tokenizer.json").read_text(encoding="utf-8"), None, None)
    for msgs in (TWO_TURNS, TWO_TURNS[1:], TWO_TURNS[1:2]):
        assert builtin.render_chat(msgs) == qwen.render_chat(msgs)
        assert builtin.encode_chat(msgs) == qwen.encode_chat(msgs)


def test_builtin_template_default_system_prompt():
    tok = Tokenizer(helpers.tiny_tokenizer_json(), None, None)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(msgs) == chatml(msgs, system=DEFAULT_SYSTEM_PROMPT)
    assert tok.render_chat(TWO_TURNS, add_generation_prompt=False) == \
        chatml(TWO_TURNS)[: -len("<|im_start|>assistant\n")]
    # Default stop ids are looked up by name: the tiny tokenizer has them at 2 and 0.
    assert tok.stop_ids == frozenset({2, 0})


def test_render_rejects_bad_messages():
    tok = Tokenizer(helpers.tiny_tokenizer_json(), None, None)
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]\['role'\]"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\['content'\] must be a str"):
        tok.render_chat([{"role": "user", "content": 3}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\] must be a dict"):
        tok.render_chat([{"role": "user"}])


def test_template_errors_are_nanoqwen_errors():
    j = helpers.tiny_tokenizer_json()
    with pytest.raises(ChatTemplateError, match="does not compile"):
        Tokenizer(j, "{% for m in messages %}", None)
    # raise_exception is how HF templates reject a conversation.
    tok = Tokenizer(j, "{{ raise_exception('only user turns, please') }}", None)
    with pytest.raises(ChatTemplateError, match="only user turns, please"):
        tok.render_chat([{"role": "user", "content": "x"}])
    # The sandbox: no attribute escapes, and the immutable variant forbids mutation.
    for bad in ("{{ messages.__class__.__mro__ }}", "{{ messages.append(1) }}"):
        with pytest.raises(ChatTemplateError):
            Tokenizer(j, bad, None).render_chat([{"role": "user", "content": "x"}])
    assert issubclass(ChatTemplateError, NanoqwenError)


def test_template_environment_like_transformers():
    j = helpers.tiny_tokenizer_json()
    # tojson does not HTML-escape (transformers overrides jinja's filter the same way).
    tok = Tokenizer(j, "{{ messages[0].content | tojson }}", None)
    assert tok.render_chat([{"role": "user", "content": "<a & 'b'> é"}]) == '"<a & \'b\'> é"'
    # trim_blocks + lstrip_blocks: block tags do not leave their line's whitespace behind.
    tmpl = "  {% for m in messages %}\n[{{ m.role }}]\n  {% endfor %}\n"
    tok = Tokenizer(j, tmpl, None)
    assert tok.render_chat([{"role": "user", "content": "x"}] * 2) == "[user]\n[user]\n"
    # loopcontrols is enabled.
    tok = Tokenizer(j, "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                       "{{ m.content }}{% endfor %}", None)
    assert tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) \
        == "a"


def test_from_model_file(tiny_model_path):
    from nanoqwen.engine.format import open_model

    mf = open_model(tiny_model_path)
    try:
        tok = Tokenizer.from_model_file(mf)
        assert tok.stop_ids == frozenset({2, 0})
        assert tok.chat_template == helpers.CHATML_TEMPLATE
        text = "def add(a, b):\n    return a + b\n"
        assert tok.decode(tok.encode(text)) == text
    finally:
        mf.close()
    empty = SimpleNamespace(path=Path("x.nanoqwen"), tokenizer_json=None, chat_template=None,
                            special_tokens={})
    with pytest.raises(FormatError, match=r"x\.nanoqwen.*no tokenizer"):
        Tokenizer.from_model_file(empty)


def test_bad_tokenizer_json():
    with pytest.raises(FormatError, match="tokenizer.json"):
        Tokenizer("{not json", None, None)


# --- incremental detokenizer -----------------------------------------------------------------

def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tok)
    return [d.push(i) for i in ids] + [d.flush()]


def check_stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    """The detokenizer's contract on one id sequence; returns the deltas."""
    deltas = stream(tok, ids)
    full = tok.decode(ids)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas), deltas
    return deltas


DETOK_TEXTS = [
    "中文字符测试：你好，世界！日本語のテキストと한국어",
    "emoji 😀🎉👩‍💻🧑🏽‍🚀 flags 🇯🇵🇺🇦 and keycap 1️⃣",
    "rare CJK 𠜎𠜱𠝹𠱓 and math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0358\u0350a\u0360l\u0353g\u0358o",
    "def f(x):\n\tif x:\n        return  x  \n\n\n    # 注释 — ok\r\n",
]


@needs_qwen
@pytest.mark.parametrize("text", DETOK_TEXTS)
def test_detokenizer_real_text(qwen, text):
    ids = qwen.encode(text)
    deltas = check_stream(qwen, ids)
    # Qwen's normaliser is NFC: "e\u0301" encodes as "é"; uncomposable marks stay separate.
    assert "".join(deltas) == unicodedata.normalize("NFC", text)


@needs_qwen
def test_detokenizer_really_splits_characters(qwen):
    # Guard that the texts above exercise the hard case: some tokens end mid-character
    # (decoding them alone gives U+FFFD), and then push() returns "" for them.
    ids = qwen.encode(DETOK_TEXTS[2])
    assert any("\ufffd" in qwen.decode([i]) for i in ids)
    assert "" in stream(qwen, ids)[:-1]


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte -> printable-character table that ByteLevel BPE vocabularies use.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One single-byte token per byte: a sampler can produce any such sequence."""
    table = _bytes_to_unicode()
    return [tok.token_to_id(table[b]) for b in data]


@needs_qwen
def test_detokenizer_single_byte_tokens(qwen):
    data = "a中😀é𠜎\n".encode()
    ids = byte_ids(qwen, data)
    deltas = check_stream(qwen, ids)
    # Each character comes out whole, at the token that completes it.
    assert [d for d in deltas if d] == ["a", "中", "😀", "é", "𠜎", "\n"]


@needs_qwen
def test_detokenizer_random_byte_streams(qwen):
    # Random bytes biased to UTF-8 lead/continuation bytes: valid characters, truncated
    # ones, stray continuations. The invariants hold whatever a sampler produces.
    rng = random.Random(0)
    pool = list(range(0x20, 0x7f)) + list(range(0x80, 0xc0)) * 2 + [0xc3, 0xe4, 0xf0, 0x9f]
    for _ in range(200):
        data = bytes(rng.choice(pool) for _ in range(rng.randint(1, 24)))
        check_stream(qwen, byte_ids(qwen, data))


@needs_qwen
def test_detokenizer_skips_special_tokens(qwen):
    ids = qwen.encode("<|im_start|>assistant\nhi 中<|im_end|>")
    assert "".join(stream(qwen, ids)) == "assistant\nhi 中"


@needs_qwen
def test_detokenizer_bounded_window(qwen, monkeypatch):
    # O(1) per token: every decode call sees a short window, never the whole reply.
    text = unicodedata.normalize("NFC", "\n".join(DETOK_TEXTS) * 40)
    ids = qwen.encode(text)
    sizes = []
    real = qwen.decode
    monkeypatch.setattr(qwen, "decode", lambda x, **kw: sizes.append(len(x)) or real(x, **kw))
    d = IncrementalDetokenizer(qwen)
    out = "".join(d.push(i) for i in ids) + d.flush()
    monkeypatch.undo()
    assert out == text
    assert len(ids) > 2000 and max(sizes) <= 8
    # A run of invalid bytes cannot grow the window without bound either: it is released
    # after max_held tokens (the full decode shows U+FFFD there as well).
    junk = byte_ids(qwen, b"\x80" * 200 + "中".encode())
    sizes.clear()
    monkeypatch.setattr(qwen, "decode", lambda x, **kw: sizes.append(len(x)) or real(x, **kw))
    d = IncrementalDetokenizer(qwen, max_held=32)
    out = "".join(d.push(i) for i in junk) + d.flush()
    monkeypatch.undo()
    assert out == qwen.decode(junk) == "\ufffd" * 200 + "中"
    assert max(sizes) <= 33


def test_detokenizer_tiny_byte_level(tiny_tokenizer):
    # Runs without ../shared: the helpers' byte-level BPE (trained on a small corpus, so
    # CJK and emoji fall apart into several byte tokens).
    for text in DETOK_TEXTS:
        ids = tiny_tokenizer.encode(text)
        assert "".join(check_stream(tiny_tokenizer, ids)) == text
    ids = tiny_tokenizer.encode("😀")
    assert len(ids) > 1 and stream(tiny_tokenizer, ids)[:len(ids) - 1] == [""] * (len(ids) - 1)


def byte_fallback_tokenizer() -> Tokenizer:
    """A sentencepiece-style vocabulary (a few characters + <0x00>..<0xFF> byte tokens,
    ByteFallback decoder, as Llama uses): characters outside the vocabulary encode as
    byte tokens, the other way UTF-8 gets split across tokens."""
    vocab = {"<|im_end|>": 0}
    for ch in "abcdefghijklmnopqrstuvwxyz ,.!\n":
        vocab[ch] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<|im_end|>"])
    return Tokenizer(tok.to_str(), None, None)


def test_detokenizer_byte_fallback():
    tok = byte_fallback_tokenizer()
    text = "hi 中文, émoji 😀 ok.\n"
    ids = tok.encode(text)
    assert len(ids) == len("hi , moji  ok.\n") + len("中文é😀".encode())
    deltas = check_stream(tok, ids)
    assert "".join(deltas) == text
    assert "中" in deltas and "😀" in deltas  # released whole, once complete
    assert tok.stop_ids == frozenset({0})
    assert "".join(stream(tok, ids + [0])) == text  # the special token adds no text
