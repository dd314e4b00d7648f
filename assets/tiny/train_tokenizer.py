"""Train the tiny model's byte-level BPE tokenizer on a sample of the training corpus.

Qwen2's pipeline (copied from its tokenizer.json): NFC normaliser; pre-tokenizer = Split on
Qwen2's regex (behavior Isolated) then ByteLevel(add_prefix_space=False, use_regex=False);
ByteLevel decoder. The BPE vocabulary is vocab_size - 7 learned tokens (the 256 byte symbols
first), then the seven special tokens at the end, as Qwen2 places them:
<|endoftext|>, <|im_start|>, <|im_end|>, <|fim_prefix|>, <|fim_middle|>, <|fim_suffix|>,
<|fim_pad|>. Writes <out>/tokenizer.json.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import time
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen2's split pattern, verbatim from its tokenizer.json pre_tokenizer.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
           "<|fim_suffix|>", "<|fim_pad|>"]


def build(texts, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    n = tok.get_vocab_size()
    if n != vocab_size - len(SPECIAL):
        raise SystemExit(f"BPE learned {n} tokens, wanted {vocab_size - len(SPECIAL)}: corpus too small")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    assert tok.get_vocab_size() == vocab_size
    return tok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="folder with docs.pkl")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=12288)
    ap.add_argument("--sample-mb", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    t0 = time.time()
    docs = pickle.load(open(Path(args.data) / "docs.pkl", "rb"))
    # the same mix as training: mostly code files, a quarter chat
    rng = random.Random(args.seed)
    budget = int(args.sample_mb * 1e6)
    raw = list(docs["train_raw"])
    chats = list(docs["train_chat"])
    rng.shuffle(raw)
    sample, size = [], 0
    for t in raw:
        if size >= budget * 0.75:
            break
        sample.append(t)
        size += len(t)
    for t in chats:
        if size >= budget:
            break
        sample.append(t)
        size += len(t)
    tok = build(sample, args.vocab_size)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(args.out) / "tokenizer.json"))
    probe = "def add(a, b):\n    return a + b\n"
    enc = tok.encode("<|im_start|>user\n" + probe + "<|im_end|>")
    print(f"[tokenizer] {len(sample)} docs, {size / 1e6:.1f} MB -> vocab {tok.get_vocab_size()} "
          f"({time.time() - t0:.1f}s); probe {len(enc.ids)} tokens: {json.dumps(enc.tokens)}",
          flush=True)


if __name__ == "__main__":
    main()
