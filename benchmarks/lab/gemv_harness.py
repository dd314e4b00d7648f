"""Check and time the GEMV kernel variants of the lab (benchmarks/lab/gemv_*_lab.cu) through
ctypes, without torch bindings.

One command on the GPU machine:
    python3 benchmarks/lab/gemv_harness.py --out "$OUT"          # build, check, bench, table last
    python3 benchmarks/lab/gemv_harness.py --check-only          # correctness only
It builds the lab library (benchmarks/lab/lab.py), then

  check: every int4 and fp16 variant, and the fused-norm launchers (gemv_int4_norm,
         gemv_int4_silu_mul_norm, gemv_fp16_norm: what NANOQWEN_FUSE_NORM=1 ran until it was
         removed) and their variants, against an fp32/fp64 PyTorch reference built from
         engine/quant.py's dequantize, on fresh random data with awkward n (1, 3, 643 = 5*128+3
         ...) and k from 128 to 27648; outputs poisoned with NaN first; bad arguments of the
         lab-only entry points must fail with a message carrying the numbers. The production
         launchers' checks are tests/gpu/test_gemv.py.
  bench: the 7B decode shapes, every variant, as a CUDA graph of many launches rotating among
         enough weight copies that the set is >= 4x the 50 MB L2; median over replays; GB/s
         counts every byte a launch must move (weights + scales + x + output) against the
         measured 4276 GB/s device copy bandwidth. "LAUNCHER" rows time the lab's copies of the
         launchers of commit 2047cf7, i.e. the kernel instances csrc/gemv_int4.cu runs (its
         kInt4Table); benchmarks/bench_step.py times the production ops themselves.

Tolerances (relative L2 error ||out - ref|| / ||ref||, or against the rounding-error scale where
a single row can cancel; ref in fp64 from the same fp16 inputs):
  half outputs: 2e-3. Output rounding alone is ~3e-4 rms; the v2/v4 variants sum products of
                exact q (-7..7) and fp16 x four deep in fp16 before fp32 (~4e-4 more); 2e-3
                leaves 3x. (The tensor-core variants sum in fp32 and sit at the rounding alone.)
  fp32 outputs with the fp16-product variants: 2e-3, same reason minus the output rounding.
  gemv_fp16 (fp32 products and sums of exact fp16 values): 1e-5 (fp32 summation over k <= 27648).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab import REPO, Lab, ptr, stream  # noqa: E402  (benchmarks/lab/lab.py)
from lab import build as build_lab  # noqa: E402

COPY_GBPS = 4276.0  # H200 device-to-device copy, read + write (../shared/design/GPU.md)
L2_BYTES = 50 * 2**20

OP_STORE, OP_RESID, OP_SILU = 0, 1, 2
TOL_HALF = 2e-3
TOL_F32_INT4 = 2e-3
TOL_FP16 = 1e-5

_log_file = None


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    if _log_file:
        _log_file.write(s + "\n")
        _log_file.flush()


def load_lib() -> Lab:
    lib = Lab(build_lab())
    lib.only = None  # --variants: a regex; checks and timings of other variants are skipped
    lib.sel = lambda names: [(i, n) for i, n in enumerate(names)  # (index, name) selected
                             if lib.only is None or re.search(lib.only, n)]
    return lib


def load_quant():
    try:  # the installed package (engine/quant.py uses package-relative imports)
        from nanoqwen.engine import quant
        return quant
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location("nanoqwen_quant", REPO / "engine" / "quant.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- data ---------------------------------------------------------------------------------------
def rand_int4(quant, n, k, gen):
    """Random codes 1..15 packed in quant.py's layout + random scales; W' (fp32, cuda)."""
    codes = torch.randint(1, 16, (n, k), generator=gen)
    qweight = quant.pack_codes(codes)
    scales = (torch.rand(n, k // 128, generator=gen) * 0.02 + 0.001).to(torch.float16)
    w = quant.dequantize(qweight, scales, torch.float32)
    return qweight.cuda(), scales.cuda(), w.cuda()


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def dot_scale(w, x):
    """sqrt(sum_k (w x)^2) per row, in fp64: the size of the products a row's sum rounds."""
    return ((w.double() ** 2) @ (x.double() ** 2)).sqrt()


