// attention_decode: the decode step's attention -- RoPE of q/k + K/V write + split-K (flash-
// decoding) paged GQA attention + the split merge, in ONE launch (kernels.h says what it promises).
// It replaced rope_kv_write + paged_attention (split + combine kernels; now in
// benchmarks/lab/attention_lab.cu) in the decode step: RESULTS.md, "Fused decode attention".
//
// Two page loops share the grid, the splits, the prologue and the merge (finish_split): the
// warp-specialized TMA kernel on tensor cores (attn_decode_tma_kernel, below; the engine's
// default since session 20: faster at every context measured, RESULTS.md) and the cp.async
// kernel this header describes (NANOQWEN_ATTN_TMA=0, the A/B).
//
// attention_verify (the speculative verify step) is the same kernels with MQ: a query per
// blockIdx.z, its own K/V rows (and those of the step's earlier queries) computed by each block
// from qkv as the decode step computes its one fresh row (attn_decode_kernel's MQ note). It
// replaced rope_kv_write + the same attention reading them from the cache (RESULTS.md, session 31).
//
// Grid (n_kv, num_splits), 4 warps a block; the block of kv head h serves the G = n_heads/n_kv
// query heads that read h, so each K/V row is loaded once for all of them. Split s of kv head h
// takes pages [s*pps, s*pps + pps) with pps = max(ceil(pages / num_splits), min_pps) (min_pps,
// the launcher's argument: fewer, longer splits at short contexts, where the merge's reads cost
// more than a split's own pages).
//
// Block flow:
//   before griddep_wait (PDL; only data written >= 2 launches back, see common.cuh): pos, the
//     page table, the RoPE row, and cp.async of the split's first kDecStages-1 K/V pages into a
//     shared-memory ring. pos is written by the previous step's advance_step, at least three
//     launches back (advance -> embed_gather -> qkv GEMV -> here), and the K/V of positions
//     < pos by earlier steps / prefill. The slot at pos is copied too (stale) but never used.
//   after the wait: q of the block's G query heads rotated (each split block rotates its own
//     copy; 448 pairs for the 7B) into shared memory; the block whose split holds pos rotates k,
//     writes k and v to the cache and keeps them in shared memory, where the score loop takes
//     that one row from instead of the (stale) ring copy.
//   the page loop: one block barrier per page (every thread reaches it; no barrier sits in a
//     warp-dependent branch), the copy of page i+kDecStages-1 is issued right after it.
//     A lane group of HD/8 lanes owns one K/V row (16-byte loads, dims [c*8, c*8+8) per lane),
//     so a warp covers 256/HD rows at once; scores are reduced over the lane group with
//     shuffles; online softmax in base 2 per lane group; tokens >= the split's end (the stale
//     tail of a partial last page) get score -inf and V = 0, so garbage (even inf/NaN) never
//     reaches the sums. Running maxima start at -1e30 (finite), so a lane group that has seen
//     only masked tokens keeps corr = 1, p = 0 and no NaN appears.
//   lane groups merged by shuffles, warps through shared memory (aliasing the drained ring),
//     the split's (m, l, acc) written to ws (ws_acc / ws_ml).
//   "last block": __threadfence, atomicAdd on counters[h]; the block that sees n_active-1
//     merges all active splits of kv head h in split order (M = max m_s, L = sum l_s 2^(m_s-M),
//     out = sum acc_s 2^(m_s-M) / L: the result does not depend on which block finishes last)
//     and resets counters[h] to 0.
#include <cuda.h>  // CUtensorMap and its enums (the encoder comes through the runtime)
#include <cudaTypedefs.h>
#include <math_constants.h>

#include <mutex>

#include "common.cuh"
#include "kernels.h"

