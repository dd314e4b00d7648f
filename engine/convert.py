"""Hugging Face Qwen2 checkpoint -> .nanoqwen, and synthetic (random-weight) models.

Both stream: one source tensor is in memory at a time (safetensors `safe_open` maps the
shards; `get_tensor` copies out just the one asked for), it is quantized in row chunks and
handed to `write_model`, which writes it and lets it go. Peak RAM is about the largest
tensor (the 7B embedding, 1.1 GB fp16) plus a few hundred MB, so a 7B fits 24 GiB easily.

Precision: the seven projections are quantized from the source values upcast to fp32 (not
via fp16, which would round twice); everything else is stored fp16, and a value beyond
fp16's range (|x| > 65504) or a non-finite value is an error naming the tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from .config import ConfigError, ModelConfig
from .errors import FormatError, NanoqwenError
from .format import Progress, expected_tensors, write_model
from .quant import quantize
from .tokenizer import DEFAULT_STOP_TOKENS

FP16_MAX = 65504.0
ROW_CHUNK = 2048  # rows quantized at once: bounds quantize()'s int64 temporaries (~100 MB)
INIT_STD = 0.02   # transformers' Qwen2 initializer_range
# generation_config.json keys that describe the file, not how to sample
_GEN_DROP = ("transformers_version", "_from_model_config")


class StderrProgress:
    """A progress bar on stderr as a `Progress` callable: redrawn in place at most ~10 times a
    second on a terminal, one line per 10% otherwise (logs stay short)."""

    def __init__(self, title: str, stream=None):
        self.title, self.stream = title, stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0, self.last, self.decile = time.monotonic(), 0.0, -1

    def __call__(self, done: int, total: int, what: str = "") -> None:
        now = time.monotonic()
        frac = done / total if total else 1.0
        line = (f"{self.title} {frac * 100:5.1f}% {done / 1e9:6.2f}/{total / 1e9:.2f} GB "
                f"{now - self.t0:5.0f}s {what}")
        if self.tty:
            if now - self.last >= 0.1 or done >= total:
                self.stream.write("\r" + line[:120].ljust(120))
                self.last = now
        elif int(frac * 10) > self.decile:
            self.decile = int(frac * 10)
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def quantize_rows(w: torch.Tensor, chunk: int = ROW_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` over row chunks: identical output (every op is per row), bounded memory."""
    parts = [quantize(w[i:i + chunk]) for i in range(0, w.shape[0], chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _read_json(path: Path, required: bool = False) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise FormatError(f"{path.parent}: no {path.name} (not a Hugging Face checkpoint "
                              "directory?)")
        return None
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(d, dict):
        raise FormatError(f"{path}: expected a JSON object")
    return d


def _weight_map(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = hf_dir / "model.safetensors.index.json"
    single = hf_dir / "model.safetensors"
    if index.is_file():
        wm = (_read_json(index) or {}).get("weight_map")
        if not isinstance(wm, dict):
            raise FormatError(f"{index}: no 'weight_map' object")
        out = {name: hf_dir / shard for name, shard in wm.items()}
        for shard in sorted(set(out.values())):
            if not shard.is_file():
                raise FormatError(f"{index} names shard {shard.name}, which is missing")
        return out
    if single.is_file():
        from safetensors import safe_open
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    if any(hf_dir.glob("*.bin")) or any(hf_dir.glob("*.pt")):
        raise FormatError(f"{hf_dir}: only .safetensors weights are supported (found .bin/.pt; "
                          "re-save with save_pretrained(safe_serialization=True))")
    raise FormatError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")


def _token_id(tok: dict[str, Any] | None, token: Any) -> int | None:
    """Id of a token's text in a tokenizer.json (added tokens first, then the vocab)."""
    if isinstance(token, dict):  # tokenizer_config may store {"content": "<|im_end|>", ...}
        token = token.get("content")
    if tok is None or not isinstance(token, str):
        return None
    for t in tok.get("added_tokens") or []:
        if t.get("content") == token:
            return int(t["id"])
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and token in vocab:
        return int(vocab[token])
    return None


def _ids(v: Any) -> list[int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, list):
        return [x for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


def special_tokens_from(tok: dict[str, Any] | None, tok_cfg: dict[str, Any] | None,
                        gen: dict[str, Any] | None, hf_cfg: dict[str, Any] | None) -> dict[str, Any]:
    """eos_token_ids = generation_config's eos ids, then config.json's, then tokenizer_config's
    eos_token (Qwen2.5-Instruct: [151645, 151643]); pad/bos likewise where given."""
    tok_cfg, gen, hf_cfg = tok_cfg or {}, gen or {}, hf_cfg or {}
    eos: list[int] = []
    for i in (_ids(gen.get("eos_token_id")) + _ids(hf_cfg.get("eos_token_id"))
              + _ids(_token_id(tok, tok_cfg.get("eos_token")))):
        if i not in eos:
            eos.append(i)
    out: dict[str, Any] = {"eos_token_ids": eos}
    for key in ("pad", "bos"):
        ids = (_ids(gen.get(f"{key}_token_id")) or _ids(hf_cfg.get(f"{key}_token_id"))
               or _ids(_token_id(tok, tok_cfg.get(f"{key}_token"))))
        out[f"{key}_token_id"] = ids[0] if ids else None
    for key in ("eos_token", "pad_token", "bos_token"):
        v = tok_cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[key] = v
    return out


def _chat_template(hf_dir: Path, tok_cfg: dict[str, Any] | None) -> str | None:
    """tokenizer_config's chat_template, else the chat_template.jinja that newer transformers
    save beside it. A list of named templates picks "default"."""
    t = (tok_cfg or {}).get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if x.get("name") == "default"), None)
    if isinstance(t, str):
        return t
    jinja = hf_dir / "chat_template.jinja"
    return jinja.read_text(encoding="utf-8") if jinja.is_file() else None


def _to_fp16(t: torch.Tensor, name: str, src: Path) -> torch.Tensor:
    tf = t.to(torch.float32)
    if not torch.isfinite(tf).all():
        raise FormatError(f"{src}: tensor {name!r} contains inf or NaN")
    amax = float(tf.abs().max()) if tf.numel() else 0.0
    if amax > FP16_MAX:
        raise FormatError(f"{src}: tensor {name!r} has a value of magnitude {amax:g}, beyond "
                          f"fp16's range ({FP16_MAX:g}); it cannot be stored as fp16")
    return tf.to(torch.float16)


def _hf_tensors(config: ModelConfig, wmap: dict[str, Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    handles: dict[Path, Any] = {}
    proj = config.projection_shapes()
    try:
        for name, (dtype, shape) in expected_tensors(config).items():
            if name.endswith(".scales"):
                continue  # yielded together with its .qweight
            quant = name.endswith(".qweight")
            src_name = name.removesuffix(".qweight") + ".weight" if quant else name
            src = wmap[src_name]
            if src not in handles:
                handles[src] = safe_open(src, framework="pt").__enter__()
            t = handles[src].get_tensor(src_name)
            want = proj[name.split(".", 3)[3].removesuffix(".qweight")] if quant else shape
            if tuple(t.shape) != tuple(want):
                raise FormatError(f"{src}: tensor {src_name!r} has shape {list(t.shape)}, the "
                                  f"config expects {list(want)}")
            if not t.dtype.is_floating_point:
                raise FormatError(f"{src}: tensor {src_name!r} has dtype {t.dtype}, "
                                  "expected a floating-point weight")
            if quant:
                tf = t.to(torch.float32)
                del t
                if not torch.isfinite(tf).all():
                    raise FormatError(f"{src}: tensor {src_name!r} contains inf or NaN")
                qweight, scales = quantize_rows(tf)
                del tf
                if not torch.isfinite(scales).all():  # amax/7 beyond fp16's range
                    raise FormatError(f"{src}: tensor {src_name!r} has values too large for "
                                      f"fp16 INT4 scales (|x| > {FP16_MAX * 7:g})")
                yield name, qweight
                yield name.removesuffix(".qweight") + ".scales", scales
            else:
                yield name, _to_fp16(t, src_name, src)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


def convert_hf(hf_dir: str | Path, out_path: str | Path, progress: Progress | None = None,
               max_context: int | None = None) -> ModelConfig:
    """Convert a Hugging Face Qwen2 checkpoint directory to `out_path`; returns its config."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise FormatError(f"{hf_dir} is not a directory")
    hf_cfg = _read_json(hf_dir / "config.json", required=True)
    try:
        config = ModelConfig.from_hf_config(hf_cfg, name=hf_dir.resolve().name)
        if max_context:
            config = dataclasses.replace(config, max_position_embeddings=max_context)
    except ConfigError as e:
        raise ConfigError(f"{hf_dir / 'config.json'}: {e}") from e
    wmap = _weight_map(hf_dir)
    needed = {n.removesuffix(".qweight") + ".weight" if n.endswith(".qweight") else n
              for n in expected_tensors(config) if not n.endswith(".scales")}
    missing = sorted(needed - set(wmap))
    if missing:
        raise FormatError(f"{hf_dir}: checkpoint lacks {len(missing)} tensor(s) the config "
                          f"needs: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    # inv_freq buffers are recomputed from rope_theta; a tied lm_head is the embedding
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = sorted(n for n in set(wmap) - needed
                   if n not in ignorable and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise FormatError(f"{hf_dir}: checkpoint has tensor(s) a Qwen2 model does not use "
                          f"(another architecture?): {', '.join(extra[:5])}")
    tok_path = hf_dir / "tokenizer.json"
    tokenizer_json = tok_path.read_text(encoding="utf-8") if tok_path.is_file() else None
    try:
        tok = json.loads(tokenizer_json) if tokenizer_json else None
    except json.JSONDecodeError as e:
        raise FormatError(f"{tok_path}: not valid JSON: {e}") from e
    tok_cfg = _read_json(hf_dir / "tokenizer_config.json")
    gen = _read_json(hf_dir / "generation_config.json")
    generation = {k: v for k, v in (gen or {}).items() if k not in _GEN_DROP}
    write_model(out_path, config, _hf_tensors(config, wmap), tokenizer_json=tokenizer_json,
                chat_template=_chat_template(hf_dir, tok_cfg),
                special_tokens=special_tokens_from(tok, tok_cfg, gen, hf_cfg),
                generation=generation, progress=progress)
    return config


def _generator(seed: int, name: str) -> torch.Generator:
    """A generator per tensor, seeded from (seed, name): any tensor is reproducible alone."""
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & (2**63 - 1))


def _normal_fp16(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    out = torch.empty(shape, dtype=torch.float16)
    flat = out.view(shape[0], -1)
    for i in range(0, shape[0], ROW_CHUNK):  # draw fp32 in chunks: no full fp32 copy in RAM
        rows = flat[i:i + ROW_CHUNK]
        rows.copy_(torch.empty(rows.shape).normal_(0.0, INIT_STD, generator=g))
    return out


def _synthetic_tensors(config: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    for name, (dtype, shape) in expected_tensors(config).items():
        if name.endswith(".scales"):
            continue
        g = _generator(seed, name)
        if name.endswith(".qweight"):
            n, k = shape[0], shape[1] * 8
            parts = []
            for i in range(0, n, ROW_CHUNK):
                w = torch.empty(min(ROW_CHUNK, n - i), k).normal_(0.0, INIT_STD, generator=g)
                parts.append(quantize(w))
            yield name, torch.cat([p[0] for p in parts])
            yield name.removesuffix(".qweight") + ".scales", torch.cat([p[1] for p in parts])
        elif name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=torch.float16)
        else:
            # embeddings, lm_head and q/k/v biases. transformers zero-inits biases; we draw
            # them like the weights so that a bias the engine forgot to add shows in the logits
            yield name, _normal_fp16(shape, g)


def synthetic(preset_or_config: str | ModelConfig, out_path: str | Path, seed: int = 0,
              tokenizer_json: str | None = None, chat_template: str | None = None,
              progress: Progress | None = None) -> ModelConfig:
    """A random-weight model of a preset name ("7b") or any ModelConfig, drawn as transformers
    initialises Qwen2: linear and embedding weights N(0, 0.02), norms 1 (biases: see above).
    `tokenizer_json` is the tokenizer.json *text* to embed (None: no tokenizer)."""
    config = (preset_or_config if isinstance(preset_or_config, ModelConfig)
              else ModelConfig.from_name(preset_or_config))
    tok = None
    if tokenizer_json is not None:
        try:
            tok = json.loads(tokenizer_json)
        except json.JSONDecodeError as e:
            raise FormatError(f"the tokenizer to embed is not valid JSON: {e}") from e
    eos = [i for i in (_token_id(tok, t) for t in DEFAULT_STOP_TOKENS) if i is not None]
    write_model(out_path, config, _synthetic_tensors(config, seed), tokenizer_json=tokenizer_json,
                chat_template=chat_template,
                special_tokens={"eos_token_ids": eos, "pad_token_id": eos[-1] if eos else None},
                generation={}, progress=progress)
    return config


def cli_convert(args) -> int:
    """`nanoqwen convert HF_DIR -o FILE` / `nanoqwen convert --synthetic PRESET -o FILE`."""
    if bool(args.hf_dir) == bool(args.synthetic):
        raise NanoqwenError("give either HF_DIR or --synthetic PRESET (exactly one)")
    if args.tokenizer and not args.synthetic:
        raise NanoqwenError("--tokenizer goes with --synthetic (a checkpoint brings its own)")
    if args.max_context is not None and args.max_context <= 0:
        raise NanoqwenError(f"--max-context={args.max_context} must be positive")
    bar = StderrProgress(f"convert -> {Path(args.output).name}")
    try:
        if args.synthetic:
            config = ModelConfig.from_name(args.synthetic)
            if args.max_context:
                config = dataclasses.replace(config, max_position_embeddings=args.max_context)
            tokenizer_json = None
            if args.tokenizer:
                try:
                    tokenizer_json = Path(args.tokenizer).read_text(encoding="utf-8")
                except OSError as e:
                    raise NanoqwenError(f"cannot read --tokenizer {args.tokenizer}: "
                                        f"{e.strerror}") from e
            config = synthetic(config, args.output, seed=args.seed,
                               tokenizer_json=tokenizer_json, progress=bar)
        else:
            config = convert_hf(args.hf_dir, args.output, progress=bar,
                                max_context=args.max_context)
    finally:
        bar.close()
    size = Path(args.output).stat().st_size
    print(f"wrote {args.output}: {config.name}, {size:,} bytes, "
          f"{config.decode_bytes_per_token() / 1e9:.3f} GB read per decoded token")
    return 0
