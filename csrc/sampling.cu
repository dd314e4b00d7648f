// GPU sampling and the end-of-step "advance" kernel.
//
// The sampler is one thread-block cluster (up to 16 blocks of 512 threads, one an SM): block r
// holds ids [c0, c0 + n) of the vocabulary (a slice of ceil(V / blocks) rounded up to 4) in its
// shared memory, and every pass over the vocabulary is a pass over the slices, in parallel,
// with the blocks' partial results exchanged through distributed shared memory (each block
// publishes its part, one cluster barrier, each block reads all parts and computes the same
// total). The steps, in the reference sampler's order (engine/sampling.py):
//   1. repetition penalty over the distinct ids of the last repeat_last_n context ids: every
//      copy of an id writes f(original) into the slice, so a repeated id is penalised once
//      whatever the order of the (benign, same-value) writes.
//   2. greedy: argmax, lowest id on ties. Done.
//   3. top-k: the k-th largest logit by a 4-pass radix select over order-preserving 32-bit
//      keys (ties at the k-th value are all kept).
//   4. top-p: the largest threshold whose kept mass reaches top_p * Z, by the same radix
//      walk over exp(l - max) masses. Masses are 2^32 fixed point summed with integer
//      atomics and integer exchanges, so the result depends neither on the order of the
//      additions nor on how the vocabulary is cut into slices: graph and eager replays,
//      reruns and any number of blocks draw the same token. The resolution drops tokens whose
//      probability is below 2^-32 of the top token's, which top-p never keeps anyway.
//   5. min-p: logit >= max + log(min_p).
//   6. temperature: weights exp((l - max)/T) (2^32 fixed point), one draw from
//      Philox4x32-10(key = seed, counter = step counter), located walking the ids in ascending
//      order (slices in rank order, each thread's contiguous run in thread order).
// One algorithm for every setting: the radix passes run on slices in shared memory, so each
// costs a few microseconds instead of the ~100 us one block streaming the 152064 logits from L2
// took (the single-block sampler of sessions 1-24 needed histogram fast paths and their
// fallbacks to stay near the 3% budget of issue 12 item 3; benchmarks/RESULTS.md, session 25).
// A slice longer than the shared row (V > blocks * kRowCap) is read from global memory (logits,
// or `work` when penalised) by the same code. `blocks` = 1 runs the same code in one block over
// the whole vocabulary: the tests' reference for the decomposition.
// Parameters are read from device memory on every call (no graph re-capture when they change).
#include <cooperative_groups.h>
#include <math_constants.h>

#include "common.cuh"
#include "kernels.h"

namespace nanoqwen {
namespace cg = cooperative_groups;

constexpr int kSampleThreads = 512;
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr int kMaxSampleBlocks = 16;  // the largest cluster Hopper schedules (non-portable)
// floats of its slice a block keeps in shared memory: 80 KB, so 8 blocks hold Qwen's 152064
constexpr int kRowCap = 20480;
// the radix passes' per-warp histograms, after the row in the dynamic buffer: 256 bins of
// three 32-bit words (a mass's parts; counts use the first) a warp
constexpr int kWarpHistWords = kSampleWarps * 256 * 3;
// 128 KB of dynamic shared memory (+ ~6 KB static): one block an SM, so a cluster's blocks
// run on as many SMs
constexpr int kSampleSmemBytes = kRowCap * 4 + kWarpHistWords * 4;
// the largest vocabulary: a warp then sees at most 32 * ceil((2^19 + 3) / 512) = 32800 ids, so
// a histogram word (at most that many adds of < 2^16) stays below 2^32 (cluster_radix)
constexpr int kMaxSampleVocab = 1 << 19;
// the automatic block count: one block per this many ids, at least 1 (small vocabularies)
constexpr int kIdsPerBlockMin = 2048;

__device__ __forceinline__ uint32_t float_key(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // larger float -> larger key
}

__device__ __forceinline__ uint4 philox4x32_10(uint4 ctr, uint2 key) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t lo0 = 0xD2511F53u * ctr.x, hi0 = __umulhi(0xD2511F53u, ctr.x);
    const uint32_t lo1 = 0xCD9E8D57u * ctr.z, hi1 = __umulhi(0xCD9E8D57u, ctr.z);
    ctr = make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
    key.x += 0x9E3779B9u;
    key.y += 0xBB67AE85u;
  }
  return ctr;
}