namespace nanoqwen {

constexpr int kDecWarps = 4;
constexpr int kDecThreads = kDecWarps * 32;
constexpr int kDecStages = 4;       // K/V pages in the shared-memory ring (3 in flight)

__device__ __forceinline__ void half8_to_float(float (&f)[8], uint4 u) {
  const half2* h = reinterpret_cast<const half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

// The start of a split block, shared by both kernels. MQ (the verify step): blockIdx.z is query
// i at position pos + i, with its own slices of qkv, out, ws and counters.
template <int HD, bool MQ>
__device__ __forceinline__ void query_slices(const half* __restrict__& qkv,
                                             half* __restrict__& out,
                                             float* __restrict__& ws_acc,
                                             float* __restrict__& ws_ml,
                                             int32_t* __restrict__& counters, int n_heads,
                                             int n_kv, int num_splits) {
  if constexpr (MQ) {
    const int qi = blockIdx.z;
    qkv += (size_t)qi * (n_heads + 2 * n_kv) * HD;
    out += (size_t)qi * n_heads * HD;
    ws_acc += (size_t)qi * n_heads * num_splits * HD;
    ws_ml += (size_t)qi * n_heads * num_splits * 2;
    counters += (size_t)qi * n_kv;
  }
}

// This split's pages and tokens: p the position (the query's, for MQ), len the tokens attended
// (positions past the table's end are not in the cache: len stops there), pps pages a split
// (at least min_pps), n_active splits with pages; pages [p_begin, p_end) (np of them) and tokens
// below t_end are this block's; new_t = p where this block holds pos and pos is in the table
// (its k/v row is written by this block), else -1; p_tab the RoPE table row of p (clamped).
// MQ (the verify step): the span's tokens [f_lo, t_end) (nf of them, 0..kMaxVerifyQueries) are
// the step's own positions pos[0].. (verify_fresh_kv); new_t is -1.
// Reads only pos_ptr, written >= 2 launches back (before griddep_wait).
struct SplitSpan {
  int p, n_pages, n_active, p_begin, p_end, np, t_end, new_t, p_tab, f_lo, nf;
};
template <bool MQ>
__device__ __forceinline__ SplitSpan split_span(const int32_t* pos_ptr, int table_len,
                                                int num_splits, int min_pps, int split) {
  SplitSpan s;
  s.p = pos_ptr[0] + (MQ ? (int)blockIdx.z : 0);
  const int cap = table_len * kPageSize;
  const int len = max(min(s.p + 1, cap), 1);
  s.n_pages = (len + kPageSize - 1) / kPageSize;
  const int pps = max((s.n_pages + num_splits - 1) / num_splits, min_pps);
  s.n_active = (s.n_pages + pps - 1) / pps;
  s.p_begin = split * pps;
  s.p_end = min(s.p_begin + pps, s.n_pages);
  s.np = s.p_end - s.p_begin;
  s.t_end = min(s.p_end * kPageSize, len);
  const bool in_cache = s.p >= 0 && s.p < cap;
  s.new_t = !MQ && in_cache && s.p >= s.p_begin * kPageSize && s.p < s.t_end ? s.p : -1;
  s.p_tab = s.p < 0 ? 0 : (s.p < cap ? s.p : cap - 1);
  s.f_lo = max(pos_ptr[0], s.p_begin * kPageSize);  // t_end <= the table's end: all in the cache
  s.nf = MQ ? max(s.t_end - s.f_lo, 0) : 0;
  return s;
}

// The decode step's fresh k/v row of kv head kvh at position p (new_t >= 0: this block holds
// it): k rotated as rope_kv_write rounds it, v as is, into the cache and into s_knew / s_vnew
// for the page loop. All NT threads of the block call it; no barrier inside.
// The G query heads' RoPE, split around griddep_wait as both page loops need it: load() takes
// this thread's cos/sin (tables written long before: safe before the wait), rotate() its pairs
// i = tid + k * NT of the G * HD/2 (qkv is the GEMV's just before: after the wait) and hands
// each rotated pair (rounded to fp16 as rope_kv_write stores it) to store(g, d, lo, hi).
template <int HD, int G, int NT>
struct QRope {
  static constexpr int half_d = HD / 2;
  static constexpr int kPairs = (G * half_d + NT - 1) / NT;
  float c[kPairs], s[kPairs];
  __device__ __forceinline__ void load(int tid, const float* __restrict__ cos_table,
                                       const float* __restrict__ sin_table, int p_tab) {
#pragma unroll
    for (int k = 0; k < kPairs; ++k) {
      const int d = (tid + k * NT) % half_d;
      c[k] = cos_table[(size_t)p_tab * half_d + d];
      s[k] = sin_table[(size_t)p_tab * half_d + d];
    }
  }
  template <class Store>
  __device__ __forceinline__ void rotate(int tid, const half* __restrict__ qkv, int head0,
                                         Store store) const {
#pragma unroll
    for (int k = 0; k < kPairs; ++k) {
      const int i = tid + k * NT;
      if (i < G * half_d) {
        const int g = i / half_d, d = i % half_d;
        const half* x = qkv + (size_t)(head0 + g) * HD;
        half lo, hi;
        rope_pair(__half2float(x[d]), __half2float(x[d + half_d]), c[k], s[k], lo, hi);
        store(g, d, lo, hi);
      }
    }
  }
};

template <int HD, int NT>
__device__ __forceinline__ void write_fresh_kv(half* __restrict__ k_cache,
                                               half* __restrict__ v_cache, half* s_knew,
                                               half* s_vnew, const half* __restrict__ qkv,
                                               const float* __restrict__ cos_table,
                                               const float* __restrict__ sin_table,
                                               const int32_t* __restrict__ page_table, int p,
                                               int p_tab, int kvh, int n_heads, int n_kv) {
  constexpr int half_d = HD / 2;
  const int tid = threadIdx.x;
  const size_t slot = ((size_t)page_table[p / kPageSize] * kPageSize + p % kPageSize) *
                          ((size_t)n_kv * HD) + (size_t)kvh * HD;
  const half* xk = qkv + (size_t)(n_heads + kvh) * HD;
  const half* xv = qkv + (size_t)(n_heads + n_kv + kvh) * HD;
  for (int d = tid; d < half_d; d += NT) {
    half lo, hi;
    rope_pair(__half2float(xk[d]), __half2float(xk[d + half_d]),
              cos_table[(size_t)p_tab * half_d + d], sin_table[(size_t)p_tab * half_d + d],
              lo, hi);
    k_cache[slot + d] = lo;
    k_cache[slot + d + half_d] = hi;
    s_knew[d] = lo;
    s_knew[d + half_d] = hi;
  }
  for (int d = tid; d < HD; d += NT) {
    const half v = xv[d];
    v_cache[slot + d] = v;
    s_vnew[d] = v;
  }
}

// The verify step's own positions in this split block's span (MQ: SplitSpan's [f_lo, f_lo + nf),
// positions pos0 + r of the step, their K/V not yet in the cache): k rotated as rope_kv_write
// rounds it and v as is, from qkv row t - pos0 (qkv0: the step's row 0), into s_knew / s_vnew
// [t - f_lo][HD] for the page loop and, where `write` (the blocks of the last query: their splits
// cover each of the step's positions exactly once), into the cache. 8 dims (16 bytes) a thread
// and item. All NT threads call it; no barrier inside.
template <int HD, int NT>
__device__ __forceinline__ void verify_fresh_kv(half* __restrict__ k_cache,
                                                half* __restrict__ v_cache, half* s_knew,
                                                half* s_vnew, const half* __restrict__ qkv0,
                                                const float* __restrict__ cos_table,
                                                const float* __restrict__ sin_table,
                                                const int32_t* __restrict__ page_table, int pos0,
                                                int f_lo, int nf, bool write, int kvh,
                                                int n_heads, int n_kv) {
  constexpr int half_d = HD / 2, KC = half_d / 8, VC = HD / 8;  // 8-dim items a row
  const size_t row = (size_t)(n_heads + 2 * n_kv) * HD;
  auto slot = [&](int t) {
    return ((size_t)page_table[t / kPageSize] * kPageSize + t % kPageSize) *
               ((size_t)n_kv * HD) + (size_t)kvh * HD;
  };
  for (int i = threadIdx.x; i < nf * (KC + VC); i += NT) {
    if (i < nf * KC) {  // 8 rotated pairs (d, d + HD/2) of k
      const int r = i / KC, d = (i % KC) * 8, t = f_lo + r;
      const half* xk = qkv0 + (size_t)(t - pos0) * row + (size_t)(n_heads + kvh) * HD;
      const uint4 ua = *reinterpret_cast<const uint4*>(xk + d);
      const uint4 ub = *reinterpret_cast<const uint4*>(xk + d + half_d);
      const float4* cs = reinterpret_cast<const float4*>(cos_table + (size_t)t * half_d + d);
      const float4* sn = reinterpret_cast<const float4*>(sin_table + (size_t)t * half_d + d);
      const float4 c0 = cs[0], c1 = cs[1], s0 = sn[0], s1 = sn[1];
      const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
      const float s[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
      const half* a = reinterpret_cast<const half*>(&ua);
      const half* b = reinterpret_cast<const half*>(&ub);
      __align__(16) half lo[8], hi[8];
#pragma unroll
      for (int e = 0; e < 8; ++e)
        rope_pair(__half2float(a[e]), __half2float(b[e]), c[e], s[e], lo[e], hi[e]);
      const uint4 ulo = *reinterpret_cast<const uint4*>(lo);
      const uint4 uhi = *reinterpret_cast<const uint4*>(hi);
      *reinterpret_cast<uint4*>(s_knew + r * HD + d) = ulo;
      *reinterpret_cast<uint4*>(s_knew + r * HD + d + half_d) = uhi;
      if (write) {
        half* ko = k_cache + slot(t);
        *reinterpret_cast<uint4*>(ko + d) = ulo;
        *reinterpret_cast<uint4*>(ko + d + half_d) = uhi;
      }
    } else {  // 8 dims of v
      const int j = i - nf * KC, r = j / VC, d = (j % VC) * 8, t = f_lo + r;
      const uint4 u = *reinterpret_cast<const uint4*>(
          qkv0 + (size_t)(t - pos0) * row + (size_t)(n_heads + n_kv + kvh) * HD + d);
      *reinterpret_cast<uint4*>(s_vnew + r * HD + d) = u;
      if (write) *reinterpret_cast<uint4*>(v_cache + slot(t) + d) = u;
    }
  }
}

// The end of a split block, shared by both kernels: the per-warp partials (s_wm / s_wl [NW][G],
// s_wacc [NW][G][HD], in shared memory, published by a barrier every thread passed) merged into
// the split's (m, l, acc) in ws; then the last active split block of kv head kvh merges all
// active splits into out, in split order, and zeroes counters[kvh]. s_merge: kMergeChunk * 2 * G
// floats of scratch that may alias s_wacc (it is written only after s_wacc's last read and a
// barrier). Called by all NT threads, outside any warp-dependent branch.
template <int HD, int G, int NW, int NT, int kMergeChunk>
__device__ __forceinline__ void finish_split(half* __restrict__ out, float* __restrict__ ws_acc,
                                             float* __restrict__ ws_ml, int32_t* counters,
                                             const float* s_wm, const float* s_wl,
                                             const float* s_wacc, float* s_merge, int* s_last,
                                             int kvh, int split, int num_splits, int n_active,
                                             int head0) {
  const int tid = threadIdx.x;
  for (int i = tid; i < G * HD; i += NT) {
    const int g = i / HD, d = i % HD;
    float M = kNegBig;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, s_wm[w * G + g]);
    float o = 0.f, L = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float f = exp2f(s_wm[w * G + g] - M);  // 0 for a warp that saw only masked tokens
      o = fmaf(s_wacc[(w * G + g) * HD + d], f, o);
      L = fmaf(s_wl[w * G + g], f, L);
    }
    const size_t sl = (size_t)(head0 + g) * num_splits + split;
    ws_acc[sl * HD + d] = o;
    if (d == 0) {
      ws_ml[sl * 2] = M;
      ws_ml[sl * 2 + 1] = L;
    }
  }

  // ---- the last active split block of this kv head merges ----
  __threadfence();  // this thread's ws writes are visible device-wide before the count
  __syncthreads();
  if (tid == 0) *s_last = atomicAdd(&counters[kvh], 1) == n_active - 1;
  __syncthreads();
  if (!*s_last) return;  // block-uniform
  __threadfence();      // acquire side: other blocks' ws writes are read after the count
  // Thread t owns 4 dims (float4) of heads g = t / TPH + k * HPB. Splits come in chunks whose
  // (m, l) are staged in shared memory by one parallel load (a serial loop over L2 loads was
  // ~0.4 us per split); the acc loads of kMergeBatch splits of each of its heads are in flight
  // at once. Per element this is the merge formula above, in split order (chunks > 1 only past
  // kMergeChunk splits, then the running sum is rescaled once per chunk).
  constexpr int TPH = HD / 4, HPB = NT / TPH, HPT = (G + HPB - 1) / HPB, kMergeBatch = 8;
  float* s_mm = s_merge;  // [G][kMergeChunk] maxima, then sums
  float* s_ll = s_mm + G * kMergeChunk;
  const int d4 = (tid % TPH) * 4, gq = tid / TPH;
  float M[HPT], L[HPT];
  float4 o[HPT];
#pragma unroll
  for (int k = 0; k < HPT; ++k) {
    M[k] = kNegBig;
    L[k] = 0.f;
    o[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  for (int c0 = 0; c0 < n_active; c0 += kMergeChunk) {
    const int cn = min(kMergeChunk, n_active - c0);
    __syncthreads();  // the ring / the previous chunk's (m, l) are no longer read
    for (int i = tid; i < G * cn; i += NT) {
      const int g = i / cn, sp = i % cn;
      const float2 ml = __ldcg(reinterpret_cast<const float2*>(
          ws_ml + ((size_t)(head0 + g) * num_splits + c0 + sp) * 2));
      s_mm[g * kMergeChunk + sp] = ml.x;
      s_ll[g * kMergeChunk + sp] = ml.y;
    }
    __syncthreads();
    // the chunk's maximum per head, the running (o, L) rescaled to it
#pragma unroll
    for (int k = 0; k < HPT; ++k) {
      const int g = gq + k * HPB;
      if (g < G) {  // warp-uniform (a warp covers whole heads); no barrier or shuffle inside
        float mc = M[k];
#pragma unroll 8
        for (int sp = 0; sp < cn; ++sp) mc = fmaxf(mc, s_mm[g * kMergeChunk + sp]);
        const float f0 = exp2f(M[k] - mc);  // 0 on the first chunk (o, L are 0 there)
        L[k] *= f0;
        o[k].x *= f0; o[k].y *= f0; o[k].z *= f0; o[k].w *= f0;
        M[k] = mc;
      }
    }
    // then the splits in batches of kMergeBatch, every load of a batch (all HPT heads) issued
    // before any is used: a loop over cn with `#pragma unroll 16` ran its remainder one L2
    // round trip a split (8, 11 or 22 active splits cost 2-5 us more than 16 or 32: RESULTS.md,
    // session 20). Per element the same operations in split order: deterministic.
    for (int b0 = 0; b0 < cn; b0 += kMergeBatch) {
      float4 a[HPT][kMergeBatch];
#pragma unroll
      for (int k = 0; k < HPT; ++k) {
        const int g = gq + k * HPB;
        const float4* ac = reinterpret_cast<const float4*>(
            ws_acc + ((size_t)(head0 + min(g, G - 1)) * num_splits + c0 + b0) * HD + d4);
#pragma unroll
        for (int j = 0; j < kMergeBatch; ++j)
          a[k][j] = g < G && b0 + j < cn ? __ldcg(ac + (size_t)j * (HD / 4))
                                         : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int k = 0; k < HPT; ++k) {
        const int g = gq + k * HPB;
        if (g < G) {
#pragma unroll
          for (int j = 0; j < kMergeBatch; ++j) {
            if (b0 + j < cn) {
              const float f = exp2f(s_mm[g * kMergeChunk + b0 + j] - M[k]);
              L[k] = fmaf(s_ll[g * kMergeChunk + b0 + j], f, L[k]);
              o[k].x = fmaf(a[k][j].x, f, o[k].x);
              o[k].y = fmaf(a[k][j].y, f, o[k].y);
              o[k].z = fmaf(a[k][j].z, f, o[k].z);
              o[k].w = fmaf(a[k][j].w, f, o[k].w);
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < HPT; ++k) {
    const int g = gq + k * HPB;
    if (g < G) {
      half2* dst = reinterpret_cast<half2*>(out + (size_t)(head0 + g) * HD + d4);
      dst[0] = __floats2half2_rn(o[k].x / L[k], o[k].y / L[k]);
      dst[1] = __floats2half2_rn(o[k].z / L[k], o[k].w / L[k]);
    }
  }
  if (tid == 0) counters[kvh] = 0;  // every active block of this kv head has counted
}

// MQ (the verify step, attention_verify): blockIdx.z = query i at position pos + i, its
// q from row i of qkv [T, q + 2kv], its out / ws / counters slices its own. The K/V of positions
// below pos are in the cache; those of the step's own positions pos .. pos + i in the block's
// span are not yet: the block computes them from qkv (verify_fresh_kv, after the wait) and its
// page loop takes them from there instead of the ring's stale copy, as the decode step does for
// its one row, so the page copies still start before griddep_wait; the blocks of the last query
// write them to the cache. Otherwise the block computes exactly what the decode step's block
// computes at that position (same splits, same order), so each query's output is bit-identical
// to attention_decode's there.
template <int HD, int G, bool MQ>
__global__ void __launch_bounds__(kDecThreads)
attn_decode_kernel(half* __restrict__ out, float* __restrict__ ws_acc, float* __restrict__ ws_ml,
                   int32_t* __restrict__ counters, const half* __restrict__ qkv,
                   half* __restrict__ k_cache, half* __restrict__ v_cache,
                   const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                   const int32_t* __restrict__ page_table, int table_len,
                   const int32_t* __restrict__ pos_ptr, int n_heads, int n_kv, int num_splits,
                   int min_pps, float scale_log2) {
  constexpr int LPR = HD / 8;                      // lanes per K/V row (16 B each)
  constexpr int RPW = 32 / LPR;                    // rows a warp covers at once
  constexpr int TPT = kPageSize / (kDecWarps * RPW);  // tokens per thread per page
  static_assert(TPT >= 1 && TPT * kDecWarps * RPW == kPageSize, "page / warp layout");
  constexpr int kPageHalves = kPageSize * HD;      // one page of K (or V) of one kv head
  constexpr int kRingBytes = kDecStages * 2 * kPageHalves * 2;
  constexpr int kMergeBytes = kDecWarps * G * HD * 4;
  static_assert(kMergeBytes <= kRingBytes, "warp-merge buffer aliases the ring");
  constexpr int kChunks = 2 * kPageSize * LPR;     // 16-byte copies per page (K and V)
  static_assert(kChunks % kDecThreads == 0, "copies per thread");

  __shared__ __align__(16) unsigned char s_raw[kRingBytes];
  __shared__ float s_q[G][HD];
  __shared__ __align__(16) half s_knew[(MQ ? kMaxVerifyQueries : 1) * HD];  // fresh rows
  __shared__ __align__(16) half s_vnew[(MQ ? kMaxVerifyQueries : 1) * HD];
  __shared__ float s_wm[kDecWarps][G], s_wl[kDecWarps][G];
  __shared__ int s_last;
  half* ring = reinterpret_cast<half*>(s_raw);     // [stage][K|V][16][HD]
  float* s_wacc = reinterpret_cast<float*>(s_raw); // [warp][g][HD], after the ring is drained

  const int kvh = blockIdx.x, split = blockIdx.y;
  const int head0 = kvh * G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  constexpr int half_d = HD / 2;

  const half* const qkv0 = qkv;  // the step's row 0 (MQ: verify_fresh_kv)
  query_slices<HD, MQ>(qkv, out, ws_acc, ws_ml, counters, n_heads, n_kv, num_splits);
  // ---- before griddep_wait: only data written >= 2 launches back ----
  const SplitSpan sp = split_span<MQ>(pos_ptr, table_len, num_splits, min_pps, split);
  if (sp.p_begin >= sp.n_pages) return;  // empty split: whole block, before any barrier or write
  const int p = sp.p, n_active = sp.n_active, p_begin = sp.p_begin, np = sp.np;
  const int t_end = sp.t_end, new_t = sp.new_t, p_tab = sp.p_tab;
  const size_t slot_stride = (size_t)n_kv * HD;

  auto issue_page = [&](int i) {  // copy page p_begin + i of this kv head into stage i % S
    const size_t page = (size_t)page_table[p_begin + i];
    half* st = ring + (size_t)(i % kDecStages) * 2 * kPageHalves;
#pragma unroll
    for (int k = 0; k < kChunks / kDecThreads; ++k) {
      const int c = tid + k * kDecThreads;
      const int which = c / (kPageSize * LPR), rem = c % (kPageSize * LPR);
      const int row = rem / LPR, col = (rem % LPR) * 8;
      const half* src = (which ? v_cache : k_cache) + (page * kPageSize + row) * slot_stride +
                        (size_t)kvh * HD + col;
      cp_async16(st + which * kPageHalves + row * HD + col, src);
    }
  };
#pragma unroll
  for (int i = 0; i < kDecStages - 1; ++i) {
    if (i < np) issue_page(i);
    cp_async_commit();  // always: keeps the group count uniform for wait_group below
  }
  // this thread's RoPE pairs of q (at most 4 for 8 x 64)
  QRope<HD, G, kDecThreads> qrope;
  qrope.load(tid, cos_table, sin_table, p_tab);

  // ---- after the wait: qkv (the GEMV just before), cache writes, ws, counters ----
  griddep_wait();
  griddep_launch_dependents();

  qrope.rotate(tid, qkv, head0, [&](int g, int d, half lo, half hi) {
    s_q[g][d] = __half2float(lo) * scale_log2;  // q as rope_kv_write would store it
    s_q[g][d + half_d] = __half2float(hi) * scale_log2;
  });
  if (new_t >= 0)  // block-uniform: this split holds pos, and pos is inside the table
    write_fresh_kv<HD, kDecThreads>(k_cache, v_cache, s_knew, s_vnew, qkv, cos_table, sin_table,
                                    page_table, p, p_tab, kvh, n_heads, n_kv);
  if constexpr (MQ)
    if (sp.nf > 0)  // block-uniform
      verify_fresh_kv<HD, kDecThreads>(k_cache, v_cache, s_knew, s_vnew, qkv0, cos_table,
                                       sin_table, page_table, p - (int)blockIdx.z, sp.f_lo, sp.nf,
                                       blockIdx.z == gridDim.z - 1, kvh, n_heads, n_kv);
  __syncthreads();  // s_q, s_knew, s_vnew

  const int grp = lane / LPR, col = (lane % LPR) * 8;
  float qr[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) qr[g][e] = s_q[g][col + e];
  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = kNegBig;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }

  for (int i = 0; i < np; ++i) {
    cp_async_wait<kDecStages - 2>();  // this thread's copies of page i have landed
    __syncthreads();                  // everyone's have; everyone is done with page i-1's stage
    if (i + kDecStages - 1 < np) issue_page(i + kDecStages - 1);
    cp_async_commit();
    const half* st = ring + (size_t)(i % kDecStages) * 2 * kPageHalves;
    const int t0 = (p_begin + i) * kPageSize;
    float kf[TPT][8], vf[TPT][8];
    bool valid[TPT];
#pragma unroll
    for (int j = 0; j < TPT; ++j) {
      const int slot = j * kDecWarps * RPW + warp * RPW + grp;
      const int t = t0 + slot;
      valid[j] = t < t_end;
      // the fresh row(s): the decode step's at new_t, the verify step's from f_lo (MQ)
      const bool fresh = MQ ? valid[j] && t >= sp.f_lo : t == new_t;
      const int fr = MQ ? (t - sp.f_lo) * HD + col : col;
      const uint4 ku = *reinterpret_cast<const uint4*>(fresh ? s_knew + fr : st + slot * HD + col);
      const uint4 vu = *reinterpret_cast<const uint4*>(
          fresh ? s_vnew + fr : st + kPageHalves + slot * HD + col);
      half8_to_float(kf[j], ku);
      half8_to_float(vf[j], vu);
#pragma unroll
      for (int e = 0; e < 8; ++e) vf[j][e] = valid[j] ? vf[j][e] : 0.f;  // 0 * inf would be NaN
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {  // G is a template parameter: heads interleave freely
      {
        float sc[TPT];
        float mn = m[g];
#pragma unroll
        for (int j = 0; j < TPT; ++j) {
          float d0 = 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) d0 = fmaf(qr[g][e], kf[j][e], d0);
#pragma unroll
          for (int o = LPR / 2; o > 0; o >>= 1) d0 += __shfl_xor_sync(0xffffffffu, d0, o);
          sc[j] = valid[j] ? d0 : -CUDART_INF_F;
          mn = fmaxf(mn, sc[j]);
        }
        const float corr = exp2f(m[g] - mn);  // both finite
        float psum = 0.f, pv[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) pv[e] = 0.f;
#pragma unroll
        for (int j = 0; j < TPT; ++j) {
          const float pj = exp2f(sc[j] - mn);  // 0 for masked tokens
          psum += pj;
#pragma unroll
          for (int e = 0; e < 8; ++e) pv[e] = fmaf(pj, vf[j][e], pv[e]);
        }
        l[g] = fmaf(l[g], corr, psum);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(acc[g][e], corr, pv[e]);
        m[g] = mn;
      }
    }
  }

  // lane groups of a warp -> group 0 (xor shuffles; every lane takes part)
#pragma unroll
  for (int o = LPR; o < 32; o <<= 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      {
        const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
        const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
        const float M = fmaxf(m[g], mo);
        const float f = exp2f(m[g] - M), fo = exp2f(mo - M);
        l[g] = fmaf(l[g], f, lo * fo);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float ao = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
          acc[g][e] = fmaf(acc[g][e], f, ao * fo);
        }
        m[g] = M;
      }
    }
  }
  cp_async_wait<0>();  // only empty groups can be left, but drain before the ring is reused
  __syncthreads();     // every warp is done reading the ring
  if (lane < LPR) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      {
#pragma unroll
        for (int e = 0; e < 8; ++e) s_wacc[(warp * G + g) * HD + col + e] = acc[g][e];
        if (lane == 0) {
          s_wm[warp][g] = m[g];
          s_wl[warp][g] = l[g];
        }
      }
    }
  }
  __syncthreads();
  finish_split<HD, G, kDecWarps, kDecThreads, kRingBytes / (8 * G)>(
      out, ws_acc, ws_ml, counters, &s_wm[0][0], &s_wl[0][0], s_wacc,
      reinterpret_cast<float*>(s_raw), &s_last, kvh, split, num_splits, n_active, head0);
}

// ---- the warp-specialized kernel: TMA bulk copies into an mbarrier ring, tensor-core math ------
// Same grid, splits, prologue (pos, pages, RoPE of q, the fresh k/v of pos) and end
// (finish_split) as attn_decode_kernel; the page loop differs. Warp kTmaConsumers (the producer)
// copies each page's K and V through the caches' tensor maps (cp.async.bulk.tensor, HD/64 boxes
// of 16 tokens x 64 dims each, 128-byte swizzle; TmaRing), completing on the stage's `full`
// mbarrier with a transaction count, into a kTmaStages-deep ring, refilling a stage once its
// consumer has arrived on the stage's `empty` mbarrier; the page ids come 32 at a time into the
// producer's lanes, the next window a window ahead. Consumer warp w takes the
// split's pages w, w + kTmaConsumers, ...: S = Q K^T by mma.sync m16n8k16 (A = the G rotated
// query heads as rows, rows G..15 zero; B = 8 tokens of K by ldmatrix), an online softmax in base
// 2 per head row (fp32), then O += P V (A = P rounded to fp16, the accumulator layout of S reused
// as the A fragment; B = V by ldmatrix.trans). Each consumer keeps its own (m, l, acc), merged
// across warps in finish_split. The page holding pos gets its fresh k/v row, and a partial last
// page zeroes its V rows past the end, written by the consuming warp into its stage before it
// reads it (so 0 * garbage never reaches the sums; masked scores are -inf by select).
// Barriers: the block barriers all sit outside the role branches; inside them only the mbarriers
// and __syncwarp order the warps (the seed's lesson: a block barrier in a warp-specialized branch
// is undefined behaviour).
constexpr int kTmaConsumers = 4;
constexpr int kTmaThreads = (kTmaConsumers + 1) * 32;
constexpr int kTmaStages = 8;

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// One box of the tensor map (coordinates innermost first) global -> shared by the copy engine,
// counted against the mbarrier's transaction count when it has landed. The descriptor form, not
// the raw-address cp.async.bulk: 4 requests a page instead of 32 row copies, the 128-byte
// swizzle in shared memory, and compute-sanitizer's racecheck does not attribute the write to
// the issuing thread (it reports every other warp's read of a raw bulk copy's buffer as a
// hazard: RESULTS.md, session 19)
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
      "[%1, {%2, %3, %4}], [%5];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// A stage: K then V of one page of one kv head, each as HD/64 boxes of 16 tokens x 64 dims (128
// bytes a token), swizzled by the copy engine (CU_TENSOR_MAP_SWIZZLE_128B): the 16-byte chunk c
// of token row r lies at chunk c ^ (r & 7), so ldmatrix's 8 rows at one logical chunk fall in 8
// bank groups. The pattern is a function of the address bits, so the ring starts 1024-aligned.
template <int HD>
struct TmaRing {
  static constexpr int kBox = kPageSize * 128;          // 16 tokens x 64 dims of fp16
  static constexpr int kHalfBytes = (HD / 64) * kBox;   // K (or V) of the page
  static constexpr int kStageBytes = 2 * kHalfBytes;
  static constexpr int kBytes = kTmaStages * kStageBytes;
  static constexpr int kSmem = kBytes + 1024;           // + the alignment slack
  static constexpr unsigned kTx = 2u * kPageSize * HD * 2u;   // bytes landing per stage
  // byte offset of token row r, logical 16-byte chunk q (8 fp16 dims: q * 8 .. q * 8 + 7) in a
  // K or V half of a stage
  __device__ static __forceinline__ int at(int r, int q) {
    return (q >> 3) * kBox + r * 128 + (((q & 7) ^ (r & 7)) << 4);
  }
};

template <int HD, int G, bool MQ>
__global__ void __launch_bounds__(kTmaThreads)
attn_decode_tma_kernel(half* __restrict__ out, float* __restrict__ ws_acc,
                       float* __restrict__ ws_ml, int32_t* __restrict__ counters,
                       const half* __restrict__ qkv, half* __restrict__ k_cache,
                       half* __restrict__ v_cache, const float* __restrict__ cos_table,
                       const float* __restrict__ sin_table, const int32_t* __restrict__ page_table,
                       int table_len, const int32_t* __restrict__ pos_ptr, int n_heads, int n_kv,
                       int num_splits, int min_pps, float scale_log2,
                       const __grid_constant__ CUtensorMap tm_k,
                       const __grid_constant__ CUtensorMap tm_v) {
  using Ring = TmaRing<HD>;
  constexpr int NT = HD / 8;  // 8-dim tiles of the output row
  static_assert(G <= 8, "one m16 tile holds the G query heads in rows 0..7");
  static_assert(kTmaConsumers * G * HD * 4 <= Ring::kBytes, "warp partials alias the ring");
  extern __shared__ __align__(128) unsigned char s_dyn[];
  unsigned char* const s_ring = s_dyn + ((1024u - (smem_u32(s_dyn) & 1023u)) & 1023u);
  __shared__ __align__(8) uint64_t s_full[kTmaStages], s_empty[kTmaStages];
  __shared__ __align__(16) half s_qh[G][HD];
  __shared__ __align__(16) half s_knew[(MQ ? kMaxVerifyQueries : 1) * HD];  // fresh rows
  __shared__ __align__(16) half s_vnew[(MQ ? kMaxVerifyQueries : 1) * HD];
  __shared__ float s_wm[kTmaConsumers][G], s_wl[kTmaConsumers][G];
  __shared__ int s_last;

  const int kvh = blockIdx.x, split = blockIdx.y;
  const int head0 = kvh * G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  constexpr int half_d = HD / 2;
  const half* const qkv0 = qkv;  // the step's row 0 (MQ: verify_fresh_kv)
  query_slices<HD, MQ>(qkv, out, ws_acc, ws_ml, counters, n_heads, n_kv, num_splits);
  // ---- before griddep_wait: only data written >= 2 launches back (as attn_decode_kernel) ----
  const SplitSpan sp = split_span<MQ>(pos_ptr, table_len, num_splits, min_pps, split);
  if (sp.p_begin >= sp.n_pages) return;  // empty split: whole block, before any barrier or write
  const int n_active = sp.n_active, p_begin = sp.p_begin, np = sp.np;
  const int t_end = sp.t_end, new_t = sp.new_t, p_tab = sp.p_tab;

  if (tid == 0) {
    for (int s = 0; s < kTmaStages; ++s) {
      mbar_init(&s_full[s], 1);   // the producer's arrive (with the stage's transaction bytes)
      mbar_init(&s_empty[s], 1);  // the consuming warp's arrive
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();  // the barriers are initialised before anyone uses them

  const bool producer = warp == kTmaConsumers;
  // The producer's page ids, 32 at a time in its lanes (lane l: page p_begin + w + l of window w),
  // the next window loaded a window ahead: a page-table load per page, dependent and in the
  // producer's serial loop, cost an L2 latency per page (the first GPU run: 40 us at 32768).
  // Read before griddep_wait (the table is written >= 2 launches back).
  int win = 0, nxt = 0;
  auto load_windows = [&] {
    win = lane < np ? page_table[p_begin + lane] : 0;
    nxt = 32 + lane < np ? page_table[p_begin + 32 + lane] : 0;
  };
  // page p_begin + i of this kv head (its id from the window) into stage i % kTmaStages: lane 0
  // arms the stage with the byte count and requests the HD/64 boxes of K and of V. Every lane
  // of the producer warp calls it (the window's shuffle).
  auto issue_page = [&](int i) {
    if (i > 0 && i % 32 == 0) {  // warp-uniform: the next window, and the one after it requested
      win = nxt;
      nxt = i + 32 + lane < np ? page_table[p_begin + i + 32 + lane] : 0;
    }
    const int page = __shfl_sync(0xffffffffu, win, i & 31);
    if (lane == 0) {
      uint64_t* bar = &s_full[i % kTmaStages];
      mbar_expect_tx(bar, Ring::kTx);
      unsigned char* st = s_ring + (size_t)(i % kTmaStages) * Ring::kStageBytes;
#pragma unroll
      for (int hb = 0; hb < HD / 64; ++hb) {
        tma_load_3d(st + hb * Ring::kBox, &tm_k, hb * 64, kvh, page * kPageSize, bar);
        tma_load_3d(st + Ring::kHalfBytes + hb * Ring::kBox, &tm_v, hb * 64, kvh,
                    page * kPageSize, bar);
      }
    }
    __syncwarp();
  };
  if (producer) {  // warp-uniform; no block barrier inside
    if (lane == 0) {
      tma_prefetch_desc(&tm_k);
      tma_prefetch_desc(&tm_v);
    }
    load_windows();
    for (int i = 0; i < min(np, kTmaStages); ++i) issue_page(i);
  }
  // this thread's RoPE pairs of q
  QRope<HD, G, kTmaThreads> qrope;
  qrope.load(tid, cos_table, sin_table, p_tab);

  // ---- after the wait: qkv (the GEMV just before), cache writes, ws, counters ----
  griddep_wait();
  griddep_launch_dependents();
  qrope.rotate(tid, qkv, head0, [&](int g, int d, half lo, half hi) {
    s_qh[g][d] = lo;   // q as rope_kv_write would store it; the scale is applied to the scores
    s_qh[g][d + half_d] = hi;
  });
  if (new_t >= 0)  // block-uniform: this split holds pos, and pos is inside the table
    write_fresh_kv<HD, kTmaThreads>(k_cache, v_cache, s_knew, s_vnew, qkv, cos_table, sin_table,
                                    page_table, sp.p, p_tab, kvh, n_heads, n_kv);
  if constexpr (MQ)
    if (sp.nf > 0)  // block-uniform
      verify_fresh_kv<HD, kTmaThreads>(k_cache, v_cache, s_knew, s_vnew, qkv0, cos_table,
                                       sin_table, page_table, sp.p - (int)blockIdx.z, sp.f_lo,
                                       sp.nf, blockIdx.z == gridDim.z - 1, kvh, n_heads, n_kv);
  __syncthreads();  // s_qh, s_knew, s_vnew

  // consumer state: lane (gid, tig) of the m16n8 fragments holds head row gid (< G counts),
  // tokens / dims 2 tig, 2 tig + 1 of each 8-wide tile
  const int gid = lane >> 2, tig = lane & 3;
  float m_run = kNegBig, l_run = 0.f;  // l_run: this lane's share of the row sum (quad-summed)
  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  if (producer) {  // warp-uniform; mbarriers and __syncwarp only
    for (int i = kTmaStages; i < np; ++i) {
      mbar_wait(&s_empty[i % kTmaStages], ((i / kTmaStages) - 1) & 1);
      issue_page(i);
    }
  } else if (warp < np) {  // warp-uniform; mbarriers and __syncwarp only
    uint32_t qa[HD / 16][2];  // A fragments of the rotated q: rows gid < G, k = 16 kk + 2 tig (+8)
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      qa[kk][0] = gid < G ? *reinterpret_cast<const uint32_t*>(&s_qh[gid][kk * 16 + 2 * tig]) : 0u;
      qa[kk][1] =
          gid < G ? *reinterpret_cast<const uint32_t*>(&s_qh[gid][kk * 16 + 8 + 2 * tig]) : 0u;
    }
    // ldmatrix row addresses: lane l feeds row (l & 7) of matrix l >> 3
    const int mi = lane >> 3, mr = lane & 7;
    const int k_row = (mi >> 1) * 8 + mr, k_q = mi & 1;  // K: token row, chunk within a k16 step
    const int v_row = (mi & 1) * 8 + mr, v_q = mi >> 1;  // V (transposed): the same for a d16 tile
    for (int i = warp; i < np; i += kTmaConsumers) {
      const int s = i % kTmaStages;
      mbar_wait(&s_full[s], (i / kTmaStages) & 1);
      unsigned char* st = s_ring + (size_t)s * Ring::kStageBytes;
      unsigned char* vst = st + Ring::kHalfBytes;
      const int t0 = (p_begin + i) * kPageSize;
      const int n_valid = min(kPageSize, t_end - t0);  // >= 1
      // the page's fresh rows: the decode step's at new_t; the verify step's (MQ) its rows
      // [fa, n_valid) at or past f_lo, s_knew / s_vnew row t0 + r - f_lo
      const int fa = MQ ? max(sp.f_lo - t0, 0) : 0;
      const bool fresh = MQ ? fa < n_valid : new_t >= t0 && new_t < t0 + kPageSize;
      const bool patch = fresh || n_valid < kPageSize;  // warp-uniform
      if (patch) {
        if constexpr (MQ) {
          for (int c = lane; c < (n_valid - fa) * (HD / 8); c += 32) {  // none unless fresh
            const int r = fa + c / (HD / 8), q = c % (HD / 8);
            const int at = (t0 + r - sp.f_lo) * (HD / 8) + q;
            *reinterpret_cast<uint4*>(st + Ring::at(r, q)) =
                reinterpret_cast<const uint4*>(s_knew)[at];
            *reinterpret_cast<uint4*>(vst + Ring::at(r, q)) =
                reinterpret_cast<const uint4*>(s_vnew)[at];
          }
        } else if (fresh) {
          for (int q = lane; q < HD / 8; q += 32) {
            *reinterpret_cast<uint4*>(st + Ring::at(new_t - t0, q)) =
                reinterpret_cast<const uint4*>(s_knew)[q];
            *reinterpret_cast<uint4*>(vst + Ring::at(new_t - t0, q)) =
                reinterpret_cast<const uint4*>(s_vnew)[q];
          }
        }
        for (int c = lane; c < (kPageSize - n_valid) * (HD / 8); c += 32)
          *reinterpret_cast<uint4*>(vst + Ring::at(n_valid + c / (HD / 8), c % (HD / 8))) =
              make_uint4(0u, 0u, 0u, 0u);
        __syncwarp();
      }
      // S = Q K^T: two n8 tiles of tokens (0-7, 8-15)
      float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t b[4];
        ldmatrix_x4(b, st + Ring::at(k_row, 2 * kk + k_q));
        mma16816(sc[0], qa[kk][0], 0u, qa[kk][1], 0u, b[0], b[1]);
        mma16816(sc[1], qa[kk][0], 0u, qa[kk][1], 0u, b[2], b[3]);
      }
      // online softmax of row gid (base 2); tokens past the split's end score -inf
      float x[2][2], mx = kNegBig;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = 8 * j + 2 * tig + e;
          x[j][e] = r < n_valid ? sc[j][e] * scale_log2 : -CUDART_INF_F;
          mx = fmaxf(mx, x[j][e]);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mn = fmaxf(m_run, mx);  // finite
      const float corr = exp2f(m_run - mn);
      float pj[2][2], psum = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          pj[j][e] = exp2f(x[j][e] - mn);  // 0 for masked tokens
          psum += pj[j][e];
        }
      l_run = fmaf(l_run, corr, psum);
      m_run = mn;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        acc[n][0] *= corr;
        acc[n][1] *= corr;
      }
      // O += P V: P's accumulator layout is the A fragment's (rows gid, k = tokens 2 tig (+8))
      const uint32_t pa0 = h2_bits(__floats2half2_rn(pj[0][0], pj[0][1]));
      const uint32_t pa2 = h2_bits(__floats2half2_rn(pj[1][0], pj[1][1]));
#pragma unroll
      for (int dt = 0; dt < HD / 16; ++dt) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vst + Ring::at(v_row, 2 * dt + v_q));
        mma16816(acc[2 * dt], pa0, 0u, pa2, 0u, b[0], b[1]);
        mma16816(acc[2 * dt + 1], pa0, 0u, pa2, 0u, b[2], b[3]);
      }
      __syncwarp();  // every lane's reads of the stage are done
      if (lane == 0) {
        // the stage's generic writes (the patch) are ordered before the copy engine's refill
        if (patch) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        mbar_arrive(&s_empty[s]);
      }
    }
  }
  __syncthreads();  // every page has landed and been read: the ring is free for the partials

  if (!producer) {  // warp-uniform; shuffles only
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    float* s_wacc = reinterpret_cast<float*>(s_ring);  // [warp][g][HD]
    if (gid < G) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        s_wacc[(warp * G + gid) * HD + 8 * n + 2 * tig] = acc[n][0];
        s_wacc[(warp * G + gid) * HD + 8 * n + 2 * tig + 1] = acc[n][1];
      }
      if (tig == 0) {
        s_wm[warp][gid] = m_run;
        s_wl[warp][gid] = l_run;
      }
    }
  }
  __syncthreads();
  finish_split<HD, G, kTmaConsumers, kTmaThreads, Ring::kBytes / (8 * G)>(
      out, ws_acc, ws_ml, counters, &s_wm[0][0], &s_wl[0][0], reinterpret_cast<float*>(s_ring),
      reinterpret_cast<float*>(s_ring), &s_last, kvh, split, num_splits, n_active, head0);
}