def scaled_err(out, ref, scale):
    """||out - ref|| / ||scale||: scale is the size of the rounding-error source per row
    (dot_scale plus |ref|), not |ref| itself, which a single row (n = 1) can draw near zero by
    cancellation (run 5 failed 1x128 on |ref| alone); same tolerance meaning as rel_err for
    large n."""
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / scale.norm().clamp_min(1e-30)).item()


def silu_ref(w, wu, x, ref, refu):
    """silu(g) * u in fp64 for g = ref = w x, u = refu = wu x, and its rounding-error scale:
    each factor's scale times the other's derivative, plus |out| (as scaled_err wants)."""
    ref_s = torch.nn.functional.silu(ref) * refu
    sig = torch.sigmoid(ref)
    scale_s = ((sig * (1 + ref * (1 - sig))).abs() * refu.abs() * dot_scale(w, x)
               + (ref * sig).abs() * dot_scale(wu, x) + ref_s.abs())
    return ref_s, scale_s


# ---- correctness --------------------------------------------------------------------------------
def check(lib: Lab, quant) -> list[str]:
    fails = []
    gen = torch.Generator().manual_seed(int(time.time()))  # fresh data every run

    def expect(name, err, tol):
        ok = err <= tol
        log(f"  {'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e} (tol {tol:.0e})")
        if not ok:
            fails.append(f"{name}: {err:.2e} > {tol:.0e}")

    log("== correctness: every int4 variant x op ==")
    for n, k in [(643, 3584), (5, 18944), (1, 896), (29, 27648)]:
        qw, sc, w = rand_int4(quant, n, k, gen)
        qu, su, wu = rand_int4(quant, n, k, gen)
        for outlier in (False, True):
            x = torch.randn(k, generator=gen)
            if outlier:  # a few massive activations, as Qwen's down_proj inputs have
                idx = torch.randperm(k, generator=gen)[:4]
                x[idx] = torch.tensor([1000.0, -1000.0, 800.0, -600.0])
            x = x.half().cuda()
            ref = w.double() @ x.double()
            refu = wu.double() @ x.double()
            # silu(g)*u against its rounding-error scale (as tests/gpu/test_gemv.py): a 1-row case
            # with outliers can cancel to near zero (run 7: 2.06e-3 of |ref| in every variant alike)
            ref_s, scale_s = silu_ref(w, wu, x, ref, refu)
            for v, vname in lib.sel(lib.int4_variants):
                tag = f"{vname} {n}x{k}{' outliers' if outlier else ''}"
                y = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
                lib.call("gemv_int4_bench", v, OP_STORE, ptr(y), ptr(x), ptr(qw), ptr(sc), None, None, None, n, k, stream())
                expect(f"store {tag}", rel_err(y, ref), TOL_HALF)
                h = torch.zeros(n, device="cuda")
                lib.call("gemv_int4_bench", v, OP_RESID, ptr(h), ptr(x), ptr(qw), ptr(sc), None, None, None, n, k, stream())
                expect(f"resid {tag}", rel_err(h, ref), TOL_F32_INT4)
                o = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
                lib.call("gemv_int4_bench", v, OP_SILU, ptr(o), ptr(x), ptr(qw), ptr(sc), ptr(qu), ptr(su), None, n, k, stream())
                if outlier:  # silu(g)*u squares the outliers' scale: can leave fp16 range legitimately
                    ok = torch.isfinite(ref_s.half()).all()
                    if not ok:
                        continue
                expect(f"silu {tag}", scaled_err(o, ref_s, scale_s), TOL_HALF)

    log("== correctness: gemv_fp16 (lm_head) ==")
    for n, k in [(1, 8), (643, 896), (1003, 3584), (77, 27648), (152064, 3584)]:
        w = (torch.randn(n, k, device="cuda") * 0.02).half()
        x = torch.randn(k, device="cuda").half()
        ref = w.double() @ x.double()
        for v, vname in lib.sel(lib.fp16_variants):
            out = torch.full((n,), float("nan"), device="cuda")
            lib.call("gemv_fp16_bench", v, ptr(out), ptr(x), ptr(w), n, k, stream())
            expect(f"gemv_fp16 {vname} {n}x{k}", rel_err(out, ref), TOL_FP16)

    log("== correctness: fused RMSNorm launchers and every norm-capable variant ==")
    # x = half(norm_w * (hidden * r)), r = rsqrt(mean(hidden^2) + eps): the rmsnorm kernel's
    # rounding (r in fp64 here, rsqrtf + another reduction order there: x may differ in the last
    # bit of a few elements, far below the tolerance). Outputs against fp64 dot products of that x.
    eps = 1e-6

    def norm_x(hidden, nw):
        r = torch.rsqrt(hidden.double().pow(2).mean() + eps).float()
        return (nw.float() * (hidden * r)).half()

    def norm_case(n, k, big=False):
        hidden = torch.randn(k, generator=gen) * 4
        hidden[torch.randperm(k, generator=gen)[:3]] = torch.tensor([90.0, -70.0, 55.0])
        nw = (torch.rand(k, generator=gen) * 2 + 0.2) * (1000.0 if big else 1.0)  # big: |x| ~ 3000
        return hidden.cuda(), nw.half().cuda()

    ncases = [(1, 128), (7, 384), (33, 3584), (4609, 3584), (643, 18944), (29, 27648), (4608, 3584)]
    for n, k in ncases:
        qw, sc, w = rand_int4(quant, n, k, gen)
        qu, su, wu = rand_int4(quant, n, k, gen)
        for big in (False, True):
            hidden, nw = norm_case(n, k, big)
            x = norm_x(hidden, nw)
            tag = f"{n}x{k}{' |x|~3000' if big else ''}"
            ref = w.double() @ x.double()
            refu = wu.double() @ x.double()
            s_g = dot_scale(w, x)
            ref_s, scale_s = silu_ref(w, wu, x, ref, refu)
            bias = (torch.randn(n, generator=gen) * 0.5).half().cuda()
            for b in (None, bias):
                y = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
                lib.call("gemv_int4_norm", ptr(y), ptr(hidden), ptr(nw), eps, ptr(qw), ptr(sc), ptr(b), n, k, stream())
                r = ref + (b.double() if b is not None else 0)
                if torch.isfinite(r.half()).all():
                    expect(f"gemv_int4_norm {tag} {'+bias' if b is not None else 'nobias'}", scaled_err(y, r, s_g + r.abs()), TOL_HALF)
                y2 = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
                lib.call("gemv_int4_norm", ptr(y2), ptr(hidden), ptr(nw), eps, ptr(qw), ptr(sc), ptr(b), n, k, stream())
                same = torch.equal(y.view(torch.int16), y2.view(torch.int16))
                log(f"  {'ok  ' if same else 'FAIL'} gemv_int4_norm {tag} deterministic={same}")
                if not same:
                    fails.append(f"gemv_int4_norm {tag} not deterministic")
            o = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
            lib.call("gemv_int4_silu_mul_norm", ptr(o), ptr(hidden), ptr(nw), eps, ptr(qw), ptr(sc), ptr(qu), ptr(su), n, k, stream())
            if torch.isfinite(ref_s.half()).all():  # |x|~3000 can push silu*up past fp16 legitimately
                expect(f"gemv_int4_silu_mul_norm {tag}", scaled_err(o, ref_s, scale_s), TOL_HALF)
            if (n, k) in ((33, 3584), (643, 18944), (29, 27648)) or (big and n == 4608):
                for v, vname in lib.sel(lib.int4_variants):
                    if v not in lib.int4_norm_variants:
                        continue
                    y = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
                    lib.call("gemv_int4_norm_bench", v, OP_STORE, ptr(y), ptr(hidden), ptr(nw), eps, ptr(qw), ptr(sc), None, None, ptr(bias), n, k, stream())
                    expect(f"norm store {vname} {tag}", scaled_err(y, ref + bias.double(), s_g + (ref + bias.double()).abs()), TOL_HALF)
                    if torch.isfinite(ref_s.half()).all():
                        o = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
                        lib.call("gemv_int4_norm_bench", v, OP_SILU, ptr(o), ptr(hidden), ptr(nw), eps, ptr(qw), ptr(sc), ptr(qu), ptr(su), None, n, k, stream())
                        expect(f"norm silu {vname} {tag}", scaled_err(o, ref_s, scale_s), TOL_HALF)
    # large-magnitude x through the non-fused ops too (o_proj / down inputs), every variant that
    # has no |x| limit (ps_*): |x| up to 3000
    for n, k in [(643, 3584), (37, 18944)]:
        qw, sc, w = rand_int4(quant, n, k, gen)
        x = (torch.randn(k, generator=gen) * 1000).clamp(-3000, 3000).half().cuda()
        ref = w.double() @ x.double()
        for v, _ in lib.sel(lib.int4_variants):
            if v not in lib.int4_norm_variants:
                continue
            h = torch.zeros(n, device="cuda")
            lib.call("gemv_int4_bench", v, OP_RESID, ptr(h), ptr(x), ptr(qw), ptr(sc), None, None, None, n, k, stream())
            expect(f"resid {lib.int4_variants[v]} {n}x{k} |x|~3000", rel_err(h, ref), TOL_F32_INT4)
    for n, k in [(1, 8), (1003, 3584), (77, 27648), (152064, 3584)]:
        w = (torch.randn(n, k, device="cuda") * 0.02).half()
        hidden, nw = norm_case(n, k)
        x = norm_x(hidden, nw)
        ref = w.double() @ x.double()
        for v, vname in lib.sel(lib.fp16_variants):
            out = torch.full((n,), float("nan"), device="cuda")
            lib.call("gemv_fp16_norm_bench", v, ptr(out), ptr(hidden), ptr(nw), eps, ptr(w), n, k, stream())
            # x may differ from norm_x in the last bit of a few elements (see above): 1e-4, not 1e-5
            expect(f"gemv_fp16_norm {vname} {n}x{k}", rel_err(out, ref), 1e-4)
        out = torch.full((n,), float("nan"), device="cuda")
        lib.call("gemv_fp16_norm", ptr(out), ptr(hidden), ptr(nw), eps, ptr(w), n, k, stream())
        expect(f"gemv_fp16_norm launcher {n}x{k}", rel_err(out, ref), 1e-4)
    torch.cuda.synchronize()

    log("== bad arguments must fail with the numbers ==")
    x = torch.randn(4096, device="cuda").half()
    qw, sc, _ = rand_int4(quant, 8, 256, gen)
    y = torch.empty(8, dtype=torch.float16, device="cuda")
    f32 = torch.empty(8, device="cuda")
    f32h = torch.randn(4096, device="cuda")
    bad = [  # the lab-only entry points (the production launchers': tests/gpu/test_gemv.py)
        ("variant=-1", lambda: lib.L.gemv_int4_bench(-1, OP_STORE, ptr(y), ptr(x), ptr(qw), ptr(sc), None, None, None, 8, 256, stream()), "variant=-1"),
        ("fp16 variant=99", lambda: lib.L.gemv_fp16_bench(99, ptr(f32), ptr(x), ptr(x), 1, 256, stream()), "variant=99"),
        ("norm k=200", lambda: lib.L.gemv_int4_norm(ptr(y), ptr(f32h), ptr(x), 1e-6, ptr(qw), ptr(sc), None, 8, 200, stream()), "k=200"),
        ("norm eps=0", lambda: lib.L.gemv_int4_norm(ptr(y), ptr(f32h), ptr(x), 0.0, ptr(qw), ptr(sc), None, 8, 256, stream()), "eps=0"),
        ("silu norm null hidden", lambda: lib.L.gemv_int4_silu_mul_norm(ptr(y), None, ptr(x), 1e-6, ptr(qw), ptr(sc), ptr(qw), ptr(sc), 8, 256, stream()), "null"),
        ("fp16 norm misaligned norm_w", lambda: lib.L.gemv_fp16_norm(ptr(f32), ptr(f32h), ptr(x) + 2, 1e-6, ptr(x), 1, 256, stream()), "aligned"),
    ]
    for name, fn, needle in bad:
        rc = fn()
        m = lib.msg()
        ok = rc != 0 and needle in m
        log(f"  {'ok  ' if ok else 'FAIL'} {name}: rc={rc} msg={m!r}")
        if not ok:
            fails.append(f"bad-arg {name}")
    torch.cuda.synchronize()
    return fails


