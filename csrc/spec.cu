// spec.cu -- prompt-lookup speculation on the device (issue 13 item 3: drafting, verifying,
// sampling and accepting, all in the engine core): the draft kernel that starts every
// speculative step and the accept kernel that ends a verify step (kernels.h says what each
// promises; engine.h's DecodeLoop runs them, engine.cu captures them into the speculative graph).
//
// The drafter is engine/spec.py's NgramDrafter, computed from ctx_tokens instead of an index:
// the last n ids of the context (n from max_n down to min_n, the longest first) are looked for
// among the earlier positions, the latest occurrence of the longest n wins, and the ids that
// followed it are the draft (at most k of them, and no further than the context's last id).
// The draft length k adapts as NgramDrafter's does (_Drafter.update): +2 after a fully kept
// draft, kept + 1 (not below k_min) after a rejection.
#include "common.cuh"
#include "kernels.h"

namespace nanoqwen {

namespace {

// a block-wide max of 64-bit keys (kSpecDraftThreads threads, 32 per warp)
__device__ __forceinline__ long long block_max(long long v, long long* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const long long w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (kSpecDraftThreads >> 5) ? red[lane] : -1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const long long w = __shfl_xor_sync(0xffffffffu, v, o);
      v = w > v ? w : v;
    }
    if (lane == 0) red[0] = v;
  }
  __syncthreads();
  return red[0];
}

// The ring slot of token index c (advance_kernel's format): id and time, a system fence, seq.
__device__ __forceinline__ void ring_write(int32_t* host_ring, int ring_size, int64_t c,
                                           int32_t t, uint64_t ns) {
  volatile int32_t* slot = host_ring + 4 * (c % ring_size);
  slot[0] = t;
  slot[2] = (int32_t)(uint32_t)(ns & 0xffffffffu);
  slot[3] = (int32_t)(uint32_t)(ns >> 32);
  __threadfence_system();
  slot[1] = (int32_t)(uint32_t)(c + 1);
}

}  // namespace