namespace {

// The TMA kernel's tensor maps: a layer's K (or V) cache [pages * 16 slots][n_kv][head_dim] fp16
// as a 3-D tensor (dims innermost first), boxes of 64 dims x 1 head x 16 slots, 128-byte swizzle
// (TmaRing). cuTensorMapEncodeTiled is a driver function: reached through the runtime's entry
// point, so nothing links libcuda. Maps are pure host data; the last few are kept (eager decode
// asks for the same 2 x layers every step), keyed by everything they encode.
struct MapKey {
  const void* ptr;
  int slots, n_kv, hd;
  bool operator==(const MapKey& o) const {
    return ptr == o.ptr && slots == o.slots && n_kv == o.n_kv && hd == o.hd;
  }
};

cudaError_t kv_tensor_map(CUtensorMap* out, const half* cache, int slots, int n_kv, int hd) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr)
    return nq_fail(cudaErrorNotSupported, "attention_decode (TMA): the driver has no "
                   "cuTensorMapEncodeTiled");
  constexpr int kCache = 256;
  static std::mutex mu;
  static MapKey keys[kCache];
  static CUtensorMap maps[kCache];
  static int n = 0, next = 0;
  const MapKey key{cache, slots, n_kv, hd};
  std::lock_guard<std::mutex> lk(mu);
  for (int i = 0; i < n; ++i)
    if (keys[i] == key) {
      *out = maps[i];
      return cudaSuccess;
    }
  const cuuint64_t dims[3] = {(cuuint64_t)hd, (cuuint64_t)n_kv, (cuuint64_t)slots};
  const cuuint64_t strides[2] = {(cuuint64_t)hd * 2, (cuuint64_t)n_kv * hd * 2};  // bytes
  const cuuint32_t box[3] = {64, 1, kPageSize};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = encode(out, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, const_cast<half*>(cache),
                            dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return nq_fail(cudaErrorInvalidValue, "attention_decode (TMA): cuTensorMapEncodeTiled of a "
                   "cache at %p (%d slots x %d heads x %d dims) failed with CUresult %d "
                   "(the cache must be 16-byte aligned)", static_cast<const void*>(cache), slots,
                   n_kv, hd, (int)r);
  const int at = n < kCache ? n++ : (next++ % kCache);
  keys[at] = key;
  maps[at] = *out;
  return cudaSuccess;
}

