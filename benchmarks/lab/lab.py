"""Build and load the lab library (benchmarks/lab/*.cu): the kernel variants that left csrc/.

    from lab import load      # with benchmarks/lab on sys.path (the lab scripts put it there)
    L = load()                # ctypes.CDLL with argtypes set; builds on first use

It compiles every benchmarks/lab/*.cu but the ALONE ones with plain nvcc (csrc/ on the include
path for common.cuh and kernels.h: the lab uses the product's device helpers and error
convention) and links them into one shared library, in $NANOQWEN_LAB_BUILD or /tmp/nanoqwen_lab_build, rebuilt
when a source or a csrc header is newer than it (or NANOQWEN_LAB_REBUILD=1). Nothing in the
engine links it; it is loaded with ctypes next to torch, and its launchers take the current
torch stream (torch.cuda.current_stream().cuda_stream), so they can be captured in a CUDA graph
together with torch.ops.nanoqwen calls. About 25 s to build on the GPU machine (the v2-v5 GEMV
families are most of it).

Every entry point returns a cudaError_t (0 = success); gemv_last_error_message() says what
went wrong, with the numbers (csrc/kernels.h's convention). `call(name, *args)` raises with it.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

LAB = Path(__file__).resolve().parent
REPO = LAB.parent.parent
CSRC = REPO / "csrc"
# the sources that include a csrc/ .cu whole (its external launchers with it) build alone
# (compile_alone, by their scripts): two of them in one library define those launchers twice
ALONE = {"gemm_int4_shapes.cu", "gemm_w4_wgmma.cu", "lm_head_cols_lab.cu",
         "gemv_int4_family_lab.cu"}
SOURCES = sorted(p for p in LAB.glob("*.cu") if p.name not in ALONE)
HEADERS = sorted(LAB.glob("*.h")) + sorted(LAB.glob("*.cuh")) + [CSRC / "common.cuh",
                                                                 CSRC / "kernels.h"]
FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC",
         "-Xptxas", "-v", f"-I{CSRC}", f"-I{LAB}"]

P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    # the lab's copies of the GEMV launchers of 2047cf7 (same instances as csrc/ at the move)
    "gemv_int4": [P, P, P, P, P, I, I, P],
    "gemv_int4_residual": [P, P, P, P, I, I, P],
    "gemv_int4_silu_mul": [P, P, P, P, P, P, I, I, P],
    "gemv_fp16": [P, P, P, I, I, P],
    "dequant_int4": [P, P, P, I, I, P],
    # every variant by index (gemv_int4_variant_name / gemv_fp16_variant_name)
    "gemv_int4_bench": [I, I, P, P, P, P, P, P, P, I, I, P],
    "gemv_fp16_bench": [I, P, P, P, I, I, P],
    # the fused-norm GEMVs (NANOQWEN_FUSE_NORM=1 until its removal) and their variants
    "gemv_int4_norm": [P, P, P, F, P, P, P, I, I, P],
    "gemv_int4_silu_mul_norm": [P, P, P, F, P, P, P, P, I, I, P],
    "gemv_fp16_norm": [P, P, P, F, P, I, I, P],
    "gemv_int4_norm_bench": [I, I, P, P, P, F, P, P, P, P, P, I, I, P],
    "gemv_fp16_norm_bench": [I, P, P, P, F, P, I, I, P],
    # the split + combine decode attention attention_decode replaced
    "paged_attention": [P, P, P, P, P, P, P, I, P, I, I, I, I, F, P],
}


def build(verbose: bool = True) -> Path:
    """The library's path, compiling it first if any source is newer (parallel nvcc, then link)."""
    bdir = Path(os.environ.get("NANOQWEN_LAB_BUILD", "/tmp/nanoqwen_lab_build"))
    bdir.mkdir(parents=True, exist_ok=True)
    lib = bdir / "liblab.so"
    newest = max(p.stat().st_mtime for p in SOURCES + HEADERS)
    if lib.exists() and lib.stat().st_mtime > newest and not os.environ.get("NANOQWEN_LAB_REBUILD"):
        return lib
    t0 = time.time()
    procs = []
    for src in SOURCES:
        obj = bdir / (src.stem + ".o")
        procs.append((src, obj, subprocess.Popen(["nvcc", *FLAGS, "-c", str(src), "-o", str(obj)],
                                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                 text=True)))
    for src, _, p in procs:
        out, _ = p.communicate()
        (bdir / (src.stem + ".ptxas.txt")).write_text(out)  # registers / spills per variant
        if p.returncode:
            sys.exit(f"lab: nvcc failed on {src.name}:\n{out}")
    subprocess.run(["nvcc", "-shared", "-o", str(lib), *(str(o) for _, o, _ in procs)], check=True)
    if verbose:
        print(f"lab: built {lib} in {time.time() - t0:.1f} s", flush=True)
    return lib


