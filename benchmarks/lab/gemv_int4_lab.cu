// gemv_int4_lab.cu -- the lab's INT4 GEMV families: csrc/gemv_int4.cu as it was at commit
// 2047cf7 (the last with them in csrc/), with every variant measured in
// benchmarks/GEMV_NOTES.md runs 1-9: v2 (CUDA cores, warp per row: smem_* / L1_*), v3 (tensor
// cores, register-held loads: tc_*), v4 (persistent streaming: ps_*), v5 (tensor cores on a
// cp.async ring: tca_*, incl. DQ_CORR, the L2 prefetch hint _pf, x from L1 _xg), the fused-RMSNorm
// prologue (gemv_int4_norm / gemv_int4_silu_mul_norm, NANOQWEN_FUSE_NORM=1 until its removal),
// the 31-entry variant table and the bench hooks. Only the build glue changed: lab.h instead of
// gemv.h, launch_pdl naming its kernels, messages through csrc's error convention. csrc/ keeps
// the tca_exact instances of the launchers below (its kInt4Table); benchmarks/lab/gemv_harness.py
// checks and times everything here. The notes below are the file's own, as measured.
//
// (Original header:) batch-1 INT4 (group-128, symmetric, code offset 8) GEMV kernels for
// decode, plus the INT4 -> fp16 dequantizer that prefill uses to feed cuBLAS.
//
// Layout: see gemv.h / engine/quant.py. A 16-byte load of a row (a "chunk") holds 32 consecutive
// inputs: words j=0..3 cover k = 32c + 8j .. +7, and because of the interleaved nibble order
//     lop3((w >> 4i) & 0x000F000F | 0x64006400)  ==  half2(1024 + u[8j+2i], 1024 + u[8j+2i+1])
// i.e. two *consecutive* inputs, so the matching activations are a plain half2 of x.
// Subtracting 1032 (1024 + code offset 8) is exact in fp16 and leaves q = u - 8 in -7..7.
//
// Work split: one warp owns R whole output rows (no split-K, no atomics: deterministic, and the
// residual add is a plain read-modify-write). Lane l reads chunks l, l+32, l+64, ... of each row,
// so every warp-wide load is 512 contiguous bytes; U chunks per row (x NM matrices x R rows) are
// issued before any is used, to keep enough bytes in flight to cover DRAM latency. The 7B shapes
// have n >= 3584 rows, i.e. >= 13 two-row warps per SM, so whole-row warps fill the chip; K is
// never split. x is staged per block in shared memory, transposed to [4][k/32] 16-byte pieces, so
// the warp's four reads of x per chunk are contiguous and conflict-free (reading it from L1 with
// the chunk's 64-byte lane stride cost 16 L1 wavefronts per instruction and capped v1 at 20-50%
// of bandwidth: GEMV_NOTES.md). Weights use L1::no_allocate; the first step's weight loads are
// issued before the x staging so they overlap it.
//
// Accumulation (variant ACC, measured in benchmarks/GEMV_NOTES.md):
//   ACC_H16W  q*x products summed in fp16 within one word (4 products per half lane, exact q),
//             then fp32 across words, the group scale applied in fp32 per chunk.
//   ACC_H16C  weights dequantized to fp16 (q*s) and summed in fp16 over a whole 32-input chunk.
//   ACC_F32   q and x converted to fp32, fp32 FMAs (most instructions).
// The v2 launchers of runs 2-6 used ACC_H16W (since run 7 the launchers use v5 tca_exact, fp32
// sums): ACC_F32 measured 20-35% slower, ACC_H16C 5-25% slower and less accurate. Its limit:
// four products |q| <= 7 times |x| summed in fp16 overflow only if |x| > 65504/28 = 2339.
#include "common.cuh"  // csrc/: PDL, loads, cp.async, the error convention
#include "lab.h"
#include "lab_common.cuh"

#include <stdarg.h>
#include <stdio.h>

namespace {

constexpr int kWarps = 8;               // warps per block
constexpr int kThreads = kWarps * 32;
constexpr int kGroup = 128;

enum { ACC_H16W = 0, ACC_H16C = 1, ACC_F32 = 2 };
enum { OP_STORE = 0, OP_RESID = 1, OP_SILU = 2 };

struct Args {
  void* out;
  const half* x;
  const uint32_t* qw;
  const half* sc;
  const uint32_t* qw2;  // up matrix (OP_SILU only)
  const half* sc2;
  const half* bias;     // OP_STORE only, may be null
  int n;
  int k;
  // fused RMSNorm (gemv_int4_norm / gemv_int4_silu_mul_norm): x is not read, it is computed per
  // block from hidden; only the v4 (ps_*) and v5 (tca_*) variants support it
  const float* hidden = nullptr;
  const half* norm_w = nullptr;
  float eps = 0.f;
};

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;  // (a & b) | c : immLut = (0xF0 & 0xCC) | 0xAA = 0xEA
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

using nanoqwen::ld_weights;  // common.cuh: streaming 16-byte load, no L1 allocation

__device__ __forceinline__ half2 as_h2(uint32_t u) { return *reinterpret_cast<half2*>(&u); }

// One word -> four half2 of exact q = u - 8, element pairs (0,1), (2,3), (4,5), (6,7).
__device__ __forceinline__ void unpack_word(uint32_t v, half2 (&q)[4]) {
  const half2 k1032 = as_h2(0x64086408u);  // half2(1032, 1032)
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = __hsub2(as_h2(lop3_and_or(v >> (4 * i), 0x000F000Fu, 0x64006400u)), k1032);
}

// Dot product of one 32-input chunk of one row with x, scaled by the group scale, in fp32.
template <int ACC>
__device__ __forceinline__ float chunk_dot(const uint4& wv, const half2 (&xh)[16],
                                           const float2 (&xf)[16], half s) {
  const uint32_t w[4] = {wv.x, wv.y, wv.z, wv.w};
  if constexpr (ACC == ACC_H16W) {
    float2 r = make_float2(0.f, 0.f);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      half2 q[4];
      unpack_word(w[j], q);
      half2 a = __hmul2(q[0], xh[4 * j]);
      a = __hfma2(q[1], xh[4 * j + 1], a);
      a = __hfma2(q[2], xh[4 * j + 2], a);
      a = __hfma2(q[3], xh[4 * j + 3], a);
      const float2 f = __half22float2(a);
      r.x += f.x;
      r.y += f.y;
    }
    return (r.x + r.y) * __half2float(s);
  } else if constexpr (ACC == ACC_H16C) {
    const half2 s2 = __half2half2(s);
    half2 a[2] = {__float2half2_rn(0.f), __float2half2_rn(0.f)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      half2 q[4];
      unpack_word(w[j], q);
#pragma unroll
      for (int i = 0; i < 4; ++i) a[j & 1] = __hfma2(__hmul2(q[i], s2), xh[4 * j + i], a[j & 1]);
    }
    const float2 f0 = __half22float2(a[0]), f1 = __half22float2(a[1]);
    return (f0.x + f1.x) + (f0.y + f1.y);
  } else {
    float r0 = 0.f, r1 = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      half2 q[4];
      unpack_word(w[j], q);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 qf = __half22float2(q[i]);
        r0 = fmaf(qf.x, xf[4 * j + i].x, r0);
        r1 = fmaf(qf.y, xf[4 * j + i].y, r1);
      }
    }
    return (r0 + r1) * __half2float(s);
  }
}

template <int R, int U, int ACC, int OP, bool XS>
__global__ void __launch_bounds__(kThreads) gemv_int4_kernel(const Args a) {
  constexpr int NM = OP == OP_SILU ? 2 : 1;  // matrices read per output row
  extern __shared__ uint4 xs[];              // XS: x transposed to [4][C] (16-byte pieces)
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * R;
  const bool active = row0 < a.n;  // per warp: no shuffle below is orphaned
  if (!XS && !active) return;
  const int C = a.k >> 5;  // 16-byte chunks per row
  const int G = a.k >> 7;  // groups per row

  const uint4* qrow[NM][R];
  const half* srow[NM][R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    // rows past n (last warp only) re-read row n-1; their sums are never stored
    const size_t row = (size_t)min(row0 + r, a.n - 1);
    qrow[0][r] = reinterpret_cast<const uint4*>(a.qw) + row * C;
    srow[0][r] = a.sc + row * G;
    if constexpr (NM == 2) {
      qrow[NM - 1][r] = reinterpret_cast<const uint4*>(a.qw2) + row * C;
      srow[NM - 1][r] = a.sc2 + row * G;
    }
  }
  const uint4* x4 = reinterpret_cast<const uint4*>(a.x);

  float acc[NM][R];
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;

  uint4 wv[U][NM][R];
  half sv[U][NM][R];
  // issue every weight and scale load of one step before the first use
  auto load_step = [&](int c0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c < C) {
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
          for (int r = 0; r < R; ++r) {
            wv[u][m][r] = ld_weights(qrow[m][r] + c);
            sv[u][m][r] = __ldg(srow[m][r] + (c >> 2));
          }
      }
    }
  };

  int c0 = lane;
  load_step(c0);  // the first step's weights are in flight while x is staged
  // PDL (common.cuh): weights are constant, so they were loaded before the wait; x, the bias and
  // the output only after it
  nanoqwen::griddep_wait();
  nanoqwen::griddep_launch_dependents();
  if constexpr (XS) {
    // Lane l needs x[32c .. 32c+31] for its chunk c: read straight from global that is four
    // 16-byte loads with a 64-byte lane stride, 16 L1 lines per instruction, and it capped v1 at
    // 20-50% of bandwidth. Transposed, piece j of chunk c sits at xs[j*C + c]: a warp's read of
    // piece j is 512 contiguous bytes, conflict-free.
    for (int i = threadIdx.x; i < 4 * C; i += kThreads) xs[(i & 3) * C + (i >> 2)] = __ldg(x4 + i);
    __syncthreads();
    if (!active) return;
  }

  while (c0 < C) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c < C) {
        half2 xh[16];
        float2 xf[16];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint4 v = XS ? xs[j * C + c] : __ldg(x4 + 4 * c + j);
          xh[4 * j + 0] = as_h2(v.x);
          xh[4 * j + 1] = as_h2(v.y);
          xh[4 * j + 2] = as_h2(v.z);
          xh[4 * j + 3] = as_h2(v.w);
        }
        if constexpr (ACC == ACC_F32) {
#pragma unroll
          for (int i = 0; i < 16; ++i) xf[i] = __half22float2(xh[i]);
        }
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
          for (int r = 0; r < R; ++r) acc[m][r] += chunk_dot<ACC>(wv[u][m][r], xh, xf, sv[u][m][r]);
      }
    }
    c0 += 32 * U;
    load_step(c0);
  }

