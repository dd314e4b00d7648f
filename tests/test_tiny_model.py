"""The bundled tiny coder model (assets/tiny/tiny.nanoqwen) on the CPU reference backend.

What the app promises a machine without a GPU: the default model loads, is the shape we
ship (Qwen2 architecture, 20-40M parameters, INT4, <= 32 MB, its own BPE tokenizer and
ChatML template inside), and answers coding requests with Python that parses. The quality
bar: on the 20 held-out requests the recipe set aside (built from functions of source
files that were never trained on), at least half of the greedy replies hold a fenced code
block that `ast.parse` accepts. Replies are capped at 160 new tokens to keep the test fast
(the recipe chose requests whose reference answer fits that cap; see assets/tiny/README.md).
"""

from __future__ import annotations

import ast
import json
import os
import re
import time
from pathlib import Path

import pytest

from nanoqwen.engine.loader import load
from nanoqwen.engine.sampling import SamplerParams
from nanoqwen.engine.session import ChatSession, Done, Stats, TextDelta

ASSET = Path(__file__).resolve().parents[1] / "assets" / "tiny"
MODEL = Path(os.environ.get("NQ_TINY_MODEL", ASSET / "tiny.nanoqwen"))
MAX_NEW = 160
FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


@pytest.fixture(scope="module")
def engine():
    eng = load(MODEL, backend="reference")
    yield eng
    eng.close()


def reply(eng, text: str, max_new: int = MAX_NEW) -> tuple[str, Stats, str]:
    session = ChatSession(eng.backend, eng.tokenizer)
    out, stats, reason = [], None, None
    for ev in session.generate(text, SamplerParams.greedy_params(), max_new_tokens=max_new):
        if isinstance(ev, TextDelta):
            out.append(ev.text)
        elif isinstance(ev, Stats):
            stats = ev
        elif isinstance(ev, Done):
            reason = ev.reason
    return "".join(out), stats, reason


def parsable_block(text: str) -> str | None:
    """The first fenced block with code that parses, or None."""
    for code in FENCE.findall(text):
        if code.strip():
            try:
                ast.parse(code)
            except SyntaxError:
                continue
            return code
    return None


def test_shipped_file_is_what_we_promise(engine):
    mf, c, tok = engine.model_file, engine.model_file.config, engine.tokenizer
    assert MODEL.stat().st_size <= 32 * 10**6
    assert c.tie_word_embeddings and c.head_dim in (64, 128)
    assert c.num_attention_heads > c.num_key_value_heads  # GQA
    n = c.vocab_size * c.hidden_size + c.num_hidden_layers * (
        sum(n * k for n, k in c.projection_shapes().values()) + c.q_size + 2 * c.kv_size
        + 2 * c.hidden_size) + c.hidden_size
    assert 20e6 <= n <= 40e6, n
    assert 8192 <= tok.vocab_size <= 16384 and tok.vocab_size == c.vocab_size
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>",
              "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>"):
        assert tok.token_to_id(t) is not None, t
    assert tok.stop_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    assert mf.chat_template and "<|im_start|>" in mf.chat_template
    prompt = tok.render_chat([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    tj = json.loads(mf.tokenizer_json)
    assert tj["model"]["type"] == "BPE"
    assert [p["type"] for p in tj["pre_tokenizer"]["pretokenizers"]] == ["Split", "ByteLevel"]


def test_short_request_answers_with_code(engine):
    # no time limit: a test never depends on this machine's speed (benchmarks measure it)
    text, stats, _ = reply(engine, "Write a Python function that adds two numbers.", max_new=64)
    print(f"\n{stats.tokens_per_s:.1f} tok/s decode, TTFT {stats.ttft_ms:.0f} ms:\n{text}")
    assert "```" in text


def test_heldout_requests_get_parsable_code(engine):
    data = json.loads((ASSET / "heldout_requests.json").read_text())
    reqs = data["requests"][:20]
    assert len(reqs) == 20
    ok, t = 0, time.perf_counter()
    for i, r in enumerate(reqs):
        text, stats, reason = reply(engine, r["request"])
        good = parsable_block(text) is not None
        ok += good
        print(f"[{i}] {'ok ' if good else 'BAD'} {reason:6} {stats.n_generated:3d} tok  {r['name']}")
    print(f"{ok}/20 replies hold a fenced block that parses ({time.perf_counter() - t:.1f}s)")
    assert ok >= 10, f"only {ok}/20 greedy replies hold a fenced code block that ast.parse accepts"
