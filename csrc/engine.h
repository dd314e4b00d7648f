// engine.h -- the decode engine core: one decode step enqueued by C++, a CUDA graph of it gated
// by a device-side halt flag, and a launcher thread that keeps the GPU ahead of the host.
//
// Torch-free (raw pointers, a cudaStream_t, cudaError_t back, like every csrc/ file); the
// binding (csrc/bindings.cpp) owns the tensors, checks them, builds a StepArgs from them and
// runs the prefill with ATen. Nothing here touches Python: every call can run with the GIL
// released, and the launcher thread never takes it.
//
// The decode loop (docs/INTERFACES.md "CUDA engine core"):
//   * step i (i >= 1) forwards token i-1 and samples token i; the prefill samples token 0.
//     advance_step writes each sampled id into the pinned host ring, slot i % ring_size, as
//     {token, seq = i + 1, t_ns lo, t_ns hi}: the id and the GPU's globaltimer first, then a
//     system fence, then seq -- so a host that reads seq == i + 1 (acquire) sees the id.
//   * a sampled stop id makes advance_step set *halt (pinned host memory, read by the GPU and
//     the host); the host sets it too, to cancel.
//   * graph mode replays a graph whose first node reads *halt and sets the conditional of an
//     IF node whose body is the captured step: once halted, every queued replay does nothing
//     (a ~2 us gate kernel). Eager mode launches the same launch_step() per step; the launcher
//     thread checks *halt before each launch, so at most the steps already queued still run.
//   * the launcher thread launches at most `run_ahead` steps beyond the last step the consumer
//     has taken (collect()), never more than ring_size - 1 (a slot is not overwritten before
//     it is read).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels.h"

