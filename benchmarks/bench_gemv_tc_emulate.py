"""CPU emulation of gemv_int4_tc_kernel (csrc/gemv_int4.cu) -- checks its index and fragment logic
without a GPU: one block at a time, every warp/lane, mma.sync m16n8k16 emulated from the PTX
fragment layout (A: a0a1 row g / a2a3 row g+8 / a4a5 row g cols+8 / a6a7 row g+8 cols+8;
B: b0b1 k=2t.., b2b3 k=2t+8..; D: c0c1 row g, c2c3 row g+8), products summed in float64.
Prints the relative error vs the dequantized reference (expected ~0: the logic, not the rounding).
    python3 benchmarks/bench_gemv_tc_emulate.py        (numpy only; ~1 minute)
"""
# CPU emulation of gemv_int4_tc_kernel's data mapping (one block, all warps), mma by its fragment
# layout, to check the index logic before a GPU run.
import numpy as np
ORDER=(0,2,4,6,1,3,5,7)
def quantize(W):
    n,k=W.shape; wf=W.reshape(n,k//128,128); sc=(np.abs(wf).max(-1)/7).astype(np.float16)
    qv=np.clip(np.round(wf/sc.astype(np.float32)[...,None]),-7,7)+8
    codes=qv.reshape(n,k).astype(np.int64).reshape(n,k//8,8)
    word=np.zeros((n,k//8),np.int64)
    for p,e in enumerate(ORDER): word|=(codes[:,:,e]&15)<<(4*p)
    Wd=((qv-8)*sc.astype(np.float32)[...,None]).reshape(n,k)
    return word.astype(np.uint32), sc, Wd
rng = np.random.default_rng(1)
def h2(u):  # uint32 -> two fp16 (low, high)
    return np.array([u & 0xFFFF, u >> 16], dtype=np.uint16).view(np.float16).astype(np.float32)
def mma(d, A, B):  # A[lane] = 4 regs, B[lane] = 2 regs; d[lane] = 4 floats ; returns new d
    Am = np.zeros((16, 16)); Bm = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a = [h2(r) for r in A[lane]]; b = [h2(r) for r in B[lane]]
        Am[g, 2*t:2*t+2] = a[0]; Am[g+8, 2*t:2*t+2] = a[1]; Am[g, 2*t+8:2*t+10] = a[2]; Am[g+8, 2*t+8:2*t+10] = a[3]
        Bm[2*t:2*t+2, g] = b[0]; Bm[2*t+8:2*t+10, g] = b[1]
    Dm = Am @ Bm
    out = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        out.append([d[lane][0] + Dm[g, 2*t], d[lane][1] + Dm[g, 2*t+1], d[lane][2] + Dm[g+8, 2*t], d[lane][3] + Dm[g+8, 2*t+1]])
    return out
def lop(w, m): return (w & m) | 0x64006400
def f16bits(v): return int(np.array([v], np.float16).view(np.uint16)[0])
def sub_lo(u): a = h2(u) - 1032; return int(f16bits(a[0])) | (int(f16bits(a[1])) << 16)
def hi_q(u): a = h2(u) / 16 - 72; return int(f16bits(a[0])) | (int(f16bits(a[1])) << 16)
def run(n, k, DQ, KS=4):
    W = rng.standard_normal((n, k)) * 0.02
    qwu, sc, Wd = quantize(W)
    x = rng.standard_normal(k).astype(np.float16)
    ref = Wd.astype(np.float64) @ x.astype(np.float64)
    scn = sc.astype(np.float32)
    xw = x.view(np.uint32)  # k/2 words
    G = k // 128; C = k // 32
    out = np.zeros(n)
    for blk in range((n + 15) // 16):
        row0 = blk * 16; red = np.zeros((KS, 16))
        for s in range(KS):
            acc = np.zeros((32, 2))
            for gi in range(s, G, KS):
                # per lane: words of chunk 4gi+t of rows g, g+8 ; x pieces
                wa = {}; xv = {}
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    ra, rb = min(row0 + g, n - 1), min(row0 + g + 8, n - 1)
                    ch = 4 * gi + t
                    wa[lane] = (qwu[ra, ch*4:ch*4+4], qwu[rb, ch*4:ch*4+4])
                    pieces = []
                    for j in range(4):
                        base = (128 * gi + 32 * t + 8 * j) // 2
                        v = xw[base:base+4]
                        if DQ == 1: v = [v[0], v[2], v[1], v[3]]
                        pieces.append([int(u) for u in v])
                    xv[lane] = pieces
                kc = np.zeros(32)
                if DQ == 1:
                    c0 = [[0]*4 for _ in range(32)]; c1 = [[0]*4 for _ in range(32)]
                    nlo = 0xE408E408
                    for j in range(4):
                        c0 = mma(c0, [[nlo]*4]*32, [xv[l][j][0:2] for l in range(32)])
                        c1 = mma(c1, [[nlo]*4]*32, [xv[l][j][2:4] for l in range(32)])
                    kc = np.array([c1[l][0] * 72 / 1032 + c0[l][0] for l in range(32)])
                d0 = [[0]*4 for _ in range(32)]; d1 = [[0]*4 for _ in range(32)]
                for j in range(4):
                    A0, A1 = [], []
                    for lane in range(32):
                        a, b = int(wa[lane][0][j]), int(wa[lane][1][j])
                        a8, b8 = a >> 8, b >> 8
                        alo0, ahi0, alo1, ahi1 = lop(a, 0xF000F), lop(a, 0xF000F0), lop(a8, 0xF000F), lop(a8, 0xF000F0)
                        blo0, bhi0, blo1, bhi1 = lop(b, 0xF000F), lop(b, 0xF000F0), lop(b8, 0xF000F), lop(b8, 0xF000F0)
                        if DQ == 1:
                            A0.append([alo0, blo0, alo1, blo1]); A1.append([ahi0, bhi0, ahi1, bhi1])
                        else:
                            A0.append([sub_lo(alo0), sub_lo(blo0), hi_q(ahi0), hi_q(bhi0)]); A1.append([sub_lo(alo1), sub_lo(blo1), hi_q(ahi1), hi_q(bhi1)])
                    if DQ == 1:
                        d0 = mma(d0, A0, [xv[l][j][0:2] for l in range(32)]); d1 = mma(d1, A1, [xv[l][j][2:4] for l in range(32)])
                    else:
                        d0 = mma(d0, A0, [xv[l][j][0:2] for l in range(32)]); d1 = mma(d1, A1, [xv[l][j][2:4] for l in range(32)])
                f1 = 1/16 if DQ == 1 else 1.0
                for lane in range(32):
                    g = lane >> 2
                    sa, sb = scn[min(row0+g, n-1), gi], scn[min(row0+g+8, n-1), gi]
                    acc[lane, 0] += sa * (d1[lane][0] * f1 + d0[lane][0] + kc[lane])
                    acc[lane, 1] += sb * (d1[lane][2] * f1 + d0[lane][2] + kc[lane])
            for lane in range(32):
                if lane & 3 == 0:
                    g = lane >> 2; red[s, g] = acc[lane, 0]; red[s, g + 8] = acc[lane, 1]
        for rr in range(16):
            if row0 + rr < n: out[row0 + rr] = red[:, rr].sum()
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    print(f"n={n} k={k} DQ={'corr' if DQ else 'exact'} KS={KS}: rel err {err:.2e}")
for DQ in (0, 1):
    run(19, 256, DQ, KS=4)
    run(5, 640, DQ, KS=2)