# ---- benchmark ----------------------------------------------------------------------------------
def shapes_7b():
    # name, op, n, k ; bytes moved per launch
    return [
        ("qkv 4608x3584", "int4", OP_STORE, 4608, 3584),
        ("o_proj 3584x3584", "int4", OP_RESID, 3584, 3584),
        ("gate/up 2x18944x3584", "int4", OP_SILU, 18944, 3584),
        ("down 3584x18944", "int4", OP_RESID, 3584, 18944),
        ("lm_head 152064x3584", "fp16", None, 152064, 3584),
    ]


def bytes_moved(kind, op, n, k):
    if kind == "fp16":
        return n * k * 2 + k * 2 + n * 4
    nm = 2 if op == OP_SILU else 1
    b = nm * (n * k // 2 + n * (k // 128) * 2) + k * 2
    b += n * 8 if op == OP_RESID else n * 2 + (n * 2 if op == OP_STORE else 0)  # bias read for qkv
    return b


def time_graph(launch, ncopies, launches, reps=25):
    """Median µs per launch of a graph of `launches` launches cycling through the copies."""
    for i in range(ncopies):
        launch(i)  # warm up (module load) outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=s):
        for i in range(launches):
            launch(i % ncopies)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / launches)
    return statistics.median(ts), min(ts), max(ts)