template <bool MQ>
cudaError_t launch_attention(const char* fn, int T, half* out, float* ws_acc, float* ws_ml,
                             int32_t* counters, const half* qkv, half* k_cache, half* v_cache,
                             const float* cos_table, const float* sin_table,
                             const int32_t* page_table, int table_len, const int32_t* pos,
                             int n_heads, int n_kv, int head_dim, int num_splits, int min_pps,
                             int kernel, float scale, cudaStream_t stream) {
  if (kernel != kAttnCpAsync && kernel != kAttnTma)
    return nq_fail(cudaErrorInvalidValue, "%s: kernel=%d (%d: cp.async split-K, %d: TMA "
                   "warp-specialized)", fn, kernel, kAttnCpAsync, kAttnTma);
  if (T < 1 || T > kMaxVerifyQueries)
    return nq_fail(cudaErrorInvalidValue, "%s: T=%d queries, 1..%d", fn, T, kMaxVerifyQueries);
  if (n_kv <= 0 || n_heads % n_kv || n_heads / n_kv > kMaxGqa || num_splits <= 0 ||
      table_len <= 0 || min_pps < 0 || min_pps > kDecMinPpsMax ||
      (head_dim != 64 && head_dim != 128))
    return nq_fail(cudaErrorInvalidValue,
                   "%s: n_heads=%d n_kv=%d head_dim=%d num_splits=%d table_len=%d "
                   "min_pps=%d (needs a whole GQA ratio <= %d, head_dim 64 or 128, num_splits and "
                   "table_len >= 1, min_pps 0..%d)",
                   fn, n_heads, n_kv, head_dim, num_splits, table_len, min_pps, kMaxGqa, kDecMinPpsMax);
  if (min_pps == 0) min_pps = kDecMinPpsDefault;
  const float scale_log2 = scale * 1.4426950408889634f;
  const dim3 grid(n_kv, num_splits, T);
  CUtensorMap tm_k, tm_v;  // the caches' tensor maps (TMA kernel): table_len pages of 16 slots
  if (kernel == kAttnTma) {
    const int slots = table_len * kPageSize;
    if (cudaError_t me = kv_tensor_map(&tm_k, k_cache, slots, n_kv, head_dim)) return me;
    if (cudaError_t me = kv_tensor_map(&tm_v, v_cache, slots, n_kv, head_dim)) return me;
  }
  // one instantiation per (head_dim, GQA ratio): G is a template parameter so the heads' loops
  // unroll and interleave (RESULTS.md, "Fused decode attention", run 2)
  bool launched = false;
  cudaError_t e = cudaSuccess;
#define NQ_DECODE_CASE(HD, G)                                                                    \
  case G:                                                                                      \
    launched = true;                                                                           \
    if (kernel == kAttnTma) {                                                                  \
      static const cudaError_t attr =                                                          \
          set_max_smem(attn_decode_tma_kernel<HD, G, MQ>, TmaRing<HD>::kSmem);                 \
      if (attr != cudaSuccess)                                                                 \
        return smem_refused(attr, MQ ? "attention_verify<" #HD ", " #G ", tma>"         \
                                     : "attention_decode<" #HD ", " #G ", tma>",               \
                            TmaRing<HD>::kSmem);                                               \
      e = launch_pdl(MQ ? "attention_verify<" #HD ", " #G ", tma>"                     \
                        : "attention_decode<" #HD ", " #G ", tma>",                            \
                     attn_decode_tma_kernel<HD, G, MQ>, grid, dim3(kTmaThreads),               \
                     TmaRing<HD>::kSmem, stream, out, ws_acc, ws_ml, counters, qkv, k_cache,   \
                     v_cache, cos_table, sin_table, page_table, table_len, pos, n_heads, n_kv,  \
                     num_splits, min_pps, scale_log2, tm_k, tm_v);                             \
    } else {                                                                                   \
      e = launch_pdl(MQ ? "attention_verify<" #HD ", " #G ">"                          \
                        : "attention_decode<" #HD ", " #G ">",                                 \
                     attn_decode_kernel<HD, G, MQ>, grid, dim3(kDecThreads), 0, stream, out,   \
                     ws_acc, ws_ml, counters, qkv, k_cache, v_cache, cos_table, sin_table,     \
                     page_table, table_len, pos, n_heads, n_kv, num_splits, min_pps,           \
                     scale_log2);                                                              \
    }                                                                                          \
    break;
#define NQ_DECODE_HD(HD)                                                                         \
  switch (n_heads / n_kv) {                                                                    \
    NQ_DECODE_CASE(HD, 1) NQ_DECODE_CASE(HD, 2) NQ_DECODE_CASE(HD, 3) NQ_DECODE_CASE(HD, 4)   \
    NQ_DECODE_CASE(HD, 5) NQ_DECODE_CASE(HD, 6) NQ_DECODE_CASE(HD, 7) NQ_DECODE_CASE(HD, 8)   \
  }                                                                                            \
  break;
  static_assert(kMaxGqa == 8, "one instantiation per GQA ratio 1..kMaxGqa");
  switch (head_dim) {
    case 64: NQ_DECODE_HD(64)
    case 128: NQ_DECODE_HD(128)
  }
#undef NQ_DECODE_HD
#undef NQ_DECODE_CASE
  if (!launched)
    return nq_fail(cudaErrorInvalidValue, "%s: no instance for head_dim=%d, G=%d", fn,
                   head_dim, n_heads / n_kv);  // unreachable after the checks above
  if (e == cudaSuccess) return e;
  return nq_fail(e,
                 "%s: T=%d n_heads=%d n_kv=%d head_dim=%d num_splits=%d table_len=%d "
                 "min_pps=%d kernel=%d: %s",
                 fn, T, n_heads, n_kv, head_dim, num_splits, table_len, min_pps, kernel,
                 last_error_message());
}

}  // namespace

