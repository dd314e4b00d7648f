"""The cluster sampler of csrc/sampling.cu (session 25's attempt, landed in session 26),
emulated on the CPU.

    python benchmarks/lab/sampler_cluster_emulate.py [--rows 40] [--coarse]

csrc/sampling.cu's cluster form cuts the vocabulary into slices, one a block,
and exchanges each block's argmax, sums and 256-bin radix histograms through distributed shared
memory. This script replays that index math with numpy: the slices (ceil(V / blocks) rounded up
to 4), the per-block radix histograms summed over the blocks, radix_pick, the draw's block
prefix (`below`), the thread runs (`per` ids each, exclusive scan `excl`) and the walk inside the
run. Checks, for block counts 1, 2, 3, 4, 8 and 16:
  - the token is the same for every block count;
  - it equals a direct computation: the top-k and top-p thresholds from a sort, and the draw as
    the first id whose cumulative weight passes the pick.
Masses are 2^32 fixed point as in the kernel; exp is numpy's float32 exp, not `__expf`, so this
checks the algorithm and its indices, not the GPU's bits. Exit status 0 when every row agrees.
Controls (planted in a copy, session 25): radix_pick's >= written >, the argmax's tie rule
dropped, and the run's walk started at 0 instead of its prefix are each caught at 12-20 rows; an
off-by-one of one 2^-32 unit in the prefix is not (a pick lands there with probability ~1e-9).
--coarse adds the first pass of benchmarks/attempts/sampler-coarse.patch (session 26): a
256-bin digit on the logit's distance below the max, then the radix passes over that digit's
ids only. Controls (session 26): the digit ordered against the keys (0 at the max) is caught
(82 of 280 draws disagree at 40 rows), and so is the radix passes ignoring the chosen digit.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

THREADS = 512


def float_key(v: np.ndarray) -> np.ndarray:
    b = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    neg = (b & 0x80000000) != 0
    return np.where(neg, (~b) & 0xFFFFFFFF, b | 0x80000000).astype(np.uint64)


def fixed_mass(v: np.ndarray, mx: float, inv_t: float) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(((v.astype(np.float32) - np.float32(mx)) * np.float32(inv_t)).astype(np.float32))
        m = np.rint(e.astype(np.float64) * 4294967296.0)
    m = np.nan_to_num(m, nan=0.0)
    return m.astype(np.uint64)


def slices(V: int, nb: int) -> list[tuple[int, int]]:
    chunk = ((V + nb - 1) // nb + 3) & ~3
    out = []
    for r in range(nb):
        c0 = min(V, r * chunk)
        out.append((c0, min(V, c0 + chunk) - c0))
    return out


def radix_pick(tot: np.ndarray, remaining: int) -> tuple[int, int]:
    """The kernel's radix_pick: the largest digit d with sum(tot[>= d]) >= remaining."""
    acc = 0
    for d in range(255, -1, -1):
        if acc + int(tot[d]) >= remaining and acc < remaining:
            return d, remaining - acc
        acc += int(tot[d])
    return 0, remaining  # no digit qualifies (remaining 0): the kernel's defaults


def coarse_digit(v: np.ndarray, key: np.ndarray, mx: float) -> np.ndarray:
    """The attempt's coarse_digit: 255 at or above the max's key, 254 - (mx - v) * 8 (float32,
    truncated) down to 1, 0 beyond or NaN."""
    key_mx = int(float_key(np.array([mx], dtype=np.float32))[0])
    with np.errstate(over="ignore", invalid="ignore"):
        d = (np.float32(mx) - v.astype(np.float32)).astype(np.float32) * np.float32(8.0)
        d = d.astype(np.float32)
        inner = np.where(d < 254.0, 254 - np.floor(np.where(np.isfinite(d), d, 0)), 0)
    inner = np.where(np.isnan(d), 0, inner)
    return np.where(key >= key_mx, 255, inner).astype(np.int64)


