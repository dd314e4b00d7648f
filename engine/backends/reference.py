"""The reference backend: a plain-PyTorch Qwen2 forward over the `.nanoqwen` weights.

It is the oracle for every CUDA kernel and the CPU fallback of the app, so it is written to
be read, not to be fast: one function per block, shapes beside each line, fp32 compute.
The INT4 projections are dequantized once at load (`quant.dequantize`) and held in `dtype`;
fp16 tensors (embeddings, norms, biases, lm_head) are upcast to `dtype` too.

Math, as Hugging Face's Qwen2ForCausalLM:
    x = embed[ids]
    per layer:  h = rmsnorm(x) ; q,k,v = h W^T + b ; RoPE(q, k) (rotate_half, theta from
                config) ; K/V into the paged cache ; causal GQA softmax(q k^T / sqrt(d)) v ;
                x += o_proj(attn) ; h = rmsnorm(x) ; x += down(silu(gate(h)) * up(h))
    logits = lm_head(rmsnorm(x))    (lm_head = embed when tied)
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..errors import NanoqwenError
from ..kv_cache import KVCache
from ..quant import dequantize
from ..rope import rope_freqs
from ..spec import SPEC_MODES
from .base import Backend, ModelFileTensors, StepEvent

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
CPU_MAX_CONTEXT = 4096  # the CPU fallback is for small models and short chats


class _ComputeThread:
    """The one thread that runs every CPU op of every ReferenceBackend in the process.

    PyTorch's CPU ops parallelise with OpenMP, and libgomp gives each thread that starts a
    parallel region a team of its own. Once libgomp manages more threads than there are CPUs
    (two callers' teams on 2 cores: the app's load worker and its generation worker, or a
    benchmark's main thread) its workers stop spinning between regions and sleep on a futex,
    and every op pays for waking them: measured on 2 cores, the bundled model's decode step
    went from 7.1 to 15-16 ms. Running all the work here keeps it to one team whoever calls.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def call(self, fn: Callable, *args):
        """fn(*args) on the compute thread (inline when already on it); its result or raise."""
        thread = self._thread
        if thread is threading.current_thread():
            return fn(*args)
        if thread is None:
            thread = self._start()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fut, fn, args))
        return fut.result()

    def _start(self) -> threading.Thread:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nanoqwen-cpu",
                                                daemon=True)
                self._thread.start()
            return self._thread

    def _run(self) -> None:
        while True:
            fut, fn, args = self._queue.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - raised in the caller
                    fut.set_exception(e)
            fut = fn = args = None  # hold no tensors while waiting for the next call

    def _after_fork(self) -> None:
        self.__init__()


_COMPUTE = _ComputeThread()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_COMPUTE._after_fork)


def set_cpu_threads(n: int | None) -> int:
    """OpenMP threads for the process's CPU work (the one compute thread's team, so every
    ReferenceBackend shares it); None keeps PyTorch's default (a thread per core). Returns
    the count now in force. Measured on 2 cores with the app running (bench_app, bundled
    model, 256 tokens; benchmarks/results/2026-12-03_app_cpu_tiny_threads{1,2}.json): a turn
    took 2.24 / 2.55 s (new chat / next turn) with 2 threads, 3.25 / 3.70 s with 1, so the
    default is all cores; on a machine another process keeps busy fewer can be faster."""
    if n is not None:
        cores = os.cpu_count() or 1
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cores:
            raise NanoqwenError(f"threads={n!r}: give a whole number from 1 to {cores} "
                                "(this machine's CPUs)")
        _COMPUTE.call(torch.set_num_threads, n)
    return _COMPUTE.call(torch.get_num_threads)


def _inline(fn: Callable, *args):
    return fn(*args)


@dataclass
class _Layer:
    ln1: torch.Tensor                 # [H]
    ln2: torch.Tensor                 # [H]
    w: dict[str, torch.Tensor]        # projection name -> W [N, K]
    bq: torch.Tensor                  # [q_size]
    bk: torch.Tensor                  # [kv_size]
    bv: torch.Tensor                  # [kv_size]