#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[m][r] += __shfl_xor_sync(0xffffffffu, acc[m][r], off);

#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = row0 + r;
    if (lane == r && row < a.n) {
      if constexpr (OP == OP_STORE) {
        float v = acc[0][r];
        if (a.bias) v += __half2float(a.bias[row]);
        static_cast<half*>(a.out)[row] = __float2half_rn(v);
      } else if constexpr (OP == OP_RESID) {
        static_cast<float*>(a.out)[row] += acc[0][r];
      } else {
        const float g = acc[0][r], u = acc[NM - 1][r];
        static_cast<half*>(a.out)[row] = __float2half_rn(g / (1.f + __expf(-g)) * u);
      }
    }
  }
}

// ---- v3: tensor-core path (mma.sync m16n8k16, fp32 accumulation) -------------------------------
// A 16-row tile per warp: lane (g = lane/4, t = lane%4) owns rows g and g+8 of the tile and, for
// group G, the 16-byte chunk t of that group (k = 128G + 32t .. +31) in both rows. Because the dot
// product is a sum, the k order inside one mma is free as long as A and B agree: thread t's A
// elements are words of its own chunk and its B elements the matching x, identical for all 8 B
// columns, so every column of D is the dot product (D[g][*] = row g, D[g+8][*] = row g+8) and the
// k-sum across the 4 lanes of a row happens inside the tensor core: no shuffles, fp32 sums.
// A group is exactly one mma chain per row pair (8 mmas per lane), so the group scale is applied
// once per group in fp32: acc += s * D_group.
// Word j of a chunk (k = 8j..8j+7): lo0 = (w & 0x000F000F)|0x64006400 -> 1024+u at k {0,1},
// hi0 = (w & 0x00F000F0)|0x64006400 -> 1024+16u at k {2,3}; the same on w>>8 for k {4,5}, {6,7}.
//   DQ_EXACT (Marlin): q = lo - 1032 (hsub2), q = hi/16 - 72 (hfma2): exact q in fp16, one mma per
//     k-quad: A = {q(g)k01, q(g+8)k01, q(g)k23, q(g+8)k23}, B = {x01, x23}.  10 instr / 8 weights.
//   DQ_CORR: no fp16 subtraction at all. lo and hi values go to two mma chains as they are
//     (A_lo = {lo0 g, lo0 g+8, lo1 g, lo1 g+8} with B = {x01, x45}; A_hi likewise with {x23, x67}),
//     and the offsets are removed by starting the chains at C_lo = -1032*sum(x_lo),
//     C_hi = -1152*sum(x_hi) -- themselves one mma each per k-slice with a constant A, computed
//     once per group per warp (shared by the warp's tiles). Then D = D_lo + D_hi/16 exactly as math;
//     the tensor core sums products of size ~1024|x| in fp32: relative error ~1e-5..1e-4.
//     6 instr / 8 weights + 8 mmas per group per warp.
// K is split across the KS warps of a block (warp s takes groups s, s+KS, ...), so n = 3584 still
// gives 224 blocks x KS warps; partial sums meet in shared memory in fixed order (deterministic).
// Each warp stages the x of its own groups into shared memory (transposed so the four lanes of a
// row read 64 contiguous bytes) after issuing its first D groups of weight loads; a ring of D
// groups of weights (16 B per row per lane) stays in flight.
enum { DQ_EXACT = 0, DQ_CORR = 1 };

__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// DQ_CORR's per-group offset K = -(1032 * sum(x at lo positions) + 72 * sum(x at hi positions)),
// the same for every row: two mma chains with a constant A = -1032 (one constant register quad).
// 0 for DQ_EXACT. xv: lane t's x of the group, in staged order.
template <int DQ>
__device__ __forceinline__ float group_corr(const uint4 (&xv)[4]) {
  if constexpr (DQ == DQ_CORR) {
    const uint32_t nlo = 0xE408E408u;  // half2(-1032, -1032)
    float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      mma16816(c0, nlo, nlo, nlo, nlo, xv[j].x, xv[j].y);
      mma16816(c1, nlo, nlo, nlo, nlo, xv[j].z, xv[j].w);
    }
    return fmaf(c1[0], 72.f / 1032.f, c0[0]);
  } else {
    return 0.f;
  }
}

// One group of one 16-row tile: va / vb = lane t's 16-byte chunk of rows g / g+8, xv its x
// (staged order), kc = group_corr(xv). Returns the dot products of rows g and g+8 over the
// group, before the group scale (8 mmas, the dequant of the notes above).
template <int DQ>
__device__ __forceinline__ float2 group_dot(const uint4& va, const uint4& vb, const uint4 (&xv)[4],
                                            float kc) {
  const uint32_t kLo = 0x64006400u;
  float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t a8 = wa[j] >> 8, b8 = wb[j] >> 8;
    uint32_t alo0 = lop3_and_or(wa[j], 0x000F000Fu, kLo), ahi0 = lop3_and_or(wa[j], 0x00F000F0u, kLo);
    uint32_t alo1 = lop3_and_or(a8, 0x000F000Fu, kLo), ahi1 = lop3_and_or(a8, 0x00F000F0u, kLo);
    uint32_t blo0 = lop3_and_or(wb[j], 0x000F000Fu, kLo), bhi0 = lop3_and_or(wb[j], 0x00F000F0u, kLo);
    uint32_t blo1 = lop3_and_or(b8, 0x000F000Fu, kLo), bhi1 = lop3_and_or(b8, 0x00F000F0u, kLo);
    if constexpr (DQ == DQ_CORR) {
      mma16816(d0, alo0, blo0, alo1, blo1, xv[j].x, xv[j].y);
      mma16816(d1, ahi0, bhi0, ahi1, bhi1, xv[j].z, xv[j].w);
    } else {
      const half2 k1032 = as_h2(0x64086408u), k16 = as_h2(0x2C002C00u), k72 = as_h2(0xD480D480u);
      auto lo = [&](uint32_t v) { const half2 q = __hsub2(as_h2(v), k1032); return *reinterpret_cast<const uint32_t*>(&q); };
      auto hi = [&](uint32_t v) { const half2 q = __hfma2(as_h2(v), k16, k72); return *reinterpret_cast<const uint32_t*>(&q); };
      mma16816(d0, lo(alo0), lo(blo0), hi(ahi0), hi(bhi0), xv[j].x, xv[j].y);
      mma16816(d1, lo(alo1), lo(blo1), hi(ahi1), hi(bhi1), xv[j].z, xv[j].w);
    }
  }
  const float f1 = DQ == DQ_CORR ? 0.0625f : 1.f;
  return make_float2(fmaf(d1[0], f1, d0[0]) + kc, fmaf(d1[2], f1, d0[2]) + kc);
}

// One output row from its fp32 sum(s): store (+bias, rounded to half), residual add (fp32), or
// silu(gate) * up (rounded to half). Every kernel family ends in it.
template <int OP>
__device__ __forceinline__ void emit_row(const Args& a, int row, const float (&v)[OP == OP_SILU ? 2 : 1]) {
  if constexpr (OP == OP_STORE) {
    float y = v[0];
    if (a.bias) y += __half2float(a.bias[row]);
    static_cast<half*>(a.out)[row] = __float2half_rn(y);
  } else if constexpr (OP == OP_RESID) {
    static_cast<float*>(a.out)[row] += v[0];
  } else {
    const float g = v[0], u = v[1];
    static_cast<half*>(a.out)[row] = __float2half_rn(g / (1.f + __expf(-g)) * u);
  }
}

// Split-K epilogue of the tensor-core kernels: the KS warps' partial sums (acc[m][r][0/1] = rows
// g, g+8 of tile r of matrix m, held by the lanes with t == 0) meet in shared memory `red`
// (KS*NM*RT*16 floats) and are summed in warp order (deterministic); one thread per row applies
// the op. Contains a block barrier: every thread of the block calls it.
template <int NM, int RT, int KS, int OP>
__device__ __forceinline__ void splitk_store(const Args& a, float* red, const float (&acc)[NM][RT][2],
                                             int s, int g, int t, int row0) {
  if (t == 0) {
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        red[((s * NM + m) * RT + r) * 16 + g] = acc[m][r][0];
        red[((s * NM + m) * RT + r) * 16 + g + 8] = acc[m][r][1];
      }
  }
  __syncthreads();
  const int tid = threadIdx.x;
  if (tid < 16 * RT) {
    const int row = row0 + tid;
    if (row < a.n) {
      float v[NM];
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        v[m] = 0.f;
#pragma unroll
        for (int w = 0; w < KS; ++w) v[m] += red[(w * NM + m) * RT * 16 + tid];
      }
      emit_row<OP>(a, row, v);
    }
  }
}