def compile_alone(source: str, show=lambda line: "spill" in line
                  and not line.strip().startswith("0 bytes stack")) -> ctypes.CDLL:
    """One lab source compiled alone into its own shared library (the lab's flags: csrc/ and
    the lab on the include path) and loaded; ptxas lines for which `show` is true are printed
    (default: the instances that spill). The callers set their entry points' argtypes."""
    so = Path("/tmp") / f"nanoqwen_{Path(source).stem}.so"
    r = subprocess.run(["nvcc", "-shared", *FLAGS, str(LAB / source), "-o", str(so)],
                       check=True, capture_output=True, text=True)
    for line in r.stdout.splitlines() + r.stderr.splitlines():
        if show(line):
            print(line.strip())
    return ctypes.CDLL(str(so))


class Lab:
    """ctypes.CDLL of the lab library with argument types set, plus the variant names."""

    def __init__(self, path: Path):
        L = ctypes.CDLL(str(path))
        for name, args in SIGNATURES.items():
            f = getattr(L, name)
            f.argtypes, f.restype = args, ctypes.c_int
        for name in ("gemv_int4_variant_count", "gemv_fp16_variant_count"):
            getattr(L, name).restype = ctypes.c_int
        L.gemv_int4_variant_supports_norm.restype = ctypes.c_int
        L.gemv_int4_variant_supports_norm.argtypes = [ctypes.c_int]
        for name in ("gemv_int4_variant_name", "gemv_fp16_variant_name"):
            getattr(L, name).restype = ctypes.c_char_p
            getattr(L, name).argtypes = [ctypes.c_int]
        L.gemv_last_error_message.restype = ctypes.c_char_p
        self.L = L
        self.int4_variants = [L.gemv_int4_variant_name(i).decode()
                              for i in range(L.gemv_int4_variant_count())]
        self.fp16_variants = [L.gemv_fp16_variant_name(i).decode()
                              for i in range(L.gemv_fp16_variant_count())]
        self.int4_norm_variants = [i for i in range(len(self.int4_variants))
                                   if L.gemv_int4_variant_supports_norm(i)]

    def msg(self) -> str:
        return self.L.gemv_last_error_message().decode()

    def call(self, name: str, *args) -> None:
        rc = getattr(self.L, name)(*args)
        if rc != 0:
            raise RuntimeError(f"lab {name} returned cudaError {rc}: {self.msg()}")


_lab: Lab | None = None


def load() -> Lab:
    """The lab library, built on first use (once per process)."""
    global _lab
    if _lab is None:
        _lab = Lab(build())
    return _lab


def ptr(t) -> int | None:
    """A tensor's device address for a ctypes call (None for an absent optional)."""
    return None if t is None else t.data_ptr()


def stream() -> int:
    """The current torch stream's handle: lab launches are ordered with torch's work."""
    import torch

    return torch.cuda.current_stream().cuda_stream