__global__ void __launch_bounds__(kSpecDraftThreads)
spec_draft_kernel(cudaGraphConditionalHandle handle, int use_handle, const int32_t* pos,
                  int32_t* ctx_tokens, int ctx_capacity, const int64_t* counter, int32_t* state,
                  int32_t* v_ids, int32_t* v_pos, int32_t* row_pos, int64_t* row_counter,
                  int64_t* host, int32_t* halt, int t_max) {
  __shared__ long long red[kSpecDraftThreads / 32];
  // launched without PDL, first in its graph or after a whole step (eager): every earlier
  // write is visible. It is also the speculative graph's halt gate (the decode graph's
  // gate_kernel): *halt (mapped host memory: the host's cancel, a stop id, the spent budget) is
  // read by thread 0 here and used only after the scan, which writes nothing, so its PCIe round
  // trip overlaps the scan; a halted turn's queued replays change nothing and run no body.
  int halted = 0;
  if (threadIdx.x == 0) halted = *reinterpret_cast<const volatile int32_t*>(halt);
  const int p = pos[0];            // the last id's position: ctx_tokens[p] is token_in
  const int64_t c = counter[0];    // ids of the turn so far
  const int total = state[kSpecTotal];
  const int max_n = state[kSpecMaxN], min_n = state[kSpecMinN];
  // drafts allowed: the turn's budget leaves room for them and one id of the target's own,
  // the verify step takes at most t_max ids, the drafts' positions lie inside ctx_tokens
  const int64_t remaining = (int64_t)total - c;
  int limit = (int)min((int64_t)state[kSpecK], remaining - 1);
  limit = min(limit, t_max - 1);
  limit = min(limit, ctx_capacity - 1 - p);
  long long best = -1;
  if (limit >= 1 && p >= 1 && p < ctx_capacity) {
    // the latest earlier end q of the longest n-gram (min_n <= n <= max_n) ending at p:
    // key (n << 32) | q, the block's max; four loads in flight a thread
    const int32_t last = ctx_tokens[p];
    constexpr int kIn = 4;
    for (int q0 = (int)threadIdx.x; q0 < p; q0 += kIn * kSpecDraftThreads) {
      int32_t v[kIn];
#pragma unroll
      for (int j = 0; j < kIn; ++j) {
        const int q = q0 + j * kSpecDraftThreads;
        v[j] = q < p ? ctx_tokens[q] : -1;   // ids are >= 0
      }
#pragma unroll
      for (int j = 0; j < kIn; ++j) {
        const int q = q0 + j * kSpecDraftThreads;
        if (v[j] != last) continue;
        int n = 1;
        while (n < max_n && q - n >= 0 && ctx_tokens[q - n] == ctx_tokens[p - n]) ++n;
        if (n >= min_n) {
          const long long key = ((long long)n << 32) | (long long)q;
          best = key > best ? key : best;
        }
      }
    }
  }
  best = block_max(best, red);
  if (threadIdx.x != 0) return;
  if (halted != 0) {   // the gate: no body, nothing written but the decision
    reinterpret_cast<volatile int64_t*>(host)[kSpecHostDecision] = t_max;
    if (use_handle) cudaGraphSetConditional(handle, (unsigned)t_max);
    return;
  }
  int kd = 0;
  if (best >= 0) {
    const int q = (int)(best & 0xffffffffLL);
    kd = min(limit, p - q);   // the ids after q, up to the context's last one
    v_ids[0] = ctx_tokens[p];
    for (int i = 1; i <= kd; ++i) {
      const int32_t d = ctx_tokens[q + i];   // q + i <= p: never one written below
      v_ids[i] = d;
      // the drafts into ctx_tokens at their positions, as the verify step's host path writes
      // them: row i's penalty window reads them; a rejected one is rewritten by the accept
      ctx_tokens[p + i] = d;
    }
    *v_pos = p;
    for (int i = 0; i <= kd; ++i) {
      row_pos[i] = p + i;
      row_counter[i] = c + i;   // row i is the turn's id c + i: the draw a decode step makes
    }
  }
  // none: the budget is spent (the launcher's further replays do nothing); kd = 0: a decode
  // step; kd >= 1: the verify step of T = kd + 1 ids
  const int decision = remaining <= 0 ? t_max : kd;
  if (remaining <= 0) *reinterpret_cast<volatile int32_t*>(halt) = 1;
  state[kSpecT] = kd + 1;
  const int r = state[kSpecReplays] + 1;
  state[kSpecReplays] = r;
  // the launcher's flow control (engine.h): the counter at this step's start, then the step
  // number, a system fence between (a host that reads r sees c of r or of a later step)
  volatile int64_t* h = reinterpret_cast<volatile int64_t*>(host);
  h[kSpecHostDecision] = decision;
  h[kSpecHostCounter] = c;
  __threadfence_system();
  h[kSpecHostReplay] = r;
  if (use_handle) cudaGraphSetConditional(handle, (unsigned)decision);
}

cudaError_t spec_draft(cudaGraphConditionalHandle handle, bool use_handle, const int32_t* pos,
                       int32_t* ctx_tokens, int ctx_capacity, const int64_t* counter,
                       int32_t* state, int32_t* v_ids, int32_t* v_pos, int32_t* row_pos,
                       int64_t* row_counter, int64_t* host, int32_t* halt, int t_max,
                       cudaStream_t stream) {
  if (t_max < 2 || t_max > kMaxVerifyQueries || ctx_capacity < 1 || host == nullptr || halt == nullptr)
    return nq_fail(cudaErrorInvalidValue, "spec_draft: t_max=%d (2..%d), ctx_capacity=%d, "
                   "host %s, halt %s", t_max, kMaxVerifyQueries, ctx_capacity, host ? "set" : "null",
                   halt ? "set" : "null");
  spec_draft_kernel<<<1, kSpecDraftThreads, 0, stream>>>(
      handle, use_handle ? 1 : 0, pos, ctx_tokens, ctx_capacity, counter, state, v_ids, v_pos,
      row_pos, row_counter, host, halt, t_max);
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return e;
  return nq_fail(e, "spec_draft: launch of 1 x %d threads (t_max=%d, ctx_capacity=%d) failed: "
                 "%s", kSpecDraftThreads, t_max, ctx_capacity, cudaGetErrorString(e));
}