template <int NM, int RT, int KS, int D, int DQ, int OP>
// at least 16 warps per SM (<= 128 registers): enough warps to hide the mma and load latencies
__global__ void __launch_bounds__(KS * 32, KS >= 16 ? 1 : 16 / KS) gemv_int4_tc_kernel(const Args a) {
  // shared memory: x [k/8 uint4] (per group [j][t] transposed); float red[KS][NM][RT][16];
  // half2 scales[KS][ceil(G/KS)][NM][RT][8]
  extern __shared__ uint4 xs[];
  const int lane = threadIdx.x & 31, s = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int C = a.k >> 5, G = a.k >> 7;
  const int row0 = blockIdx.x * (16 * RT);
  const uint4* wp[NM][RT][2];
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // rows past n (last block only) re-read row n-1; their sums are never stored
        const size_t row = (size_t)min(row0 + 16 * r + g + 8 * h, a.n - 1);
        wp[m][r][h] = reinterpret_cast<const uint4*>(m ? a.qw2 : a.qw) + row * C + 4 * s + t;
      }
  const int cnt = s < G ? (G - s + KS - 1) / KS : 0;  // this warp's groups: s, s+KS, ...
  float* red = reinterpret_cast<float*>(xs + (a.k >> 3));
  half2* ss = reinterpret_cast<half2*>(red + KS * NM * RT * 16) + s * ((G + KS - 1) / KS) * NM * RT * 8;

  uint4 wv[D][NM][RT][2];
  // loads happen in group order, so each row pointer just advances by KS groups (4 chunks each)
  auto load = [&](int d) {
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          wv[d][m][r][h] = ld_weights(wp[m][r][h]);
          wp[m][r][h] += 4 * KS;
        }
  };
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (d < cnt) load(d);
  nanoqwen::griddep_wait();  // PDL: x and the output only after the wait (common.cuh)
  nanoqwen::griddep_launch_dependents();
  {  // stage this warp's x: 16 pieces per group, piece p = 4t + j stored at 4j + t; for DQ_CORR
     // the words of a piece are reordered to (x01, x45, x23, x67) so that each mma's B operand
     // (x01, x45) / (x23, x67) is a register pair as loaded (no moves)
    const uint4* x4 = reinterpret_cast<const uint4*>(a.x);
    const int p = lane & 15;
    for (int i = lane >> 4; i < cnt; i += 2) {
      const int gi = s + i * KS;
      uint4 v = __ldg(x4 + gi * 16 + p);
      if constexpr (DQ == DQ_CORR) v = make_uint4(v.x, v.z, v.y, v.w);
      xs[gi * 16 + (p & 3) * 4 + (p >> 2)] = v;
    }
    // and its scales, as half2 (row g, row g+8) per (group, matrix, tile, g): one LDS per use
    constexpr int E = NM * RT * 8;  // entries per group
    for (int e = lane; e < cnt * E; e += 32) {
      const int i = e / E, m = (e / (RT * 8)) % NM, r = (e / 8) % RT, gg = e % 8;
      const half* scm = m ? a.sc2 : a.sc;
      const size_t rlo = (size_t)min(row0 + 16 * r + gg, a.n - 1);
      const size_t rhi = (size_t)min(row0 + 16 * r + gg + 8, a.n - 1);
      const int gi = s + i * KS;
      ss[e] = __halves2half2(__ldg(scm + rlo * G + gi), __ldg(scm + rhi * G + gi));
    }
    __syncwarp();
  }

  float acc[NM][RT][2];
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int r = 0; r < RT; ++r) acc[m][r][0] = acc[m][r][1] = 0.f;

  for (int i0 = 0; i0 < cnt; i0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int i = i0 + d;
      if (i < cnt) {
        const int gi = s + i * KS;
        uint4 xv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) xv[j] = xs[gi * 16 + j * 4 + t];
        const float kc = group_corr<DQ>(xv);
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
          for (int r = 0; r < RT; ++r) {
            const float2 dd = group_dot<DQ>(wv[d][m][r][0], wv[d][m][r][1], xv, kc);
            const float2 sc2 = __half22float2(ss[(i * NM + m) * RT * 8 + r * 8 + g]);
            acc[m][r][0] = fmaf(sc2.x, dd.x, acc[m][r][0]);
            acc[m][r][1] = fmaf(sc2.y, dd.y, acc[m][r][1]);
          }
        if (i + D < cnt) load(d);
      }
    }
  }

  splitk_store<NM, RT, KS, OP>(a, red, acc, s, g, t, row0);
}

// ---- v4: persistent streaming kernel (ps_* variants) -------------------------------------------
// The grid is one block per SM (x BPS); block b owns the contiguous rows [b*n/G, (b+1)*n/G), so x
// (or the fused RMSNorm) is staged into shared memory once per block, not once per 8 rows. The
// block's rows are cut into "segments" -- 32 consecutive 16-byte chunks of one row, one warp-wide
// 512-byte load -- and the block's segment list (row-major) is split into W contiguous,
// equal-length (+-1) ranges, one per warp: split-K falls out for long rows (down_proj: a row is
// 19 segments, a warp ~32), whole rows for short ones, and the load is balanced to one segment
// whatever n and k are. Each warp runs a ring of D segments of weight (and scale) loads: segment
// s+D is issued as soon as segment s is consumed, so loads stay in flight across row boundaries
// (no per-row drain); the first D are issued BEFORE griddep_wait(), overlapping the previous
// kernel's tail under PDL and this block's x staging / norm prologue.
// A row finished inside one warp is written by that warp; a row shared by several warps (at most
// one at each end of a warp's range) leaves one fp32 partial per warp in shared memory, and after
// the block barrier the first warp's slot plus the following warps' slots are added in warp
// order: deterministic, no atomics, every row written exactly once.
// Accumulation: ACC_H16W (q*x products summed four deep in fp16, then fp32) or ACC_F32. For
// H16W, x is pre-scaled by 2^-e (e >= 0 the smallest with max|x| * 2^-e <= 1024, exact except for
// values that become fp16 subnormals, whose contribution is < 2^-24 * 2^e each) and the fp32 sum
// multiplied back by 2^e: four products |q| <= 8 of |x'| <= 1024 stay below 32768, so there is no
// |x| limit at all (fp16 x is finite, <= 65504).
// Dequant (Marlin's trick, 9 instructions per 8 weights): lo = lop3(w, 0x000F000F, 0x64006400) =
// half2(1024 + u) -> q = lo - 1032; hi = lop3(w, 0x00F000F0, 0x64006400) = half2(1024 + 16u) ->
// q = hi/16 - 72 (one hfma2, exact); on w and w >> 8 these are the pairs k {0,1}, {2,3}, {4,5},
// {6,7} of the word (nibble order {0,2,4,6,1,3,5,7}).

