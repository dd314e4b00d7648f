// lm_head_cols_lab.cu -- the verify step's lm_head (fp16 GEMV, fp32 out) at 5-16 columns with
// each column bit-identical to csrc/gemv_fp16.cu's one-column instance (the decode step's), so
// speculation stays exact. Driven by lm_head_cols.py; nothing in the engine links it.
//
// Why csrc's column instances are slow past 4 columns (599 us at 8 against 342 at one, 1.09 GB
// at the copy rate being ~335): one warp a row, so for every 8 weights each column costs an x
// load from L1 and 8 conversions besides its 8 FMAs -- 18 instructions a weight at 8 columns, and
// 8 x 16 B of L1 reads per 16 B of weights. Here a warp owns R rows and each x chunk, loaded and
// converted once, serves all R of them: per chunk and lane R*8 weight conversions, nc*(1 load +
// 8 conversions) and R*nc*8 FMAs, about 11 instructions a weight at R = 4 and 8 columns, and a
// quarter of the L1 traffic.
//
// Bit-identity with the one-column instance (U = 8, R = 1): there lane l sums the chunks
// (8 weights) c = l, l+32, ... in increasing order into two chains per row, acc0 over the even
// elements and acc1 over the odd ones, fmaf(w, x, acc) element by element; then v = acc0 + acc1
// and the xor butterfly 16, 8, 4, 2, 1. Here each (row, column) runs exactly those chains on the
// same lane with the same chunks in the same order, and the same butterfly; only which rows a
// warp owns and when their weights arrive differ.
//
// Two ways to keep the weight bytes in flight with R*nc*2 accumulators in registers:
//   A (regs): a register ring of U steps a row (R*U*16 B a lane), refilled right after a step's
//     weights are converted;
//   B (ring): a cp.async ring of S steps in shared memory (S*R*512 B a warp; no registers), each
//     lane reading back only the 16-byte slots it copied itself (no barrier: cp.async.wait_group).
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"

namespace {
using nanoqwen::ld_weights;
using nanoqwen::griddep_wait;
using nanoqwen::griddep_launch_dependents;

__device__ __forceinline__ float2 h2f(uint32_t u) {
  return __half22float2(*reinterpret_cast<half2*>(&u));
}

// One warp step: chunk c of R rows (weights wv, already loaded) against nc <= NC columns of x.
template <int R, int NC>
__device__ __forceinline__ void step_fma(const uint4 (&wv)[R], const uint4* __restrict__ x4,
                                         int C, int c, int nc, float (&acc0)[NC][R],
                                         float (&acc1)[NC][R]) {
  float wf[R][8];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float2 a = h2f(wv[r].x), b = h2f(wv[r].y), d = h2f(wv[r].z), e = h2f(wv[r].w);
    wf[r][0] = a.x; wf[r][1] = a.y; wf[r][2] = b.x; wf[r][3] = b.y;
    wf[r][4] = d.x; wf[r][5] = d.y; wf[r][6] = e.x; wf[r][7] = e.y;
  }
#pragma unroll
  for (int q = 0; q < NC; ++q) {
    if (q >= nc) break;  // warp-uniform
    const uint4 xv = __ldg(x4 + (size_t)q * C + c);
    const float2 x0 = h2f(xv.x), x1 = h2f(xv.y), x2 = h2f(xv.z), x3 = h2f(xv.w);
#pragma unroll
    for (int r = 0; r < R; ++r) {  // the one-column instance's order, element by element
      acc0[q][r] = fmaf(wf[r][0], x0.x, acc0[q][r]);
      acc1[q][r] = fmaf(wf[r][1], x0.y, acc1[q][r]);
      acc0[q][r] = fmaf(wf[r][2], x1.x, acc0[q][r]);
      acc1[q][r] = fmaf(wf[r][3], x1.y, acc1[q][r]);
      acc0[q][r] = fmaf(wf[r][4], x2.x, acc0[q][r]);
      acc1[q][r] = fmaf(wf[r][5], x2.y, acc1[q][r]);
      acc0[q][r] = fmaf(wf[r][6], x3.x, acc0[q][r]);
      acc1[q][r] = fmaf(wf[r][7], x3.y, acc1[q][r]);
    }
  }
}

