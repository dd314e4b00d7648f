// GPU sampling and the end-of-step "advance" kernel.
//
// The sampler is one block of 1024 threads over the whole vocabulary, in the reference
// sampler's order (engine/sampling.py):
//   1. repetition penalty over the distinct ids of the last repeat_last_n context ids. The
//      logits are copied to `work` first and every copy of an id writes f(original), so a
//      repeated id is penalised once whatever the order of the (benign, same-value) writes.
//   2. greedy: argmax, lowest id on ties. Done.
//   3. top-k: the k-th largest logit by a 4-pass radix select over order-preserving 32-bit
//      keys (ties at the k-th value are all kept).
//   4. top-p: the largest threshold whose kept mass reaches top_p * Z, by the same radix
//      walk over exp(l - max) masses. Masses are 2^32 fixed point summed with integer
//      atomics, so the result does not depend on the order of the additions: graph and
//      eager replays (and reruns) draw the same token. The resolution drops tokens whose
//      probability is below 2^-32 of the top token's, which top-p never keeps anyway.
//   5. min-p: logit >= max + log(min_p).
//   6. temperature: weights exp((l - max)/T) (2^32 fixed point), one draw from
//      Philox4x32-10(key = seed, counter = step counter), located walking the ids in ascending
//      order (draw_full: sums over contiguous warp ranges, two levels, then one warp's scan).
// The radix passes are the full path; the fast paths below skip them and draw the same token
// (same kept set, same fixed-point weights, same id-order walk). params_i[3] != 0 forces the
// full path: the tests' and bench_step's A/B reference.
// top-k up to 256 (the default 40): the k-th largest per-thread maximum bounds the threshold
// from below, the few tokens above it are compacted and steps 3-6 finish on that list in shared
// memory (sample_top_k_fast). Any other k (or that list overflowing: flat rows): a counting
// histogram of the distance below the max (1/4-nat bins, 64 nats), the crossing bin's 256
// sub-bins and the crossing sub-bin's keys give the k-th largest key (top_k_threshold_wide).
// top-p < 1 then (sample_top_p_fast, over top-k's survivors): one pass sums z and per-warp
// histograms of the distance below the max (1/16-nat bins, exact counts and masses); the bin
// where the mass reaches ceil(top_p * z) holds the threshold; if at most 1024 tokens lie at or
// above it (min-p's floor, when tighter, replaces it) they are compacted in ascending id order
// and steps 4-6 finish on the list with the full z; otherwise (flat rows) the threshold comes
// from that bin's sub-bins (threshold_wide) and the draw runs over the vocabulary (draw_full,
// two levels of warp ranges, coalesced). The radix path remains for what the histograms cannot
// bound: thresholds more than 16 (top-p) or 64 (top-k) nats down, a crossing sub-bin of more
// than 1024 tokens (big ties), z == 0 (+-inf maxima), V > 1048576.
// Measured on the H200 (benchmarks/RESULTS.md, issue 12 item 3): see bench_samplers.py.
// Radix histograms are per warp with same-bin lanes merged first (radix_threshold).
// Parameters are read from device memory on every call (no graph re-capture when they change).
#include <math_constants.h>

#include "common.cuh"
#include "kernels.h"

namespace nanoqwen {

constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr int kWarpHistBytes = kSampleWarps * 256 * 8;  // radix_threshold's per-warp histograms
constexpr int kTopKFastMax = 256;  // the largest top-k sample_top_k_fast is tried for

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

struct SampleShared {
  unsigned long long hist[256];
  unsigned long long red[kSampleWarps];
  float redf[kSampleWarps];
  int redi[kSampleWarps];
  unsigned long long sel_rem;
  int sel_digit;
  float max_val;
  int max_idx;
  unsigned bin_cnt[256];  // sample_top_p_fast: tokens per distance bin (sh.hist: their mass)
  int top_p_bin;          // rows_pick: the bin where the mass reaches the target, or -1
  unsigned top_p_n;       // rows_pick: tokens in bins 0..top_p_bin
  unsigned top_p_in_bin;  // rows_pick: tokens in top_p_bin
  unsigned long long top_p_above;  // rows_pick: base + the mass of bins 0..top_p_bin-1
};

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

// Argmax of src[0..V) (lowest id on ties) into sh.max_val / sh.max_idx.
__device__ void block_argmax(const float* __restrict__ src, int V, SampleShared& sh,
                             uint32_t* thread_max_key = nullptr) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float bv = -CUDART_INF_F;
  int bi = 0x7fffffff;
  // Each thread visits its ids in ascending order and only a strictly larger value replaces,
  // so ties keep the lowest id. The bulk is read as float4 with four loads in flight per
  // thread: one block streams the whole vocabulary (608 KB at 152064), and one dependent
  // 4-byte load per iteration left it bound by L2 latency.
  int v4 = 0;
  if ((reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
    v4 = V / 4;
    const float4* s4 = reinterpret_cast<const float4*>(src);
    constexpr int kIn = 4;
    for (int i0 = threadIdx.x; i0 < v4; i0 += kIn * kSampleThreads) {
      float4 f[kIn];
#pragma unroll
      for (int u = 0; u < kIn; ++u) {
        const int i = i0 + u * kSampleThreads;
        f[u] = i < v4 ? s4[i] : make_float4(-CUDART_INF_F, -CUDART_INF_F, -CUDART_INF_F, -CUDART_INF_F);
      }
#pragma unroll
      for (int u = 0; u < kIn; ++u) {
        const int id = 4 * (i0 + u * kSampleThreads);
        if (f[u].x > bv) { bv = f[u].x; bi = id; }
        if (f[u].y > bv) { bv = f[u].y; bi = id + 1; }
        if (f[u].z > bv) { bv = f[u].z; bi = id + 2; }
        if (f[u].w > bv) { bv = f[u].w; bi = id + 3; }
      }
    }
  }
  for (int i = 4 * v4 + threadIdx.x; i < V; i += kSampleThreads) {
    const float v = src[i];
    if (v > bv) { bv = v; bi = i; }
  }
  if (thread_max_key) thread_max_key[threadIdx.x] = float_key(bv);  // read after barriers below
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
  }
  __syncthreads();
  if (lane == 0) { sh.redf[warp] = bv; sh.redi[warp] = bi; }
  __syncthreads();
  if (warp == 0) {  // no block barrier inside: shuffles only
    bv = sh.redf[lane];
    bi = sh.redi[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) {
      // all -inf (or NaN) logits: fall back to id 0 rather than an out-of-range id
      sh.max_val = bv;
      sh.max_idx = bi == 0x7fffffff ? 0 : bi;
    }
  }
  __syncthreads();
}