namespace nanoqwen {

// One layer's weights (INT4 g128, quant.py's layout) and KV pages.
struct LayerPtrs {
  const half* ln1;            // [H]
  const half* ln2;            // [H]
  const uint32_t* qkv_qw;     // [q + 2kv, H/8]
  const half* qkv_sc;         // [q + 2kv, H/128]
  const half* qkv_b;          // [q + 2kv]
  const uint32_t* o_qw;       // [H, q/8]
  const half* o_sc;
  const uint32_t* gate_qw;    // [I, H/8]
  const half* gate_sc;
  const uint32_t* up_qw;      // [I, H/8]
  const half* up_sc;
  const uint32_t* down_qw;    // [H, I/8]
  const half* down_sc;
  half* k_cache;              // [num_pages, 16, n_kv, head_dim]
  half* v_cache;
};

// Everything one decode step reads and writes. Every pointer is on the device except ring and
// halt (pinned host memory, mapped: the device writes/reads them through the same address).
struct StepArgs {
  int H = 0, I = 0, n_heads = 0, n_kv = 0, head_dim = 0, vocab = 0;
  float eps = 0.f;
  int min_pps = 0;            // attention_decode's minimum pages per split
  int attn_kernel = 0;        // attention_decode's page loop (kAttnCpAsync / kAttnTma)
  int num_splits = 1;
  int table_len = 0;          // pages in page_table (the RoPE tables hold table_len*16 rows)
  int ctx_capacity = 0;       // ids in ctx_tokens
  const half* embed = nullptr;       // [V, H]
  const half* final_norm = nullptr;  // [H]
  const half* lm_head = nullptr;     // [V, H]
  std::vector<LayerPtrs> layers;
  float* hidden = nullptr;    // [H] fp32 residual
  half* xn = nullptr;         // [H]
  // [H/16] the folded norm's parts. Non-null: the decode step's norms are folded into their
  // neighbours (embed_gather and the residual GEMVs write the sum-of-squares parts, the qkv and
  // gate/up GEMVs form x themselves: no rmsnorm launch in the layers); null: rmsnorm launches
  // (the A/B; NANOQWEN_NORM_FOLD=0)
  float* norm_parts = nullptr;
  half* qkv = nullptr;        // [q + 2kv]
  half* attn = nullptr;       // [n_heads, head_dim]
  half* act = nullptr;        // [I]
  float* logits = nullptr;    // [V]
  float* work = nullptr;      // [V]
  float* ws_acc = nullptr;    // [n_heads, num_splits, head_dim]
  float* ws_ml = nullptr;     // [n_heads, num_splits, 2]
  int32_t* attn_counters = nullptr;  // [n_kv]
  const float* cos = nullptr;        // [table_len*16, head_dim/2]
  const float* sin = nullptr;
  const int32_t* page_table = nullptr;
  int32_t* token_in = nullptr;       // [1]
  int32_t* pos = nullptr;            // [1]
  int32_t* sampled = nullptr;        // [1]
  int64_t* counter = nullptr;        // [1]
  int32_t* ctx_tokens = nullptr;     // [ctx_capacity]
  const float* params_f = nullptr;   // [4]
  const int64_t* params_i = nullptr; // [4]
  const int32_t* stops = nullptr;    // device [1 + kMaxStops]: count, then the stop ids
  int32_t* ring = nullptr;           // host, mapped: [ring_size, 4]
  int ring_size = 0;
  int32_t* halt = nullptr;           // host, mapped: [1]
};

// The speculative verify step's buffers (T <= kMaxVerify rows each; device memory): the
// decode step's activations with a row per token, and T slices of its attention workspace.
constexpr int kMaxVerify = 16;
struct VerifyArgs {
  int32_t* ids = nullptr;            // [T] the tokens (the last sampled one, then the drafts)
  int32_t* pos = nullptr;            // [1] the first one's position
  float* hidden = nullptr;           // [T, H]
  half* xn = nullptr;                // [T, H]
  half* qkv = nullptr;               // [T, q + 2kv]
  half* attn = nullptr;              // [T, n_heads, head_dim]
  half* act = nullptr;               // [T, I]
  float* logits = nullptr;           // [T, V]
  float* ws_acc = nullptr;           // [T, n_heads, num_splits, head_dim]
  float* ws_ml = nullptr;            // [T, n_heads, num_splits, 2]
  int32_t* attn_counters = nullptr;  // [T, n_kv], zero
};

// Speculation on the device (spec.cu, kernels.h): the verify step's buffers and, per row of it,
// the position and draw counter sample_token reads and the id it draws; the drafter's state
// (device) and the launcher's view of the steps (host, mapped).
struct SpecArgs {
  VerifyArgs v;
  int32_t* row_pos = nullptr;        // [kMaxVerify]
  int64_t* row_counter = nullptr;    // [kMaxVerify]
  int32_t* row_ids = nullptr;        // [kMaxVerify]
  float* row_work = nullptr;         // [kMaxVerify, V] sample_token's scratch
  int32_t* state = nullptr;          // device [kSpecStateLen]
  int64_t* host = nullptr;           // host, mapped: [kSpecHostLen] (DecodeLoop allocates it)
};
constexpr int kMaxStops = 8;
constexpr int kRingSize = 256;      // slots in the pinned ring (the run-ahead is below it)

// The end of a step, also of a prefill: rmsnorm(hidden, final norm) -> lm_head GEMV into
// logits; then sample_token -> advance_step. Each returns the first failing launch's error;
// the thread's message (kernels.h: last_error_message()) then says which launch and why, with
// the numbers ("decode step, layer 3, attention_decode (...): <the launcher's message>: <error>").
cudaError_t launch_logits(const StepArgs& a, cudaStream_t stream);
cudaError_t launch_sample_advance(const StepArgs& a, cudaStream_t stream);

// Every launch of one decode step: embed_gather, per layer rmsnorm -> qkv GEMV ->
// attention_decode -> o GEMV (+residual) -> rmsnorm -> gate/up GEMV (SiLU*mul) -> down GEMV
// (+residual), then launch_logits and launch_sample_advance. Safe to capture.
cudaError_t launch_step(const StepArgs& a, cudaStream_t stream);

// The verify step of speculative decoding: T tokens (v.ids) at positions *v.pos.. forwarded as
// T decode steps would forward them, in one pass over the weights -- their K/V into the cache
// (attention_verify writes them), the logits of every one into v.logits [T, V]. Every GEMV runs
// T columns (gemv.h), attention is attention_verify: each row's logits are bit-identical to the
// decode step's at that position, so greedy speculation keeps the plain decode's tokens. No
// sampling, no ring, no advance: the caller reads the logits. The page table must cover the
// positions. Safe to capture.
cudaError_t launch_verify(const StepArgs& a, const VerifyArgs& v, int T, cudaStream_t stream);
// launch_verify(T) captured into *out (graph mode's verify step: v.ids and v.pos are read when it
// runs, so one graph per T serves every verify of T tokens). *out is null on failure.
cudaError_t capture_verify(const StepArgs& a, const VerifyArgs& v, int T, cudaStream_t stream,
                           cudaGraphExec_t* out);

// The verify step of a speculative step (T = 2..kMaxVerify ids that spec_draft wrote): launch_verify,
// sample_token on its T rows (row i at s.row_pos[i] with the turn's sampler and draw
// s.row_counter[i]), spec_accept. Safe to capture.
cudaError_t launch_spec_verify(const StepArgs& a, const SpecArgs& s, int T, cudaStream_t stream);
// Writes the GPU's globaltimer (ns) into *out (host mapped) when the stream reaches it.
cudaError_t stamp_time(uint64_t* out, cudaStream_t stream);

// A token read back from the ring: id and the GPU time its step ended.
struct RingToken {
  int32_t token;
  uint64_t t_ns;
};

class DecodeLoop {
 public:
  // `a` must outlive the loop (the binding keeps it); ring/halt are allocated here.
  DecodeLoop(StepArgs* a, cudaStream_t stream, int device);
  ~DecodeLoop();
  DecodeLoop(const DecodeLoop&) = delete;
  DecodeLoop& operator=(const DecodeLoop&) = delete;

