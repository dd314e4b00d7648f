// gemv_int4.cu -- the batch-1 INT4 (group-128, symmetric, code offset 8) decode GEMVs the engine
// launches (qkv, o_proj, gate/up, down_proj), plus the INT4 -> fp16 dequantizer prefill uses.
//
// One kernel family (tca: tensor-core math on weights streamed through a per-warp cp.async
// shared-memory ring), one instance per engine GEMV, chosen from ONE constexpr table (kInt4Table,
// below) by op and k; a shape the chosen instance cannot run is refused with n and k in the
// message -- there is no fallback kernel. The alternatives it was measured against (v2 CUDA-core
// warp-per-row, v3 tensor cores with register-held loads, v4 persistent streaming, the DQ_CORR
// dequant, the L2 prefetch hint, x read from L1, the RMSNorm recomputed in every block's
// prologue) are in benchmarks/lab/gemv_int4_lab.cu with their figures in benchmarks/GEMV_NOTES.md.
// The decode step's norm is folded differently here: the residual instance writes the sum of
// squares in parts, and the one-column qkv and gate/up instances form x from them (Args::hid,
// common.cuh's order; GEMV_NOTES.md, session 34).
//
// Layout: see gemv.h / engine/quant.py. A 16-byte load of a row (a "chunk") holds 32 consecutive
// inputs, words j = 0..3 covering k = 32c + 8j .. +7; with the interleaved nibble order
//   lop3(w, 0x000F000F, 0x64006400) = half2(1024 + u) at k {0,1} of the word,
//   lop3(w, 0x00F000F0, 0x64006400) = half2(1024 + 16u) at k {2,3},
// and the same on w >> 8 for k {4,5}, {6,7} (Marlin's trick). q = lo - 1032 and q = hi/16 - 72
// are exact in fp16 (q in -7..7).
//
// The kernel (gemv_int4_tca_kernel<NM, KS, S, GPS, OP>):
//   * a block owns a 16-row tile (NM = 2 matrices for gate/up); its KS warps split K: warp s owns
//     the contiguous groups [s*G/KS, (s+1)*G/KS), G = k/128, and their partial sums meet in
//     shared memory, added in warp order (deterministic, no atomics);
//   * weights travel global -> shared by cp.async into a ring of S stages per warp (a stage = GPS
//     consecutive groups of all 16 rows x NM), so bytes in flight cost shared memory, not
//     registers (what limited the register-loading v3: GEMV_NOTES.md runs 6-7); the copy lanes
//     cover whole row pieces, and for even GPS odd rows swap their 64-byte halves per 128 bytes
//     (chunk index ^ 4) so the mma fragment reads of rows g and g+1 hit different banks;
//   * math: mma.sync m16n8k16, A = the exact q of rows g and g+8 (lane g = lane/4, t = lane%4
//     holds chunk t of each group), B = the matching x, identical in all 8 columns, so every
//     column of D is the row's dot product over the group, summed in fp32 inside the tensor
//     core; the group's fp16 scale is applied once per group in fp32;
//   * x is staged per warp (its own groups only) into shared memory, transposed so the four
//     lanes of a row read 64 contiguous bytes; scales are staged as half2 (row g, row g+8).
//   * PDL (common.cuh): the first S-1 ring stages and the scales are issued before
//     griddep_wait() (weights are constant); x, bias and the output only after it.
#include <limits.h>

#include "common.cuh"
#include "gemv.h"

