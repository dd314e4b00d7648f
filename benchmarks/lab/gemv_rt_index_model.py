"""The index math of gemv_int4_tca_kernel's column launches with RT row tiles a block
(csrc/gemv_int4.cu, attempts/verify-row-tiles.patch), replayed on the CPU: no GPU, no
arithmetic, only which data every lane copies, reads and sums where.

Each 16-byte weight chunk is tracked by name (matrix, row, chunk), each scale by (matrix, row,
group), each partial sum by (warp, matrix, row, column). The model follows the kernel's code
line by line -- the copy offsets (goff / soff / gcol), the ring slots of each stage, the scale
staging, the fragment reads of rows g and g+8 of every virtual matrix v = m * RT + rt, the
split-K buffer `red` and the epilogue's loop -- and checks:
  * every mma reads the chunks of rows g, g+8 of tile v's rows (clamped to n - 1 past n) at the
    group the warp is on, and the scale pair of the same rows and group;
  * a ring slot is read only after the stage it holds was copied and before it is reused;
  * every output (row < n, column < nc) is emitted exactly once, from the sums of every warp of
    its block over exactly its own rows and columns, the warps' K ranges covering all groups;
  * the shared-memory regions (red, scales, ring) fit tca_smem_bytes and do not overlap.
A planted error (the scale index without RT, or the second tile's rows offset by 8) must fail.
check_fold does the same for attempts/verify-norm-fold.patch's indices: the residual's column
parts (each (column, tile) once, from its own rows) and a consumer lane's hid / ln / x entries.

    python3 benchmarks/lab/gemv_rt_index_model.py
"""

from __future__ import annotations

import sys

GROUP = 128


def ring_swz(gps, col, row):
    return col ^ ((row & 1) << 2) if gps % 2 == 0 else col