def cluster_radix(x, sl, floor_key, mx, target, mass: bool, coarse: bool = False) -> int:
    prefix, mask, remaining = 0, 0, target
    cdigit = None
    if coarse:  # the attempt's first pass: the coarse digit where the target is crossed
        tot = np.zeros(256, dtype=np.uint64)
        for c0, n in sl:
            v = x[c0:c0 + n]
            key = float_key(v)
            w = fixed_mass(v, mx, 1.0) if mass else np.ones(n, dtype=np.uint64)
            take = (key >= floor_key) & (w != 0)
            np.add.at(tot, coarse_digit(v, key, mx)[take], w[take])
        cdigit, remaining = radix_pick(tot, remaining)
    for shift in (24, 16, 8, 0):
        tot = np.zeros(256, dtype=np.uint64)
        for c0, n in sl:  # each block's histogram, then the cluster's sum
            v = x[c0:c0 + n]
            key = float_key(v)
            take = ((key & mask) == prefix) & (key >= floor_key)
            if cdigit is not None:
                take &= coarse_digit(v, key, mx) == cdigit
            w = fixed_mass(v, mx, 1.0) if mass else np.ones(n, dtype=np.uint64)
            take &= w != 0
            bins = ((key >> shift) & 255).astype(np.int64)
            np.add.at(tot, bins[take], w[take])
        d, remaining = radix_pick(tot, remaining)
        prefix |= d << shift
        mask |= 255 << shift
    return prefix


def top_p_target(top_p: float, z: int) -> int:
    t = int(np.ceil(np.float64(np.float32(top_p)) * float(z)))
    return max(1, min(t, z)) if z > 0 else 0


def cluster_sample(x, nb, temperature, top_k, top_p, min_p, u, coarse=False) -> int:
    V = len(x)
    sl = slices(V, nb)
    # argmax: per block (lowest id on ties), then over the blocks
    best = (-np.inf, 0x7FFFFFFF)
    for c0, n in sl:
        if n == 0:
            continue
        v = x[c0:c0 + n]
        j = int(np.argmax(v))  # numpy: the first maximum (lowest id)
        if v[j] > best[0] or (v[j] == best[0] and c0 + j < best[1]):
            best = (float(v[j]), c0 + j)
    mx, max_idx = best[0], (0 if best[1] == 0x7FFFFFFF else best[1])
    if temperature <= 0:
        return max_idx
    floor_key = 0
    if 0 < top_k < V:
        floor_key = cluster_radix(x, sl, 0, mx, top_k, mass=False, coarse=coarse)
    if top_p < 1.0:
        z = 0
        for c0, n in sl:
            v = x[c0:c0 + n]
            z += int(fixed_mass(v, mx, 1.0)[float_key(v) >= floor_key].sum())
        if z > 0:
            floor_key = cluster_radix(x, sl, floor_key, mx, top_p_target(top_p, z), mass=True,
                                      coarse=coarse and not 0 < top_k <= 1024)
    if min_p > 0:
        floor_key = max(floor_key, int(float_key(np.array([mx + np.log(np.float32(min_p))],
                                                         dtype=np.float32))[0]))
    # the draw: block sums in rank order, each thread a contiguous run of `per` ids
    inv_t = 1.0 / temperature
    weights = []
    for c0, n in sl:
        v = x[c0:c0 + n]
        weights.append(np.where(float_key(v) >= floor_key, fixed_mass(v, mx, inv_t), 0)
                       .astype(np.uint64))
    block_tot = [int(w.sum()) for w in weights]
    total = sum(block_tot)
    if total == 0:
        return max_idx
    pick = min(int(u * total), total - 1)
    below = 0
    for r, (c0, n) in enumerate(sl):
        if below <= pick < below + block_tot[r]:
            local = pick - below
            per = (n + THREADS - 1) // THREADS
            w = weights[r]
            excl = 0
            for t in range(THREADS):
                j0, j1 = min(n, t * per), min(n, t * per + per)
                mine = int(w[j0:j1].sum())
                if mine and excl <= local < excl + mine:
                    acc = excl
                    for j in range(j0, j1):
                        if w[j] > 0 and local < acc + int(w[j]):
                            return c0 + j
                        acc += int(w[j])
                excl += mine
            raise AssertionError("the pick landed in no thread's run")
        below += block_tot[r]
    raise AssertionError("the pick landed in no block")