def time_eager(launch, ncopies, launches=200):
    for i in range(ncopies):
        launch(i)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for i in range(launches):
        launch(i % ncopies)
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e3 / launches


def bench(lib: Lab, results: dict):
    # ceilings on this very machine first
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        b.copy_(a)
    e1.record()
    e1.synchronize()
    copy_gbps = 2 * 2**30 * 10 / (e0.elapsed_time(e1) * 1e-3) / 1e9
    a.random_()
    h = a.view(torch.float16)
    hs = h.float().sum()  # noqa: F841 (warm)
    torch.cuda.synchronize()
    e0.record()
    for _ in range(5):
        h.view(-1, 4096).sum(dim=1, dtype=torch.float32)
    e1.record()
    e1.synchronize()
    read_gbps = 2**30 * 5 / (e0.elapsed_time(e1) * 1e-3) / 1e9
    del a, b, h
    log(f"== ceilings here: copy {copy_gbps:.0f} GB/s (read+write), torch row-sum read {read_gbps:.0f} GB/s ==")
    results["copy_gbps"], results["read_gbps"] = copy_gbps, read_gbps

    rows = []
    for name, kind, op, n, k in shapes_7b():
        nbytes = bytes_moved(kind, op, n, k)
        ncopies = max(2, math.ceil(4 * L2_BYTES / nbytes))
        launches = max(ncopies, 48 if nbytes < 100e6 else 8)
        x = torch.randn(k, device="cuda").half()
        if kind == "fp16":
            ws = [(torch.randn(n, k, device="cuda") * 0.02).half() for _ in range(ncopies)]
            out = torch.empty(n, device="cuda")
            variants = lib.fp16_variants

            def mk(v):
                return lambda i: lib.L.gemv_fp16_bench(v, ptr(out), ptr(x), ptr(ws[i]), n, k, stream())
            default = lambda i: lib.L.gemv_fp16(ptr(out), ptr(x), ptr(ws[i]), n, k, stream())
        else:
            nm = 2 if op == OP_SILU else 1
            qws = [torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
                   for _ in range(ncopies * nm)]
            scs = [(torch.rand(n, k // 128, device="cuda") * 0.02).half() for _ in range(ncopies * nm)]
            bias = torch.randn(n, device="cuda").half() if op == OP_STORE else None
            out = torch.zeros(n, device="cuda", dtype=torch.float32 if op == OP_RESID else torch.float16)
            variants = lib.int4_variants

            def mk(v):
                def f(i):
                    j = i * nm
                    q2 = ptr(qws[j + 1]) if nm == 2 else None
                    s2 = ptr(scs[j + 1]) if nm == 2 else None
                    return lib.L.gemv_int4_bench(v, op, ptr(out), ptr(x), ptr(qws[j]), ptr(scs[j]), q2, s2, ptr(bias), n, k, stream())
                return f
            if op == OP_STORE:
                default = lambda i: lib.L.gemv_int4(ptr(out), ptr(x), ptr(qws[i]), ptr(scs[i]), ptr(bias), n, k, stream())
            elif op == OP_RESID:
                default = lambda i: lib.L.gemv_int4_residual(ptr(out), ptr(x), ptr(qws[i]), ptr(scs[i]), n, k, stream())
            else:
                default = lambda i: lib.L.gemv_int4_silu_mul(ptr(out), ptr(x), ptr(qws[2 * i]), ptr(scs[2 * i]), ptr(qws[2 * i + 1]), ptr(scs[2 * i + 1]), n, k, stream())
        log(f"== {name}: {nbytes / 1e6:.2f} MB/launch, {ncopies} copies, graph of {launches} ==")
        for v, vname in lib.sel(variants):
            med, lo, hi = time_graph(mk(v), ncopies, launches)
            gbps = nbytes / (med * 1e-6) / 1e9
            log(f"  {vname:<16} {med:8.2f} us (min {lo:.2f} max {hi:.2f})  {gbps:7.0f} GB/s  {100 * gbps / COPY_GBPS:5.1f}%")
            rows.append(dict(shape=name, variant=vname, us=med, us_min=lo, us_max=hi, gbps=gbps,
                             pct=100 * gbps / COPY_GBPS))
        med, lo, hi = time_graph(default, ncopies, launches)
        med2, _, _ = time_graph(default, ncopies, launches)  # same version twice: the noise
        eager = time_eager(default, ncopies)
        gbps = nbytes / (med * 1e-6) / 1e9
        log(f"  {'LAUNCHER':<16} {med:8.2f} us (again {med2:.2f}; eager {eager:.2f} us)  {gbps:7.0f} GB/s  {100 * gbps / COPY_GBPS:5.1f}%")
        rows.append(dict(shape=name, variant="LAUNCHER", us=med, us_again=med2, us_eager=eager,
                         gbps=gbps, pct=100 * gbps / COPY_GBPS))
        del x, out
        if kind == "fp16":
            del ws
        else:
            del qws, scs
        torch.cuda.empty_cache()
    # fused-norm launchers and variants (qkv, gate/up, lm_head): x comes from hidden in the prologue
    eps = 1e-6
    for name, kind, op, n, k in shapes_7b():
        if op == OP_RESID:
            continue
        nbytes = bytes_moved(kind, op, n, k) - k * 2 + k * 6  # hidden fp32 + norm_w instead of x
        ncopies = max(2, math.ceil(4 * L2_BYTES / nbytes))
        launches = max(ncopies, 48 if nbytes < 100e6 else 8)
        hidden = torch.randn(k, device="cuda")
        nw = (torch.rand(k, device="cuda") + 0.5).half()
        fname = name.split()[0] + "+norm"
        if kind == "fp16":
            ws = [(torch.randn(n, k, device="cuda") * 0.02).half() for _ in range(ncopies)]
            out = torch.empty(n, device="cuda")
            cands = [("LAUNCHER", lambda i: lib.L.gemv_fp16_norm(ptr(out), ptr(hidden), ptr(nw), eps, ptr(ws[i]), n, k, stream()))]
        else:
            nm = 2 if op == OP_SILU else 1
            qws = [torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda") for _ in range(ncopies * nm)]
            scs = [(torch.rand(n, k // 128, device="cuda") * 0.02).half() for _ in range(ncopies * nm)]
            bias = torch.randn(n, device="cuda").half() if op == OP_STORE else None
            out = torch.zeros(n, device="cuda", dtype=torch.float16)

            def mkn(v):
                def f(i):
                    j = i * nm
                    q2 = ptr(qws[j + 1]) if nm == 2 else None
                    s2 = ptr(scs[j + 1]) if nm == 2 else None
                    return lib.L.gemv_int4_norm_bench(v, op, ptr(out), ptr(hidden), ptr(nw), eps, ptr(qws[j]), ptr(scs[j]), q2, s2, ptr(bias), n, k, stream())
                return f
            cands = [(lib.int4_variants[v], mkn(v)) for v in lib.int4_norm_variants
                     if lib.only is None or re.search(lib.only, lib.int4_variants[v])]
            if op == OP_STORE:
                cands.append(("LAUNCHER", lambda i: lib.L.gemv_int4_norm(ptr(out), ptr(hidden), ptr(nw), eps, ptr(qws[i]), ptr(scs[i]), ptr(bias), n, k, stream())))
            else:
                cands.append(("LAUNCHER", lambda i: lib.L.gemv_int4_silu_mul_norm(ptr(out), ptr(hidden), ptr(nw), eps, ptr(qws[2 * i]), ptr(scs[2 * i]), ptr(qws[2 * i + 1]), ptr(scs[2 * i + 1]), n, k, stream())))
        log(f"== {fname}: {nbytes / 1e6:.2f} MB/launch, {ncopies} copies, graph of {launches} ==")
        for vname, fn in cands:
            med, lo, hi = time_graph(fn, ncopies, launches)
            gbps = nbytes / (med * 1e-6) / 1e9
            log(f"  {vname:<16} {med:8.2f} us (min {lo:.2f} max {hi:.2f})  {gbps:7.0f} GB/s  {100 * gbps / COPY_GBPS:5.1f}%")
            rows.append(dict(shape=fname, variant=vname, us=med, us_min=lo, us_max=hi, gbps=gbps, pct=100 * gbps / COPY_GBPS))
        del out, hidden, nw
        if kind == "fp16":
            del ws
        else:
            del qws, scs
        torch.cuda.empty_cache()
    results["rows"] = rows
    return rows


def layer_seq(lib: Lab, layers=8, sets=4) -> dict:
    """The decode step's GEMV chain per layer, launchers only: qkv (norm) -> o_proj (residual) ->
    gate/up (norm, silu) -> down (residual), `layers` layers as one CUDA graph cycling over `sets`
    weight sets (4 x 120 MB > 4x L2). PDL on/off is fixed per process (NANOQWEN_PDL, read once)."""
    H, I, QKV = 3584, 18944, 4608
    eps = 1e-6

    def q(n, k):
        return (torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda"),
                (torch.rand(n, k // 128, device="cuda") * 0.002).half())
    W = [dict(qkv=q(QKV, H), o=q(H, H), g=q(I, H), u=q(I, H), d=q(H, I), bias=torch.randn(QKV, device="cuda").half(),
              n1=(torch.rand(H, device="cuda") + 0.5).half(), n2=(torch.rand(H, device="cuda") + 0.5).half())
         for _ in range(sets)]
    hidden = torch.randn(H, device="cuda")
    yqkv = torch.empty(QKV, dtype=torch.float16, device="cuda")
    xo = torch.randn(H, device="cuda").half() * 0.1  # stands in for the attention output
    act = torch.empty(I, dtype=torch.float16, device="cuda")

    def one_layer(i):
        w = W[i]
        rc = lib.L.gemv_int4_norm(ptr(yqkv), ptr(hidden), ptr(w["n1"]), eps, ptr(w["qkv"][0]), ptr(w["qkv"][1]), ptr(w["bias"]), QKV, H, stream())
        rc |= lib.L.gemv_int4_residual(ptr(hidden), ptr(xo), ptr(w["o"][0]), ptr(w["o"][1]), H, H, stream())
        rc |= lib.L.gemv_int4_silu_mul_norm(ptr(act), ptr(hidden), ptr(w["n2"]), eps, ptr(w["g"][0]), ptr(w["g"][1]), ptr(w["u"][0]), ptr(w["u"][1]), I, H, stream())
        rc |= lib.L.gemv_int4_residual(ptr(hidden), ptr(act), ptr(w["d"][0]), ptr(w["d"][1]), H, I, stream())
        if rc:
            raise RuntimeError(f"layer_seq launch failed: {lib.msg()}")
    med, lo, hi = time_graph(one_layer, sets, layers)
    return dict(pdl=os.environ.get("NANOQWEN_PDL", "1") != "0", us_per_layer=med, us_min=lo, us_max=hi,
                finite=bool(torch.isfinite(hidden).all()))


def main():
    global _log_file
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the log and json")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--layer-seq-only", action="store_true",
                    help="print the per-layer GEMV chain timing as one JSON line (this process's PDL setting)")
    ap.add_argument("--variants", default=None, metavar="REGEX",
                    help="check and time only the kernel variants whose name matches (launchers always)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _log_file = open(out / "gemv_log.txt", "w")
    if not torch.cuda.is_available():
        sys.exit("gemv_harness: no CUDA device")
    lib = load_lib()
    lib.only = args.variants
    if args.layer_seq_only:
        print("LAYER_SEQ " + json.dumps(layer_seq(lib)), flush=True)
        return
    quant = load_quant()
    commit = os.environ.get("GEMV_COMMIT", "unknown")
    results = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                   commit=commit, torch=torch.__version__)
    log(f"device {results['device']}, {results['date']}, commit {commit}, torch {torch.__version__}")
    bdir = Path(os.environ.get("NANOQWEN_LAB_BUILD", "/tmp/nanoqwen_lab_build"))
    for f in bdir.glob("gemv*.ptxas.txt"):
        regs = [ln.strip() for ln in f.read_text().splitlines() if "registers" in ln or "spill" in ln]
        (out / "ptxas.txt").open("a").write(f"{f.name}\n" + "\n".join(regs) + "\n")
    fails = [] if args.bench_only else check(lib, quant)
    results["fails"] = fails
    rows = [] if args.check_only else bench(lib, results)
    if not args.check_only:
        # the per-layer chain with PDL on (this process, unless NANOQWEN_PDL=0 was set) and off (a
        # child process: the switch is read once per process)
        seq = [layer_seq(lib)]
        env = dict(os.environ, NANOQWEN_PDL="0" if seq[0]["pdl"] else "1")
        p = subprocess.run([sys.executable, __file__, "--layer-seq-only", "--out", str(out / "child")],
                           env=env, capture_output=True, text=True)
        for ln in p.stdout.splitlines():
            if ln.startswith("LAYER_SEQ "):
                seq.append(json.loads(ln[len("LAYER_SEQ "):]))
        if len(seq) < 2:
            log(f"layer_seq child failed: {p.stdout[-2000:]} {p.stderr[-2000:]}")
        results["layer_seq"] = seq
    (out / "gemv_results.json").write_text(json.dumps(results, indent=1))
    log("")
    log(f"== summary ({results['device']}, {results['date']}, commit {commit}) ==")
    log(f"correctness: {'ALL PASS' if not fails else f'{len(fails)} FAIL: ' + '; '.join(fails[:8])}")
    if rows:
        # every variant x shape (us), so one run's tail carries the whole comparison
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        table = {(r["shape"], r["variant"]): r["us"] for r in rows}
        names = list(dict.fromkeys(r["variant"] for r in rows if r["variant"] != "LAUNCHER"))
        log(f"{'variant (us)':<20}" + "".join(f"{s.split()[0]:>9}" for s in shapes))
        for v in names + ["LAUNCHER"]:
            log(f"{v:<20}" + "".join(f"{table[(s, v)]:9.2f}" if (s, v) in table else f"{'-':>9}" for s in shapes))
        best = {}
        for r in rows:
            if r["variant"] != "LAUNCHER" and (r["shape"] not in best or r["us"] < best[r["shape"]]["us"]):
                best[r["shape"]] = r
        log(f"{'shape':<22} {'launcher us':>11} {'GB/s':>6} {'%4276':>6} | best variant")
        for r in rows:
            if r["variant"] == "LAUNCHER":
                b = best.get(r["shape"], r)
                log(f"{r['shape']:<22} {r['us']:11.2f} {r['gbps']:6.0f} {r['pct']:5.1f}% | {b['variant']} {b['us']:.2f} us {b['pct']:.1f}%")
        for sq in results.get("layer_seq", []):
            log(f"layer chain qkv_norm->o->gate/up_norm->down, PDL {'on ' if sq['pdl'] else 'off'}: "
                f"{sq['us_per_layer']:.2f} us/layer (min {sq['us_min']:.2f}; floor 28.2 us; finite={sq['finite']})")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
