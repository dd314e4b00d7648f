"""Text <-> token ids for Qwen2 models, the chat template, and streaming detokenization.

`Tokenizer` wraps a `tokenizers` tokenizer.json (the exact file the model was trained with,
stored in the .nanoqwen header) and the model's own Jinja chat template, rendered the way
transformers renders it (sandboxed, trim_blocks + lstrip_blocks, `raise_exception`,
`tojson`), so the prompt ids we prefill are the ids the model saw in training.

`IncrementalDetokenizer` turns a stream of sampled ids into text deltas. Byte-level BPE
tokens can end in the middle of a multi-byte UTF-8 character; the decoder then renders the
incomplete tail as U+FFFD. Invariants: a delta never ends in a character that a later token
could still change, and the concatenation of all deltas (plus `flush()`) equals
`tokenizer.decode(all ids)`. Work per token is O(1) amortised: only a short window of ids
(the last emitted run + the held ones) is ever decoded, never the whole reply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from .errors import FormatError, NanoqwenError

DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Used when a file carries no template: plain ChatML as Qwen2.5 formats it, including the
# default system turn Qwen's own template inserts when the conversation has none. For
# conversations without tools this renders byte-for-byte what Qwen2.5's template renders.
BUILTIN_CHAT_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Stop tokens when the file names none: ChatML's end of turn, then end of document (the
# converter writes the same ones into synthetic models).
DEFAULT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
_ROLES = ("system", "user", "assistant")
_REPLACEMENT = "\ufffd"


def check_token_ids(tokenizer_json: str, vocab_size: int, where: str) -> None:
    """Refuse a tokenizer.json whose ids reach past a model's vocabulary (embedding rows
    0..vocab_size-1): it belongs to another model, and an id >= vocab_size would index past
    the embedding at generation time. Exact: the largest id of the model's vocab and of the
    added tokens, read from the JSON (FormatError naming `where` and the token)."""
    try:
        tok = json.loads(tokenizer_json)
    except json.JSONDecodeError as e:
        raise FormatError(f"{where}: not valid JSON: {e}") from e
    best: tuple[int, str] = (-1, "")
    vocab = (tok.get("model") or {}).get("vocab") if isinstance(tok, dict) else None
    if isinstance(vocab, dict):
        for text, i in vocab.items():
            if isinstance(i, int) and i > best[0]:
                best = (i, text)
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], ids are positions
        best = (len(vocab) - 1, str(vocab[-1][0]) if vocab else "")
    for t in (tok.get("added_tokens") or []) if isinstance(tok, dict) else []:
        if isinstance(t, dict) and isinstance(t.get("id"), int) and t["id"] > best[0]:
            best = (t["id"], str(t.get("content")))
    if best[0] >= vocab_size:
        raise FormatError(f"{where}: token id {best[0]} ({best[1]!r}) is outside the model's "
                          f"vocabulary of {vocab_size} (vocab_size); this tokenizer belongs to "
                          "another model")


class ChatTemplateError(NanoqwenError, ValueError):
    """A chat template that does not compile, raises, or a conversation it cannot render."""


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation (transformers exposes the same global).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' override: jinja2's built-in tojson HTML-escapes <, >, &, ' which would
    # change tool schemas the model sees.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e.message} (line {e.lineno})"
                                ) from e


class Tokenizer:
    """Encode/decode with the model's tokenizer.json; render chats with its template."""

    def __init__(self, tokenizer_json: str, chat_template: str | None = None,
                 eos_token_ids: Sequence[int] | None = None):
        try:
            self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise FormatError(f"tokenizer.json cannot be loaded: {e}") from e
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template: str = chat_template if chat_template else BUILTIN_CHAT_TEMPLATE
        self._template = _compile_template(self.chat_template)

        if eos_token_ids:
            ids = [int(i) for i in eos_token_ids]
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise FormatError(f"eos_token_ids {bad} are outside the tokenizer's vocabulary "
                                  f"of {self.vocab_size} tokens")
        else:
            ids = [i for t in DEFAULT_STOP_TOKENS if (i := self._tok.token_to_id(t)) is not None]
        self.stop_ids: frozenset[int] = frozenset(ids)

    @classmethod
    def from_model_file(cls, mf) -> Tokenizer:
        """Build from an open `ModelFile` (its tokenizer_json, chat_template, special_tokens)."""
        if not mf.tokenizer_json:
            raise FormatError(f"{mf.path}: the model file carries no tokenizer; convert it again "
                              f"with a tokenizer.json (nanoqwen convert ... --tokenizer FILE)")
        special = mf.special_tokens or {}
        tok = cls(mf.tokenizer_json, mf.chat_template, special.get("eos_token_ids"))
        config = getattr(mf, "config", None)
        # files converted before the converter checked this: n distinct ids > vocab_size
        # means some id is past the embedding (the exact check is check_token_ids)
        if config is not None and tok.vocab_size > config.vocab_size:
            raise FormatError(f"{mf.path}: the embedded tokenizer has {tok.vocab_size} tokens, "
                              f"more than the model's vocabulary of {config.vocab_size}; "
                              "convert it again with the model's own tokenizer")
        return tok

    def same_vocabulary(self, other: "Tokenizer") -> bool:
        """Whether `other` maps every token to the same id (a draft model's requirement)."""
        return self._tok.get_vocab(with_added_tokens=True) == \
            other._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special tokens written in the text (e.g. <|im_start|>) are recognised.
        No BOS/EOS is added: Qwen2 uses none, and chat prompts carry their own markers."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def render_chat(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": str}, ...])."""
        checked = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content'")
            if m["role"] not in _ROLES:
                raise ChatTemplateError(f"messages[{i}]['role'] is {m['role']!r}; "
                                        f"expected one of {', '.join(_ROLES)}")
            if not isinstance(m["content"], str):
                raise ChatTemplateError(f"messages[{i}]['content'] must be a str, "
                                        f"not {type(m['content']).__name__}")
            checked.append({"role": m["role"], "content": m["content"]})
        try:
            return self._template.render(messages=checked,
                                         add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render the conversation: {e}"
                                    ) from e

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Ids of the rendered conversation, ending with the assistant generation prompt."""
        return self.encode(self.render_chat(messages, add_generation_prompt=True))