// exp((v - mx) * inv_t) in 2^32 fixed point (<= 2^32 for v <= mx): sums of these are exact
// integers, so they do not depend on the order of the additions.
__device__ __forceinline__ unsigned long long fixed_mass(float v, float mx, float inv_t) {
  return __float2ull_rn(__expf((v - mx) * inv_t) * 4294967296.0f);
}

// top-p's target mass: ceil(top_p * z), at least 1 and at most z.
__device__ __forceinline__ unsigned long long top_p_target(float top_p, unsigned long long z) {
  const unsigned long long t = (unsigned long long)ceil((double)top_p * (double)z);
  return t < 1ull ? 1ull : (t > z ? z : t);
}

// min-p's floor logit max + log(min_p) (__fadd_rn: never fused into a neighbouring multiply).
__device__ __forceinline__ float min_p_floor(float mx, float min_p) {
  return __fadd_rn(mx, logf(min_p));
}

// The draw: a point in [0, total) from 53 bits of Philox4x32-10(key = seed, counter).
__device__ unsigned long long draw_pick(const int64_t* counter, uint64_t seed,
                                        unsigned long long total) {
  const uint64_t ctr = (uint64_t)counter[0];
  const uint4 r = philox4x32_10(make_uint4((uint32_t)ctr, (uint32_t)(ctr >> 32), 0x6e716e71u, 0u),
                                make_uint2((uint32_t)seed, (uint32_t)(seed >> 32)));
  const double u = (double)(((uint64_t)r.x << 21) ^ ((uint64_t)r.y >> 11)) *
                   (1.0 / 9007199254740992.0);  // 53 random bits in [0, 1)
  unsigned long long pick = (unsigned long long)(u * (double)total);
  return pick >= total ? total - 1 : pick;
}

// This block's part of the vocabulary: ids c0 .. c0 + n - 1, their (penalised) logits at
// row[0 .. n) (shared memory, or global memory when the slice is longer than kRowCap).
struct Slice {
  const float* row;
  int c0, n;
};

// Static shared memory. The *_x arrays are what other blocks of the cluster read (double
// buffered by the exchange's parity: a block rewrites buffer p only after the next exchange's
// cluster barrier, which every block reaches after its reads of buffer p).
struct SampleShared {
  unsigned long long hist_x[2][256];  // this block's radix histogram
  unsigned long long sum_x[2];        // this block's sum (z, the draw's weights)
  float max_x[2];                     // this block's argmax
  int idx_x[2];
  unsigned long long tot[256];        // the cluster's histogram
  unsigned long long red[kSampleWarps];
  float redf[kSampleWarps];
  int redi[kSampleWarps];
  unsigned long long sel_rem, all_sum, below_sum;
  int sel_digit;
  float max_val;
  int max_idx;
};

__device__ __forceinline__ void cluster_sync() { cg::this_cluster().sync(); }
template <class T>
__device__ __forceinline__ const T& remote(T& x, int rank) {
  return *cg::this_cluster().map_shared_rank(&x, (unsigned)rank);
}

// Block-wide uint64 sum (all threads get it). Called by every thread, outside warp branches.
__device__ unsigned long long block_sum_u64(unsigned long long v, SampleShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) sh.red[warp] = v;
  __syncthreads();
  unsigned long long r = lane < kSampleWarps ? sh.red[lane] : 0ull;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
  return r;
}

// Exclusive scan of `mine` over the block in thread order; `total` gets the block's sum.
// Called by every thread, outside warp branches.
__device__ unsigned long long block_excl_scan_u64(unsigned long long mine, SampleShared& sh,
                                                  unsigned long long& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long other = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += other;
  }
  __syncthreads();
  if (lane == 31) sh.red[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    unsigned long long t = lane < kSampleWarps ? sh.red[lane] : 0ull;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long other = __shfl_up_sync(0xffffffffu, t, o);
      if (lane >= o) t += other;
    }
    if (lane < kSampleWarps) sh.red[lane] = t;  // inclusive totals of warps 0..lane
  }
  __syncthreads();
  total = sh.red[kSampleWarps - 1];
  return incl - mine + (warp > 0 ? sh.red[warp - 1] : 0ull);
}