// Scale loads that must not be moved past griddep_wait() by the compiler (volatile asm keeps
// their order relative to the wait's volatile asm; the weights use common.cuh's ld_weights,
// volatile for the same reason).
__device__ __forceinline__ half ld_s_early(const half* p) {
  unsigned short v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return __ushort_as_half(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = lab::warp_max(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return lab::warp_max(lane < nwarps ? scratch[lane] : 0.f);
}

__device__ __forceinline__ uint32_t h2_bits(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

__device__ __forceinline__ float piece_amax(const uint4& v) {
  const half2 m = __hmax2(__hmax2(__habs2(as_h2(v.x)), __habs2(as_h2(v.y))),
                          __hmax2(__habs2(as_h2(v.z)), __habs2(as_h2(v.w))));
  const float2 f = __half22float2(m);
  return fmaxf(f.x, f.y);
}

// Stages x (given, or RMSNorm(hidden) * norm_w rounded to half exactly as csrc/embed_norm.cu's
// rmsnorm kernel rounds it) into xs, transposed to [4][C] 16-byte pieces (piece j of chunk c at
// xs[j*C + c]: a warp's read of piece j is 512 contiguous bytes, conflict-free). With PRESCALE,
// x is multiplied by 2^-e (see above) and 2^e is returned. Called by every thread of the block;
// ends with a barrier.
template <int THREADS, bool NORM, bool PRESCALE>
__device__ __forceinline__ float stage_x(const Args& a, uint4* xs, float* scratch) {
  const int C = a.k >> 5, P = a.k >> 3;  // P: 16-byte pieces of x
  float amax = 0.f;
  if constexpr (NORM) {
    const float4* h4 = reinterpret_cast<const float4*>(a.hidden);
    float ss = 0.f;
    for (int i = threadIdx.x; i < (a.k >> 2); i += THREADS) {
      const float4 v = h4[i];
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = nanoqwen::block_sum(ss, scratch);
    const float r = rsqrtf(ss / (float)a.k + a.eps);
    const uint4* w4 = reinterpret_cast<const uint4*>(a.norm_w);
    for (int i = threadIdx.x; i < P; i += THREADS) {
      const float4 h0 = h4[2 * i], h1 = h4[2 * i + 1];
      const uint4 wq = __ldg(w4 + i);
      const float2 w0 = __half22float2(as_h2(wq.x)), w1 = __half22float2(as_h2(wq.y)),
                   w2 = __half22float2(as_h2(wq.z)), w3 = __half22float2(as_h2(wq.w));
      uint4 o;
      o.x = h2_bits(__floats2half2_rn(w0.x * (h0.x * r), w0.y * (h0.y * r)));
      o.y = h2_bits(__floats2half2_rn(w1.x * (h0.z * r), w1.y * (h0.w * r)));
      o.z = h2_bits(__floats2half2_rn(w2.x * (h1.x * r), w2.y * (h1.y * r)));
      o.w = h2_bits(__floats2half2_rn(w3.x * (h1.z * r), w3.y * (h1.w * r)));
      xs[(i & 3) * C + (i >> 2)] = o;
      if constexpr (PRESCALE) amax = fmaxf(amax, piece_amax(o));
    }
  } else {
    const uint4* x4 = reinterpret_cast<const uint4*>(a.x);
    for (int i = threadIdx.x; i < P; i += THREADS) {
      const uint4 v = __ldg(x4 + i);
      xs[(i & 3) * C + (i >> 2)] = v;
      if constexpr (PRESCALE) amax = fmaxf(amax, piece_amax(v));
    }
  }
  if constexpr (!PRESCALE) {
    __syncthreads();
    return 1.f;
  } else {
    amax = block_max(amax, scratch);  // its barriers also publish the stores above
    int e = 0;
    for (; e < 16 && amax > 1024.f; ++e) amax *= 0.5f;  // NaN/inf: e stays small, NaN propagates
    if (e) {  // block-uniform; each thread rescales the pieces it wrote
      const half2 s2 = __float2half2_rn(ldexpf(1.f, -e));
      for (int i = threadIdx.x; i < P; i += THREADS) {
        uint4& v = xs[(i & 3) * C + (i >> 2)];
        v = make_uint4(h2_bits(__hmul2(as_h2(v.x), s2)), h2_bits(__hmul2(as_h2(v.y), s2)),
                       h2_bits(__hmul2(as_h2(v.z), s2)), h2_bits(__hmul2(as_h2(v.w), s2)));
      }
    }
    __syncthreads();
    return ldexpf(1.f, e);
  }
}

// Dot product of one 32-input chunk (weights wv, x pieces xp[0..3]) times the group scale, fp32.
template <int ACC>
__device__ __forceinline__ float chunk_dot_v4(const uint4& wv, const uint4 (&xp)[4], half s) {
  const uint32_t w[4] = {wv.x, wv.y, wv.z, wv.w};
  const half2 k1032 = as_h2(0x64086408u), k16 = as_h2(0x2C002C00u), k72 = as_h2(0xD480D480u);
  float r0 = 0.f, r1 = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t v = w[j], v8 = w[j] >> 8;
    const half2 q0 = __hsub2(as_h2(lop3_and_or(v, 0x000F000Fu, 0x64006400u)), k1032);
    const half2 q1 = __hfma2(as_h2(lop3_and_or(v, 0x00F000F0u, 0x64006400u)), k16, k72);
    const half2 q2 = __hsub2(as_h2(lop3_and_or(v8, 0x000F000Fu, 0x64006400u)), k1032);
    const half2 q3 = __hfma2(as_h2(lop3_and_or(v8, 0x00F000F0u, 0x64006400u)), k16, k72);
    const half2 x0 = as_h2(xp[j].x), x1 = as_h2(xp[j].y), x2 = as_h2(xp[j].z), x3 = as_h2(xp[j].w);
    if constexpr (ACC == ACC_F32) {
      const half2 q[4] = {q0, q1, q2, q3}, xx[4] = {x0, x1, x2, x3};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 qf = __half22float2(q[i]), xf = __half22float2(xx[i]);
        r0 = fmaf(qf.x, xf.x, r0);
        r1 = fmaf(qf.y, xf.y, r1);
      }
    } else {
      half2 acc = __hmul2(q0, x0);
      acc = __hfma2(q1, x1, acc);
      acc = __hfma2(q2, x2, acc);
      acc = __hfma2(q3, x3, acc);
      const float2 f = __half22float2(acc);
      r0 += f.x;
      r1 += f.y;
    }
  }
  return (r0 + r1) * __half2float(s);
}


// shared memory: x (k*2 bytes), partials float[W][2][NM], scratch float[32]
constexpr int ps_smem_bytes(int k, int warps, int nm) { return k * 2 + (warps * 2 * nm + 32) * 4; }

// LD: 16-byte loads in flight per lane (ring slots D = LD / NM: gate/up loads two per segment)
template <int THREADS, int LD, int ACC, int OP, bool NORM>
// at most half an SM's registers (minBlocks 2), so the next kernel's block can co-reside (PDL)
__global__ void __launch_bounds__(THREADS, 2) gemv_int4_ps_kernel(const Args a) {
  constexpr int NM = OP == OP_SILU ? 2 : 1;
  constexpr int D = LD / NM > 0 ? LD / NM : 1;
  constexpr int W = THREADS / 32;
  extern __shared__ uint4 xs[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int C = a.k >> 5, G = a.k >> 7, J = (C + 31) >> 5;  // J: segments per row
  const int r0 = (int)((long long)blockIdx.x * a.n / gridDim.x);
  const int r1 = (int)((long long)(blockIdx.x + 1) * a.n / gridDim.x);
  const int T = (r1 - r0) * J;  // the block's segments
  const int s0 = (int)((long long)warp * T / W), s1 = (int)((long long)(warp + 1) * T / W);

  const uint4* qb[NM];
  const half* sb[NM];
  qb[0] = reinterpret_cast<const uint4*>(a.qw);
  sb[0] = a.sc;
  if constexpr (NM == 2) {
    qb[NM - 1] = reinterpret_cast<const uint4*>(a.qw2);
    sb[NM - 1] = a.sc2;
  }

  uint4 wv[D][NM];
  half sv[D][NM];
  // load cursor: segment ls = row lrow (absolute), segment lj within the row
  int ls = s0, lrow = r0 + s0 / J, lj = s0 % J;
  auto issue = [&](int d) {
    if (ls < s1) {
      const int c = lj * 32 + lane;
      if (c < C) {
#pragma unroll
        for (int m = 0; m < NM; ++m) {
          wv[d][m] = ld_weights(qb[m] + (size_t)lrow * C + c);
          sv[d][m] = ld_s_early(sb[m] + (size_t)lrow * G + (c >> 2));
        }
      }
      ++ls;
      if (++lj == J) {
        lj = 0;
        ++lrow;
      }
    }
  };
#pragma unroll
  for (int d = 0; d < D; ++d) issue(d);  // weights only: allowed before the wait (common.cuh)

  nanoqwen::griddep_wait();  // x / hidden / the residual are written by earlier kernels
  nanoqwen::griddep_launch_dependents();
  float* part = reinterpret_cast<float*>(xs + (a.k >> 3));
  float* scratch = part + W * 2 * NM;
  const float xscale = stage_x<THREADS, NORM, ACC != ACC_F32>(a, xs, scratch);

  float acc[NM];
#pragma unroll
  for (int m = 0; m < NM; ++m) acc[m] = 0.f;
  const int frow = r0 + s0 / J;  // this warp's first row
  int crow = frow, cj = s0 % J;  // compute cursor
  for (int cs = s0; cs < s1; cs += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (cs + d < s1) {  // warp-uniform
        uint4 w[NM];
        half sc[NM];
#pragma unroll
        for (int m = 0; m < NM; ++m) {
          w[m] = wv[d][m];
          sc[m] = sv[d][m];
        }
        issue(d);  // refill the slot first: loads stay in flight across the row boundary below
        const int c = cj * 32 + lane;
        if (c < C) {
          uint4 xp[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) xp[j] = xs[j * C + c];
#pragma unroll
          for (int m = 0; m < NM; ++m) acc[m] += chunk_dot_v4<ACC>(w[m], xp, sc[m]);
        }
        if (cj == J - 1 || cs + d == s1 - 1) {  // end of this warp's part of row crow
          float v[NM];
#pragma unroll
          for (int m = 0; m < NM; ++m) {
            v[m] = nanoqwen::warp_sum(acc[m]) * xscale;
            acc[m] = 0.f;
          }
          const int rs = (crow - r0) * J;  // the row's first segment (block-local)
          if (lane == 0) {
            if (rs >= s0 && rs + J <= s1) {
              emit_row<OP>(a, crow, v);  // the whole row was this warp's
            } else {
              const int slot = crow == frow ? 0 : 1;
#pragma unroll
              for (int m = 0; m < NM; ++m) part[(warp * 2 + slot) * NM + m] = v[m];
            }
          }
        }
        if (++cj == J) {
          cj = 0;
          ++crow;
        }
      }
    }
  }

  // rows shared by several warps: thread w combines the row that starts in warp w's range and
  // continues past it (warp w's slot, then slot 0 of each later warp touching the row, in order)
  __syncthreads();
  if (threadIdx.x < W) {
    const int w = threadIdx.x;
    const int a0 = (int)((long long)w * T / W), a1 = (int)((long long)(w + 1) * T / W);
    if (a1 > a0) {
      const int lr = (a1 - 1) / J;  // warp w's last row (block-local)
      const int rs = lr * J, re = rs + J;
      if (rs >= a0 && re > a1) {
        const int slot = lr == a0 / J ? 0 : 1;
        float v[NM];
#pragma unroll
        for (int m = 0; m < NM; ++m) v[m] = part[(w * 2 + slot) * NM + m];
        for (int w2 = w + 1; w2 < W; ++w2) {
          const int b0 = (int)((long long)w2 * T / W), b1 = (int)((long long)(w2 + 1) * T / W);
          if (b0 >= re) break;
          if (b1 > b0) {
#pragma unroll
            for (int m = 0; m < NM; ++m) v[m] += part[(w2 * 2) * NM + m];
          }
        }
        emit_row<OP>(a, r0 + lr, v);
      }
    }
  }
}

// One thread per 16-byte chunk: 32 outputs, written as four 16-byte stores.
__global__ void __launch_bounds__(256) dequant_int4_kernel(half* w, const uint4* qw, const half* sc,
                                                           size_t total_chunks, int C, int G) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total_chunks;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t row = i / C;
    const int c = (int)(i - row * C);
    const uint4 v = qw[i];
    const half2 s2 = __half2half2(sc[row * G + (c >> 2)]);
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    uint4* dst = reinterpret_cast<uint4*>(w) + i * 4;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      half2 q[4];
      unpack_word(words[j], q);
      // q exact and |q| <= 8, so q*s is exact before the single fp16 rounding: bit-identical to
      // the fp32 reference rounded to half
      half2 o[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) o[t] = __hmul2(q[t], s2);
      dst[j] = *reinterpret_cast<uint4*>(o);
    }
  }
}