class IncrementalDetokenizer:
    """Streams text for sampled ids, holding back any incomplete UTF-8 character.

    The vLLM/TGI scheme: keep `_ids` = ids since the start of the previous emitted run. The
    text of `_ids[:_read]` (already emitted) is `_prefix_text`; decoding the whole window
    and dropping that prefix gives the new text. Decoding from the previous run's start
    (instead of from `_read`) gives the decoder context, so decoders that treat the first
    token specially (leading-space stripping) produce the same text as a full decode.

    New text ending in U+FFFD is held: the last token ended mid-character and the next may
    complete it. For valid UTF-8 output at most 3 tokens are ever held. A model that emits
    a long run of invalid bytes would make the window grow, so after `max_held` held tokens
    the text is released as-is (the full decode has U+FFFD there too) and the window
    restarts — that is the only case where deltas may differ from a full decode.
    """

    def __init__(self, tokenizer: Tokenizer, max_held: int = 32):
        self._tok = tokenizer
        self._max_held = max_held
        self._ids: list[int] = []
        self._read = 0          # _ids[:_read] is emitted; _ids[_read:] is held
        self._prefix_text = ""  # decode(_ids[:_read])

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        text = self._tok.decode(self._ids)
        held = len(self._ids) - self._read
        if text.endswith(_REPLACEMENT) and held < self._max_held:
            return ""
        delta = text[len(self._prefix_text):]
        # The emitted run becomes the next window's context; older ids are dropped so
        # memory and per-token decode work stay bounded.
        emitted = self._ids[self._read:]
        if text.endswith(_REPLACEMENT):
            emitted = []  # forced release of garbage bytes: restart without context
        self._ids = emitted
        self._read = len(emitted)
        self._prefix_text = self._tok.decode(emitted) if emitted else ""
        return delta

    def flush(self) -> str:
        """Return whatever is held (possibly ending in U+FFFD) and reset."""
        text = self._tok.decode(self._ids)
        delta = text[len(self._prefix_text):]
        self._ids, self._read, self._prefix_text = [], 0, ""
        return delta
