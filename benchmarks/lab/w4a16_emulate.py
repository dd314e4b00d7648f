"""w4a16_gemm_lab.cu's index math run on the CPU: a lane-by-lane emulation of the kernel.

    python benchmarks/lab/w4a16_emulate.py

No GPU here, so before the kernel's first device run this checks what a device run could only
show as wrong numbers: the X and W chunks' placement in shared memory (the swizzle, the
zero-filled tokens past m and rows past n), each lane's fragment reads, the dequantization's
bit tricks (lop3 / hsub2 / hfma2 on the interleaved nibble order, q*s rounded to half),
mma.sync m16n8k16's fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16" with .f16
A row-major and B column-major: a0..a3 = (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..);
b0, b1 = (2t..2t+1, g), (2t+8.., g); d0..d3 = (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)), and
the three epilogues, for every block of a small problem with awkward m and n. It checks that
every shared-memory byte a lane reads was written by the stage's copies (and which), and that
a quarter warp's 16-byte reads hit 8 distinct bank groups (the conflict-free claim).

The arithmetic: the tensor core's fp32 sums are emulated in float64 (order differs from the
hardware's), so the output is compared with fp32 math on the same half weights to 2e-3
relative (w4a16_gemm.py's bound); an index error gives O(1) errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from nanoqwen.engine.quant import dequantize, quantize  # noqa: E402

GROUP = 128


def h2(bits: int) -> tuple[np.float16, np.float16]:
    """uint32 -> (low half, high half) as fp16 values."""
    return (np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0],
            np.array([bits >> 16], dtype=np.uint16).view(np.float16)[0])


def lop3_and_or(a: int, b: int, c: int) -> int:
    return ((a & b) | c) & 0xFFFFFFFF


def lo(v: int, s: np.float16) -> tuple:
    x0, x1 = h2(lop3_and_or(v, 0x000F000F, 0x64006400))
    q = (np.float16(x0 - np.float16(1032)), np.float16(x1 - np.float16(1032)))
    return tuple(np.float16(np.float32(e) * np.float32(s)) for e in q)


def hi(v: int, s: np.float16) -> tuple:
    x0, x1 = h2(lop3_and_or(v, 0x00F000F0, 0x64006400))
    # hfma2(v, 1/16, -72): exact here (v/16 - 72 is an integer in -8..7)
    q = tuple(np.float16(np.float32(e) * np.float32(0.0625) - np.float32(72)) for e in (x0, x1))
    return tuple(np.float16(np.float32(e) * np.float32(s)) for e in q)


class Smem:
    """Shared memory as bytes, with the writer of each 16-byte unit (to check reads)."""

    def __init__(self, nbytes: int) -> None:
        self.b = np.zeros(nbytes, dtype=np.uint8)
        self.tag = [None] * (nbytes // 16)

    def cp_async16(self, off: int, src: bytes | None, tag) -> None:
        assert off % 16 == 0
        self.b[off:off + 16] = np.frombuffer(src, dtype=np.uint8) if src is not None else 0
        assert self.tag[off // 16] is None, f"16-byte unit {off} written twice in a stage"
        self.tag[off // 16] = tag

    def lds128(self, off: int, want) -> np.ndarray:
        got = self.tag[off // 16]
        assert got == want, f"read {off}: holds {got}, wanted {want}"
        return self.b[off:off + 16].view(np.uint32)


def mma(d: np.ndarray, a_regs, b_regs) -> None:
    """d [32 lanes, 4] += A . B with the m16n8k16 fragment layouts; a_regs [32][4] of half
    pairs, b_regs [32][2] of half pairs."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                        (g + 8, 2 * t + 8))):
            A[row, col], A[row, col + 1] = a_regs[lane][r]
        for r, k0 in enumerate((2 * t, 2 * t + 8)):
            B[k0, g], B[k0 + 1, g] = b_regs[lane][r]
    D = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        d[lane] += (D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1])