// One radix step over sh.hist: the largest digit d with sum(hist[>= d]) >= remaining.
// Sets sh.sel_digit and sh.sel_rem (= remaining - sum(hist[> d])). Warp 0 only works; the
// barrier after it is reached by all threads.
__device__ void radix_pick(unsigned long long remaining, SampleShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp == 0) {
    unsigned long long v[8], mine = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) { v[j] = sh.hist[lane * 8 + j]; mine += v[j]; }
    unsigned long long suffix = mine;  // sum over lanes >= this lane
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long other = __shfl_down_sync(0xffffffffu, suffix, o);
      if (lane + o < 32) suffix += other;
    }
    const unsigned long long above = suffix - mine;
    if (lane == 0 && suffix < remaining) {  // cannot happen for valid inputs: keep all
      sh.sel_digit = 0;
      sh.sel_rem = remaining;
    }
    if (above < remaining && remaining <= suffix) {
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

// Largest key t with weight(key >= t, key >= floor) >= target, where weight is 1 per token
// (counting) or the fixed-point mass exp(l - mx) * 2^32.
template <bool kMass>
__device__ __noinline__ uint32_t radix_threshold(const float* __restrict__ src, int V, uint32_t floor_key,
                                    float mx, unsigned long long target, SampleShared& sh) {
  // Histograms: one private 256-bin copy per warp (dynamic shared memory, kWarpHistBytes), and
  // within a warp the lanes that hit the same bin are merged first (__match_any_sync + an
  // exact integer reduction), so each distinct bin costs one shared atomic per warp step.
  // One shared histogram hit by every lane (session 1) serialised on the few hot bins: logits
  // concentrate in a handful of top digits, and the H200 measured ~2 ms per call at V = 152064.
  // Integer sums, so the result does not depend on the order: still deterministic.
  extern __shared__ unsigned long long whist[];  // [kSampleWarps][256]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long* my = whist + warp * 256;
  uint32_t prefix = 0, mask = 0;
  unsigned long long remaining = target;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < kSampleWarps * 256; i += kSampleThreads) whist[i] = 0ull;
    __syncthreads();
    // kBatch loads in flight per thread before the warp intrinsics (one dependent L2 load
    // per element left each pass bound by latency); same trip count for every lane
    constexpr int kBatch = 8;
    for (int i0 = 0; i0 < V; i0 += kBatch * kSampleThreads) {
      float vb[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = i0 + u * kSampleThreads + threadIdx.x;
        vb[u] = i < V ? src[i] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + u * kSampleThreads + threadIdx.x;
      bool take = false;
      uint32_t bin = 0;
      unsigned long long w = 0;
      if (i < V) {
        const float v = vb[u];
        const uint32_t key = float_key(v);
        if ((key & mask) == prefix && key >= floor_key) {
          w = kMass ? __float2ull_rn(__expf(v - mx) * 4294967296.0f) : 1ull;  // <= 2^32
          take = w != 0;
          bin = (key >> shift) & 255u;
        }
      }
      const unsigned act = __ballot_sync(0xffffffffu, take);
      if (take) {
        const unsigned peers = __match_any_sync(act, bin);
        unsigned long long total;
        if constexpr (kMass) {  // w < 2^33 in three parts whose 32-lane sums fit 32 bits
          const unsigned a = __reduce_add_sync(peers, (unsigned)(w & 0xFFFFu));
          const unsigned b = __reduce_add_sync(peers, (unsigned)((w >> 16) & 0xFFFFu));
          const unsigned c = __reduce_add_sync(peers, (unsigned)(w >> 32));
          total = (unsigned long long)a + ((unsigned long long)b << 16) +
                  ((unsigned long long)c << 32);
        } else {
          total = (unsigned long long)__popc(peers);
        }
        if (lane == __ffs(peers) - 1) atomicAdd(&my[bin], total);
      }
      }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += kSampleThreads) {
      unsigned long long t = 0;
#pragma unroll 8
      for (int w = 0; w < kSampleWarps; ++w) t += whist[w * 256 + b];
      sh.hist[b] = t;
    }
    __syncthreads();
    radix_pick(remaining, sh);
    prefix |= (uint32_t)sh.sel_digit << shift;
    mask |= 255u << shift;
    remaining = sh.sel_rem;
    __syncthreads();  // sh.sel_* are rewritten by the next pass
  }
  return prefix;
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

// min-p's floor logit max + log(min_p). __fadd_rn is never fused into a neighbouring multiply,
// so every call site (full path, finish_compact, sample_top_p_fast) gets the same float.
__device__ __forceinline__ float min_p_floor(float mx, float min_p) {
  return __fadd_rn(mx, logf(min_p));
}

// sample_top_p_fast's histogram: 256 bins of 1/16 nat below the max (16 nats; a token 16 nats
// down has 1e-7 of the top token's probability).
constexpr int kTopPBins = 256;
// Distance below the max in bins: monotone non-increasing in v (so {d < lim} is a top set of
// the logit order) and NaN for NaN. __fsub_rn/__fmul_rn are never contracted: the histogram
// pass and the write pass compute the same value for the same logit.
__device__ __forceinline__ float top_p_bin_dist(float v, float mx) {
  return __fmul_rn(__fsub_rn(mx, v), 16.0f);  // bin_dist(v, mx, 16)
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
    unsigned long long t = sh.red[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long other = __shfl_up_sync(0xffffffffu, t, o);
      if (lane >= o) t += other;
    }
    sh.red[lane] = t;  // inclusive totals of warps 0..lane
  }
  __syncthreads();
  total = sh.red[kSampleWarps - 1];
  return incl - mine + (warp > 0 ? sh.red[warp - 1] : 0ull);
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

// Shared-memory layout of the compact path inside the dynamic buffer (radix_threshold's
// per-warp histograms are not live while it runs): candidate values, ids, masses, a sort
// buffer and the per-thread maxima, kSampleThreads entries each.
struct CompactSmem {
  float* cv;
  int* ci;
  unsigned long long* cw;
  uint32_t* sort;
  uint32_t* tmax;  // float_key of each thread's maximum (block_argmax fills it)
};
__device__ __forceinline__ CompactSmem compact_smem() {
  extern __shared__ unsigned long long whist[];
  CompactSmem c;
  c.cw = whist;                                                    // 8 KB
  c.cv = reinterpret_cast<float*>(whist + kSampleThreads);         // 4 KB
  c.ci = reinterpret_cast<int*>(c.cv + kSampleThreads);            // 4 KB
  c.sort = reinterpret_cast<uint32_t*>(c.ci + kSampleThreads);     // 4 KB
  c.tmax = c.sort + kSampleThreads;                                // 4 KB
  return c;
}

// Sorts kSampleThreads keys in shared memory into descending order (bitonic, one pair per
// thread per stage). Called by every thread, outside warp branches.
__device__ void bitonic_sort_desc(uint32_t* a) {
  const int t = threadIdx.x;
  for (int size = 2; size <= kSampleThreads; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      const int p = t ^ stride;
      if (p > t) {
        const bool desc = (t & size) == 0;
        const uint32_t x = a[t], y = a[p];
        if ((x < y) == desc) {
          a[t] = y;
          a[p] = x;
        }
      }
    }
  }
  __syncthreads();
}

