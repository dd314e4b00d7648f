// lm_head_tc_lab.cu -- a lab candidate for the lm_head GEMV on tensor cores, for 1..16 columns
// (issue 13's verify step; RESULTS.md session 15: at 8 columns csrc/gemv_fp16.cu's fp32 FMAs, not
// its 1.09 GB, bound it: 599 us against 342 at one column). Not launched by the engine.
//
// logits[c][n] = sum_k W[n,k] * x[c][k], W fp16 [n, k] row-major, x fp16 [nc, k], fp32 out.
// A warp owns a 16-row tile at a time (grid-stride over tiles). Per k32 block lane (g, t) loads
// one 16-byte chunk (8 halves, k = 32*kb + 8t ..) of rows g and g+8 and the same chunk of x
// column g (and 8 + g for the second n8 tile): mma m16n8k16 #1 takes halves 0-3 of the chunks,
// #2 halves 4-7 -- the logical k of the mma (2t, 2t+1, 2t+8, 2t+9) maps to the same physical k
// for A and B, so the product is the plain dot product. fp16 x fp16 products are exact in fp32;
// the tensor core sums them in fp32. Column c's accumulator chain is the same for any nc, so
// columns are bit-identical to a one-column call (the property the verify step needs) -- if the
// decode step used this kernel too.
//
// benchmarks/lab/lm_head_tc.py compiles it alone (lab.compile_alone: csrc/common.cuh's fragment
// helpers) and calls it through ctypes.
#include "common.cuh"

namespace {

using nanoqwen::mma16816;     // csrc/common.cuh
using nanoqwen::ld_weights;   // weights: read once, not into L1


constexpr int kWarps = 8;

// One 16-row tile's weights over k32 blocks [kb0, kb1), the way every kernel here streams them:
// lane (g, t) loads its 16-byte chunk (k = 32 kb + 8t ..) of rows g and g+8, U blocks in flight,
// and hands each block's pair to use(kb, va, vb). The reads-only probe below shares it, so it
// times exactly the loads the tensor-core kernels issue.
template <int U, class Use>
__device__ __forceinline__ void tile_stream(const half* __restrict__ w, int tile, int n, int k,
                                            int kb0, int kb1, Use use) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, C = k >> 3;
  const int ra = min(tile * 16 + g, n - 1), rb = min(tile * 16 + g + 8, n - 1);
  const uint4* wa = reinterpret_cast<const uint4*>(w) + (size_t)ra * C + t;
  const uint4* wb = reinterpret_cast<const uint4*>(w) + (size_t)rb * C + t;
  for (int kb = kb0; kb < kb1; kb += U) {
    uint4 va[U], vb[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (kb + u < kb1) {
        va[u] = ld_weights(wa + (kb + u) * 4);
        vb[u] = ld_weights(wb + (kb + u) * 4);
      }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (kb + u < kb1) use(kb + u, va[u], vb[u]);
  }
}

// One 16-row tile's dot products over k32 blocks [kb0, kb1) into d (both kernels' math): the
// tile's weights as tile_stream streams them, and the same chunk of x columns 8nt + g (zeros
// past nc).
template <int NT, int U>
__device__ __forceinline__ void tile_dot(float (&d)[NT][4], const half* __restrict__ x,
                                         const half* __restrict__ w, int tile, int n, int k,
                                         int nc, int kb0, int kb1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, C = k >> 3;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  const uint4* xc[NT];
  bool ok[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    ok[nt] = nt * 8 + g < nc;
    xc[nt] = x4 + (size_t)(ok[nt] ? nt * 8 + g : 0) * C + t;
  }
  tile_stream<U>(w, tile, n, k, kb0, kb1, [&](int kb, const uint4& va, const uint4& vb) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint4 xv = ok[nt] ? __ldg(xc[nt] + kb * 4) : make_uint4(0u, 0u, 0u, 0u);
      mma16816(d[nt], va.x, vb.x, va.y, vb.y, xv.x, xv.y);
      mma16816(d[nt], va.z, vb.z, va.w, vb.w, xv.z, xv.w);
    }
  });
}