namespace nanoqwen {
namespace {

constexpr int kGroup = 128;
// the sm_90 per-block limit of dynamic shared memory (x + scales + the rings)
constexpr int kTcaMaxSmemBytes = 227 * 1024;

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
  int nc;               // columns: x [nc, k], out [nc, n] (1: the decode GEMV)
  // The decode step's folded norm (one column; common.cuh): non-null `hid`, the consumer forms
  // x = rmsnorm(hid) itself from hid [k] fp32, its k/16 sum-of-squares parts and the norm weight
  // ln [k] (x is then unused); non-null `parts_out`, OP_RESID writes the parts of what it adds
  // (block b, rows 16b..16b+15: n/16 parts). An initializer that stops before them leaves them
  // null: no norm, no parts.
  const float* hid = nullptr;
  const float* parts = nullptr;
  const half* ln = nullptr;
  float eps = 0.f;
  float* parts_out = nullptr;
};

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

// group_dot for NT tiles of 8 columns (the verify step's k tokens): lane g supplies column
// 8*nt + g of B, so D[row][c] is row's dot product with column c's x. Lane (g, t) gets rows g, g+8
// of columns 8*nt + 2t, 2t+1: out[nt] = {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}. Per column
// the mma chain (words j = 0..3 into d0 / d1, then d0 + d1) is group_dot's, so each column's sum is
// bit-identical to the one-column kernel's on the same x.
template <int NT>
__device__ __forceinline__ void group_dot_cols(const uint4& va, const uint4& vb,
                                               const uint4 (&xv)[NT][4], float4 (&out)[NT]) {
  const uint32_t kLo = 0x64006400u;
  const half2 k1032 = as_h2(0x64086408u), k16 = as_h2(0x2C002C00u), k72 = as_h2(0xD480D480u);
  auto lo = [&](uint32_t v) { return h2_bits(__hsub2(as_h2(v), k1032)); };
  auto hi = [&](uint32_t v) { return h2_bits(__hfma2(as_h2(v), k16, k72)); };
  float d0[NT][4], d1[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) d0[nt][e] = d1[nt][e] = 0.f;
  const uint32_t wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t a8 = wa[j] >> 8, b8 = wb[j] >> 8;
    const uint32_t p0 = lo(lop3_and_or(wa[j], 0x000F000Fu, kLo));
    const uint32_t p1 = lo(lop3_and_or(wb[j], 0x000F000Fu, kLo));
    const uint32_t p2 = hi(lop3_and_or(wa[j], 0x00F000F0u, kLo));
    const uint32_t p3 = hi(lop3_and_or(wb[j], 0x00F000F0u, kLo));
    const uint32_t r0 = lo(lop3_and_or(a8, 0x000F000Fu, kLo));
    const uint32_t r1 = lo(lop3_and_or(b8, 0x000F000Fu, kLo));
    const uint32_t r2 = hi(lop3_and_or(a8, 0x00F000F0u, kLo));
    const uint32_t r3 = hi(lop3_and_or(b8, 0x00F000F0u, kLo));
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      mma16816(d0[nt], p0, p1, p2, p3, xv[nt][j].x, xv[nt][j].y);
      mma16816(d1[nt], r0, r1, r2, r3, xv[nt][j].z, xv[nt][j].w);
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    out[nt] = make_float4(d0[nt][0] + d1[nt][0], d0[nt][1] + d1[nt][1], d0[nt][2] + d1[nt][2],
                          d0[nt][3] + d1[nt][3]);
}

// One output row from its fp32 sum(s): store (+bias, rounded to half), residual add (fp32), or
// silu(gate) * up (rounded to half).
// Column col of the output (out [nc, n]).
template <int OP>
__device__ __forceinline__ void emit_row(const Args& a, int row, int col,
                                         const float (&v)[OP == OP_SILU ? 2 : 1]) {
  const size_t i = (size_t)col * a.n + row;
  if constexpr (OP == OP_STORE) {
    float y = v[0];
    if (a.bias) y += __half2float(a.bias[row]);
    static_cast<half*>(a.out)[i] = __float2half_rn(y);
  } else if constexpr (OP == OP_RESID) {
    float* h = static_cast<float*>(a.out) + i;
    *h = __fadd_rn(*h, v[0]);
  } else {
    const float g = v[0], u = v[1];
    static_cast<half*>(a.out)[i] = __float2half_rn(g / (1.f + __expf(-g)) * u);
  }
}

// Split-K epilogue: the KS warps' partial sums (acc[m][0/1] = rows g, g+8 of matrix m, held by the
// lanes with t == 0) meet in shared memory `red` (KS*NM*16 floats) and are summed in warp order
// (deterministic); one thread per row applies the op. Contains a block barrier: every thread of
// the block calls it.
template <int NM, int KS, int OP>
__device__ __forceinline__ void splitk_store(const Args& a, float* red, const float (&acc)[NM][2],
                                             int s, int g, int t, int row0) {
  if (t == 0) {
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      red[(s * NM + m) * 16 + g] = acc[m][0];
      red[(s * NM + m) * 16 + g + 8] = acc[m][1];
    }
  }
  __syncthreads();
  const int tid = threadIdx.x;
  if (tid < 16) {
    const int row = row0 + tid;
    if (row < a.n) {
      float v[NM];
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        v[m] = 0.f;
#pragma unroll
        for (int w = 0; w < KS; ++w) v[m] += red[(w * NM + m) * 16 + tid];
      }
      emit_row<OP>(a, row, 0, v);
    }
  }
  if constexpr (OP == OP_RESID) {
    if (a.parts_out && tid < 32) {  // warp 0: the part of rows row0 .. row0+15 as updated
      const int row = row0 + tid;
      const float h = tid < 16 && row < a.n ? static_cast<const float*>(a.out)[row] : 0.f;
      const float p = sq_part16_lanes(h);
      if (tid == 0) a.parts_out[blockIdx.x] = p;
    }
  }
}

// splitk_store for NT tiles of 8 columns: acc[m][nt] = lane (g, t)'s (g, 2t), (g, 2t+1),
// (g+8, 2t), (g+8, 2t+1) of tile nt; `red` holds KS*NM*8*NT*16 floats ([warp][m][col][row]).
// The sums over warps run in warp order, as splitk_store's. Every thread of the block calls it.
template <int NM, int KS, int OP, int NT>
__device__ __forceinline__ void splitk_store_cols(const Args& a, float* red,
                                                  const float (&acc)[NM][NT][4], int s, int g,
                                                  int t, int row0) {
  constexpr int NCOL = 8 * NT;
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float* r = red + ((s * NM + m) * NCOL + nt * 8 + 2 * t + e) * 16;
        r[g] = acc[m][nt][e];
        r[g + 8] = acc[m][nt][2 + e];
      }
  __syncthreads();
  for (int i = threadIdx.x; i < 16 * a.nc; i += KS * 32) {
    const int rr = i & 15, col = i >> 4, row = row0 + rr;
    if (row < a.n) {
      float v[NM];
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        v[m] = 0.f;
#pragma unroll
        for (int w = 0; w < KS; ++w) v[m] += red[((w * NM + m) * NCOL + col) * 16 + rr];
      }
      emit_row<OP>(a, row, col, v);
    }
  }
}

