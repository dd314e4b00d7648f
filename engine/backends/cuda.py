"""The CUDA backend: the C++ engine core (csrc/engine.h, torch.classes.nanoqwen.Engine) over our
kernels, with cuBLAS through ATen for the prefill GEMMs (and SDPA for long prompts' attention).

Python here loads weights, allocates every buffer once and keeps the cache bookkeeping
(kv_tokens, pages); it never sits on the hot path:
  * the decode step (embed_gather; per layer rmsnorm -> gemv_int4 q|k|v -> attention_decode
    (RoPE, K/V write, split-K attention) -> gemv_int4_residual o -> rmsnorm ->
    gemv_int4_silu_mul gate/up -> gemv_int4_residual down; rmsnorm -> gemv_fp16 lm_head ->
    sample_token -> advance_step) is enqueued by C++ (launch_step); graph mode replays ONE
    graph captured from that launcher, gated by a halt flag; eager mode calls the launcher;
  * the whole prefill (layer by layer: cuBLAS on fp16 weights kept resident or dequantized
    once per layer, or gemm_int4 on the INT4 weights themselves; attention_prefill over the
    pages, SDPA for chunks ending past NANOQWEN_PREFILL_ATTN_MAX) is one C++ call;
  * a C++ launcher thread keeps up to RUN_AHEAD steps queued; each sampled id lands in a
    pinned ring slot with a sequence number and the GPU's time; a stop id sets the halt flag
    on the device, so the steps queued after it do nothing (graph mode);
  * generate_chunks() wakes once per window (~30 ms), takes every id that landed and yields
    them as one list. Every call into the core that waits releases the GIL.
Tokens computed past a stop id are discarded by truncation, so `kv_tokens` is always exact
(base.py's invariant).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..build import load_extension
from ..config import KV_PAGE_SIZE, ModelConfig
from ..errors import NanoqwenError
from ..kv_cache import KVCache
from ..rope import rope_tables
from ..service import MODES, PREFILL_WEIGHTS
from ..spec import K_MAX, K_START, MAX_N, MIN_N, NGRAM_K_MIN, SPEC_MODES
from ..switches import read_switches
from ..synthetic import SyntheticWeights
from .base import Backend, ModelFileTensors, StepEvent

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# decode steps the launcher thread keeps queued beyond the last id the host took; the ring
# (csrc/engine.h kRingSize = 256) bounds it. Graph steps after a stop are gated off, so a deep
# queue costs nothing; eager steps after a stop still run, so eager queues less.
RUN_AHEAD = {"graph": 128, "eager": 48}
# the same for speculation's plain runs (base.py _spec_chunks), which stop as soon as the drafter
# matches: the device halts the run there itself (advance_step's n-gram watch), so a graph step
# queued past it costs only its gate, but the host's stop waits for each; an eager step already
# launched runs. So they queue just enough to keep the GPU busy while the host takes each id.
SPEC_RUN_AHEAD = {"graph": 3, "eager": 2}
MAX_STOP_IDS = 8       # csrc/engine.h kMaxStops
COLLECT_TIMEOUT_MS = 100.0  # longest wait inside the core before Python re-checks cancel
PREFILL_CHUNK = 2048   # prompt tokens per prefill chunk (bounds activation memory)
MAX_VERIFY = 16        # csrc/engine.h kMaxVerify: tokens of one verify step (forward_all)
assert K_MAX + 1 <= MAX_VERIFY, "a speculation step verifies the last token and K_MAX drafts"
# prompt lookup on the device (start_turn's spec; csrc/spec.cu): NgramDrafter's sizes
SPEC_DEVICE_SIZES = [K_START, NGRAM_K_MIN, K_MAX, MIN_N, MAX_N]


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


def _flatten(chunks) -> Iterator[StepEvent]:
    """The events of `chunks` one by one; closing this closes `chunks` at once (a generator
    expression would leave its cleanup -- stop the launcher, free pages -- to the collector)."""
    try:
        for chunk in chunks:
            yield from chunk
    finally:
        chunks.close()


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


class CudaBackend(Backend):
    name = "cuda"
    modes = MODES
    # speculation verifies its drafts with the engine's verify step (forward_all): up to
    # MAX_VERIFY tokens in one pass over the weights, each row's logits as a decode step's
    spec_modes = SPEC_MODES

    @property
    def spec_auto(self) -> str | None:
        """Prompt lookup where it runs inside the engine's loop (NANOQWEN_SPEC_DEVICE, the
        default): measured faster on screen than plain decoding in the app, greedy and with the
        app's sampler (benchmarks/RESULTS.md, sessions 37-38); the host loop (the switch off)
        was slower there, so "auto" then means none."""
        return "ngram" if self.switches.spec_device else None

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
        super().__init__(config, max_context)  # checks max_context against the model
        self.mode = mode
        self.device = torch.device(device) if device is not None else \
            torch.device("cuda", torch.cuda.current_device())
        self.device_name = torch.cuda.get_device_name(self.device)
        self.stream = torch.cuda.Stream(self.device)
        self._ops = torch.ops.nanoqwen
        self._gen_id = 0
        self._lock = threading.RLock()
        # the prefill's weights: "resident" fp16 copies (cuBLAS), "dequant" (one layer's fp16
        # copy at a time, cuBLAS; prompt chunks of at most switches.int4_max_m tokens, a next
        # turn, through gemm_int4 instead) or "int4" (gemm_int4 on the INT4 weights, no copy).
        # "auto": resident where it fits with room to spare, else dequant (at 512
        # tokens gemm_int4 is slower than dequant + cuBLAS: benchmarks/RESULTS.md, session 18),
        # else int4 where even one layer's copy does not fit
        if prefill_weights not in PREFILL_WEIGHTS:
            raise ValueError(f"prefill_weights={prefill_weights!r}: use "
                             + "|".join(PREFILL_WEIGHTS))
        need_dense = self._dense_bytes()
        if prefill_weights == "auto":
            free = torch.cuda.mem_get_info(self.device)[0]
            prefill_weights = "resident" \
                if free > 1.5 * (self._required_bytes() + need_dense) else "dequant" \
                if free >= self._required_bytes(scratch=True) else "int4"
        self._check_memory(need_dense if prefill_weights == "resident" else 0,
                           scratch=prefill_weights == "dequant")
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
        """Random weights made on the GPU (no file): for benchmarks and tests. The same
        tensors as `nanoqwen convert --synthetic` writes for (config, seed) (synthetic.py)."""
        weights = SyntheticWeights(config, seed, device=kw.get("device") or "cuda")
        return cls(config, weights, max_context=max_context, mode=mode, **kw)

    def _weight_bytes(self) -> int:
        from ..format import expected_tensors

        size = {"fp16": 2, "int32": 4}
        return sum(size[dt] * math.prod(shape) for dt, shape in expected_tensors(self.config).values())

    def _dense_bytes(self) -> int:
        c = self.config
        per_layer = sum(n * k for n, k in c.projection_shapes().values()) * 2
        return c.num_hidden_layers * per_layer

    def _required_bytes(self, scratch: bool = False) -> int:
        """Weights, KV cache, activations; `scratch`: two layers' fp16 copies ("dequant": the
        next layer is dequantized while the current one runs)."""
        c = self.config
        pages = math.ceil(self.max_context / KV_PAGE_SIZE)
        kv = 2 * c.num_hidden_layers * pages * KV_PAGE_SIZE * c.kv_size * 2
        per_layer_dense = 2 * sum(n * k for n, k in c.projection_shapes().values()) * 2 \
            if scratch else 0
        chunk = min(PREFILL_CHUNK, self.max_context)
        acts = chunk * (c.hidden_size * 12 + c.intermediate_size * 12 + c.vocab_size * 0) \
            + self.max_context * c.hidden_size * 4
        rope = pages * KV_PAGE_SIZE * c.head_dim * 4
        return self._weight_bytes() + kv + per_layer_dense + acts + rope + (64 << 20)

    def _check_memory(self, extra: int, scratch: bool = False) -> None:
        need = self._required_bytes(scratch) + extra
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
        # RoPE tables from the reference's angles (rope.py), built on the CPU and moved
        d = c.head_dim
        cos, sin = rope_tables(num_pages * KV_PAGE_SIZE, d, c.rope_theta)
        self.cos, self.sin = cos.to(dev), sin.to(dev)                        # [P, D/2]

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
        # attention_decode's splits a kv head (blocks: kv heads x splits): one block an SM for
        # the TMA kernel, two for the cp.async one (33 splits beat 66 with the TMA kernel from
        # 2048 cached tokens up and equal them below, where pps is min_pps: RESULTS.md, session 20)
        per_sm = 1 if self.switches.attn_tma else 2
        self.num_splits = max(1, min(num_pages, -(-per_sm * sms // c.num_key_value_heads)))
        self.ws_acc = torch.zeros(c.num_attention_heads, self.num_splits, d,
                                  dtype=torch.float32, device=dev)
        self.ws_ml = torch.zeros(c.num_attention_heads, self.num_splits, 2,
                                 dtype=torch.float32, device=dev)
        self._xn = torch.zeros(1, c.hidden_size, dtype=torch.float16, device=dev)
        # attention_decode's per-kv-head "last split merges" counters; it leaves them zero
        self.attn_counters = torch.zeros(c.num_key_value_heads, dtype=torch.int32, device=dev)
        # its minimum KV pages per split (NANOQWEN_ATTN_MIN_PPS), a launch argument: captured
        # into the graph once, fixed for this backend's lifetime
        self.attn_min_pps = self.switches.attn_min_pps
        # greedy until a generate() sets its own parameters
        self.params_f = torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float32, device=dev)
        self.params_i = torch.tensor([0, 0, 0, 0], dtype=torch.int64, device=dev)
        self.stops = i32(1 + MAX_STOP_IDS)   # the turn's stop ids: count, then ids
        if self.prefill_weights == "dequant":
            # two sets: the engine dequantizes the next layer into one on a side stream while
            # the current layer's GEMMs read the other (their contents are written per prefill)
            self._scratch = self._dequant_layer(self.layers[0], None) \
                + self._dequant_layer(self.layers[0], None)

    # --- the engine core -------------------------------------------------------------------------
    def core_args(self, n_layers: int | None = None) -> tuple[list, list, list, list[int]]:
        """(globals, layers, dense, ints) for torch.classes.nanoqwen.Engine, in the order
        csrc/bindings.cpp documents above the class: every buffer and weight of this backend
        (the first n_layers layers only, when given: tests build a core of one layer)."""
        c = self.config
        globals_ = [self.embed, self.norm, self.lm_head, self.hidden, self._xn, self.qkv,
                    self.attn, self.act, self.logits, self.work, self.ws_acc, self.ws_ml,
                    self.attn_counters, self.cos, self.sin, self.page_table, self.token_in,
                    self.pos, self.sampled, self.counter, self.ctx_tokens, self.params_f,
                    self.params_i, self.stops]
        layers = []
        for li, L in enumerate(self.layers[:n_layers]):
            layers += [L.ln1, L.ln2, L.qkv_qw, L.qkv_sc, L.qkv_b, L.o_qw, L.o_sc, L.gate_qw,
                       L.gate_sc, L.up_qw, L.up_sc, L.down_qw, L.down_sc, self.k_layers[li],
                       self.v_layers[li]]
        mode = {"dequant": 0, "resident": 1, "int4": 2}[self.prefill_weights]
        dense = [w for L in self.layers[:n_layers] for w in L.dense] if mode == 1 \
            else list(self._scratch) if mode == 0 else []
        ints = [c.hidden_size, c.intermediate_size, c.num_attention_heads,
                c.num_key_value_heads, c.head_dim, c.vocab_size,
                self.switches.int4_max_m,  # dequant weights: chunks this short via gemm_int4
                self.attn_min_pps, self.num_splits, mode, PREFILL_CHUNK,
                int(self.switches.attn_tma),  # csrc kAttnTma = 1, kAttnCpAsync = 0
                self.switches.prefill_attn_max,  # chunks ending at most here: attention_prefill
                int(self.switches.norm_fold)]  # the decode step's norms folded into its GEMVs
        return globals_, layers, dense, ints

    def _make_core(self) -> None:
        """torch.classes.nanoqwen.Engine over every buffer and weight (csrc/bindings.cpp checks
        each one's dtype, shape and device and says which is wrong)."""
        self.core = torch.classes.nanoqwen.Engine(*self.core_args(), float(self.config.rms_norm_eps),
                                                  self.stream.cuda_stream)

    def _capture(self) -> None:
        """Warm up eagerly once (module loading, shared-memory attributes) and capture one step
        (halt-gated where the driver allows: `self.gated`). Runs at load, when the cache is
        empty, so the warm-up's K/V write at position 0 is harmless."""
        self._make_core()
        self.token_in.zero_()
        self.pos.zero_()
        self.core.begin_turn([])
        self.core.run_step(False)
        self.stream.synchronize()
        self.gated = self.core.capture()
        self.capture_note = self.core.capture_note()
        self.stream.synchronize()
        self.pos.zero_()
        self.counter.zero_()

    def _run_step(self) -> None:
        """One decode step now (graph replay or eager launches), on the stream."""
        self.core.run_step(self._mode == "graph")

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        Backend.mode.fset(self, value)
        core = getattr(self, "core", None)
        if core is not None:  # a running turn's launcher takes it at its next step
            core.set_graph(value == "graph")

    def request_cancel(self) -> None:
        """Stop the running turn from any thread: the GPU's next gated step does nothing and the
        launcher stops; the generator then ends as cancelled (its cancel Event is set too)."""
        core = getattr(self, "core", None)
        if core is not None:
            core.cancel()

    # --- cache bookkeeping ----------------------------------------------------------------------
    def _truncate(self, n: int) -> None:
        self._gen_id += 1  # a suspended generate() must not append past a truncation
        self.cache.rollback(n)

    def _reserve(self, n_tokens: int) -> None:
        """Pages for positions 0..n_tokens-1, mirrored into the device page table."""
        pt = self._reserve_host(n_tokens)
        if pt:
            self.page_table[:len(pt)].copy_(torch.tensor(pt, dtype=torch.int32))
            self._pt_host[:len(pt)] = pt

    def _reserve_host(self, n_tokens: int) -> list[int]:
        """Pages for positions 0..n_tokens-1 in the host's bookkeeping; the page table's
        entries the device must get (its first len() entries; [] when it has them already)."""
        self.cache.reserve(n_tokens)
        pt = self.cache.page_table
        return list(pt) if pt != self._pt_host[:len(pt)] else []

    # --- prefill ----------------------------------------------------------------------------------
    def _prefill(self, tokens: list[int], pos0: int, sample: bool) -> None:
        """K/V of tokens at pos0.. into the cache, logits of the last one into self.logits; with
        `sample`, also sample + advance (ring slot = counter). One C++ call (GIL released) that
        only enqueues: layer by layer, the projections (cuBLAS on fp16 weights resident or
        dequantized per layer, or gemm_int4 on the INT4 weights), rope_kv_write into the decode
        pages, attention_prefill over the pages (a chunk whose context ends past
        NANOQWEN_PREFILL_ATTN_MAX: SDPA over gathered K/V), silu_mul. One token is a decode
        step (graph or eager, as the mode says)."""
        self._reserve(pos0 + len(tokens))
        self.core.prefill(torch.tensor(tokens, dtype=torch.int32), pos0, sample,
                          self._mode == "graph")

    # --- Backend primitives -------------------------------------------------------------------
    def _forward(self, tokens: list[int], pos: int) -> torch.Tensor:
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(self.stream), \
                torch.inference_mode():
            self._gen_id += 1  # any suspended generate() no longer owns the cache
            self.core.begin_turn([])  # waits for (and stops) a suspended turn's queued steps
            self.cache.rollback(pos)
            self._prefill(tokens, pos, sample=False)
            logits = self.logits.cpu()  # syncs the stream
            self.cache.length = pos + len(tokens)
        return logits.clone()  # a normal tensor, not an inference-mode one

    def forward_all(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append `tokens` (at most MAX_VERIFY); fp32 logits [T, V] of every one (CPU). The
        engine's verify step: each row is what a decode step at that position computes, bit
        for bit (csrc/engine.h launch_verify)."""
        tokens = self._checked_verify(tokens)
        return self._append(tokens, lambda t, pos: self._verify(
            t, pos, lambda ids, p, graph: self.core.verify(ids, p, graph).cpu()))

    def forward_all_argmax(self, tokens: Sequence[int]) -> list[int]:
        """forward_all's rows' argmax (lowest id on ties), found on the device: T ids come
        back instead of T x V logits."""
        tokens = self._checked_verify(tokens)
        return self._append(tokens, lambda t, pos: self._verify(
            t, pos, lambda ids, p, graph: self.core.verify(ids, p, graph).argmax(1).tolist()))

    samples_rows = True

    def forward_all_sample(self, tokens: Sequence[int], sampler) -> list[int]:
        """Backend.forward_all_sample on the device (the engine's verify_sample): the verify
        step, then row i drawn by the decode step's own sampler (sample_token) as the step at
        that position would draw it -- its penalty window the ctx_tokens the verify step wrote
        -- from Philox(a seed taken from `sampler`'s generator, i). T ids come back, not T x V
        logits, and no host sampler runs: speculation with a sampler costs the verify step and
        one sampler launch of T clusters (a fixed seed still gives a reproducible reply)."""
        tokens = self._checked_verify(tokens)
        _, pf, pi = self._sampler_values(sampler.params, sampler.draw_seed())
        return self._append(tokens, lambda t, pos: self._verify(
            t, pos, lambda ids, p, graph: self.core.verify_sample(ids, p, graph, pf, pi)))

    def _checked_verify(self, tokens: Sequence[int]) -> list[int]:
        tokens = self._checked(tokens)
        if len(tokens) > MAX_VERIFY:
            raise ValueError(f"forward_all takes at most {MAX_VERIFY} tokens on the CUDA engine "
                             f"(its verify step), got {len(tokens)}")
        return tokens

    def _verify(self, tokens: list[int], pos: int,
                run: Callable[[torch.Tensor, int, bool], object]):
        """The verify step at pos: K/V of tokens into the cache; returns run(ids, pos, graph),
        which calls the engine's verify (the device logits [T, V] are the engine's buffer:
        read on its stream, not kept) or verify_sample. Graph mode replays a graph of the
        verify step per token count (captured at its first use), eager mode launches it: as
        the decode step, eager vs graph is launch overhead and nothing else (the same kernels,
        bit for bit)."""
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(self.stream), \
                torch.inference_mode():
            self._gen_id += 1  # any suspended generate() no longer owns the cache
            self.core.begin_turn([])  # waits for (and stops) a suspended turn's queued steps
            self.cache.rollback(pos)
            self._reserve(pos + len(tokens))
            out = run(torch.tensor(tokens, dtype=torch.int32), pos, self._mode == "graph")
            self.cache.length = pos + len(tokens)
        return out.clone() if isinstance(out, torch.Tensor) else out  # not an inference tensor

    def forward_logits_gpu(self) -> torch.Tensor:
        """The device logits buffer of the last forward (tests)."""
        return self.logits

    def generate(self, new_tokens: Sequence[int], params, max_new_tokens: int,
                 stop_ids: frozenset[int] = frozenset(),
                 cancel: threading.Event | None = None) -> Iterator[StepEvent]:
        """See Backend.generate: same contract, GPU sampling, graph/eager decode. Per token
        (chunks of one); the app and the CLI take generate_chunks."""
        new_tokens = self.prepare_generate(new_tokens, params, max_new_tokens)
        chunks = self._chunks_gpu(new_tokens, params, max_new_tokens, frozenset(stop_ids),
                                  cancel, 0.0, 1)
        return _flatten(chunks)

    def generate_chunks(self, new_tokens: Sequence[int], params, max_new_tokens: int,
                        stop_ids: frozenset[int] = frozenset(),
                        cancel: threading.Event | None = None,
                        window_s: float = 0.03) -> Iterator[list[StepEvent]]:
        """See Backend.generate_chunks: the first id alone as soon as it lands, then every id
        that landed in each window_s, read from the pinned ring in one C++ wait (no GIL).
        Prompt lookup ("ngram") runs inside the engine's own loop (NANOQWEN_SPEC_DEVICE, on by
        default): every step drafts on the device, and a step with drafts is a verify step
        whose kept ids land in the ring like decode steps' (csrc/spec.cu); a draft model
        ("draft"), or prompt lookup with the switch off, is Backend's loop."""
        if self._spec is not None and not (self._spec == "ngram" and self.switches.spec_device):
            return Backend.generate_chunks(self, new_tokens, params, max_new_tokens, stop_ids,
                                           cancel, window_s)
        new_tokens = self.prepare_generate(new_tokens, params, max_new_tokens)
        return self._chunks_gpu(new_tokens, params, max_new_tokens, frozenset(stop_ids), cancel,
                                window_s, None,
                                spec=SPEC_DEVICE_SIZES if self._spec == "ngram" else None)

    spec_runs_plain = True

    def _plain_run(self, new_tokens: list[int], params, max_new_tokens: int,
                   stop_ids: frozenset[int], cancel: threading.Event | None,
                   until: Callable[[int], bool], seed: int, watch_n: int = 0,
                   first_run: bool = False) -> Iterator[list[StepEvent]]:
        """Backend._plain_run: a turn of the engine's own loop (start_turn, the GPU sampling
        and running ahead), each id taken as it lands, stopped when until() says so. With
        watch_n the step that samples that id also halts the turn on the device (the n-gram
        watch of advance_step, csrc/kernels.h: a scan of ctx_tokens), so the graph steps
        queued after it do nothing: no step runs past the drafter's match, however far
        ahead of the host the GPU is."""
        if not 0 <= watch_n <= 255:
            raise ValueError(f"watch_n={watch_n}: the device watches 0..255 ids")
        # With sampling and a fixed seed the reply must not depend on timing. Where the host
        # alone stops a run (no watch; eager steps launched before the device's halt) how many
        # steps are under way by then does, so the run then keeps only the ids up to the stop
        # (its drafts begin there; the steps past it are truncated away). Greedy ids are the
        # same wherever a run stops, so it keeps them all.
        exact = not params.greedy and params.seed >= 0
        watch = watch_n | (256 if first_run and watch_n else 0)   # bit 8: not at draw 0
        return self._chunks_gpu(new_tokens, params, max_new_tokens, stop_ids, cancel, 0.0, None,
                                until, SPEC_RUN_AHEAD[self._mode], seed, exact, watch)

    @staticmethod
    def _sampler_values(params, seed: int | None = None, watch: int = 0
                        ) -> tuple[int, list[float], list[int]]:
        """(the resolved seed, params_f, params_i) for start_turn; `seed` overrides params';
        `watch` is params_i[3], advance_step's n-gram watch (0: off)."""
        from ..ops import sampler_values

        if seed is None:
            seed = params.seed if params.seed >= 0 else int.from_bytes(os.urandom(8), "little")
        pf, pi = sampler_values(params, seed)
        pi[3] = watch
        return seed, [float(v) for v in pf], [int(v) for v in pi]   # List[float], List[int]

    def _chunks_gpu(self, new_tokens: list[int], params, max_new_tokens: int,
                    stop_ids: frozenset[int], cancel: threading.Event | None, window_s: float,
                    max_chunk: int | None, until: Callable[[int], bool] | None = None,
                    run_ahead: int | None = None, seed: int | None = None,
                    exact_stop: bool = False, watch: int = 0, spec: list[int] | None = None
                    ) -> Iterator[list[StepEvent]]:
        """The turn's ids as they land (generate / generate_chunks). With `until` (Backend.
        _plain_run), until(id) is called with every id in order; once it returns True the
        launcher stops, the steps already queued finish (graph steps are gated off), their
        ids are taken too (with `exact_stop`, not: the turn ends at that id) and the
        generator ends. With `spec` (start_turn's speculation sizes) the steps are the
        device's speculative steps: each lands 1..MAX_VERIFY ids, the turn's budget and
        stop ids are kept on the device, and spec_stats follows the device's figures."""
        if cancel is not None and cancel.is_set():
            return
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(stop_ids)} stop ids; the CUDA engine takes at most "
                             f"{MAX_STOP_IDS}")
        n0, t = len(self.kv_tokens), len(new_tokens)
        # decode steps: at most max_new_tokens - 1 (the last token is never forwarded) and no
        # position past the context; the turn yields at most steps_max + 1 tokens
        steps_max = max(0, min(max_new_tokens - 1, self.max_context - (n0 + t)))
        total = steps_max + 1
        graph = self._mode == "graph"
        with self._lock:
            self._gen_id += 1
            my_id = self._gen_id
            # The host's page bookkeeping first; the device gets the pages, the parameters and
            # the prompt in one C++ call that releases the GIL once (start_turn: each release
            # while the UI thread paints costs ~0.5 ms to get the GIL back), after a suspended
            # turn's launcher has stopped and its steps are done.
            self.cache.rollback(n0)
            pt = self._reserve_host(n0 + t + steps_max)
            seed, pf, pi = self._sampler_values(params, seed, watch)
            ids = torch.tensor(new_tokens, dtype=torch.int32)
            if spec:
                self.spec_stats = dict(drafted=0, accepted=0, verify_steps=0)
            try:   # (the engine's own device and stream)
                t0_ns = self.core.start_turn(sorted(stop_ids), pf, pi, pt, ids, n0, steps_max,
                                             graph, run_ahead or RUN_AHEAD["graph" if graph
                                                                           else "eager"],
                                             list(spec or []))
            except BaseException:
                if pt:   # which entries the device holds is not known now
                    self._pt_host = [-1] * len(self._pt_host)
                self.cache.rollback(n0)
                raise
            self.seed = seed
            if pt:
                self._pt_host[:len(pt)] = pt
        idx, prev_ns, stopped = 0, 0, False

        def take(ids: list[int], ts: list[int], chunk: list[StepEvent]) -> bool:
            """ids into chunk and the cache bookkeeping; True when the turn is over."""
            nonlocal idx, prev_ns, stopped
            for tok, t_ns in zip(ids, ts):
                if idx == 0:
                    step_ms = (t_ns - t0_ns) / 1e6  # prefill + first sample
                    self.kv_tokens.extend(new_tokens)
                else:
                    step_ms = (t_ns - prev_ns) / 1e6
                    self.kv_tokens.append(self._last)  # step idx forwarded token idx-1
                prev_ns, self._last = t_ns, tok
                chunk.append(StepEvent(tok, step_ms, idx == 0))
                idx += 1
                if until is not None and until(tok):
                    stopped = True
                    if exact_stop:
                        return True
                if (tok in stop_ids or idx == max_new_tokens
                        or len(self.kv_tokens) >= self.max_context):
                    return True
            return False

        try:
            while idx < total:
                if self._gen_id != my_id:
                    return  # a forward()/generate() took the cache over
                want = 1 if idx == 0 else min(max_chunk or total, total - idx)
                ids, ts, status = self.core.collect(idx, want, 0.0 if idx == 0 else window_s * 1e3,
                                                    COLLECT_TIMEOUT_MS)
                if status == 2:
                    raise NanoqwenError(f"the CUDA engine failed: {self.core.error()}")
                if not ids:
                    if status == 1 or (cancel is not None and cancel.is_set()):
                        return  # halted (a cancel): nothing more will land
                    continue
                chunk: list[StepEvent] = []
                done = take(ids, ts, chunk)
                if stopped and not done:
                    # until() said stop: no further launch, the queued steps finish; each of
                    # them forwarded its id and sampled the next, so their ids are kept too
                    self.core.finish()
                    if idx < total:
                        ids, ts, status = self.core.collect(idx, total - idx, 0.0, 0.0)
                        if status == 2:
                            raise NanoqwenError(f"the CUDA engine failed: {self.core.error()}")
                        take(ids, ts, chunk)
                    done = True
                self.cache.length = len(self.kv_tokens)
                if spec:
                    self._take_spec_stats()
                yield chunk
                if done or (cancel is not None and cancel.is_set()):
                    return
        finally:
            if self._gen_id == my_id:
                # steps queued past the end computed K/V nobody keeps (graph steps after a
                # stop are gated off): stop the launcher, wait, then free their pages
                self.core.finish()
                self.cache.rollback(len(self.kv_tokens))
                if spec:
                    self._take_spec_stats()

    def _take_spec_stats(self) -> None:
        """spec_stats from the device's figures of the running (or last) speculative turn."""
        d, a, v = self.core.spec_stats()
        self.spec_stats = dict(drafted=int(d), accepted=int(a), verify_steps=int(v))
