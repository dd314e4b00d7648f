// Embedding gather (fp16 table row -> fp32 residual), RMSNorm (fp32 residual -> fp16) and the
// fp16 prefill's SiLU*mul (the fused gate/up projection's rows -> the down projection's input).
//
// The residual add that HF writes before each norm happens in the o/down GEMV epilogue
// (gemv_int4_residual accumulates into the fp32 `hidden`), so the norm here only reads; its sum
// of squares is common.cuh's order (the decode step's folded norms compute the same numbers).
// Both kernels take T rows (T = 1 in decode, a prefill chunk otherwise); H is a multiple of
// 128 (config.py checks it), so rows are 16-byte aligned and vector loads are safe.
#include "common.cuh"
#include "kernels.h"

namespace nanoqwen {

// Thread j of row t takes entries 16j .. 16j+15 (two 16-byte loads of the table, four 16-byte
// stores); with parts it also writes that run's part of the sum of squares (common.cuh).
__global__ void embed_gather_kernel(float* __restrict__ hidden, float* __restrict__ parts,
                                    const half* __restrict__ table,
                                    const int32_t* __restrict__ ids, int H, int vocab) {
  griddep_wait();  // ids: the previous step's advance_step may be the kernel right before
  griddep_launch_dependents();
  const int t = blockIdx.x, np = H / 16;
  int id = ids[t];
  id = id < 0 ? 0 : (id >= vocab ? vocab - 1 : id);
  const uint4* src = reinterpret_cast<const uint4*>(table + (size_t)id * H);
  float4* dst = reinterpret_cast<float4*>(hidden + (size_t)t * H);
  for (int j = threadIdx.x; j < np; j += blockDim.x) {
    float h[16];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const uint4 v = src[2 * j + u];
      const half2* h2 = reinterpret_cast<const half2*>(&v);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __half22float2(h2[q]);
        h[8 * u + 2 * q] = f.x;
        h[8 * u + 2 * q + 1] = f.y;
      }
    }
#pragma unroll
    for (int q = 0; q < 4; ++q)
      dst[4 * j + q] = make_float4(h[4 * q], h[4 * q + 1], h[4 * q + 2], h[4 * q + 3]);
    if (parts) parts[(size_t)t * np + j] = sq_part16(h);
  }
}

cudaError_t embed_gather(float* hidden, const half* table, const int32_t* ids, int T, int H,
                         int vocab, cudaStream_t stream, float* parts) {
  if (T <= 0) return cudaSuccess;
  if (H % 16 || vocab < 1)
    return nq_fail(cudaErrorInvalidValue,
                   "embed_gather: H=%d must be a multiple of 16 and vocab=%d >= 1 (T=%d)", H,
                   vocab, T);
  const cudaError_t e = launch_pdl("embed_gather_kernel", embed_gather_kernel, dim3(T), dim3(256),
                                   0, stream, hidden, parts, table, ids, H, vocab);
  if (e == cudaSuccess) return e;
  return nq_fail(e, "embed_gather: T=%d H=%d vocab=%d: %s", T, H, vocab, last_error_message());
}

// One block per row, thread j the entries 16j .. 16j+15, held in registers between the sum of
// squares and the scaling: the parts and their fold in common.cuh's order, so a row normed here
// is bit-identical to the decode step's folded norm of it.
constexpr int kNormMaxH = 8192;  // 512 threads x 16 entries

__global__ void __launch_bounds__(kNormMaxH / 16)
rmsnorm_kernel(half* __restrict__ out, const float* __restrict__ hidden,
               const half* __restrict__ weight, int H, float eps) {
  __shared__ float part_s[kNormMaxH / 16];
  __shared__ float r_s;
  griddep_wait();  // hidden comes from the kernel before
  griddep_launch_dependents();
  const int t = blockIdx.x, j = threadIdx.x, np = H / 16;
  float h[16];
  if (j < np) {
    const float4* x4 = reinterpret_cast<const float4*>(hidden + (size_t)t * H) + 4 * j;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 v = x4[q];
      h[4 * q] = v.x; h[4 * q + 1] = v.y; h[4 * q + 2] = v.z; h[4 * q + 3] = v.w;
    }
    part_s[j] = sq_part16(h);
  }
  __syncthreads();
  if (j < 32) {  // one whole warp (the block has >= 32 threads)
    const float r = norm_fold_rs(part_s, np, H, eps);
    if (j == 0) r_s = r;
  }
  __syncthreads();
  if (j < np) {
    const float r = r_s;
    const uint4* w4 = reinterpret_cast<const uint4*>(weight) + 2 * j;
    uint4* o4 = reinterpret_cast<uint4*>(out + (size_t)t * H) + 2 * j;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const uint4 wv = w4[u];
      const half* w8 = reinterpret_cast<const half*>(&wv);
      uint4 ov;
      half* o8 = reinterpret_cast<half*>(&ov);
#pragma unroll
      for (int q = 0; q < 8; ++q) o8[q] = norm_entry(h[8 * u + q], r, __half2float(w8[q]));
      o4[u] = ov;
    }
  }
}

