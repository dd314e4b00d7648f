"""The measurement switches: environment variables that change how the CUDA engine runs, for
A/B measurements (README, "measurement switches"; the numbers are in benchmarks/RESULTS.md).

    NANOQWEN_PDL=0|1           programmatic dependent launch, default 1 (on)    csrc/common.cuh
    NANOQWEN_ATTN_MIN_PPS=n    attention_decode's minimum KV pages per split,    backends/cuda.py
                               n = 1..8192 in decimal digits, default 2
    NANOQWEN_ATTN_TMA=0|1      attention_decode's page loop: 1 the TMA          backends/cuda.py
                               warp-specialized kernel on tensor cores, 0 the
                               cp.async split-K kernel; default 1
    NANOQWEN_INT4_MAX_M=n      with prefill weights "dequant" (no resident fp16  backends/cuda.py
                               copy), prompt chunks of at most n tokens go
                               through gemm_int4 on the INT4 weights instead;
                               n = 0 (never) .. 2048, default INT4_MAX_M_DEFAULT
    NANOQWEN_NORM_FOLD=0|1     the decode step's RMSNorms: 1 folded into the     backends/cuda.py
                               GEMVs around them (the residual GEMVs write the
                               sum of squares in parts, the qkv and gate/up
                               GEMVs form the normed x themselves), 0 rmsnorm
                               launches; default NORM_FOLD_DEFAULT
    NANOQWEN_SPEC_DEVICE=0|1   prompt lookup (speculation "ngram"): 1 drafted,  backends/cuda.py
                               verified, sampled and accepted on the device
                               inside the engine's decode loop, 0 the host's
                               loop (backends/base.py _spec_chunks); default
                               SPEC_DEVICE_DEFAULT
    NANOQWEN_PREFILL_ATTN_MAX=n  prompt chunks whose context ends at most n      backends/cuda.py
                               positions in take the paged prefill attention
                               kernel, longer ones SDPA over gathered K/V;
                               n = 0 (always SDPA) .. 131072, default
                               PREFILL_ATTN_MAX_DEFAULT

Unset or empty means the default; any other value raises SwitchError naming the variable, the
value and what is allowed, because a typo that silently measured the default would be a wrong
result, not a crash. For the same reason a removed switch that is still set (NANOQWEN_FUSE_NORM:
its fused-norm GEMVs measured slower end to end and moved to benchmarks/lab/) is an error, not
ignored. The CUDA backend calls read_switches() before it builds or loads the kernels. This is
the only reader of NANOQWEN_ATTN_MIN_PPS: the backend passes the value to the attention_decode
op as its min_pps argument (the op rejects anything outside 0..8192, 0 meaning its default).
The C++ side reads NANOQWEN_PDL itself, once per process, with the same rules, and takes a
malformed value as the default (it cannot raise): this check is what a user sees. The C++
constants are kDecMinPpsDefault / kDecMinPpsMax in csrc/kernels.h; tests/test_switches.py
keeps the two sides equal.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import NanoqwenError

PDL = "NANOQWEN_PDL"
ATTN_MIN_PPS = "NANOQWEN_ATTN_MIN_PPS"
ATTN_TMA = "NANOQWEN_ATTN_TMA"
# on: the tensor-map TMA kernel is faster than the cp.async one at every context measured
# (bench_attention.py, H100, 128 to 32768 tokens: 7.3 against 7.6 us at 512, 16.9 against 19.1
# at 8192, 33.8 against 42.5 at 32768), the 7B decode after 8192 / 30000 cached tokens 2.565 /
# 2.811 against 2.705 / 3.104 ms/token, and compute-sanitizer clean (benchmarks/RESULTS.md,
# session 20); 0 measures the cp.async kernel
ATTN_TMA_DEFAULT = True
NORM_FOLD = "NANOQWEN_NORM_FOLD"
# on: the rmsnorm launches of the layers go (2 a layer); what they cost against what the fold
# adds to the qkv and gate/up GEMVs is measured in benchmarks/RESULTS.md, session 34
NORM_FOLD_DEFAULT = True
SPEC_DEVICE = "NANOQWEN_SPEC_DEVICE"
# on: a speculative turn is the engine's own loop (spec.cu's draft and accept kernels, one
# graph replay a step, run ahead of the host like plain decoding), so the host takes ids from
# the ring and holds the GIL for nothing else; 0 measures the host loop it replaces
SPEC_DEVICE_DEFAULT = True
# switches that existed and were removed: variable -> why (read_switches refuses them when set)
REMOVED = {
    "NANOQWEN_FUSE_NORM": "the fused-norm GEMVs it selected decoded at 1.93 ms/token against 1.89 "
                          "with separate rmsnorm launches and moved to benchmarks/lab/ "
                          "(benchmarks/RESULTS.md)",
}

# 8 (was 2): end to end the fastest of 2 / 4 / 8 on the 0.5B, 1.5B, 3B and 7B after 512 and
# after 2048 cached tokens (fewer, longer splits; benchmarks/RESULTS.md, session 38)
ATTN_MIN_PPS_DEFAULT = 8
# 8192 pages = 131072 tokens, 4x the Qwen2.5-Coder context: a value at or above a context's page
# count already means one split per kv head, so larger ones change nothing, and the bound keeps
# the kernel's int page arithmetic (split * pages_per_split) far from overflow.
ATTN_MIN_PPS_MAX = 8192
INT4_MAX_M = "NANOQWEN_INT4_MAX_M"
# a next turn's few dozen new tokens: gemm_int4 reads the INT4 weights once where the dequant
# path writes and rereads a layer's fp16 copy. 7B on an H100, us a layer, gemm_int4 against
# dequant + cuBLAS (benchmarks/RESULTS.md): session 18, 278 / 591 at 40 tokens, 477 / 619 at
# 128; session 22 (dequant_int4 at the copy rate since session 21; lab/gemm_w4_wgmma.py), 314 /
# 414 at 64 and 500 / 421 at 127 -- and from 128 tokens gemm_int4 is the wgmma kernel, whose
# product shape takes 683 there: the crossing is now between 64 and 127
INT4_MAX_M_DEFAULT = 64
INT4_MAX_M_MAX = 2048   # CudaBackend's PREFILL_CHUNK: no chunk is longer
PREFILL_ATTN_MAX = "NANOQWEN_PREFILL_ATTN_MAX"
# the paged kernel (csrc/attention_prefill.cu) up to 2048 positions, SDPA beyond: H100, TTFT ms
# kernel / SDPA (benchmarks/RESULTS.md, session 21): 0.5B pp512 2.27 / 3.28, 1.5B 4.46 / 4.67,
# 7B 11.90 / 12.07; at 2048 equal within noise (0.5B 5.83 / 5.80, 7B 49.55 / 49.30); 7B pp4096
# 108.9 / 102.9, pp8192 256.6 / 229.6 (SDPA's flash kernel is faster on long rows; the kernel
# saves the host's gathers and SDPA calls, which is what the small models wait for)
PREFILL_ATTN_MAX_DEFAULT = 2048
PREFILL_ATTN_MAX_MAX = 131072   # 4x the Qwen2.5-Coder context: every prompt


class SwitchError(NanoqwenError, ValueError):
    """A measurement switch with a value it does not accept (a user error: the CLI prints it,
    the app shows it; a ValueError too, as any bad argument value)."""


@dataclass(frozen=True)
class Switches:
    pdl: bool = True            # NANOQWEN_PDL
    attn_min_pps: int = ATTN_MIN_PPS_DEFAULT  # NANOQWEN_ATTN_MIN_PPS
    attn_tma: bool = ATTN_TMA_DEFAULT         # NANOQWEN_ATTN_TMA
    int4_max_m: int = INT4_MAX_M_DEFAULT      # NANOQWEN_INT4_MAX_M
    prefill_attn_max: int = PREFILL_ATTN_MAX_DEFAULT  # NANOQWEN_PREFILL_ATTN_MAX
    norm_fold: bool = NORM_FOLD_DEFAULT       # NANOQWEN_NORM_FOLD
    spec_device: bool = SPEC_DEVICE_DEFAULT   # NANOQWEN_SPEC_DEVICE


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    v = env.get(name, "")
    if v == "":
        return default
    if v not in ("0", "1"):
        raise SwitchError(f"{name}={v!r} is not allowed: use 0 or 1, or leave it unset "
                          f"(default {int(default)})")
    return v == "1"


def _count(env: Mapping[str, str], name: str, default: int, lo: int, hi: int, what: str) -> int:
    v = env.get(name, "")
    if v == "":
        return default
    # ASCII digits only (no sign, space, '_' or other Unicode digits, all of which int() takes),
    # leading zeros allowed. The pattern bounds the length, so int() never sees a huge string.
    digits = v.lstrip("0") or "0"
    if not re.fullmatch(r"[0-9]{1,12}", digits) or not lo <= int(digits) <= hi:
        raise SwitchError(f"{name}={v!r} is not allowed: use a whole number of {what} "
                          f"from {lo} to {hi}, or leave it unset (default {default})")
    return int(digits)


def read_switches(env: Mapping[str, str] | None = None) -> Switches:
    """The switches from `env` (default os.environ), validated; raises SwitchError."""
    env = os.environ if env is None else env
    for name, why in REMOVED.items():
        if env.get(name, "") != "":
            raise SwitchError(f"{name}={env[name]!r}: this switch was removed ({why}); unset it")
    return Switches(pdl=_flag(env, PDL, True),
                    attn_min_pps=_count(env, ATTN_MIN_PPS, ATTN_MIN_PPS_DEFAULT, 1,
                                        ATTN_MIN_PPS_MAX, "KV pages per split"),
                    attn_tma=_flag(env, ATTN_TMA, ATTN_TMA_DEFAULT),
                    int4_max_m=_count(env, INT4_MAX_M, INT4_MAX_M_DEFAULT, 0, INT4_MAX_M_MAX,
                                      "prompt tokens"),
                    prefill_attn_max=_count(env, PREFILL_ATTN_MAX, PREFILL_ATTN_MAX_DEFAULT, 0,
                                            PREFILL_ATTN_MAX_MAX, "positions"),
                    norm_fold=_flag(env, NORM_FOLD, NORM_FOLD_DEFAULT),
                    spec_device=_flag(env, SPEC_DEVICE, SPEC_DEVICE_DEFAULT))
