// lm_head_cols_lab.cu -- the verify step's lm_head (fp16 GEMV, fp32 out) at 2-16 columns with
// each column bit-identical to csrc/gemv_fp16.cu's one-column instance (the decode step's), so
// speculation stays exact. Driven by lm_head_cols.py; nothing in the engine links it. It includes
// csrc/gemv_fp16.cu whole (so it builds alone: lab.py's ALONE) and instantiates the product's
// rows kernel (gemv_fp16_rows_kernel, its step rows_step and its group end rows_finish) in other
// shapes, beside the form the product does not have.
//
// Why csrc's one-row-a-warp instance is slow past 4 columns (599 us at 8 against 342 at one):
// for every 8 weights each column costs an x load from L1 and 8 conversions besides its 8 FMAs,
// about 18 instructions a weight at 8 columns. A warp owning R rows loads and converts each x
// chunk once for R rows. Two ways to keep the weight bytes in flight with R*nc*2 accumulators in
// registers:
//   regs: a register ring of U steps a row (R*U*16 B a lane), the slot refilled right after its
//     weights are copied out (below; not in the product);
//   ring: the product's cp.async ring of S steps in shared memory (S*R*512 B a warp, no
//     registers), EXACT or with a runtime column count.
// Session 30 (H100, results/2026-12-07_lab_lm_head_cols_{5dbcf14,d1e20b3}_h100.json): ring
// R 4 S 4 exact 365 / 402 us at 5 / 8 columns, runtime-count R 4 S 4 up to 16 columns 907 at 16
// (R 2: 1245); the best register ring (R 8 U 1, 251 registers) 379 / 408. A third form, every
// column's x loaded first with a runtime count (d1e20b3's ringX_*), measured no better than
// without and is in that commit only.
#include "gemv_fp16.cu"
#include "lab_common.cuh"

namespace nanoqwen {
namespace {

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
  RowWalk ld{(int)(blockIdx.x * W + (threadIdx.x >> 5)), 0}, cp = ld;
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
      if (c < C) rows_step<R, NC, false>([&](int r) { return cur[r]; }, x4, C, c, nc, acc0, acc1);
      if (cp.j == J - 1) rows_finish<R, NC>(out, n, nc, cp.g, lane, acc0, acc1);
      cp.next(J, gstride);
    }
  }
}

// P = 0: every row group once (one group a warp); P = 1: the resident blocks only (persistent,
// each warp's loads running across its groups)
template <int R, int U, int NC, int W, int P>
cudaError_t launch_regs(float* out, const half* x, const half* w, int n, int k, int nc,
                        cudaStream_t s) {
  auto kern = lm_head_cols_regs<R, U, NC, W>;
  const int blocks = ((n + R - 1) / R + W - 1) / W;
  int per_sm = 1;
  if (P) cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, W * 32, 0);
  const dim3 grid(P ? std::min(blocks, std::max(per_sm, 1) * lab::num_sms()) : blocks);
  return launch_pdl("lm_head_cols_regs", kern, grid, dim3(W * 32), 0, s, out, x, w, n, k, nc);
}

// the product's rows kernel in other shapes (launch_rows: its ring, its resident grid)
template <int R, int S, int NC, int W, int MINB, bool EXACT>
cudaError_t launch_ring(float* out, const half* x, const half* w, int n, int k, int nc,
                        cudaStream_t s) {
  return launch_rows<R, S, NC, W, MINB, EXACT>("lm_head_cols ring", out, x, w, n, k, nc, s);
}

struct Variant {
  const char* name;
  int nc_max;
  bool exact;  // takes nc_max columns only
  cudaError_t (*launch)(float*, const half*, const half*, int, int, int, cudaStream_t);
};

const Variant kVariants[] = {
    {"regs_R4_U2_W8", 8, false, launch_regs<4, 2, 8, 8, 0>},
    {"regs_R4_U3_W4_persist", 8, false, launch_regs<4, 3, 8, 4, 1>},
    {"regs_R8_U1_W8_persist", 8, false, launch_regs<8, 1, 8, 8, 1>},
    {"ring_R4_S4_W8", 8, false, launch_ring<4, 4, 8, 8, 2, false>},
    {"ring_R2_S8_W8", 8, false, launch_ring<2, 8, 8, 8, 2, false>},
    {"ringE5_R4_S4_W8_b2 (product)", 5, true, launch_ring<4, 4, 5, 8, 2, true>},
    {"ringE8_R4_S4_W8_b2 (product)", 8, true, launch_ring<4, 4, 8, 8, 2, true>},
    {"ringE8_R4_S6_W8_b1", 8, true, launch_ring<4, 6, 8, 8, 1, true>},
    {"ringE12_R4_S4_W8_b1", 12, true, launch_ring<4, 4, 12, 8, 1, true>},
    {"ring16_R2_S6_W8", 16, false, launch_ring<2, 6, 16, 8, 1, false>},
    {"ring16_R4_S4_W8 (product)", 16, false, launch_ring<4, 4, 16, 8, 1, false>},
};

}  // namespace
}  // namespace nanoqwen

using nanoqwen::kVariants;

extern "C" {
int lm_head_cols_count() { return (int)(sizeof(kVariants) / sizeof(kVariants[0])); }
const char* lm_head_cols_name(int v) { return kVariants[v].name; }
int lm_head_cols_max(int v) { return kVariants[v].nc_max; }
int lm_head_cols_exact(int v) { return kVariants[v].exact; }
// out [cols, n] fp32, x [cols, k] fp16, w [n, k] fp16; 0 or a cudaError_t
int lm_head_cols(int v, float* out, const half* x, const half* w, int n, int k, int cols,
                 cudaStream_t s) {
  if (v < 0 || v >= lm_head_cols_count() || cols < 1 || cols > kVariants[v].nc_max || k % 8 ||
      n < 1 || (kVariants[v].exact && cols != kVariants[v].nc_max))
    return (int)cudaErrorInvalidValue;
  return (int)kVariants[v].launch(out, x, w, n, k, cols, s);
}
}