cudaError_t rmsnorm(half* out, const float* hidden, const half* weight, int T, int H, float eps,
                    cudaStream_t stream) {
  if (T <= 0) return cudaSuccess;
  if (H % 16 || H > kNormMaxH)
    return nq_fail(cudaErrorInvalidValue,
                   "rmsnorm: H=%d must be a multiple of 16 and at most %d (T=%d)", H, kNormMaxH,
                   T);
  const int threads = (H / 16 + 31) / 32 * 32;
  const cudaError_t e = launch_pdl("rmsnorm_kernel", rmsnorm_kernel, dim3(T), dim3(threads), 0,
                                   stream, out, hidden, weight, H, eps);
  if (e == cudaSuccess) return e;
  return nq_fail(e, "rmsnorm: T=%d H=%d: %s", T, H, last_error_message());
}

// One thread per 8 output columns (16-byte loads of g and u, a 16-byte store); the rows are
// 16-byte aligned because I is a multiple of 8. fp32 math and one rounding, the decode GEMV's
// formula (gemv_int4.cu OP_SILU) on the fp16 g and u cuBLAS wrote.
__global__ void silu_mul_kernel(half* __restrict__ out, const half* __restrict__ gu, int I,
                                int64_t n8) {
  griddep_wait();  // gu: the GEMM right before
  griddep_launch_dependents();
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n8) return;
  const int per_row = I / 8;
  const int64_t t = j / per_row;
  const int c = (int)(j - t * per_row) * 8;
  const half* row = gu + t * 2 * (int64_t)I;
  const uint4 g8 = __ldcs(reinterpret_cast<const uint4*>(row + c));      // read once: streaming
  const uint4 u8 = __ldcs(reinterpret_cast<const uint4*>(row + I + c));
  const half2* g2 = reinterpret_cast<const half2*>(&g8);
  const half2* u2 = reinterpret_cast<const half2*>(&u8);
  uint4 o8;
  half2* o2 = reinterpret_cast<half2*>(&o8);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 g = __half22float2(g2[q]), u = __half22float2(u2[q]);
    o2[q] = __floats2half2_rn(g.x / (1.f + __expf(-g.x)) * u.x, g.y / (1.f + __expf(-g.y)) * u.y);
  }
  *reinterpret_cast<uint4*>(out + t * (int64_t)I + c) = o8;
}

cudaError_t silu_mul(half* out, const half* gu, int T, int I, cudaStream_t stream) {
  if (T <= 0) return cudaSuccess;
  if (I <= 0 || I % 8)
    return nq_fail(cudaErrorInvalidValue, "silu_mul: I=%d must be a positive multiple of 8 (T=%d)",
                   I, T);
  if ((reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(gu)) % 16)
    return nq_fail(cudaErrorInvalidValue,
                   "silu_mul: out=%p and gu=%p must be 16-byte aligned (T=%d I=%d)",
                   (const void*)out, (const void*)gu, T, I);
  constexpr int kThreads = 256;
  const int64_t n8 = (int64_t)T * (I / 8);
  const cudaError_t e = launch_pdl("silu_mul_kernel", silu_mul_kernel,
                                   dim3((unsigned)((n8 + kThreads - 1) / kThreads)),
                                   dim3(kThreads), 0, stream, out, gu, I, n8);
  if (e == cudaSuccess) return e;
  return nq_fail(e, "silu_mul: T=%d I=%d: %s", T, I, last_error_message());
}

}  // namespace nanoqwen
