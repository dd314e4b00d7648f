"""Where a decode step's time goes: each op of the 7B step timed alone (a CUDA graph of 50
launches on the backend's own buffers, median of 7 replays), times its count per token,
against the whole captured step. With --alt, also the alternatives that left csrc/ (the
fused-norm GEMVs, the unfused rope_kv_write + paged_attention pair), from the lab library
(benchmarks/lab/lab.py; builds it first, ~25 s), on the same buffers.
NANOQWEN_PDL=0 in the environment launches without programmatic dependent launch (A/B);
NANOQWEN_NORM_FOLD=0 times the step with its norms as rmsnorm launches (the A/B of the fold).

    python benchmarks/bench_step.py [--preset 7b] [--context 512] [--alt]
                                    [--sampler-only] [--json FILE]

Synthetic random weights made on the GPU (CudaBackend.synthetic); the context is filled by a
prefill so attention reads a real cache. Per-op figures include each launch's own overhead
inside a graph, so their sum can exceed the step (no overlap between kernels of one token).
A second table times sample_token per sampler setting (greedy, the app default, top-k off with
top-p / min-p, large top-k), as the engine launches it and in one block, on the model's logits
and on a peaked row (bench_sampler); --sampler-only prints that table alone. --json FILE writes
both tables' rows (with date, device and commit): "ops" (name, us per launch, launches a token,
us a token, and the sum and the whole step), "rows" (the sampler's); --sampler-only writes
"rows" alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from bench_attention import time_graph


def main() -> None:
    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.config import ModelConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--alt", action="store_true",
                    help="also time the lab's alternatives (fused-norm GEMVs, paged_attention)")
    ap.add_argument("--sampler-only", action="store_true",
                    help="only the sample_token table (skips the step's ops)")
    ap.add_argument("--json", default=None, help="write the sample_token table's rows here")
    a = ap.parse_args()
    cfg = ModelConfig.from_name(a.preset)
    be = CudaBackend.synthetic(cfg, max_context=a.context + 64)
    be.forward(list(range(1, a.context)))  # K/V for positions 0..context-2
    be.forward([5])                        # one decode step: pos = context - 1
    o = torch.ops.nanoqwen
    if a.sampler_only:
        with torch.inference_mode():
            bench_sampler(be, o, a.json)
        return
    nl = cfg.num_hidden_layers
    pos_val = int(be.pos)
    eps = cfg.rms_norm_eps

    layers = be.layers
    nh, d = cfg.num_attention_heads, cfg.head_dim
    xn = be._xn  # the step's normed-x buffer; a q buffer for the unfused attention pair:
    q = torch.zeros(1, nh, d, dtype=torch.float16, device=be.device)
    ring = torch.zeros(256, 4, dtype=torch.int32).pin_memory()   # advance_step's own ring
    halt = torch.zeros(1, dtype=torch.int32).pin_memory()
    no_stops = torch.zeros(9, dtype=torch.int32, device=be.device)
    H = cfg.hidden_size
    parts = torch.zeros(H // 16, device=be.device)  # the folded norm's parts (the engine's own
    # buffer lives in C++); right for the step's hidden: embed_gather writes them first
    with torch.inference_mode():
        o.embed_gather(be.hidden, be.embed, be.token_in, parts[None])
    lm_head = ("gemv_fp16 lm_head", 1, lambda i: o.gemv_fp16(be.logits, xn, be.lm_head))
    tail = [
        ("sample_token greedy", 1, lambda i: o.sample_token(
            be.sampled, be.work, be.logits, be.ctx_tokens, be.pos, be.params_f, be.params_i,
            be.counter)),
        ("advance_step", 1, lambda i: o.advance_step(
            be.token_in, be.pos, be.ctx_tokens, be.counter, ring, be.sampled, no_stops, halt)),
    ]
    attention = ("attention_decode", nl, lambda i: o.attention_decode(
        be.attn, be.ws_acc, be.ws_ml, be.attn_counters, be.qkv, be.k_layers[i % nl],
        be.v_layers[i % nl], be.cos, be.sin, be.page_table, be.pos, be.attn_min_pps))
    if be.switches.norm_fold:  # the step's launches with the norms folded (the default)
        rows = [
            ("embed_gather (parts)", 1, lambda i: o.embed_gather(be.hidden, be.embed, be.token_in,
                                                                 parts[None])),
            ("gemv_int4_norm qkv", nl, lambda i: o.gemv_int4_norm(
                be.qkv[0], be.hidden[0], parts, layers[i % nl].ln1, eps, layers[i % nl].qkv_qw,
                layers[i % nl].qkv_sc, layers[i % nl].qkv_b)),
            attention,
            ("gemv_int4_residual o (parts)", nl, lambda i: o.gemv_int4_residual(
                be.hidden, be.attn.view(1, -1), layers[i % nl].o_qw, layers[i % nl].o_sc, parts)),
            ("gemv_int4_silu_mul_norm", nl, lambda i: o.gemv_int4_silu_mul_norm(
                be.act, be.hidden[0], parts, layers[i % nl].ln2, eps, layers[i % nl].gate_qw,
                layers[i % nl].gate_sc, layers[i % nl].up_qw, layers[i % nl].up_sc)),
            ("gemv_int4_residual down (parts)", nl, lambda i: o.gemv_int4_residual(
                be.hidden, be.act, layers[i % nl].down_qw, layers[i % nl].down_sc, parts)),
            ("rmsnorm (final)", 1, lambda i: o.rmsnorm(xn, be.hidden, be.norm, eps)),
            lm_head, *tail]
    else:  # NANOQWEN_NORM_FOLD=0: the norms as their own launches
        rows = [
            ("embed_gather", 1, lambda i: o.embed_gather(be.hidden, be.embed, be.token_in)),
            ("rmsnorm", 2 * nl + 1, lambda i: o.rmsnorm(xn, be.hidden, layers[i % nl].ln1, eps)),
            ("gemv_int4 qkv", nl, lambda i: o.gemv_int4(
                be.qkv, xn, layers[i % nl].qkv_qw, layers[i % nl].qkv_sc, layers[i % nl].qkv_b)),
            attention,
            ("gemv_int4_residual o", nl, lambda i: o.gemv_int4_residual(
                be.hidden, be.attn.view(1, -1), layers[i % nl].o_qw, layers[i % nl].o_sc)),
            ("gemv_int4_silu_mul", nl, lambda i: o.gemv_int4_silu_mul(
                be.act, xn, layers[i % nl].gate_qw, layers[i % nl].gate_sc, layers[i % nl].up_qw,
                layers[i % nl].up_sc)),
            ("gemv_int4_residual down", nl, lambda i: o.gemv_int4_residual(
                be.hidden, be.act, layers[i % nl].down_qw, layers[i % nl].down_sc)),
            lm_head, *tail]
    other = alternatives(be, q, eps) if a.alt else []
    import os
    print(f"# {cfg.name} decode step at context {a.context}, {torch.cuda.get_device_name()}, "
          f"PDL {'off' if os.environ.get('NANOQWEN_PDL') == '0' else 'on'}")
    print("| op | us/launch | per token | us/token |")
    print("| --- | --- | --- | --- |")
    total = 0.0
    ops = []
    with torch.inference_mode():
        for name, count, fn in rows + other:
            us = time_graph(fn)
            be.pos.fill_(pos_val)
            if not name.startswith("(alt"):
                total += us * count
            print(f"| {name} | {us:.2f} | {count} | {us * count:.1f} |")
            ops.append(dict(op=name, us_per_launch=us, per_token=count, us_per_token=us * count))
        # the whole captured step (it advances pos; reset it before every replay); a fresh
        # turn first, so the halt-gated graph runs its body
        be.core.begin_turn([])
        times = []
        for _ in range(9):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(be.stream):
                be.pos.fill_(pos_val)
                s.record(be.stream)
                be.core.run_step(True)
                e.record(be.stream)
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
    step_us = statistics.median(times)
    print(f"| sum of ops | | | {total:.1f} |")
    print(f"| whole step (graph replay) | | | {step_us:.1f} |")
    print(f"weights per token {cfg.decode_bytes_per_token() / 1e9:.2f} GB -> floor "
          f"{cfg.decode_bytes_per_token() / 4276e9 * 1e6:.0f} us at 4276 GB/s")
    step = dict(preset=a.preset, context=a.context, norm_fold=bool(be.switches.norm_fold),
                pdl=os.environ.get("NANOQWEN_PDL") != "0", ops=ops, sum_of_ops_us=total,
                whole_step_us=step_us, weights_gb=cfg.decode_bytes_per_token() / 1e9)
    with torch.inference_mode():
        bench_sampler(be, o, a.json, step)


def alternatives(be, q, eps) -> list:
    """(name, count, fn) rows for the lab's alternatives, timed like the step's ops, not summed:
    the fused-norm GEMVs (NANOQWEN_FUSE_NORM=1 until its removal) and the pair attention_decode
    replaced (rope_kv_write, still the prefill's op, + the lab's paged_attention)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "lab"))
    from lab import load, ptr, stream

    lab, o = load(), torch.ops.nanoqwen
    L, nl = be.layers, len(be.layers)
    H, V = be.hidden.shape[1], be.logits.shape[0]
    nh, d = be.attn.shape

    def nk(qw):  # an INT4 matrix's (n, k)
        return qw.shape[0], qw.shape[1] * 8

    def qkv_norm(i):
        w = L[i % nl]
        lab.call("gemv_int4_norm", ptr(be.qkv), ptr(be.hidden), ptr(w.ln1), eps, ptr(w.qkv_qw),
                 ptr(w.qkv_sc), ptr(w.qkv_b), *nk(w.qkv_qw), stream())

    def gate_up_norm(i):
        w = L[i % nl]
        lab.call("gemv_int4_silu_mul_norm", ptr(be.act), ptr(be.hidden), ptr(w.ln2), eps,
                 ptr(w.gate_qw), ptr(w.gate_sc), ptr(w.up_qw), ptr(w.up_sc), *nk(w.gate_qw),
                 stream())

    def lm_head_norm(i):
        lab.call("gemv_fp16_norm", ptr(be.logits), ptr(be.hidden), ptr(be.norm), eps,
                 ptr(be.lm_head), V, H, stream())

    def paged(i):
        kc, vc = be.k_layers[i % nl], be.v_layers[i % nl]
        lab.call("paged_attention", ptr(be.attn), ptr(be.ws_acc), ptr(be.ws_ml), ptr(q[0]),
                 ptr(kc), ptr(vc), ptr(be.page_table), be.page_table.numel(), ptr(be.pos), nh,
                 kc.shape[2], d, be.ws_acc.shape[1], d ** -0.5, stream())

    return [
        ("(alt, lab) gemv_int4_norm qkv", nl, qkv_norm),
        ("(alt, lab) gemv_int4_silu_mul_norm", nl, gate_up_norm),
        ("(alt, lab) gemv_fp16_norm lm_head", 1, lm_head_norm),
        ("(alt) rope_kv_write", nl, lambda i: o.rope_kv_write(
            q, be.k_layers[i % nl], be.v_layers[i % nl], be.qkv, be.cos, be.sin, be.pos,
            be.page_table)),
        ("(alt, lab) paged_attention", nl, paged),
    ]


