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
// The verify step's 5-16 columns take gemv_fp16_rows_kernel (below): one warp a row costs every
// column an x load and 8 conversions per 8 weights, which bound that instance past 4 columns
// (599 us at 8 against 342 at one, RESULTS.md session 15).
#include <type_traits>

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

// Columns 5-16 (the verify step): a warp owns R rows, so an x chunk, loaded and converted once,
// serves R rows (per chunk and lane: R*8 weight conversions, nc*(1 load + 8 conversions), R*nc*8
// FMAs). The weights stream through a cp.async ring of S steps a warp in shared memory (S*R*512
// B; the accumulators leave no registers for a register ring deep enough), each lane reading
// back only the 16-byte slots it copied itself (cp_async_wait, no barrier) and refilling a slot
// after its values were used. The grid is the resident blocks; warp w walks row groups w, w +
// gstride, ..., and its copies run S steps ahead across groups. Bit-identical to the one-column
// instance per column: each (row, column) runs the same two chains on the same lane over the
// same chunks in the same order (c = lane + 32 j, j increasing; even elements into acc0, odd
// into acc1, fmaf element by element), then acc0 + acc1 and the same xor butterfly. Variants and
// their figures: benchmarks/lab/lm_head_cols_lab.cu (ring_R4_S4_W8, ringE*_R4_S4_W8_b2,
// ring16_R4_S4_W8 are this kernel's instances).
struct RowWalk {  // a warp's position: row group g, step j (chunk lane + 32 j) of J
  int g, j;
  __device__ __forceinline__ void next(int J, int gstride) {
    if (++j == J) {
      j = 0;
      g += gstride;
    }
  }
};

// One step of a warp's R rows: chunk c (< C) of each row, wget(r) returning row r's 16 bytes,
// against nc columns of x (x4: [nc, C] chunks), into the one-column instance's two chains per
// (column, row). EXACT: nc is NC, and every column's x chunk is loaded before the first FMA
// (no runtime column count: measured 6-8% faster at 5 and 8 columns, 17% at 12, than an
// instance with one; lab/lm_head_cols.py, session 30).
template <int R, int NC, bool EXACT, class WGet>
__device__ __forceinline__ void rows_step(WGet wget, const uint4* __restrict__ x4, int C, int c,
                                          int nc, float (&acc0)[NC][R], float (&acc1)[NC][R]) {
  uint4 xr[EXACT ? NC : 1];
  if constexpr (EXACT) {
#pragma unroll
    for (int q = 0; q < NC; ++q) xr[q] = __ldg(x4 + (size_t)q * C + c);
  }
  float wf[R][8];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const uint4 v = wget(r);
    const float2 a = h2f(v.x), b = h2f(v.y), d = h2f(v.z), e = h2f(v.w);
    wf[r][0] = a.x; wf[r][1] = a.y; wf[r][2] = b.x; wf[r][3] = b.y;
    wf[r][4] = d.x; wf[r][5] = d.y; wf[r][6] = e.x; wf[r][7] = e.y;
  }