def _layer_list(L: _Layer) -> list[torch.Tensor]:
    """A layer's tensors in decoder_layer's order (LAYER_TENSORS)."""
    w = L.w
    return [L.ln1, L.ln2, w["self_attn.q_proj"], L.bq, w["self_attn.k_proj"], L.bk,
            w["self_attn.v_proj"], L.bv, w["self_attn.o_proj"], w["mlp.gate_proj"],
            w["mlp.up_proj"], w["mlp.down_proj"]]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> x / sqrt(mean(x^2) + eps) * weight, the variance taken in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for integer positions [T] (frequencies repeated twice, as HF)."""
    freqs = rope_freqs(positions, head_dim, theta)                   # [T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)                          # [T, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]: x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x[d/2:], x[:d/2])."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int) -> torch.Tensor:
    """Causal GQA attention.

    q [T, n_heads, d] at positions pos0..pos0+T-1; k, v [S, n_kv, d] at positions 0..S-1
    (S = pos0 + T). Query head h reads kv head h // (n_heads / n_kv), as HF's repeat_kv.
    Returns [T, n_heads * d].
    """
    t, n_heads, d = q.shape
    s, n_kv, _ = k.shape
    ratio = n_heads // n_kv
    k = k.repeat_interleave(ratio, dim=1)                            # [S, n_heads, d]
    v = v.repeat_interleave(ratio, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)       # [n_heads, T, S]
    q_pos = torch.arange(pos0, pos0 + t)[:, None]
    k_pos = torch.arange(s)[None, :]
    scores = scores.masked_fill((k_pos > q_pos).to(scores.device), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = torch.einsum("hts,shd->thd", probs, v)                     # [T, n_heads, d]
    return out.reshape(t, n_heads * d)


LAYER_TENSORS = ("ln1", "ln2", "wq", "bq", "wk", "bk", "wv", "bv", "wo", "wg", "wu", "wd")


def decoder_layer(x: torch.Tensor, w: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                  k_store: torch.Tensor, v_store: torch.Tensor, write_pages: torch.Tensor,
                  write_slots: torch.Tensor, read_pages: torch.Tensor, pos0: int, n_heads: int,
                  n_kv: int, head_dim: int, eps: float) -> torch.Tensor:
    """One Qwen2 layer over x [T, H] at positions pos0..; w: this layer's LAYER_TENSORS.

    K/V of the new positions go into this layer's pages of the paged cache (`k_store` [pages,
    16, n_kv, d], slot (write_pages[i], write_slots[i]) for position pos0 + i), as
    KVCache.write does; attention reads positions 0..pos0+T-1 from the pages `read_pages`,
    as KVCache.gather does.
    """
    t = x.shape[0]
    s = pos0 + t
    ln1, ln2, wq, bq, wk, bk, wv, bv = w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]
    wo, wg, wu, wd = w[8], w[9], w[10], w[11]
    h = rms_norm(x, ln1, eps)
    q = (h @ wq.T + bq).view(t, n_heads, head_dim)
    k = (h @ wk.T + bk).view(t, n_kv, head_dim)
    v = (h @ wv.T + bv).view(t, n_kv, head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_store[write_pages, write_slots] = k.to(k_store.dtype)
    v_store[write_pages, write_slots] = v.to(v_store.dtype)
    shape = [read_pages.shape[0] * k_store.shape[1], n_kv, head_dim]
    k_all = k_store.index_select(0, read_pages).reshape(shape)[:s]     # [S, n_kv, d]
    v_all = v_store.index_select(0, read_pages).reshape(shape)[:s]
    a = attention(q, k_all.to(x.dtype), v_all.to(x.dtype), pos0)       # [T, q_size]
    x = x + a @ wo.T
    h = rms_norm(x, ln2, eps)
    g = F.silu(h @ wg.T) * (h @ wu.T)
    return x + g @ wd.T


def forward_tokens(tokens: list[int], pos0: int, page_table: list[int], embed: torch.Tensor,
                   norm: torch.Tensor, lm_head: torch.Tensor, layers: list[list[torch.Tensor]],
                   k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int,
                   head_dim: int, rope_theta: float, eps: float, all_logits: bool
                   ) -> torch.Tensor:
    """The whole forward of `tokens` at positions pos0..: fp32 logits [T, V] (all_logits) or
    [1, V] (the last token). K/V are written into `k_cache`/`v_cache` [layers, pages, 16,
    n_kv, d] at the pages `page_table` maps the positions to (reserved by the caller)."""
    t = len(tokens)
    device = embed.device
    ids = torch.tensor(tokens, dtype=torch.int64, device=device)
    x = embed[ids]                                                     # [T, H]
    positions = torch.arange(pos0, pos0 + t)
    cos, sin = rope_cos_sin(positions, head_dim, rope_theta, embed.dtype)
    cos, sin = cos.to(device), sin.to(device)
    page = k_cache.shape[2]
    table = torch.tensor(page_table, dtype=torch.int64)
    write_pages = table[positions // page].to(device)
    write_slots = (positions % page).to(device)
    read_pages = table[:(pos0 + t + page - 1) // page].to(device)
    for li in range(len(layers)):
        x = decoder_layer(x, layers[li], cos, sin, k_cache[li], v_cache[li], write_pages,
                          write_slots, read_pages, pos0, n_heads, n_kv, head_dim, eps)
    if not all_logits:
        x = x[-1:]
    logits = rms_norm(x, norm, eps) @ lm_head.T                        # [T or 1, V]
    return logits.float().cpu()


def _scripted_forward():
    """`forward_tokens` compiled by TorchScript, or None where that is not available.

    Why: a TorchScript call runs the whole forward in C++ with the GIL released, while the
    Python function re-takes the GIL after each of its ~250 ops. Next to a busy UI thread
    (Textual renders in Python, holding the GIL) each re-take waits up to the interpreter's
    switch interval (5 ms): measured on 2 cores, a Python loop of small matmuls ran 250x
    slower beside a GIL-holding thread, the scripted loop 1.7x. Same aten ops, same order:
    the results are identical (the CPU fuser is off by default), and a test checks that.
    """
    global _SCRIPTED
    if _SCRIPTED is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # torch.jit.script is deprecated in torch 2.x
                _SCRIPTED = torch.jit.script(forward_tokens)
        except Exception:  # noqa: BLE001 - a torch without TorchScript: run the Python one
            _SCRIPTED = False
    return _SCRIPTED or None


_SCRIPTED = None


class ReferenceBackend(Backend):
    name = "reference"
    modes = ("eager",)
    spec_modes = SPEC_MODES   # verified with forward_all (the multi-token forward)
    # prompt lookup in the app on a 2-core CPU (bundled model, 256-token turns, medians of 5;
    # benchmarks/RESULTS.md, session 37): on screen, new chat / next turn, greedy 70.6 / 66.6
    # -> 113.9 / 149.9 tok/s, with the app's sampler 65.5 / 64.2 -> 68.8 / 92.2
    spec_auto = "ngram"

    def __init__(self, config: ModelConfig, tensors: Mapping[str, torch.Tensor],
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 max_context: int | None = None, kv_dtype: torch.dtype | None = None,
                 progress: Callable[[int, int, str], None] | None = None) -> None:
        device = torch.device(device)
        if max_context is None:
            max_context = config.max_position_embeddings
            if device.type == "cpu":
                max_context = min(max_context, CPU_MAX_CONTEXT)
        super().__init__(config, max_context)  # checks max_context against the model
        self.device, self.dtype = device, dtype
        self.device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else "cpu")
        # CPU work runs on the process's one compute thread (see _ComputeThread); on a CUDA
        # device the caller's thread keeps it (its current stream is thread-local).
        self._call = _COMPUTE.call if device.type == "cpu" else _inline
        self._cache_lock = threading.RLock()
        self._call(self._load, tensors, progress)
        self.cache = self._call(KVCache, config.num_hidden_layers, config.num_key_value_heads,
                                config.head_dim, max_context, kv_dtype or dtype, device)
        # CPU: the TorchScript forward (no GIL while it runs; _scripted_forward says why). On
        # a CUDA device the Python one, so the oracle runs exactly the ops it shows.
        scripted = _scripted_forward() if device.type == "cpu" else None
        self._forward_fn = scripted if scripted is not None else forward_tokens

    @classmethod
    def from_model_file(cls, mf, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, max_context: int | None = None,
                        progress: Callable[[int, int, str], None] | None = None
                        ) -> "ReferenceBackend":
        """From an open `format.ModelFile` (tensors are read lazily from its mmap)."""
        return cls(mf.config, ModelFileTensors(mf), device=device, dtype=dtype,
                   max_context=max_context, progress=progress)

    # --- weights ---------------------------------------------------------------------------
    def _load(self, tensors: Mapping[str, torch.Tensor],
              progress: Callable[[int, int, str], None] | None) -> None:
        # progress(done, total, what) as format.Progress, counted in layers here
        c = self.config

        def get(name: str) -> torch.Tensor:
            if name not in tensors:
                raise KeyError(f"tensor {name!r} is missing")
            return tensors[name].to(device=self.device, dtype=self.dtype)

        self.embed = get("model.embed_tokens.weight")                   # [V, H]
        self.norm = get("model.norm.weight")                            # [H]
        self.lm_head = self.embed if c.tie_word_embeddings else get("lm_head.weight")
        self.layers: list[_Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            w = {}
            for proj in PROJECTIONS:
                qweight, scales = tensors[p + proj + ".qweight"], tensors[p + proj + ".scales"]
                w[proj] = dequantize(qweight, scales, self.dtype).to(self.device)  # [N, K]
            self.layers.append(_Layer(
                ln1=get(p + "input_layernorm.weight"), ln2=get(p + "post_attention_layernorm.weight"),
                w=w, bq=get(p + "self_attn.q_proj.bias"), bk=get(p + "self_attn.k_proj.bias"),
                bv=get(p + "self_attn.v_proj.bias")))
            if progress is not None:
                progress(i + 1, c.num_hidden_layers, f"layer {i}")

    # --- forward ---------------------------------------------------------------------------
    def forward_all(self, tokens) -> torch.Tensor:
        """Like forward() but returns fp32 logits of every token, [T, V] (for tests/oracles)."""
        tokens = self._checked(tokens)
        return self._append(tokens, lambda t, pos: self._call(self._run, t, pos, True))

    def _forward(self, tokens: list[int], pos: int) -> torch.Tensor:
        return self._call(self._run, tokens, pos, False)

    def _compute(self, fn: Callable, *args):
        return self._call(fn, *args)   # a speculation step is one call on the compute thread

    def _truncate(self, n: int) -> None:
        # No hop to the compute thread (it may be waiting for the GIL behind a busy UI); the
        # lock orders it after a forward still running for a caller that stopped waiting
        # (KeyboardInterrupt), so that forward cannot set the length back afterwards.
        with self._cache_lock:
            self.cache.rollback(n)

    def _generate(self, new_tokens: list[int], sampler, max_new_tokens: int,
                  stop_ids: frozenset[int], cancel: threading.Event | None
                  ) -> Iterator[StepEvent]:
        """Backend._generate with each step (forward + sample) as one call on the compute
        thread: one GIL hand-off each way per token instead of two, and the sampler's ops
        in the same OpenMP team. The same loop, so the same contract (docs/INTERFACES.md)."""
        if self._call is _inline:
            yield from super()._generate(new_tokens, sampler, max_new_tokens, stop_ids, cancel)
            return
        if cancel is not None and cancel.is_set():
            return

        def step(tokens: list[int]) -> tuple[int, float]:
            t0 = time.perf_counter()
            logits = self.forward(tokens)
            return sampler.sample(logits, self.kv_tokens), (time.perf_counter() - t0) * 1e3

        token, ms = self._call(step, new_tokens)
        for i in range(max_new_tokens):
            yield StepEvent(token, ms, i == 0)
            if (token in stop_ids or i + 1 == max_new_tokens
                    or len(self.kv_tokens) >= self.max_context
                    or (cancel is not None and cancel.is_set())):
                return
            token, ms = self._call(step, [token])   # forwarded only once the consumer asks

    @torch.inference_mode()
    def _run(self, tokens: list[int], pos0: int, all_logits: bool) -> torch.Tensor:
        with self._cache_lock:
            return self._run_locked(tokens, pos0, all_logits)

    def _run_locked(self, tokens: list[int], pos0: int, all_logits: bool) -> torch.Tensor:
        c = self.config
        t = len(tokens)
        self.cache.reserve(pos0 + t)
        fn = self._forward_fn
        logits = fn(tokens, pos0, self.cache.page_table, self.embed, self.norm, self.lm_head,
                    [_layer_list(L) for L in self.layers], self.cache.k, self.cache.v, c.num_attention_heads,
                    c.num_key_value_heads, c.head_dim, float(c.rope_theta),
                    float(c.rms_norm_eps), all_logits)
        self.cache.length = pos0 + t
        return logits if all_logits else logits[0]
