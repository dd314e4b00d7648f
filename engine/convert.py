"""Hugging Face Qwen2 checkpoint -> .nanoqwen, and synthetic (random-weight) models.

Everything about the checkpoint is checked before the first byte is written: config.json
(`model_type` decides the architecture, as in transformers), every shard's safetensors header
(read here, so a truncated shard, a garbage header, or an index naming a tensor its shard
lacks is one FormatError naming the file), every tensor's shape and dtype, and that the
tokenizer's ids fit the model's vocabulary. Then the tensors stream to `write_model`:

- Shards are read one at a time with plain reads (no mmap), in file order; a shard is closed
  before the next is opened, so no shard stays mapped or counted in the process's RSS.
- A tensor is read and converted in row blocks of about BLOCK_ELEMS elements: only its output
  (fp16, or INT4 qweight + scales) is whole in memory, plus one block's temporaries (~70 MB,
  measured). So the process holds about the largest output tensor (the 7B embedding: 1.09 GB
  fp16) plus that, never a bf16 source + fp32 copy + .abs() temporary of the embedding at once.
  Measured with benchmarks/bench_convert.py (peak RSS as `/usr/bin/time -v` reports it, bf16
  checkpoints in 4 shards): 1.5B shapes 0.71 GiB (3.50 GiB before this layout), 1.6x its
  467 MB embedding; 0.5B shapes 0.52 GiB (1.87 GiB before). benchmarks/RESULTS.md has the runs.

Precision: the seven projections are quantized from the source values upcast to fp32 (not
via fp16, which would round twice); everything else is stored fp16, and a value beyond
fp16's range (|x| > 65504) or a non-finite value is an error naming the tensor.

The model's name comes from the checkpoint (`model_name`): the repository name when the
directory is a Hugging Face cache snapshot (models--Qwen--X/snapshots/<hash> -> X), else the
config's `_name_or_path`, else the directory's name; never a snapshot hash.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import torch

from .config import ConfigError, ModelConfig
from .errors import FormatError, NanoqwenError
from .format import Progress, expected_tensors, write_model
from .progress import StderrProgress
from .quant import BLOCK_ELEMS as QUANT_BLOCK_ELEMS, quantize_blocks
from .synthetic import SyntheticWeights
from .tokenizer import DEFAULT_STOP_TOKENS, check_token_ids

FP16_MAX = 65504.0
BLOCK_ELEMS = QUANT_BLOCK_ELEMS  # elements converted at once (quant.py says why this many)
# generation_config.json keys that describe the file, not how to sample
_GEN_DROP = ("transformers_version", "_from_model_config")
ARCHITECTURE = "Qwen2ForCausalLM"

# --- safetensors -----------------------------------------------------------------------------
# The format (huggingface/safetensors): u64 little-endian header length N, N bytes of JSON
# {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the
# data; offsets are relative to the data's start and the tensors tile it with no holes.
ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
ST_FLOAT = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
            "F64": torch.float64}
ST_MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers too


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of a safetensors file: where its bytes are (absolute offset in `path`)."""
    name: str
    path: Path
    dtype: str                   # safetensors' name: "BF16", "F32", ...
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, SourceTensor]:
    """Parse and check a .safetensors file's header against its size; FormatError naming the
    file for a short file, a garbage header, malformed entries, holes/overlaps, truncation."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            raw = f.read(n) if 0 <= n <= min(ST_MAX_HEADER, size - 8) else b""
    except OSError as e:
        raise FormatError(f"cannot read {path}: {e.strerror}") from e
    if n < 0:
        raise FormatError(f"{path}: not a safetensors file ({size} bytes, shorter than its "
                          "8-byte header length)")
    if n > min(ST_MAX_HEADER, size - 8):
        raise FormatError(f"{path}: not a safetensors file or a garbage header: its first 8 "
                          f"bytes give a header of {n:,} bytes, the file has {size:,}")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: garbage safetensors header (not UTF-8 JSON: {e})") from e
    if not isinstance(header, dict):
        raise FormatError(f"{path}: garbage safetensors header (a JSON "
                          f"{type(header).__name__}, not an object)")
    data_start = 8 + n
    out: dict[str, SourceTensor] = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            ok = (dtype in ST_ITEMSIZE and all(isinstance(d, int) and d >= 0 for d in shape)
                  and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise FormatError(f"{path}: safetensors header entry {name!r} is malformed: "
                              f"{str(e)[:200]}")
        if end - begin != math.prod(shape) * ST_ITEMSIZE[dtype]:
            raise FormatError(f"{path}: tensor {name!r} is {dtype} {list(shape)} but its "
                              f"data_offsets [{begin}, {end}] hold {end - begin} bytes")
        out[name] = SourceTensor(name, path, dtype, shape, data_start + begin, end - begin)
    pos = data_start
    for t in sorted(out.values(), key=lambda t: (t.offset, t.nbytes)):
        if t.offset != pos:
            raise FormatError(f"{path}: tensor {t.name!r} starts at data offset "
                              f"{t.offset - data_start}, expected {pos - data_start} (the "
                              "header's tensors overlap or leave a hole)")
        pos += t.nbytes
    if pos > size:
        raise FormatError(f"{path} is truncated: its header describes {pos:,} bytes, the file "
                          f"has {size:,} ({pos - size:,} missing)")
    if pos < size:
        raise FormatError(f"{path}: {size - pos:,} unexpected bytes after the last tensor "
                          f"(the header describes {pos:,} bytes)")
    return out


def _read_rows(f: BinaryIO, t: SourceTensor, r0: int, r1: int) -> torch.Tensor:
    """Rows r0..r1 of `t` (along its first dimension), in its own dtype, read into a fresh
    buffer (a plain read: nothing of the file stays mapped)."""
    row_bytes = t.nbytes // t.shape[0] if t.shape and t.shape[0] else t.nbytes
    buf = torch.empty((r1 - r0) * row_bytes, dtype=torch.uint8)
    f.seek(t.offset + r0 * row_bytes)
    got = f.readinto(memoryview(buf.numpy()))
    if got != buf.numel():
        raise FormatError(f"{t.path}: tensor {t.name!r}: short read ({got} of {buf.numel()} "
                          "bytes); did the file change during the conversion?")
    return buf.view(ST_FLOAT[t.dtype]).view((r1 - r0, *t.shape[1:]))


def _blocks(t: SourceTensor) -> Iterator[tuple[int, int]]:
    rows = t.shape[0]
    step = max(1, BLOCK_ELEMS // max(1, math.prod(t.shape[1:])))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def _fp32_block(f: BinaryIO, t: SourceTensor, r0: int, r1: int) -> torch.Tensor:
    w = _read_rows(f, t, r0, r1).to(torch.float32)
    if not torch.isfinite(w).all():
        raise FormatError(f"{t.path}: tensor {t.name!r} contains inf or NaN")
    return w


def _fp16_tensor(f: BinaryIO, t: SourceTensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=torch.float16)
    for r0, r1 in _blocks(t):
        w = _fp32_block(f, t, r0, r1)
        amax = float(w.abs().max()) if w.numel() else 0.0
        if amax > FP16_MAX:
            raise FormatError(f"{t.path}: tensor {t.name!r} has a value of magnitude {amax:g}, "
                              f"beyond fp16's range ({FP16_MAX:g}); it cannot be stored as fp16")
        out[r0:r1].copy_(w)  # fp32 -> fp16, round to nearest even (as .to(torch.float16))
    return out


def _int4_tensor(f: BinaryIO, t: SourceTensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = t.shape
    qweight, scales = quantize_blocks(((r0, r1, _fp32_block(f, t, r0, r1))
                                       for r0, r1 in _blocks(t)), n, k)
    if not torch.isfinite(scales).all():  # amax/7 beyond fp16's range
        raise FormatError(f"{t.path}: tensor {t.name!r} has values too large for fp16 INT4 "
                          f"scales (|x| > {FP16_MAX * 7:g})")
    return qweight, scales


# --- the checkpoint directory ------------------------------------------------------------------
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


def source_tensors(hf_dir: Path) -> dict[str, SourceTensor]:
    """HF tensor name -> where it is, from the index (or the single model.safetensors), with
    every shard's header read and checked and every index entry found in its shard."""
    index = hf_dir / "model.safetensors.index.json"
    single = hf_dir / "model.safetensors"
    if index.is_file():
        wm = (_read_json(index) or {}).get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise FormatError(f"{index}: no 'weight_map' object of tensor name -> shard file")
        shards: dict[str, dict[str, SourceTensor]] = {}
        for shard in sorted(set(wm.values())):
            p = hf_dir / shard
            if not p.is_file():
                raise FormatError(f"{index} names shard {shard}, which is missing")
            shards[shard] = read_safetensors_header(p)
        out = {}
        for name, shard in wm.items():
            if name not in shards[shard]:
                raise FormatError(f"{index}: weight_map puts tensor {name!r} in {shard}, which "
                                  "does not hold it")
            out[name] = shards[shard][name]
        return out
    if single.is_file():
        return read_safetensors_header(single)
    if any(hf_dir.glob("*.bin")) or any(hf_dir.glob("*.pt")):
        raise FormatError(f"{hf_dir}: only .safetensors weights are supported (found .bin/.pt; "
                          "re-save with save_pretrained(safe_serialization=True))")
    raise FormatError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")


