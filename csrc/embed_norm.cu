// Embedding gather (fp16 table row -> fp32 residual), RMSNorm (fp32 residual -> fp16) and the
// fp16 prefill's SiLU*mul (the fused gate/up projection's rows -> the down projection's input).
//
// The residual add that HF writes before each norm happens in the o/down GEMV epilogue
// (gemv_int4_residual accumulates into the fp32 `hidden`), so the norm here only reads.
// Both kernels take T rows (T = 1 in decode, a prefill chunk otherwise); H is a multiple of
// 128 (config.py checks it), so rows are 16-byte aligned and vector loads are safe.
#include "common.cuh"
#include "kernels.h"

namespace nanoqwen {

__global__ void embed_gather_kernel(float* __restrict__ hidden, const half* __restrict__ table,
                                    const int32_t* __restrict__ ids, int H, int vocab) {
  griddep_wait();  // ids: the previous step's advance_step may be the kernel right before
  griddep_launch_dependents();
  const int t = blockIdx.x;
  int id = ids[t];
  id = id < 0 ? 0 : (id >= vocab ? vocab - 1 : id);
  // 8 halves (16 bytes) in, 8 floats (32 bytes) out per step
  const uint4* src = reinterpret_cast<const uint4*>(table + (size_t)id * H);
  float4* dst = reinterpret_cast<float4*>(hidden + (size_t)t * H);
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) {
    uint4 u = src[i];
    const half2* h = reinterpret_cast<const half2*>(&u);
    float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
    float2 c = __half22float2(h[2]), d = __half22float2(h[3]);
    dst[2 * i] = make_float4(a.x, a.y, b.x, b.y);
    dst[2 * i + 1] = make_float4(c.x, c.y, d.x, d.y);
  }
}

cudaError_t embed_gather(float* hidden, const half* table, const int32_t* ids, int T, int H,
                         int vocab, cudaStream_t stream) {
  if (T <= 0) return cudaSuccess;
  if (H % 8 || vocab < 1)
    return nq_fail(cudaErrorInvalidValue,
                   "embed_gather: H=%d must be a multiple of 8 and vocab=%d >= 1 (T=%d)", H, vocab,
                   T);
  const cudaError_t e = launch_pdl("embed_gather_kernel", embed_gather_kernel, dim3(T), dim3(256),
                                   0, stream, hidden, table, ids, H, vocab);
  if (e == cudaSuccess) return e;
  return nq_fail(e, "embed_gather: T=%d H=%d vocab=%d: %s", T, H, vocab, last_error_message());
}

// One block per row. Each thread keeps its slice of the row in registers between the
// sum-of-squares pass and the scaling pass (H <= 8192 fits: 512 threads x 4 x kMaxVec).
constexpr int kNormThreads = 512;
constexpr int kMaxVec = 4;  // float4s per thread: H <= 512 * 4 * 4 = 8192

__global__ void __launch_bounds__(kNormThreads)
rmsnorm_kernel(half* __restrict__ out, const float* __restrict__ hidden,
               const half* __restrict__ weight, int H, float eps) {
  __shared__ float scratch[32];
  griddep_wait();  // hidden comes from the kernel before
  griddep_launch_dependents();
  const int t = blockIdx.x;
  const float4* x4 = reinterpret_cast<const float4*>(hidden + (size_t)t * H);
  const int n4 = H / 4;
  float4 v[kMaxVec];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxVec; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i < n4) {
      v[j] = x4[i];
      ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    }
  }
  ss = block_sum(ss, scratch);
  const float r = rsqrtf(ss / (float)H + eps);
  const half2* w2 = reinterpret_cast<const half2*>(weight);
  half2* o2 = reinterpret_cast<half2*>(out + (size_t)t * H);
#pragma unroll
  for (int j = 0; j < kMaxVec; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i < n4) {
      float2 wa = __half22float2(w2[2 * i]), wb = __half22float2(w2[2 * i + 1]);
      o2[2 * i] = __floats2half2_rn(wa.x * (v[j].x * r), wa.y * (v[j].y * r));
      o2[2 * i + 1] = __floats2half2_rn(wb.x * (v[j].z * r), wb.y * (v[j].w * r));
    }
  }
}

cudaError_t rmsnorm(half* out, const float* hidden, const half* weight, int T, int H, float eps,
                    cudaStream_t stream) {
  if (T <= 0) return cudaSuccess;
  if (H % 4 || H > kNormThreads * 4 * kMaxVec)
    return nq_fail(cudaErrorInvalidValue,
                   "rmsnorm: H=%d must be a multiple of 4 and at most %d (T=%d)", H,
                   kNormThreads * 4 * kMaxVec, T);
  const cudaError_t e = launch_pdl("rmsnorm_kernel", rmsnorm_kernel, dim3(T), dim3(kNormThreads),
                                   0, stream, out, hidden, weight, H, eps);
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
