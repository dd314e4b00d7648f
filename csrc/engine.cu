// engine.cu -- the decode step launcher, its halt-gated CUDA graph and the launcher thread
// (engine.h says what each promises). Torch-free; compiles with plain nvcc.
#include "engine.h"

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "common.cuh"
#include "gemv.h"
#include "kernels.h"  // and the error convention: nq_fail, take_last_error

namespace nanoqwen {
namespace {

// The error convention (kernels.h): a failing launcher has recorded its own message; record()
// is for a raw CUDA call of this file (no inner message), wrap() adds the decode step's context
// (which layer, which op, the numbers) in front of the launcher's message. Both end in the CUDA
// error's name, as engine messages always have.
std::string vformat(const char* fmt, va_list ap) {
  char buf[512];
  vsnprintf(buf, sizeof(buf), fmt, ap);
  return buf;
}

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
cudaError_t record(cudaError_t e, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  const std::string what = vformat(fmt, ap);
  va_end(ap);
  return nq_fail(e, "%s: %s", what.c_str(), cudaGetErrorString(e));
}

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
cudaError_t wrap(cudaError_t e, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  const std::string what = vformat(fmt, ap);
  va_end(ap);
  const std::string inner = take_last_error();
  if (inner.empty()) return nq_fail(e, "%s: %s", what.c_str(), cudaGetErrorString(e));
  return nq_fail(e, "%s (%s): %s", what.c_str(), inner.c_str(), cudaGetErrorString(e));
}

#define NQ_TRY(call, ...)                                 \
  do {                                                    \
    const cudaError_t e_ = (call);                        \
    if (e_ != cudaSuccess) return wrap(e_, __VA_ARGS__);  \
  } while (0)

__global__ void stamp_kernel(uint64_t* out) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  *reinterpret_cast<volatile uint64_t*>(out) = t;
  __threadfence_system();
}

// First node of the gated graph: run the step body only while nobody has halted the turn.
__global__ void gate_kernel(cudaGraphConditionalHandle handle, const int32_t* halt) {
  const int h = *reinterpret_cast<const volatile int32_t*>(halt);
  cudaGraphSetConditional(handle, h == 0 ? 1u : 0u);
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

cudaError_t stamp_time(uint64_t* out, cudaStream_t stream) {
  stamp_kernel<<<1, 1, 0, stream>>>(out);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? e : record(e, "stamp_time: launch of the 1-thread stamp kernel");
}

cudaError_t launch_logits(const StepArgs& a, cudaStream_t s) {
  NQ_TRY(rmsnorm(a.xn, a.hidden, a.final_norm, 1, a.H, a.eps, s),
         "decode step, final rmsnorm (H=%d)", a.H);
  NQ_TRY(gemv_fp16(a.logits, a.xn, a.lm_head, a.vocab, a.H, 1, s),
         "decode step, lm_head gemv_fp16 (n=%d, k=%d)", a.vocab, a.H);
  return cudaSuccess;
}

cudaError_t launch_sample_advance(const StepArgs& a, cudaStream_t s) {
  NQ_TRY(sample_token(a.sampled, a.work, a.logits, a.vocab, a.ctx_tokens, a.ctx_capacity, a.pos,
                      a.params_f, a.params_i, a.counter, s),
         "decode step, sample_token (V=%d)", a.vocab);
  NQ_TRY(advance_step(a.token_in, a.pos, a.ctx_tokens, a.ctx_capacity, a.counter, a.ring,
                      a.ring_size, a.sampled, a.stops, a.halt, a.params_i, s),
         "decode step, advance_step (ring of %d)", a.ring_size);
  return cudaSuccess;
}

cudaError_t launch_step(const StepArgs& a, cudaStream_t s) {
  const int qkv_n = (a.n_heads + 2 * a.n_kv) * a.head_dim, q = a.n_heads * a.head_dim;
  const float scale = 1.0f / sqrtf((float)a.head_dim);
  // norm_parts non-null (the fold): each norm is formed by the GEMV after it from the parts the
  // kernel before it wrote (gemv.h); the parts buffer is rewritten only after its readers have
  // finished (every launch's outputs come after its griddep_wait, and the chain is one stream)
  float* const parts = a.norm_parts;
  NQ_TRY(embed_gather(a.hidden, a.embed, a.token_in, 1, a.H, a.vocab, s, parts),
         "decode step, embed_gather (H=%d, V=%d)", a.H, a.vocab);
  for (int li = 0; li < (int)a.layers.size(); ++li) {
    const LayerPtrs& L = a.layers[li];
    if (parts) {
      NQ_TRY(gemv_int4_norm(a.qkv, a.hidden, parts, L.ln1, a.eps, L.qkv_qw, L.qkv_sc, L.qkv_b,
                            qkv_n, a.H, s),
             "decode step, layer %d, qkv gemv_int4_norm", li);
    } else {
      NQ_TRY(rmsnorm(a.xn, a.hidden, L.ln1, 1, a.H, a.eps, s), "decode step, layer %d, rmsnorm 1",
             li);
      NQ_TRY(gemv_int4(a.qkv, a.xn, L.qkv_qw, L.qkv_sc, L.qkv_b, qkv_n, a.H, 1, s),
             "decode step, layer %d, qkv gemv_int4", li);
    }
    NQ_TRY(attention_decode(a.attn, a.ws_acc, a.ws_ml, a.attn_counters, a.qkv, L.k_cache,
                            L.v_cache, a.cos, a.sin, a.page_table, a.table_len, a.pos, a.n_heads,
                            a.n_kv, a.head_dim, a.num_splits, a.min_pps, a.attn_kernel, scale, s),
           "decode step, layer %d, attention_decode (heads %d/%d, d=%d, splits %d, min_pps %d, "
           "kernel %d)",
           li, a.n_heads, a.n_kv, a.head_dim, a.num_splits, a.min_pps, a.attn_kernel);
    if (parts) {
      NQ_TRY(gemv_int4_residual_parts(a.hidden, parts, a.attn, L.o_qw, L.o_sc, a.H, q, s),
             "decode step, layer %d, o gemv_int4_residual_parts", li);
      NQ_TRY(gemv_int4_silu_mul_norm(a.act, a.hidden, parts, L.ln2, a.eps, L.gate_qw, L.gate_sc,
                                     L.up_qw, L.up_sc, a.I, a.H, s),
             "decode step, layer %d, gate/up gemv_int4_silu_mul_norm", li);
      NQ_TRY(gemv_int4_residual_parts(a.hidden, parts, a.act, L.down_qw, L.down_sc, a.H, a.I, s),
             "decode step, layer %d, down gemv_int4_residual_parts", li);
    } else {
      NQ_TRY(gemv_int4_residual(a.hidden, a.attn, L.o_qw, L.o_sc, a.H, q, 1, s),
             "decode step, layer %d, o gemv_int4_residual", li);
      NQ_TRY(rmsnorm(a.xn, a.hidden, L.ln2, 1, a.H, a.eps, s), "decode step, layer %d, rmsnorm 2",
             li);
      NQ_TRY(gemv_int4_silu_mul(a.act, a.xn, L.gate_qw, L.gate_sc, L.up_qw, L.up_sc, a.I, a.H, 1,
                                s),
             "decode step, layer %d, gate/up gemv_int4_silu_mul", li);
      NQ_TRY(gemv_int4_residual(a.hidden, a.act, L.down_qw, L.down_sc, a.H, a.I, 1, s),
             "decode step, layer %d, down gemv_int4_residual", li);
    }
  }
  const cudaError_t e = launch_logits(a, s);
  return e != cudaSuccess ? e : launch_sample_advance(a, s);
}

cudaError_t launch_verify(const StepArgs& a, const VerifyArgs& v, int T, cudaStream_t s) {
  if (T < 1 || T > kMaxVerify)
    return nq_fail(cudaErrorInvalidValue, "verify step: T=%d tokens, 1..%d", T, kMaxVerify);
  const int qkv_n = (a.n_heads + 2 * a.n_kv) * a.head_dim, q = a.n_heads * a.head_dim;
  const float scale = 1.0f / sqrtf((float)a.head_dim);
  NQ_TRY(embed_gather(v.hidden, a.embed, v.ids, T, a.H, a.vocab, s),
         "verify step (T=%d), embed_gather (H=%d, V=%d)", T, a.H, a.vocab);
  for (int li = 0; li < (int)a.layers.size(); ++li) {
    const LayerPtrs& L = a.layers[li];
    NQ_TRY(rmsnorm(v.xn, v.hidden, L.ln1, T, a.H, a.eps, s),
           "verify step (T=%d), layer %d, rmsnorm 1", T, li);
    NQ_TRY(gemv_int4(v.qkv, v.xn, L.qkv_qw, L.qkv_sc, L.qkv_b, qkv_n, a.H, T, s),
           "verify step (T=%d), layer %d, qkv gemv_int4", T, li);
    NQ_TRY(attention_verify(v.attn, v.ws_acc, v.ws_ml, v.attn_counters, v.qkv, L.k_cache,
                            L.v_cache, a.cos, a.sin, a.page_table, a.table_len, v.pos, T,
                            a.n_heads, a.n_kv, a.head_dim, a.num_splits, a.min_pps,
                            a.attn_kernel, scale, s),
           "verify step (T=%d), layer %d, attention_verify (heads %d/%d, d=%d, splits %d)",
           T, li, a.n_heads, a.n_kv, a.head_dim, a.num_splits);
    NQ_TRY(gemv_int4_residual(v.hidden, v.attn, L.o_qw, L.o_sc, a.H, q, T, s),
           "verify step (T=%d), layer %d, o gemv_int4_residual", T, li);
    NQ_TRY(rmsnorm(v.xn, v.hidden, L.ln2, T, a.H, a.eps, s),
           "verify step (T=%d), layer %d, rmsnorm 2", T, li);
    NQ_TRY(gemv_int4_silu_mul(v.act, v.xn, L.gate_qw, L.gate_sc, L.up_qw, L.up_sc, a.I, a.H, T, s),
           "verify step (T=%d), layer %d, gate/up gemv_int4_silu_mul", T, li);
    NQ_TRY(gemv_int4_residual(v.hidden, v.act, L.down_qw, L.down_sc, a.H, a.I, T, s),
           "verify step (T=%d), layer %d, down gemv_int4_residual", T, li);
  }
  NQ_TRY(rmsnorm(v.xn, v.hidden, a.final_norm, T, a.H, a.eps, s),
         "verify step (T=%d), final rmsnorm (H=%d)", T, a.H);
  NQ_TRY(gemv_fp16(v.logits, v.xn, a.lm_head, a.vocab, a.H, T, s),
         "verify step (T=%d), lm_head gemv_fp16 (n=%d, k=%d)", T, a.vocab, a.H);
  return cudaSuccess;
}

cudaError_t launch_spec_verify(const StepArgs& a, const SpecArgs& sp, int T, cudaStream_t s) {
  if (T < 2 || T > kMaxVerify)
    return nq_fail(cudaErrorInvalidValue, "speculative verify step: T=%d ids, 2..%d", T,
                   kMaxVerify);
  NQ_TRY(launch_verify(a, sp.v, T, s), "speculative step (T=%d)", T);
  NQ_TRY(sample_token(sp.row_ids, sp.row_work, sp.v.logits, a.vocab, a.ctx_tokens, a.ctx_capacity,
                      sp.row_pos, a.params_f, a.params_i, sp.row_counter, s, nullptr, 0, T),
         "speculative step (T=%d), sample_token of its rows (V=%d)", T, a.vocab);
  NQ_TRY(spec_accept(sp.v.ids, sp.row_ids, a.token_in, a.pos, a.ctx_tokens, a.ctx_capacity,
                     a.counter, sp.state, sp.host, a.ring, a.ring_size, a.stops, a.halt, s),
         "speculative step (T=%d), spec_accept", T);
  return cudaSuccess;
}

cudaError_t capture_verify(const StepArgs& a, const VerifyArgs& v, int T, cudaStream_t s,
                           cudaGraphExec_t* out) {
  *out = nullptr;
  cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed);
  if (e != cudaSuccess) return record(e, "capture_verify: cudaStreamBeginCapture (T=%d)", T);
  const cudaError_t le = launch_verify(a, v, T, s);
  const std::string msg = take_last_error();
  cudaGraph_t g = nullptr;
  e = cudaStreamEndCapture(s, &g);
  if (le != cudaSuccess) {
    if (g) cudaGraphDestroy(g);
    return nq_fail(le, "capture_verify (T=%d): %s", T, msg.c_str());
  }
  if (e != cudaSuccess) return record(e, "capture_verify: cudaStreamEndCapture (T=%d)", T);
  e = cudaGraphInstantiate(out, g, 0);
  cudaGraphDestroy(g);
  if (e != cudaSuccess) {
    *out = nullptr;
    return record(e, "capture_verify: cudaGraphInstantiate (T=%d)", T);
  }
  return cudaSuccess;
}

// ---- DecodeLoop ---------------------------------------------------------------------------------

DecodeLoop::DecodeLoop(StepArgs* a, cudaStream_t stream, int device)
    : a_(a), stream_(stream), device_(device) {
  // mapped pinned memory: the GPU writes the ring and reads/writes halt through these pointers
  // (with unified addressing the device alias is the host address; asked for explicitly below)
  void* p = nullptr;
  const size_t ring_bytes = sizeof(int32_t) * 4 * kRingSize + 64;
  if (const cudaError_t e = cudaHostAlloc(&p, ring_bytes, cudaHostAllocMapped)) {
    (void)cudaGetLastError();
    record(e, "cudaHostAlloc of the %d-slot token ring (%zu bytes)", kRingSize, ring_bytes);
    return;
  }
  std::memset(p, 0, sizeof(int32_t) * 4 * kRingSize + 64);
  ring_ = static_cast<int32_t*>(p);
  halt_ = ring_ + 4 * kRingSize;                                   // 16-byte aligned
  stamp_ = reinterpret_cast<uint64_t*>(ring_ + 4 * kRingSize + 4);  // 8-byte aligned
  void* d = nullptr;
  const cudaError_t de = cudaHostGetDevicePointer(&d, p, 0);
  if (de != cudaSuccess || d != p) {
    // no unified addressing: the kernels need the device alias (never seen on sm_90 hosts)
    if (de != cudaSuccess) {
      (void)cudaGetLastError();
      record(de, "cudaHostGetDevicePointer of the %d-slot token ring (%zu bytes)", kRingSize,
             ring_bytes);
    } else {
      record(cudaErrorNotSupported, "the pinned ring's device address differs from its host "
             "address");
    }
    cudaFreeHost(p);
    ring_ = nullptr;
    return;
  }
  a_->ring = ring_;
  a_->ring_size = kRingSize;
  a_->halt = halt_;
}

DecodeLoop::~DecodeLoop() {
  stop();
  cudaStreamSynchronize(stream_);
  if (exec_) cudaGraphExecDestroy(exec_);
  if (graph_def_) cudaGraphDestroy(graph_def_);
  if (spec_exec_) cudaGraphExecDestroy(spec_exec_);
  if (spec_def_) cudaGraphDestroy(spec_def_);
  if (spec_host_) cudaFreeHost(spec_host_);
  if (ring_) cudaFreeHost(ring_);
}

cudaError_t DecodeLoop::set_spec(SpecArgs* s) {
  if (spec_host_ == nullptr) {
    void* p = nullptr;
    const size_t bytes = sizeof(int64_t) * kSpecHostLen;
    if (const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocMapped)) {
      (void)cudaGetLastError();
      return record(e, "cudaHostAlloc of speculation's %zu-byte host block", bytes);
    }
    void* d = nullptr;
    const cudaError_t de = cudaHostGetDevicePointer(&d, p, 0);
    if (de != cudaSuccess || d != p) {   // as the ring: the kernels use the host address
      (void)cudaGetLastError();
      cudaFreeHost(p);
      return record(de != cudaSuccess ? de : cudaErrorNotSupported,
                    "speculation's host block: no device alias at its host address");
    }
    std::memset(p, 0, bytes);
    spec_host_ = static_cast<int64_t*>(p);
  }
  s->host = spec_host_;
  spec_ = s;
  return cudaSuccess;
}