// The cluster's sum of every block's `block_total` (sh.all_sum) and the sum over the blocks of
// lower rank (sh.below_sum). Called by every thread of every block, outside warp branches.
__device__ void cluster_sum(unsigned long long block_total, SampleShared& sh, int& ph) {
  const cg::cluster_group cl = cg::this_cluster();
  const int nb = (int)cl.num_blocks(), me = (int)cl.block_rank();
  const int lane = threadIdx.x & 31;
  const int p = ph++ & 1;
  if (threadIdx.x == 0) sh.sum_x[p] = block_total;
  cluster_sync();
  if (threadIdx.x < 32) {
    const unsigned long long v = lane < nb ? remote(sh.sum_x[p], lane) : 0ull;
    unsigned long long all = v, below = lane < me ? v : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      all += __shfl_xor_sync(0xffffffffu, all, o);
      below += __shfl_xor_sync(0xffffffffu, below, o);
    }
    if (lane == 0) {
      sh.all_sum = all;
      sh.below_sum = below;
    }
  }
  __syncthreads();
}

// Calls f(v, j, in) for j = 0 .. s.n - 1 of the slice, threads striding kSampleThreads with
// kB loads in flight; every lane makes the same calls (in == false past the end, v then 0),
// so f may use warp intrinsics.
template <class F>
__device__ __forceinline__ void for_slice(const Slice& s, F&& f) {
  constexpr int kB = 4;
  for (int j0 = 0; j0 < s.n; j0 += kB * kSampleThreads) {
    float vb[kB];
#pragma unroll
    for (int u = 0; u < kB; ++u) {
      const int j = j0 + u * kSampleThreads + threadIdx.x;
      vb[u] = j < s.n ? s.row[j] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kB; ++u) {
      const int j = j0 + u * kSampleThreads + threadIdx.x;
      f(vb[u], j, j < s.n);
    }
  }
}