// The ids with key >= floor, in a fixed order (thread-major: thread t's ids t, t+1024, ...; a
// count pass, a block scan, a write pass), into c.cv / c.ci. Returns their number; when it is
// above kSampleThreads nothing is written (block-uniform).
__device__ int compact_candidates(const float* __restrict__ src, int V, uint32_t floor,
                                  const CompactSmem& c, SampleShared& sh) {
  const int t = threadIdx.x;
  unsigned long long mine = 0;
  for (int i = t; i < V; i += kSampleThreads) mine += float_key(src[i]) >= floor;
  unsigned long long n;
  unsigned long long at = block_excl_scan_u64(mine, sh, n);
  if (n > (unsigned long long)kSampleThreads) return (int)min(n, (unsigned long long)INT32_MAX);
  if (mine) {
    for (int i = t; i < V; i += kSampleThreads) {
      const float v = src[i];
      if (float_key(v) >= floor) {
        c.cv[at] = v;
        c.ci[at] = i;
        ++at;
      }
    }
  }
  __syncthreads();
  return (int)n;
}

// Steps 4-6 on the n compacted candidates, of which those with key >= floor_key survived
// top-k: top-p, min-p and the draw on a one-per-thread list in shared memory instead of more
// passes over the whole vocabulary. Same candidate set and the same probabilities as the full
// path (top-p's threshold is the largest kept key whose mass of keys >= it reaches the target,
// as the radix walk finds it); the draw walks the list in its order, which is fixed, so draws
// stay a function of (seed, counter), and when the list is in ascending id order
// (sample_top_p_fast) it is the full path's order: the same token.
// z_given: top-p's total mass z_all is over more than the list (top-k off: the whole
// vocabulary, summed by the caller); otherwise it is the list's own sum (the top-k survivors).
__device__ void finish_compact(int32_t* out_token, int n, uint32_t floor_key, float mx,
                               float temperature, float top_p, float min_p, uint64_t seed,
                               const int64_t* counter, const CompactSmem& c, SampleShared& sh,
                               bool z_given = false, unsigned long long z_all = 0) {
  const int t = threadIdx.x;
  const float v = t < n ? c.cv[t] : 0.f;
  const uint32_t key = t < n ? float_key(v) : 0u;
  const bool have = t < n && key >= floor_key;
  uint32_t floor2 = floor_key;
  if (top_p < 1.0f) {
    const unsigned long long w = have ? fixed_mass(v, mx, 1.0f) : 0ull;
    if (t < n) c.cw[t] = w;
    const unsigned long long z_list = block_sum_u64(w, sh);  // its barriers publish c.cw
    const unsigned long long z = z_given ? z_all : z_list;
    const unsigned long long target = top_p_target(top_p, z);
    unsigned long long m = 0;  // mass of the kept candidates with key >= this one's
    if (have)
      for (int j = 0; j < n; ++j) m += float_key(c.cv[j]) >= key ? c.cw[j] : 0ull;
    if (t == 0) sh.sel_digit = 0;
    __syncthreads();
    if (have && m >= target) atomicMax(reinterpret_cast<unsigned*>(&sh.sel_digit), key);
    __syncthreads();
    floor2 = max(floor2, (uint32_t)sh.sel_digit);
  }
  if (min_p > 0.f) floor2 = max(floor2, float_key(min_p_floor(mx, min_p)));
  const unsigned long long wt =
      have && key >= floor2 ? fixed_mass(v, mx, 1.0f / temperature) : 0ull;
  unsigned long long total;
  const unsigned long long excl = block_excl_scan_u64(wt, sh, total);
  if (t == 0) out_token[0] = sh.max_idx;  // fallback (total > 0 always: the max is kept)
  __syncthreads();
  const unsigned long long pick = draw_pick(counter, seed, total);
  if (wt > 0 && excl <= pick && pick < excl + wt) out_token[0] = c.ci[t];
}

// top-k (0 < k <= kSampleThreads) without the radix passes: the k-th largest of the 1024
// per-thread maxima is a lower bound L of the k-th largest logit (those k maxima are k
// distinct logits >= L), so every top-k token has key >= L, and for any distribution worth
// sampling from only a few more do. The tokens >= L are compacted, their k-th largest key is
// found by sorting (the top-k threshold the radix select would find, ties kept), and steps 4-6
// finish on the list. Returns false (block-uniform) when more than kSampleThreads tokens are
// >= L (a flat distribution); the radix path then runs.
__device__ __noinline__ bool sample_top_k_fast(int32_t* out_token, const float* __restrict__ src, int V,
                                  int top_k, float mx, float temperature, float top_p,
                                  float min_p, uint64_t seed, const int64_t* counter,
                                  SampleShared& sh) {
  const CompactSmem c = compact_smem();
  const int t = threadIdx.x;
  uint32_t lower = 0, floor_key = 0;
  if (top_k < V) {
    c.sort[t] = c.tmax[t];
    bitonic_sort_desc(c.sort);
    lower = c.sort[top_k - 1];
    __syncthreads();  // c.sort is rewritten below
  }
  const int n = compact_candidates(src, V, lower, c, sh);
  if (n > kSampleThreads) return false;
  if (top_k < V) {
    c.sort[t] = t < n ? float_key(c.cv[t]) : 0u;
    bitonic_sort_desc(c.sort);
    floor_key = c.sort[top_k - 1];  // n >= top_k: the k maxima are among the candidates
    __syncthreads();
  }
  finish_compact(out_token, n, floor_key, mx, temperature, top_p, min_p, seed, counter, c, sh);
  return true;
}

// Visits ids [s0, s1) of a warp's contiguous segment, coalesced: the lanes stride 32 and each
// has kB loads in flight before f(v, i, in) runs on them in id order; every lane makes the same
// calls (in == false past s1, v then 0), so f may use warp intrinsics.
template <int kB, class F>
__device__ __forceinline__ void for_segment(const float* __restrict__ src, int s0, int s1,
                                            F&& f) {
  const int lane = threadIdx.x & 31;
  for (int i0 = s0; i0 < s1; i0 += kB * 32) {
    float vb[kB];
#pragma unroll
    for (int u = 0; u < kB; ++u) {
      const int i = i0 + u * 32 + lane;
      vb[u] = i < s1 ? src[i] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kB; ++u) {
      const int i = i0 + u * 32 + lane;
      f(vb[u], i, i < s1);
    }
  }
}

// Fixed-point weight of one token for the draw, 0 below the kept set's floor.
__device__ __forceinline__ unsigned long long draw_weight(float v, uint32_t floor_key, float mx,
                                                          float inv_t) {
  return float_key(v) >= floor_key ? fixed_mass(v, mx, inv_t) : 0ull;
}