// ---- v5: tensor-core math on weights streamed into a per-warp shared-memory ring (cp.async) ---
// Run 6's Nsight Compute reading: v3 (above) is latency-bound -- its weights in flight live in
// registers, so register-limited occupancy (16 warps/SM) caps the bytes in flight, and 50-68% of
// warp time waits on global loads. v5 keeps v3's math (16-row tile per block, mma.sync with x as
// the B operand, fp32 sums, group scale per group in fp32, split-K over the KS warps of a block
// reduced in shared memory in warp order) but the weights travel global -> shared by cp.async
// (LDGSTS: nothing held in registers while in flight), through a ring of S stages per warp; a
// stage is GPS consecutive groups of all 16 rows (x NM matrices). Warp s owns the CONTIGUOUS
// groups [s*G/KS, (s+1)*G/KS), so each row is read front to back in GPS*64-byte pieces, and the
// copy lanes cover whole row pieces (a warp-wide copy instruction = 512 contiguous-per-row bytes
// over 512/(GPS*64) rows) -- the copy layout no longer has to match the mma fragment layout.
// Bytes in flight per SM = warps x (S-1) stages x stage bytes, bounded by shared memory only.
// Every lane reads what other lanes copied, so a stage is consumed after cp.async.wait_group
// (this lane's copies landed) + __syncwarp (everyone's have). Rows of the ring are GPS*64 bytes;
// for even GPS odd rows swap their 64-byte halves per 128 bytes (chunk index ^ 4) so the mma
// fragment reads (rows g and g+1 in one quarter-warp phase) hit different banks.
// PF: cp.async with the .L2::256B prefetch hint (the L2 fetches the 256-byte block around each
// 16-byte copy: the next stage's bytes of the row are already on their way).
template <int GPS>
__device__ __forceinline__ int ring_swz(int col, int row) {
  return (GPS % 2 == 0) ? (col ^ ((row & 1) << 2)) : col;
}

constexpr int tca_smem_bytes(int k, int nm, int ks, int s, int gps, bool xg) {
  return (xg ? 0 : k * 2) + ks * nm * 16 * 4 + 32 * 4 + ks * ((k / 128 + ks - 1) / ks) * nm * 8 * 4 +
         ks * s * nm * 16 * gps * 64;
}

// NORM (gemv_int4_norm / gemv_int4_silu_mul_norm): x = half(norm_w * (hidden * r)), r =
// rsqrt(mean(hidden^2) + eps), the rmsnorm kernel's formula; every block sums the squares of the
// whole fp32 hidden itself (k*4 bytes from L2, in parallel with its x loads; same block size and
// order in every block, so all blocks get the same r) and stages only its warps' groups of x.
// XG: x is not staged; the mma loop reads it with __ldg (L1-cached: lanes of equal t share an
// address, so a warp's 16-byte x load touches 4 distinct pieces). Saves k*2 bytes of shared
// memory per block (down_proj: 37 of 107 KB) and the staging step; not with NORM.
template <int NM, int KS, int S, int GPS, int DQ, int OP, bool PF, bool XG, bool NORM>
__global__ void __launch_bounds__(KS * 32, KS >= 16 ? 1 : 16 / KS) gemv_int4_tca_kernel(const Args a) {
  static_assert(S >= 2 && (GPS == 1 || GPS == 2 || GPS == 4), "ring shape");
  static_assert(!(XG && NORM), "the fused norm stages x");
  // shared memory: x [k/8 uint4] (not with XG) (per group [j][t] transposed, as v3); float red[KS][NM][16];
  // float scratch[32] (NORM's block sum); half2 scales[KS][ceil(G/KS)][NM][8];
  // ring[KS][S][NM][16 rows][GPS*4 chunks]
  extern __shared__ uint4 xs[];
  constexpr int RC = GPS * 4;        // 16-byte chunks per row per stage
  constexpr int SLOT = NM * 16 * RC; // uint4 per stage
  constexpr int CPL = 16 * RC / 32;  // copies per lane per matrix per stage
  const int lane = threadIdx.x & 31, s = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int C = a.k >> 5, G = a.k >> 7;
  const int row0 = blockIdx.x * 16;
  const int gb = s * G / KS, cnt = (s + 1) * G / KS - gb;
  const int maxcnt = (G + KS - 1) / KS;
  float* red = reinterpret_cast<float*>(xs + (XG ? 0 : (a.k >> 3)));
  float* scratch = red + KS * NM * 16;
  half2* ss_all = reinterpret_cast<half2*>(scratch + 32);
  half2* ss = ss_all + s * maxcnt * NM * 8;
  uint4* ring = reinterpret_cast<uint4*>(ss_all + KS * maxcnt * NM * 8) + s * S * SLOT;
  const int nst = (cnt + GPS - 1) / GPS;

  // this lane's copies: chunk c = lane + 32 i of a stage is row c / RC, column c % RC; offsets in
  // uint4 of the warp's first stage (rows past n re-read row n-1; their sums are never stored)
  int goff[CPL], soff[CPL], gcol[CPL];
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = lane + 32 * i, r = c / RC, col = c % RC;
    goff[i] = min(row0 + r, a.n - 1) * C + gb * 4 + col;
    soff[i] = r * RC + ring_swz<GPS>(col, r);
    gcol[i] = col / 4;
  }
  auto issue = [&](int st) {
    if (st < nst) {
      uint4* dst = ring + (st % S) * SLOT;
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        const uint4* src = reinterpret_cast<const uint4*>(m ? a.qw2 : a.qw) + st * RC;
#pragma unroll
        for (int i = 0; i < CPL; ++i)
          if (st * GPS + gcol[i] < cnt) lab::cp_async16_hint<PF>(dst + m * 16 * RC + soff[i], src + goff[i]);
      }
    }
    nanoqwen::cp_async_commit();  // always: keeps the group count uniform for wait_group below
  };
#pragma unroll
  for (int st = 0; st < S - 1; ++st) issue(st);
  // scales, as half2 (row g, row g+8) per (group, matrix, g): weights, so before the wait (PDL)
  for (int e = lane; e < cnt * NM * 8; e += 32) {
    const int i = e / (NM * 8), m = (e / 8) % NM, gg = e % 8;
    const half* scm = m ? a.sc2 : a.sc;
    const size_t rlo = (size_t)min(row0 + gg, a.n - 1), rhi = (size_t)min(row0 + gg + 8, a.n - 1);
    ss[e] = __halves2half2(ld_s_early(scm + rlo * G + gb + i), ld_s_early(scm + rhi * G + gb + i));
  }
  nanoqwen::griddep_wait();  // PDL: x and the output only after the wait (common.cuh)
  nanoqwen::griddep_launch_dependents();
  float r = 0.f;
  if constexpr (NORM) {  // all threads (block_sum has block barriers; no warp-id branch here)
    const float4* h4 = reinterpret_cast<const float4*>(a.hidden);
    float sq = 0.f;
    for (int i = threadIdx.x; i < a.k / 4; i += KS * 32) {
      const float4 v = h4[i];
      sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    r = rsqrtf(nanoqwen::block_sum(sq, scratch) / (float)a.k + a.eps);
  }
  if constexpr (!XG) {  // stage this warp's x as v3 does (DQ_CORR: words reordered to (x01, x45, x23, x67))
    const uint4* x4 = reinterpret_cast<const uint4*>(a.x);
    const int p = lane & 15;
    for (int i = lane >> 4; i < cnt; i += 2) {
      const int gi = gb + i;
      uint4 v;
      if constexpr (NORM) {  // piece p of group gi = inputs gi*128 + 8p .. +7
        const float4* h4 = reinterpret_cast<const float4*>(a.hidden) + gi * 32 + 2 * p;
        const float4 h0 = h4[0], h1 = h4[1];
        const uint4 wv = __ldg(reinterpret_cast<const uint4*>(a.norm_w) + gi * 16 + p);
        const float2 w0 = __half22float2(as_h2(wv.x)), w1 = __half22float2(as_h2(wv.y));
        const float2 w2 = __half22float2(as_h2(wv.z)), w3 = __half22float2(as_h2(wv.w));
        v.x = h2_bits(__floats2half2_rn(w0.x * (h0.x * r), w0.y * (h0.y * r)));
        v.y = h2_bits(__floats2half2_rn(w1.x * (h0.z * r), w1.y * (h0.w * r)));
        v.z = h2_bits(__floats2half2_rn(w2.x * (h1.x * r), w2.y * (h1.y * r)));
        v.w = h2_bits(__floats2half2_rn(w3.x * (h1.z * r), w3.y * (h1.w * r)));
      } else {
        v = __ldg(x4 + gi * 16 + p);
      }
      if constexpr (DQ == DQ_CORR) v = make_uint4(v.x, v.z, v.y, v.w);
      xs[gi * 16 + (p & 3) * 4 + (p >> 2)] = v;
    }
  }

  float acc[NM][1][2];
#pragma unroll
  for (int m = 0; m < NM; ++m) acc[m][0][0] = acc[m][0][1] = 0.f;
  for (int st = 0; st < nst; ++st) {
    nanoqwen::cp_async_wait<S - 2>();  // this lane's copies of stage st have landed
    __syncwarp();              // ... and every lane's; stage st-1's slot is no longer read
    issue(st + S - 1);
    const uint4* slot = ring + (st % S) * SLOT;
#pragma unroll
    for (int jj = 0; jj < GPS; ++jj) {
      const int i = st * GPS + jj;
      if (i < cnt) {
        const int gi = gb + i;
        uint4 xv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if constexpr (XG) {  // staged index j*4 + t is x piece 4t + j
            xv[j] = __ldg(reinterpret_cast<const uint4*>(a.x) + gi * 16 + 4 * t + j);
            if constexpr (DQ == DQ_CORR) xv[j] = make_uint4(xv[j].x, xv[j].z, xv[j].y, xv[j].w);
          } else {
            xv[j] = xs[gi * 16 + j * 4 + t];
          }
        }
        const float kc = group_corr<DQ>(xv);
#pragma unroll
        for (int m = 0; m < NM; ++m) {
          const float2 dd = group_dot<DQ>(slot[(m * 16 + g) * RC + ring_swz<GPS>(4 * jj + t, g)],
                                          slot[(m * 16 + g + 8) * RC + ring_swz<GPS>(4 * jj + t, g + 8)],
                                          xv, kc);
          const float2 sc2 = __half22float2(ss[(i * NM + m) * 8 + g]);
          acc[m][0][0] = fmaf(sc2.x, dd.x, acc[m][0][0]);
          acc[m][0][1] = fmaf(sc2.y, dd.y, acc[m][0][1]);
        }
      }
    }
  }
  nanoqwen::cp_async_wait<0>();  // only empty groups are left; drain anyway before the block exits

  splitk_store<NM, 1, KS, OP>(a, red, acc, s, g, t, row0);
}