_HASH = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a git/HF snapshot or sha256 directory name


def model_name(hf_dir: Path, hf_cfg: dict[str, Any]) -> str:
    """The model's name (module doc): HF cache repository > config `_name_or_path` >
    directory name; a bare hash is never a name."""
    paths = (hf_dir.absolute(), hf_dir.resolve())
    for p in paths:  # <cache>/models--{org}--{name}/snapshots/{hash}[/...]
        parts = p.parts
        for i, part in enumerate(parts[:-2]):
            if part.startswith("models--") and parts[i + 1] == "snapshots":
                return part.split("--")[-1]
    for key in ("_name_or_path", "name"):
        v = hf_cfg.get(key)
        if isinstance(v, str) and v.strip().rstrip("/\\"):
            base = re.split(r"[/\\]", v.strip().rstrip("/\\"))[-1]
            if not _HASH.fullmatch(base):
                return base
    for p in paths:
        if p.name and not _HASH.fullmatch(p.name):
            return p.name
    return "qwen2"


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


def _needed(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF source name -> the shape the config expects, for every tensor the file is made of."""
    proj = config.projection_shapes()
    out = {}
    for name, (_, shape) in expected_tensors(config).items():
        if name.endswith(".scales"):
            continue
        if name.endswith(".qweight"):
            base = name.removesuffix(".qweight")
            out[base + ".weight"] = proj[base.split(".", 3)[3]]
        else:
            out[name] = shape
    return out


def _check_tensors(hf_dir: Path, config: ModelConfig, src: dict[str, SourceTensor]) -> None:
    needed = _needed(config)
    missing = sorted(set(needed) - set(src))
    if missing:
        raise FormatError(f"{hf_dir}: checkpoint lacks {len(missing)} tensor(s) the config "
                          f"needs: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    # inv_freq buffers are recomputed from rope_theta; a tied lm_head is the embedding
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = sorted(n for n in set(src) - set(needed)
                   if n not in ignorable and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise FormatError(f"{hf_dir}: checkpoint has tensor(s) a Qwen2 model does not use "
                          f"(another architecture?): {', '.join(extra[:5])}")
    for name, shape in needed.items():
        t = src[name]
        if t.shape != tuple(shape):
            raise FormatError(f"{t.path}: tensor {name!r} has shape {list(t.shape)}, the "
                              f"config expects {list(shape)}")
        if t.dtype not in ST_FLOAT:
            raise FormatError(f"{t.path}: tensor {name!r} has dtype {t.dtype}, expected a "
                              f"floating-point weight ({', '.join(ST_FLOAT)})")


def _hf_tensors(config: ModelConfig, src: dict[str, SourceTensor]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors, shard by shard (one open at a time, closed when done)."""
    by_shard: dict[Path, list[str]] = {}
    for name in expected_tensors(config):  # file order within a shard: sequential writes
        if name.endswith(".scales"):
            continue  # produced with its .qweight
        s = name.removesuffix(".qweight") + ".weight" if name.endswith(".qweight") else name
        by_shard.setdefault(src[s].path, []).append(name)
    for path in sorted(by_shard):
        try:
            f = open(path, "rb", buffering=0)
        except OSError as e:
            raise FormatError(f"cannot read {path}: {e.strerror}") from e
        with f:
            for name in by_shard[path]:
                if name.endswith(".qweight"):
                    base = name.removesuffix(".qweight")
                    qweight, scales = _int4_tensor(f, src[base + ".weight"])
                    yield name, qweight
                    del qweight  # write_model has written it: let it go before the next
                    yield base + ".scales", scales
                    del scales
                else:
                    yield name, _fp16_tensor(f, src[name])


def convert_hf(hf_dir: str | Path, out_path: str | Path, progress: Progress | None = None,
               max_context: int | None = None) -> ModelConfig:
    """Convert a Hugging Face Qwen2 checkpoint directory to `out_path`; returns its config.
    Raises FormatError/ConfigError (one line, naming the file or field) before anything is
    written for any problem the checkpoint's metadata shows."""
    if sys.byteorder != "little":
        raise FormatError("safetensors and .nanoqwen are little-endian; this machine is not")
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise FormatError(f"{hf_dir} is not a directory")
    hf_cfg = _read_json(hf_dir / "config.json", required=True)
    try:
        config = ModelConfig.from_hf_config(hf_cfg, name=model_name(hf_dir, hf_cfg))
        if max_context:
            config = dataclasses.replace(config, max_position_embeddings=max_context)
    except ConfigError as e:
        raise ConfigError(f"{hf_dir / 'config.json'}: {e}") from e
    src = source_tensors(hf_dir)
    _check_tensors(hf_dir, config, src)
    tok_path = hf_dir / "tokenizer.json"
    tokenizer_json = tok_path.read_text(encoding="utf-8") if tok_path.is_file() else None
    try:
        tok = json.loads(tokenizer_json) if tokenizer_json else None
    except json.JSONDecodeError as e:
        raise FormatError(f"{tok_path}: not valid JSON: {e}") from e
    tok_cfg = _read_json(hf_dir / "tokenizer_config.json")
    gen = _read_json(hf_dir / "generation_config.json")
    special = special_tokens_from(tok, tok_cfg, gen, hf_cfg)
    if tokenizer_json is not None:
        check_token_ids(tokenizer_json, config.vocab_size, str(tok_path))
    _check_special_ids(special, config, hf_dir)
    generation = {k: v for k, v in (gen or {}).items() if k not in _GEN_DROP}
    write_model(out_path, config, _hf_tensors(config, src), tokenizer_json=tokenizer_json,
                chat_template=_chat_template(hf_dir, tok_cfg), special_tokens=special,
                generation=generation, progress=progress)
    return config


def _check_special_ids(special: dict[str, Any], config: ModelConfig, where: Path) -> None:
    for key in ("eos_token_ids", "pad_token_id", "bos_token_id"):
        for i in _ids(special.get(key)):
            if not 0 <= i < config.vocab_size:
                raise FormatError(f"{where}: {key.removesuffix('s')} {i} (from "
                                  "generation_config.json / config.json) is outside the model's "
                                  f"vocabulary of {config.vocab_size} (config.json vocab_size)")


# --- synthetic models ------------------------------------------------------------------------

def _synthetic_tensors(config: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors from synthetic.SyntheticWeights on the CPU (the generator the GPU
    benchmark uses too), in file order; a projection's .qweight and .scales come from one pass."""
    weights = SyntheticWeights(config, seed, device="cpu")
    for name in expected_tensors(config):
        if name.endswith(".scales"):
            continue
        if name.endswith(".qweight"):
            base = name.removesuffix(".qweight")
            qweight, scales = weights.quantized(base)
            yield name, qweight
            del qweight  # write_model has written it: let it go before the next
            yield base + ".scales", scales
            del scales
        else:
            yield name, weights[name]


def synthetic(preset_or_config: str | ModelConfig, out_path: str | Path, seed: int = 0,
              tokenizer_json: str | None = None, chat_template: str | None = None,
              progress: Progress | None = None) -> ModelConfig:
    """A random-weight model of a preset name ("7b") or any ModelConfig: the tensors of
    synthetic.SyntheticWeights(config, seed) (weights and biases N(0, 0.02), norms
    1 + 0.1 N(0, 1); the same tensors `nanoqwen bench --synthetic` makes on the GPU).
    `tokenizer_json` is the tokenizer.json *text* to embed (None: no tokenizer)."""
    config = (preset_or_config if isinstance(preset_or_config, ModelConfig)
              else ModelConfig.from_name(preset_or_config))
    tok = None
    if tokenizer_json is not None:
        try:
            tok = json.loads(tokenizer_json)
        except json.JSONDecodeError as e:
            raise FormatError(f"the tokenizer to embed is not valid JSON: {e}") from e
        check_token_ids(tokenizer_json, config.vocab_size, "the tokenizer to embed")
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
    from .cli import write_stdout

    write_stdout(f"wrote {args.output}: {config.name}, {size:,} bytes, "
                 f"{config.decode_bytes_per_token() / 1e9:.3f} GB read per decoded token\n")
    return 0