// Argmax over the cluster (lowest id on ties; all -inf or NaN: id 0) into sh.max_val /
// sh.max_idx of every block. Called by every thread, outside warp branches.
__device__ void cluster_argmax(const Slice& s, SampleShared& sh, int& ph) {
  const cg::cluster_group cl = cg::this_cluster();
  const int nb = (int)cl.num_blocks();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float bv = -CUDART_INF_F;
  int bi = 0x7fffffff;
  // each thread visits its ids in ascending order and only a strictly larger value replaces
  for_slice(s, [&](float v, int j, bool in) {
    if (in && v > bv) { bv = v; bi = s.c0 + j; }
  });
  const auto merge = [&](float ov, int oi) {
    if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
  };
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    merge(__shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
  if (lane == 0) { sh.redf[warp] = bv; sh.redi[warp] = bi; }
  __syncthreads();
  const int p = ph++ & 1;
  if (warp == 0) {  // no block barrier inside: shuffles only
    bv = lane < kSampleWarps ? sh.redf[lane] : -CUDART_INF_F;
    bi = lane < kSampleWarps ? sh.redi[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      merge(__shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    if (lane == 0) { sh.max_x[p] = bv; sh.idx_x[p] = bi; }
  }
  cluster_sync();
  if (warp == 0) {
    bv = lane < nb ? remote(sh.max_x[p], lane) : -CUDART_INF_F;
    bi = lane < nb ? remote(sh.idx_x[p], lane) : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      merge(__shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    if (lane == 0) {
      sh.max_val = bv;
      sh.max_idx = bi == 0x7fffffff ? 0 : bi;  // never an out-of-range id
    }
  }
  __syncthreads();
}

// One radix step over sh.tot: the largest digit d with sum(tot[>= d]) >= remaining into
// sh.sel_digit, remaining - sum(tot[> d]) into sh.sel_rem (digit 0 and `remaining` when no
// digit qualifies: only for remaining == 0 or a sum below it, which valid inputs never give).
// Warp 0 only works; the caller's barrier before it published tot and the initial values.
__device__ void radix_pick(unsigned long long remaining, SampleShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp == 0) {
    unsigned long long v[8], mine = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) { v[j] = sh.tot[lane * 8 + j]; mine += v[j]; }
    unsigned long long suffix = mine;  // sum over lanes >= this lane
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long other = __shfl_down_sync(0xffffffffu, suffix, o);
      if (lane + o < 32) suffix += other;
    }
    const unsigned long long above = suffix - mine;
    if (above < remaining && remaining <= suffix) {  // exactly one lane
      unsigned long long acc = above;
#pragma unroll
      for (int j = 7; j >= 0; --j) {
        if (acc + v[j] >= remaining) {
          sh.sel_digit = lane * 8 + j;
          sh.sel_rem = remaining - acc;
          break;
        }
        acc += v[j];
      }
    }
  }
  __syncthreads();
}

// Largest key t with weight(key >= t, key >= floor_key) >= target over the cluster, where
// weight is 1 per token (counting) or the fixed-point mass exp(l - mx) * 2^32. Four passes of
// 8 bits; each block histograms its slice, the blocks' histograms are summed through the
// cluster and every block picks the same digit. Called by every thread, outside warp branches.
// A block's histogram is the sum of per-warp ones of 32-bit words: counts, or a mass cut into
// three parts (bits 0-15, 16-31, 32-) so that each part's word stays below 2^32 (a warp sees
// at most 32800 ids: V <= kMaxSampleVocab). Each lane merges its run of ids that fall in
// the same bin in a register and adds the run with plain 32-bit shared atomics (whose result
// nothing waits for) when the bin changes: the first pass, where most ids share a digit, adds
// about once per lane, later passes about once per taken id. Every sum is an exact integer, so
// the histogram, and the token, are the same as any other order of the additions gives.
template <bool kMass>
__device__ uint32_t cluster_radix(const Slice& s, uint32_t floor_key, float mx,
                                  unsigned long long target, SampleShared& sh, int& ph) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kParts = kMass ? 3 : 1;
  unsigned* whist = reinterpret_cast<unsigned*>(smem_raw + kRowCap * 4);
  const cg::cluster_group cl = cg::this_cluster();
  const int nb = (int)cl.num_blocks();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned* my = whist + warp * (256 * kParts);  // part q of bin b at my[q * 256 + b]
  uint32_t prefix = 0, mask = 0;
  unsigned long long remaining = target;
  for (int shift = 24; shift >= 0; shift -= 8) {
#pragma unroll
    for (int b = lane; b < 256 * kParts; b += 32) my[b] = 0u;
    __syncwarp();
    uint32_t run_bin = 0;
    unsigned long long run = 0;  // this lane's weight of run_bin not yet added
    const auto flush = [&]() {
      if (run == 0) return;
      if constexpr (kMass) {
        atomicAdd(&my[run_bin], (unsigned)(run & 0xFFFFu));
        atomicAdd(&my[256 + run_bin], (unsigned)((run >> 16) & 0xFFFFu));
        atomicAdd(&my[512 + run_bin], (unsigned)(run >> 32));
      } else {
        atomicAdd(&my[run_bin], (unsigned)run);
      }
    };
    for_slice(s, [&](float v, int, bool in) {
      if (!in) return;
      const uint32_t key = float_key(v);
      if ((key & mask) != prefix || key < floor_key) return;
      const unsigned long long w = kMass ? fixed_mass(v, mx, 1.0f) : 1ull;  // <= 2^32
      if (w == 0) return;  // below 2^-32 of the max: no mass
      const uint32_t bin = (key >> shift) & 255u;
      if (bin != run_bin) {
        flush();
        run_bin = bin;
        run = 0;
      }
      run += w;
    });
    flush();
    __syncthreads();
    const int p = ph++ & 1;
    if (threadIdx.x < 256) {
      unsigned long long t = 0;
#pragma unroll
      for (int w = 0; w < kSampleWarps; ++w) {
        const unsigned* h = whist + w * (256 * kParts) + threadIdx.x;
        t += kMass ? (unsigned long long)h[0] + ((unsigned long long)h[256] << 16) +
                         ((unsigned long long)h[512] << 32)
                   : (unsigned long long)h[0];
      }
      sh.hist_x[p][threadIdx.x] = t;
    }
    cluster_sync();
    if (threadIdx.x < 256) {
      unsigned long long t = 0;
#pragma unroll
      for (int r = 0; r < kMaxSampleBlocks; ++r)
        if (r < nb) t += remote(sh.hist_x[p][threadIdx.x], r);
      sh.tot[threadIdx.x] = t;
    }
    if (threadIdx.x == 0) {
      sh.sel_digit = 0;
      sh.sel_rem = remaining;
    }
    __syncthreads();
    radix_pick(remaining, sh);
    prefix |= (uint32_t)sh.sel_digit << shift;
    mask |= 255u << shift;
    remaining = sh.sel_rem;
    __syncthreads();  // sh.sel_* and sh.tot are rewritten by the next pass
  }
  return prefix;
}