__global__ void __launch_bounds__(32)
spec_accept_kernel(const int32_t* v_ids, const int32_t* row_ids, int32_t* token_in, int32_t* pos,
                   int32_t* ctx_tokens, int ctx_capacity, int64_t* counter, int32_t* state,
                   int64_t* host, int32_t* host_ring, int ring_size, const int32_t* stops,
                   int32_t* halt) {
  griddep_wait();   // row_ids come from sample_token right before
  griddep_launch_dependents();
  if (threadIdx.x != 0) return;
  const int T = state[kSpecT], kd = T - 1;
  const int p = pos[0];
  const int64_t c = counter[0];
  const int n_stops = stops != nullptr ? min(stops[0], 8) : 0;
  const auto is_stop = [&](int32_t t) {
    for (int i = 0; i < n_stops; ++i)
      if (stops[1 + i] == t) return true;
    return false;
  };
  // Sampler.verify's rule (engine/backends/base.py _verify_step): row i's id is emitted; the
  // draft after it is kept iff they are equal; a rejection or a kept stop id ends the step;
  // with every draft kept, the last row's id is emitted too
  int32_t out[kMaxVerifyQueries];
  int e = 0, kept = 0;
  bool stop = false;
  for (int i = 0; i < kd; ++i) {
    const int32_t t = row_ids[i];
    out[e++] = t;
    if (t != v_ids[i + 1]) {
      stop = is_stop(t);
      break;
    }
    ++kept;
    if (is_stop(t)) {
      stop = true;
      break;
    }
  }
  if (kept == kd && !stop) {
    out[e++] = row_ids[kd];
    stop = is_stop(row_ids[kd]);
  }
  // the step's time shared by its ids (each one's time is the previous one's plus an equal
  // share), so the host's per-id times are the effective rate: the previous id's time is in
  // its ring slot (id c - 1; the prefill wrote id 0)
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  const volatile int32_t* prev = host_ring + 4 * ((c - 1) % ring_size);
  const uint64_t t0 = (uint64_t)(uint32_t)prev[2] | ((uint64_t)(uint32_t)prev[3] << 32);
  const uint64_t span = now > t0 ? now - t0 : 0;
  for (int j = 0; j < e; ++j) {
    const int q = p + 1 + j;   // id j's position (the next step forwards the last one)
    if (q < ctx_capacity) ctx_tokens[q] = out[j];
    ring_write(host_ring, ring_size, c + j, out[j], t0 + span * (uint64_t)(j + 1) / (uint64_t)e);
  }
  token_in[0] = out[e - 1];
  pos[0] = p + e;
  counter[0] = c + e;
  if (stop || c + e >= (int64_t)state[kSpecTotal]) *reinterpret_cast<volatile int32_t*>(halt) = 1;
  int k = state[kSpecK];
  k = kept == kd ? min(state[kSpecKMax], k + 2) : max(state[kSpecKMin], kept + 1);
  state[kSpecK] = k;
  const int drafted = state[kSpecDrafted] + kd, accepted = state[kSpecAccepted] + kept,
            steps = state[kSpecVerifySteps] + 1;
  state[kSpecDrafted] = drafted;
  state[kSpecAccepted] = accepted;
  state[kSpecVerifySteps] = steps;
  volatile int64_t* h = reinterpret_cast<volatile int64_t*>(host);
  h[kSpecHostDrafted] = drafted;
  h[kSpecHostAccepted] = accepted;
  h[kSpecHostVerifySteps] = steps;
}

cudaError_t spec_accept(const int32_t* v_ids, const int32_t* row_ids, int32_t* token_in,
                        int32_t* pos, int32_t* ctx_tokens, int ctx_capacity, int64_t* counter,
                        int32_t* state, int64_t* host, int32_t* host_ring, int ring_size,
                        const int32_t* stops, int32_t* halt, cudaStream_t stream) {
  if (ring_size <= 0 || host_ring == nullptr || halt == nullptr || host == nullptr)
    return nq_fail(cudaErrorInvalidValue, "spec_accept: ring_size=%d, ring %s, halt %s, host %s",
                   ring_size, host_ring ? "set" : "null", halt ? "set" : "null",
                   host ? "set" : "null");
  const cudaError_t e = launch_pdl("spec_accept_kernel", spec_accept_kernel, dim3(1), dim3(32), 0,
                                   stream, v_ids, row_ids, token_in, pos, ctx_tokens,
                                   ctx_capacity, counter, state, host, host_ring, ring_size,
                                   stops, halt);
  if (e == cudaSuccess) return e;
  return nq_fail(e, "spec_accept: ring_size=%d: %s", ring_size, last_error_message());
}

}  // namespace nanoqwen