  // Capture the step: first as a halt-gated graph (IF node); if the driver refuses that, as a
  // plain graph of the step (then a halted graph replay still runs; gated() says which).
  cudaError_t capture();
  bool gated() const { return gated_; }
  std::string capture_note() const { return capture_note_; }

  // One step now, on the stream (graph replay or the eager launches); no loop involved.
  cudaError_t run_step(bool graph);

  // Reset the ring and halt for a new turn (the stream must be idle: the caller synced it).
  void reset_turn();
  // Start the launcher thread: up to n_steps steps (steps 1..n_steps), each in the mode that
  // set_graph() last chose, at most run_ahead beyond the consumer.
  void start(int64_t n_steps, int run_ahead);
  // Speculation on the device: set_spec() gives the loop its buffers (once; the host block of
  // s is allocated here and written back into s). With spec_on(true) a turn's steps are
  // speculative steps (kernels.h: spec_draft, then a decode step or a verify step), each
  // emitting 1..kMaxVerify ids: graph mode replays the speculative graph (spec_draft, which is
  // also its halt gate, then a switch node over the step bodies, captured by capture_spec() at
  // its first use), eager mode launches spec_draft, waits for its decision and launches that body. The
  // flow control counts ids: a step is launched only when the ring has room for every id the
  // steps launched before it can still emit (host[kSpecHostCounter/Replay] say how far the
  // device is), and at most run_ahead steps ahead of the latest started one.
  cudaError_t set_spec(SpecArgs* s);
  void spec_on(bool on) { spec_on_ = on; }
  cudaError_t capture_spec();
  std::string spec_note() const { return spec_note_; }
  void set_graph(bool graph) { graph_.store(graph); }
  // Host-side halt (cancel): the GPU's next gate skips the step, the launcher stops.
  void cancel();
  // Stop the launcher thread (halt first) and wait for it. The caller syncs the stream.
  void stop();

  // Tokens first.. as they land: waits (no GIL here) until at least one token is there, then
  // keeps taking tokens until min_wait_us has passed since the call or max_n tokens were
  // taken or a stop id / halt is seen; returns at timeout_us with what it has (maybe none).
  // status: 0 ok, 1 halted (host cancel or stop: no token beyond the ones returned will come
  // unless already in the ring), 2 launcher or stream error (engine_error()).
  int collect(int64_t first, int64_t max_n, int64_t min_wait_us, int64_t timeout_us,
              std::vector<RingToken>* out);
  // Mark tokens < n as consumed (frees ring slots for the launcher). collect() marks each id
  // it copies out, so the launcher never waits for the consumer's processing of a window.
  void consumed(int64_t n);
  std::string error() const;
  int64_t launched() const { return launched_.load(); }
  bool halted() const;
  // GPU time of the turn's start stamp (prefill start), ns.
  uint64_t* start_stamp() { return stamp_; }
  int32_t* ring() { return ring_; }
  int32_t* halt_ptr() { return halt_; }

 private:
  void thread_main(int64_t n_steps, int run_ahead);
  // one speculative step (graph replay, or eager: draft, wait, body); *none: the budget was
  // spent (nothing launched after the draft)
  cudaError_t run_spec_step(bool graph, bool* none);
  bool spec_room(int64_t i, int run_ahead) const;
  bool is_stop(int32_t t) const;
  void set_error(const std::string& e);

  StepArgs* a_;
  cudaStream_t stream_;
  int device_;
  cudaGraph_t graph_def_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  bool gated_ = false;
  std::string capture_note_;
  int32_t* ring_ = nullptr;    // host mapped [kRingSize, 4]
  int32_t* halt_ = nullptr;    // host mapped [1]
  uint64_t* stamp_ = nullptr;  // host mapped [1]
  SpecArgs* spec_ = nullptr;
  int64_t* spec_host_ = nullptr;   // host mapped [kSpecHostLen] (SpecArgs::host)
  bool spec_on_ = false;
  cudaGraph_t spec_def_ = nullptr;
  cudaGraphExec_t spec_exec_ = nullptr;
  std::string spec_note_;
  std::thread thread_;
  std::atomic<bool> graph_{true};
  std::atomic<bool> quit_{false};
  std::atomic<int64_t> launched_{0};
  std::atomic<int64_t> consumed_{0};
  std::atomic<bool> thread_done_{true};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string error_;
 public:
  std::vector<int32_t> host_stops;  // the turn's stop ids (host copy, for collect())
};

}  // namespace nanoqwen
