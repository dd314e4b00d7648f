"""The one place that lists the CUDA sources and flags and builds the extension.

`load_extension()` JIT-builds csrc/ with torch.utils.cpp_extension (ninja) into a stable
per-user cache directory, `<user cache dir>/nanoqwen/build-<hash>`, where the hash covers the
sources' bytes, the flags and the torch/CUDA versions: a second start (or a second process)
finds the objects there and only loads the library. The library registers the
`torch.ops.nanoqwen.*` ops (csrc/bindings.cpp); engine/ops.py wraps them.

Every way this can fail (no CUDA device, no nvcc, a compile error, an installed copy whose
package data lacks csrc/) raises BackendUnavailable with a message that says which, so the
loader can fall back to the reference backend and tell the user why.

NANOQWEN_DEBUG=1 adds `-lineinfo -Xptxas -v` (register/spill report in the build log).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path

from .errors import BackendUnavailable

EXT_NAME = "nanoqwen_ext"

# Kernel files are torch-free and compile with plain nvcc; bindings.cpp is the only one
# with torch headers (about a minute on its own, so it is a separate translation unit).
SOURCES = (
    "bindings.cpp",
    "engine.cu",
    "embed_norm.cu",
    "rope_kv.cu",
    "attention.cu",
    "attention_prefill.cu",
    "sampling.cu",
    "spec.cu",
    "gemv_int4.cu",
    "gemm_int4.cu",
    "gemv_fp16.cu",
)
HEADERS = ("kernels.h", "common.cuh", "gemv.h", "engine.h")

CUDA_FLAGS = [
    "-O3",
    "-std=c++17",
    "-gencode=arch=compute_90a,code=sm_90a",
    # torch adds -D__CUDA_NO_HALF_OPERATORS__ etc.; undo them so the kernels compile exactly
    # as the plain-nvcc compile check (CI) compiles them.
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
]
# the C++ standard of bindings.cpp is left to torch (its headers move with its version)
CXX_FLAGS = ["-O3"]
DEBUG_FLAGS = ["-lineinfo", "-Xptxas", "-v"]

_lock = threading.Lock()
_loaded: str | None = None


def csrc_dir() -> Path:
    """The CUDA sources: NANOQWEN_CSRC if set, else the checkout's csrc/, or in an installed
    copy the package data at site-packages/nanoqwen/csrc (nanoqwen.REPO_ROOT says which)."""
    from nanoqwen import REPO_ROOT

    return Path(os.environ.get("NANOQWEN_CSRC", REPO_ROOT / "csrc"))


def debug_enabled() -> bool:
    return os.environ.get("NANOQWEN_DEBUG", "") not in ("", "0")


def flags() -> tuple[list[str], list[str]]:
    """(nvcc flags, c++ flags) for this build."""
    cuda = list(CUDA_FLAGS) + (DEBUG_FLAGS if debug_enabled() else [])
    return cuda, list(CXX_FLAGS)


def cache_root() -> Path:
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("nanoqwen"))
    except ImportError:  # the GPU machine's python has no platformdirs
        return Path.home() / ".cache" / "nanoqwen"


def build_dir() -> Path:
    """<cache>/build-<hash of sources + flags + torch/CUDA versions>."""
    import torch

    h = hashlib.sha256()
    src = csrc_dir()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((src / name).read_bytes())
    cuda_flags, cxx_flags = flags()
    h.update(repr((cuda_flags, cxx_flags, torch.__version__, torch.version.cuda)).encode())
    return cache_root() / f"build-{h.hexdigest()[:16]}"


def _check_prerequisites() -> None:
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable("no CUDA device: torch.cuda.is_available() is False "
                                 f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        raise BackendUnavailable(
            f"the kernels are built for sm_90a (H100/H200); this device "
            f"({torch.cuda.get_device_name()}) is sm_{major}{minor}")
    src = csrc_dir()
    missing = [n for n in SOURCES + HEADERS if not (src / n).is_file()]
    if missing:
        raise BackendUnavailable(f"CUDA sources missing from {src}: {', '.join(missing)} "
                                 "(a broken install? reinstall nanoqwen, or unset "
                                 "NANOQWEN_CSRC if it points elsewhere)")
    from torch.utils import cpp_extension

    nvcc = None
    if cpp_extension.CUDA_HOME:
        cand = Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
        nvcc = str(cand) if cand.exists() else None
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise BackendUnavailable("no CUDA compiler: nvcc is neither in CUDA_HOME "
                                 f"({cpp_extension.CUDA_HOME}) nor on PATH")


def load_extension(verbose: bool | None = None) -> str:
    """Build (or reuse) and load the extension; return the library path. Idempotent."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        _check_prerequisites()
        import torch
        from torch.utils import cpp_extension

        d = build_dir()
        d.mkdir(parents=True, exist_ok=True)
        cuda_flags, cxx_flags = flags()
        src = csrc_dir()
        if verbose is None:
            verbose = debug_enabled()
        try:
            path = cpp_extension.load(
                name=EXT_NAME,
                sources=[str(src / n) for n in SOURCES],
                extra_cflags=cxx_flags,
                extra_cuda_cflags=cuda_flags,
                extra_include_paths=[str(src)],
                build_directory=str(d),
                is_python_module=False,
                verbose=verbose,
            )
        except Exception as e:  # compiler errors arrive as RuntimeError/CalledProcessError
            msg = str(e).strip()
            if len(msg) > 4000:
                msg = "...\n" + msg[-4000:]
            raise BackendUnavailable(f"building the CUDA extension in {d} failed:\n{msg}") from e
        if not hasattr(torch.ops.nanoqwen, "attention_decode"):
            raise BackendUnavailable(f"{path} loaded but registered no nanoqwen ops")
        _loaded = str(path) if path is not None else str(d)
        return _loaded
