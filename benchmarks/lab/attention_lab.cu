// attention_lab.cu -- paged_attention, the split-K decode attention (split kernel + combine
// kernel, fed by rope_kv_write) that attention_decode replaced in the decode step (RESULTS.md,
// "Fused decode attention": 2.2-3.9x slower from 2048 tokens up). Moved out of csrc/attention.cu
// unchanged (commit 2047cf7 is the last with it there); only the launch calls name their
// kernels for the error convention. C entry point in lab.h. Its original notes:
//
// Paged decode attention for GQA, split-K (flash-decoding), for one query token.
//
// Grid (n_kv, num_splits), 4 warps a block. The block of kv head h serves the G = n_heads/n_kv
// query heads that read h, so each K/V row is loaded once for all of them. The length comes
// from device memory (pos + 1) and each split takes a contiguous run of ceil(pages/splits)
// pages, so the grid is sized once for the maximum and a short context leaves most splits
// empty: they return at once (a whole-block exit before any barrier, so it is safe).
//
// Inside a split, warp w takes tokens t0+w, t0+w+4, ... two at a time; lane j holds dims
// [j*E, j*E+E) of q, k, v (E = head_dim/32), dot products are reduced across the warp with
// shuffles, and softmax is online (running max m, sum l, acc) in base 2 (q pre-scaled by
// log2(e)/sqrt(d)). The four warps' states are merged through shared memory after ONE block
// barrier that every thread reaches (barriers never sit inside a warp-id branch: that was
// UB once and corrupted softmax only on partial last pages). Tokens >= len are never read,
// so the stale tail of a partial last page needs no masking.
//
// The combine kernel merges the active splits: M = max m_s, L = sum l_s 2^(m_s-M),
// out = sum acc_s 2^(m_s-M) / L.
#include <math_constants.h>

#include "common.cuh"  // csrc/: PDL, launch_pdl, kMaxGqa, kPageSize, the error convention
#include "lab.h"
#include "lab_common.cuh"  // warp_sum

namespace nanoqwen {
namespace {

constexpr int kAttnWarps = 4;

__device__ __forceinline__ int attn_len(const int32_t* pos_ptr, int table_len) {
  int len = pos_ptr[0] + 1;
  len = min(len, table_len * kPageSize);
  return max(len, 1);
}

template <int E>
__device__ __forceinline__ void load_row(float (&dst)[E], const half* p) {
  if constexpr (E == 4) {
    uint2 u = *reinterpret_cast<const uint2*>(p);
    const half2* h = reinterpret_cast<const half2*>(&u);
    float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
    dst[0] = a.x; dst[1] = a.y; dst[2] = b.x; dst[3] = b.y;
  } else {
    static_assert(E == 2, "head_dim 64 or 128");
    float2 a = __half22float2(*reinterpret_cast<const half2*>(p));
    dst[0] = a.x; dst[1] = a.y;
  }
}

template <int HD>
__global__ void __launch_bounds__(kAttnWarps * 32)
attn_split_kernel(float* __restrict__ ws_acc, float* __restrict__ ws_ml,
                  const half* __restrict__ q, const half* __restrict__ k_cache,
                  const half* __restrict__ v_cache, const int32_t* __restrict__ page_table,
                  int table_len, const int32_t* __restrict__ pos_ptr, int n_heads, int n_kv,
                  int num_splits, float scale_log2) {
  constexpr int E = HD / 32;
  __shared__ float s_m[kAttnWarps][kMaxGqa];
  __shared__ float s_l[kAttnWarps][kMaxGqa];
  __shared__ float s_acc[kAttnWarps][kMaxGqa][HD];

  // PDL: q and the current token's K/V row come from rope_kv_write, the launch just before
  griddep_wait();
  griddep_launch_dependents();
  const int kvh = blockIdx.x, split = blockIdx.y;
  const int G = n_heads / n_kv;
  const int len = attn_len(pos_ptr, table_len);
  const int n_pages = (len + kPageSize - 1) / kPageSize;
  const int pps = (n_pages + num_splits - 1) / num_splits;
  const int p_begin = split * pps;
  if (p_begin >= n_pages) return;  // empty split: uniform over the block, before any barrier
  const int t_begin = p_begin * kPageSize;
  const int t_end = min((p_begin + pps) * kPageSize, len);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int head0 = kvh * G;

  float qr[kMaxGqa][E];
#pragma unroll
  for (int g = 0; g < kMaxGqa; ++g) {
    if (g < G) {
      load_row<E>(qr[g], q + (size_t)(head0 + g) * HD + lane * E);
#pragma unroll
      for (int e = 0; e < E; ++e) qr[g][e] *= scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) qr[g][e] = 0.f;
    }
  }
  float m[kMaxGqa], l[kMaxGqa], acc[kMaxGqa][E];
#pragma unroll
  for (int g = 0; g < kMaxGqa; ++g) {
    m[g] = -CUDART_INF_F;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
  }