// Fixed-point weight of one token for the draw, 0 below the kept set's floor.
__device__ __forceinline__ unsigned long long draw_weight(float v, uint32_t floor_key, float mx,
                                                          float inv_t) {
  return float_key(v) >= floor_key ? fixed_mass(v, mx, inv_t) : 0ull;
}

// Step 6: weights exp((l - max)/T) (2^32 fixed point) of the tokens with key >= floor_key, one
// draw, and the token where the pick lands walking the ids in ascending order: the blocks'
// slices in rank order, in a slice each thread's contiguous run in thread order. Exactly one
// thread of one block writes the token (the max's id when every weight is 0). Called by every
// thread of every block, outside warp branches.
__device__ void cluster_draw(int32_t* out_token, const Slice& s, uint32_t floor_key, float mx,
                             float temperature, uint64_t seed, const int64_t* counter,
                             SampleShared& sh, int& ph) {
  const float inv_t = 1.0f / temperature;
  const int per = (s.n + kSampleThreads - 1) / kSampleThreads;
  const int j0 = min(s.n, (int)threadIdx.x * per), j1 = min(s.n, j0 + per);
  unsigned long long mine = 0;
  for (int j = j0; j < j1; ++j) mine += draw_weight(s.row[j], floor_key, mx, inv_t);
  unsigned long long block_total;
  const unsigned long long excl = block_excl_scan_u64(mine, sh, block_total);
  cluster_sum(block_total, sh, ph);
  const unsigned long long total = sh.all_sum, below = sh.below_sum;
  if (total == 0) {  // +inf or NaN maxima: nothing has a weight
    if (cg::this_cluster().block_rank() == 0 && threadIdx.x == 0) out_token[0] = sh.max_idx;
    return;
  }
  const unsigned long long pick = draw_pick(counter, seed, total);
  if (pick < below || pick >= below + block_total) return;  // another block's
  const unsigned long long local = pick - below;
  if (mine == 0 || local < excl || local >= excl + mine) return;  // another thread's
  unsigned long long acc = excl;
  for (int j = j0; j < j1; ++j) {
    const unsigned long long w = draw_weight(s.row[j], floor_key, mx, inv_t);
    if (w > 0 && local < acc + w) {  // acc <= local holds: the run's earlier weights are below
      out_token[0] = s.c0 + j;
      return;
    }
    acc += w;
  }
}

