// nanoqwen decode kernels (everything but the INT4/fp16 GEMVs, which live in gemv.h), and the
// one error convention every csrc/ function follows.
//
// Torch-free: raw pointers, a cudaStream_t, a cudaError_t back. csrc/bindings.cpp is the only
// file that includes torch headers. Every launcher checks its arguments and launches on `stream`;
// on any failure (a refused argument, a refused cudaFuncSetAttribute, a failed launch) it records
// a message with the numbers (nq_fail, below) before it returns the error.
//
// Shared conventions (docs/INTERFACES.md, engine/kv_cache.py):
//   hidden      fp32 [T, H]              the residual stream (GEMV epilogues add into it)
//   KV cache    fp16 [num_pages, 16, n_kv, head_dim] per layer (K after RoPE, V as projected);
//               position p lives in page page_table[p / 16], slot p % 16.
//   pos         int32 [1] on the device: position of the current (first) token. Decode kernels
//               read it at run time, so one captured CUDA graph serves every position.
//   RoPE tables fp32 [max_positions, head_dim/2] cos and sin, computed on the host from the
//               angles the reference backend uses (engine/rope.py: fp32 inv_freq * position),
//               HF rotate_half order.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include <string>

namespace nanoqwen {

// ---- errors ------------------------------------------------------------------------------------
// One message per host thread: the last failure recorded by any csrc/ function in this thread
// ("" once taken). Every failing path records one (nq_fail) before it returns its error, so the
// message read right after a failed call is that call's: the binding's check_launch appends it
// to the op's exception, engine.cu wraps it with the decode step's context (layer, op). Messages
// carry the numbers ("gemv_int4: n=1 k=90112 needs 235776 bytes of shared memory ...").
// Inline with a function-local thread_local: one buffer per thread for the whole library.
inline std::string& error_slot() {
  static thread_local std::string s;
  return s;
}
inline const char* last_error_message() { return error_slot().c_str(); }
// The message, cleared (so a later failure that records nothing cannot borrow it).
inline std::string take_last_error() {
  std::string m;
  m.swap(error_slot());
  return m;
}
inline cudaError_t nq_vfail(cudaError_t err, const char* fmt, va_list ap) {
  char buf[1024];
  vsnprintf(buf, sizeof buf, fmt, ap);
  error_slot() = buf;
  return err;
}
// Records printf(fmt, ...) as this thread's message and returns err (never cudaSuccess: a
// caller writes `return nq_fail(cudaErrorInvalidValue, "rmsnorm: H=%d ...", H);`).
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
inline cudaError_t nq_fail(cudaError_t err, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  nq_vfail(err, fmt, ap);
  va_end(ap);
  return err;
}

constexpr int kPageSize = 16;
constexpr int kMaxGqa = 8;  // Qwen2.5-Coder ratios are 5, 6, 7, 8 (and 1 for tests)

// hidden[t, :] = float(table[ids[t], :]) for t < T. ids are clamped into [0, vocab) so a bad
// id can never read out of bounds (the Python side validates ids before they get here). H a
// multiple of 16. With parts (fp32 [T, H/16]; may be null) it also writes the parts of each
// row's sum of squares (common.cuh's order), which the decode step's folded norm reads.
cudaError_t embed_gather(float* hidden, const half* table, const int32_t* ids, int T, int H,
                         int vocab, cudaStream_t stream, float* parts = nullptr);

// out[t, :] = half(w * x * rsqrt(mean(x^2) + eps)), x = hidden[t, :] in fp32; H a multiple of
// 16, at most 8192. The sum of squares is common.cuh's order, so the result is bit-identical
// to the decode step's folded norm (gemv_int4_norm) of the same row.
cudaError_t rmsnorm(half* out, const float* hidden, const half* weight, int T, int H, float eps,
                    cudaStream_t stream);

// out[t, i] = half(silu(g) * u) for g = gu[t, i], u = gu[t, I + i] (gu [T, 2I] fp16: the fp16
// prefill's gate/up GEMM), fp32 math, one rounding. I a multiple of 8, both 16-byte aligned.
cudaError_t silu_mul(half* out, const half* gu, int T, int I, cudaStream_t stream);

// Row t of qkv [T, (n_heads + 2 n_kv) * head_dim] is the token at position pos[0] + t.
// Rotates q and k (HF rotate_half), writes q to q_out [T, n_heads, head_dim], and rotated k and
// plain v into the layer's pages. Positions at or beyond table_len*16 are not written to the
// cache (and read the last row of the tables, which must hold table_len*16 rows).
cudaError_t rope_kv_write(half* q_out, half* k_cache, half* v_cache, const half* qkv,
                          const float* cos_table, const float* sin_table, const int32_t* pos,
                          const int32_t* page_table, int table_len, int T, int n_heads,
                          int n_kv, int head_dim, cudaStream_t stream);

// The prefill's causal GQA attention, one launch: query i of q [T, n_heads, head_dim] (rotated,
// rope_kv_write's q_out) at position q0 + i attends to the cached positions 0..q0 + i of its kv
// head (query head h reads kv head h / (n_heads / n_kv)), whose K/V rows lie in the pages
// page_table[0 .. ceil((q0 + T) / 16)) of k_cache / v_cache [pages, 16, n_kv, head_dim] (this
// chunk's own rows included: rope_kv_write runs first). out [T, n_heads * head_dim] fp16;
// scale 1/sqrt(head_dim); fp32 scores and softmax, P rounded to fp16 before P V (as SDPA's flash
// kernel does). head_dim 64 or 128, n_heads a multiple of n_kv; pointers 16-byte aligned.
cudaError_t attention_prefill(half* out, const half* q, const half* k_cache, const half* v_cache,
                              const int32_t* page_table, int q0, int T, int n_heads, int n_kv,
                              int head_dim, cudaStream_t stream);

// The decode step's attention in ONE launch: RoPE of q and k of the projected token
// (qkv [(n_heads + 2 n_kv) * head_dim], position pos[0]) as rope_kv_write does it (fp32 from
// fp16, rounded once), the write of rotated k and plain v into slot pos of the layer's pages
// (skipped, like rope_kv_write, when pos is beyond the table), then split-K (flash-decoding)
// attention over positions 0..pos: grid (n_kv, num_splits), split s takes a contiguous run of
// pages sized from the length at run time, and the splits are merged inside the same launch (the
// last split block of each kv head to finish merges them, in split order, so the result does not
// depend on which block finishes last).
//   out [n_heads, head_dim]; ws_acc fp32 [n_heads, num_splits, head_dim], ws_ml fp32
//   [n_heads, num_splits, 2] (the splits' acc and (max, sum)); counters int32 [n_kv]: zero
//   before the first call, left zero by every call. head_dim 64 or 128, n_heads / n_kv <=
//   kMaxGqa, scale = 1/sqrt(head_dim).
// The cache write equals rope_kv_write's bit for bit.
// Split sizing: pages per split = max(ceil(pages / num_splits), min_pps), so at short contexts
// fewer, longer splits run (their merge reads cost more than a split's own pages). min_pps is an
// argument, not read from the environment: 0 means kDecMinPpsDefault, 1..kDecMinPpsMax is used
// as given, anything else fails without launching (the torch op checks it first). A host int
// baked into the launch, so a captured graph keeps it.
// 8: end to end the fastest of 2 / 4 / 8 on every preset from 0.5B to 7B, after 512 and after
// 2048 cached tokens (H100, benchmarks/RESULTS.md, session 38: 7B 2.138 -> 2.076 ms/token at
// 512, 0.5B after 2048 0.659 -> 0.575); from 33 * 8 pages on, ceil(pages / splits) decides.
constexpr int kDecMinPpsDefault = 8;
// 8192 pages = 131072 tokens: larger values change nothing at Qwen2.5-Coder contexts (one split
// per kv head already), and the bound keeps split * pps far inside int. engine/switches.py
// validates NANOQWEN_ATTN_MIN_PPS against the same two constants (tests/test_switches.py).
constexpr int kDecMinPpsMax = 8192;
// kernel: which page loop runs (the same splits, prologue and merge either way):
//   kAttnCpAsync  4 warps stream pages through a cp.async ring, fp32 FMA dot products
//   kAttnTma      (the engine's default) a producer warp copies pages through tensor maps
//                 (cp.async.bulk.tensor, TMA) into an mbarrier ring, 4 consumer warps do QK^T
//                 and PV on tensor cores (mma.sync m16n8k16); the maps cover table_len pages,
//                 so every page id in the table must be < table_len (the engine's caches hold
//                 exactly table_len pages)
// anything else fails without launching.
constexpr int kAttnCpAsync = 0;
constexpr int kAttnTma = 1;
cudaError_t attention_decode(half* out, float* ws_acc, float* ws_ml, int32_t* counters,
                             const half* qkv, half* k_cache, half* v_cache,
                             const float* cos_table, const float* sin_table,
                             const int32_t* page_table, int table_len, const int32_t* pos,
                             int n_heads, int n_kv, int head_dim, int num_splits, int min_pps,
                             int kernel, float scale, cudaStream_t stream);

// The speculative verify step's attention: T (1..kMaxVerifyQueries) queries at positions
// pos[0] .. pos[0] + T - 1, what attention_decode does for one: qkv [T, q + 2kv] (row i the
// token at pos[0] + i); the T rows' k (RoPE, rounded as rope_kv_write does) and v written into
// the pages (positions at or beyond table_len*16 are not), and attended by the queries at or past
// them in the same launch (each block computes the rows it needs itself: no rope_kv_write
// before it); out [T, n_heads, head_dim]; ws_acc / ws_ml / counters T times attention_decode's
// (query i uses slice i; counters zero before, left zero). Query i's output is bit-identical to
// attention_decode's at position pos[0] + i after decode steps at pos[0] .. pos[0] + i - 1, and
// the cache afterwards to theirs: the same RoPE, splits, kernel and order (tests/gpu checks it).
constexpr int kMaxVerifyQueries = 16;
cudaError_t attention_verify(half* out, float* ws_acc, float* ws_ml, int32_t* counters,
                             const half* qkv, half* k_cache, half* v_cache,
                             const float* cos_table, const float* sin_table,
                             const int32_t* page_table, int table_len, const int32_t* pos, int T,
                             int n_heads, int n_kv, int head_dim, int num_splits, int min_pps,
                             int kernel, float scale, cudaStream_t stream);

// GPU sampler (docs/INTERFACES.md order): repetition penalty over the distinct ids among the
// last repeat_last_n context ids (ctx_tokens[0..pos]) -> greedy argmax (lowest id on ties) ->
// top-k -> top-p -> min-p -> temperature -> one draw from Philox4x32-10(seed, counter).
//   params_f fp32 [4]  = temperature, top_p, min_p, repeat_penalty
//   params_i int64 [4] = top_k, repeat_last_n, seed, (unused)
//   counter  int64 [1] = the draw's counter (advance() increments it)
//   work     fp32 [V]  scratch for the penalised logits of slices too long for shared memory
// Parameters live in device memory, so changing one needs no graph re-capture.
// ctx_tokens holds ctx_capacity ids; the window is clamped to it.
// One thread-block cluster of `blocks` blocks (0: automatic, the largest cluster the GPU runs
// at once, fewer for small vocabularies; 1..16 explicitly), each over a slice of the
// vocabulary; the token does not depend on the number of blocks (the tests' reference is 1).
// path (int32 [1], optional; nullptr in the engine): the kPath* bits of the stages that ran,
// whether the slices were in shared memory, and the number of blocks << kPathBlocksShift.
constexpr int32_t kPathGreedy = 1, kPathTopK = 2, kPathTopP = 4, kPathMinP = 8, kPathDraw = 16,
                  kPathRowShared = 32, kPathBlocksShift = 8;
// rows > 1 (the verify step's rows, engine's verify_sample): `rows` independent draws in one
// launch, a cluster each, row r reading logits + r * V and pos[r], counter[r], writing
// out_token[r] and work + r * V (work then [rows, V]); the same draw as rows calls of one row.
// path must be null then.
cudaError_t sample_token(int32_t* out_token, float* work, const float* logits, int V,
                         const int32_t* ctx_tokens, int ctx_capacity, const int32_t* pos, const float* params_f,
                         const int64_t* params_i, const int64_t* counter, cudaStream_t stream,
                         int32_t* path = nullptr, int blocks = 0, int rows = 1);

// The end of a decode step, so the next one needs no host round trip:
//   token_in[0] = sampled; pos += 1; ctx_tokens[pos] = sampled (if pos < ctx_capacity);
//   slot = host_ring[counter % ring_size] (pinned, mapped host memory, int32 [ring_size, 4]):
//     slot[0] = sampled, slot[2..3] = the GPU's globaltimer (ns, lo/hi), a system fence, then
//     slot[1] = counter + 1 (the host reads seq == i + 1 before it reads the id);
//   if sampled is one of stops[1..stops[0]] (device int32, stops[0] <= 8), *halt = 1 (pinned
//   host memory: the gated decode graph and the host both read it); counter += 1.
// stops and halt may both be null (no stop detection).
// The n-gram watch (speculation's plain runs, engine/backends/base.py): w = params_i[3] (the
// sampler's parameters; params_i null: no watch), n = w & 0xff (0: off). If the last n ids
// (ctx_tokens[pos - n + 1 .. pos - 1] and sampled, at the new pos) occurred before, ending at
// some q < pos, *halt = 1 too: prompt lookup has a draft there (NgramDrafter.will_draft with
// min_n = n), and the queued graph steps do nothing. Bit 8 of w: not at draw 0 (counter == 0:
// the turn's first id, which the host takes alone).
constexpr int kAdvanceThreads = 256;   // the watch's scan of ctx_tokens; one thread otherwise
cudaError_t advance_step(int32_t* token_in, int32_t* pos, int32_t* ctx_tokens,
                         int ctx_capacity, int64_t* counter, int32_t* host_ring, int ring_size,
                         const int32_t* sampled, const int32_t* stops, int32_t* halt,
                         const int64_t* params_i, cudaStream_t stream);

// ---- prompt-lookup speculation on the device (spec.cu; engine.h's speculative turn) ----------
// A speculative step is spec_draft, then either a decode step (launch_step: nothing drafted)
// or the verify step of T = drafts + 1 ids, sample_token on its T rows and spec_accept.
// state: device int32 [kSpecStateLen], the turn's configuration (written by the host before the
// turn), the draft length and the figures; host: pinned mapped int64 [kSpecHostLen].
constexpr int kSpecDraftThreads = 1024;
enum : int {
  kSpecK = 0,          // the draft length now (the turn starts at k_start)
  kSpecKMin,           // bounds of the draft length
  kSpecKMax,
  kSpecMinN,           // n-gram sizes matched, longest first
  kSpecMaxN,
  kSpecTotal,          // the turn's budget of ids (the prefill's included): none past it
  kSpecDrafted,        // figures of the turn: ids drafted, drafts kept, verify steps
  kSpecAccepted,
  kSpecVerifySteps,
  kSpecT,              // this step's T (spec_draft -> spec_accept)
  kSpecReplays,        // speculative steps started this turn
  kSpecStateLen = 16
};
enum : int {
  kSpecHostCounter = 0,  // the turn's id count when the latest step started
  kSpecHostReplay,       // that step's number (1, 2, ...), written after the count
  kSpecHostDecision,     // its decision: 0 decode step, d >= 1 verify of d drafts, t_max none
  kSpecHostDrafted,      // the turn's figures so far (spec_accept's copies of state's)
  kSpecHostAccepted,
  kSpecHostVerifySteps,
  kSpecHostLen = 8
};
// spec_draft: the drafter on ctx_tokens[0..pos] (pos: the last id's position), for a turn whose
// id count is *counter: drafts d = min(k, budget left - 1, t_max - 1, room in ctx_tokens, ids
// after the match) ids; with d >= 1 writes v_ids = [ctx_tokens[pos], drafts], v_pos = pos,
// row_pos[i] = pos + i, row_counter[i] = counter + i (row i is drawn as the decode step of that
// id draws it) and the drafts into ctx_tokens[pos + 1..]; state[kSpecT] = d + 1. The decision
// (0 decode step, d verify, t_max when the budget is spent, which also sets *halt) goes to
// host[kSpecHostDecision] and, with use_handle, to the switch node's conditional handle (the
// speculative graph's step bodies, indexed by decision). With *halt set (the turn halted: a
// cancel, a stop id, the spent budget) it is the graph's halt gate instead: decision t_max
// (no body runs), nothing else written. One block of kSpecDraftThreads threads, no PDL (it
// starts the graph). t_max 2..kMaxVerifyQueries.
cudaError_t spec_draft(cudaGraphConditionalHandle handle, bool use_handle, const int32_t* pos,
                       int32_t* ctx_tokens, int ctx_capacity, const int64_t* counter,
                       int32_t* state, int32_t* v_ids, int32_t* v_pos, int32_t* row_pos,
                       int64_t* row_counter, int64_t* host, int32_t* halt, int t_max,
                       cudaStream_t stream);
// spec_accept: the end of a verify step of T = state[kSpecT] ids (v_ids, drawn ids row_ids):
// the ids it keeps (engine/backends/base.py _verify_step's rule: each row's id is emitted, the
// draft after it kept iff equal, a rejection or a stop id ends the step, all kept: the last
// row's id too) go to ctx_tokens and the ring as advance_step writes a decode step's id (their
// times the step's time shared equally), token_in = the last, pos += their count, counter +=
// their count; a stop id or the spent budget sets *halt; the draft length adapts
// (engine/spec.py _Drafter.update) and the figures add up (state, and host's copies).
cudaError_t spec_accept(const int32_t* v_ids, const int32_t* row_ids, int32_t* token_in,
                        int32_t* pos, int32_t* ctx_tokens, int ctx_capacity, int64_t* counter,
                        int32_t* state, int64_t* host, int32_t* host_ring, int ring_size,
                        const int32_t* stops, int32_t* halt, cudaStream_t stream);

}  // namespace nanoqwen