// Sum of draw weights over ids [s0, s1) by one warp, coalesced (lanes stride 32, 8 loads in
// flight); every lane gets it. Integer sum: independent of the order.
__device__ unsigned long long warp_weight_sum(const float* __restrict__ src, int s0, int s1,
                                              uint32_t floor_key, float mx, float inv_t) {
  unsigned long long m = 0;
  for_segment<8>(src, s0, s1, [&](float v, int, bool in) {
    if (in) m += draw_weight(v, floor_key, mx, inv_t);
  });
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m += __shfl_xor_sync(0xffffffffu, m, o);
  return m;
}

// Which of the 32 warps' contiguous ranges holds `pick` (0 <= pick < the sum of the ranges'
// weights `wsum`, held by every lane of its warp): its warp index in sh.sel_digit, the pick
// minus the weight before it in sh.sel_rem; `total` gets the sum over all warps. Called by
// every thread, outside warp branches.
__device__ void locate_range(unsigned long long wsum, SampleShared& sh, unsigned long long& total,
                             bool draw, const int64_t* counter, uint64_t seed,
                             unsigned long long pick_in) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned long long excl0 = block_excl_scan_u64(lane == 0 ? wsum : 0ull, sh, total);
  const unsigned long long excl = __shfl_sync(0xffffffffu, excl0, 0);
  const unsigned long long pick = draw ? draw_pick(counter, seed, total) : pick_in;
  if (lane == 0 && wsum > 0 && excl <= pick && pick < excl + wsum) {
    sh.sel_digit = warp;
    sh.sel_rem = pick - excl;
  }
  __syncthreads();
}

// Step 6 over the whole vocabulary: weights exp((l - max)/T) (2^32 fixed point) of the tokens
// with key >= floor_key, one draw, and the token where the pick lands walking the ids in
// ascending order (the same token as any walk in id order: finish_compact's on a list in id
// order). Two levels of contiguous ranges, every read coalesced: the warps' segments of the
// vocabulary, then the chosen segment cut into 32 sub-ranges, one per warp; the warp owning
// the pick's sub-range walks it 32 ids at a time with a warp scan. Called by every thread,
// outside warp branches.
__device__ void draw_full(int32_t* out_token, const float* __restrict__ src, int V,
                          uint32_t floor_key, float mx, float temperature, uint64_t seed,
                          const int64_t* counter, SampleShared& sh) {
  const float inv_t = 1.0f / temperature;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int seg = ((V + kSampleWarps - 1) / kSampleWarps + 31) & ~31;
  if (threadIdx.x == 0) {
    out_token[0] = sh.max_idx;  // fallback (the max is always kept: never used)
    sh.sel_digit = 0;
    sh.sel_rem = 0;
  }
  int s0 = min(V, warp * seg), s1 = min(V, s0 + seg);
  unsigned long long total;
  locate_range(warp_weight_sum(src, s0, s1, floor_key, mx, inv_t), sh, total, true, counter,
               seed, 0ull);
  const int w1 = sh.sel_digit;
  const unsigned long long pick1 = sh.sel_rem;
  __syncthreads();  // read by all before locate_range rewrites them
  const int r0 = min(V, w1 * seg), r1 = min(V, r0 + seg);
  const int sub = ((r1 - r0 + kSampleWarps - 1) / kSampleWarps + 31) & ~31;
  s0 = min(r1, r0 + warp * sub);
  s1 = min(r1, s0 + sub);
  unsigned long long total1;
  locate_range(warp_weight_sum(src, s0, s1, floor_key, mx, inv_t), sh, total1, false, counter,
               seed, pick1);
  if (warp == sh.sel_digit) {  // warp-uniform; shuffles only inside
    unsigned long long acc = 0;
    const unsigned long long pick = sh.sel_rem;
    for (int i0 = s0; i0 < s1; i0 += 32) {
      const int i = i0 + lane;
      const unsigned long long w = i < s1 ? draw_weight(src[i], floor_key, mx, inv_t) : 0ull;
      unsigned long long incl = w;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long other = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += other;
      }
      const unsigned long long lo = acc + incl - w;
      if (w > 0 && lo <= pick && pick < acc + incl) out_token[0] = i;  // exactly one lane
      acc += __shfl_sync(0xffffffffu, incl, 31);
      if (acc > pick) break;  // warp-uniform
    }
  }
}

// sample_top_p_fast's histograms: per warp and bin, u32 rows of the token count and of the
// exact fixed-point mass in two parts (w >> 16 <= 2^16 and w & 0xFFFF): a warp segment holds at
// most 32768 tokens, so every row sum stays below 2^31 and the bin's mass is exact.
// The rows are addressed from the dynamic shared buffer at each use (constant offsets): held
// as pointers they cost six of the kernel's 64 registers and spilled its hot passes.
struct TopPRows {
  __device__ __forceinline__ unsigned* base() const {
    extern __shared__ unsigned long long whist[];
    return reinterpret_cast<unsigned*>(whist);
  }
  __device__ __forceinline__ unsigned& cnt(int k) const { return base()[k]; }
  __device__ __forceinline__ unsigned& hi(int k) const { return base()[kTopPRowWordsC + k]; }
  __device__ __forceinline__ unsigned& lo(int k) const { return base()[2 * kTopPRowWordsC + k]; }
  static constexpr int kTopPRowWordsC = kSampleWarps * 256;
};
constexpr int kTopPRowWords = kSampleWarps * kTopPBins;
// the kernel's dynamic shared memory: the larger of radix_threshold's histograms and the rows
// threshold_wide's band: the crossing bin's logits, when at most this many, in shared memory
// after the rows (one pass over the vocabulary instead of two)
constexpr int kBandCap = 8192;
constexpr int kRowsBytes =
    kWarpHistBytes > 3 * kTopPRowWords * 4 ? kWarpHistBytes : 3 * kTopPRowWords * 4;
constexpr int kSampleSmemBytes = kRowsBytes + kBandCap * 4;
__device__ __forceinline__ float* band_smem() {
  extern __shared__ unsigned long long whist[];
  return reinterpret_cast<float*>(reinterpret_cast<char*>(whist) + kRowsBytes);
}
static_assert(TopPRows::kTopPRowWordsC == kTopPRowWords, "row size");
__device__ __forceinline__ TopPRows top_p_rows() { return TopPRows{}; }
__device__ __forceinline__ void rows_clear(const TopPRows& r) {
  for (int i = threadIdx.x; i < 3 * kTopPRowWords; i += kSampleThreads) r.cnt(i) = 0u;
}
// kMass false (counting): the count row alone (rows_pick<false> reads it as the weight)
template <bool kMass = true>
__device__ __forceinline__ void rows_add(const TopPRows& r, int warp, int b,
                                         unsigned long long w) {
  const int k = warp * kTopPBins + b;
  atomicAdd(&r.cnt(k), 1u);
  if (!kMass) return;
  const unsigned hi = (unsigned)(w >> 16), lo = (unsigned)(w & 0xFFFFull);
  if (hi) atomicAdd(&r.hi(k), hi);
  if (lo) atomicAdd(&r.lo(k), lo);
}