// step_fma with every column's x chunk loaded first (column index clamped to nc - 1, so each
// load is unconditional and the compiler may issue all NC before the first use): the loads'
// latency is paid once a step instead of once a column (session 30, call 1: the break per
// column keeps the compiler from hoisting them).
template <int R, int NC>
__device__ __forceinline__ void step_fma_hoisted(const uint4 (&wv)[R], const uint4* __restrict__ x4,
                                                 int C, int c, int nc, float (&acc0)[NC][R],
                                                 float (&acc1)[NC][R]) {
  uint4 xr[NC];
#pragma unroll
  for (int q = 0; q < NC; ++q) xr[q] = __ldg(x4 + (size_t)min(q, nc - 1) * C + c);
  float wf[R][8];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float2 a = h2f(wv[r].x), b = h2f(wv[r].y), d = h2f(wv[r].z), e = h2f(wv[r].w);
    wf[r][0] = a.x; wf[r][1] = a.y; wf[r][2] = b.x; wf[r][3] = b.y;
    wf[r][4] = d.x; wf[r][5] = d.y; wf[r][6] = e.x; wf[r][7] = e.y;
  }
#pragma unroll
  for (int q = 0; q < NC; ++q) {
    if (q >= nc) break;  // warp-uniform
    const float2 x0 = h2f(xr[q].x), x1 = h2f(xr[q].y), x2 = h2f(xr[q].z), x3 = h2f(xr[q].w);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc0[q][r] = fmaf(wf[r][0], x0.x, acc0[q][r]);
      acc1[q][r] = fmaf(wf[r][1], x0.y, acc1[q][r]);
      acc0[q][r] = fmaf(wf[r][2], x1.x, acc0[q][r]);
      acc1[q][r] = fmaf(wf[r][3], x1.y, acc1[q][r]);
      acc0[q][r] = fmaf(wf[r][4], x2.x, acc0[q][r]);
      acc1[q][r] = fmaf(wf[r][5], x2.y, acc1[q][r]);
      acc0[q][r] = fmaf(wf[r][6], x3.x, acc0[q][r]);
      acc1[q][r] = fmaf(wf[r][7], x3.y, acc1[q][r]);
    }
  }
}

// exactly NC columns (no break: every load and FMA unconditional)
template <int R, int NC>
__device__ __forceinline__ void step_fma_exact(const uint4 (&wv)[R], const uint4* __restrict__ x4,
                                               int C, int c, int, float (&acc0)[NC][R],
                                               float (&acc1)[NC][R]) {
  step_fma_hoisted<R, NC>(wv, x4, C, c, NC, acc0, acc1);
}

// A row group's end: the butterfly per (row, column), stored by lane r; accumulators zeroed.
template <int R, int NC>
__device__ __forceinline__ void finish_group(float* __restrict__ out, int n, int nc, int g,
                                             int lane, float (&acc0)[NC][R], float (&acc1)[NC][R]) {
#pragma unroll
  for (int q = 0; q < NC; ++q) {
    if (q >= nc) break;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = acc0[q][r] + acc1[q][r];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == r && g * R + r < n) out[(size_t)q * n + g * R + r] = v;
      acc0[q][r] = acc1[q][r] = 0.f;
    }
  }
}

// The warp's walk over (row group, step): group g = rg, rg + gstride, ..., steps j = 0..J-1 of
// each (chunk lane + 32 j). Loads run ahead of the compute by the ring's depth, across groups.
struct Walk {
  int g, j;
  __device__ __forceinline__ void next(int J, int gstride) {
    if (++j == J) { j = 0; g += gstride; }
  }
};