// Scale loads that must not be moved past griddep_wait() by the compiler (volatile asm keeps
// their order relative to the wait's volatile asm; the weights' cp.async is volatile too).
__device__ __forceinline__ half ld_s_early(const half* p) {
  unsigned short v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return __ushort_as_half(v);
}

template <int GPS>
__device__ __forceinline__ int ring_swz(int col, int row) {
  return (GPS % 2 == 0) ? (col ^ ((row & 1) << 2)) : col;
}

// x [k*2 B; none with column tiles, nt > 0: x is read from global memory] + red [KS*NM*16*max(1,
// 8*nt) floats] + scales [KS*ceil(G/KS)*NM*8 half2] + ring [KS*S*NM*16 rows * GPS*64 B], in bytes
// (int64: a refused huge k must not overflow the check itself)
__host__ __device__ constexpr int ncol_of(int nt) { return nt == 0 ? 1 : 8 * nt; }
constexpr long long tca_smem_bytes(long long k, int nm, int ks, int s, int gps, int nt) {
  return (nt == 0 ? k * 2 : 0) + ks * nm * 16 * ncol_of(nt) * 4 +
         ks * ((k / kGroup + ks - 1) / ks) * nm * 8 * 4 + (long long)ks * s * nm * 16 * gps * 64;
}

