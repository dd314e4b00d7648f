"""compute-sanitizer memcheck, racecheck and synccheck of attention_decode and attention_prefill
at partial-page lengths, of attention_verify (the verify step's attention), of gemv_fp16's
rows kernel (the verify step's lm_head at 5-16 columns: a per-warp cp.async ring) at ragged
shapes, and of speculation's spec_draft / spec_accept in engine turns (this file, run as a
script under the sanitizer), clean. Skipped where compute-sanitizer is absent."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def sanitizer_cmd(tool: str, script: Path, kernels: str = "attn_", *args: str) -> list[str]:
    exe = shutil.which("compute-sanitizer") or (
        "/usr/local/cuda/bin/compute-sanitizer"
        if os.path.exists("/usr/local/cuda/bin/compute-sanitizer") else None)
    if exe is None:
        pytest.skip("compute-sanitizer not installed")
    # only the kernels under test are instrumented (torch's own kernels are not under test)
    return [exe, "--tool", tool, "--error-exitcode", "99", "--kernel-name", f"kns={kernels}",
            sys.executable, str(script), *args]


def _check(tool: str, r: subprocess.CompletedProcess) -> None:
    out = r.stdout + r.stderr
    print(out if len(out) <= 12000 else out[:6000] + "\n[...]\n" + out[-6000:])
    assert r.returncode == 0, f"{tool} exit {r.returncode}"
    assert "ERROR SUMMARY: 0 errors" in out or tool == "racecheck"
    if tool == "racecheck":
        assert "RACECHECK SUMMARY: 0 hazards" in out


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_attention_decode_sanitizer_clean(tool):
    """attention_decode, both page loops (the cp.async ring with its fresh-row select; the TMA
    producer warp, mbarrier ring and consumer warps with their page patches), and the
    last-block merge, at partial-page lengths, several split counts, a ring reused many times,
    pos beyond the table; attention_prefill (its double-buffered cp.async key tiles, warps
    skipping tiles, zero-filled rows past the last key) from an empty cache and after a prefix:
    this file run as a script."""
    r = subprocess.run(sanitizer_cmd(tool, Path(__file__)), capture_output=True, text=True,
                       timeout=400)
    _check(tool, r)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_gemv_fp16_rows_sanitizer_clean(tool):
    """gemv_fp16's rows kernel (5-8 columns exactly, 9-16 with a runtime count): each lane's
    cp.async ring slots refilled after it read them, rows past n clamped to row n-1 for the
    copies and never stored, lanes without a chunk (k = 8, 264, 896) copying nothing; the
    outputs bit-identical to one-column calls: this file run as a script with "rows"."""
    r = subprocess.run(sanitizer_cmd(tool, Path(__file__), "gemv_fp16_rows", "rows"),
                       capture_output=True, text=True, timeout=400)
    _check(tool, r)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_attention_verify_sanitizer_clean(tool):
    """attention_verify (the verify step's attention) on both page loops: each block's rows of
    the step computed into shared memory and patched over the ring's stale copies (cp.async
    select, TMA stage patch before the proxy fence), the last query's blocks writing them to the
    cache while other blocks' page copies read those pages: this file run as a script with
    "verify" (against attention_decode calls one position at a time, bit for bit)."""
    r = subprocess.run(sanitizer_cmd(tool, Path(__file__), "attn_decode", "verify"),
                       capture_output=True, text=True, timeout=400)
    _check(tool, r)


@pytest.mark.parametrize("tool", ["memcheck", "synccheck"])
def test_speculation_kernels_sanitizer_clean(tool):
    """spec_draft (its block-wide scan of ctx_tokens and max of the matches) and spec_accept (the
    ids into ctx_tokens and the pinned ring) in speculative turns of the bundled model, greedy
    and sampled with a penalty, eager (spec_draft, its decision read back, the body: the graph
    replays the same kernels): this file run as a script with "spec" (each reply the plain
    one, as tests/gpu/test_spec_device.py checks). Not racecheck: under it a whole engine
    faults in its first decode step's advance_kernel (an illegal address on the pinned ring,
    before any speculation; seen in session 33 and again in session 37's first run), so
    racecheck covers kernels run alone (the tests above); spec_accept is one thread with no
    shared memory, and spec_draft's one shared array is read only after __syncthreads."""
    r = subprocess.run(sanitizer_cmd(tool, Path(__file__), "spec_", "spec"), capture_output=True,
                       text=True, timeout=400)
    _check(tool, r)