// The rows summed over the warps into sh.hist (exact masses) and sh.bin_cnt (counts); then,
// in warp 0 (shuffles only), the first bin b where base + the mass of bins 0..b reaches
// target: sh.top_p_bin (-1 when none does), sh.top_p_n (tokens in bins 0..b), sh.top_p_in_bin
// (tokens in b) and sh.top_p_above (base + the mass of bins 0..b-1). Called by every thread,
// after a barrier that published the rows; ends with one.
template <bool kMass = true>
__device__ void rows_pick(const TopPRows& r, unsigned long long base, unsigned long long target,
                          SampleShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int b = threadIdx.x; b < kTopPBins; b += kSampleThreads) {
    unsigned long long hi = 0, lo = 0;
    unsigned n = 0;
#pragma unroll 8
    for (int w = 0; w < kSampleWarps; ++w) {
      if (kMass) {
        hi += r.hi(w * kTopPBins + b);
        lo += r.lo(w * kTopPBins + b);
      }
      n += r.cnt(w * kTopPBins + b);
    }
    sh.hist[b] = kMass ? (hi << 16) + lo : (unsigned long long)n;
    sh.bin_cnt[b] = n;
  }
  if (threadIdx.x == 0) sh.top_p_bin = -1;  // unless a lane below finds the bin
  __syncthreads();
  if (warp == 0) {
    static_assert(kTopPBins == 32 * 8, "8 bins per lane");
    unsigned long long v[8], mine = 0;
    unsigned cn[8], cmine = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[j] = sh.hist[lane * 8 + j];
      cn[j] = sh.bin_cnt[lane * 8 + j];
      mine += v[j];
      cmine += cn[j];
    }
    unsigned long long incl = mine;
    unsigned cincl = cmine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long other = __shfl_up_sync(0xffffffffu, incl, o);
      const unsigned cother = __shfl_up_sync(0xffffffffu, cincl, o);
      if (lane >= o) { incl += other; cincl += cother; }
    }
    if (lane == 31 && base + incl < target) sh.top_p_bin = -1;  // no bin reaches it
    if (base + incl - mine < target && target <= base + incl) {  // exactly one lane
      unsigned long long acc = base + incl - mine;
      unsigned cacc = cincl - cmine;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (acc + v[j] >= target) {
          sh.top_p_bin = lane * 8 + j;
          sh.top_p_n = cacc + cn[j];
          sh.top_p_in_bin = cn[j];
          sh.top_p_above = acc;
          break;
        }
        acc += v[j];
        cacc += cn[j];
      }
    }
  }
  __syncthreads();
}

// Distance below the max in bins of 1/scale nat (scale a power of two: top-p's 16, top-k's
// 4), as top_p_bin_dist: monotone non-increasing in v, NaN for NaN, never contracted.
__device__ __forceinline__ float bin_dist(float v, float mx, float scale) {
  return __fmul_rn(__fsub_rn(mx, v), scale);
}

// The exact threshold t* (the largest key whose weight of keys >= it reaches target; weight
// the fixed-point mass exp(l - max) for kMass, else 1 per token) among the tokens with key >=
// floor_key, when it lies in distance bin `bin` (bin_dist at `scale`) and the tokens up to that
// bin are too many for the list (a flat distribution): a pass histograms the bin's tokens into
// 256 sub-bins (exact weights again), the sub-bin where the weight reaches the target is
// compacted (<= kSampleThreads tokens, else false: big ties, the radix path decides) and t* is
// found among its keys, as finish_compact finds it. `above`: the weight of the bins before
// `bin`; `n_bin`: its tokens (with key >= floor_key): up to kBandCap of them are copied to
// shared memory in the one pass, more take a second pass. Returns t* through *key_out.
// Block-uniform result.
// The sub-bin index floor((d - bin) * 256) is monotone in d, which is monotone non-increasing
// in the logit: the sub-bins partition the bin by logit order, so every key in an earlier
// sub-bin is larger than every key in a later one, and weight(key >= k) for k in the crossing
// sub-bin is the weight above it plus its own tokens' with key >= k. d - bin is exact
// (Sterbenz: bin <= d < bin + 1 <= 2 bin, or bin 0) and the * 256 is a power of two.
template <bool kMass>
__device__ bool threshold_wide(const float* __restrict__ src, int s0, int s1, float mx,
                               float scale, uint32_t floor_key, int bin, unsigned n_bin,
                               unsigned long long above, unsigned long long target,
                               SampleShared& sh, uint32_t* key_out) {
  const TopPRows rows = top_p_rows();
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const float fb = (float)bin, fe = (float)(bin + 1);
  // n_bin (the bin's tokens, from the caller's histogram) fits the band: one pass copies them
  // to shared memory and the sub-bins are made from there; else two passes over the vocabulary
  const bool banded = n_bin <= (unsigned)kBandCap;
  float* band = band_smem();
  auto in_bin = [&](float v, float d) {
    return d >= fb && d < fe && float_key(v) >= floor_key;
  };
  auto sub_of = [&](float d) {
    return min((int)__fmul_rn(__fsub_rn(d, fb), 256.0f), kTopPBins - 1);
  };
  rows_clear(rows);
  if (t == 0) sh.top_p_n = 0u;
  __syncthreads();
  for_segment<8>(src, s0, s1, [&](float v, int, bool in) {
    const float d = bin_dist(v, mx, scale);
    const bool take = in && in_bin(v, d);
    if (banded) {  // block-uniform
      const unsigned bal = __ballot_sync(0xffffffffu, take);
      if (bal) {
        unsigned at = 0;
        if (lane == __ffs(bal) - 1) at = atomicAdd(&sh.top_p_n, (unsigned)__popc(bal));
        at = __shfl_sync(0xffffffffu, at, __ffs(bal) - 1) + __popc(bal & ((1u << lane) - 1u));
        if (take && at < (unsigned)kBandCap) band[at] = v;  // at < n_bin: guard anyway
      }
    } else if (take) {
      rows_add<kMass>(rows, warp, sub_of(d), kMass ? fixed_mass(v, mx, 1.0f) : 1ull);
    }
  });
  __syncthreads();
  const int nb = (int)min(sh.top_p_n, (unsigned)kBandCap);
  if (banded) {
    for (int j = t; j < nb; j += kSampleThreads) {
      const float v = band[j];
      rows_add<kMass>(rows, warp, sub_of(bin_dist(v, mx, scale)),
                      kMass ? fixed_mass(v, mx, 1.0f) : 1ull);
    }
    __syncthreads();
  }
  rows_pick<kMass>(rows, above, target, sh);
  const int sub = sh.top_p_bin;
  const unsigned n_sub = sh.top_p_in_bin;
  const unsigned long long base = sh.top_p_above;
  if (sub < 0 || n_sub > (unsigned)kSampleThreads) return false;  // read by all: uniform
  __syncthreads();  // sh.top_p_* are reused below
  // the crossing sub-bin's tokens, in any order (t* does not depend on it); c.* overlays the
  // rows, which rows_pick has read
  const CompactSmem c = compact_smem();
  if (t == 0) sh.top_p_n = 0u;
  __syncthreads();
  if (banded) {
    for (int j = t; j < nb; j += kSampleThreads) {
      const float v = band[j];
      if (sub_of(bin_dist(v, mx, scale)) == sub) {
        const unsigned k = atomicAdd(&sh.top_p_n, 1u);
        if (k < (unsigned)kSampleThreads) c.cv[k] = v;  // k < n_sub by construction
      }
    }
  } else {
    for_segment<8>(src, s0, s1, [&](float v, int, bool in) {
      const float d = bin_dist(v, mx, scale);
      if (in && in_bin(v, d) && sub_of(d) == sub) {
        const unsigned k = atomicAdd(&sh.top_p_n, 1u);
        if (k < (unsigned)kSampleThreads) c.cv[k] = v;
      }
    });
  }
  __syncthreads();
  const int n = (int)min(sh.top_p_n, (unsigned)kSampleThreads);
  const uint32_t key = t < n ? float_key(c.cv[t]) : 0u;
  if (t < n) c.cw[t] = kMass ? fixed_mass(c.cv[t], mx, 1.0f) : 1ull;
  if (t == 0) sh.sel_digit = 0;
  __syncthreads();
  if (t < n) {
    unsigned long long m = base;  // weight of the keys >= this one
    for (int j = 0; j < n; ++j) m += float_key(c.cv[j]) >= key ? c.cw[j] : 0ull;
    if (m >= target) atomicMax(reinterpret_cast<unsigned*>(&sh.sel_digit), key);
  }
  __syncthreads();
  *key_out = (uint32_t)sh.sel_digit;
  __syncthreads();  // read by all before sh.sel_digit is reused
  return true;
}