// NT = 0: one column (the decode step), x staged in shared memory; NT = 1, 2: a.nc <= 8*NT
// columns (the verify step), columns >= nc fed zeros, each lane reading its column's x from
// global memory (L1/L2). A block's x is then nc*k*2 bytes, too much to stage for down_proj;
// staging it whole where it fits, copying it by cp.async in a ring beside the weights', or
// loading a stage's x at the stage's start all measured slower (RESULTS.md, session 15); loading
// it one stage ahead into registers is faster (kPrefetchX below, session 29).
template <int NM, int KS, int S, int GPS, int OP, int NT>
__global__ void __launch_bounds__(KS * 32, KS >= 16 ? 1 : 16 / KS) gemv_int4_tca_kernel(const Args a) {
  static_assert(S >= 2 && (GPS == 1 || GPS == 2 || GPS == 4), "ring shape");
  static_assert(NT >= 0 && NT <= 2, "column tiles");
  constexpr int NCOL = ncol_of(NT);
  // shared memory: x [k/8 uint4] (per group [j][t] transposed); float red[KS][NM][16];
  // half2 scales[KS][ceil(G/KS)][NM][8]; ring[KS][S][NM][16 rows][GPS*4 chunks]
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
  float* red = reinterpret_cast<float*>(xs + (NT == 0 ? (a.k >> 3) : 0));
  half2* ss_all = reinterpret_cast<half2*>(red + KS * NM * 16 * NCOL);
  half2* ss = ss_all + s * maxcnt * NM * 8;
  uint4* ring = reinterpret_cast<uint4*>(ss_all + KS * maxcnt * NM * 8) + s * S * SLOT;
  const int nst = (cnt + GPS - 1) / GPS;

  // this lane's copies: chunk c = lane + 32 i of a stage is row c / RC, column c % RC; offsets in
  // uint4 of the warp's first stage (rows past n re-read row n-1; their sums are never stored;
  // n * C fits int: the launcher checks it)
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
          if (st * GPS + gcol[i] < cnt) cp_async16(dst + m * 16 * RC + soff[i], src + goff[i]);
      }
    }
    cp_async_commit();  // always: keeps the group count uniform for wait_group below
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
  griddep_wait();  // PDL: x and the output only after the wait (common.cuh)
  griddep_launch_dependents();
  if constexpr (NT == 0) {  // stage this warp's x: 16 pieces per group, piece p = 4t + j stored at 4j + t
    const int p = lane & 15;
    bool norm = false;
    if constexpr (OP != OP_RESID) norm = a.hid != nullptr;  // o/down never norm their x
    if (norm) {  // the folded norm: piece = half(ln * (hid * r)), 8 entries, rmsnorm's numbers
      const float4* h4 = reinterpret_cast<const float4*>(a.hid);
      const uint4* w4 = reinterpret_cast<const uint4*>(a.ln);
      // the first kNormBatch pieces' loads go out before the fold's (whose adds wait on its
      // loads), so the two L2 round trips overlap; the rest after (bench_step at 7B: the fold
      // with its loads in a dependent chain cost qkv +2.7 us, RESULTS.md session 34)
      constexpr int kNormBatch = 4;
      float4 hb[kNormBatch][2];
      uint4 wb[kNormBatch];
      const int i0 = lane >> 4;
#pragma unroll
      for (int u = 0; u < kNormBatch; ++u) {
        const int i = i0 + 2 * u, pi = (gb + i) * 16 + p;
        if (i < cnt) {
          hb[u][0] = __ldg(h4 + 2 * pi);
          hb[u][1] = __ldg(h4 + 2 * pi + 1);
          wb[u] = __ldg(w4 + pi);
        }
      }
      const float r = norm_fold_rs(a.parts, a.k >> 4, a.k, a.eps);
      auto put = [&](int i, const float4& h0, const float4& h1, const uint4& wv) {
        const half* w8 = reinterpret_cast<const half*>(&wv);
        const float hv[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
        uint4 xv;
        half* x8 = reinterpret_cast<half*>(&xv);
#pragma unroll
        for (int q = 0; q < 8; ++q) x8[q] = norm_entry(hv[q], r, __half2float(w8[q]));
        xs[(gb + i) * 16 + (p & 3) * 4 + (p >> 2)] = xv;
      };
#pragma unroll
      for (int u = 0; u < kNormBatch; ++u)
        if (i0 + 2 * u < cnt) put(i0 + 2 * u, hb[u][0], hb[u][1], wb[u]);
#pragma unroll 2
      for (int i = i0 + 2 * kNormBatch; i < cnt; i += 2) {
        const int pi = (gb + i) * 16 + p;
        put(i, __ldg(h4 + 2 * pi), __ldg(h4 + 2 * pi + 1), __ldg(w4 + pi));
      }
    } else {
      const uint4* x4 = reinterpret_cast<const uint4*>(a.x);
      for (int i = lane >> 4; i < cnt; i += 2) {
        const int gi = gb + i;
        xs[gi * 16 + (p & 3) * 4 + (p >> 2)] = __ldg(x4 + gi * 16 + p);
      }
    }
  }
  // NT > 0: lane g's columns 8*nt + g (null: past nc, fed zeros); group gi's pieces 4t..4t+3,
  // what the staged layout hands lane t
  const uint4* xcol[NT > 0 ? NT : 1];
#pragma unroll
  for (int nt = 0; nt < (NT > 0 ? NT : 1); ++nt)
    xcol[nt] = NT > 0 && nt * 8 + g < a.nc
                   ? reinterpret_cast<const uint4*>(a.x) + (size_t)(nt * 8 + g) * (a.k >> 3) + 4 * t
                   : nullptr;

  // NT == 1 (2..8 columns): a stage's x is loaded one stage ahead into registers (xn), so its
  // L1/L2 latency overlaps the ring wait and the previous stage's math instead of stalling each
  // group's mma (H100, 7B: gate/up at 2 / 8 columns 34.2 -> 31.2 / 38.8 -> 33.6 us, t(4) -0.12
  // ms; RESULTS.md, session 29). Not for KS = 8 (down_proj): its 106 registers fit 2 blocks of
  // 256 threads an SM instead of 3 (14.8 against 13.2 us at 2 columns); NT = 2 would spill.
  constexpr bool kPrefetchX = NT == 1 && KS < 8;
  uint4 xn[kPrefetchX ? GPS : 1][4];
  auto load_x = [&](int st) {
#pragma unroll
    for (int jj = 0; jj < GPS; ++jj) {
      const int i = st * GPS + jj;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        xn[kPrefetchX ? jj : 0][j] = xcol[0] && i < cnt ? __ldg(xcol[0] + (gb + i) * 16 + j)
                                                        : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  if constexpr (kPrefetchX) load_x(0);
  float acc[NM][2];
  float accc[NM][NT > 0 ? NT : 1][4];
#pragma unroll
  for (int m = 0; m < NM; ++m) {
    acc[m][0] = acc[m][1] = 0.f;
#pragma unroll
    for (int nt = 0; nt < (NT > 0 ? NT : 1); ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) accc[m][nt][e] = 0.f;
  }
  for (int st = 0; st < nst; ++st) {
    cp_async_wait<S - 2>();  // this lane's copies of stage st have landed
    __syncwarp();            // ... and every lane's (x too); stage st-1's slot is no longer read
    issue(st + S - 1);
    uint4 xc[kPrefetchX ? GPS : 1][4];
    if constexpr (kPrefetchX) {
#pragma unroll
      for (int jj = 0; jj < GPS; ++jj)
#pragma unroll
        for (int j = 0; j < 4; ++j) xc[jj][j] = xn[jj][j];
      if (st + 1 < nst) load_x(st + 1);
    }
    const uint4* slot = ring + (st % S) * SLOT;
#pragma unroll
    for (int jj = 0; jj < GPS; ++jj) {
      const int i = st * GPS + jj;
      if (i < cnt) {
        const int gi = gb + i;
        if constexpr (NT == 0) {
          uint4 xv[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) xv[j] = xs[gi * 16 + j * 4 + t];
#pragma unroll
          for (int m = 0; m < NM; ++m) {
            const uint4& va = slot[(m * 16 + g) * RC + ring_swz<GPS>(4 * jj + t, g)];
            const uint4& vb = slot[(m * 16 + g + 8) * RC + ring_swz<GPS>(4 * jj + t, g + 8)];
            const float2 dd = group_dot(va, vb, xv);
            const float2 sc2 = __half22float2(ss[(i * NM + m) * 8 + g]);
            acc[m][0] = fmaf(sc2.x, dd.x, acc[m][0]);
            acc[m][1] = fmaf(sc2.y, dd.y, acc[m][1]);
          }
        } else {
          uint4 xv[NT][4];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j)
              xv[nt][j] = kPrefetchX ? xc[kPrefetchX ? jj : 0][j]
                          : xcol[nt] ? __ldg(xcol[nt] + gi * 16 + j)
                                     : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
          for (int m = 0; m < NM; ++m) {
            const uint4& va = slot[(m * 16 + g) * RC + ring_swz<GPS>(4 * jj + t, g)];
            const uint4& vb = slot[(m * 16 + g + 8) * RC + ring_swz<GPS>(4 * jj + t, g + 8)];
            float4 dd[NT];
            group_dot_cols<NT>(va, vb, xv, dd);
            const float2 sc2 = __half22float2(ss[(i * NM + m) * 8 + g]);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              accc[m][nt][0] = fmaf(sc2.x, dd[nt].x, accc[m][nt][0]);
              accc[m][nt][1] = fmaf(sc2.x, dd[nt].y, accc[m][nt][1]);
              accc[m][nt][2] = fmaf(sc2.y, dd[nt].z, accc[m][nt][2]);
              accc[m][nt][3] = fmaf(sc2.y, dd[nt].w, accc[m][nt][3]);
            }
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups are left; drain anyway before the block exits

  if constexpr (NT == 0)
    splitk_store<NM, KS, OP>(a, red, acc, s, g, t, row0);
  else
    splitk_store_cols<NM, KS, OP, NT>(a, red, accc, s, g, t, row0);
}

// ---- the one table: which instance each engine GEMV runs ------------------------------------
// One tca instance with its launch. The shared-memory attribute is raised once per instance to
// the sm_90 limit; the launch uses what this k needs (tca_smem_bytes).
template <int OP, int KS, int S, int GPS>
struct Tca {
  static constexpr int kOp = OP, kNm = OP == OP_SILU ? 2 : 1, kKs = KS, kStages = S, kGps = GPS;
  template <int NT>
  static cudaError_t launch(const Args& a, cudaStream_t stream) {
    auto kern = gemv_int4_tca_kernel<kNm, KS, S, GPS, OP, NT>;
    static const cudaError_t attr = set_max_smem(kern, kTcaMaxSmemBytes);
    if (attr != cudaSuccess) return smem_refused(attr, "gemv_int4_tca_kernel", kTcaMaxSmemBytes);
    return launch_pdl(NT == 0 ? "gemv_int4_tca_kernel" : "gemv_int4_tca_kernel (columns)", kern,
                      dim3((a.n + 15) / 16), dim3(KS * 32),
                      (size_t)tca_smem_bytes(a.k, kNm, KS, S, GPS, NT), stream, a);
  }
};

struct Int4Instance {
  int op;            // OP_STORE / OP_RESID / OP_SILU
  int max_k;         // serves k <= max_k (an op's rows ascend in max_k, the last has kAnyK)
  const char* use;   // the engine GEMV it serves (for messages)
  int nm, ks, stages, gps;
  // by column tiles: [0] one column (decode), [1] 2..8 columns, [2] 9..16 (the verify step)
  cudaError_t (*launch[3])(const Args&, cudaStream_t);
};

constexpr int kMaxCols = kMaxGemvCols;
static_assert(kMaxCols <= 16, "two tiles of 8 columns at most");

constexpr int kAnyK = INT_MAX;

template <class T>
constexpr Int4Instance instance(int max_k, const char* use) {
  return {T::kOp, max_k, use, T::kNm, T::kKs, T::kStages, T::kGps,
          {&T::template launch<0>, &T::template launch<1>, &T::template launch<2>}};
}

// Chosen from GEMV_NOTES.md runs 7-8 (H200, graph of back-to-back PDL launches, 7B shapes): the
// fastest tca shape per GEMV, each 23-30% faster than the v2/v3 kernels it replaced; the other
// presets' rows from lab/gemv_int4_family.py (H100, each GEMV in the decode step's form, cold
// weights; results/2026-12-07_s36c1_gemv_int4_family_887367d_h100.json), where an instance
// beat the 7B's by 5% or more. Keyed by k alone: the family's k of each op are distinct but
// for the 14B's and the 32B's o_proj (5120) and gate/up (5120), which want the same instance.
// The residual op serves o_proj (k = q_size: 896 .. 5120) and down_proj (k = the
// intermediate size: 4864 .. 27648); a k between two rows takes the next one up.
constexpr Int4Instance kInt4Table[] = {
    instance<Tca<OP_STORE, 4, 4, 2>>(kAnyK, "qkv"),      // 4608x3584: 4.48 us (v3 6.33)
    instance<Tca<OP_RESID, 4, 4, 2>>(896, "o_proj (the 0.5B)"),
    instance<Tca<OP_RESID, 8, 6, 2>>(1536, "o_proj (the 1.5B)"),          // 2.19 us (2.46)
    instance<Tca<OP_RESID, 8, 4, 2>>(2048, "o_proj (the 3B)"),            // 2.44 us (2.85)
    instance<Tca<OP_RESID, 4, 4, 2>>(3584, "o_proj"),    // 3584x3584: 3.99 us (v3 4.81)
    instance<Tca<OP_RESID, 16, 4, 1>>(4864, "down_proj (the 0.5B)"),      // 2.92 us (3.09)
    instance<Tca<OP_RESID, 4, 4, 2>>(5120, "o_proj (the 14B and 32B)"),
    instance<Tca<OP_RESID, 8, 4, 2>>(8960, "down_proj (the 1.5B)"),
    instance<Tca<OP_RESID, 16, 2, 2>>(11008, "down_proj (the 3B)"),       // 6.00 us (6.61)
    instance<Tca<OP_RESID, 4, 4, 2>>(13824, "down_proj (the 14B)"),       // 15.76 us (17.96)
    instance<Tca<OP_RESID, 8, 4, 2>>(18944, "down_proj"), // 3584x18944: 11.60 us (v3 16.59)
    instance<Tca<OP_RESID, 16, 4, 2>>(kAnyK, "down_proj (the 32B)"),      // 31.44 us (35.72)
    instance<Tca<OP_SILU, 4, 4, 1>>(896, "gate/up (the 0.5B)"),           // 3.27 us (3.43)
    instance<Tca<OP_SILU, 2, 4, 2>>(3584, "gate/up"),    // 2x18944x3584: 19.92 us (v2 25.74)
    instance<Tca<OP_SILU, 8, 4, 1>>(5120, "gate/up (the 14B and 32B)"),   // 32B 52.05 (58.21)
    instance<Tca<OP_SILU, 2, 4, 2>>(kAnyK, "gate/up"),
};
constexpr int kInt4Rows = sizeof(kInt4Table) / sizeof(kInt4Table[0]);

// every op has a catch-all row, and an op's rows ascend in max_k: pick() always finds one
constexpr bool table_is_complete() {
  for (int op = OP_STORE; op <= OP_SILU; ++op) {
    int last = -1;
    bool any = false;
    for (int i = 0; i < kInt4Rows; ++i) {
      if (kInt4Table[i].op != op) continue;
      if (kInt4Table[i].max_k <= last) return false;
      last = kInt4Table[i].max_k;
      any = true;
    }
    if (!any || last != kAnyK) return false;
  }
  return true;
}
static_assert(table_is_complete(),
              "kInt4Table: every op needs rows in ascending max_k, the last with kAnyK");

constexpr const Int4Instance& pick(int op, int k) {
  int i = 0;
  while (kInt4Table[i].op != op || k > kInt4Table[i].max_k) ++i;
  return kInt4Table[i];
}
static_assert(pick(OP_RESID, 3584).ks == 4 && pick(OP_RESID, 4864).ks == 16 &&
                  pick(OP_RESID, 5120).ks == 4 && pick(OP_RESID, 18944).ks == 8 &&
                  pick(OP_SILU, 3584).ks == 2,
              "the 7B's rows are GEMV_NOTES.md's");

cudaError_t check_int4(const char* fn, const void* out, const half* x, const uint32_t* qw,
                       const half* sc, int n, int k, int cols) {
  if (cols < 1 || cols > kMaxCols)
    return nq_fail(cudaErrorInvalidValue, "%s: cols=%d must be 1..%d (n=%d, k=%d)", fn, cols,
                   kMaxCols, n, k);
  if (!out || !x || !qw || !sc)
    return nq_fail(cudaErrorInvalidValue, "%s: null pointer (out=%p x=%p qweight=%p scales=%p)",
                   fn, out, (const void*)x, (const void*)qw, (const void*)sc);
  if (n < 1) return nq_fail(cudaErrorInvalidValue, "%s: n=%d must be >= 1", fn, n);
  if (k < kGroup || k % kGroup)
    return nq_fail(cudaErrorInvalidValue,
                   "%s: k=%d is not a positive multiple of the INT4 group %d", fn, k, kGroup);
  if (misaligned16(x) || misaligned16(qw))
    return nq_fail(cudaErrorInvalidValue, "%s: x=%p and qweight=%p must be 16-byte aligned", fn,
                   (const void*)x, (const void*)qw);
  return cudaSuccess;
}

// The table's instance for (op, k), after the checks only that instance's shape needs.
cudaError_t run_int4(const char* fn, int op, const Args& a, cudaStream_t stream) {
  const Int4Instance& r = pick(op, a.k);
  const long long chunks = (long long)a.n * (a.k / 32);
  if (chunks > INT_MAX)
    return nq_fail(cudaErrorInvalidValue,
                   "%s: n=%d k=%d has %lld 16-byte weight chunks per matrix, beyond the int "
                   "offsets of its kernel (%s instance tca K%d S%d G%d); no other kernel exists",
                   fn, a.n, a.k, chunks, r.use, r.ks, r.stages, r.gps);
  const int nt = a.nc <= 1 ? 0 : (a.nc + 7) / 8;
  const long long smem = tca_smem_bytes(a.k, r.nm, r.ks, r.stages, r.gps, nt);
  if (smem > kTcaMaxSmemBytes)
    return nq_fail(cudaErrorInvalidValue,
                   "%s: n=%d k=%d needs %lld bytes of shared memory per block in its kernel (%s "
                   "instance tca K%d S%d G%d), the limit is %d; no other kernel exists",
                   fn, a.n, a.k, smem, r.use, r.ks, r.stages, r.gps, kTcaMaxSmemBytes);
  const cudaError_t e = r.launch[nt](a, stream);
  if (e == cudaSuccess) return e;
  return nq_fail(e, "%s: n=%d k=%d cols=%d (%s instance tca K%d S%d G%d): %s", fn, a.n, a.k, a.nc,
                 r.use, r.ks, r.stages, r.gps, last_error_message());
}

// A block takes kDqWords consecutive 32-bit words (8 weights each), its thread t the words t,
// t + 256, ...: every warp-wide load reads 128 contiguous bytes and every warp-wide store
// writes 512 (a thread's 8 outputs are one 16-byte store), with kDqUnroll loads in flight per
// thread before any store. The first version (a thread's 16-byte chunk written as four 16-byte
// stores 64 bytes apart, one chunk in flight) ran at ~1.6 TB/s on the H100 (RESULTS.md, session 21).
constexpr int kDqThreads = 256, kDqUnroll = 8, kDqWords = kDqThreads * kDqUnroll;

// total <= INT_MAX - kDqWords (dequant_int4 checks it): 32-bit word indices and division, and
// the grid-stride sum b + gridDim.x * kDqWords (at most 2^31 + 2^31 - 1) does not wrap.
__global__ void __launch_bounds__(kDqThreads) dequant_int4_kernel(half* w, const uint32_t* qw,
                                                                  const half* sc, uint32_t total,
                                                                  uint32_t W, uint32_t G) {
  const half2 k1032 = as_h2(0x64086408u);  // half2(1032, 1032)
  for (uint32_t b = blockIdx.x * kDqWords; b < total; b += gridDim.x * kDqWords) {
    uint32_t v[kDqUnroll];
#pragma unroll
    for (int u = 0; u < kDqUnroll; ++u) {
      const uint32_t i = b + threadIdx.x + u * kDqThreads;
      v[u] = i < total ? __ldcs(qw + i) : 0u;   // read once: streaming
    }
#pragma unroll
    for (int u = 0; u < kDqUnroll; ++u) {
      const uint32_t i = b + threadIdx.x + u * kDqThreads;
      if (i >= total) break;
      const uint32_t row = i / W, c = i - row * W;
      const half2 s2 = __half2half2(sc[(size_t)row * G + (c >> 4)]);   // 16 words a group
      // nibble pairs (0,4), (1,5), (2,6), (3,7) of the word: (w >> 4p) & 0x000F000F | 0x64006400
      // = half2(1024 + u); minus 1032 = exact q. q exact and |q| <= 8, so q*s is exact before the
      // single fp16 rounding: bit-identical to the fp32 reference rounded to half
      half2 o[4];
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const uint32_t lo = lop3_and_or(v[u] >> (4 * p), 0x000F000Fu, 0x64006400u);
        o[p] = __hmul2(__hsub2(as_h2(lo), k1032), s2);
      }
      reinterpret_cast<uint4*>(w)[i] = *reinterpret_cast<uint4*>(o);
    }
  }
}

}  // namespace

cudaError_t gemv_int4(half* y, const half* x, const uint32_t* qweight, const half* scales,
                      const half* bias, int n, int k, int cols, cudaStream_t stream) {
  if (cudaError_t e = check_int4("gemv_int4", y, x, qweight, scales, n, k, cols)) return e;
  return run_int4("gemv_int4", OP_STORE,
                  Args{y, x, qweight, scales, nullptr, nullptr, bias, n, k, cols}, stream);
}

cudaError_t gemv_int4_residual(float* hidden, const half* x, const uint32_t* qweight,
                               const half* scales, int n, int k, int cols, cudaStream_t stream) {
  if (cudaError_t e = check_int4("gemv_int4_residual", hidden, x, qweight, scales, n, k, cols))
    return e;
  return run_int4("gemv_int4_residual", OP_RESID,
                  Args{hidden, x, qweight, scales, nullptr, nullptr, nullptr, n, k, cols}, stream);
}

cudaError_t gemv_int4_silu_mul(half* out, const half* x, const uint32_t* qw_gate,
                               const half* sc_gate, const uint32_t* qw_up, const half* sc_up,
                               int n, int k, int cols, cudaStream_t stream) {
  if (cudaError_t e = check_int4("gemv_int4_silu_mul", out, x, qw_gate, sc_gate, n, k, cols))
    return e;
  if (!qw_up || !sc_up || misaligned16(qw_up))
    return nq_fail(cudaErrorInvalidValue,
                   "gemv_int4_silu_mul: up matrix qweight=%p (16-byte aligned) and scales=%p must "
                   "be non-null", (const void*)qw_up, (const void*)sc_up);
  return run_int4("gemv_int4_silu_mul", OP_SILU,
                  Args{out, x, qw_gate, sc_gate, qw_up, sc_up, nullptr, n, k, cols}, stream);
}

// ---- the decode step's folded norms (one column) --------------------------------------------
namespace {
// The norm's inputs in place of x: hidden [k] fp32, parts [k/16] fp32, ln [k] fp16 (the first
// two 16-byte aligned), eps > 0. `x` for check_int4 is hidden (its alignment is what matters).
cudaError_t check_norm(const char* fn, const void* out, const float* hidden, const float* parts,
                       const half* ln, float eps, const uint32_t* qw, const half* sc, int n,
                       int k) {
  if (cudaError_t e = check_int4(fn, out, reinterpret_cast<const half*>(hidden), qw, sc, n, k, 1))
    return e;
  if (!parts || !ln || misaligned16(ln))
    return nq_fail(cudaErrorInvalidValue,
                   "%s: parts=%p and the norm weight ln=%p (16-byte aligned) must be non-null", fn,
                   (const void*)parts, (const void*)ln);
  if (!(eps > 0.f)) return nq_fail(cudaErrorInvalidValue, "%s: eps=%g must be > 0", fn, eps);
  return cudaSuccess;
}
}  // namespace

cudaError_t gemv_int4_norm(half* y, const float* hidden, const float* parts, const half* ln,
                           float eps, const uint32_t* qweight, const half* scales,
                           const half* bias, int n, int k, cudaStream_t stream) {
  if (cudaError_t e = check_norm("gemv_int4_norm", y, hidden, parts, ln, eps, qweight, scales, n, k))
    return e;
  return run_int4("gemv_int4_norm", OP_STORE,
                  Args{y, nullptr, qweight, scales, nullptr, nullptr, bias, n, k, 1, hidden, parts,
                       ln, eps},
                  stream);
}

cudaError_t gemv_int4_silu_mul_norm(half* out, const float* hidden, const float* parts,
                                    const half* ln, float eps, const uint32_t* qw_gate,
                                    const half* sc_gate, const uint32_t* qw_up, const half* sc_up,
                                    int n, int k, cudaStream_t stream) {
  if (cudaError_t e = check_norm("gemv_int4_silu_mul_norm", out, hidden, parts, ln, eps, qw_gate,
                                 sc_gate, n, k))
    return e;
  if (!qw_up || !sc_up || misaligned16(qw_up))
    return nq_fail(cudaErrorInvalidValue,
                   "gemv_int4_silu_mul_norm: up matrix qweight=%p (16-byte aligned) and scales=%p "
                   "must be non-null", (const void*)qw_up, (const void*)sc_up);
  return run_int4("gemv_int4_silu_mul_norm", OP_SILU,
                  Args{out, nullptr, qw_gate, sc_gate, qw_up, sc_up, nullptr, n, k, 1, hidden,
                       parts, ln, eps},
                  stream);
}

cudaError_t gemv_int4_residual_parts(float* hidden, float* parts, const half* x,
                                     const uint32_t* qweight, const half* scales, int n, int k,
                                     cudaStream_t stream) {
  if (cudaError_t e = check_int4("gemv_int4_residual_parts", hidden, x, qweight, scales, n, k, 1))
    return e;
  if (!parts)
    return nq_fail(cudaErrorInvalidValue, "gemv_int4_residual_parts: parts must be non-null");
  return run_int4("gemv_int4_residual_parts", OP_RESID,
                  Args{hidden, x, qweight, scales, nullptr, nullptr, nullptr, n, k, 1, nullptr,
                       nullptr, nullptr, 0.f, parts},
                  stream);
}

cudaError_t dequant_int4(half* w, const uint32_t* qweight, const half* scales, int n, int k,
                         cudaStream_t stream) {
  if (!w || !qweight || !scales)
    return nq_fail(cudaErrorInvalidValue, "dequant_int4: null pointer (w=%p qweight=%p scales=%p)",
                   (void*)w, (const void*)qweight, (const void*)scales);
  if (n < 1) return nq_fail(cudaErrorInvalidValue, "dequant_int4: n=%d must be >= 1", n);
  if (k < kGroup || k % kGroup)
    return nq_fail(cudaErrorInvalidValue,
                   "dequant_int4: k=%d is not a positive multiple of the INT4 group %d", k, kGroup);
  if (misaligned16(w) || misaligned16(qweight))
    return nq_fail(cudaErrorInvalidValue,
                   "dequant_int4: w=%p and qweight=%p must be 16-byte aligned", (void*)w,
                   (const void*)qweight);
  const size_t total = (size_t)n * (k / 8);   // 32-bit words, 8 weights each
  if (total > (size_t)INT_MAX - kDqWords)
    return nq_fail(cudaErrorInvalidValue,
                   "dequant_int4: n=%d k=%d has %zu weight words, beyond the 32-bit indices of its "
                   "kernel", n, k, total);
  const size_t blocks = (total + kDqWords - 1) / kDqWords;
  const unsigned grid = (unsigned)(blocks < (1u << 20) ? blocks : (1u << 20));
  dequant_int4_kernel<<<grid, kDqThreads, 0, stream>>>(w, qweight, scales, (uint32_t)total,
                                                       (uint32_t)(k / 8), (uint32_t)(k / kGroup));
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return e;
  return nq_fail(e, "dequant_int4: launch of grid %u x block %d (n=%d, k=%d) failed: %s", grid,
                 kDqThreads, n, k, cudaGetErrorString(e));
}

}  // namespace nanoqwen
