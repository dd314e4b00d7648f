// gemv_fp16.cu -- batch-1 fp16 GEMV with fp32 output: the lm_head (152064 x 3584 for the 7B,
// 1.09 GB, a quarter of all bytes a decode step reads).
//
// One warp owns R whole rows; lane l reads 16-byte chunks (8 weights) l, l+32, ... so each
// warp-wide load is 512 contiguous bytes, with U chunks per row in flight before the first use.
// Weights go through L1::no_allocate so x (k halves, read via the read-only path) stays in L1.
// Products and sums are fp32 (w and x are converted exactly), so logits carry no fp16 rounding:
// argmax ties are decided by the math, not by accumulation order beyond fp32's.
// Invariants (checked): n >= 1, k >= 8, k % 8 == 0, x and w 16-byte aligned.
// One instance, R = 1 row per warp and U = 8 chunks in flight: its variants (R1_U4, R2_U4,
// R1_U16) and the RMSNorm-in-the-prologue entry gemv_fp16_norm are in
// benchmarks/lab/gemv_fp16_lab.cu (GEMV_NOTES.md runs 1-2: all four within 0.7%, 104-106% of the
// copy bandwidth).
#include "common.cuh"
#include "gemv.h"

namespace nanoqwen {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

__device__ __forceinline__ float2 h2f(uint32_t u) {
  return __half22float2(*reinterpret_cast<half2*>(&u));
}

// PDL (common.cuh): the warp's first U weight chunks are loaded before griddep_wait(); x and the
// logits only after it.
constexpr int kRows = 1;    // R: rows per warp
constexpr int kUnroll = 8;  // U: 16-byte chunks per row in flight

// NC > 1: nc <= NC columns (the verify step), x [nc, k], out [nc, n]; per column the products
// and sums run in the one-column order, so each column is bit-identical to an NC = 1 launch.
template <int R, int U, int NC>
__global__ void __launch_bounds__(kThreads) gemv_fp16_kernel(float* __restrict__ out,
                                                             const half* __restrict__ x,
                                                             const half* __restrict__ w, int n,
                                                             int k, int nc) {
  const int lane = threadIdx.x & 31;
  const int C = k >> 3;  // 16-byte chunks per row
  const int ngroups = (n + R - 1) / R;
  const int gstride = gridDim.x * kWarps;
  int rg = blockIdx.x * kWarps + (threadIdx.x >> 5);  // this warp's row group (R rows)
  uint4 wv[U][R];
  int cb = 0;  // warp-uniform chunk base of the current step
  auto load = [&]() {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      // rows past n (last group only) re-read row n-1; their sums are never stored
      const uint4* wrow = reinterpret_cast<const uint4*>(w) + (size_t)min(rg * R + r, n - 1) * C;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = cb + lane + 32 * u;
        if (c < C) wv[u][r] = ld_weights(wrow + c);
      }
    }
  };
  if (rg < ngroups) load();
  griddep_wait();
  griddep_launch_dependents();
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  float acc0[NC][R], acc1[NC][R];  // two chains per row and column for FMA latency
#pragma unroll
  for (int q = 0; q < NC; ++q)
