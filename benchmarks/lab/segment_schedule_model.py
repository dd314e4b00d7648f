"""decode_segment.cu's schedule (benchmarks/attempts/decode-segments.patch: equal to the chain bit
for bit and 1.7x slower at 7B on the H100, session 24; decode-segments-v2.patch keeps its schedule
and has each warp walk the stage sequence that the producer walks here), replayed on the CPU for
every Qwen2.5-Coder shape: the index math of the producer warp and the consumer warps (as written
in the kernel) must cover every (16-row tile, group) of every phase exactly once, in the K ranges
of the chain kernel's warps (gemv_int4.cu's table: q/k/v and o split K in 4, gate/up in 2, down in
8, o by 8 past k = 8192), the producer and the consumers of a block must walk the same number of
ring stages, and the counter a phase waits for must reach exactly the number of blocks that own
tiles of the phase before (one release add each).

    python benchmarks/lab/segment_schedule_model.py [--grid 132]

No GPU; exit status 0 when every check passes. A model of the code, not the code: it is kept in
step with the patch's csrc/decode_segment.cu by hand (Share, warp_range, the launcher's base)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

OP_STORE, OP_RESID, OP_SILU = 0, 1, 2


def k_split(op: int, k: int) -> int:
    """gemv_int4.cu's kInt4Table: the warps that split K for (op, k)."""
    return {OP_STORE: 4, OP_RESID: 4 if k <= 8192 else 8, OP_SILU: 2}[op]


def phases(H: int, I: int, q: int, qkv_n: int, L: int, seg: int) -> list[tuple[int, int, int]]:
    out = []
    if seg > 0:
        out += [(OP_RESID, H, q), (OP_SILU, I, H), (OP_RESID, H, I)]
    if seg < L:
        out += [(OP_STORE, qkv_n, H)]
    return out


def check_segment(H, I, q, qkv_n, L, seg, grid) -> tuple[int, int, float, int]:
    """Returns (ring stages, weight bytes) of the busiest block, the mean bytes a block, and the sum
    over the phases of each phase's busiest block's bytes (figures, not checks). Every phase ends in
    a wait for all the blocks that own its tiles, so a phase lasts as long as its busiest block
    streams: the last figure, not the busiest block's total, bounds the segment (session 24's
    H100 run: the round-robin balances the total, not each phase)."""
    base = 0
    for i in range(seg):   # the launcher's round-robin start
        base += (2 * ((H + 15) // 16) + (I + 15) // 16 if i > 0 else 0) + (qkv_n + 15) // 16
    stages, nbytes = [0] * grid, [0] * grid
    phase_max = 0
    for op, n, k in phases(H, I, q, qkv_n, L, seg):
        before = list(nbytes)
        ks, nt, G = k_split(op, k), (n + 15) // 16, k // 128
        ks_log2 = ks.bit_length() - 1
        nm, tps = (2 if op == OP_SILU else 1), 8 // ks
        cntmax = -(-G // ks)
        pbase = base % grid
        covered: dict[tuple[int, int], int] = {}
        owners = 0
        for b in range(grid):
            first = ((b - pbase) % grid + grid) % grid
            count = (nt - 1 - first) // grid + 1 if first < nt else 0
            owners += count > 0
            for s in range(-(-count // tps)):
                ntiles = min(tps, count - s * tps)
                stages[b] += cntmax * nm   # producer and consumers: for st, for m
                for w in range(8):
                    # warp_range as the kernel writes it: shifts by ks_log2
                    r, j = w & (ks - 1), w >> ks_log2
                    gb = (r * G) >> ks_log2
                    cnt = (((r + 1) * G) >> ks_log2) - gb
                    if j >= ntiles:
                        continue
                    tile = first + (s * tps + j) * grid
                    assert tile < nt
                    for st in range(cnt):
                        key = (tile, gb + st)
                        assert key not in covered, ("twice", seg, op, key)
                        covered[key] = b
                        nbytes[b] += 64 * 16 * nm
                        # the chain's warp r owns exactly these groups: [r*G/KS, (r+1)*G/KS)
                        assert r * G // ks <= gb + st < (r + 1) * G // ks
        assert len(covered) == nt * G, ("missed", seg, op, len(covered), nt * G)
        assert owners == min(grid, nt), (owners, grid, nt)
        phase_max += max(a - b for a, b in zip(nbytes, before))
        base += nt
    return max(stages), max(nbytes), sum(nbytes) / grid, phase_max


def main() -> int:
    from nanoqwen.engine.config import PRESETS

    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", type=int, default=132)
    args = ap.parse_args()
    for name, p in PRESETS.items():
        H, I = p["hidden_size"], p["intermediate_size"]
        hd = H // p["num_attention_heads"]
        q, qkv_n = p["num_attention_heads"] * hd, (p["num_attention_heads"]
                                                  + 2 * p["num_key_value_heads"]) * hd
        L = p["num_hidden_layers"]
        for seg in (0, L):
            check_segment(H, I, q, qkv_n, L, seg, args.grid)
        st, most, mean, pmax = check_segment(H, I, q, qkv_n, L, 1, args.grid)
        print(f"{name}: every tile and group once, in the chain's K ranges; a middle segment's "
              f"busiest block: {st} ring stages, {most / 1e6:.3f} MB (mean {mean / 1e6:.3f}, "
              f"+{100 * (most / mean - 1):.0f}%); the phases' busiest blocks: "
              f"{pmax / 1e6:.3f} MB (+{100 * (pmax / mean - 1):.0f}%)")
    for H, I, nh, nkv, hd in ((256, 512, 2, 1, 128), (256, 384, 4, 2, 64)):   # tests' tiny models
        for seg in (0, 1, 2):
            check_segment(H, I, nh * hd, (nh + 2 * nkv) * hd, 2, seg, args.grid)
    print("tiny test models: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