// The sampler's body (every block of the cluster); the kernel below adds the final barrier.
__device__ __forceinline__ uint32_t sample_body(
    int32_t* __restrict__ out_token, float* __restrict__ work, const float* __restrict__ logits,
    int V, const int32_t* __restrict__ ctx_tokens, int ctx_capacity,
    const int32_t* __restrict__ pos_ptr, const float* __restrict__ params_f,
    const int64_t* __restrict__ params_i, const int64_t* __restrict__ counter, SampleShared& sh) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* s_row = reinterpret_cast<float*>(smem_raw);
  const cg::cluster_group cl = cg::this_cluster();
  const int nb = (int)cl.num_blocks(), me = (int)cl.block_rank();
  int ph = 0;  // exchanges so far (the same in every block: the control flow is uniform)
  const float temperature = params_f[0], top_p = params_f[1], min_p = params_f[2];
  const float penalty = params_f[3];
  const int64_t top_k = params_i[0], last_n = params_i[1];
  const uint64_t seed = (uint64_t)params_i[2];

  // this block's slice: a multiple of 4 ids (16-byte aligned when the logits are)
  const int chunk = (((V + nb - 1) / nb) + 3) & ~3;
  Slice s;
  s.c0 = min(V, me * chunk);
  s.n = min(V, s.c0 + chunk) - s.c0;
  const bool in_smem = chunk <= kRowCap;
  const int n_ctx = min(pos_ptr[0] + 1, ctx_capacity);
  const int window = (last_n < 0 || last_n > n_ctx) ? n_ctx : (int)last_n;
  const bool penalise = penalty != 1.0f && window > 0;
  float* dst = in_smem ? s_row : (penalise ? work + s.c0 : nullptr);

  // 1. the slice (into shared memory, or into `work` when penalised and too long for it)
  if (dst != nullptr) {
    const float* src = logits + s.c0;
    int v4 = 0;
    if ((reinterpret_cast<uintptr_t>(src) & 15u) == 0 && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
      v4 = s.n / 4;
      const float4* s4 = reinterpret_cast<const float4*>(src);
      float4* d4 = reinterpret_cast<float4*>(dst);
      constexpr int kIn = 4;  // loads in flight per thread before the stores
      for (int i0 = threadIdx.x; i0 < v4; i0 += kIn * kSampleThreads) {
        float4 f[kIn];
#pragma unroll
        for (int u = 0; u < kIn; ++u) {
          const int i = i0 + u * kSampleThreads;
          if (i < v4) f[u] = s4[i];
        }
#pragma unroll
        for (int u = 0; u < kIn; ++u) {
          const int i = i0 + u * kSampleThreads;
          if (i < v4) d4[i] = f[u];
        }
      }
    }
    for (int i = 4 * v4 + threadIdx.x; i < s.n; i += kSampleThreads) dst[i] = src[i];
    __syncthreads();  // global writes of the block are visible to it after the barrier
    if (penalise) {
      for (int i = threadIdx.x; i < window; i += kSampleThreads) {
        const int id = ctx_tokens[n_ctx - window + i];
        if (id >= s.c0 && id < s.c0 + s.n) {
          const float v = logits[id];
          dst[id - s.c0] = v > 0.f ? v / penalty : v * penalty;
        }
      }
      __syncthreads();
    }
  }
  s.row = dst != nullptr ? dst : logits + s.c0;

  // 2. greedy
  cluster_argmax(s, sh, ph);
  const float mx = sh.max_val;
  if (temperature <= 0.f) {
    if (me == 0 && threadIdx.x == 0) out_token[0] = sh.max_idx;
    return kPathGreedy;  // cluster-uniform
  }
  uint32_t ran = 0;
  // 3. top-k
  uint32_t floor_key = 0;
  if (top_k > 0 && top_k < V) {
    floor_key = cluster_radix<false>(s, 0u, mx, (unsigned long long)top_k, sh, ph);
    ran |= kPathTopK;
  }
  // 4. top-p over the softmax of the top-k survivors (z == 0: +inf or NaN maxima, no masses)
  if (top_p < 1.0f) {
    unsigned long long z = 0;
    for_slice(s, [&](float v, int, bool in) {
      if (in && float_key(v) >= floor_key) z += fixed_mass(v, mx, 1.0f);
    });
    cluster_sum(block_sum_u64(z, sh), sh, ph);
    z = sh.all_sum;
    if (z > 0) {
      floor_key = cluster_radix<true>(s, floor_key, mx, top_p_target(top_p, z), sh, ph);
      ran |= kPathTopP;
    }
  }
  // 5. min-p (a ratio of probabilities = a difference of logits)
  if (min_p > 0.f) {
    floor_key = max(floor_key, float_key(min_p_floor(mx, min_p)));
    ran |= kPathMinP;
  }
  // 6. temperature + draw
  cluster_draw(out_token, s, floor_key, mx, temperature, seed, counter, sh, ph);
  return ran | kPathDraw;
}

__global__ void __launch_bounds__(kSampleThreads, 1)
sample_kernel(int32_t* __restrict__ out_token, float* __restrict__ work,
              const float* __restrict__ logits, int V, const int32_t* __restrict__ ctx_tokens,
              int ctx_capacity, const int32_t* __restrict__ pos_ptr, const float* __restrict__ params_f,
              const int64_t* __restrict__ params_i, const int64_t* __restrict__ counter,
              int32_t* __restrict__ path) {
  __shared__ SampleShared sh;
  // the row of a multi-row launch (sample_token's rows; a cluster spans blockIdx.x only)
  const int r = (int)blockIdx.y;
  out_token += r;
  work += (size_t)r * V;
  logits += (size_t)r * V;
  pos_ptr += r;
  counter += r;
  griddep_wait();  // logits come from the lm_head GEMV right before (PDL rules: common.cuh)
  griddep_launch_dependents();
  const uint32_t ran = sample_body(out_token, work, logits, V, ctx_tokens, ctx_capacity, pos_ptr,
                                   params_f, params_i, counter, sh);
  const cg::cluster_group cl = cg::this_cluster();
  if (path != nullptr && cl.block_rank() == 0 && threadIdx.x == 0) {
    const bool in_smem = ((((V + (int)cl.num_blocks() - 1) / (int)cl.num_blocks()) + 3) & ~3) <= kRowCap;
    path[0] = (int32_t)(ran | (in_smem ? kPathRowShared : 0u) | (cl.num_blocks() << kPathBlocksShift));
  }
  // no block leaves while another may still read its shared memory (the last exchange)
  cluster_sync();
}