def bank_groups_ok(offsets: list[int]) -> bool:
    """A warp's 16-byte reads: each quarter warp (8 lanes) hits 8 distinct bank groups."""
    return all(len({(o // 16) % 8 for o in offsets[q * 8:(q + 1) * 8]}) == 8 for q in range(4))


def run(WR, WT, AT, BT, S, op, m, n, k, x, mats, bias, resid, conflicts):
    """The kernel, emulated; returns the output ([m, n] half or fp32)."""
    SILU = op == "silu"
    BN, BM = WR * 16 * AT, WT * BT * 8
    ROWS_OUT = WR * 16 if SILU else BN
    X_BYTES, STAGE = BM * 256, BM * 256 + BN * 64
    G, kw4 = k // GROUP, k // 32
    qw = [np.ascontiguousarray(mt[0].numpy().view(np.uint32)) for mt in mats]
    sc = [mt[1].numpy() for mt in mats]
    xh = x.numpy()
    out = resid.numpy().copy() if op == "resid" else np.full((m, n), np.nan, dtype=np.float16)
    nthreads = WR * WT * 32
    for bx in range((n + ROWS_OUT - 1) // ROWS_OUT):
        for by in range((m + BM - 1) // BM):
            row0, tok0 = bx * ROWS_OUT, by * BM
            acc = np.zeros((WR * WT, AT, BT, 32, 4))
            for kg in range(G):
                sm = Smem(STAGE)   # one stage: the ring's other slots hold other groups
                for tid in range(nthreads):
                    for c in range(tid, BM * 16, nthreads):
                        tok, cc = c >> 4, c & 15
                        p = (((cc & 3) << 2) | (cc >> 2)) ^ ((tok & 1) << 2)
                        gt = tok0 + tok
                        src = xh[gt, kg * GROUP + cc * 8: kg * GROUP + cc * 8 + 8].tobytes() \
                            if gt < m else None
                        sm.cp_async16(tok * 256 + p * 16, src, ("x", tok, cc))
                    for c in range(tid, BN * 4, nthreads):
                        r, ch = c >> 2, c & 3
                        if SILU:
                            w, rem = r // 32, r % 32
                            mat, grow = rem // 16, row0 + w * 16 + rem % 16
                        else:
                            mat, grow = 0, row0 + r
                        src = qw[mat].reshape(-1, kw4, 4)[grow, kg * 4 + ch].tobytes() \
                            if grow < n else None
                        sm.cp_async16(X_BYTES + r * 64 + ch * 16, src, ("w", mat, grow, ch))
                for warp in range(WR * WT):
                    wr, wt = warp % WR, warp // WR
                    s2, va, vb = {}, {}, {}
                    for at in range(AT):
                        w_offs = {0: [], 8: []}
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            for h in (0, 1):
                                if SILU:
                                    mat, grow = at, row0 + wr * 16 + g + 8 * h
                                else:
                                    mat, grow = 0, row0 + (wr * AT + at) * 16 + g + 8 * h
                                s2[at, h, lane] = sc[mat][grow, kg] if grow < n else sc[mat][0, kg]
                            r = (wr * AT + at) * 16 + g
                            for dr, dst in ((0, va), (8, vb)):
                                rr = r + dr
                                if SILU:
                                    w_, rem = rr // 32, rr % 32
                                    mat, grow = rem // 16, row0 + w_ * 16 + rem % 16
                                else:
                                    mat, grow = 0, row0 + rr
                                off = X_BYTES + rr * 64 + t * 16
                                w_offs[dr].append(off)
                                dst[at, lane] = sm.lds128(off, ("w", mat, grow, t))
                        for dr in (0, 8):
                            conflicts["w"] += not bank_groups_ok(w_offs[dr])
                    for j in range(4):
                        A0, A1 = {}, {}
                        for at in range(AT):
                            for lane in range(32):
                                wa, wb = int(va[at, lane][j]), int(vb[at, lane][j])
                                sa, sb = s2[at, 0, lane], s2[at, 1, lane]
                                A0[at, lane] = (lo(wa, sa), lo(wb, sb), hi(wa, sa), hi(wb, sb))
                                A1[at, lane] = (lo(wa >> 8, sa), lo(wb >> 8, sb),
                                                hi(wa >> 8, sa), hi(wb >> 8, sb))
                        for nt in range(BT):
                            xv, x_offs = {}, []
                            for lane in range(32):
                                g, t = lane >> 2, lane & 3
                                tok = (wt * BT + nt) * 8 + g
                                p = ((j << 2) | t) ^ ((tok & 1) << 2)
                                off = tok * 256 + p * 16
                                x_offs.append(off)
                                xv[lane] = sm.lds128(off, ("x", tok, 4 * t + j)).view(np.float16)
                            conflicts["x"] += not bank_groups_ok(x_offs)
                            for at in range(AT):
                                d = acc[warp, at, nt]
                                mma(d, [A0[at, ln] for ln in range(32)],
                                    [(tuple(xv[ln][0:2]), tuple(xv[ln][2:4])) for ln in range(32)])
                                mma(d, [A1[at, ln] for ln in range(32)],
                                    [(tuple(xv[ln][4:6]), tuple(xv[ln][6:8])) for ln in range(32)])
            # epilogue
            for warp in range(WR * WT):
                wr, wt = warp % WR, warp // WR
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    for nt in range(BT):
                        for e in (0, 1):
                            tok = tok0 + (wt * BT + nt) * 8 + 2 * t + e
                            if tok >= m:
                                continue
                            for h in (0, 1):
                                if SILU:
                                    row = row0 + wr * 16 + g + 8 * h
                                    if row >= n:
                                        continue
                                    gv = np.float32(acc[warp, 0, nt, lane, 2 * h + e])
                                    uv = np.float32(acc[warp, 1, nt, lane, 2 * h + e])
                                    out[tok, row] = np.float16(gv / (1 + np.exp(-gv)) * uv)
                                    continue
                                for at in range(AT):
                                    row = row0 + (wr * AT + at) * 16 + g + 8 * h
                                    if row >= n:
                                        continue
                                    v = np.float32(acc[warp, at, nt, lane, 2 * h + e])
                                    if op == "store":
                                        b = np.float32(bias[row]) if bias is not None else 0
                                        out[tok, row] = np.float16(v + b)
                                    else:
                                        out[tok, row] += v
    return out


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    # (WR, WT, AT, BT, S): two of the lab's shapes scaled down in warps (the index math is the
    # same per warp), m and n off every tile edge
    shapes = [(2, 1, 2, 2, 2), (1, 2, 2, 1, 3)]
    k = 256
    worst = 0.0
    conflicts = {"x": 0, "w": 0}
    for WR, WT, AT, BT, S in shapes:
        for op, n, m in (("store", 72, 19), ("resid", 40, 33), ("silu", 24, 11)):
            mats = []
            for _ in range(2 if op == "silu" else 1):
                w = torch.randn(n, k, generator=gen) * 0.02
                mats.append(quantize(w))
            x = torch.randn(m, k, generator=gen).half()
            bias = (torch.randn(n, generator=gen) * 0.1).half().numpy() if op == "store" else None
            resid = torch.randn(m, n, generator=gen)
            wh = [dequantize(q, s).half().float() for q, s in mats]   # the kernel's q*s in half
            xf = x.float()
            if op == "silu":
                gt, up = xf @ wh[0].T, xf @ wh[1].T
                ref = (gt * torch.sigmoid(gt) * up).half().float()
            elif op == "store":
                ref = (xf @ wh[0].T + torch.from_numpy(bias).float()).half().float()
            else:
                ref = resid + xf @ wh[0].T
            got = torch.from_numpy(np.asarray(run(WR, WT, AT, BT, S, op, m, n, k, x, mats, bias,
                                                  resid, conflicts), dtype=np.float32))
            assert torch.isfinite(got).all(), f"{op}: unwritten outputs"
            err = float((got - ref).abs().max() / ref.abs().max())
            worst = max(worst, err)
            print(f"WR{WR} WT{WT} AT{AT} BT{BT} {op:5s} m={m} n={n} k={k}: error {err:.2e}",
                  flush=True)
    print(f"largest error {worst:.2e} (bound 2e-3); quarter warps with a bank-group conflict: "
          f"x {conflicts['x']}, w {conflicts['w']}")
    return 0 if worst <= 2e-3 and not any(conflicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
