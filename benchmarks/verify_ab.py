"""bench_verify.py JSON files side by side: the decode step, t(k) and t(k) / decode for a few k,
and the column GEMVs' times, each run against the first (the A of an A/B).

    python benchmarks/verify_ab.py [LABEL=]A.json [LABEL=]B.json ...

Every figure is the files' own (graph mode, medians of their --reps); the differences are
plain subtractions, so they carry both runs' noise: compare them with the A-again run's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KS = (1, 2, 4, 8, 16)
OPS = ("qkv", "o", "gate/up", "down", "lm_head")
COLS = (2, 8, 16)


def load(path: str) -> dict:
    d = json.loads(Path(path).read_text())
    if d.get("bench") != "bench_verify":
        raise SystemExit(f"{path}: not a bench_verify.py JSON (bench={d.get('bench')!r})")
    return d


def figures(d: dict) -> dict[str, float]:
    out = {"decode ms": d["decode_graph_ms"]}
    rows = {r["k"]: r for r in d["rows"]}
    for k in KS:
        if k in rows:
            out[f"t({k}) ms"] = rows[k]["ms"]
            out[f"t({k}) / decode"] = rows[k]["vs_decode_graph"]
    cols = {(r["op"], r["cols"]): r["us_graph"] for r in d.get("gemv_columns") or []}
    for op in OPS:
        for c in COLS:
            if (op, c) in cols:
                out[f"{op} @{c} us"] = cols[op, c]
    return out


def main(paths: list[str]) -> None:
    if len(paths) < 2:
        raise SystemExit(__doc__)
    named = [p.split("=", 1) if "=" in p else (Path(p).stem, p) for p in paths]
    ds = [load(p) for _, p in named]
    runs = [(n, figures(d)) for (n, _), d in zip(named, ds)]
    print(f"# {ds[0]['preset']}, context {ds[0]['context']}, {ds[0]['device']}; "
          f"commits {', '.join(str(d.get('commit')) for d in ds)}")
    names = [n for n, _ in runs]
    w = max(18, *(len(n) + 2 for n in names))
    print(f"{'':22}" + "".join(f"{n:>{w}}" for n in names))
    base = runs[0][1]
    for key in base:
        cells = []
        for _, f in runs:
            v = f.get(key)
            if v is None:
                cells.append(f"{'-':>{w}}")
                continue
            ratio = key.endswith("/ decode")
            txt = f"{v:.3f}x" if ratio else f"{v:.3f}"
            if f is not base and not ratio:
                txt += f" ({v - base[key]:+.3f})"
            cells.append(f"{txt:>{w}}")
        print(f"{key:22}" + "".join(cells))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        sys.stderr.close()