def _run_spec() -> int:
    """Standalone body for the sanitizer: speculative turns on the device against plain
    decoding's replies; exits non-zero if any differs or nothing was drafted."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: test_spec
    from test_spec import MODEL, PROMPTS, prompt_ids, run

    from nanoqwen.engine.loader import load
    from nanoqwen.engine.sampling import SamplerParams

    if not MODEL.is_file():
        print("the bundled model is absent")
        return 1
    eng = load(MODEL, backend="cuda")
    be = eng.backend
    be.mode = "eager"
    ok = True
    for params in (SamplerParams.greedy_params(),
                   SamplerParams(temperature=0.8, seed=3, repeat_penalty=1.1, repeat_last_n=64)):
        for text in PROMPTS[:2]:
            ids = prompt_ids(eng, text)
            plain = run(be, ids, params, 60, None)
            out = run(be, ids, params, 60, "ngram")
            st = be.spec_stats
            print(f"speculation temperature={params.temperature}: {len(out)} ids, the plain reply "
                  f"{out == plain}, {st}")
            ok &= out == plain and st["verify_steps"] > 0
    eng.close()
    torch.cuda.synchronize()
    return 0 if ok else 1


def _run_gemv_fp16_rows() -> int:
    """Standalone body for the sanitizer: gemv_fp16 at 5-16 columns against one-column calls,
    bit for bit (test_verify.py's property), at shapes small enough for the instrumented run;
    exits non-zero if any column differs."""
    from nanoqwen.engine.build import load_extension

    load_extension()
    ops = torch.ops.nanoqwen
    ok = True
    for n, k in ((2053, 3584), (4099, 896), (1001, 264), (37, 8), (3, 3584)):
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).half()
        x = torch.randn(16, k, generator=g, device="cuda").half()
        ones = torch.empty(16, n, device="cuda")
        for c in range(16):
            ops.gemv_fp16(ones[c], x[c], w)
        for cols in (5, 6, 7, 8, 9, 16):
            out = torch.full((cols, n), float("nan"), device="cuda")
            ops.gemv_fp16(out, x[:cols].contiguous(), w)
            same = bool(torch.equal(out, ones[:cols]))
            print(f"gemv_fp16 n={n} k={k} cols={cols}: columns equal to one-column calls {same}")
            ok &= same
    torch.cuda.synchronize()
    return 0 if ok else 1


def _run_attention_decode() -> int:
    """Standalone body for the sanitizer: attention_decode against an fp32 reference (within
    2e-3 + 2e-3 |ref|, as test_attention_fused.py: fp32 math, the output rounded once to fp16)
    and its cache write against rope_kv_write's (bit for bit); exits non-zero if wrong."""
    from nanoqwen.engine.build import load_extension

    load_extension()
    ops = torch.ops.nanoqwen
    page = 16
    ok = True
    for d, nh, nkv, L, pages in ((128, 28, 4, 49, 8), (64, 14, 2, 17, 8), (128, 40, 8, 33, 4),
                                 (128, 28, 4, 8 * 16 + 3, 8),  # pos beyond the table
                                 (128, 28, 4, 24 * 16 - 5, 24)):  # the TMA ring wraps (1 split)
        g = torch.Generator(device="cuda").manual_seed(L)
        table = torch.randperm(pages, generator=g, device="cuda").int()
        kc = torch.randn(pages, page, nkv, d, generator=g, device="cuda").half()
        vc = torch.randn(pages, page, nkv, d, generator=g, device="cuda").half()
        qkv = torch.randn(1, (nh + 2 * nkv) * d, generator=g, device="cuda").half()
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
        f = torch.arange(pages * page, device="cuda").float()[:, None] * inv[None]
        cos, sin = f.cos().contiguous(), f.sin().contiguous()
        pos = torch.tensor([L - 1], dtype=torch.int32, device="cuda")
        # min_pps 2 (the engine's default until session 38); 1 at 8 splits runs 8 one-page splits
        # into the merge
        for splits, min_pps in ((1, 2), (3, 2), (8, 2), (8, 1)):
            ws = torch.empty(nh, splits, d, device="cuda"), torch.empty(nh, splits, 2, device="cuda")
            k2, v2 = kc.clone(), vc.clone()
            q = torch.empty(1, nh, d, device="cuda").half()
            ops.rope_kv_write(q, k2, v2, qkv, cos, sin, pos, table)
            # fp32 attention of the rotated q over positions 0..min(pos, table end)
            n = min(L, pages * page)
            p = torch.arange(n, device="cuda")
            kk = k2[table[p // page].long(), p % page].float().repeat_interleave(nh // nkv, 1)
            vv = v2[table[p // page].long(), p % page].float().repeat_interleave(nh // nkv, 1)
            sc = torch.einsum("hd,lhd->hl", q[0].float(), kk) / math.sqrt(d)
            ref = torch.einsum("hl,lhd->hd", torch.softmax(sc, -1), vv)
            for kernel in (0, 1):  # kAttnCpAsync, kAttnTma
                k1, v1 = kc.clone(), vc.clone()
                cnt = torch.zeros(nkv, dtype=torch.int32, device="cuda")
                out = torch.empty(nh, d, device="cuda").half()
                ops.attention_decode(out, *ws, cnt, qkv, k1, v1, cos, sin, table, pos, min_pps,
                                     kernel)
                dev = (out.float() - ref).abs()
                close = bool((dev <= 2e-3 + 2e-3 * ref.abs()).all())
                same = bool(torch.equal(k1, k2) and torch.equal(v1, v2))
                print(f"kernel={kernel} d={d} nh={nh} nkv={nkv} L={L} splits={splits} "
                      f"min_pps={min_pps}: max err {float(dev.max()):.2e} close {close} "
                      f"cache equal {same} counters {cnt.tolist()}")
                ok &= close and same and int(cnt.abs().sum()) == 0
    # attention_prefill: (q0, T) from an empty cache and after a prefix, partial last pages, a
    # chunk of several key tiles and row tiles; within 4e-3 of fp32 math (test_attention_prefill)
    for d, nh, nkv, q0, T in ((128, 28, 4, 0, 17), (64, 14, 2, 0, 130), (128, 28, 4, 37, 70),
                              (128, 40, 8, 200, 1)):
        g = torch.Generator(device="cuda").manual_seed(q0 + T)
        pages = -(-(q0 + T) // page) + 2
        table = torch.randperm(pages, generator=g, device="cuda").int()
        kc = torch.randn(pages, page, nkv, d, generator=g, device="cuda").half()
        vc = torch.randn(pages, page, nkv, d, generator=g, device="cuda").half()
        q = torch.randn(T, nh, d, generator=g, device="cuda").half()
        out = torch.empty(T, nh * d, device="cuda").half()
        ops.attention_prefill(out, q, kc, vc, table, q0)
        n = q0 + T
        p = torch.arange(n, device="cuda")
        kk = kc[table[p // page].long(), p % page].float().repeat_interleave(nh // nkv, 1)
        vv = vc[table[p // page].long(), p % page].float().repeat_interleave(nh // nkv, 1)
        sc = torch.einsum("thd,lhd->htl", q.float(), kk) / math.sqrt(d)
        sc = sc.masked_fill(p[None, None, :] > (q0 + torch.arange(T, device="cuda"))[None, :, None],
                            float("-inf"))
        ref = torch.einsum("htl,lhd->thd", torch.softmax(sc, -1), vv).reshape(T, nh * d)
        dev = float((out.float() - ref).abs().max())
        print(f"attention_prefill d={d} nh={nh} nkv={nkv} q0={q0} T={T}: max err {dev:.2e}")
        ok &= dev < 4e-3
    torch.cuda.synchronize()
    return 0 if ok else 1


def _run_verify() -> int:
    """Standalone body for the sanitizer: attention_verify (each block computes the step's own
    K/V rows into shared memory, the last query's blocks write them to the cache) on both
    kernels against T attention_decode calls, bit for bit (test_attention_fused.py's
    verify_matches_decode), inside a page, across one and two page boundaries, past the table's
    end, with pages per split differing between queries; exits non-zero if any differs."""
    from nanoqwen.engine.build import load_extension

    load_extension()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_attention_fused import verify_matches_decode

    ok = True
    for d, nh, nkv, pos, T, pages, splits in ((128, 28, 4, 14, 5, 4, 1), (128, 28, 4, 15, 16, 4, 3),
                                              (64, 14, 2, 61, 8, 4, 2),
                                              (128, 28, 4, 1000, 13, 66, 7)):
        for kernel in (0, 1):  # kAttnCpAsync, kAttnTma
            g = torch.Generator(device="cuda").manual_seed(pos * 100 + T)
            same = verify_matches_decode(g, kernel, d, nh, nkv, pos, T, pages, splits)
            print(f"attention_verify d={d} nh={nh} nkv={nkv} pos={pos} T={T} splits={splits} "
                  f"kernel={kernel}: equal to decode steps {same}")
            ok &= same
    torch.cuda.synchronize()
    return 0 if ok else 1


if __name__ == "__main__":
    mode = sys.argv[1:]
    sys.exit(_run_gemv_fp16_rows() if mode == ["rows"] else _run_verify() if mode == ["verify"]
             else _run_spec() if mode == ["spec"] else _run_attention_decode())