  const size_t slot_stride = (size_t)n_kv * HD;
  const size_t head_off = (size_t)kvh * HD + lane * E;
  for (int ta = t_begin + warp; ta < t_end; ta += 2 * kAttnWarps) {
    const int tb = ta + kAttnWarps;
    const bool has_b = tb < t_end;
    // both tokens' loads first, so two rows of K and V are in flight at once
    const size_t ra = ((size_t)page_table[ta / kPageSize] * kPageSize + ta % kPageSize) *
                      slot_stride + head_off;
    float ka[E], va[E], kb[E], vb[E];
    load_row<E>(ka, k_cache + ra);
    load_row<E>(va, v_cache + ra);
    if (has_b) {
      const size_t rb = ((size_t)page_table[tb / kPageSize] * kPageSize + tb % kPageSize) *
                        slot_stride + head_off;
      load_row<E>(kb, k_cache + rb);
      load_row<E>(vb, v_cache + rb);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) kb[e] = vb[e] = 0.f;
    }
#pragma unroll
    for (int g = 0; g < kMaxGqa; ++g) {
      if (g < G) {  // warp-uniform: the shuffles below see the whole warp
        float sa = 0.f, sb = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          sa = fmaf(qr[g][e], ka[e], sa);
          sb = fmaf(qr[g][e], kb[e], sb);
        }
        sa = warp_sum(sa);
        sb = has_b ? warp_sum(sb) : -CUDART_INF_F;
        const float mn = fmaxf(m[g], fmaxf(sa, sb));  // finite: sa is
        const float corr = exp2f(m[g] - mn);          // 0 on the first token (m = -inf)
        const float pa = exp2f(sa - mn), pb = exp2f(sb - mn);
        l[g] = fmaf(l[g], corr, pa + pb);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = fmaf(acc[g][e], corr, fmaf(pa, va[e], pb * vb[e]));
        m[g] = mn;
      }
    }
  }

  // merge the warps (a warp with no token has m = -inf, l = 0, acc = 0)
#pragma unroll
  for (int g = 0; g < kMaxGqa; ++g) {
    if (g < G) {
      if (lane == 0) {
        s_m[warp][g] = m[g];
        s_l[warp][g] = l[g];
      }
#pragma unroll
      for (int e = 0; e < E; ++e) s_acc[warp][g][lane * E + e] = acc[g][e];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
    const int g = i / HD, d = i % HD;
    float M = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, s_m[w][g]);
    float o = 0.f, L = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float f = s_m[w][g] == -CUDART_INF_F ? 0.f : exp2f(s_m[w][g] - M);
      o = fmaf(s_acc[w][g][d], f, o);
      L = fmaf(s_l[w][g], f, L);
    }
    const size_t slot = (size_t)(head0 + g) * num_splits + split;
    ws_acc[slot * HD + d] = o;
    if (d == 0) {
      ws_ml[slot * 2] = M;
      ws_ml[slot * 2 + 1] = L;
    }
  }
}