#pragma unroll
    for (int r = 0; r < R; ++r) acc0[q][r] = acc1[q][r] = 0.f;

  while (rg < ngroups) {  // warp-uniform
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = cb + lane + 32 * u;
      if (c < C) {
#pragma unroll
        for (int q = 0; q < NC; ++q) {
          if (NC > 1 && q >= nc) break;  // warp-uniform
          const uint4 xv = __ldg(x4 + (size_t)q * C + c);
          const float2 x0 = h2f(xv.x), x1 = h2f(xv.y), x2 = h2f(xv.z), x3 = h2f(xv.w);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const float2 w0 = h2f(wv[u][r].x), w1 = h2f(wv[u][r].y), w2 = h2f(wv[u][r].z),
                         w3 = h2f(wv[u][r].w);
            acc0[q][r] = fmaf(w0.x, x0.x, acc0[q][r]);
            acc1[q][r] = fmaf(w0.y, x0.y, acc1[q][r]);
            acc0[q][r] = fmaf(w1.x, x1.x, acc0[q][r]);
            acc1[q][r] = fmaf(w1.y, x1.y, acc1[q][r]);
            acc0[q][r] = fmaf(w2.x, x2.x, acc0[q][r]);
            acc1[q][r] = fmaf(w2.y, x2.y, acc1[q][r]);
            acc0[q][r] = fmaf(w3.x, x3.x, acc0[q][r]);
            acc1[q][r] = fmaf(w3.y, x3.y, acc1[q][r]);
          }
        }
      }
    }
    cb += 32 * U;
    if (cb >= C) {  // row group done
#pragma unroll
      for (int q = 0; q < NC; ++q) {
        if (NC > 1 && q >= nc) break;  // warp-uniform
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float v = acc0[q][r] + acc1[q][r];
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
          if (lane == r && rg * R + r < n) out[(size_t)q * n + rg * R + r] = v;
          acc0[q][r] = acc1[q][r] = 0.f;
        }
      }
      cb = 0;
      rg += gstride;
    }
    if (rg < ngroups) load();
  }
}

}  // namespace

cudaError_t gemv_fp16(float* logits, const half* x, const half* w, int n, int k, int cols,
                      cudaStream_t stream) {
  if (!logits || !x || !w)
    return nq_fail(cudaErrorInvalidValue, "gemv_fp16: null pointer (logits=%p x=%p w=%p)",
                   (const void*)logits, (const void*)x, (const void*)w);
  if (n < 1) return nq_fail(cudaErrorInvalidValue, "gemv_fp16: n=%d must be >= 1", n);
  if (k < 8 || k % 8)
    return nq_fail(cudaErrorInvalidValue, "gemv_fp16: k=%d is not a positive multiple of 8", k);
  if (misaligned16(x) || misaligned16(w))
    return nq_fail(cudaErrorInvalidValue, "gemv_fp16: x=%p and w=%p must be 16-byte aligned",
                   (const void*)x, (const void*)w);
  if (cols < 1 || cols > kMaxGemvCols)
    return nq_fail(cudaErrorInvalidValue, "gemv_fp16: cols=%d must be 1..%d (n=%d, k=%d)", cols,
                   kMaxGemvCols, n, k);
  const int warps = (n + kRows - 1) / kRows;
  const dim3 grid((warps + kWarps - 1) / kWarps);
  // one column: the decode step's instance; more: the smallest of 4, 8, 16 columns that holds
  // them, the same R and U (2 rows a warp with 4 chunks in flight measured slower at 8 columns:
  // RESULTS.md, session 15). Each column's sums run as in the one-column instance.
  const cudaError_t e =
      cols == 1  ? launch_pdl("gemv_fp16_kernel", gemv_fp16_kernel<kRows, kUnroll, 1>, grid,
                              dim3(kThreads), 0, stream, logits, x, w, n, k, cols)
      : cols <= 4 ? launch_pdl("gemv_fp16_kernel<4 columns>", gemv_fp16_kernel<kRows, kUnroll, 4>,
                               grid, dim3(kThreads), 0, stream, logits, x, w, n, k, cols)
      : cols <= 8 ? launch_pdl("gemv_fp16_kernel<8 columns>", gemv_fp16_kernel<kRows, kUnroll, 8>,
                               grid, dim3(kThreads), 0, stream, logits, x, w, n, k, cols)
                  : launch_pdl("gemv_fp16_kernel<16 columns>",
                               gemv_fp16_kernel<kRows, kUnroll, 16>, grid, dim3(kThreads), 0,
                               stream, logits, x, w, n, k, cols);
  if (e == cudaSuccess) return e;
  return nq_fail(e, "gemv_fp16: n=%d k=%d cols=%d: %s", n, k, cols, last_error_message());
}

}  // namespace nanoqwen