// The largest cluster of sample_kernel blocks (16, 8, 4, 2 or 1) this GPU can run at once.
static int max_sample_blocks() {
  for (int n = kMaxSampleBlocks; n > 1; n >>= 1) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(n);
    cfg.blockDim = dim3(kSampleThreads);
    cfg.dynamicSmemBytes = kSampleSmemBytes;
    cudaLaunchAttribute a[1];
    a[0].id = cudaLaunchAttributeClusterDimension;
    a[0].val.clusterDim.x = n;
    a[0].val.clusterDim.y = 1;
    a[0].val.clusterDim.z = 1;
    cfg.attrs = a;
    cfg.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, sample_kernel, &cfg) == cudaSuccess &&
        clusters > 0)
      return n;
    (void)cudaGetLastError();  // not sticky
  }
  return 1;
}

cudaError_t sample_token(int32_t* out_token, float* work, const float* logits, int V,
                         const int32_t* ctx_tokens, int ctx_capacity, const int32_t* pos,
                         const float* params_f, const int64_t* params_i, const int64_t* counter,
                         cudaStream_t stream, int32_t* path, int blocks, int rows) {
  if (rows < 1 || rows > 65535 || (rows > 1 && path != nullptr))
    return nq_fail(cudaErrorInvalidValue, "sample_token: rows=%d must be 1..65535, and 1 with a "
                   "path", rows);
  if (V <= 0 || ctx_capacity <= 0)
    return nq_fail(cudaErrorInvalidValue, "sample_token: V=%d and ctx_capacity=%d must be >= 1", V,
                   ctx_capacity);
  if (V > kMaxSampleVocab)
    return nq_fail(cudaErrorInvalidValue, "sample_token: V=%d is above the largest vocabulary "
                   "the sampler's histograms hold (%d)", V, kMaxSampleVocab);
  if (blocks < 0 || blocks > kMaxSampleBlocks)
    return nq_fail(cudaErrorInvalidValue, "sample_token: blocks=%d must be 0 (automatic) .. %d",
                   blocks, kMaxSampleBlocks);
  // > 48 KB of dynamic shared memory and clusters of 16 need the attributes (once per process)
  static const cudaError_t attr = set_max_smem(sample_kernel, kSampleSmemBytes);
  if (attr != cudaSuccess) return smem_refused(attr, "sample_token: sample_kernel", kSampleSmemBytes);
  static const cudaError_t np = [] {
    const cudaError_t e =
        cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) (void)cudaGetLastError();
    return e;
  }();
  (void)np;  // refused: the occupancy query of 16 fails and max_sample_blocks() takes 8
  // The occupancy query is made once per process, possibly while the stream is being captured
  // (the engine's first decode step may be the graph's): the thread's capture mode is relaxed
  // around it, the documented way to make a call a global-mode capture might refuse.
  static const int auto_blocks = [] {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    const bool swapped = cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
    const int n = max_sample_blocks();
    if (swapped) (void)cudaThreadExchangeStreamCaptureMode(&mode);
    (void)cudaGetLastError();  // nothing sticky from the query
    return n;
  }();
  const int n = blocks > 0 ? blocks
                           : max(1, min(auto_blocks, (V + kIdsPerBlockMin - 1) / kIdsPerBlockMin));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(n, rows);
  cfg.blockDim = dim3(kSampleThreads);
  cfg.dynamicSmemBytes = kSampleSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute a[2];
  a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a[0].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  a[1].id = cudaLaunchAttributeClusterDimension;
  a[1].val.clusterDim.x = n;
  a[1].val.clusterDim.y = 1;
  a[1].val.clusterDim.z = 1;
  cfg.attrs = a;
  cfg.numAttrs = 2;
  cudaError_t e = cudaLaunchKernelEx(&cfg, sample_kernel, out_token, work, logits, V, ctx_tokens,
                                     ctx_capacity, pos, params_f, params_i, counter, path);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e == cudaSuccess) return e;
  return nq_fail(e, "sample_token: V=%d ctx_capacity=%d rows=%d: launch of a cluster of %d blocks "
                 "x %d threads with %d bytes of dynamic shared memory (PDL %s) failed: %s", V,
                 ctx_capacity, rows, n, kSampleThreads, kSampleSmemBytes,
                 pdl_enabled() ? "on" : "off", cudaGetErrorString(e));
}

