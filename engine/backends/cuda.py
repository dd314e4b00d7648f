"""The CUDA backend: our kernels (csrc/) for decode, cuBLAS through torch for prefill.

Decode step (batch 1), every launch on preallocated device buffers, so the same launches
run eagerly or as ONE captured CUDA graph (mode "graph" | "eager", switchable per token):
    embed_gather(token_in) -> hidden fp32
    per layer: rmsnorm -> gemv_int4 (fused q|k|v + bias) -> rope_kv_write (pages) ->
               paged_attention -> gemv_int4_residual (o_proj) -> rmsnorm ->
               gemv_int4_silu_mul (gate/up) -> gemv_int4_residual (down)
    rmsnorm -> gemv_fp16 (lm_head) -> sample_token -> advance_step
The step reads the position from device memory and `advance_step` writes the sampled id
into the next step's input, so the host never sits between steps: it replays the graph a
few steps ahead (LOOKAHEAD) and reads ids from a pinned ring buffer that advance_step
writes directly, after each step's CUDA event. Tokens computed past a stop id are discarded
by truncation, so `kv_tokens` is always exact (base.py's invariant).

Prefill (prompt chunks): layer by layer, each layer's INT4 weights dequantized to fp16 once
(or kept resident when memory allows), cuBLAS GEMMs through torch, our rope_kv_write into
the same pages the decode kernels read, and torch SDPA over the paged cache for attention.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..build import load_extension
from ..config import KV_PAGE_SIZE, ModelConfig
from ..errors import NanoqwenError
from ..kv_cache import KVCache
from ..switches import read_switches
from .base import Backend, ModelFileTensors, StepEvent

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LOOKAHEAD = 4          # decode steps the GPU may run ahead of the host
RING = 64              # pinned ring slots (> LOOKAHEAD + 1)
PREFILL_CHUNK = 2048   # prompt tokens per prefill chunk (bounds activation memory)


@dataclass
class _Layer:
    ln1: torch.Tensor        # fp16 [H]
    ln2: torch.Tensor        # fp16 [H]
    qkv_qw: torch.Tensor     # int32 [q+2kv, H/8]
    qkv_sc: torch.Tensor     # fp16 [q+2kv, H/128]
    qkv_b: torch.Tensor      # fp16 [q+2kv]
    o_qw: torch.Tensor
    o_sc: torch.Tensor
    gate_qw: torch.Tensor
    gate_sc: torch.Tensor
    up_qw: torch.Tensor
    up_sc: torch.Tensor
    down_qw: torch.Tensor
    down_sc: torch.Tensor
    dense: tuple | None = None  # resident fp16 (W_qkv, W_o, W_gate_up, W_down) for prefill


class SyntheticWeights(Mapping):
    """Random weights of any preset generated on the GPU on demand, in the file's naming:
    normal(0, 0.02) as transformers initialises, norms 1 + 0.1 N(0,1), projections quantized
    on the GPU (ops.quantize_int4_gpu, quant.py's layout). Each tensor has its own seed, so
    the model does not depend on the order of reads. No file, no CPU quantization."""

    def __init__(self, config: ModelConfig, seed: int = 0, device="cuda", std: float = 0.02):
        from ..format import expected_tensors

        self.config, self.seed, self.device, self.std = config, seed, torch.device(device), std
        self._names = expected_tensors(config)
        self._last = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        dtype, shape = self._names[name]
        g = torch.Generator(device=self.device)
        g.manual_seed((self.seed * 1_000_003 + sum(map(ord, name)) * 7919 + len(name)) % 2**62)
        if name.endswith(".scales"):
            return self._quantized(name.removesuffix(".scales"), g)[1]
        if name.endswith(".qweight"):
            return self._quantized(name.removesuffix(".qweight"), g)[0]
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            w = 1.0 + 0.1 * torch.randn(shape, generator=g, device=self.device)
        else:
            w = torch.randn(shape, generator=g, device=self.device) * self.std
        return w.to(torch.float16)

    def _quantized(self, base: str, g: torch.Generator):
        from ..ops import quantize_int4_gpu

        if self._last is not None and self._last[0] == base:  # .qweight then .scales
            return self._last[1]
        n, k8 = self._names[base + ".qweight"][1]
        g.manual_seed((self.seed * 1_000_003 + sum(map(ord, base)) * 7919 + len(base)) % 2**62)
        w = torch.randn(n, k8 * 8, generator=g, device=self.device) * self.std
        out = quantize_int4_gpu(w)
        self._last = (base, out)
        return out

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


class CudaBackend(Backend):
    name = "cuda"
    modes = ("graph", "eager")

    def __init__(self, config: ModelConfig, tensors: Mapping[str, torch.Tensor],
                 max_context: int | None = None, mode: str = "graph",
                 device: str | torch.device | None = None, prefill_weights: str = "auto",
                 progress: Callable[[int, int], None] | None = None) -> None:
        # the measurement switches first: a bad value is a SwitchError (a user error) here,
        # not a default silently measured; the kernels get attn_min_pps as an argument (and
        # read NANOQWEN_PDL themselves)
        self.switches = read_switches()
        load_extension()  # BackendUnavailable with the reason when it cannot build/run
        if max_context is None:
            max_context = config.max_position_embeddings
        if max_context > config.max_position_embeddings:
            raise ValueError(f"max_context={max_context} exceeds the model's "
                             f"max_position_embeddings={config.max_position_embeddings}")
        super().__init__(config, max_context)
        self.mode = mode
        self.device = torch.device(device) if device is not None else \
            torch.device("cuda", torch.cuda.current_device())
        self.device_name = torch.cuda.get_device_name(self.device)
        self.stream = torch.cuda.Stream(self.device)
        self._ops = torch.ops.nanoqwen
        self._gen_id = 0
        self._lock = threading.RLock()
        need_dense = self._dense_bytes()
        self._check_memory(need_dense if prefill_weights == "resident" else 0)
        if prefill_weights == "auto":
            free = torch.cuda.mem_get_info(self.device)[0]
            prefill_weights = "resident" if free > 1.5 * (self._required_bytes() + need_dense) \
                else "dequant"
        if prefill_weights not in ("resident", "dequant"):
            raise ValueError(f"prefill_weights={prefill_weights!r}: use auto|resident|dequant")
        self.prefill_weights = prefill_weights
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream), \
                    torch.inference_mode():
                self._load(tensors, progress)
                self._alloc()
                self.stream.synchronize()
                self._capture()
        except torch.cuda.OutOfMemoryError as e:
            free, total = torch.cuda.mem_get_info(self.device)
            raise NanoqwenError(
                f"out of GPU memory loading {config.name}: needs about "
                f"{_gib(self._required_bytes())} ({self.prefill_weights} prefill weights), "
                f"{_gib(free)} of {_gib(total)} free on {self.device_name}; "
                f"try a smaller max_context") from e

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_model_file(cls, mf, max_context: int | None = None, mode: str = "graph",
                        progress: Callable[[int, int], None] | None = None,
                        **kw) -> "CudaBackend":
        return cls(mf.config, ModelFileTensors(mf), max_context=max_context, mode=mode,
                   progress=progress, **kw)

    @classmethod
    def synthetic(cls, config: ModelConfig, seed: int = 0, max_context: int | None = None,
                  mode: str = "graph", **kw) -> "CudaBackend":
        """Random weights made on the GPU (no file): for benchmarks and tests."""
        return cls(config, SyntheticWeights(config, seed), max_context=max_context, mode=mode,
                   **kw)

    def _weight_bytes(self) -> int:
        from ..format import expected_tensors

        size = {"fp16": 2, "int32": 4}
        return sum(size[dt] * math.prod(shape) for dt, shape in expected_tensors(self.config).values())

    def _dense_bytes(self) -> int:
        c = self.config
        per_layer = sum(n * k for n, k in c.projection_shapes().values()) * 2
        return c.num_hidden_layers * per_layer

    def _required_bytes(self) -> int:
        c = self.config
        pages = math.ceil(self.max_context / KV_PAGE_SIZE)
        kv = 2 * c.num_hidden_layers * pages * KV_PAGE_SIZE * c.kv_size * 2
        per_layer_dense = sum(n * k for n, k in c.projection_shapes().values()) * 2
        chunk = min(PREFILL_CHUNK, self.max_context)
        acts = chunk * (c.hidden_size * 12 + c.intermediate_size * 12 + c.vocab_size * 0) \
            + self.max_context * c.hidden_size * 4
        rope = pages * KV_PAGE_SIZE * c.head_dim * 4
        return self._weight_bytes() + kv + per_layer_dense + acts + rope + (64 << 20)

    def _check_memory(self, extra: int) -> None:
        need = self._required_bytes() + extra
        free, total = torch.cuda.mem_get_info(self.device)
        if need > free:
            raise NanoqwenError(
                f"not enough GPU memory for {self.config.name} with max_context="
                f"{self.max_context}: needs about {_gib(need)} (weights "
                f"{_gib(self._weight_bytes())}, KV cache and scratch the rest), only {_gib(free)} "
                f"of {_gib(total)} is free on {self.device_name}")

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """CPU (mmap) tensors go through pinned staging and an async copy on our stream."""
        if t.device == self.device:
            return t.contiguous()
        if t.device.type == "cpu":
            staged = t.contiguous().pin_memory()
            out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            out.copy_(staged, non_blocking=True)  # the caching host allocator keeps `staged`
            return out                            # alive until the copy's stream event
        return t.to(self.device).contiguous()

    def _load(self, tensors: Mapping[str, torch.Tensor], progress) -> None:
        c = self.config

        def get(name: str, dtype: torch.dtype) -> torch.Tensor:
            if name not in tensors:
                raise NanoqwenError(f"tensor {name!r} is missing")
            t = tensors[name]
            if t.dtype != dtype:
                raise NanoqwenError(f"tensor {name!r} is {t.dtype}, expected {dtype}")
            return self._upload(t)

        self.embed = get("model.embed_tokens.weight", torch.float16)        # [V, H]
        self.norm = get("model.norm.weight", torch.float16)                 # [H]
        self.lm_head = self.embed if c.tie_word_embeddings else \
            get("lm_head.weight", torch.float16)                            # [V, H]
        self.layers: list[_Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."

            def q(proj: str):
                return (get(p + proj + ".qweight", torch.int32),
                        get(p + proj + ".scales", torch.float16))

            (qw, qs), (kw, ks), (vw, vs) = (q("self_attn.q_proj"), q("self_attn.k_proj"),
                                            q("self_attn.v_proj"))
            bias = [get(p + f"self_attn.{n}_proj.bias", torch.float16) for n in "qkv"]
            layer = _Layer(
                ln1=get(p + "input_layernorm.weight", torch.float16),
                ln2=get(p + "post_attention_layernorm.weight", torch.float16),
                # one [q+2kv, H] matrix and one bias: a single GEMV launch per token
                qkv_qw=torch.cat([qw, kw, vw], 0), qkv_sc=torch.cat([qs, ks, vs], 0),
                qkv_b=torch.cat(bias, 0),
                o_qw=None, o_sc=None, gate_qw=None, gate_sc=None, up_qw=None, up_sc=None,
                down_qw=None, down_sc=None)
            layer.o_qw, layer.o_sc = q("self_attn.o_proj")
            layer.gate_qw, layer.gate_sc = q("mlp.gate_proj")
            layer.up_qw, layer.up_sc = q("mlp.up_proj")
            layer.down_qw, layer.down_sc = q("mlp.down_proj")
            del qw, kw, vw, qs, ks, vs, bias
            if self.prefill_weights == "resident":
                layer.dense = self._dequant_layer(layer, None)
            self.layers.append(layer)
            if progress is not None:
                progress(i + 1, c.num_hidden_layers)

    def _dequant_layer(self, L: _Layer, out: tuple | None) -> tuple:
        """fp16 (W_qkv [q+2kv, H], W_o [H, q], W_gate_up [2I, H], W_down [H, I])."""
        c = self.config
        I, H = c.intermediate_size, c.hidden_size
        if out is None:
            out = (torch.empty(c.q_size + 2 * c.kv_size, H, dtype=torch.float16, device=self.device),
                   torch.empty(H, c.q_size, dtype=torch.float16, device=self.device),
                   torch.empty(2 * I, H, dtype=torch.float16, device=self.device),
                   torch.empty(H, I, dtype=torch.float16, device=self.device))
        o = self._ops
        o.dequant_int4(out[0], L.qkv_qw, L.qkv_sc)
        o.dequant_int4(out[1], L.o_qw, L.o_sc)
        o.dequant_int4(out[2][:I], L.gate_qw, L.gate_sc)
        o.dequant_int4(out[2][I:], L.up_qw, L.up_sc)
        o.dequant_int4(out[3], L.down_qw, L.down_sc)
        return out

    def _alloc(self) -> None:
        c, dev = self.config, self.device
        self.cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                             self.max_context, torch.float16, dev)
        self.k_layers = [self.cache.k[i] for i in range(c.num_hidden_layers)]
        self.v_layers = [self.cache.v[i] for i in range(c.num_hidden_layers)]
        num_pages = self.cache.num_pages
        # the device page table always has num_pages entries (valid ids everywhere, so a read
        # past the used pages can never leave the cache); the kernels clamp the length by it
        self.page_table = torch.arange(num_pages, dtype=torch.int32, device=dev)
        self._pt_host: list[int] = list(range(num_pages))
        # RoPE tables exactly as the reference computes them (fp32 inv_freq x fp32 position)
        d = c.head_dim
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.arange(num_pages * KV_PAGE_SIZE).float()[:, None] * inv_freq[None, :]
        self.cos = freqs.cos().contiguous().to(dev)                          # [P, D/2]
        self.sin = freqs.sin().contiguous().to(dev)

        def i32(n: int = 1):
            return torch.zeros(n, dtype=torch.int32, device=dev)

        self.token_in, self.pos, self.sampled = i32(), i32(), i32()
        self.counter = torch.zeros(1, dtype=torch.int64, device=dev)
        self.ctx_tokens = i32(num_pages * KV_PAGE_SIZE + 1)
        self.hidden = torch.zeros(1, c.hidden_size, dtype=torch.float32, device=dev)
        self.qkv = torch.zeros(1, c.q_size + 2 * c.kv_size, dtype=torch.float16, device=dev)
        self.attn = torch.zeros(c.num_attention_heads, d, dtype=torch.float16, device=dev)
        self.act = torch.zeros(c.intermediate_size, dtype=torch.float16, device=dev)
        self.logits = torch.zeros(c.vocab_size, dtype=torch.float32, device=dev)
        self.work = torch.zeros(c.vocab_size, dtype=torch.float32, device=dev)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.num_splits = max(1, min(num_pages, -(-2 * sms // c.num_key_value_heads)))
        self.ws_acc = torch.zeros(c.num_attention_heads, self.num_splits, d,
                                  dtype=torch.float32, device=dev)
        self.ws_ml = torch.zeros(c.num_attention_heads, self.num_splits, 2,
                                 dtype=torch.float32, device=dev)
        # NANOQWEN_FUSE_NORM=1: norms inside the GEMV prologues (an A/B switch, see _launch_step)
        self._fuse_norm = self.switches.fuse_norm
        self._xn = torch.zeros(1, c.hidden_size, dtype=torch.float16, device=dev)
        # attention_decode's per-kv-head "last split merges" counters; it leaves them zero
        self.attn_counters = torch.zeros(c.num_key_value_heads, dtype=torch.int32, device=dev)
        # its minimum KV pages per split (NANOQWEN_ATTN_MIN_PPS), a launch argument: captured
        # into the graph once, fixed for this backend's lifetime
        self.attn_min_pps = self.switches.attn_min_pps
        # greedy until a generate() sets its own parameters
        self.params_f = torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float32, device=dev)
        self.params_i = torch.tensor([0, 0, 0, 0], dtype=torch.int64, device=dev)
        self.host_ring = torch.zeros(RING, dtype=torch.int32).pin_memory()
        if self.prefill_weights == "dequant":
            self._scratch = self._dequant_layer(self.layers[0], None)

    # --- the decode step ----------------------------------------------------------------------
    def _launch_step(self) -> None:
        """Every launch of one decode step, on the current stream (eager or under capture).

        Seven launches a layer: rmsnorm -> qkv GEMV -> attention_decode (RoPE, K/V write,
        split-K attention and the split merge in one) -> o GEMV into the residual -> rmsnorm ->
        gate/up GEMV with SiLU*mul -> down GEMV into the residual. Every kernel is launched
        with PDL (csrc/common.cuh), so each GEMV's weight fetch starts under the previous
        kernel's tail. NANOQWEN_FUSE_NORM=1 folds the norms into the GEMVs' prologues instead
        (five launches a layer); the H200 measured that 3.7% slower (benchmarks/RESULTS.md),
        so it is an A/B switch, not the default."""
        o, c = self._ops, self.config
        eps, xn = c.rms_norm_eps, self._xn
        o.embed_gather(self.hidden, self.embed, self.token_in)
        for li, L in enumerate(self.layers):
            if self._fuse_norm:
                o.gemv_int4_norm(self.qkv, self.hidden, L.ln1, eps, L.qkv_qw, L.qkv_sc, L.qkv_b)
            else:
                o.rmsnorm(xn, self.hidden, L.ln1, eps)
                o.gemv_int4(self.qkv, xn, L.qkv_qw, L.qkv_sc, L.qkv_b)
            o.attention_decode(self.attn, self.ws_acc, self.ws_ml, self.attn_counters, self.qkv,
                               self.k_layers[li], self.v_layers[li], self.cos, self.sin,
                               self.page_table, self.pos, self.attn_min_pps)
            o.gemv_int4_residual(self.hidden, self.attn, L.o_qw, L.o_sc)
            if self._fuse_norm:
                o.gemv_int4_silu_mul_norm(self.act, self.hidden, L.ln2, eps, L.gate_qw,
                                          L.gate_sc, L.up_qw, L.up_sc)
            else:
                o.rmsnorm(xn, self.hidden, L.ln2, eps)
                o.gemv_int4_silu_mul(self.act, xn, L.gate_qw, L.gate_sc, L.up_qw, L.up_sc)
            o.gemv_int4_residual(self.hidden, self.act, L.down_qw, L.down_sc)
        if self._fuse_norm:
            o.gemv_fp16_norm(self.logits, self.hidden, self.norm, eps, self.lm_head)
        else:
            o.rmsnorm(xn, self.hidden, self.norm, eps)
            o.gemv_fp16(self.logits, xn, self.lm_head)
        self._launch_sample()

    def _launch_sample(self) -> None:
        o = self._ops
        o.sample_token(self.sampled, self.work, self.logits, self.ctx_tokens, self.pos,
                       self.params_f, self.params_i, self.counter)
        o.advance_step(self.token_in, self.pos, self.ctx_tokens, self.counter, self.host_ring,
                       self.sampled)

    def _capture(self) -> None:
        """Warm up eagerly once (module loading, cuBLAS-free) and capture one step. Runs at
        load, when the cache is empty, so the warm-up's K/V write at position 0 is harmless."""
        self.token_in.zero_()
        self.pos.zero_()
        self._launch_step()
        self.stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream, capture_error_mode="relaxed"):
            self._launch_step()
        self.stream.synchronize()
        self.pos.zero_()
        self.counter.zero_()

    def _run_step(self) -> None:
        if self._mode == "graph":
            self.graph.replay()
        else:
            self._launch_step()

    # --- cache bookkeeping ----------------------------------------------------------------------
    def _truncate(self, n: int) -> None:
        self._gen_id += 1  # a suspended generate() must not append past a truncation
        self.cache.rollback(n)

    def _reserve(self, n_tokens: int) -> None:
        """Pages for positions 0..n_tokens-1, mirrored into the device page table."""
        self.cache.reserve(n_tokens)
        pt = self.cache.page_table
        if pt != self._pt_host[:len(pt)]:
            self.page_table[:len(pt)].copy_(torch.tensor(pt, dtype=torch.int32))
            self._pt_host[:len(pt)] = pt

    # --- prefill ----------------------------------------------------------------------------------
    def _prefill(self, tokens: list[int], pos0: int, sample: bool) -> None:
        """K/V of tokens at pos0.. into the cache, logits of the last one into self.logits; with
        `sample`, also sample + advance (ring slot = counter). Launches only (no host sync)."""
        c, o = self.config, self._ops
        t = len(tokens)
        self._reserve(pos0 + t)
        ids = torch.tensor(tokens, dtype=torch.int32).to(self.device, non_blocking=False)
        self.ctx_tokens[pos0:pos0 + t].copy_(ids)
        if t == 1:
            # one token is a decode step: the same kernels (graph or eager) as generate's loop.
            # Without `sample` the step still samples and advances; harmless, because every
            # forward/generate sets token_in, pos and the context ids it needs first.
            self.token_in.copy_(ids)
            self.pos.fill_(pos0)
            self._run_step()
            return
        nh, nkv, d, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        hidden = torch.empty(t, c.hidden_size, dtype=torch.float32, device=self.device)
        o.embed_gather(hidden, self.embed, ids)
        chunks = [(s, min(t, s + PREFILL_CHUNK)) for s in range(0, t, PREFILL_CHUNK)]
        pos_t = [torch.full((1,), pos0 + s, dtype=torch.int32, device=self.device)
                 for s, _ in chunks]
        for li, L in enumerate(self.layers):
            W_qkv, W_o, W_gu, W_d = L.dense if L.dense is not None else \
                self._dequant_layer(L, self._scratch)
            k_l, v_l = self.k_layers[li], self.v_layers[li]
            for (s, e), p_t in zip(chunks, pos_t):
                h = hidden[s:e]                                               # [Tc, H]
                tc = e - s
                xn = torch.empty(tc, c.hidden_size, dtype=torch.float16, device=self.device)
                o.rmsnorm(xn, h, L.ln1, eps)
                qkv = F.linear(xn, W_qkv, L.qkv_b)                            # [Tc, q+2kv]
                q = torch.empty(tc, nh, d, dtype=torch.float16, device=self.device)
                o.rope_kv_write(q, k_l, v_l, qkv, self.cos, self.sin, p_t, self.page_table)
                a = self._prefill_attention(q, k_l, v_l, pos0 + s, pos0 + e)  # [Tc, nh*d]
                h.add_(F.linear(a, W_o))
                o.rmsnorm(xn, h, L.ln2, eps)
                gu = F.linear(xn, W_gu)                                       # [Tc, 2I]
                g, u = gu.float().chunk(2, dim=-1)
                act = (F.silu(g) * u).to(torch.float16)   # fp32 math, one rounding, as the GEMV
                h.add_(F.linear(act, W_d))
        o.rmsnorm(self._xn, hidden[t - 1:], self.norm, eps)
        o.gemv_fp16(self.logits, self._xn, self.lm_head)
        if sample:
            self.pos.fill_(pos0 + t - 1)
            self._launch_sample()

    def _prefill_attention(self, q: torch.Tensor, k_l: torch.Tensor, v_l: torch.Tensor,
                           q0: int, q1: int) -> torch.Tensor:
        """Causal GQA attention of queries at positions q0..q1-1 over cached positions 0..q1-1."""
        c = self.config
        s = q1
        used = -(-s // KV_PAGE_SIZE)
        table = self.page_table[:used].long()
        shape = (used * KV_PAGE_SIZE, c.num_key_value_heads, c.head_dim)
        k = k_l.index_select(0, table).reshape(shape)[:s].permute(1, 0, 2).unsqueeze(0)
        v = v_l.index_select(0, table).reshape(shape)[:s].permute(1, 0, 2).unsqueeze(0)
        qq = q.permute(1, 0, 2).unsqueeze(0)                                   # [1, nh, Tc, D]
        if q0 == 0:
            out = F.scaled_dot_product_attention(qq, k, v, is_causal=True, enable_gqa=True)
        else:  # a cached prefix: query i sees keys 0..q0+i (bottom-right aligned causal mask)
            qpos = torch.arange(q0, q1, device=self.device)[:, None]
            mask = torch.arange(s, device=self.device)[None, :] <= qpos
            out = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, enable_gqa=True)
        return out[0].permute(1, 0, 2).reshape(q1 - q0, c.q_size)

    # --- Backend primitives -------------------------------------------------------------------
    def _forward(self, tokens: list[int], pos: int) -> torch.Tensor:
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(self.stream), \
                torch.inference_mode():
            self._gen_id += 1  # any suspended generate() no longer owns the cache
            self.cache.rollback(pos)
            self._prefill(tokens, pos, sample=False)
            logits = self.logits.cpu()  # syncs the stream
            self.cache.length = pos + len(tokens)
        return logits.clone()  # a normal tensor, not an inference-mode one

    def forward_logits_gpu(self) -> torch.Tensor:
        """The device logits buffer of the last forward (tests)."""
        return self.logits

    def generate(self, new_tokens: Sequence[int], params, max_new_tokens: int,
                 stop_ids: frozenset[int] = frozenset(),
                 cancel: threading.Event | None = None) -> Iterator[StepEvent]:
        """See Backend.generate: same contract, GPU sampling, graph/eager decode."""
        new_tokens = self.prepare_generate(new_tokens, params, max_new_tokens)
        return self._generate_gpu(new_tokens, params, max_new_tokens, frozenset(stop_ids), cancel)

    def _set_params(self, params) -> int:
        from ..ops import sampler_tensors

        seed = params.seed if params.seed >= 0 else int.from_bytes(os.urandom(8), "little")
        pf, pi = sampler_tensors(params, seed, "cpu")
        self.params_f.copy_(pf)
        self.params_i.copy_(pi)
        return seed

    def _generate_gpu(self, new_tokens: list[int], params, max_new_tokens: int,
                      stop_ids: frozenset[int], cancel: threading.Event | None
                      ) -> Iterator[StepEvent]:
        if cancel is not None and cancel.is_set():
            return
        n0, t = len(self.kv_tokens), len(new_tokens)
        # decode forwards: at most max_new_tokens - 1 (the last token is never forwarded) and
        # no position past the context
        steps_max = max(0, min(max_new_tokens - 1, self.max_context - (n0 + t)))
        with self._lock:
            self._gen_id += 1
            my_id = self._gen_id
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream), \
                    torch.inference_mode():
                self.cache.rollback(n0)
                self._reserve(n0 + t + steps_max)
                self.seed = self._set_params(params)
                self.counter.zero_()
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                try:
                    self._prefill(new_tokens, n0, sample=True)
                except BaseException:
                    self.cache.rollback(n0)
                    raise
                ends = [torch.cuda.Event(enable_timing=True)]
                ends[0].record(self.stream)
        launched = 0
        try:
            for idx in range(max_new_tokens):
                if self._gen_id != my_id:
                    return  # a forward()/generate() took the cache over
                with self._lock, torch.cuda.device(self.device), \
                        torch.cuda.stream(self.stream), torch.inference_mode():
                    # keep decode steps queued beyond the token we wait for; eager launches
                    # cost host time per step, so eager keeps a shorter queue
                    ahead = LOOKAHEAD if self._mode == "graph" else 2
                    while launched < min(steps_max, idx + ahead):
                        self._run_step()
                        ev = torch.cuda.Event(enable_timing=True)
                        ev.record(self.stream)
                        ends.append(ev)
                        launched += 1
                ends[idx].synchronize()  # releases the GIL; at most about one step
                with torch.inference_mode():  # host_ring is an inference-mode tensor
                    token = int(self.host_ring[idx % RING])
                if idx == 0:
                    step_ms = start.elapsed_time(ends[0])
                    self.kv_tokens.extend(new_tokens)
                else:
                    step_ms = ends[idx - 1].elapsed_time(ends[idx])
                    self.kv_tokens.append(self._last)  # step idx forwarded token idx-1
                self.cache.length = len(self.kv_tokens)
                self._last = token
                yield StepEvent(token, step_ms, idx == 0)
                if (token in stop_ids or idx + 1 == max_new_tokens
                        or len(self.kv_tokens) >= self.max_context
                        or (cancel is not None and cancel.is_set())):
                    return
        finally:
            if self._gen_id == my_id:
                # steps queued past the end computed K/V nobody keeps: wait for them, then
                # free their pages (the next turn overwrites their slots)
                self.stream.synchronize()
                self.cache.rollback(len(self.kv_tokens))
