"""The `.nanoqwen` file, format v1: an atomic streaming writer and a validating mmap reader.

Byte layout (docs/FORMAT.md is the full reference; all integers little-endian):
  [0, 64)            fixed prefix, `PREFIX`: magic b"NANOQWEN", version u32, flags u32,
                     header_len u64, header_crc32 u32, reserved u32, file_size u64,
                     data_offset u64, 16 zero bytes
  [64, 64+header_len) UTF-8 JSON header: config, tokenizer.json text, chat template, special
                     tokens, generation defaults, tensor index (name, dtype, shape, offset,
                     nbytes, crc32)
  [data_offset, file_size) tensor data; every tensor starts at a multiple of 4096 (page
                     aligned, so an mmap view of it is aligned for fast pinned upload)

Invariants: `open_model` checks magic, version, flags, recorded vs actual size, header CRC and
JSON, the config, every tensor's dtype/shape against `expected_tensors(config)`, and every
tensor's bounds, alignment and non-overlap before it returns; tensor CRCs on `verify()`.
`write_model` never leaves a partial file under the final name (temp file + fsync + rename).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import secrets
import struct
import sys
import threading
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from .config import ConfigError, ModelConfig
from .errors import FormatError

MAGIC = b"NANOQWEN"
VERSION = 1
ALIGNMENT = 4096
# magic, version, flags, header_len, header_crc32, reserved, file_size, data_offset, 16 pad
PREFIX = struct.Struct("<8sIIQIIQQ16x")
HEADER_OFFSET = PREFIX.size  # 64
CHUNK = 16 << 20  # checksum / progress granularity
VERIFY_THREADS = 8  # more buys nothing once the largest tensor (embedding/lm_head) is the wait
# below this a thread pool costs more than it saves (bundled 25 MB model: 4.6 ms on one thread,
# 6.2 ms on two, 2-core machine)
VERIFY_SERIAL_BELOW = 64 << 20

# dtype name in the header -> (torch dtype, numpy dtype); numpy because np.frombuffer keeps the
# mmap exported (so it cannot be unmapped under a live tensor) and torch.from_numpy keeps that.
DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "fp16": (torch.float16, np.dtype("<f2")),
    "int32": (torch.int32, np.dtype("<i4")),
}

# progress(done_bytes, total_bytes, what): what is the tensor being written or checked.
Progress = Callable[[int, int, str], None]


def expected_tensors(config: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor a file for `config` holds: name -> (dtype, shape), in file order."""
    h, g = config.hidden_size, config.group_size
    out: dict[str, tuple[str, tuple[int, ...]]] = {
        "model.embed_tokens.weight": ("fp16", (config.vocab_size, h))}
    proj = config.projection_shapes()
    bias = {"self_attn.q_proj": config.q_size, "self_attn.k_proj": config.kv_size,
            "self_attn.v_proj": config.kv_size}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ("fp16", (h,))
        for name, (n, k) in proj.items():
            if name == "mlp.gate_proj":  # norm sits between attention and MLP, as it is used
                out[p + "post_attention_layernorm.weight"] = ("fp16", (h,))
            out[p + name + ".qweight"] = ("int32", (n, k // 8))
            out[p + name + ".scales"] = ("fp16", (n, k // g))
            if name in bias:
                out[p + name + ".bias"] = ("fp16", (bias[name],))
    out["model.norm.weight"] = ("fp16", (h,))
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = ("fp16", (config.vocab_size, h))
    return out


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str              # "fp16" | "int32"
    shape: tuple[int, ...]
    offset: int             # absolute byte offset in the file, multiple of ALIGNMENT
    nbytes: int
    crc32: int              # zlib.crc32 of the tensor's bytes


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][1].itemsize


class ModelFile:
    """An open, validated .nanoqwen file. Tensors are zero-copy views of a read-only mmap:
    writing into one crashes the process (SIGSEGV), so `.clone()` before any in-place op."""

    def __init__(self, path: Path, header: dict[str, Any], config: ModelConfig,
                 tensors: dict[str, TensorInfo], mm: mmap.mmap, file_size: int):
        self.path = path
        self.config = config
        self.tokenizer_json: str | None = header.get("tokenizer_json")
        self.chat_template: str | None = header.get("chat_template")
        self.special_tokens: dict[str, Any] = header.get("special_tokens") or {}
        self.generation: dict[str, Any] = header.get("generation") or {}
        self.tensors = tensors
        self.file_size = file_size
        self._mm: mmap.mmap | None = mm

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name` (CPU, zero-copy from the mmap, read-only)."""
        if self._mm is None:
            raise ValueError(f"{self.path} is closed")
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{name!r} is not a tensor of {self.path}")
        np_dtype = DTYPES[info.dtype][1]
        arr = np.frombuffer(self._mm, dtype=np_dtype, count=info.nbytes // np_dtype.itemsize,
                            offset=info.offset).reshape(info.shape)
        with warnings.catch_warnings():  # torch warns that the (read-only) buffer is not writable
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)

    def verify(self, progress: Progress | None = None, threads: int | None = None) -> None:
        """Check every tensor's CRC32; raises FormatError naming the first tensor (in file
        order) that differs. Tensors are checked on `threads` threads (default: up to
        VERIFY_THREADS, one per core), largest first: zlib.crc32 releases the GIL, so the time
        is about max(largest tensor, total / threads) at ~1.1 GB/s per core
        (docs/FORMAT.md, "Checksums at load"). `progress` is called under a lock."""
        if self._mm is None:
            raise ValueError(f"{self.path} is closed")
        infos = sorted(self.tensors.values(), key=lambda t: (-t.nbytes, t.offset))
        total = sum(t.nbytes for t in infos)
        n = max(1, min(threads or VERIFY_THREADS, os.cpu_count() or 1, len(infos) or 1))
        if threads is None and total < VERIFY_SERIAL_BELOW:
            n = 1
        lock = threading.Lock()
        done = 0
        view = memoryview(self._mm)

        def crc_of(t: TensorInfo) -> int:
            nonlocal done
            crc = 0
            for start in range(t.offset, t.offset + t.nbytes, CHUNK):
                end = min(start + CHUNK, t.offset + t.nbytes)
                crc = zlib.crc32(view[start:end], crc)
                if progress:
                    with lock:
                        done += end - start
                        progress(done, total, t.name)
            return crc

        try:
            if n == 1:
                crcs = [crc_of(t) for t in infos]
            else:
                with ThreadPoolExecutor(n, thread_name_prefix="nanoqwen-verify") as ex:
                    crcs = list(ex.map(crc_of, infos))
        finally:
            view.release()
        for t, crc in sorted(zip(infos, crcs), key=lambda x: x[0].offset):
            if crc != t.crc32:
                raise FormatError(
                    f"{self.path}: checksum mismatch in tensor {t.name!r} (bytes "
                    f"{t.offset}..{t.offset + t.nbytes}): stored {t.crc32:08x}, "
                    f"computed {crc:08x}; the file is corrupt")

    def close(self) -> None:
        """Drop the mapping. Tensors still alive keep it mapped until they are freed."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # live tensors export it; it is unmapped when the last one goes
            self._mm = None

    def __enter__(self) -> "ModelFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_model(path: str | os.PathLike, verify: bool = False) -> ModelFile:
    """Open and validate a .nanoqwen file (checksums too when `verify`)."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise FormatError(f"cannot open {path}: {e.strerror}") from e
    with f:
        actual = os.fstat(f.fileno()).st_size
        prefix = f.read(HEADER_OFFSET)
        header, config, tensors, recorded = _validate(path, f, prefix, actual)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mf = ModelFile(path, header, config, tensors, mm, recorded)
    if verify:
        try:
            mf.verify()
        except BaseException:
            mf.close()
            raise
    return mf


def _validate(path: Path, f, prefix: bytes, actual: int):
    if prefix[:8] != MAGIC:
        if len(prefix) < 8 and MAGIC.startswith(prefix):
            raise FormatError(f"{path} is truncated: {actual} bytes, not even the 8-byte magic")
        raise FormatError(f"{path}: not a .nanoqwen file (first bytes {prefix[:16]!r}, "
                          f"expected {MAGIC!r})")
    if len(prefix) < HEADER_OFFSET:
        raise FormatError(f"{path} is truncated: {actual} bytes, shorter than the "
                          f"{HEADER_OFFSET}-byte prefix")
    _, version, flags, hlen, hcrc, _, recorded, data_off = PREFIX.unpack(prefix)
    if version > VERSION:
        raise FormatError(f"{path} was written by a newer nanoqwen (v{version}); "
                          f"this one reads v{VERSION}")
    if version != VERSION:
        raise FormatError(f"{path}: unknown format version {version} (this nanoqwen reads v{VERSION})")
    if flags:
        raise FormatError(f"{path}: unknown flags 0x{flags:08x} in the prefix (v1 defines none)")
    if actual < recorded:
        raise FormatError(f"{path} is truncated: {actual} bytes on disk, the prefix records "
                          f"{recorded} ({recorded - actual} bytes missing)")
    if actual > recorded:
        raise FormatError(f"{path}: {actual - recorded} unexpected bytes after the recorded "
                          f"end of the file at byte {recorded}")
    if HEADER_OFFSET + hlen > data_off or data_off > recorded or data_off % ALIGNMENT:
        raise FormatError(f"{path}: prefix lies: header {HEADER_OFFSET}..{HEADER_OFFSET + hlen}, "
                          f"data_offset {data_off}, file_size {recorded} (data_offset must "
                          f"follow the header, be {ALIGNMENT}-aligned and inside the file)")
    raw = f.read(hlen)
    crc = zlib.crc32(raw)
    if crc != hcrc:
        raise FormatError(f"{path}: header checksum mismatch (bytes {HEADER_OFFSET}.."
                          f"{HEADER_OFFSET + hlen}): stored {hcrc:08x}, computed {crc:08x}")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: header is not valid UTF-8 JSON: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("config"), dict) \
            or not isinstance(header.get("tensors"), list):
        raise FormatError(f"{path}: header lacks a 'config' object or a 'tensors' list")
    for key, types in (("tokenizer_json", (str, type(None))), ("chat_template", (str, type(None))),
                       ("special_tokens", (dict, type(None))), ("generation", (dict, type(None)))):
        if not isinstance(header.get(key), types):
            raise FormatError(f"{path}: header field {key!r} has type "
                              f"{type(header.get(key)).__name__}")
    try:
        config = ModelConfig.from_dict(header["config"])
    except (ConfigError, TypeError) as e:
        raise FormatError(f"{path}: header config is not usable: {e}") from e
    tensors = _validate_tensors(path, header["tensors"], config, data_off, recorded)
    return header, config, tensors, recorded


def _validate_tensors(path: Path, entries: list, config: ModelConfig, data_off: int,
                      size: int) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for i, e in enumerate(entries):
        try:
            info = TensorInfo(name=e["name"], dtype=e["dtype"], shape=tuple(e["shape"]),
                              offset=e["offset"], nbytes=e["nbytes"], crc32=int(e["crc32"], 16))
            ok = (isinstance(info.name, str) and info.dtype in DTYPES
                  and all(isinstance(d, int) and d >= 0 for d in info.shape)
                  and isinstance(info.offset, int) and isinstance(info.nbytes, int))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise FormatError(f"{path}: tensor index entry {i} is malformed: {str(e)[:200]}")
        where = f"{path}: tensor {info.name!r}"
        if info.name in tensors:
            raise FormatError(f"{where} appears twice in the index")
        if info.nbytes != _nbytes(info.dtype, info.shape):
            raise FormatError(f"{where}: nbytes={info.nbytes} but {info.dtype} "
                              f"{list(info.shape)} needs {_nbytes(info.dtype, info.shape)}")
        if info.offset % ALIGNMENT or info.offset < data_off:
            raise FormatError(f"{where}: offset {info.offset} is not a {ALIGNMENT}-aligned "
                              f"offset in the data region (which starts at {data_off})")
        if info.offset + info.nbytes > size:
            raise FormatError(f"{where}: bytes {info.offset}..{info.offset + info.nbytes} run "
                              f"past the end of the file ({size} bytes)")
        tensors[info.name] = info
    prev = None
    for t in sorted(tensors.values(), key=lambda t: t.offset):
        if prev is not None and t.offset < prev.offset + prev.nbytes:
            raise FormatError(f"{path}: tensors {prev.name!r} and {t.name!r} overlap "
                              f"(offsets {prev.offset}+{prev.nbytes} and {t.offset})")
        prev = t
    expected = expected_tensors(config)
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise FormatError(f"{path}: {len(missing)} tensor(s) the config needs are missing: "
                          f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    extra = [n for n in tensors if n not in expected]
    if extra:
        raise FormatError(f"{path}: unexpected tensor(s) for this config (tie_word_embeddings="
                          f"{config.tie_word_embeddings}): {', '.join(extra[:5])}")
    for name, (dtype, shape) in expected.items():
        t = tensors[name]
        if (t.dtype, t.shape) != (dtype, shape):
            raise FormatError(f"{path}: tensor {name!r} is {t.dtype} {list(t.shape)} but the "
                              f"config expects {dtype} {list(shape)}")
    return tensors


def _header_bytes(config: ModelConfig, infos: list[TensorInfo], extra: dict[str, Any]) -> bytes:
    header = {"format": "nanoqwen", "version": VERSION, "alignment": ALIGNMENT,
              "config": config.to_dict(), **extra,
              # crc32 as 8 hex digits: fixed width, so the header's length is known before
              # the data (and so its checksums) has been written
              "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                           "offset": t.offset, "nbytes": t.nbytes, "crc32": f"{t.crc32:08x}"}
                          for t in infos]}
    return json.dumps(header, ensure_ascii=False).encode("utf-8")


def write_model(path: str | os.PathLike, config: ModelConfig,
                tensors: Iterable[tuple[str, torch.Tensor]], tokenizer_json: str | None = None,
                chat_template: str | None = None, special_tokens: dict[str, Any] | None = None,
                generation: dict[str, Any] | None = None, progress: Progress | None = None) -> None:
    """Write a .nanoqwen file atomically, streaming `tensors` (any order, each exactly once;
    exactly the set `expected_tensors(config)` names) one at a time to its place."""
    if sys.byteorder != "little":
        raise FormatError("the .nanoqwen format is little-endian; this machine is not")
    path = Path(path)
    expected = expected_tensors(config)
    extra = {"tokenizer_json": tokenizer_json, "chat_template": chat_template,
             "special_tokens": special_tokens or {}, "generation": generation or {}}
    # offsets depend on the header's length, which depends on the offsets' digits: iterate
    # to the fixed point (it only grows, so two or three rounds)
    data_off, prev = _align(HEADER_OFFSET), -1
    while data_off != prev:
        layout, off = [], data_off
        for name, (dtype, shape) in expected.items():
            layout.append(TensorInfo(name, dtype, shape, off, _nbytes(dtype, shape), 0))
            off = _align(off + layout[-1].nbytes)
        prev, data_off = data_off, max(data_off, _align(
            HEADER_OFFSET + len(_header_bytes(config, layout, extra))))
    file_size = layout[-1].offset + layout[-1].nbytes
    slots = {t.name: t for t in layout}
    total = sum(t.nbytes for t in layout)

    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise FormatError(f"cannot write {path}: {e.strerror}") from e
    try:
        crcs: dict[str, int] = {}
        with os.fdopen(fd, "wb") as f:
            done = 0
            for name, t in tensors:
                slot = slots.get(name)
                if slot is None:
                    raise FormatError(f"writing {path}: tensor {name!r} is not part of this config")
                if name in crcs:
                    raise FormatError(f"writing {path}: tensor {name!r} given twice")
                want = DTYPES[slot.dtype][0]
                if t.dtype != want or tuple(t.shape) != slot.shape:
                    raise FormatError(f"writing {path}: tensor {name!r} is {t.dtype} "
                                      f"{list(t.shape)}, expected {want} {list(slot.shape)}")
                buf = t.detach().cpu().contiguous().numpy().reshape(-1).view(np.uint8)
                f.seek(slot.offset)
                f.write(buf)
                crcs[name] = zlib.crc32(buf)
                done += slot.nbytes
                del buf, t  # one tensor at a time: let the caller's producer free it
                if progress:
                    progress(done, total, name)
            missing = [n for n in expected if n not in crcs]
            if missing:
                raise FormatError(f"writing {path}: {len(missing)} tensor(s) never given: "
                                  f"{', '.join(missing[:5])}")
            final = [TensorInfo(t.name, t.dtype, t.shape, t.offset, t.nbytes, crcs[t.name])
                     for t in layout]
            header = _header_bytes(config, final, extra)
            assert HEADER_OFFSET + len(header) <= data_off  # crc32 is fixed width
            f.truncate(file_size)
            f.seek(0)
            f.write(PREFIX.pack(MAGIC, VERSION, 0, len(header), zlib.crc32(header), 0,
                                file_size, data_off))
            f.write(header)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise FormatError(f"cannot write {path}: {e.strerror or e}") from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(d: Path) -> None:
    """Make the rename durable; not every filesystem lets a directory be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def cli_info(args) -> int:
    """`nanoqwen info FILE [--verify]`."""
    from .cli import write_stdout  # a full disk on stdout is one error line (cli's doc)

    def out(line: str) -> None:
        write_stdout(line + "\n")

    with open_model(args.file) as mf:
        c = mf.config
        by_dtype: dict[str, int] = {}
        for t in mf.tensors.values():
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
        out(f"file:        {mf.path} ({mf.file_size:,} bytes, format v{VERSION})")
        out(f"model:       {c.name}")
        out("config:")
        for k, v in c.to_dict().items():
            out(f"  {k}: {v}")
        out(f"  head_dim={c.head_dim} q_size={c.q_size} kv_size={c.kv_size} "
            f"gqa_ratio={c.gqa_ratio}")
        tok = f"embedded ({len(mf.tokenizer_json):,} chars)" if mf.tokenizer_json else "none"
        tpl = f"embedded ({len(mf.chat_template):,} chars)" if mf.chat_template else \
            "none (built-in ChatML)"
        out(f"tokenizer:   {tok}")
        out(f"chat template: {tpl}")
        out(f"special tokens: {json.dumps(mf.special_tokens)}")
        out(f"generation defaults: {json.dumps(mf.generation)}")
        total = sum(by_dtype.values())
        out(f"tensors:     {len(mf.tensors)}, {total:,} bytes ("
            + ", ".join(f"{d} {n:,}" for d, n in sorted(by_dtype.items())) + ")")
        bpt = c.decode_bytes_per_token()
        out(f"decode reads per token: {bpt:,} bytes ({bpt / 1e9:.3f} GB) of weights")
        if args.verify:
            from .progress import StderrProgress
            bar = StderrProgress("verify")
            try:
                mf.verify(progress=bar)
            finally:
                bar.close()
            out("checksums OK")
    return 0