// ---- variants ---------------------------------------------------------------------------------
// x staged in shared memory needs k*2 bytes; the family's largest k (27648) needs 54 KB.
constexpr int kMaxSmemBytes = 96 * 1024;

template <int R, int U, int ACC, int OP, bool XS>
cudaError_t launch_op(const Args& a, cudaStream_t stream) {
  auto kern = gemv_int4_kernel<R, U, ACC, OP, XS>;
  const int warps = (a.n + R - 1) / R;
  const dim3 grid((warps + kWarps - 1) / kWarps), block(kThreads);
  int smem = 0;
  if constexpr (XS) {
    // once per instantiation: allow > 48 KB of dynamic shared memory (not a stream operation,
    // so it is also legal if the first call happens during graph capture)
    static const cudaError_t attr =
        cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmemBytes);
    if (attr != cudaSuccess) return nanoqwen::nq_fail(attr, "lab: cudaFuncSetAttribute(MaxDynamicSharedMemorySize) refused");
    smem = a.k * 2;
  }
  return nanoqwen::launch_pdl("lab gemv_int4 v2", kern, grid, block, smem, stream, a);
}

constexpr int tc_smem_bytes(int k, int nm, int rt, int ks) {
  return k * 2 + ks * nm * rt * 16 * 4 + ks * ((k / 128 + ks - 1) / ks) * nm * rt * 8 * 4;
}

template <int NM, int RT, int KS, int D, int DQ, int OP>
cudaError_t launch_tc_op(const Args& a, cudaStream_t stream) {
  auto kern = gemv_int4_tc_kernel<NM, RT, KS, D, DQ, OP>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmemBytes);
  if (attr != cudaSuccess) return nanoqwen::nq_fail(attr, "lab: cudaFuncSetAttribute(MaxDynamicSharedMemorySize) refused");
  const int smem = tc_smem_bytes(a.k, NM, RT, KS);
  const dim3 grid((a.n + 16 * RT - 1) / (16 * RT)), block(KS * 32);
  return nanoqwen::launch_pdl("lab gemv_int4 v3 tc", kern, grid, block, smem, stream, a);
}

template <int RT, int KS, int D, int DQ>
cudaError_t launch_tc(int op, const Args& a, cudaStream_t stream);

template <int R, int U, int ACC, bool XS>
cudaError_t launch_int4(int op, const Args& a, cudaStream_t stream) {
  if (a.hidden) return gemv_fail_("gemv_int4: this variant has no fused RMSNorm (only ps_* do)");
  // k beyond the shared-memory limit (none in the Qwen2.5 family) falls back to x from L1
  if (XS && a.k * 2 > kMaxSmemBytes) return launch_int4<R, U, ACC, false>(op, a, stream);
  switch (op) {
    case OP_STORE: return launch_op<R, U, ACC, OP_STORE, XS>(a, stream);
    case OP_RESID: return launch_op<R, U, ACC, OP_RESID, XS>(a, stream);
    case OP_SILU: return launch_op<R, U, ACC, OP_SILU, XS>(a, stream);
    default: return gemv_fail_("gemv_int4: op=%d is not 0 (store), 1 (residual) or 2 (silu_mul)", op);
  }
}

template <int RT, int KS, int D, int DQ>
cudaError_t launch_tc(int op, const Args& a, cudaStream_t stream) {
  if (a.hidden) return gemv_fail_("gemv_int4: this variant has no fused RMSNorm (only ps_* do)");
  // x (k*2 bytes) must fit in shared memory; beyond that (no Qwen2.5 shape) the v2 kernel with x
  // from L1 takes over
  if (tc_smem_bytes(a.k, 2, RT, KS) > kMaxSmemBytes) return launch_int4<1, 2, ACC_H16W, false>(op, a, stream);
  switch (op) {
    case OP_STORE: return launch_tc_op<1, RT, KS, D, DQ, OP_STORE>(a, stream);
    case OP_RESID: return launch_tc_op<1, RT, KS, D, DQ, OP_RESID>(a, stream);
    case OP_SILU: return launch_tc_op<2, RT, KS, D, DQ, OP_SILU>(a, stream);
    default: return gemv_fail_("gemv_int4: op=%d is not 0 (store), 1 (residual) or 2 (silu_mul)", op);
  }
}

template <int THREADS, int LD, int ACC, int OP, bool NORM, int BPS>
cudaError_t launch_ps_op(const Args& a, cudaStream_t stream) {
  auto kern = gemv_int4_ps_kernel<THREADS, LD, ACC, OP, NORM>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmemBytes);
  if (attr != cudaSuccess) return nanoqwen::nq_fail(attr, "lab: cudaFuncSetAttribute(MaxDynamicSharedMemorySize) refused");
  const int sms = lab::num_sms();
  if (sms < 1) return gemv_fail_("gemv_int4: could not read the SM count of the current device");
  const int grid = a.n < sms * BPS ? a.n : sms * BPS;  // every block owns >= 1 row
  const int smem = ps_smem_bytes(a.k, THREADS / 32, OP == OP_SILU ? 2 : 1);
  return nanoqwen::launch_pdl("lab gemv_int4 v4 ps", kern, dim3(grid), dim3(THREADS), smem, stream, a);
}

template <int THREADS, int LD, int ACC, int BPS>
cudaError_t launch_ps(int op, const Args& a, cudaStream_t stream) {
  const bool norm = a.hidden != nullptr;
  if (ps_smem_bytes(a.k, THREADS / 32, 2) > kMaxSmemBytes) {
    // x does not fit in shared memory (k > ~48000: no Qwen2.5 shape)
    if (norm)
      return gemv_fail_("gemv_int4 (fused norm): k=%d needs %d bytes of shared memory, limit %d", a.k,
                        ps_smem_bytes(a.k, THREADS / 32, 2), kMaxSmemBytes);
    return launch_int4<1, 2, ACC_H16W, false>(op, a, stream);
  }
  switch (op) {
    case OP_STORE:
      return norm ? launch_ps_op<THREADS, LD, ACC, OP_STORE, true, BPS>(a, stream)
                  : launch_ps_op<THREADS, LD, ACC, OP_STORE, false, BPS>(a, stream);
    case OP_RESID:
      if (norm) return gemv_fail_("gemv_int4: the fused norm exists for store and silu_mul only");
      return launch_ps_op<THREADS, LD, ACC, OP_RESID, false, BPS>(a, stream);
    case OP_SILU:
      return norm ? launch_ps_op<THREADS, LD, ACC, OP_SILU, true, BPS>(a, stream)
                  : launch_ps_op<THREADS, LD, ACC, OP_SILU, false, BPS>(a, stream);
    default: return gemv_fail_("gemv_int4: op=%d is not 0 (store), 1 (residual) or 2 (silu_mul)", op);
  }
}

// v5 needs more than kMaxSmemBytes (x + the rings): up to the sm_90 per-block limit
constexpr int kTcaMaxSmemBytes = 227 * 1024;