// top-k's threshold (the k-th largest key, ties kept: what radix_threshold<false> finds) for
// k tokens the compact list cannot hold: a counting histogram of the distance below the max in
// 256 bins of 1/4 nat (64 nats), the bin where the count reaches k, then threshold_wide's
// sub-bins. False (block-uniform: the radix path decides) when the k-th largest lies more than
// 64 nats down or its sub-bin holds more than kSampleThreads tokens.
__device__ __noinline__ bool top_k_threshold_wide(const float* __restrict__ src, int V, float mx, int top_k,
                                     SampleShared& sh, uint32_t* key_out) {
  const TopPRows rows = top_p_rows();
  const int warp = threadIdx.x >> 5;
  const int seg = ((V + kSampleWarps - 1) / kSampleWarps + 31) & ~31;
  const int s0 = min(V, warp * seg), s1 = min(V, s0 + seg);
  constexpr float kScale = 4.0f;
  rows_clear(rows);
  __syncthreads();
  for_segment<8>(src, s0, s1, [&](float v, int, bool in) {
    const float d = bin_dist(v, mx, kScale);
    if (in && d < (float)kTopPBins) rows_add<false>(rows, warp, (int)d, 1ull);
  });
  __syncthreads();
  rows_pick<false>(rows, 0ull, (unsigned long long)top_k, sh);
  const int bin = sh.top_p_bin;
  const unsigned n_bin = sh.top_p_in_bin;
  const unsigned long long above = sh.top_p_above;
  __syncthreads();  // read by all before threshold_wide rewrites them
  if (bin < 0) return false;
  return threshold_wide<false>(src, s0, s1, mx, kScale, 0u, bin, n_bin, above,
                               (unsigned long long)top_k, sh, key_out);
}