__global__ void __launch_bounds__(kAdvanceThreads)
advance_kernel(int32_t* token_in, int32_t* pos, int32_t* ctx_tokens, int ctx_capacity,
               int64_t* counter, int32_t* host_ring, int ring_size, const int32_t* sampled,
               const int32_t* stops, int32_t* halt, const int64_t* params_i) {
  griddep_wait();  // sampled comes from sample_token right before
  griddep_launch_dependents();
  const int32_t t = sampled[0];
  const int32_t p = pos[0] + 1;
  // the n-gram watch (kernels.h): every thread scans a strided share of the earlier ends q
  // for the last n ids, before thread 0 writes pos, counter and ctx_tokens[p] below
  int hit = 0;
  const int64_t w = (params_i != nullptr && halt != nullptr) ? params_i[3] : 0;
  const int n = (int)(w & 0xff);
  if (n > 0 && p < ctx_capacity && !(((w >> 8) & 1) && counter[0] == 0)) {
    // four loads in flight per thread (a 32k context is 32 rounds, not 128 dependent ones)
    constexpr int kIn = 4;
    for (int q0 = n - 1 + (int)threadIdx.x; q0 < p && !hit; q0 += kIn * kAdvanceThreads) {
      int32_t v[kIn];
#pragma unroll
      for (int j = 0; j < kIn; ++j) {
        const int q = q0 + j * kAdvanceThreads;
        v[j] = q < p ? ctx_tokens[q] : -1;   // ids are >= 0
      }
#pragma unroll
      for (int j = 0; j < kIn; ++j) {
        const int q = q0 + j * kAdvanceThreads;
        if (v[j] != t) continue;
        int k = 1;
        while (k < n && ctx_tokens[q - k] == ctx_tokens[p - k]) ++k;
        hit |= k == n;
      }
    }
  }
  hit = __syncthreads_or(hit);
  if (threadIdx.x != 0) return;
  token_in[0] = t;
  pos[0] = p;
  if (p >= 0 && p < ctx_capacity) ctx_tokens[p] = t;
  const int64_t c = counter[0];
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  // pinned host memory, mapped (UVA): the id and time first, then the sequence number the
  // host polls, with a system-scope fence between, so seq == c + 1 implies the id is there
  volatile int32_t* slot = host_ring + 4 * (c % ring_size);
  slot[0] = t;
  slot[2] = (int32_t)(uint32_t)(ns & 0xffffffffu);
  slot[3] = (int32_t)(uint32_t)(ns >> 32);
  __threadfence_system();
  slot[1] = (int32_t)(uint32_t)(c + 1);
  if (stops != nullptr && halt != nullptr) {
    const int n_stops = min(stops[0], 8);
    for (int i = 0; i < n_stops; ++i)
      if (stops[1 + i] == t) *reinterpret_cast<volatile int32_t*>(halt) = 1;
  }
  if (hit) *reinterpret_cast<volatile int32_t*>(halt) = 1;
  counter[0] = c + 1;
}

cudaError_t advance_step(int32_t* token_in, int32_t* pos, int32_t* ctx_tokens,
                         int ctx_capacity, int64_t* counter, int32_t* host_ring, int ring_size,
                         const int32_t* sampled, const int32_t* stops, int32_t* halt,
                         const int64_t* params_i, cudaStream_t stream) {
  if (ring_size <= 0)
    return nq_fail(cudaErrorInvalidValue, "advance_step: ring_size=%d must be >= 1", ring_size);
  const cudaError_t e = launch_pdl("advance_kernel", advance_kernel, dim3(1),
                                   dim3(kAdvanceThreads), 0, stream, token_in, pos, ctx_tokens,
                                   ctx_capacity, counter, host_ring, ring_size, sampled, stops,
                                   halt, params_i);
  if (e == cudaSuccess) return e;
  return nq_fail(e, "advance_step: ctx_capacity=%d ring_size=%d: %s", ctx_capacity, ring_size,
                 last_error_message());
}

}  // namespace nanoqwen