template <int NT, int U>
__global__ void __launch_bounds__(kWarps * 32) lm_head_tc_kernel(float* __restrict__ out,
                                                                 const half* __restrict__ x,
                                                                 const half* __restrict__ w,
                                                                 int n, int k, int nc) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int warp = blockIdx.x * kWarps + (threadIdx.x >> 5), nwarps = gridDim.x * kWarps;
  const int KB = k >> 5, tiles = (n + 15) >> 4;
  for (int tile = warp; tile < tiles; tile += nwarps) {
    float d[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) d[nt][0] = d[nt][1] = d[nt][2] = d[nt][3] = 0.f;
    tile_dot<NT, U>(d, x, w, tile, n, k, nc, 0, KB);
    // lane (g, t): rows g, g+8 of columns 8nt + 2t, 2t+1
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = nt * 8 + 2 * t + e, r = tile * 16 + g;
        if (col < nc) {
          if (r < n) out[(size_t)col * n + r] = d[nt][e];
          if (r + 8 < n) out[(size_t)col * n + r + 8] = d[nt][2 + e];
        }
      }
  }
}

// The same math with each 16-row tile's K split over KW warps of a block (8 / KW tiles a
// block), their fp32 partials summed in shared memory in warp order: deterministic, and each
// column's sum independent of nc. 9504 tiles of the 7B's lm_head make 9504 * KW warps of work
// instead of lm_head_tc_kernel's 9504 (two waves over 8448 warps on an H100, the second one
// eighth full).
template <int NT, int U, int KW>
__global__ void __launch_bounds__(kWarps * 32) lm_head_tc_splitk_kernel(float* __restrict__ out,
                                                                        const half* __restrict__ x,
                                                                        const half* __restrict__ w,
                                                                        int n, int k, int nc) {
  static_assert(kWarps % KW == 0, "whole tiles a block");
  constexpr int TPB = kWarps / KW, NCOL = 8 * NT;
  __shared__ float red[kWarps][16][NCOL];
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
  const int part = warp % KW, tib = warp / KW, tile = blockIdx.x * TPB + tib;
  const int KB = k >> 5, tiles = (n + 15) >> 4;
  float d[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) d[nt][0] = d[nt][1] = d[nt][2] = d[nt][3] = 0.f;
  if (tile < tiles)  // warp-uniform; the barrier below is outside it
    tile_dot<NT, U>(d, x, w, tile, n, k, nc, part * KB / KW, (part + 1) * KB / KW);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      red[warp][g][nt * 8 + 2 * t + e] = d[nt][e];
      red[warp][g + 8][nt * 8 + 2 * t + e] = d[nt][2 + e];
    }
  __syncthreads();
  for (int i = threadIdx.x; i < TPB * 16 * nc; i += kWarps * 32) {
    const int tb = i / (16 * nc), rem = i % (16 * nc), row = rem % 16, col = rem / 16;
    const int r = (blockIdx.x * TPB + tb) * 16 + row;
    if (r < n) {
      float v = 0.f;
#pragma unroll
      for (int p = 0; p < KW; ++p) v += red[tb * KW + p][row][col];
      out[(size_t)col * n + r] = v;
    }
  }
}