cudaError_t attention_decode(half* out, float* ws_acc, float* ws_ml, int32_t* counters,
                             const half* qkv, half* k_cache, half* v_cache,
                             const float* cos_table, const float* sin_table,
                             const int32_t* page_table, int table_len, const int32_t* pos,
                             int n_heads, int n_kv, int head_dim, int num_splits, int min_pps,
                             int kernel, float scale, cudaStream_t stream) {
  return launch_attention<false>("attention_decode", 1, out, ws_acc, ws_ml, counters, qkv,
                                 k_cache, v_cache, cos_table, sin_table, page_table, table_len,
                                 pos, n_heads, n_kv, head_dim, num_splits, min_pps, kernel, scale,
                                 stream);
}

cudaError_t attention_verify(half* out, float* ws_acc, float* ws_ml, int32_t* counters,
                             const half* qkv, half* k_cache, half* v_cache,
                             const float* cos_table, const float* sin_table,
                             const int32_t* page_table, int table_len, const int32_t* pos, int T,
                             int n_heads, int n_kv, int head_dim, int num_splits, int min_pps,
                             int kernel, float scale, cudaStream_t stream) {
  return launch_attention<true>("attention_verify", T, out, ws_acc, ws_ml, counters, qkv, k_cache,
                                v_cache, cos_table, sin_table, page_table, table_len, pos, n_heads,
                                n_kv, head_dim, num_splits, min_pps, kernel, scale, stream);
}

}  // namespace nanoqwen
