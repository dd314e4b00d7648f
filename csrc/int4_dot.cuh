// int4_dot.cuh -- the INT4 decode GEMV's arithmetic, shared by the kernels that must produce the
// same bits: gemv_int4.cu's tca kernel (the chain of launches) and decode_segment.cu's persistent
// segment kernel. A row's value is formed in exactly the same operations and order by both, so the
// two decode paths give bit-identical hidden states and logits (tests/gpu checks it) and the
// speculative verify step (tca kernel with columns) matches either.
#pragma once

#include "common.cuh"

namespace nanoqwen {

// One group of one 16-row tile: va / vb = lane t's 16-byte chunk of rows g / g+8, xv its x
// (staged order). Returns the dot products of rows g and g+8 over the group, before the group
// scale: per word, exact q (lo - 1032, hi/16 - 72) and two mmas.
__device__ __forceinline__ float2 group_dot(const uint4& va, const uint4& vb,
                                            const uint4 (&xv)[4]) {
  const uint32_t kLo = 0x64006400u;
  const half2 k1032 = as_h2(0x64086408u), k16 = as_h2(0x2C002C00u), k72 = as_h2(0xD480D480u);
  auto lo = [&](uint32_t v) { return h2_bits(__hsub2(as_h2(v), k1032)); };
  auto hi = [&](uint32_t v) { return h2_bits(__hfma2(as_h2(v), k16, k72)); };
  float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t a8 = wa[j] >> 8, b8 = wb[j] >> 8;
    const uint32_t alo0 = lop3_and_or(wa[j], 0x000F000Fu, kLo);
    const uint32_t ahi0 = lop3_and_or(wa[j], 0x00F000F0u, kLo);
    const uint32_t alo1 = lop3_and_or(a8, 0x000F000Fu, kLo);
    const uint32_t ahi1 = lop3_and_or(a8, 0x00F000F0u, kLo);
    const uint32_t blo0 = lop3_and_or(wb[j], 0x000F000Fu, kLo);
    const uint32_t bhi0 = lop3_and_or(wb[j], 0x00F000F0u, kLo);
    const uint32_t blo1 = lop3_and_or(b8, 0x000F000Fu, kLo);
    const uint32_t bhi1 = lop3_and_or(b8, 0x00F000F0u, kLo);
    mma16816(d0, lo(alo0), lo(blo0), hi(ahi0), hi(bhi0), xv[j].x, xv[j].y);
    mma16816(d1, lo(alo1), lo(blo1), hi(ahi1), hi(bhi1), xv[j].z, xv[j].w);
  }
  return make_float2(d0[0] + d1[0], d0[2] + d1[2]);
}

// The output of one row from its fp32 sum(s): the q/k/v projection's bias add and rounding, and the
// gate/up projection's silu(gate) * up, rounded once. (The residual op is a plain fp32 add.)
__device__ __forceinline__ half int4_store_value(float v, const half* bias, int row) {
  float y = v;
  if (bias) y += __half2float(bias[row]);
  return __float2half_rn(y);
}
__device__ __forceinline__ half int4_silu_value(float g, float u) {
  return __float2half_rn(g / (1.f + __expf(-g)) * u);
}

}  // namespace nanoqwen