// top-p (and min-p) over the tokens with key >= kfloor (top-k's survivors; 0: top-k off),
// without the radix passes. Same kept set, same fixed-point masses and the same draw as the
// full path, so the same token for the same (seed, counter). Below, every set is taken inside
// the survivors (the masses, z and the counts are theirs):
//   scan pass (warp w owns the contiguous ids [w*seg, (w+1)*seg), read coalesced): the total
//     mass z (top-p's denominator, the same integer sum as the full path's), per-warp
//     histograms over d = 16 * (max - l) (256 bins, 16 nats): token counts and exact masses
//     (TopPRows), and per warp the count of min-p's survivors.
//   pick: the first bin b where the histogram's mass reaches top_p's target: the top-p
//     threshold t* (the largest key whose mass of keys >= it reaches the target) lies in b, so
//     U_h = {d < b + 1} holds every token of the top-p set. With min-p, U_F = {l >= max +
//     log(min_p)} also does: if t* lies in U_F it is found exactly (all keys >= t* are in U_F),
//     otherwise no list key reaches the target and min-p's floor decides alone, as on the full
//     path. Both are top sets of the logit order, so one contains the other: take the smaller.
//   write pass: the chosen set in ascending id order (warp segments in order, ballots within
//     a warp) -- the order in which the full path's draw walks the vocabulary, so the same
//     pick lands on the same token -- and finish_compact with the full z.
//   more than kSampleThreads tokens in the chosen set (flat distributions): t* from b's
//     sub-bins (threshold_wide), the floor max(t*, min-p's), and the full path's draw
//     (draw_full) over the vocabulary. With no bin reaching the target (t* more than 16 nats
//     down) but min-p's floor inside the 16 nats, t* is below that floor: the floor decides.
// Returns false (block-uniform) when t* is more than 16 nats down without such a floor, when
// the crossing sub-bin has more than kSampleThreads tokens (big ties), when z == 0 (+-inf
// maxima), or when V > 32 * 32768 (a row could overflow); *z_known then says whether z_out
// holds z for the full path.
// kFloor: kfloor may be above 0 (a compile-time switch: the key test per token costs ~5 us of
// the one block's issue slots at V = 152064 when top-k is off).
template <bool kFloor>
__device__ bool sample_top_p_fast(int32_t* out_token, const float* __restrict__ src, int V,
                                  uint32_t kfloor, float mx, float temperature, float top_p, float min_p,
                                  uint64_t seed, const int64_t* counter, SampleShared& sh,
                                  unsigned long long& z_out, bool& z_known) {
  const TopPRows rows = top_p_rows();
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  z_known = false;
  const int seg = ((V + kSampleWarps - 1) / kSampleWarps + 31) & ~31;  // whole 128 B lines
  if (seg > 32768) return false;  // 32768 tokens * 2^16 per row: the u32 sums stay exact
  const int s0 = min(V, warp * seg), s1 = min(V, s0 + seg);
  const bool use_min_p = min_p > 0.f;
  const float fv = use_min_p ? min_p_floor(mx, min_p) : 0.f;
  const uint32_t fkey = float_key(fv);
  const uint32_t fkey_s = max(fkey, kfloor);  // min-p's survivors among top-k's
  rows_clear(rows);
  __syncthreads();  // the rows overlay block_argmax's tmax (not read on this path)

  const unsigned* my_cnt = &rows.cnt(warp * kTopPBins);
  unsigned long long z = 0;
  unsigned n_f = 0;  // min-p survivors in this warp's segment (warp-uniform)
  // loads in flight per lane before the arithmetic: 4 in this pass (8 spilled at the 64-register
  // cap, and the pass is bound by the expf + 64-bit conversion per token anyway), 8 in the write
  for_segment<4>(src, s0, s1, [&](float v, int, bool seg_in) {
    const bool in = seg_in && (!kFloor || float_key(v) >= kfloor);
    if (in) {
      const unsigned long long w = fixed_mass(v, mx, 1.0f);  // the full path's top-p mass
      z += w;
      const float d = top_p_bin_dist(v, mx);
      if (d < (float)kTopPBins) rows_add(rows, warp, (int)d, w);  // false for NaN
    }
    if (use_min_p) n_f += __popc(__ballot_sync(0xffffffffu, in && float_key(v) >= fkey_s));
  });
  z = block_sum_u64(z, sh);  // its first barrier also publishes the rows
  z_out = z;
  z_known = true;
  if (z == 0) return false;
  const unsigned long long target = top_p_target(top_p, z);
  rows_pick(rows, 0ull, target, sh);
  const int bin = sh.top_p_bin;
  const float lim = (float)(bin + 1);  // U_h = {d < lim}: (int)d <= bin for d in [0, 256)
  // U_F inside U_h iff max + log(min_p) itself lies inside (both are top sets)
  const bool by_key = use_min_p && (bin < 0 || top_p_bin_dist(fv, mx) < lim);
  if (!by_key && bin < 0) return false;
  bool wide = !by_key && sh.top_p_n > (unsigned)kSampleThreads;
  unsigned long long n = 0, at0 = 0;
  unsigned wc = n_f;  // this warp's share of the chosen set
  if (!wide) {
    if (!by_key) {
      unsigned s = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) s += lane * 8 + j <= bin ? my_cnt[lane * 8 + j] : 0u;
      wc = __reduce_add_sync(0xffffffffu, s);
    }
    at0 = block_excl_scan_u64(lane == 0 ? wc : 0ull, sh, n);
    wide = n > (unsigned long long)kSampleThreads;
  }
  if (wide) {  // block-uniform
    uint32_t floor_key;
    const float df = top_p_bin_dist(fv, mx);
    if (by_key && (bin < 0 ? df < (float)kTopPBins : df < (float)bin)) {
      // min-p's floor lies in a bin above t*'s (or inside the 16 nats when t* is further
      // down): every key >= t* that min-p keeps is above the floor, which decides alone
      floor_key = fkey_s;
    } else if (bin < 0) {
      return false;  // t* and min-p's floor both more than 16 nats down
    } else {
      const unsigned long long above = sh.top_p_above;
      const unsigned n_bin = sh.top_p_in_bin;
      __syncthreads();  // read by all before threshold_wide rewrites it
      if (!threshold_wide<true>(src, s0, s1, mx, 16.0f, kfloor, bin, n_bin, above, target, sh,
                                &floor_key))
        return false;
      floor_key = max(floor_key, use_min_p ? fkey_s : kfloor);
    }
    draw_full(out_token, src, V, floor_key, mx, temperature, seed, counter, sh);
    return true;
  }
  // write pass: the rows are dead (read before the scan's barriers), c.cv / c.ci overlay them
  const CompactSmem c = compact_smem();
  if (wc > 0) {  // warp-uniform
    unsigned at = (unsigned)__shfl_sync(0xffffffffu, at0, 0);
    const unsigned lt = (1u << lane) - 1u;
    for_segment<8>(src, s0, s1, [&](float v, int i, bool in) {
      const bool keep = in && (by_key ? float_key(v) >= fkey_s
                                      : top_p_bin_dist(v, mx) < lim &&
                                            (!kFloor || float_key(v) >= kfloor));
      const unsigned bal = __ballot_sync(0xffffffffu, keep);
      const unsigned k = at + __popc(bal & lt);
      if (keep && k < (unsigned)kSampleThreads) {  // k < n by construction; guard anyway
        c.cv[k] = v;
        c.ci[k] = i;
      }
      at += __popc(bal);
    });
  }
  __syncthreads();
  finish_compact(out_token, (int)n, 0u, mx, temperature, top_p, min_p, seed, counter, c, sh,
                 true, z);
  return true;
}