template <int R, int U, int NC, int W>
__global__ void __launch_bounds__(W * 32) lm_head_cols_regs(float* __restrict__ out,
                                                            const half* __restrict__ x,
                                                            const half* __restrict__ w, int n,
                                                            int k, int nc) {
  const int lane = threadIdx.x & 31;
  const int C = k >> 3, J = (C + 31) >> 5;
  const int ngroups = (n + R - 1) / R, gstride = gridDim.x * W;
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  Walk ld{(int)blockIdx.x * W + (int)(threadIdx.x >> 5), 0}, cp = ld;
  uint4 wv[U][R];
  auto load = [&](uint4 (&dst)[R]) {
    if (ld.g < ngroups) {
      const int c = lane + 32 * ld.j;
      if (c < C) {
#pragma unroll
        for (int r = 0; r < R; ++r)
          dst[r] = ld_weights(w4 + (size_t)min(ld.g * R + r, n - 1) * C + c);
      }
      ld.next(J, gstride);
    }
  };
#pragma unroll
  for (int u = 0; u < U; ++u) load(wv[u]);
  griddep_wait();
  griddep_launch_dependents();
  float acc0[NC][R], acc1[NC][R];
#pragma unroll
  for (int q = 0; q < NC; ++q)
#pragma unroll
    for (int r = 0; r < R; ++r) acc0[q][r] = acc1[q][r] = 0.f;
  while (cp.g < ngroups) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (cp.g >= ngroups) break;  // warp-uniform
      const int c = lane + 32 * cp.j;
      uint4 cur[R];
#pragma unroll
      for (int r = 0; r < R; ++r) cur[r] = wv[u][r];
      load(wv[u]);  // refill the slot before this step's FMAs
      if (c < C) step_fma<R, NC>(cur, x4, C, c, nc, acc0, acc1);
      if (cp.j == J - 1) finish_group<R, NC>(out, n, nc, cp.g, lane, acc0, acc1);
      cp.next(J, gstride);
    }
  }
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

template <int R, int S, int NC, int W, int MINB, int X>
__global__ void __launch_bounds__(W * 32, MINB) lm_head_cols_ring(float* __restrict__ out,
                                                                  const half* __restrict__ x,
                                                                  const half* __restrict__ w,
                                                                  int n, int k, int nc) {
  extern __shared__ uint4 ring[];  // [W][S][R][32]
  const int lane = threadIdx.x & 31;
  const int C = k >> 3, J = (C + 31) >> 5;
  const int ngroups = (n + R - 1) / R, gstride = gridDim.x * W;
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  uint4* my = ring + (size_t)(threadIdx.x >> 5) * S * R * 32 + lane;
  Walk ld{(int)blockIdx.x * W + (int)(threadIdx.x >> 5), 0}, cp = ld;
  auto issue = [&](int slot) {  // one commit group per step, empty past the end
    if (ld.g < ngroups) {
      const int c = lane + 32 * ld.j;
      if (c < C) {
#pragma unroll
        for (int r = 0; r < R; ++r)
          cp_async16(my + (slot * R + r) * 32, w4 + (size_t)min(ld.g * R + r, n - 1) * C + c);
      }
      ld.next(J, gstride);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < S; ++s) issue(s);
  griddep_wait();
  griddep_launch_dependents();
  float acc0[NC][R], acc1[NC][R];
#pragma unroll
  for (int q = 0; q < NC; ++q)
#pragma unroll
    for (int r = 0; r < R; ++r) acc0[q][r] = acc1[q][r] = 0.f;
  while (cp.g < ngroups) {
#pragma unroll
    for (int u = 0; u < S; ++u) {
      if (cp.g >= ngroups) break;  // warp-uniform
      const int c = lane + 32 * cp.j;
      cp_async_wait<S - 1>();  // slot u's group (the oldest) has landed
      uint4 cur[R];
#pragma unroll
      for (int r = 0; r < R; ++r) cur[r] = my[(u * R + r) * 32];
      if (c < C) {
        if constexpr (X == 0) step_fma<R, NC>(cur, x4, C, c, nc, acc0, acc1);
        else if constexpr (X == 1) step_fma_hoisted<R, NC>(cur, x4, C, c, nc, acc0, acc1);
        else step_fma_exact<R, NC>(cur, x4, C, c, nc, acc0, acc1);
      }
      issue(u);  // after the slot's values were used: no same-thread write-after-read race
      if (cp.j == J - 1) finish_group<R, NC>(out, n, nc, cp.g, lane, acc0, acc1);
      cp.next(J, gstride);
    }
  }
  cp_async_wait<0>();
}

struct Variant {
  const char* name;
  int nc_max;
  cudaError_t (*launch)(float*, const half*, const half*, int, int, int, cudaStream_t);
};

int g_sms = 0;
int sms() {
  if (!g_sms) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, dev);
  }
  return g_sms;
}

template <typename K>
int resident_grid(K kern, int threads, size_t smem, int blocks) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, threads, smem);
  return min(blocks, max(per_sm, 1) * sms());
}