template <int NM, int KS, int S, int GPS, int DQ, int OP, bool PF, bool XG, bool NORM>
cudaError_t launch_tca_op(const Args& a, cudaStream_t stream) {
  auto kern = gemv_int4_tca_kernel<NM, KS, S, GPS, DQ, OP, PF, XG, NORM>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kTcaMaxSmemBytes);
  if (attr != cudaSuccess) return nanoqwen::nq_fail(attr, "lab: cudaFuncSetAttribute(MaxDynamicSharedMemorySize) refused");
  const int smem = tca_smem_bytes(a.k, NM, KS, S, GPS, XG);
  return nanoqwen::launch_pdl("lab gemv_int4 v5 tca", kern, dim3((a.n + 15) / 16), dim3(KS * 32), smem, stream, a);
}

template <int KS, int S, int GPS, int DQ, bool PF, bool XG = false>
cudaError_t launch_tca(int op, const Args& a, cudaStream_t stream) {
  const bool norm = a.hidden != nullptr;  // the norm stages x: an XG variant runs it without XG
  if (tca_smem_bytes(a.k, op == OP_SILU ? 2 : 1, KS, S, GPS, XG && !norm) > kTcaMaxSmemBytes) {
    // x + rings beyond the per-block shared-memory limit (no Qwen2.5 launcher shape): the fused
    // norm goes to v4 (ps_T256_L8_h16_B2, its run-6 launcher), the rest to v2 with x from L1
    if (norm) return launch_ps<256, 8, ACC_H16W, 2>(op, a, stream);
    return launch_int4<1, 2, ACC_H16W, false>(op, a, stream);
  }
  switch (op) {
    case OP_STORE:
      return norm ? launch_tca_op<1, KS, S, GPS, DQ, OP_STORE, PF, false, true>(a, stream)
                  : launch_tca_op<1, KS, S, GPS, DQ, OP_STORE, PF, XG, false>(a, stream);
    case OP_RESID:
      if (norm) return gemv_fail_("gemv_int4: the fused norm exists for store and silu_mul only");
      return launch_tca_op<1, KS, S, GPS, DQ, OP_RESID, PF, XG, false>(a, stream);
    case OP_SILU:
      return norm ? launch_tca_op<2, KS, S, GPS, DQ, OP_SILU, PF, false, true>(a, stream)
                  : launch_tca_op<2, KS, S, GPS, DQ, OP_SILU, PF, XG, false>(a, stream);
    default: return gemv_fail_("gemv_int4: op=%d is not 0 (store), 1 (residual) or 2 (silu_mul)", op);
  }
}

struct Int4Variant {
  const char* name;
  cudaError_t (*launch)(int, const Args&, cudaStream_t);
};

// launcher_variant() below picks which of these the engine's launchers use.
constexpr Int4Variant kInt4Variants[] = {
    // v2 launcher (run 2, d0d40e9), the control: x in shared memory, warp per row, fp16 products
    {"smem_R1_U2_h16word", launch_int4<1, 2, ACC_H16W, true>},
    {"smem_R2_U2_h16word", launch_int4<2, 2, ACC_H16W, true>},
    {"L1_R2_U2_h16word", launch_int4<2, 2, ACC_H16W, false>},
    // v3: tensor cores, fp32 sums; tc_<dequant>_R<16-row tiles per warp>_K<warps splitting K in a
    // block>_D<groups of weight loads in flight per warp>
    {"tc_corr_R1_K8_D4", launch_tc<1, 8, 4, DQ_CORR>},
    {"tc_corr_R1_K4_D4", launch_tc<1, 4, 4, DQ_CORR>},
    {"tc_corr_R1_K4_D8", launch_tc<1, 4, 8, DQ_CORR>},
    {"tc_corr_R1_K16_D4", launch_tc<1, 16, 4, DQ_CORR>},
    {"tc_corr_R2_K4_D2", launch_tc<2, 4, 2, DQ_CORR>},
    {"tc_corr_R2_K8_D2", launch_tc<2, 8, 2, DQ_CORR>},
    {"tc_exact_R1_K8_D4", launch_tc<1, 8, 4, DQ_EXACT>},
    {"tc_exact_R1_K4_D4", launch_tc<1, 4, 4, DQ_EXACT>},
    // v4: persistent streaming kernel; ps_T<threads per block>_L<16-byte loads in flight per
    // lane>_<accumulation>[_B<blocks per SM>] (one block per SM unless _B)
    {"ps_T256_L8_h16", launch_ps<256, 8, ACC_H16W, 1>},
    {"ps_T256_L12_h16", launch_ps<256, 12, ACC_H16W, 1>},
    {"ps_T256_L16_h16", launch_ps<256, 16, ACC_H16W, 1>},
    {"ps_T256_L8_f32", launch_ps<256, 8, ACC_F32, 1>},
    {"ps_T256_L12_f32", launch_ps<256, 12, ACC_F32, 1>},
    // 512 threads at <= 64 registers (half an SM): spills 40-300 bytes (ptxas), kept as a data point
    {"ps_T512_L4_h16", launch_ps<512, 4, ACC_H16W, 1>},
    {"ps_T256_L8_h16_B2", launch_ps<256, 8, ACC_H16W, 2>},
    // v5: v3's math, weights through a per-warp cp.async shared-memory ring (the fused-norm ops
    // too); tca_<dequant>_K<warps splitting K>_S<ring stages>_G<groups per stage>[_pf: L2::256B
    // hint]. Shapes measured and dropped (GEMV_NOTES.md runs 7-8): K8_S3_G4, K8_S4_G1, K8_S6_G1,
    // K16_S3_G1, K2_S6_G1, K2_S5_G2, K1_S4_G2, K1_S6_G2, K2_S4_G2_pf.
    {"tca_exact_K8_S4_G2", launch_tca<8, 4, 2, DQ_EXACT, false>},
    {"tca_exact_K8_S3_G2", launch_tca<8, 3, 2, DQ_EXACT, false>},
    {"tca_exact_K8_S4_G2_pf", launch_tca<8, 4, 2, DQ_EXACT, true>},
    {"tca_exact_K4_S4_G2", launch_tca<4, 4, 2, DQ_EXACT, false>},
    {"tca_exact_K4_S3_G2", launch_tca<4, 3, 2, DQ_EXACT, false>},
    {"tca_exact_K4_S6_G1", launch_tca<4, 6, 1, DQ_EXACT, false>},
    {"tca_exact_K2_S4_G2", launch_tca<2, 4, 2, DQ_EXACT, false>},
    {"tca_exact_K2_S3_G2", launch_tca<2, 3, 2, DQ_EXACT, false>},
    {"tca_corr_K4_S4_G2", launch_tca<4, 4, 2, DQ_CORR, false>},
    // _xg: x read from global/L1 in the loop instead of staged (less shared memory per block)
    {"tca_exact_K8_S4_G2_xg", launch_tca<8, 4, 2, DQ_EXACT, false, true>},
    {"tca_exact_K8_S6_G2_xg", launch_tca<8, 6, 2, DQ_EXACT, false, true>},
    {"tca_exact_K4_S4_G2_xg", launch_tca<4, 4, 2, DQ_EXACT, false, true>},
    {"tca_exact_K2_S4_G2_xg", launch_tca<2, 4, 2, DQ_EXACT, false, true>},
};
constexpr int kNumInt4Variants = sizeof(kInt4Variants) / sizeof(kInt4Variants[0]);

constexpr bool same_name(const char* a, const char* b) {
  while (*a && *a == *b) ++a, ++b;
  return *a == *b;
}
constexpr int variant_index(const char* name) {
  for (int i = 0; i < kNumInt4Variants; ++i)
    if (same_name(kInt4Variants[i].name, name)) return i;
  return -1;
}
constexpr bool has_norm(int v) {  // ps_* and tca_* have the fused RMSNorm
  const char* n = kInt4Variants[v].name;
  return (n[0] == 'p' && n[1] == 's' && n[2] == '_') || (n[0] == 't' && n[1] == 'c' && n[2] == 'a');
}

// The variant each launcher uses, per op and, for the residual GEMVs, per k (o_proj k = 3584 vs
// down_proj k = 18944): chosen from the measurements in GEMV_NOTES.md. The fused-norm launchers
// use the store / silu choices, which must be ps_* variants (the only ones with the norm).
// Run 7 (H200, commit 8e0254e, graph of back-to-back PDL launches): the v5 tca_* kernels beat
// v2/v3 on every INT4 shape, and all four plain launchers now sum in fp32 (no |x| limit). The
// fused-norm launchers use the same tca shapes with the norm in the prologue (not yet measured).
constexpr int kStoreVariant = variant_index("tca_exact_K4_S4_G2");       // qkv 4.48 us (v3 6.33)
constexpr int kResidSmallKVariant = variant_index("tca_exact_K4_S4_G2"); // o_proj 3.99 us (4.81)
constexpr int kResidLargeKVariant = variant_index("tca_exact_K8_S4_G2"); // down 11.60 us (16.59)
constexpr int kSiluVariant = variant_index("tca_exact_K2_S4_G2");        // gate/up 19.92 (25.74)
constexpr int kNormStoreVariant = variant_index("tca_exact_K4_S4_G2");   // qkv+norm (ps: 7.45 us)
constexpr int kNormSiluVariant = variant_index("tca_exact_K2_S4_G2");    // gate/up+norm (ps: 30.46)
static_assert(kStoreVariant >= 0 && kResidSmallKVariant >= 0 && kResidLargeKVariant >= 0 &&
                  kSiluVariant >= 0 && kNormStoreVariant >= 0 && kNormSiluVariant >= 0,
              "launcher variant name not in kInt4Variants");
static_assert(has_norm(kNormStoreVariant) && has_norm(kNormSiluVariant),
              "the fused norm needs a ps_* or tca_* variant");
int launcher_variant(int op, int k) {
  if (op == OP_STORE) return kStoreVariant;
  if (op == OP_RESID) return k <= 8192 ? kResidSmallKVariant : kResidLargeKVariant;
  return kSiluVariant;
}