template <int HD>
__global__ void __launch_bounds__(HD)
attn_combine_kernel(half* __restrict__ out, const float* __restrict__ ws_acc,
                    const float* __restrict__ ws_ml, int table_len,
                    const int32_t* __restrict__ pos_ptr, int num_splits) {
  griddep_wait();  // PDL: ws_acc / ws_ml come from the split kernel just before
  griddep_launch_dependents();
  const int h = blockIdx.x, d = threadIdx.x;
  const int len = attn_len(pos_ptr, table_len);
  const int n_pages = (len + kPageSize - 1) / kPageSize;
  const int pps = (n_pages + num_splits - 1) / num_splits;
  const int n_active = (n_pages + pps - 1) / pps;  // every one of these is non-empty
  const float* ml = ws_ml + (size_t)h * num_splits * 2;
  float M = -CUDART_INF_F;
  for (int s = 0; s < n_active; ++s) M = fmaxf(M, ml[2 * s]);
  float L = 0.f, o = 0.f;
  const float* acc = ws_acc + (size_t)h * num_splits * HD + d;
  for (int s = 0; s < n_active; ++s) {
    const float f = exp2f(ml[2 * s] - M);
    L = fmaf(ml[2 * s + 1], f, L);
    o = fmaf(acc[(size_t)s * HD], f, o);
  }
  out[(size_t)h * HD + d] = __float2half_rn(o / L);
}

cudaError_t paged_attention_impl(half* out, float* ws_acc, float* ws_ml, const half* q,
                                 const half* k_cache, const half* v_cache,
                                 const int32_t* page_table, int table_len, const int32_t* pos,
                                 int n_heads, int n_kv, int head_dim, int num_splits, float scale,
                                 cudaStream_t stream) {
  if (n_kv <= 0 || n_heads % n_kv || n_heads / n_kv > kMaxGqa || num_splits <= 0 ||
      table_len <= 0 || (head_dim != 64 && head_dim != 128))
    return nq_fail(cudaErrorInvalidValue,
                   "paged_attention: n_heads=%d n_kv=%d head_dim=%d num_splits=%d table_len=%d "
                   "(needs a GQA ratio <= %d, head_dim 64 or 128, splits and pages >= 1)",
                   n_heads, n_kv, head_dim, num_splits, table_len, kMaxGqa);
  const float scale_log2 = scale * 1.4426950408889634f;
  const dim3 grid(n_kv, num_splits);
  cudaError_t e;
  if (head_dim == 64) {
    e = launch_pdl("lab attn_split_kernel<64>", attn_split_kernel<64>, grid, dim3(kAttnWarps * 32),
                   0, stream, ws_acc, ws_ml, q, k_cache, v_cache, page_table, table_len, pos,
                   n_heads, n_kv, num_splits, scale_log2);
    if (e != cudaSuccess) return e;
    return launch_pdl("lab attn_combine_kernel<64>", attn_combine_kernel<64>, dim3(n_heads),
                      dim3(64), 0, stream, out, ws_acc, ws_ml, table_len, pos, num_splits);
  }
  e = launch_pdl("lab attn_split_kernel<128>", attn_split_kernel<128>, grid,
                 dim3(kAttnWarps * 32), 0, stream, ws_acc, ws_ml, q, k_cache, v_cache, page_table,
                 table_len, pos, n_heads, n_kv, num_splits, scale_log2);
  if (e != cudaSuccess) return e;
  return launch_pdl("lab attn_combine_kernel<128>", attn_combine_kernel<128>, dim3(n_heads),
                    dim3(128), 0, stream, out, ws_acc, ws_ml, table_len, pos, num_splits);
}

}  // namespace
}  // namespace nanoqwen

extern "C" cudaError_t paged_attention(half* out, float* ws_acc, float* ws_ml, const half* q,
                                       const half* k_cache, const half* v_cache,
                                       const int32_t* page_table, int table_len,
                                       const int32_t* pos, int n_heads, int n_kv, int head_dim,
                                       int num_splits, float scale, cudaStream_t stream) {
  return nanoqwen::paged_attention_impl(out, ws_acc, ws_ml, q, k_cache, v_cache, page_table,
                                        table_len, pos, n_heads, n_kv, head_dim, num_splits,
                                        scale, stream);
}