cudaError_t DecodeLoop::capture_spec() {
  if (!ring_ || !spec_)
    return record(cudaErrorInvalidValue, "capture_spec: %s",
                  !ring_ ? "the token ring was not allocated" : "no speculation buffers (set_spec)");
  if (spec_exec_ || !spec_note_.empty()) return cudaSuccess;   // captured, or refused once
  cudaGraph_t g = nullptr;
  cudaError_t e = cudaGraphCreate(&g, 0);
  if (e != cudaSuccess) return record(e, "capture_spec: cudaGraphCreate");
  const char* failed = "";
  std::string inner;
  do {
    // spec_draft (the halt gate too: once halted, a queued replay runs no body), which sets the
    // switch's value, then the switch over the step bodies. No separate gate kernel and IF
    // node, as the decode graph has: session 37 measured +14.6 us a step at 7B shapes for the
    // gate -> IF { spec_draft -> switch } form of a turn that never drafts.
    cudaGraphConditionalHandle hs;
    failed = "cudaGraphConditionalHandleCreate (the switch)";
    if ((e = cudaGraphConditionalHandleCreate(&hs, g, (unsigned)kMaxVerify,
                                              cudaGraphCondAssignDefault))) break;
    failed = "cudaStreamBeginCaptureToGraph (spec_draft)";
    if ((e = cudaStreamBeginCaptureToGraph(stream_, g, nullptr, nullptr, 0,
                                           cudaStreamCaptureModeRelaxed))) break;
    const SpecArgs& sp = *spec_;
    const cudaError_t de = spec_draft(hs, true, a_->pos, a_->ctx_tokens, a_->ctx_capacity,
                                      a_->counter, sp.state, sp.v.ids, sp.v.pos, sp.row_pos,
                                      sp.row_counter, sp.host, halt_, kMaxVerify, stream_);
    if (de != cudaSuccess) inner = take_last_error();
    cudaGraph_t g2 = g;
    e = cudaStreamEndCapture(stream_, &g2);
    failed = "spec_draft's launch";
    if (de != cudaSuccess) { e = de; break; }
    failed = "cudaStreamEndCapture (spec_draft)";
    if (e != cudaSuccess) break;
    cudaGraphNode_t draft = nullptr;
    size_t n = 1;
    failed = "cudaGraphGetNodes (spec_draft)";
    if ((e = cudaGraphGetNodes(g, &draft, &n))) break;
    if (n != 1) { e = cudaErrorUnknown; break; }
    cudaGraphNodeParams ps = {};
    ps.type = cudaGraphNodeTypeConditional;
    ps.conditional.handle = hs;
    ps.conditional.type = cudaGraphCondTypeSwitch;
    ps.conditional.size = kMaxVerify;   // body d: d drafts (0: a decode step)
    cudaGraphNode_t sw = nullptr;
    failed = "cudaGraphAddNode (the switch node)";
    if ((e = cudaGraphAddNode(&sw, g, &draft, nullptr, 1, &ps))) break;
    for (int d = 0; d < kMaxVerify && e == cudaSuccess; ++d) {
      cudaGraph_t bd = ps.conditional.phGraph_out[d];
      failed = "cudaStreamBeginCaptureToGraph (a step body)";
      if ((e = cudaStreamBeginCaptureToGraph(stream_, bd, nullptr, nullptr, 0,
                                             cudaStreamCaptureModeRelaxed))) break;
      const cudaError_t se = d == 0 ? launch_step(*a_, stream_)
                                    : launch_spec_verify(*a_, sp, d + 1, stream_);
      if (se != cudaSuccess) inner = take_last_error();
      cudaGraph_t bd2 = bd;
      e = cudaStreamEndCapture(stream_, &bd2);
      failed = d == 0 ? "the decode step body's launches" : "a verify step body's launches";
      if (se != cudaSuccess) e = se;
      else failed = "cudaStreamEndCapture (a step body)";
    }
    if (e != cudaSuccess) break;
    failed = "cudaGraphInstantiate (the speculative graph)";
    if ((e = cudaGraphInstantiate(&spec_exec_, g, 0))) break;
    spec_def_ = g;
    return cudaSuccess;
  } while (false);
  // refused: graph-mode speculative steps run as eager ones (spec_note() says why)
  spec_note_ = std::string("speculative graph unavailable (") + failed +
               (inner.empty() ? "" : ": " + inner) + ": " + cudaGetErrorString(e) +
               "); speculative steps launch eagerly";
  (void)cudaGetLastError();
  cudaStreamCaptureStatus st;
  if (cudaStreamIsCapturing(stream_, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
    cudaGraph_t junk = nullptr;
    cudaStreamEndCapture(stream_, &junk);
    if (junk) cudaGraphDestroy(junk);
  }
  (void)cudaGetLastError();
  if (spec_exec_) { cudaGraphExecDestroy(spec_exec_); spec_exec_ = nullptr; }
  cudaGraphDestroy(g);
  return cudaSuccess;
}

cudaError_t DecodeLoop::capture() {
  if (!ring_)
    return record(cudaErrorMemoryAllocation, "capture: the %d-slot token ring was not allocated",
                  kRingSize);
  if (exec_) { cudaGraphExecDestroy(exec_); exec_ = nullptr; }
  if (graph_def_) { cudaGraphDestroy(graph_def_); graph_def_ = nullptr; }
  gated_ = false;
  capture_note_.clear();
  // 1. the gated graph: gate kernel -> IF(halt == 0) { step }
  cudaGraph_t g = nullptr;
  cudaError_t e = cudaGraphCreate(&g, 0);
  if (e != cudaSuccess) return record(e, "cudaGraphCreate");
  cudaGraphConditionalHandle h;
  bool ok = false;
  // the call that refused the gated graph, for capture_note_ (this path falls back, not fails)
  const char* refused = "";
  std::string gate_detail;
  do {
    refused = "cudaGraphConditionalHandleCreate";
    if ((e = cudaGraphConditionalHandleCreate(&h, g, 0, cudaGraphCondAssignDefault)) != cudaSuccess) break;
    refused = "cudaStreamBeginCaptureToGraph (the gate)";
    if ((e = cudaStreamBeginCaptureToGraph(stream_, g, nullptr, nullptr, 0,
                                           cudaStreamCaptureModeRelaxed)) != cudaSuccess) break;
    gate_kernel<<<1, 1, 0, stream_>>>(h, halt_);
    cudaError_t le = cudaGetLastError();
    cudaGraph_t g2 = g;
    e = cudaStreamEndCapture(stream_, &g2);
    refused = "the gate kernel's launch (grid 1 x block 1)";
    if (le != cudaSuccess) { e = le; break; }
    refused = "cudaStreamEndCapture (the gate)";
    if (e != cudaSuccess) break;
    cudaGraphNode_t gate = nullptr;
    size_t n = 1;
    refused = "cudaGraphGetNodes (the gate)";
    if ((e = cudaGraphGetNodes(g, &gate, &n)) != cudaSuccess) break;
    if (n != 1) {
      e = cudaErrorUnknown;
      gate_detail = ": " + std::to_string(n) + " nodes, expected 1";
      break;
    }
    cudaGraphNodeParams p = {};
    p.type = cudaGraphNodeTypeConditional;
    p.conditional.handle = h;
    p.conditional.type = cudaGraphCondTypeIf;
    p.conditional.size = 1;
    cudaGraphNode_t cnode = nullptr;
    refused = "cudaGraphAddNode (the IF node)";
    if ((e = cudaGraphAddNode(&cnode, g, &gate, nullptr, 1, &p)) != cudaSuccess) break;
    cudaGraph_t body = p.conditional.phGraph_out[0];
    refused = "cudaStreamBeginCaptureToGraph (the step body)";
    if ((e = cudaStreamBeginCaptureToGraph(stream_, body, nullptr, nullptr, 0,
                                           cudaStreamCaptureModeRelaxed)) != cudaSuccess) break;
    const cudaError_t se = launch_step(*a_, stream_);
    const std::string step_msg = take_last_error();
    cudaGraph_t b2 = body;
    e = cudaStreamEndCapture(stream_, &b2);
    if (se != cudaSuccess) { nq_fail(se, "%s", step_msg.c_str()); cudaGraphDestroy(g); return se; }
    refused = "cudaStreamEndCapture (the step body)";
    if (e != cudaSuccess) break;
    refused = "cudaGraphInstantiate (the gated graph)";
    if ((e = cudaGraphInstantiate(&exec_, g, 0)) != cudaSuccess) break;
    ok = true;
  } while (false);
  if (ok) {
    graph_def_ = g;
    gated_ = true;
    return cudaSuccess;
  }
  // the driver refused the conditional graph: say which call and why, and capture the plain step
  capture_note_ = std::string("halt-gated graph unavailable (") + refused + gate_detail + ": " +
                  cudaGetErrorString(e) + "); queued graph steps run to completion after a stop";
  (void)cudaGetLastError();
  cudaStreamCaptureStatus st;
  if (cudaStreamIsCapturing(stream_, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
    cudaGraph_t junk = nullptr;
    cudaStreamEndCapture(stream_, &junk);
    if (junk) cudaGraphDestroy(junk);
  }
  (void)cudaGetLastError();
  if (g) cudaGraphDestroy(g);
  if (exec_) { cudaGraphExecDestroy(exec_); exec_ = nullptr; }
  g = nullptr;
  if ((e = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed)) != cudaSuccess)
    return record(e, "cudaStreamBeginCapture of the decode step");
  const cudaError_t se = launch_step(*a_, stream_);
  const std::string step_msg = take_last_error();
  e = cudaStreamEndCapture(stream_, &g);
  if (se != cudaSuccess) {
    nq_fail(se, "%s", step_msg.c_str());
    if (g) cudaGraphDestroy(g);
    return se;
  }
  if (e != cudaSuccess) return record(e, "cudaStreamEndCapture of the decode step");
  if ((e = cudaGraphInstantiate(&exec_, g, 0)) != cudaSuccess) {
    cudaGraphDestroy(g);
    return record(e, "cudaGraphInstantiate of the decode step");
  }
  graph_def_ = g;
  return cudaSuccess;
}

cudaError_t DecodeLoop::run_step(bool graph) {
  if (graph) {
    if (!exec_) return record(cudaErrorInvalidValue, "run_step: the decode graph is not captured");
    const cudaError_t e = cudaGraphLaunch(exec_, stream_);
    return e == cudaSuccess ? e : record(e, "cudaGraphLaunch of the decode step");
  }
  return launch_step(*a_, stream_);
}

void DecodeLoop::reset_turn() {
  stop();
  if (ring_) std::memset(ring_, 0, sizeof(int32_t) * 4 * kRingSize);
  if (halt_) *reinterpret_cast<volatile int32_t*>(halt_) = 0;
  if (spec_host_) {   // the prefill's id is the turn's first: step 1 starts at count 1
    std::memset(spec_host_, 0, sizeof(int64_t) * kSpecHostLen);
    spec_host_[kSpecHostCounter] = 1;
    spec_host_[kSpecHostReplay] = 1;
  }
  launched_ = 0;
  consumed_ = 0;
  std::lock_guard<std::mutex> lk(mu_);
  error_.clear();
}

bool DecodeLoop::halted() const {
  return halt_ && *reinterpret_cast<const volatile int32_t*>(halt_) != 0;
}

bool DecodeLoop::is_stop(int32_t t) const {
  for (int32_t s : host_stops)
    if (s == t) return true;
  return false;
}

void DecodeLoop::set_error(const std::string& e) {
  std::lock_guard<std::mutex> lk(mu_);
  if (error_.empty()) error_ = e;
}

std::string DecodeLoop::error() const {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

void DecodeLoop::start(int64_t n_steps, int run_ahead) {
  stop();
  if (run_ahead < 1) run_ahead = 1;
  if (run_ahead > kRingSize - 2) run_ahead = kRingSize - 2;
  quit_ = false;
  thread_done_ = false;
  thread_ = std::thread(&DecodeLoop::thread_main, this, n_steps, run_ahead);
}

void DecodeLoop::thread_main(int64_t n_steps, int run_ahead) {
  // a new thread starts on device 0: the steps must go to the engine's
  if (const cudaError_t e = cudaSetDevice(device_)) {
    (void)cudaGetLastError();
    set_error(std::string("the launcher thread's cudaSetDevice(") + std::to_string(device_) +
              "): " + cudaGetErrorString(e));
    if (halt_) *reinterpret_cast<volatile int32_t*>(halt_) = 1;
    thread_done_ = true;
    return;
  }
  const bool spec = spec_on_ && spec_ != nullptr && spec_host_ != nullptr;
  for (int64_t i = 1; i <= n_steps; ++i) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (spec) {   // the device's progress is not signalled: polled
        while (!(quit_.load() || halted() || spec_room(i, run_ahead)))
          cv_.wait_for(lk, std::chrono::microseconds(20));
      } else {
        cv_.wait(lk, [&] { return quit_.load() || i - consumed_.load() <= run_ahead; });
      }
    }
    if (quit_.load() || halted()) break;
    bool none = false;
    const cudaError_t e = spec ? run_spec_step(graph_.load(), &none) : run_step(graph_.load());
    if (e != cudaSuccess) {
      set_error(take_last_error());
      if (halt_) *reinterpret_cast<volatile int32_t*>(halt_) = 1;
      break;
    }
    launched_ = i;
    if (none) break;
  }
  thread_done_ = true;
}