bool misaligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) != 0; }

cudaError_t check_int4(const char* fn, const void* out, const half* x, const uint32_t* qw,
                       const half* sc, int n, int k) {
  if (!out || !x || !qw || !sc)
    return gemv_fail_("%s: null pointer (out=%p x=%p qweight=%p scales=%p)", fn, out, (const void*)x,
                      (const void*)qw, (const void*)sc);
  if (n < 1) return gemv_fail_("%s: n=%d must be >= 1", fn, n);
  if (k < kGroup || k % kGroup)
    return gemv_fail_("%s: k=%d is not a positive multiple of the INT4 group %d", fn, k, kGroup);
  if (misaligned16(x) || misaligned16(qw))
    return gemv_fail_("%s: x=%p and qweight=%p must be 16-byte aligned", fn, (const void*)x,
                      (const void*)qw);
  return cudaSuccess;
}

cudaError_t check_norm(const char* fn, const float* hidden, const half* norm_w, float eps) {
  if (!hidden || !norm_w)
    return gemv_fail_("%s: null pointer (hidden=%p norm_w=%p)", fn, (const void*)hidden,
                      (const void*)norm_w);
  if (misaligned16(hidden) || misaligned16(norm_w))
    return gemv_fail_("%s: hidden=%p and norm_w=%p must be 16-byte aligned", fn,
                      (const void*)hidden, (const void*)norm_w);
  if (!(eps > 0.f)) return gemv_fail_("%s: eps=%g must be > 0", fn, (double)eps);
  return cudaSuccess;
}

}  // namespace

extern "C" {

cudaError_t gemv_int4(half* y, const half* x, const uint32_t* qweight, const half* scales,
                      const half* bias, int n, int k, cudaStream_t stream) {
  if (cudaError_t e = check_int4("gemv_int4", y, x, qweight, scales, n, k)) return e;
  return kInt4Variants[launcher_variant(OP_STORE, k)].launch(OP_STORE, Args{y, x, qweight, scales, nullptr, nullptr, bias, n, k},
                                 stream);
}

cudaError_t gemv_int4_residual(float* hidden, const half* x, const uint32_t* qweight,
                               const half* scales, int n, int k, cudaStream_t stream) {
  if (cudaError_t e = check_int4("gemv_int4_residual", hidden, x, qweight, scales, n, k)) return e;
  return kInt4Variants[launcher_variant(OP_RESID, k)].launch(
      OP_RESID, Args{hidden, x, qweight, scales, nullptr, nullptr, nullptr, n, k}, stream);
}

cudaError_t gemv_int4_silu_mul(half* out, const half* x, const uint32_t* qw_gate,
                               const half* sc_gate, const uint32_t* qw_up, const half* sc_up,
                               int n, int k, cudaStream_t stream) {
  if (cudaError_t e = check_int4("gemv_int4_silu_mul", out, x, qw_gate, sc_gate, n, k)) return e;
  if (!qw_up || !sc_up || misaligned16(qw_up))
    return gemv_fail_("gemv_int4_silu_mul: up matrix qweight=%p (16-byte aligned) and scales=%p "
                      "must be non-null", (const void*)qw_up, (const void*)sc_up);
  return kInt4Variants[launcher_variant(OP_SILU, k)].launch(OP_SILU, Args{out, x, qw_gate, sc_gate, qw_up, sc_up, nullptr, n, k},
                                 stream);
}

cudaError_t gemv_int4_norm(half* y, const float* hidden, const half* norm_w, float eps,
                           const uint32_t* qweight, const half* scales, const half* bias, int n,
                           int k, cudaStream_t stream) {
  // x is not an input here; pass hidden in its place for the pointer/alignment check
  if (cudaError_t e = check_int4("gemv_int4_norm", y, reinterpret_cast<const half*>(hidden), qweight,
                                 scales, n, k))
    return e;
  if (cudaError_t e = check_norm("gemv_int4_norm", hidden, norm_w, eps)) return e;
  Args a{y, nullptr, qweight, scales, nullptr, nullptr, bias, n, k};
  a.hidden = hidden;
  a.norm_w = norm_w;
  a.eps = eps;
  return kInt4Variants[kNormStoreVariant].launch(OP_STORE, a, stream);
}

cudaError_t gemv_int4_silu_mul_norm(half* out, const float* hidden, const half* norm_w, float eps,
                                    const uint32_t* qw_gate, const half* sc_gate,
                                    const uint32_t* qw_up, const half* sc_up, int n, int k,
                                    cudaStream_t stream) {
  const char* fn = "gemv_int4_silu_mul_norm";
  if (cudaError_t e = check_int4(fn, out, reinterpret_cast<const half*>(hidden), qw_gate, sc_gate, n, k))
    return e;
  if (cudaError_t e = check_norm(fn, hidden, norm_w, eps)) return e;
  if (!qw_up || !sc_up || misaligned16(qw_up))
    return gemv_fail_("%s: up matrix qweight=%p (16-byte aligned) and scales=%p must be non-null",
                      fn, (const void*)qw_up, (const void*)sc_up);
  Args a{out, nullptr, qw_gate, sc_gate, qw_up, sc_up, nullptr, n, k};
  a.hidden = hidden;
  a.norm_w = norm_w;
  a.eps = eps;
  return kInt4Variants[kNormSiluVariant].launch(OP_SILU, a, stream);
}

cudaError_t dequant_int4(half* w, const uint32_t* qweight, const half* scales, int n, int k,
                         cudaStream_t stream) {
  if (!w || !qweight || !scales)
    return gemv_fail_("dequant_int4: null pointer (w=%p qweight=%p scales=%p)", (void*)w,
                      (const void*)qweight, (const void*)scales);
  if (n < 1) return gemv_fail_("dequant_int4: n=%d must be >= 1", n);
  if (k < kGroup || k % kGroup)
    return gemv_fail_("dequant_int4: k=%d is not a positive multiple of the INT4 group %d", k, kGroup);
  if (misaligned16(w) || misaligned16(qweight))
    return gemv_fail_("dequant_int4: w=%p and qweight=%p must be 16-byte aligned", (void*)w,
                      (const void*)qweight);
  const size_t total = (size_t)n * (k / 32);
  const size_t blocks = (total + 255) / 256;
  const unsigned grid = (unsigned)(blocks < (1u << 20) ? blocks : (1u << 20));
  dequant_int4_kernel<<<grid, 256, 0, stream>>>(w, reinterpret_cast<const uint4*>(qweight), scales,
                                                total, k / 32, k / kGroup);
  return cudaGetLastError();
}

int gemv_int4_variant_count(void) { return kNumInt4Variants; }

const char* gemv_int4_variant_name(int variant) {
  return (variant >= 0 && variant < kNumInt4Variants) ? kInt4Variants[variant].name : nullptr;
}

cudaError_t gemv_int4_bench(int variant, int op, void* out, const half* x, const uint32_t* qw,
                            const half* sc, const uint32_t* qw2, const half* sc2,
                            const half* bias, int n, int k, cudaStream_t stream) {
  if (variant < 0 || variant >= kNumInt4Variants)
    return gemv_fail_("gemv_int4_bench: variant=%d not in [0, %d)", variant, kNumInt4Variants);
  if (cudaError_t e = check_int4("gemv_int4_bench", out, x, qw, sc, n, k)) return e;
  if (op == OP_SILU && (!qw2 || !sc2 || misaligned16(qw2)))
    return gemv_fail_("gemv_int4_bench: op=2 needs the up matrix (qw2=%p sc2=%p)", (const void*)qw2,
                      (const void*)sc2);
  return kInt4Variants[variant].launch(op, Args{out, x, qw, sc, qw2, sc2, bias, n, k}, stream);
}

cudaError_t gemv_int4_norm_bench(int variant, int op, void* out, const float* hidden,
                                 const half* norm_w, float eps, const uint32_t* qw, const half* sc,
                                 const uint32_t* qw2, const half* sc2, const half* bias, int n,
                                 int k, cudaStream_t stream) {
  if (variant < 0 || variant >= kNumInt4Variants)
    return gemv_fail_("gemv_int4_norm_bench: variant=%d not in [0, %d)", variant, kNumInt4Variants);
  if (cudaError_t e = check_int4("gemv_int4_norm_bench", out, reinterpret_cast<const half*>(hidden),
                                 qw, sc, n, k))
    return e;
  if (cudaError_t e = check_norm("gemv_int4_norm_bench", hidden, norm_w, eps)) return e;
  if (op == OP_SILU && (!qw2 || !sc2 || misaligned16(qw2)))
    return gemv_fail_("gemv_int4_norm_bench: op=2 needs the up matrix (qw2=%p sc2=%p)",
                      (const void*)qw2, (const void*)sc2);
  Args a{out, nullptr, qw, sc, qw2, sc2, bias, n, k};
  a.hidden = hidden;
  a.norm_w = norm_w;
  a.eps = eps;
  return kInt4Variants[variant].launch(op, a, stream);
}

int gemv_int4_variant_supports_norm(int variant) {
  return variant >= 0 && variant < kNumInt4Variants && has_norm(variant);
}

// The lab follows csrc's error convention (kernels.h): one per-thread message, read by ctypes.
const char* gemv_last_error_message(void) { return nanoqwen::last_error_message(); }

cudaError_t gemv_fail_(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  nanoqwen::nq_vfail(cudaErrorInvalidValue, fmt, ap);
  va_end(ap);
  return cudaErrorInvalidValue;
}

}  // extern "C"