__global__ void __launch_bounds__(kSampleThreads, 1)
sample_kernel(int32_t* __restrict__ out_token, float* __restrict__ work,
              const float* __restrict__ logits, int V, const int32_t* __restrict__ ctx_tokens,
              int ctx_capacity, const int32_t* __restrict__ pos_ptr, const float* __restrict__ params_f,
              const int64_t* __restrict__ params_i, const int64_t* __restrict__ counter,
              int32_t* __restrict__ path) {
  __shared__ SampleShared sh;
  // which stages ran (kPath* bits), written once at the end when `path` is given (tests)
  uint32_t ran = 0;
  const auto done = [&](uint32_t bits) {
    if (path != nullptr && threadIdx.x == 0) path[0] = (int32_t)(ran | bits);
  };
  griddep_wait();  // logits come from the lm_head GEMV right before (PDL rules: common.cuh)
  griddep_launch_dependents();
  const float temperature = params_f[0], top_p = params_f[1], min_p = params_f[2];
  const float penalty = params_f[3];
  const int64_t top_k = params_i[0], last_n = params_i[1];
  const uint64_t seed = (uint64_t)params_i[2];

  // 1. repetition penalty
  const float* src = logits;
  const int n_ctx = min(pos_ptr[0] + 1, ctx_capacity);
  const int window = (last_n < 0 || last_n > n_ctx) ? n_ctx : (int)last_n;
  if (penalty != 1.0f && window > 0) {
    // the copy as float4 with four in flight per thread where both are 16-byte aligned (one
    // dependent 4-byte load per iteration left it bound by L2 latency)
    int v4 = 0;
    if (((reinterpret_cast<uintptr_t>(logits) | reinterpret_cast<uintptr_t>(work)) & 15u) == 0) {
      v4 = V / 4;
      const float4* s4 = reinterpret_cast<const float4*>(logits);
      float4* d4 = reinterpret_cast<float4*>(work);
      constexpr int kIn = 4;
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
    for (int i = 4 * v4 + threadIdx.x; i < V; i += kSampleThreads) work[i] = logits[i];
    __syncthreads();
    for (int i = threadIdx.x; i < window; i += kSampleThreads) {
      const int id = ctx_tokens[n_ctx - window + i];
      if (id >= 0 && id < V) {
        const float v = logits[id];
        work[id] = v > 0.f ? v / penalty : v * penalty;
      }
    }
    __syncthreads();  // global writes of the block are visible to it after the barrier
    src = work;
  }

  // 2. greedy
  block_argmax(src, V, sh, compact_smem().tmax);
  const float mx = sh.max_val;
  if (temperature <= 0.f) {
    if (threadIdx.x == 0) out_token[0] = sh.max_idx;
    done(kPathGreedy);
    return;  // uniform over the block
  }

  // params_i[3] != 0: the full path alone (the radix passes): the A/B reference
  // tests/gpu/test_sampler_fast.py and bench_step.py hold the fast paths to, token for token
  const bool full_path = params_i[3] != 0;
  // 3. top-k. Up to kTopKFastMax (the usual 40): a lower bound from the per-thread maxima,
  // then steps 4-6 on the few tokens above it (sample_top_k_fast). Beyond it that bound lets
  // through more than the list holds on any row (measured on the H200: top-k 1000 fell back
  // on flat and peaked rows alike), so the attempt is not made
  const bool use_top_k = top_k > 0 && top_k < V;
  if (!full_path && use_top_k && top_k <= kTopKFastMax &&
      sample_top_k_fast(out_token, src, V, (int)top_k, mx, temperature, top_p, min_p, seed,
                        counter, sh)) {
    done(kPathTopKFast);
    return;  // block-uniform
  }
  // 3'. the k-th largest key by distance histograms (top_k_threshold_wide), else the radix
  uint32_t floor_key = 0;
  bool have_floor = !use_top_k;
  if (!full_path && use_top_k) {
    have_floor = top_k_threshold_wide(src, V, mx, (int)top_k, sh, &floor_key);
    if (have_floor) ran |= kPathTopKWide;
  }
  // 4'. top-p over the survivors by distance histograms (sample_top_p_fast); the same token
  // as the full path below
  unsigned long long z_all = 0;
  bool z_known = false;
  // (top_k <= kSampleThreads: the list below, as on the full path, which draws in its order)
  if (!full_path && have_floor && top_p < 1.0f && !(use_top_k && top_k <= kSampleThreads) &&
      (use_top_k ? sample_top_p_fast<true>(out_token, src, V, floor_key, mx, temperature, top_p,
                                           min_p, seed, counter, sh, z_all, z_known)
                 : sample_top_p_fast<false>(out_token, src, V, 0u, mx, temperature, top_p,
                                            min_p, seed, counter, sh, z_all, z_known))) {
    done(kPathTopPFast);
    return;  // block-uniform
  }
  if (use_top_k && !have_floor) {
    floor_key = radix_threshold<false>(src, V, 0u, mx, (unsigned long long)top_k, sh);
    ran |= kPathRadixTopK;
  }

  // 3b. top-k left at most one survivor per thread: finish on a compact list
  if (use_top_k && top_k <= kSampleThreads) {
    const CompactSmem c = compact_smem();
    const int n = compact_candidates(src, V, floor_key, c, sh);
    if (n <= kSampleThreads) {
      finish_compact(out_token, n, floor_key, mx, temperature, top_p, min_p, seed, counter, c,
                     sh);
      done(kPathCompact);
      return;  // block-uniform
    }
  }

  // 4. top-p over the softmax of the top-k survivors
  if (top_p < 1.0f) {
    unsigned long long z = z_all;  // sample_top_p_fast's z when it fell back (same floor)
    if (!z_known) {
      for (int i = threadIdx.x; i < V; i += kSampleThreads) {
        const float v = src[i];
        if (float_key(v) >= floor_key) z += fixed_mass(v, mx, 1.0f);
      }
      z = block_sum_u64(z, sh);
    }
    floor_key = radix_threshold<true>(src, V, floor_key, mx, top_p_target(top_p, z), sh);
    ran |= kPathRadixTopP;
  }

  // 5. min-p (a ratio of probabilities = a difference of logits)
  if (min_p > 0.f) floor_key = max(floor_key, float_key(min_p_floor(mx, min_p)));

  // 6. temperature + draw
  draw_full(out_token, src, V, floor_key, mx, temperature, seed, counter, sh);
  done(kPathDrawFull);
}

cudaError_t sample_token(int32_t* out_token, float* work, const float* logits, int V,
                         const int32_t* ctx_tokens, int ctx_capacity, const int32_t* pos,
                         const float* params_f, const int64_t* params_i, const int64_t* counter,
                         cudaStream_t stream, int32_t* path) {
  if (V <= 0 || ctx_capacity <= 0)
    return nq_fail(cudaErrorInvalidValue, "sample_token: V=%d and ctx_capacity=%d must be >= 1", V,
                   ctx_capacity);
  // > 48 KB of dynamic shared memory needs the attribute (common.cuh: once per process)
  static const cudaError_t attr = set_max_smem(sample_kernel, kSampleSmemBytes);
  if (attr != cudaSuccess) return smem_refused(attr, "sample_token: sample_kernel", kSampleSmemBytes);
  const cudaError_t e = launch_pdl("sample_kernel", sample_kernel, dim3(1), dim3(kSampleThreads),
                                   kSampleSmemBytes, stream, out_token, work, logits, V, ctx_tokens,
                                   ctx_capacity, pos, params_f, params_i, counter, path);
  if (e == cudaSuccess) return e;
  return nq_fail(e, "sample_token: V=%d ctx_capacity=%d: %s", V, ctx_capacity,
                 last_error_message());
}

__global__ void advance_kernel(int32_t* token_in, int32_t* pos, int32_t* ctx_tokens,
                               int ctx_capacity, int64_t* counter, int32_t* host_ring,
                               int ring_size, const int32_t* sampled, const int32_t* stops,
                               int32_t* halt) {
  griddep_wait();  // sampled comes from sample_token right before
  griddep_launch_dependents();
  const int32_t t = sampled[0];
  const int32_t p = pos[0] + 1;
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
    const int n = min(stops[0], 8);
    for (int i = 0; i < n; ++i)
      if (stops[1 + i] == t) *reinterpret_cast<volatile int32_t*>(halt) = 1;
  }
  counter[0] = c + 1;
}

cudaError_t advance_step(int32_t* token_in, int32_t* pos, int32_t* ctx_tokens,
                         int ctx_capacity, int64_t* counter, int32_t* host_ring, int ring_size,
                         const int32_t* sampled, const int32_t* stops, int32_t* halt,
                         cudaStream_t stream) {
  if (ring_size <= 0)
    return nq_fail(cudaErrorInvalidValue, "advance_step: ring_size=%d must be >= 1", ring_size);
  const cudaError_t e = launch_pdl("advance_kernel", advance_kernel, dim3(1), dim3(1), 0, stream,
                                   token_in, pos, ctx_tokens, ctx_capacity, counter, host_ring,
                                   ring_size, sampled, stops, halt);
  if (e == cudaSuccess) return e;
  return nq_fail(e, "advance_step: ctx_capacity=%d ring_size=%d: %s", ctx_capacity, ring_size,
                 last_error_message());
}

}  // namespace nanoqwen