bool DecodeLoop::spec_room(int64_t i, int run_ahead) const {
  // step r started at id count c (r read first: c is then r's or a later step's, which only
  // makes the bound larger); steps r..i emit at most kMaxVerify ids each, and the id x lands
  // in slot x % kRingSize, which the consumer must have taken (id x - kRingSize) first
  const volatile int64_t* h = spec_host_;
  const int64_t r = h[kSpecHostReplay];
  std::atomic_thread_fence(std::memory_order_acquire);
  const int64_t c = h[kSpecHostCounter];
  if (i - r > run_ahead) return false;
  return c + (i - r + 1) * kMaxVerify <= consumed_.load() + kRingSize;
}

cudaError_t DecodeLoop::run_spec_step(bool graph, bool* none) {
  *none = false;
  if (graph && spec_exec_) {
    const cudaError_t e = cudaGraphLaunch(spec_exec_, stream_);
    return e == cudaSuccess ? e : record(e, "cudaGraphLaunch of the speculative step");
  }
  // eager (or no speculative graph): the draft, its decision on the host, then that body
  const SpecArgs& sp = *spec_;
  cudaError_t e = spec_draft(0, false, a_->pos, a_->ctx_tokens, a_->ctx_capacity, a_->counter,
                             sp.state, sp.v.ids, sp.v.pos, sp.row_pos, sp.row_counter, sp.host,
                             halt_, kMaxVerify, stream_);
  if (e != cudaSuccess) return wrap(e, "speculative step (eager)");
  if ((e = cudaStreamSynchronize(stream_)) != cudaSuccess)
    return record(e, "speculative step (eager): cudaStreamSynchronize after spec_draft");
  const int64_t d = reinterpret_cast<const volatile int64_t*>(spec_host_)[kSpecHostDecision];
  // the step before may have emitted a stop id (the graph's gate would skip this one)
  if (d >= kMaxVerify || halted()) {
    *none = true;
    return cudaSuccess;
  }
  return d == 0 ? launch_step(*a_, stream_) : launch_spec_verify(*a_, sp, (int)d + 1, stream_);
}

