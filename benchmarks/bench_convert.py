"""The converter's peak memory and wall time on a synthetic Hugging Face checkpoint.

    python benchmarks/bench_convert.py --preset 1.5b --dir /tmp/hf-1.5b [--shards 4] [--keep]

writes a checkpoint of a preset's shapes (bf16, random N(0, 0.02) weights, config.json, sharded
with a model.safetensors.index.json as save_pretrained writes it; reused when --dir already holds
one), then runs `nanoqwen convert DIR -o DIR/out.nanoqwen` under `/usr/bin/time -v` and prints
one JSON object: the largest source tensor, the shard sizes, the peak RSS ("Maximum resident set
size": anonymous memory plus the file pages the process has mapped and touched), wall and CPU
seconds, page faults. `--python` runs another interpreter (e.g. an older checkout's).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def hf_names(cfg) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a ModelConfig, in save_pretrained's order."""
    h = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, (n, k) in cfg.projection_shapes().items():
            out[p + name + ".weight"] = (n, k)
        for name, n in (("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)):
            out[p + f"self_attn.{name}.bias"] = (n,)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def write_checkpoint(d: Path, preset: str, shards: int) -> None:
    from nanoqwen.engine.config import ModelConfig

    cfg = ModelConfig.from_name(preset)
    d.mkdir(parents=True, exist_ok=True)
    names = hf_names(cfg)
    total = sum(torch.Size(s).numel() * 2 for s in names.values())
    per_shard = total / shards
    g = torch.Generator().manual_seed(0)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in names.items():
        nbytes = torch.Size(shape).numel() * 2
        if size and size + nbytes > per_shard and len(groups) < shards:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    wmap = {}
    for j, group in enumerate(groups):
        fname = f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in group:
            t = torch.empty(names[name], dtype=torch.bfloat16)
            flat = t.view(t.shape[0], -1)
            for r in range(0, flat.shape[0], 4096):
                rows = flat[r:r + 4096]
                rows.copy_(torch.empty(rows.shape).normal_(0.0, 0.02, generator=g))
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            tensors[name] = t
            wmap[name] = fname
        save_file(tensors, d / fname, metadata={"format": "pt"})
        del tensors
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": wmap}, indent=2))
    hf = cfg.to_hf_config()
    hf.pop("head_dim")
    (d / "config.json").write_text(json.dumps(hf | {"torch_dtype": "bfloat16"}, indent=2))


def measure(d: Path, python: str) -> dict:
    out = d / "out.nanoqwen"
    cmd = ["/usr/bin/time", "-v", python, "-m", "nanoqwen.engine.cli", "convert", str(d),
           "-o", str(out)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"convert failed ({r.returncode}):\n{r.stderr[-3000:]}")

    def field(label: str) -> float:
        m = re.search(rf"{re.escape(label)}: ([\d.:]+)", r.stderr)
        return float(m[1]) if m else float("nan")

    shards = sorted(d.glob("model-*.safetensors"))
    from safetensors import safe_open
    largest = 0
    for s in shards:
        with safe_open(s, framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                largest = max(largest, torch.Size(sl.get_shape()).numel() * 2)
    return dict(checkpoint=str(d), shards=[s.stat().st_size for s in shards],
                largest_tensor_bytes=largest, output_bytes=out.stat().st_size,
                max_rss_kib=int(field("Maximum resident set size (kbytes)")),
                wall_s=round(wall, 1), user_s=field("User time (seconds)"),
                sys_s=field("System time (seconds)"),
                minor_faults=int(field("Minor (reclaiming a frame) page faults")),
                major_faults=int(field("Major (requiring I/O) page faults")),
                python=python, date=time.strftime("%Y-%m-%d"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1.5b")
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--keep", action="store_true", help="keep the converted file")
    args = ap.parse_args()
    if not (args.dir / "model.safetensors.index.json").is_file():
        write_checkpoint(args.dir, args.preset, args.shards)
    res = measure(args.dir, args.python)
    if not args.keep:
        (args.dir / "out.nanoqwen").unlink()
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
