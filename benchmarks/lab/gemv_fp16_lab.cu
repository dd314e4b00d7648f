// gemv_fp16_lab.cu -- csrc/gemv_fp16.cu as it was at commit 2047cf7: the four R/U variants
// (GEMV_NOTES.md runs 1-2: within 0.7% of each other; csrc/ keeps R1_U8), the bench hooks and
// gemv_fp16_norm (the RMSNorm in the prologue, NANOQWEN_FUSE_NORM=1 until its removal). Only the
// build glue changed (lab.h, named launches, csrc's error convention).
//
// (Original header:) gemv_fp16.cu -- batch-1 fp16 GEMV with fp32 output: the lm_head (152064 x 3584 for the 7B,
// 1.09 GB, a quarter of all bytes a decode step reads).
//
// One warp owns R whole rows; lane l reads 16-byte chunks (8 weights) l, l+32, ... so each
// warp-wide load is 512 contiguous bytes, with U chunks per row in flight before the first use.
// Weights go through L1::no_allocate so x (k halves, read via the read-only path) stays in L1.
// Products and sums are fp32 (w and x are converted exactly), so logits carry no fp16 rounding:
// argmax ties are decided by the math, not by accumulation order beyond fp32's.
// Invariants (checked): n >= 1, k >= 8, k % 8 == 0, x and w 16-byte aligned (the fused-norm
// entry: hidden and norm_w 16-byte aligned, k*2 bytes of x in shared memory, k <= 48000).
#include "common.cuh"  // csrc/: PDL, loads, cp.async, the error convention
#include "lab.h"
#include "lab_common.cuh"

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

using nanoqwen::ld_weights;  // common.cuh: streaming 16-byte load, no L1 allocation

__device__ __forceinline__ float2 h2f(uint32_t u) {
  return __half22float2(*reinterpret_cast<half2*>(&u));
}

// NORM: x = half(norm_w * hidden * rsqrt(mean(hidden^2) + eps)) is computed by each block into
// shared memory (k*2 bytes) in its prologue, and the grid is capped at kNormBlocksPerSM blocks
// per SM, each warp striding over row groups (gridDim.x * kWarps apart), so the norm is computed
// ~4 x 132 times rather than once per 8 rows. Without NORM, x is read through the read-only path.
// PDL (common.cuh): the warp's first U weight chunks are loaded before griddep_wait(); x, hidden
// and the logits only after it.
constexpr int kNormBlocksPerSM = 4;


__device__ __forceinline__ uint32_t h2_bits(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

template <int R, int U, bool NORM>
__global__ void __launch_bounds__(kThreads) gemv_fp16_kernel(float* __restrict__ out,
                                                             const half* __restrict__ x,
                                                             const half* __restrict__ w, int n,
                                                             int k, const float* hidden,
                                                             const half* norm_w, float eps) {
  extern __shared__ uint4 xsm[];  // NORM: x [k/8] 16-byte pieces, then 32 floats of scratch
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
  nanoqwen::griddep_wait();
  nanoqwen::griddep_launch_dependents();
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  if constexpr (NORM) {  // every thread of the block, before any warp leaves
    float* scratch = reinterpret_cast<float*>(xsm + C);
    const float4* h4 = reinterpret_cast<const float4*>(hidden);
    float ss = 0.f;
    for (int i = threadIdx.x; i < (k >> 2); i += kThreads) {
      const float4 v = h4[i];
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = nanoqwen::block_sum(ss, scratch);
    const float rs = rsqrtf(ss / (float)k + eps);  // exactly as csrc/embed_norm.cu's rmsnorm
    const uint4* w4 = reinterpret_cast<const uint4*>(norm_w);
    for (int i = threadIdx.x; i < C; i += kThreads) {
      const float4 h0 = h4[2 * i], h1 = h4[2 * i + 1];
      const uint4 wq = __ldg(w4 + i);
      const float2 w0 = h2f(wq.x), w1 = h2f(wq.y), w2 = h2f(wq.z), w3 = h2f(wq.w);
      uint4 o;
      o.x = h2_bits(__floats2half2_rn(w0.x * (h0.x * rs), w0.y * (h0.y * rs)));
      o.y = h2_bits(__floats2half2_rn(w1.x * (h0.z * rs), w1.y * (h0.w * rs)));
      o.z = h2_bits(__floats2half2_rn(w2.x * (h1.x * rs), w2.y * (h1.y * rs)));
      o.w = h2_bits(__floats2half2_rn(w3.x * (h1.z * rs), w3.y * (h1.w * rs)));
      xsm[i] = o;
    }
    __syncthreads();
    x4 = xsm;
  }

  float acc0[R], acc1[R];  // two chains per row for FMA latency
#pragma unroll
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = 0.f;

  while (rg < ngroups) {  // warp-uniform
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = cb + lane + 32 * u;
      if (c < C) {
        const uint4 xv = NORM ? x4[c] : __ldg(x4 + c);
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
    cb += 32 * U;
    if (cb >= C) {  // row group done
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float v = acc0[r] + acc1[r];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == r && rg * R + r < n) out[rg * R + r] = v;
        acc0[r] = acc1[r] = 0.f;
      }
      cb = 0;
      rg += gstride;
    }
    if (rg < ngroups) load();
  }
}

constexpr int kMaxSmemBytes = 96 * 1024;  // x of k <= 48000 (the family's largest k is 27648)

template <int R, int U>
cudaError_t launch_fp16(float* out, const half* x, const half* w, int n, int k,
                        cudaStream_t stream) {
  const int warps = (n + R - 1) / R;
  return nanoqwen::launch_pdl("lab gemv_fp16", gemv_fp16_kernel<R, U, false>, dim3((warps + kWarps - 1) / kWarps),
                              dim3(kThreads), 0, stream, out, x, w, n, k,
                              static_cast<const float*>(nullptr), static_cast<const half*>(nullptr),
                              0.f);
}

template <int R, int U>
cudaError_t launch_fp16_norm(float* out, const float* hidden, const half* norm_w, float eps,
                             const half* w, int n, int k, cudaStream_t stream) {
  auto kern = gemv_fp16_kernel<R, U, true>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmemBytes);
  if (attr != cudaSuccess) return nanoqwen::nq_fail(attr, "lab: cudaFuncSetAttribute(MaxDynamicSharedMemorySize) refused");
  const int smem = k * 2 + 32 * 4;
  if (smem > kMaxSmemBytes)
    return gemv_fail_("gemv_fp16_norm: k=%d needs %d bytes of shared memory, limit %d", k, smem,
                      kMaxSmemBytes);
  const int sms = lab::num_sms();
  if (sms < 1) return gemv_fail_("gemv_fp16_norm: could not read the SM count of the device");
  const int warps = (n + R - 1) / R;
  int grid = (warps + kWarps - 1) / kWarps;
  if (grid > sms * kNormBlocksPerSM) grid = sms * kNormBlocksPerSM;
  return nanoqwen::launch_pdl("lab gemv_fp16_norm", kern, dim3(grid), dim3(kThreads), smem, stream, out,
                              static_cast<const half*>(nullptr), w, n, k, hidden, norm_w, eps);
}

