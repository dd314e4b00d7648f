// RoPE (HF rotate_half) fused with the write of k/v into the 16-token KV pages, for the prefill
// (T rows at once; the decode step does the same inside attention_decode, bit for bit alike).
//
// One block per token row. Pair (d, d + D/2) of a head rotates by angle pos * inv_freq[d]:
//   out[d]       = x[d] * cos - x[d + D/2] * sin
//   out[d + D/2] = x[d + D/2] * cos + x[d] * sin
// computed in fp32 from the fp16 projection, rounded once to fp16 (the cache's dtype).
// Launched with PDL (common.cuh): everything is read after griddep_wait (qkv comes from the
// projection just before).
#include "common.cuh"
#include "kernels.h"

namespace nanoqwen {

__global__ void rope_kv_write_kernel(half* __restrict__ q_out, half* __restrict__ k_cache,
                                     half* __restrict__ v_cache, const half* __restrict__ qkv,
                                     const float* __restrict__ cos_table,
                                     const float* __restrict__ sin_table,
                                     const int32_t* __restrict__ pos_ptr,
                                     const int32_t* __restrict__ page_table, int table_len,
                                     int n_heads, int n_kv, int D) {
  griddep_wait();
  griddep_launch_dependents();
  const int t = blockIdx.x;
  const int p = pos_ptr[0] + t;
  const int half_d = D / 2;
  const int cap = table_len * kPageSize;
  const int p_tab = p < 0 ? 0 : (p < cap ? p : cap - 1);  // never read past the RoPE tables
  const int row = (n_heads + 2 * n_kv) * D;
  const half* x = qkv + (size_t)t * row;
  const float* cs = cos_table + (size_t)p_tab * half_d;
  const float* sn = sin_table + (size_t)p_tab * half_d;
  const bool in_cache = p >= 0 && p < cap;
  size_t slot_base = 0;
  if (in_cache) {
    const int page = page_table[p / kPageSize];
    slot_base = ((size_t)page * kPageSize + (p % kPageSize)) * n_kv * D;
  }
  // rotations: (n_heads + n_kv) heads x D/2 pairs
  const int n_pairs = (n_heads + n_kv) * half_d;
  for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) {
    const int h = i / half_d, d = i % half_d;
    const half* xh = x + h * D;  // q heads first, then k heads (contiguous in the row)
    const float a = __half2float(xh[d]), b = __half2float(xh[d + half_d]);
    half lo, hi;
    rope_pair(a, b, cs[d], sn[d], lo, hi);
    if (h < n_heads) {
      half* qo = q_out + ((size_t)t * n_heads + h) * D;
      qo[d] = lo;
      qo[d + half_d] = hi;
    } else if (in_cache) {
      half* ko = k_cache + slot_base + (size_t)(h - n_heads) * D;
      ko[d] = lo;
      ko[d + half_d] = hi;
    }
  }
  if (in_cache) {
    const half* v = x + (n_heads + n_kv) * D;
    for (int i = threadIdx.x; i < n_kv * D; i += blockDim.x) v_cache[slot_base + i] = v[i];
  }
}

cudaError_t rope_kv_write(half* q_out, half* k_cache, half* v_cache, const half* qkv,
                          const float* cos_table, const float* sin_table, const int32_t* pos,
                          const int32_t* page_table, int table_len, int T, int n_heads,
                          int n_kv, int head_dim, cudaStream_t stream) {
  if (T <= 0) return cudaSuccess;
  if (head_dim % 2 || n_kv <= 0 || n_heads % n_kv || table_len < 1)
    return nq_fail(cudaErrorInvalidValue,
                   "rope_kv_write: head_dim=%d must be even, n_heads=%d a multiple of "
                   "n_kv=%d >= 1, table_len=%d >= 1 (T=%d)", head_dim, n_heads, n_kv, table_len, T);
  const cudaError_t e = launch_pdl("rope_kv_write_kernel", rope_kv_write_kernel, dim3(T),
                                   dim3(256), 0, stream, q_out, k_cache, v_cache, qkv, cos_table,
                                   sin_table, pos, page_table, table_len, n_heads, n_kv, head_dim);
  if (e == cudaSuccess) return e;
  return nq_fail(e, "rope_kv_write: T=%d n_heads=%d n_kv=%d head_dim=%d table_len=%d: %s", T,
                 n_heads, n_kv, head_dim, table_len, last_error_message());
}

}  // namespace nanoqwen