#pragma unroll
  for (int q = 0; q < NC; ++q) {
    if (!EXACT && q >= nc) break;  // warp-uniform
    const uint4 xv = EXACT ? xr[EXACT ? q : 0] : __ldg(x4 + (size_t)q * C + c);
    const float2 x0 = h2f(xv.x), x1 = h2f(xv.y), x2 = h2f(xv.z), x3 = h2f(xv.w);
#pragma unroll
    for (int r = 0; r < R; ++r) {  // the one-column instance's order
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

// A row group's end: per (column, row) acc0 + acc1 and the xor butterfly 16, 8, 4, 2, 1 (the
// one-column instance's end, whose code is left as it was measured), stored by lane r (rows
// past n are not); the accumulators zeroed. 1 <= nc <= NC.
template <int R, int NC>
__device__ __forceinline__ void rows_finish(float* __restrict__ out, int n, int nc, int g,
                                            int lane, float (&acc0)[NC][R],
                                            float (&acc1)[NC][R]) {
#pragma unroll
  for (int q = 0; q < NC; ++q) {
    if (NC > 1 && q >= nc) break;  // warp-uniform
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

template <int R, int S, int NC, int W, int MINB, bool EXACT>
__global__ void __launch_bounds__(W * 32, MINB) gemv_fp16_rows_kernel(float* __restrict__ out,
                                                                      const half* __restrict__ x,
                                                                      const half* __restrict__ w,
                                                                      int n, int k, int nc) {
  if constexpr (EXACT) nc = NC;
  extern __shared__ uint4 ring[];  // [W][S][R][32]
  const int lane = threadIdx.x & 31;
  const int C = k >> 3, J = (C + 31) >> 5;
  const int ngroups = (n + R - 1) / R, gstride = gridDim.x * W;
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  uint4* my = ring + (size_t)(threadIdx.x >> 5) * S * R * 32 + lane;
  RowWalk ld{(int)(blockIdx.x * W + (threadIdx.x >> 5)), 0}, cp = ld;
  auto issue = [&](int slot) {  // one commit group per step, empty past the warp's last
    if (ld.g < ngroups) {
      const int c = lane + 32 * ld.j;
      if (c < C) {
#pragma unroll
        for (int r = 0; r < R; ++r)  // rows past n (last group) re-read row n-1, never stored
          cp_async16(my + (slot * R + r) * 32, w4 + (size_t)min(ld.g * R + r, n - 1) * C + c);
      }
      ld.next(J, gstride);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < S; ++s) issue(s);  // weights only: legal before griddep_wait (PDL rule 1)
  griddep_wait();
  griddep_launch_dependents();
  float acc0[NC][R], acc1[NC][R];
#pragma unroll
  for (int q = 0; q < NC; ++q)
#pragma unroll
    for (int r = 0; r < R; ++r) acc0[q][r] = acc1[q][r] = 0.f;
  while (cp.g < ngroups) {  // warp-uniform
#pragma unroll
    for (int u = 0; u < S; ++u) {  // ring slot u holds the step S back from the next copy
      if (cp.g >= ngroups) break;
      const int c = lane + 32 * cp.j;
      cp_async_wait<S - 1>();  // the oldest of S pending groups, slot u's, has landed
      if (c < C)
        rows_step<R, NC, EXACT>([&](int r) { return my[(u * R + r) * 32]; }, x4, C, c, nc, acc0,
                                acc1);
      issue(u);  // refill after the slot's values were used (no same-thread write-after-read)
      if (cp.j == J - 1) rows_finish<R, NC>(out, n, nc, cp.g, lane, acc0, acc1);
      cp.next(J, gstride);
    }
  }
  cp_async_wait<0>();
}

// One instance of the rows kernel: its ring's bytes and its resident grid (once per instance).
template <int R, int S, int NC, int W, int MINB, bool EXACT>
cudaError_t launch_rows(const char* what, float* out, const half* x, const half* w, int n, int k,
                        int nc, cudaStream_t stream) {
  constexpr int kSmem = W * S * R * 32 * 16;
  auto kern = gemv_fp16_rows_kernel<R, S, NC, W, MINB, EXACT>;
  static const cudaError_t attr = set_max_smem(kern, kSmem);
  if (attr != cudaSuccess) return smem_refused(attr, what, kSmem);
  static const int resident = [&] {
    int dev = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, W * 32, kSmem) !=
            cudaSuccess) {
      (void)cudaGetLastError();
      return 132;  // an H100's SMs: only the grid's size depends on it
    }
    return sms * (per_sm > 0 ? per_sm : 1);
  }();
  const int blocks = ((n + R - 1) / R + W - 1) / W;
  return launch_pdl(what, kern, dim3(std::min(blocks, resident)), dim3(W * 32), kSmem, stream,
                    out, x, w, n, k, nc);
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
  // one column: the decode step's instance; 2-4: the same kernel for 4 columns (x reloaded per
  // column, within 7% of the one-column time up to 4); 5-8: the rows kernel, 4 rows a warp, a
  // ring of 4 steps, 2 blocks an SM, one instance per column count (exact); 9-16: the rows
  // kernel for up to 16 columns, 4 rows a warp, 1 block an SM (lab/lm_head_cols.py, session 30:
  // 2 rows a warp was no faster than one at 16 columns). Each column's sums run as in the
  // one-column instance.
  auto exact = [&](auto nc) {
    return launch_rows<4, 4, decltype(nc)::value, 8, 2, true>(
        "gemv_fp16_rows_kernel<exactly 5-8 columns>", logits, x, w, n, k, cols, stream);
  };
  cudaError_t e;
  switch (cols) {
    case 1:
      e = launch_pdl("gemv_fp16_kernel", gemv_fp16_kernel<kRows, kUnroll, 1>, grid,
                     dim3(kThreads), 0, stream, logits, x, w, n, k, cols);
      break;
    case 2: case 3: case 4:
      e = launch_pdl("gemv_fp16_kernel<4 columns>", gemv_fp16_kernel<kRows, kUnroll, 4>, grid,
                     dim3(kThreads), 0, stream, logits, x, w, n, k, cols);
      break;
    case 5: e = exact(std::integral_constant<int, 5>{}); break;
    case 6: e = exact(std::integral_constant<int, 6>{}); break;
    case 7: e = exact(std::integral_constant<int, 7>{}); break;
    case 8: e = exact(std::integral_constant<int, 8>{}); break;
    default:
      e = launch_rows<4, 4, 16, 8, 1, false>("gemv_fp16_rows_kernel<16 columns>", logits, x, w, n,
                                             k, cols, stream);
  }
  if (e == cudaSuccess) return e;
  return nq_fail(e, "gemv_fp16: n=%d k=%d cols=%d: %s", n, k, cols, last_error_message());
}

}  // namespace nanoqwen