struct Fp16Variant {
  const char* name;
  cudaError_t (*launch)(float*, const half*, const half*, int, int, cudaStream_t);
  cudaError_t (*launch_norm)(float*, const float*, const half*, float, const half*, int, int,
                             cudaStream_t);
};

// Index 0 is what gemv_fp16 and gemv_fp16_norm use (chosen from the measurements in GEMV_NOTES.md).
const Fp16Variant kFp16Variants[] = {
    {"R1_U8", launch_fp16<1, 8>, launch_fp16_norm<1, 8>},
    {"R1_U4", launch_fp16<1, 4>, launch_fp16_norm<1, 4>},
    {"R2_U4", launch_fp16<2, 4>, launch_fp16_norm<2, 4>},
    {"R1_U16", launch_fp16<1, 16>, launch_fp16_norm<1, 16>},
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

cudaError_t check_norm(const char* fn, const float* hidden, const half* norm_w, float eps) {
  if (!hidden || !norm_w)
    return gemv_fail_("%s: null pointer (hidden=%p norm_w=%p)", fn, (const void*)hidden,
                      (const void*)norm_w);
  if ((reinterpret_cast<uintptr_t>(hidden) | reinterpret_cast<uintptr_t>(norm_w)) & 15u)
    return gemv_fail_("%s: hidden=%p and norm_w=%p must be 16-byte aligned", fn,
                      (const void*)hidden, (const void*)norm_w);
  if (!(eps > 0.f)) return gemv_fail_("%s: eps=%g must be > 0", fn, (double)eps);
  return cudaSuccess;
}

}  // namespace

extern "C" {

cudaError_t gemv_fp16_norm(float* logits, const float* hidden, const half* norm_w, float eps,
                           const half* w, int n, int k, cudaStream_t stream) {
  // hidden stands in for x in the shared pointer/shape check
  if (cudaError_t e = check_fp16("gemv_fp16_norm", logits, reinterpret_cast<const half*>(hidden), w, n, k))
    return e;
  if (cudaError_t e = check_norm("gemv_fp16_norm", hidden, norm_w, eps)) return e;
  return kFp16Variants[0].launch_norm(logits, hidden, norm_w, eps, w, n, k, stream);
}

cudaError_t gemv_fp16_norm_bench(int variant, float* logits, const float* hidden,
                                 const half* norm_w, float eps, const half* w, int n, int k,
                                 cudaStream_t stream) {
  if (variant < 0 || variant >= kNumFp16Variants)
    return gemv_fail_("gemv_fp16_norm_bench: variant=%d not in [0, %d)", variant, kNumFp16Variants);
  if (cudaError_t e = check_fp16("gemv_fp16_norm_bench", logits, reinterpret_cast<const half*>(hidden), w, n, k))
    return e;
  if (cudaError_t e = check_norm("gemv_fp16_norm_bench", hidden, norm_w, eps)) return e;
  return kFp16Variants[variant].launch_norm(logits, hidden, norm_w, eps, w, n, k, stream);
}

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

