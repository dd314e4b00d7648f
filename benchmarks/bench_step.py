"""Where a decode step's time goes: each op of the 7B step timed alone (a CUDA graph of 50
launches on the backend's own buffers, median of 7 replays), times its count per token,
against the whole captured step; also the alternatives (fused-norm GEMVs, the unfused
rope_kv_write + paged_attention pair).
NANOQWEN_PDL=0 in the environment launches without programmatic dependent launch (A/B).

    python benchmarks/bench_step.py [--preset 7b] [--context 512]

Synthetic random weights made on the GPU (CudaBackend.synthetic); the context is filled by a
prefill so attention reads a real cache. Per-op figures include each launch's own overhead
inside a graph, so their sum can exceed the step (no overlap between kernels of one token).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench_attention import time_graph


def main() -> None:
    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.config import ModelConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--context", type=int, default=512)
    a = ap.parse_args()
    cfg = ModelConfig.from_name(a.preset)
    be = CudaBackend.synthetic(cfg, max_context=a.context + 64)
    be.forward(list(range(1, a.context)))  # K/V for positions 0..context-2
    be.forward([5])                        # one decode step: pos = context - 1
    o = torch.ops.nanoqwen
    L0 = be.layers[0]
    nl = cfg.num_hidden_layers
    pos_val = int(be.pos)
    eps = cfg.rms_norm_eps

    layers = be.layers
    nh, d = cfg.num_attention_heads, cfg.head_dim
    xn = be._xn  # the step's normed-x buffer; a q buffer for the unfused attention pair:
    q = torch.zeros(1, nh, d, dtype=torch.float16, device=be.device)
    rows = [  # the step's launches (default: norms as their own launches), count per token
        ("embed_gather", 1, lambda i: o.embed_gather(be.hidden, be.embed, be.token_in)),
        ("rmsnorm", 2 * nl + 1, lambda i: o.rmsnorm(xn, be.hidden, layers[i % nl].ln1, eps)),
        ("gemv_int4 qkv", nl, lambda i: o.gemv_int4(
            be.qkv, xn, layers[i % nl].qkv_qw, layers[i % nl].qkv_sc, layers[i % nl].qkv_b)),
        ("attention_decode", nl, lambda i: o.attention_decode(
            be.attn, be.ws_acc, be.ws_ml, be.attn_counters, be.qkv, be.k_layers[i % nl],
            be.v_layers[i % nl], be.cos, be.sin, be.page_table, be.pos)),
        ("gemv_int4_residual o", nl, lambda i: o.gemv_int4_residual(
            be.hidden, be.attn, layers[i % nl].o_qw, layers[i % nl].o_sc)),
        ("gemv_int4_silu_mul", nl, lambda i: o.gemv_int4_silu_mul(
            be.act, xn, layers[i % nl].gate_qw, layers[i % nl].gate_sc, layers[i % nl].up_qw,
            layers[i % nl].up_sc)),
        ("gemv_int4_residual down", nl, lambda i: o.gemv_int4_residual(
            be.hidden, be.act, layers[i % nl].down_qw, layers[i % nl].down_sc)),
        ("gemv_fp16 lm_head", 1, lambda i: o.gemv_fp16(be.logits, xn, be.lm_head)),
        ("sample_token greedy", 1, lambda i: o.sample_token(
            be.sampled, be.work, be.logits, be.ctx_tokens, be.pos, be.params_f, be.params_i,
            be.counter)),
        ("advance_step", 1, lambda i: o.advance_step(
            be.token_in, be.pos, be.ctx_tokens, be.counter, be.host_ring, be.sampled)),
    ]
    sample_fn = rows[-2][2]
    other = [  # alternatives, timed the same way, not summed: the fused-norm GEMVs
        # (NANOQWEN_FUSE_NORM=1) and the session-1 pair attention_decode replaced
        ("(alt) gemv_int4_norm qkv", nl, lambda i: o.gemv_int4_norm(
            be.qkv, be.hidden, layers[i % nl].ln1, eps, layers[i % nl].qkv_qw,
            layers[i % nl].qkv_sc, layers[i % nl].qkv_b)),
        ("(alt) gemv_int4_silu_mul_norm", nl, lambda i: o.gemv_int4_silu_mul_norm(
            be.act, be.hidden, layers[i % nl].ln2, eps, layers[i % nl].gate_qw,
            layers[i % nl].gate_sc, layers[i % nl].up_qw, layers[i % nl].up_sc)),
        ("(alt) gemv_fp16_norm lm_head", 1, lambda i: o.gemv_fp16_norm(
            be.logits, be.hidden, be.norm, eps, be.lm_head)),
        ("(alt) rope_kv_write", nl, lambda i: o.rope_kv_write(
            q, be.k_layers[i % nl], be.v_layers[i % nl], be.qkv, be.cos, be.sin, be.pos,
            be.page_table)),
        ("(alt) paged_attention", nl, lambda i: o.paged_attention(
            be.attn, be.ws_acc, be.ws_ml, q[0], be.k_layers[i % nl], be.v_layers[i % nl],
            be.page_table, be.pos)),
    ]
    import os
    print(f"# {cfg.name} decode step at context {a.context}, {torch.cuda.get_device_name()}, "
          f"PDL {'off' if os.environ.get('NANOQWEN_PDL') == '0' else 'on'}")
    print("| op | us/launch | per token | us/token |")
    print("| --- | --- | --- | --- |")
    total = 0.0
    with torch.inference_mode():
        for name, count, fn in rows + other:
            us = time_graph(fn)
            be.pos.fill_(pos_val)
            if not name.startswith("(alt)"):
                total += us * count
            print(f"| {name} | {us:.2f} | {count} | {us * count:.1f} |")
        # the sampler with a full chain (temperature/top-k/top-p/min-p/penalty)
        saved = be.params_f.clone(), be.params_i.clone()
        be.params_f.copy_(torch.tensor([0.8, 0.95, 0.05, 1.1]))
        be.params_i.copy_(torch.tensor([40, 64, 1234, 0]))
        us = time_graph(sample_fn)
        print(f"| sample_token t=0.8 k=40 p=0.95 min_p=0.05 pen=1.1 | {us:.2f} | (1) | - |")
        be.params_f.copy_(torch.tensor([1.0, 0.9, 0.0, 1.0]))
        be.params_i.copy_(torch.tensor([0, 64, 1234, 0]))
        us = time_graph(sample_fn)
        print(f"| sample_token t=1 top-k off p=0.9 | {us:.2f} | (1) | - |")
        be.params_f.copy_(saved[0])
        be.params_i.copy_(saved[1])
        # the whole captured step (it advances pos; reset it before every replay)
        times = []
        for _ in range(9):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(be.stream):
                be.pos.fill_(pos_val)
                s.record(be.stream)
                be.graph.replay()
                e.record(be.stream)
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
    print(f"| sum of ops | | | {total:.1f} |")
    print(f"| whole step (graph replay) | | | {statistics.median(times):.1f} |")
    print(f"weights per token {cfg.decode_bytes_per_token() / 1e9:.2f} GB -> floor "
          f"{cfg.decode_bytes_per_token() / 4276e9 * 1e6:.0f} us at 4276 GB/s")


if __name__ == "__main__":
    main()