// Reads only (session 16's open question): every split-K tensor-core variant ran ~5% over the
// fp32-FMA GEMV at one column (360 against 341 us). Same bytes, other shapes of load: these two
// kernels keep only the loads -- the split-K tile's (a block a 16-row tile, warp p a K slice,
// lane (g, t) chunk 4 kb + t of rows g and g+8: a warp-wide load is 8 rows x 64 bytes) and
// gemv_fp16's (a warp a row, lane l chunks l, l+32, ...: 512 contiguous bytes) -- each lane
// XOR-folding what it loads into one word, stored, so nothing is optimized away.
template <int U>
__global__ void __launch_bounds__(kWarps * 32) read_tile_kernel(uint32_t* __restrict__ sink,
                                                                const half* __restrict__ w, int n,
                                                                int k) {
  const int warp = threadIdx.x >> 5, KB = k >> 5;
  uint32_t acc = 0;
  tile_stream<U>(w, blockIdx.x, n, k, warp * KB / kWarps, (warp + 1) * KB / kWarps,
                 [&](int, const uint4& va, const uint4& vb) {
                   acc ^= va.x ^ va.y ^ va.z ^ va.w ^ vb.x ^ vb.y ^ vb.z ^ vb.w;
                 });
  sink[(size_t)blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

template <int U>
__global__ void __launch_bounds__(kWarps * 32) read_row_kernel(uint32_t* __restrict__ sink,
                                                               const half* __restrict__ w, int n,
                                                               int k) {
  const int lane = threadIdx.x & 31, C = k >> 3;
  const int row = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (row >= n) return;  // warp-uniform; no barrier in this kernel
  const uint4* wr = reinterpret_cast<const uint4*>(w) + (size_t)row * C;
  uint32_t acc = 0;
  for (int cb = 0; cb < C; cb += 32 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (cb + lane + 32 * u < C) v[u] = ld_weights(wr + cb + lane + 32 * u);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (cb + lane + 32 * u < C) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  sink[(size_t)row * 32 + lane] = acc;
}

}  // namespace

// lm_head_tc with K split over kw (2, 4 or 8) warps a tile, `unroll` k32 blocks in flight (4;
// with kw 8 also 2, 7 or 14); 0 on success.
extern "C" int lm_head_tc_splitk(float* out, const half* x, const half* w, int n, int k, int nc,
                                 int kw, int unroll, cudaStream_t stream) {
  if (n < 1 || k < 32 || k % 32 || nc < 1 || nc > 16 || (kw != 2 && kw != 4 && kw != 8))
    return (int)cudaErrorInvalidValue;
  if (unroll != 4 && !(kw == 8 && (unroll == 2 || unroll == 7 || unroll == 14)))
    return (int)cudaErrorInvalidValue;
  const int tiles = (n + 15) / 16;
  const dim3 grid((tiles + kWarps / kw - 1) / (kWarps / kw)), block(kWarps * 32);
#define NQ_LMTC(NT, U, KW) \
  lm_head_tc_splitk_kernel<NT, U, KW><<<grid, block, 0, stream>>>(out, x, w, n, k, nc)
#define NQ_LMTC_U(NT)                    \
  if (kw == 2) NQ_LMTC(NT, 4, 2);        \
  else if (kw == 4) NQ_LMTC(NT, 4, 4);   \
  else if (unroll == 2) NQ_LMTC(NT, 2, 8);  \
  else if (unroll == 7) NQ_LMTC(NT, 7, 8);  \
  else if (unroll == 14) NQ_LMTC(NT, 14, 8); \
  else NQ_LMTC(NT, 4, 8)
  if (nc <= 8) {
    NQ_LMTC_U(1);
  } else {
    NQ_LMTC_U(2);
  }
#undef NQ_LMTC_U
#undef NQ_LMTC
  return (int)cudaGetLastError();
}

// 0 on success; a CUDA error otherwise (k % 32, nc 1..16, 16-byte alignment are the caller's).
extern "C" int lm_head_tc(float* out, const half* x, const half* w, int n, int k, int nc,
                          int unroll, cudaStream_t stream) {
  if (n < 1 || k < 32 || k % 32 || nc < 1 || nc > 16) return (int)cudaErrorInvalidValue;
  int sms = 0, dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int tiles = (n + 15) / 16;
  int blocks = (tiles + kWarps - 1) / kWarps;
  if (blocks > sms * 8) blocks = sms * 8;
  const dim3 grid(blocks), block(kWarps * 32);
  if (nc <= 8) {
    if (unroll == 8) lm_head_tc_kernel<1, 8><<<grid, block, 0, stream>>>(out, x, w, n, k, nc);
    else lm_head_tc_kernel<1, 4><<<grid, block, 0, stream>>>(out, x, w, n, k, nc);
  } else {
    if (unroll == 8) lm_head_tc_kernel<2, 8><<<grid, block, 0, stream>>>(out, x, w, n, k, nc);
    else lm_head_tc_kernel<2, 4><<<grid, block, 0, stream>>>(out, x, w, n, k, nc);
  }
  return (int)cudaGetLastError();
}

// The reads-only kernels: pattern 0 = the split-K tile's loads (U = 7, as the one-column
// instance), 1 = gemv_fp16's (U = 8). sink: at least 32 * n words. 0 on success.
extern "C" int lm_head_read(uint32_t* sink, const half* w, int n, int k, int pattern,
                            cudaStream_t stream) {
  if (n < 16 || k < 32 || k % 32 || (pattern != 0 && pattern != 1))
    return (int)cudaErrorInvalidValue;
  if (pattern == 0)
    read_tile_kernel<7><<<(n + 15) / 16, kWarps * 32, 0, stream>>>(sink, w, n, k);
  else
    read_row_kernel<8><<<(n + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(sink, w, n, k);
  return (int)cudaGetLastError();
}

