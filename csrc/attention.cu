// attention_decode: the decode step's attention -- RoPE of q/k + K/V write + split-K (flash-
// decoding) paged GQA attention + the split merge, in ONE launch (kernels.h says what it promises).
// It replaced rope_kv_write + paged_attention (split + combine kernels; now in
// benchmarks/lab/attention_lab.cu) in the decode step: RESULTS.md, "Fused decode attention".
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
#include <math_constants.h>

#include "common.cuh"
#include "kernels.h"

namespace nanoqwen {

constexpr int kDecWarps = 4;
constexpr int kDecThreads = kDecWarps * 32;
constexpr int kDecStages = 4;       // K/V pages in the shared-memory ring (3 in flight)
constexpr float kNegBig = -1e30f;   // finite "minus infinity" for running maxima

__device__ __forceinline__ void half8_to_float(float (&f)[8], uint4 u) {
  const half2* h = reinterpret_cast<const half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

// MQ (the verify step, attention_decode_cached): blockIdx.z = query i at position pos + i, its
// q from row i of qkv [T, q + 2kv], its out / ws / counters slices its own; the K/V of every
// position, the query's own included, are already in the cache (rope_kv_write, the launch just
// before: so the page copies wait for griddep_wait). Otherwise the block computes exactly what
// the decode step's block computes at that position (same splits, same order), so each query's
// output is bit-identical to attention_decode's there.
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
  __shared__ __align__(16) half s_knew[HD];
  __shared__ __align__(16) half s_vnew[HD];
  __shared__ float s_wm[kDecWarps][G], s_wl[kDecWarps][G];
  __shared__ int s_last;
  half* ring = reinterpret_cast<half*>(s_raw);     // [stage][K|V][16][HD]
  float* s_wacc = reinterpret_cast<float*>(s_raw); // [warp][g][HD], after the ring is drained

  const int kvh = blockIdx.x, split = blockIdx.y;
  const int head0 = kvh * G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  constexpr int half_d = HD / 2;

  if constexpr (MQ) {  // this query's slices
    const int qi = blockIdx.z;
    qkv += (size_t)qi * (n_heads + 2 * n_kv) * HD;
    out += (size_t)qi * n_heads * HD;
    ws_acc += (size_t)qi * n_heads * num_splits * HD;
    ws_ml += (size_t)qi * n_heads * num_splits * 2;
    counters += (size_t)qi * n_kv;
  }
  // ---- before griddep_wait: only data written >= 2 launches back ----
  const int p = pos_ptr[0] + (MQ ? (int)blockIdx.z : 0);
  const int cap = table_len * kPageSize;
  const int len = max(min(p + 1, cap), 1);
  const int n_pages = (len + kPageSize - 1) / kPageSize;
  const int pps = max((n_pages + num_splits - 1) / num_splits, min_pps);
  const int n_active = (n_pages + pps - 1) / pps;
  const int p_begin = split * pps;
  if (p_begin >= n_pages) return;  // empty split: whole block, before any barrier or write
  const int p_end = min(p_begin + pps, n_pages);
  const int np = p_end - p_begin;
  const int t_end = min(p_end * kPageSize, len);
  const bool in_cache = p >= 0 && p < cap;
  const int new_t = !MQ && in_cache && p >= p_begin * kPageSize && p < t_end ? p : -1;
  const int p_tab = p < 0 ? 0 : (p < cap ? p : cap - 1);
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
  if constexpr (MQ) griddep_wait();  // the new positions' K/V come from the launch just before
#pragma unroll
  for (int i = 0; i < kDecStages - 1; ++i) {
    if (i < np) issue_page(i);
    cp_async_commit();  // always: keeps the group count uniform for wait_group below
  }
  // this thread's RoPE pairs of q: i = tid + k*128 over G * HD/2 pairs (at most 4 for 8 x 64)
  constexpr int kQPairs = (G * half_d + kDecThreads - 1) / kDecThreads;
  float cq[kQPairs], sq[kQPairs];
#pragma unroll
  for (int k = 0; k < kQPairs; ++k) {
    const int d = (tid + k * kDecThreads) % half_d;
    cq[k] = cos_table[(size_t)p_tab * half_d + d];
    sq[k] = sin_table[(size_t)p_tab * half_d + d];
  }

  // ---- after the wait: qkv (the GEMV just before), cache writes, ws, counters ----
  if constexpr (!MQ) griddep_wait();
  griddep_launch_dependents();

#pragma unroll
  for (int k = 0; k < kQPairs; ++k) {
    const int i = tid + k * kDecThreads;
    if (i < G * half_d) {
      const int g = i / half_d, d = i % half_d;
      const half* x = qkv + (size_t)(head0 + g) * HD;
      half lo, hi;
      rope_pair(__half2float(x[d]), __half2float(x[d + half_d]), cq[k], sq[k], lo, hi);
      s_q[g][d] = __half2float(lo) * scale_log2;  // q as rope_kv_write would store it
      s_q[g][d + half_d] = __half2float(hi) * scale_log2;
    }
  }
  if (new_t >= 0) {  // block-uniform: this split holds pos, and pos is inside the table
    const size_t slot = ((size_t)page_table[p / kPageSize] * kPageSize + p % kPageSize) *
                            slot_stride + (size_t)kvh * HD;
    const half* xk = qkv + (size_t)(n_heads + kvh) * HD;
    const half* xv = qkv + (size_t)(n_heads + n_kv + kvh) * HD;
    for (int d = tid; d < half_d; d += kDecThreads) {
      half lo, hi;
      rope_pair(__half2float(xk[d]), __half2float(xk[d + half_d]),
                cos_table[(size_t)p_tab * half_d + d], sin_table[(size_t)p_tab * half_d + d],
                lo, hi);
      k_cache[slot + d] = lo;
      k_cache[slot + d + half_d] = hi;
      s_knew[d] = lo;
      s_knew[d + half_d] = hi;
    }
    for (int d = tid; d < HD; d += kDecThreads) {
      const half v = xv[d];
      v_cache[slot + d] = v;
      s_vnew[d] = v;
    }
  }
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
      const bool fresh = t == new_t;
      const uint4 ku = *reinterpret_cast<const uint4*>(fresh ? s_knew + col : st + slot * HD + col);
      const uint4 vu = *reinterpret_cast<const uint4*>(
          fresh ? s_vnew + col : st + kPageHalves + slot * HD + col);
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
  for (int i = tid; i < G * HD; i += kDecThreads) {
    const int g = i / HD, d = i % HD;
    float M = kNegBig;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) M = fmaxf(M, s_wm[w][g]);
    float o = 0.f, L = 0.f;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) {
      const float f = exp2f(s_wm[w][g] - M);  // 0 for a warp that saw only masked tokens
      o = fmaf(s_wacc[(w * G + g) * HD + d], f, o);
      L = fmaf(s_wl[w][g], f, L);
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
  if (tid == 0) s_last = atomicAdd(&counters[kvh], 1) == n_active - 1;
  __syncthreads();
  if (!s_last) return;  // block-uniform
  __threadfence();      // acquire side: other blocks' ws writes are read after the count
  // Thread t owns 4 dims (float4) of heads g = t / TPH + k * HPB. Splits come in chunks whose
  // (m, l) are staged in shared memory by one parallel load (a serial loop over L2 loads was
  // ~0.4 us per split); the acc loads of 16 splits are in flight at once. Per element this is
  // the merge formula above, in split order (chunks > 1 only past kMergeChunk splits, then the
  // running sum is rescaled once per chunk).
  constexpr int TPH = HD / 4, HPB = kDecThreads / TPH, HPT = (G + HPB - 1) / HPB;
  constexpr int kMergeChunk = kRingBytes / (8 * G);
  float* s_mm = reinterpret_cast<float*>(s_raw);  // [G][kMergeChunk] maxima, then sums
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
    for (int i = tid; i < G * cn; i += kDecThreads) {
      const int g = i / cn, sp = i % cn;
      const float2 ml = __ldcg(reinterpret_cast<const float2*>(
          ws_ml + ((size_t)(head0 + g) * num_splits + c0 + sp) * 2));
      s_mm[g * kMergeChunk + sp] = ml.x;
      s_ll[g * kMergeChunk + sp] = ml.y;
    }
    __syncthreads();
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
        const float4* ac = reinterpret_cast<const float4*>(
            ws_acc + ((size_t)(head0 + g) * num_splits + c0) * HD + d4);
#pragma unroll 16
        for (int sp = 0; sp < cn; ++sp) {  // split order: deterministic
          const float f = exp2f(s_mm[g * kMergeChunk + sp] - mc);
          const float4 a = __ldcg(ac + (size_t)sp * (HD / 4));
          L[k] = fmaf(s_ll[g * kMergeChunk + sp], f, L[k]);
          o[k].x = fmaf(a.x, f, o[k].x);
          o[k].y = fmaf(a.y, f, o[k].y);
          o[k].z = fmaf(a.z, f, o[k].z);
          o[k].w = fmaf(a.w, f, o[k].w);
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

namespace {

template <bool MQ>
cudaError_t launch_attention(const char* fn, int T, half* out, float* ws_acc, float* ws_ml,
                             int32_t* counters, const half* qkv, half* k_cache, half* v_cache,
                             const float* cos_table, const float* sin_table,
                             const int32_t* page_table, int table_len, const int32_t* pos,
                             int n_heads, int n_kv, int head_dim, int num_splits, int min_pps,
                             float scale, cudaStream_t stream) {
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
  // one instantiation per (head_dim, GQA ratio): G is a template parameter so the heads' loops
  // unroll and interleave (RESULTS.md, "Fused decode attention", run 2)
  bool launched = false;
  cudaError_t e = cudaSuccess;
#define NQ_DECODE_CASE(HD, G)                                                                    \
  case G:                                                                                      \
    launched = true;                                                                           \
    e = launch_pdl(MQ ? "attention_decode_cached<" #HD ", " #G ">"                            \
                      : "attention_decode<" #HD ", " #G ">",                                   \
                   attn_decode_kernel<HD, G, MQ>, grid,                                        \
                   dim3(kDecThreads), 0, stream, out, ws_acc, ws_ml, counters, qkv, k_cache,    \
                   v_cache, cos_table, sin_table, page_table, table_len, pos, n_heads, n_kv,    \
                   num_splits, min_pps, scale_log2);                                           \
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
                 "min_pps=%d: %s",
                 fn, T, n_heads, n_kv, head_dim, num_splits, table_len, min_pps,
                 last_error_message());
}

}  // namespace

cudaError_t attention_decode(half* out, float* ws_acc, float* ws_ml, int32_t* counters,
                             const half* qkv, half* k_cache, half* v_cache,
                             const float* cos_table, const float* sin_table,
                             const int32_t* page_table, int table_len, const int32_t* pos,
                             int n_heads, int n_kv, int head_dim, int num_splits, int min_pps,
                             float scale, cudaStream_t stream) {
  return launch_attention<false>("attention_decode", 1, out, ws_acc, ws_ml, counters, qkv,
                                 k_cache, v_cache, cos_table, sin_table, page_table, table_len,
                                 pos, n_heads, n_kv, head_dim, num_splits, min_pps, scale, stream);
}

cudaError_t attention_decode_cached(half* out, float* ws_acc, float* ws_ml, int32_t* counters,
                                    const half* qkv, const half* k_cache, const half* v_cache,
                                    const float* cos_table, const float* sin_table,
                                    const int32_t* page_table, int table_len, const int32_t* pos,
                                    int T, int n_heads, int n_kv, int head_dim, int num_splits,
                                    int min_pps, float scale, cudaStream_t stream) {
  // (the kernel writes the caches only when !MQ)
  return launch_attention<true>("attention_decode_cached", T, out, ws_acc, ws_ml, counters, qkv,
                                const_cast<half*>(k_cache), const_cast<half*>(v_cache),
                                cos_table, sin_table, page_table, table_len, pos, n_heads, n_kv,
                                head_dim, num_splits, min_pps, scale, stream);
}

}  // namespace nanoqwen
