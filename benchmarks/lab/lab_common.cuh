// Device/host helpers only the lab kernels use (csrc/common.cuh has the shared ones).
#pragma once

#include <cuda_runtime.h>

#include "common.cuh"

namespace nanoqwen {
// Warp-wide and block-wide fp32 sums (left csrc/common.cuh with the step's rmsnorm, whose sum of
// squares is now common.cuh's fixed order). block_sum: `scratch` holds >= 32 floats; every
// thread of the block calls it (block barriers), never inside a warp-id branch.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? scratch[lane] : 0.f;
  return warp_sum(r);
}
}  // namespace nanoqwen

namespace lab {

// SM count of the current device (host; cached per device; not a stream operation, so legal
// while a graph is being captured). Sizes the v4 persistent grids and the fused-norm lm_head.
inline int num_sms() {
  static int cache[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev < 0 || dev >= 64) return 132;
  if (!cache[dev]) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
    cache[dev] = v;
  }
  return cache[dev];
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// csrc's cp_async16, with the .L2::256B prefetch hint when L2_256 (the _pf variants; measured
// 1-3% slower, GEMV_NOTES.md runs 7 and 9).
template <bool L2_256>
__device__ __forceinline__ void cp_async16_hint(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (L2_256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

}  // namespace lab