def direct_sample(x, temperature, top_k, top_p, min_p, u) -> int:
    """The same sampler without slices, histograms or runs: thresholds from a sort."""
    V = len(x)
    key = float_key(x)
    mx_i = int(np.argmax(x))
    mx = float(x[mx_i])
    if temperature <= 0:
        return mx_i
    floor_key = 0
    order = np.sort(key)[::-1]
    if 0 < top_k < V:
        floor_key = int(order[top_k - 1])  # the k-th largest key; every tie at it is kept
    if top_p < 1.0:
        m = fixed_mass(x, mx, 1.0)
        keep = key >= floor_key
        z = int(m[keep].sum())
        if z > 0:
            target = top_p_target(top_p, z)
            # the largest key t with mass(key >= t, kept) >= target
            ks = np.unique(key[keep])[::-1]
            acc = 0
            for t in ks:
                acc += int(m[keep & (key == t)].sum())
                if acc >= target:
                    floor_key = int(t)
                    break
    if min_p > 0:
        floor_key = max(floor_key, int(float_key(np.array([mx + np.log(np.float32(min_p))],
                                                         dtype=np.float32))[0]))
    w = np.where(key >= floor_key, fixed_mass(x, mx, 1.0 / temperature), 0).astype(np.uint64)
    total = int(w.sum())
    if total == 0:
        return mx_i
    pick = min(int(u * total), total - 1)
    return int(np.searchsorted(np.cumsum(w), pick, side="right"))  # uint64 sums: exact


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--coarse", action="store_true",
                    help="the coarse first digit of benchmarks/attempts/sampler-coarse.patch")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    bad = 0
    settings = [(0.0, 0, 1.0, 0.0), (0.8, 40, 0.95, 0.05), (0.8, 0, 0.9, 0.0),
                (1.0, 1500, 1.0, 0.0), (0.8, 0, 1.0, 0.05), (1.5, 5, 0.5, 0.0),
                (0.8, 2000, 0.9, 0.0)]
    for row in range(args.rows):
        V = int(rng.choice([5, 37, 1000, 1025, 4099, 33333]))
        kind = row % 5
        x = rng.standard_normal(V).astype(np.float32)
        if kind == 0:
            x *= 2
            x[rng.choice(V, min(V, 20), replace=False)] += 10
        elif kind == 1:
            x = np.round(x * 2).astype(np.float32)  # ties everywhere
        elif kind == 2:
            x *= 0.5  # flat
        elif kind == 3:
            x[-min(V, 7):] += 9  # strong tokens in the last slice
        else:  # wide (most ids beyond the coarse digit's 31.75 below the max) and some -inf
            x *= 12
            x[rng.choice(V, max(1, V // 10), replace=False)] = -np.inf
        for temperature, top_k, top_p, min_p in settings:
            u = float(rng.random())
            ref = direct_sample(x, temperature, top_k, top_p, min_p, u)
            got = {nb: cluster_sample(x, nb, temperature, top_k, top_p, min_p, u, args.coarse)
                   for nb in (1, 2, 3, 4, 8, 16)}
            if len(set(got.values())) != 1 or ref not in got.values():
                bad += 1
                print(f"row {row} V={V} kind {kind} setting {(temperature, top_k, top_p, min_p)}"
                      f" u={u:.6f}: direct {ref}, by blocks {got}")
    print(f"{args.rows} rows x {len(settings)} settings x 6 block counts: "
          f"{'all agree' if bad == 0 else f'{bad} disagree'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
