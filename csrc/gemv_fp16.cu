// gemv_fp16.cu -- batch-1 fp16 GEMV with fp32 output: the lm_head (152064 x 3584 for the 7B,
// 1.09 GB, a quarter of all bytes a decode step reads).
//
// One warp owns R whole rows; lane l reads 16-byte chunks (8 weights) l, l+32, ... so each
// warp-wide load is 512 contiguous bytes, with U chunks per row in flight before the first use.
// Weights go through L1::no_allocate so x (k halves, read via the read-only path) stays in L1.
// Products and sums are fp32 (w and x are converted exactly), so logits carry no fp16 rounding:
// argmax ties are decided by the math, not by accumulation order beyond fp32's.
// Invariants (checked): n >= 1, k >= 8, k % 8 == 0, x and w 16-byte aligned.
#include "common.cuh"
#include "gemv.h"

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

using nanoqwen::ld_weights;  // common.cuh: streaming 16-byte load, no L1 allocation

__device__ __forceinline__ float2 h2f(uint32_t u) {
  return __half22float2(*reinterpret_cast<half2*>(&u));
}

template <int R, int U>
__global__ void __launch_bounds__(kThreads) gemv_fp16_kernel(float* __restrict__ out,
                                                             const half* __restrict__ x,
                                                             const half* __restrict__ w, int n,
                                                             int k) {
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * R;
  if (row0 >= n) return;  // whole warp leaves together
  const int C = k >> 3;   // 16-byte chunks per row
  const uint4* wrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    wrow[r] = reinterpret_cast<const uint4*>(w) + (size_t)min(row0 + r, n - 1) * C;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);

  float acc0[R], acc1[R];  // two chains per row for FMA latency
#pragma unroll
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = 0.f;

  for (int c0 = lane; c0 < C; c0 += 32 * U) {
    uint4 wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (c0 + 32 * u < C) {
#pragma unroll
        for (int r = 0; r < R; ++r) wv[u][r] = ld_weights(wrow[r] + c0 + 32 * u);
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c < C) {
        const uint4 xv = __ldg(x4 + c);
        const float2 x0 = h2f(xv.x), x1 = h2f(xv.y), x2 = h2f(xv.z), x3 = h2f(xv.w);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float2 w0 = h2f(wv[u][r].x), w1 = h2f(wv[u][r].y), w2 = h2f(wv[u][r].z),
                       w3 = h2f(wv[u][r].w);
          acc0[r] = fmaf(w0.x, x0.x, acc0[r]);
          acc1[r] = fmaf(w0.y, x0.y, acc1[r]);
          acc0[r] = fmaf(w1.x, x1.x, acc0[r]);
          acc1[r] = fmaf(w1.y, x1.y, acc1[r]);
          acc0[r] = fmaf(w2.x, x2.x, acc0[r]);
          acc1[r] = fmaf(w2.y, x2.y, acc1[r]);
          acc0[r] = fmaf(w3.x, x3.x, acc0[r]);
          acc1[r] = fmaf(w3.y, x3.y, acc1[r]);
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    float v = acc0[r] + acc1[r];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == r && row0 + r < n) out[row0 + r] = v;
  }
}

template <int R, int U>
cudaError_t launch_fp16(float* out, const half* x, const half* w, int n, int k,
                        cudaStream_t stream) {
  const int warps = (n + R - 1) / R;
  gemv_fp16_kernel<R, U><<<(warps + kWarps - 1) / kWarps, kThreads, 0, stream>>>(out, x, w, n, k);
  return cudaGetLastError();
}

struct Fp16Variant {
  const char* name;
  cudaError_t (*launch)(float*, const half*, const half*, int, int, cudaStream_t);
};

// Index 0 is what gemv_fp16 uses (chosen from the measurements in GEMV_NOTES.md).
const Fp16Variant kFp16Variants[] = {
    {"R1_U8", launch_fp16<1, 8>},
    {"R1_U4", launch_fp16<1, 4>},
    {"R2_U4", launch_fp16<2, 4>},
    {"R1_U16", launch_fp16<1, 16>},
};
constexpr int kNumFp16Variants = sizeof(kFp16Variants) / sizeof(kFp16Variants[0]);

cudaError_t check_fp16(const char* fn, const float* out, const half* x, const half* w, int n, int k) {
  if (!out || !x || !w)
    return gemv_fail_("%s: null pointer (logits=%p x=%p w=%p)", fn, (const void*)out,
                      (const void*)x, (const void*)w);
  if (n < 1) return gemv_fail_("%s: n=%d must be >= 1", fn, n);
  if (k < 8 || k % 8) return gemv_fail_("%s: k=%d is not a positive multiple of 8", fn, k);
  if ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15u)
    return gemv_fail_("%s: x=%p and w=%p must be 16-byte aligned", fn, (const void*)x,
                      (const void*)w);
  return cudaSuccess;
}

}  // namespace

extern "C" {

cudaError_t gemv_fp16(float* logits, const half* x, const half* w, int n, int k,
                      cudaStream_t stream) {
  if (cudaError_t e = check_fp16("gemv_fp16", logits, x, w, n, k)) return e;
  return kFp16Variants[0].launch(logits, x, w, n, k, stream);
}

int gemv_fp16_variant_count(void) { return kNumFp16Variants; }

const char* gemv_fp16_variant_name(int variant) {
  return (variant >= 0 && variant < kNumFp16Variants) ? kFp16Variants[variant].name : nullptr;
}

cudaError_t gemv_fp16_bench(int variant, float* logits, const half* x, const half* w, int n,
                            int k, cudaStream_t stream) {
  if (variant < 0 || variant >= kNumFp16Variants)
    return gemv_fail_("gemv_fp16_bench: variant=%d not in [0, %d)", variant, kNumFp16Variants);
  if (cudaError_t e = check_fp16("gemv_fp16_bench", logits, x, w, n, k)) return e;
  return kFp16Variants[variant].launch(logits, x, w, n, k, stream);
}

}  // extern "C"

// TEMPORARY (development only, replaced before anything lands): entry point declared in gemv.h
extern "C" cudaError_t gemv_fp16_norm(float*, const float*, const half*, float, const half*, int,
                                      int, cudaStream_t) {
  return gemv_fail_("gemv_fp16_norm: not implemented yet");
}
