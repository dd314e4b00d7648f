"""CPU emulation of the wgmma prefill GEMM's index math (csrc/gemm_int4.cu, gemm_int4_wgmma_kernel),
lane by lane, before (and independent of) a device run: the stage's cp.async addresses (X in the
128-byte swizzle, W rows at chunk ^ ((row >> 1) & 3), the scale pairs), each lane's A fragment
from its W words (shift 4t, Marlin's lop3, - 1032, * scale in fp16), wgmma's reads of B through
the descriptor (start address + (n / 8) * SBO + (n % 8) * 128 + 2 k, then the 128-byte swizzle:
address bits 4-6 ^= bits 7-9), the accumulator layout and the epilogue tile -- against
X . W^T in float64 on the weights engine/quant.py's dequantize gives.

    python benchmarks/lab/w4_wgmma_emulate.py

What it cannot check: the hardware's own reading of the layouts (PTX ISA's canonical layouts and
fragment figures, as CUTLASS encodes them, are what it assumes), timing, races, fences.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2].parent))


def h(x):
    return np.float16(x)


def emulate(m, n, k, WG=2, MT=2, BT=128, op="store", seed=0) -> float:
    from nanoqwen.engine.quant import dequantize, quantize

    rng = np.random.default_rng(seed)
    G = k // 128
    mats = []
    for _ in range(2 if op == "silu" else 1):
        qw, sc = quantize(torch.from_numpy(rng.standard_normal((n, k)) * 0.02).float())
        mats.append((qw.numpy().view(np.uint32), sc.numpy(), dequantize(qw, sc).half().numpy()))
    x = rng.standard_normal((m, k)).astype(np.float16)
    bias = (rng.standard_normal(n) * 0.1).astype(np.float16)
    BR = WG * MT * 64
    ROWS_OUT = BR // 2 if op == "silu" else BR
    X_BYTES, W_BYTES = BT * 256, BR * 64
    Tt, Rt = -(-m // BT), -(-n // ROWS_OUT)
    GT = 8
    out = np.full((m, n), np.nan)
    for b in range(Tt * Rt):
        grp = b // (GT * Rt)
        first = grp * GT
        gsz = min(Tt - first, GT)
        tok0 = (first + (b % (GT * Rt)) % gsz) * BT
        row0 = ((b % (GT * Rt)) // gsz) * ROWS_OUT

        def src_row(r):
            if op == "silu":
                up = r >= BR // 2
                return row0 + (r - BR // 2 if up else r), up
            return row0 + r, False

        acc = np.zeros((WG, MT, 4, 32, BT // 2))   # [wg][mt][warp][lane][i]
        for kg in range(G):
            stage = np.zeros(X_BYTES + W_BYTES + BR * 4, dtype=np.uint8)
            # X: chunk ch (8 halves) of token r
            for r in range(BT):
                for ch in range(16):
                    atom, cc = ch >> 3, ch & 7
                    dst = atom * (BT * 128) + r * 128 + ((cc ^ (r & 7)) << 4)
                    if tok0 + r < m:
                        src = x[tok0 + r, kg * 128 + ch * 8: kg * 128 + ch * 8 + 8]
                        stage[dst:dst + 16] = src.view(np.uint8)
            for r in range(BR):
                grow, up = src_row(r)
                qw = mats[1 if up else 0][0]
                for ch in range(4):
                    dst = X_BYTES + r * 64 + ((ch ^ ((r >> 1) & 3)) << 4)
                    if grow < n:
                        stage[dst:dst + 16] = qw[grow, kg * 16 + ch * 4: kg * 16 + ch * 4 + 4].view(np.uint8)
                sc = mats[1 if up else 0][1].reshape(-1)
                if grow < n:
                    e = grow * G + kg
                    pair = sc[e & ~1: (e & ~1) + 2]
                    dst = X_BYTES + W_BYTES + r * 4
                    nb = 4 if e & 1 else 2
                    stage[dst:dst + nb] = pair.view(np.uint8)[:nb]
            ss = stage[X_BYTES + W_BYTES:].view(np.float16)
            ws = stage[X_BYTES:X_BYTES + W_BYTES]

            def b_elem(start, nn, kk):   # wgmma's read of B (token nn, k kk of the slice)
                addr = start + (nn // 8) * 1024 + (nn % 8) * 128 + 2 * kk
                addr ^= ((addr >> 7) & 7) << 4
                return stage[addr:addr + 2].view(np.float16)[0]

            for wg in range(WG):
                for mt in range(MT):
                    for kk in range(8):
                        start = (kk >> 2) * (BT * 128) + (kk & 3) * 32
                        B = np.array([[b_elem(start, nn, kq) for nn in range(BT)]
                                      for kq in range(16)], dtype=np.float64)   # [16][BT]
                        A = np.zeros((64, 16))
                        for wq in range(4):
                            for lane in range(32):
                                g, t = lane >> 2, lane & 3
                                regs = []
                                for hh, word_off in ((0, 0), (1, 0), (0, 1), (1, 1)):
                                    r = (wg * MT + mt) * 64 + wq * 16 + g + 8 * hh
                                    c = kk // 2
                                    base = r * 64 + ((c ^ ((r >> 1) & 3)) << 4)
                                    words = ws[base:base + 16].view(np.uint32)
                                    w = int(words[2 * (kk & 1) + word_off])
                                    grow, _ = src_row(r)
                                    spar = ((grow if grow < n else 0) * G) & 1
                                    s = ss[2 * r + ((spar ^ kg) & 1)]
                                    v = w >> (4 * t)
                                    lo, hi = v & 0xF, (v >> 16) & 0xF
                                    # fp16: (1024 + u) - 1032 exact, times s rounded once
                                    regs.append((h(h(lo - 8) * s), h(h(hi - 8) * s)))
                                # fragment: reg0 (g, 2t..), reg1 (g+8, 2t..), reg2 (g, 2t+8..),
                                # reg3 (g+8, 2t+8..)
                                for ri, (rr, kc) in enumerate(((g, 2 * t), (g + 8, 2 * t),
                                                               (g, 2 * t + 8), (g + 8, 2 * t + 8))):
                                    A[wq * 16 + rr, kc] = regs[ri][0]
                                    A[wq * 16 + rr, kc + 1] = regs[ri][1]
                        D = A @ B   # [64][BT]
                        for wq in range(4):
                            for lane in range(32):
                                g, t = lane >> 2, lane & 3
                                for i in range(BT // 2):
                                    row = wq * 16 + g + 8 * ((i >> 1) & 1)
                                    col = 8 * (i >> 2) + 2 * t + (i & 1)
                                    acc[wg, mt, wq, lane, i] += D[row, col]
        # epilogue tile [token][block row]
        E = np.zeros((BT, BR))
        for wg in range(WG):
            for mt in range(MT):
                for wq in range(4):
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        for i in range(BT // 2):
                            r = (wg * MT + mt) * 64 + wq * 16 + g + 8 * ((i >> 1) & 1)
                            tok = 8 * (i >> 2) + 2 * t + (i & 1)
                            E[tok, r] = acc[wg, mt, wq, lane, i]
        for tok in range(BT):
            if tok0 + tok >= m:
                continue
            for j in range(ROWS_OUT):
                if row0 + j >= n:
                    continue
                if op == "silu":
                    gv, uv = E[tok, j], E[tok, j + BR // 2]
                    out[tok0 + tok, row0 + j] = gv / (1 + np.exp(-gv)) * uv
                else:
                    out[tok0 + tok, row0 + j] = E[tok, j] + (bias[row0 + j] if op == "store" else 0)
    xd = x.astype(np.float64)
    if op == "silu":
        gt, up = xd @ mats[0][2].astype(np.float64).T, xd @ mats[1][2].astype(np.float64).T
        ref = gt / (1 + np.exp(-gt)) * up
    else:
        ref = xd @ mats[0][2].astype(np.float64).T + (bias.astype(np.float64) if op == "store" else 0)
    assert np.isfinite(out).all(), "an output left unwritten"
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def main() -> int:
    worst = 0.0
    for m, n, k, WG, MT, BT, op in [(20, 300, 256, 2, 2, 128, "store"),
                                    (20, 70, 128, 2, 1, 64, "silu"),
                                    (9, 130, 384, 1, 2, 64, "resid")]:
        err = emulate(m, n, k, WG, MT, BT, op)
        worst = max(worst, err)
        print(f"m={m} n={n} k={k} WG={WG} MT={MT} BT={BT} {op}: error {err:.3g}", flush=True)
    print("ok" if worst < 1e-9 else "MISMATCH")
    return 0 if worst < 1e-9 else 1


if __name__ == "__main__":
    raise SystemExit(main())