def bench_sampler(be, o, json_path: str | None = None, step: dict | None = None) -> None:
    """sample_token alone (graph of 50 launches, median of 7 replays) per sampler setting, on
    the synthetic model's logits (random weights; "kept" shows how peaked they are) and on a
    peaked row like a real model's (50 tokens 14 nats above a 2-sigma bulk), as the engine
    launches it (the automatic cluster), as a cluster of 8 and in one block ("blocks" 1: the
    same code over the whole vocabulary read from L2, which is what one block streaming 152064
    logits costs).
    "kept" is the reference sampler's kept-set size. json_path: the table's rows, with the
    step's op table (`step`, from main) where given."""
    import json
    import time

    from nanoqwen.engine.bench import _commit
    from nanoqwen.engine.sampling import SamplerParams, _candidates

    V = be.logits.shape[0]
    g = torch.Generator(device=be.device).manual_seed(0)
    peaked = torch.randn(V, generator=g, device=be.device) * 2
    peaked[torch.randperm(V, generator=g, device=be.device)[:50]] += 14
    rows = [  # name, (temperature, top_k, top_p, min_p, repeat_penalty)
        ("greedy", (0.0, 0, 1.0, 0.0, 1.0)),
        ("app default: t 0.8, top-k 40, top-p 0.95, min-p 0.05", (0.8, 40, 0.95, 0.05, 1.0)),
        ("  + penalty 1.1 (the row of earlier sessions)", (0.8, 40, 0.95, 0.05, 1.1)),
        ("t 0.8, top-k off, top-p 0.9", (0.8, 0, 0.9, 0.0, 1.0)),
        ("t 0.8, top-k off, top-p 0.95, min-p 0.05", (0.8, 0, 0.95, 0.05, 1.0)),
        ("t 0.8, top-k 1000", (0.8, 1000, 0.95, 0.05, 1.0)),
        ("t 0.8, top-k 5000", (0.8, 5000, 0.95, 0.05, 1.0)),
        ("temperature alone (top-k off, top-p 1)", (0.8, 0, 1.0, 0.0, 1.0)),
    ]
    saved = be.params_f.clone(), be.params_i.clone()
    path = torch.zeros(1, dtype=torch.int32, device=be.device)
    print()
    table = []
    print("| sample_token | logits | kept | blocks | us/call |")
    print("| --- | --- | --- | --- | --- |")
    for label, logits in (("model", be.logits), ("peaked", peaked)):
        cpu = logits.float().cpu()
        for name, (t, k, p, mp, pen) in rows:
            be.params_f.copy_(torch.tensor([t, p, mp, pen]))
            be.params_i.copy_(torch.tensor([k, 64, 1234, 0]))
            kept = 1 if t <= 0 else len(_candidates(cpu, SamplerParams(
                temperature=t, top_k=k, top_p=p, min_p=mp))[1])  # penalty not applied here
            for blocks in (0, 8, 1):
                o.sample_token(be.sampled, be.work, logits, be.ctx_tokens, be.pos, be.params_f,
                               be.params_i, be.counter, path, blocks=blocks)
                n_blocks = int(path.item()) >> 8  # csrc/kernels.h kPathBlocksShift
                us = time_graph(lambda i, b=blocks: o.sample_token(
                    be.sampled, be.work, logits, be.ctx_tokens, be.pos, be.params_f,
                    be.params_i, be.counter, blocks=b))
                print(f"| {name} | {label} | {kept} | {n_blocks} | {us:.2f} |")
                table.append(dict(setting=name.strip(), logits=label, kept=kept,
                                  blocks_asked=blocks, blocks=n_blocks, us_per_call=us))
    be.params_f.copy_(saved[0])
    be.params_i.copy_(saved[1])
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(bench="bench_step" if step else "bench_step sample_token", vocab=V,
                           device=torch.cuda.get_device_name(), commit=_commit(),
                           date=time.strftime("%Y-%m-%d"), **(step or {}), rows=table),
                      f, indent=2)


if __name__ == "__main__":
    main()
