"""Open a `.nanoqwen` file and build the backend and tokenizer for it.

"auto" picks the CUDA engine when a device and the built extension are there and falls back
to the reference backend otherwise, recording why (`LoadedEngine.fallback_reason`) so the
app and the CLI can say which backend runs and why. An explicit backend="cuda" that cannot
run raises BackendUnavailable instead.

Every load verifies the file's checksums first (`ModelFile.verify`: each tensor's CRC32, on
several threads), so a flipped byte is an error naming the tensor, never a model that
generates silently from corrupt weights. Measured cost (docs/FORMAT.md, "Checksums at load"):
~22 ms for the bundled 25 MB model, ~1 GB/s per core, so a 7B file (5.5 GB) costs ~2.5 s on 2
cores and ~1 s with 8 threads (its 1.09 GB embedding is the longest single checksum).
`load(verify=False)` skips it (tests, tools that just verified).

The CUDA backend (backends/cuda.py, imported lazily) is expected to provide
    CudaBackend.from_model_file(mf, mode=..., max_context=..., progress=...)
raising BackendUnavailable when it cannot run here (no device, no compiler, build failed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .backends.base import Backend
from .errors import BackendUnavailable, NanoqwenError
from .format import ModelFile, Progress, open_model
# BACKENDS and default_model_path are defined where the torch-free app can reach them
from .service import BACKENDS, default_model_path
from .tokenizer import Tokenizer


@dataclass
class LoadedEngine:
    backend: Backend
    tokenizer: Tokenizer
    model_file: ModelFile
    fallback_reason: str | None = None  # why "auto" did not get CUDA; None otherwise

    def __iter__(self):
        # `backend, tokenizer, mf = load(...)` keeps working
        return iter((self.backend, self.tokenizer, self.model_file))

    def close(self) -> None:
        self.model_file.close()


def _cuda_backend(mf: ModelFile, mode: str, max_context: int | None,
                  progress: Progress | None, prefill_weights: str = "auto") -> Backend:
    if not torch.cuda.is_available():
        raise BackendUnavailable("no CUDA device is available")
    try:
        from .backends.cuda import CudaBackend
    except ImportError as e:
        raise BackendUnavailable(f"the CUDA backend cannot be imported: {e}") from e
    return CudaBackend.from_model_file(mf, mode=mode, max_context=max_context, progress=progress,
                                       prefill_weights=prefill_weights)


def load(path: str | Path | None = None, backend: str = "auto", mode: str = "graph",
         progress: Progress | None = None, max_context: int | None = None,
         verify: bool = True, threads: int | None = None,
         prefill_weights: str = "auto") -> LoadedEngine:
    """Open `path` (default: the bundled model) and build `backend` ("auto"|"cuda"|"reference").

    `mode` is the decode mode to start in where the backend has it (the reference backend
    only has "eager" and ignores it). `max_context` caps the KV cache (default: the
    backend's own default). `verify` checks every tensor's checksum before any is used
    (module doc). `threads`: the CPU backend's OpenMP threads (reference.set_cpu_threads;
    None: one per core); set before any weight is read, ignored by the CUDA backend.
    `prefill_weights`: the CUDA prefill's weights (CudaBackend: auto|resident|dequant|int4);
    the reference backend has one way. Raises
    FormatError for an unusable or corrupt file, BackendUnavailable for
    an explicit "cuda" that cannot run.
    """
    if backend not in BACKENDS:
        raise NanoqwenError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    path = Path(path) if path is not None else default_model_path()
    if not path.exists():
        raise NanoqwenError(f"model file {path} does not exist")
    mf = open_model(path)
    try:
        if max_context is not None:  # before the checksums: a bad value fails at once
            mf.config.check_context(max_context)
        if verify:
            mf.verify(progress=None if progress is None else
                      (lambda done, total, _name: progress(done, total, "verifying checksums")))
        tokenizer = Tokenizer.from_model_file(mf)
        reason = None
        be: Backend | None = None
        if backend in ("auto", "cuda"):
            try:
                be = _cuda_backend(mf, mode, max_context, progress, prefill_weights)
            except BackendUnavailable as e:
                if backend == "cuda":
                    raise
                reason = str(e)
        if be is None:
            from .backends.reference import ReferenceBackend, set_cpu_threads

            device = "cuda" if torch.cuda.is_available() else "cpu"
            if device == "cpu":
                set_cpu_threads(threads)
            be = ReferenceBackend.from_model_file(mf, device=device, max_context=max_context,
                                                  progress=progress)
        if mode in be.modes:
            be.mode = mode
        return LoadedEngine(be, tokenizer, mf, reason)
    except BaseException:
        mf.close()
        raise


def load_draft(path: str | Path, backend: Backend, tokenizer: Tokenizer,
               target_name: str) -> LoadedEngine:
    """The draft model of speculative decoding (spec "draft"): `path` loaded on the kind of
    `backend` (the target's), refused (NanoqwenError, the file closed) unless its tokenizer is the
    target's -- a draft proposes ids, so both must mean the same text by them. The caller
    sets `backend.draft_backend` to the result's backend and closes it with the target."""
    d = load(path, backend=backend.name)
    if not tokenizer.same_vocabulary(d.tokenizer):
        d.close()
        raise NanoqwenError(f"the draft model {path} has another tokenizer than "
                            f"{target_name}: a draft model needs the same vocabulary")
    return d