// grid: every row group once (P = 0: one group a warp) or only the resident blocks (P = 1:
// persistent, each warp walks groups rg, rg + gstride, ... and its loads run across them)
template <int R, int U, int NC, int W, int P>
cudaError_t launch_regs(float* out, const half* x, const half* w, int n, int k, int nc,
                        cudaStream_t s) {
  auto kern = lm_head_cols_regs<R, U, NC, W>;
  const int blocks = ((n + R - 1) / R + W - 1) / W;
  const dim3 grid(P ? resident_grid(kern, W * 32, 0, blocks) : blocks);
  return nanoqwen::launch_pdl("lm_head_cols_regs", kern, grid, dim3(W * 32), 0, s, out, x, w,
                              n, k, nc);
}

template <int R, int S, int NC, int W, int MINB, int X = 0>
cudaError_t launch_ring(float* out, const half* x, const half* w, int n, int k, int nc,
                        cudaStream_t s) {
  const size_t smem = (size_t)W * S * R * 32 * 16;
  auto kern = lm_head_cols_ring<R, S, NC, W, MINB, X>;
  static bool attr = false;
  if (!attr) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
    if (e != cudaSuccess) return e;
    attr = true;
  }
  const int blocks = ((n + R - 1) / R + W - 1) / W;
  const dim3 grid(resident_grid(kern, W * 32, smem, blocks));  // persistent: the ring primes once
  return nanoqwen::launch_pdl("lm_head_cols_ring", kern, grid, dim3(W * 32), smem, s, out, x, w,
                              n, k, nc);
}

const Variant kVariants[] = {
    // session 30 call 1's best (the product's 5-8 column instance is ring_R4_S4_W8)
    {"regs_R8_U1_W8_persist", 8, launch_regs<8, 1, 8, 8, 1>},
    {"ring_R4_S4_W8", 8, launch_ring<4, 4, 8, 8, 2>},
    // x hoisted (X = 1) and exactly-NC instances (X = 2, only at cols == NC)
    {"ringX_R4_S4_W8_b2", 8, launch_ring<4, 4, 8, 8, 2, 1>},
    {"ringX_R4_S6_W8_b1", 8, launch_ring<4, 6, 8, 8, 1, 1>},
    {"ringX_R8_S3_W8_b1", 8, launch_ring<8, 3, 8, 8, 1, 1>},
    {"ringX_R2_S8_W8_b2", 8, launch_ring<2, 8, 8, 8, 2, 1>},
    {"ringE8_R4_S4_W8_b2", 8, launch_ring<4, 4, 8, 8, 2, 2>},
    {"ringE8_R4_S6_W8_b1", 8, launch_ring<4, 6, 8, 8, 1, 2>},
    {"ringE5_R4_S4_W8_b2", 5, launch_ring<4, 4, 5, 8, 2, 2>},
    {"ring16_R4_S4_W8", 16, launch_ring<4, 4, 16, 8, 1>},
    {"ringX16_R2_S6_W8_b1", 16, launch_ring<2, 6, 16, 8, 1, 1>},
    {"ringX16_R4_S4_W8_b1", 16, launch_ring<4, 4, 16, 8, 1, 1>},
    {"ringE16_R2_S6_W8_b1", 16, launch_ring<2, 6, 16, 8, 1, 2>},
    {"ringE12_R4_S4_W8_b1", 12, launch_ring<4, 4, 12, 8, 1, 2>},
};

}  // namespace

extern "C" {
int lm_head_cols_count() { return (int)(sizeof(kVariants) / sizeof(kVariants[0])); }
const char* lm_head_cols_name(int v) { return kVariants[v].name; }
int lm_head_cols_max(int v) { return kVariants[v].nc_max; }
// the exactly-NC instances (ringE*) take cols == NC only
int lm_head_cols_exact(int v) { return kVariants[v].name[4] == 'E'; }
// out [cols, n] fp32, x [cols, k] fp16, w [n, k] fp16; 0 or a cudaError_t
int lm_head_cols(int v, float* out, const half* x, const half* w, int n, int k, int cols,
                 cudaStream_t s) {
  if (v < 0 || v >= lm_head_cols_count() || cols < 1 || cols > kVariants[v].nc_max || k % 8 ||
      n < 1 || (lm_head_cols_exact(v) && cols != kVariants[v].nc_max))
    return (int)cudaErrorInvalidValue;
  return (int)kVariants[v].launch(out, x, w, n, k, cols, s);
}
}