def smem_bytes(k, nm, ks, s, gps, nt, rt):
    vm = nm * rt
    ncol = 1 if nt == 0 else 8 * nt
    return ((k * 2 if nt == 0 else 0) + ks * vm * 16 * ncol * 4
            + ks * ((k // GROUP + ks - 1) // ks) * vm * 8 * 4 + ks * s * vm * 16 * gps * 64)


def run(n, k, nm, ks, s_stages, gps, rt, nc, plant=None):
    nt = (nc + 7) // 8
    ncol = 8 * nt
    vm = nm * rt
    rc = gps * 4
    slot_sz = vm * 16 * rc
    cpl = 16 * rc // 32
    C, G = k // 32, k // 128
    maxcnt = (G + ks - 1) // ks
    # shared memory regions, in bytes, as the kernel carves them (no x with column tiles)
    red_b = ks * vm * 16 * ncol * 4
    ss_b = ks * maxcnt * vm * 8 * 4
    ring_b = ks * s_stages * slot_sz * 16
    assert red_b + ss_b + ring_b == smem_bytes(k, nm, ks, s_stages, gps, nt, rt)
    blocks = (n + 16 * rt - 1) // (16 * rt)
    emitted = {}
    for b in range(blocks):
        row0 = b * 16 * rt
        red = {}
        groups_seen = {}
        for s in range(ks):
            gb = s * G // ks
            cnt = (s + 1) * G // ks - gb
            nst = (cnt + gps - 1) // gps
            ring = {}  # (slot, index) -> (m, row, chunk, stage)
            ss = {}
            issuers = []
            for lane in range(32):
                goff = [[0] * cpl for _ in range(rt)]
                soff = [0] * cpl
                gcol = [0] * cpl
                for i in range(cpl):
                    c = lane + 32 * i
                    r, col = c // rc, c % rc
                    for t_ in range(rt):
                        off = 8 * t_ if plant == "tile_offset_8" else 16 * t_
                        goff[t_][i] = min(row0 + off + r, n - 1) * C + gb * 4 + col
                    soff[i] = r * rc + ring_swz(gps, col, r)
                    gcol[i] = col // 4
                lane_goff = goff
                ss_lane = ss

                def issue(st, lane=lane, goff=lane_goff, soff=soff, gcol=gcol):
                    if st >= nst:
                        return
                    for v in range(vm):
                        m = v // rt
                        for i in range(cpl):
                            if st * gps + gcol[i] < cnt:
                                idx = goff[v % rt][i] + st * rc
                                key = ((st % s_stages), v * 16 * rc + soff[i])
                                ring[key] = (m, idx // C, idx % C, st)

                issuers.append(issue)  # every lane's copies of a stage are issued together below
                # scales
                for e in range(lane, cnt * vm * 8, 32):
                    i, v, gg = e // (vm * 8), (e // 8) % vm, e % 8
                    if plant == "scale_no_rt":
                        v_rows = v % nm
                        r0 = row0 + gg
                    else:
                        v_rows = v // rt
                        r0 = row0 + 16 * (v % rt) + gg
                    ss_lane[e] = (v_rows, min(r0, n - 1), min(r0 + 8, n - 1), gb + i)
            for st in range(s_stages - 1):
                for f in issuers:
                    f(st)
            acc = {}
            for st in range(nst):
                for f in issuers:
                    f(st + s_stages - 1)
                slot = st % s_stages
                for jj in range(gps):
                    i = st * gps + jj
                    if i >= cnt:
                        continue
                    gi = gb + i
                    groups_seen.setdefault(s, set()).add(gi)
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        for v in range(vm):
                            m, t_ = v // rt, v % rt
                            off = 16 * t_
                            for rr, gg in ((g, g), (g + 8, g + 8)):
                                key = (slot, (v * 16 + gg) * rc + ring_swz(gps, 4 * jj + t, gg))
                                got = ring.get(key)
                                want_row = min(row0 + off + rr, n - 1)
                                assert got is not None, ("unwritten ring entry", key)
                                assert got[3] == st, ("stale or early slot", got, st)
                                assert got[:3] == (m, want_row, gi * 4 + t), \
                                    ("chunk", got, (m, want_row, gi * 4 + t), b, s, lane, v)
                            sc = ss[(i * vm + v) * 8 + g]
                            want = (m, min(row0 + off + g, n - 1), min(row0 + off + g + 8, n - 1),
                                    gi)
                            assert sc == want, ("scale", sc, want, b, s, lane, v)
                            # the lane's accumulators: rows g, g+8 of tile v, columns 8nt+2t, +1
                            for nt_ in range(nt):
                                for e in range(2):
                                    col = nt_ * 8 + 2 * t + e
                                    for rr in (g, g + 8):
                                        acc.setdefault((v, nt_, e, rr == g + 8, lane), set()).add(
                                            (m, row0 + 16 * t_ + rr, col, gi))
            # splitk_store_cols: red[((s*VM+v)*NCOL + nt*8+2t+e)*16 + g / g+8]
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for v in range(vm):
                    for nt_ in range(nt):
                        for e in range(2):
                            base = ((s * vm + v) * ncol + nt_ * 8 + 2 * t + e) * 16
                            for hi, rr in ((False, g), (True, g + 8)):
                                cell = base + rr
                                assert cell not in red, ("red written twice", cell)
                                red[cell] = (s, frozenset(acc.get((v, nt_, e, hi, lane), set())))
        # the warps' K ranges cover every group once
        allg = sorted(x for gs in groups_seen.values() for x in gs)
        assert allg == list(range(G)), ("K ranges", allg)
        assert max(red) < red_b // 4
        # the epilogue
        for i in range(16 * rt * nc):
            rr, t_, col = i & 15, (i >> 4) % rt, (i >> 4) // rt
            row = row0 + 16 * t_ + rr
            if row >= n:
                continue
            for m in range(nm):
                terms = set()
                for w in range(ks):
                    cell = ((w * vm + m * rt + t_) * ncol + col) * 16 + rr
                    ws, items = red[cell]
                    assert ws == w
                    for it in items:
                        assert it[:3] == (m, row, col), ("sum of another output", it, (m, row, col))
                    terms |= {it[3] for it in items}
                assert terms == set(range(G)), ("groups summed", row, col, sorted(terms))
            key = (row, col)
            assert key not in emitted, ("emitted twice", key)
            emitted[key] = b
    want = {(r, c) for r in range(n) for c in range(nc)}
    assert set(emitted) == want, ("outputs", len(emitted), len(want))


def check_fold(n, k, nc, ks, rt):
    """attempts/verify-norm-fold.patch: the residual's column launch writes part (col, tile) of
    every 16-row tile once, from that tile's rows; a consumer lane's hid, ln and x entries of a
    group are the same k (x piece j = entries 8j .. 8j+7 of the lane's 32)."""
    np_ = (n + 15) // 16
    written = {}
    for b in range((n + 16 * rt - 1) // (16 * rt)):
        row0 = b * 16 * rt
        for s in range(ks):
            for p in range(s, nc * rt, ks):
                col, t_ = p // rt, p % rt
                if row0 + 16 * t_ >= n:
                    continue
                idx = col * np_ + (row0 >> 4) + t_
                assert idx not in written, ("part twice", idx)
                written[idx] = (col, [r for r in range(row0 + 16 * t_, row0 + 16 * t_ + 16) if r < n])
    for col in range(nc):
        for tile in range(np_):
            assert written[col * np_ + tile] == (col, [r for r in range(16 * tile, 16 * tile + 16)
                                                       if r < n])
    for gi in range(k // 128):
        for t in range(4):
            x = [(gi * 16 + 4 * t + j) * 8 + q for j in range(4) for q in range(8)]
            h = [(gi * 32 + 8 * t + qq) * 4 + e for qq in range(8) for e in range(4)]
            w = [(gi * 16 + 4 * t + j) * 8 + q for j in range(4) for q in range(8)]
            # fold_x: piece j takes h[2j], h[2j+1] (8 floats) and w piece j
            hx = [h[8 * j + q] for j in range(4) for q in range(8)]
            assert x == hx == w, (gi, t)


CASES = [  # (n, k, nm, ks, s, gps, rt, nc): the patch's two instances and ragged shapes
    (53, 1024, 2, 2, 4, 2, 2, 8), (10, 1024, 2, 2, 4, 2, 2, 3), (64, 768, 2, 2, 4, 2, 2, 16),
    (40, 2560, 1, 8, 4, 2, 2, 9), (96, 2432, 1, 8, 4, 2, 2, 2), (33, 1024, 1, 4, 4, 2, 1, 8),
    (48, 512, 2, 4, 3, 1, 2, 13), (17, 1280, 1, 16, 2, 2, 2, 5),
]

if __name__ == "__main__":
    for c in CASES:
        run(*c)
        print("ok", c)
    for fc in ((53, 1024, 8, 2, 2), (40, 2432, 16, 8, 2), (3584, 896, 9, 4, 1), (10, 256, 2, 2, 2)):
        check_fold(*fc)
        print("ok fold", fc)
    for plant, case in (("scale_no_rt", CASES[0]), ("tile_offset_8", CASES[3])):
        try:
            run(*case, plant=plant)
        except AssertionError as e:
            print(f"planted {plant}: caught ({str(e)[:70]}...)")
        else:
            print(f"planted {plant}: NOT caught")
            sys.exit(1)