void DecodeLoop::cancel() {
  if (halt_) *reinterpret_cast<volatile int32_t*>(halt_) = 1;
  cv_.notify_all();
}

void DecodeLoop::stop() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  quit_ = false;
}

void DecodeLoop::consumed(int64_t n) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (n > consumed_.load()) consumed_ = n;
  }
  cv_.notify_all();
}

int DecodeLoop::collect(int64_t first, int64_t max_n, int64_t min_wait_us, int64_t timeout_us,
                        std::vector<RingToken>* out) {
  out->clear();
  if (!ring_) {
    set_error("the token ring could not be allocated");
    return 2;
  }
  const int64_t t0 = now_us();
  int64_t i = first;
  int polls = 0;
  for (;;) {
    while ((int64_t)out->size() < max_n) {
      const volatile int32_t* s = ring_ + 4 * (i % kRingSize);
      if ((uint32_t)s[1] != (uint32_t)(i + 1)) break;
      std::atomic_thread_fence(std::memory_order_acquire);
      RingToken t;
      t.token = s[0];
      t.t_ns = (uint64_t)(uint32_t)s[2] | ((uint64_t)(uint32_t)s[3] << 32);
      out->push_back(t);
      ++i;
      consumed(i);  // the id is copied out: its slot may be refilled, the launcher may go on
      if (is_stop(t.token)) return 0;
    }
    if ((int64_t)out->size() >= max_n) return 0;
    const int64_t el = now_us() - t0;
    if (!out->empty() && el >= min_wait_us) return 0;
    if (!error().empty()) return 2;
    if (++polls % 16 == 0) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q != cudaSuccess && q != cudaErrorNotReady) {
        set_error(std::string("the decode stream failed (cudaStreamQuery after ") +
                  std::to_string(launched_.load()) + " launched steps): " + cudaGetErrorString(q));
        return 2;
      }
      // halted, nothing more launching, the GPU idle: no further token can land
      if (q == cudaSuccess && halted() && thread_done_.load()) {
        const volatile int32_t* s = ring_ + 4 * (i % kRingSize);
        if ((uint32_t)s[1] != (uint32_t)(i + 1)) return out->empty() ? 1 : 0;
      }
    }
    if (el >= timeout_us) return 0;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace nanoqwen
