// gemm_int4.cu -- the prefill's projections as INT4-weight x fp16-activation GEMMs on tensor cores
// (issue 14 item 1): the .nanoqwen INT4 layout read directly, no fp16 copy of the weights.
//
// Y [m, n] = X [m, k] . W[n, k]^T, W = (u - 8) * s (group 128, engine/quant.py; gemv.h's layout),
// with the prefill's three epilogues: store (+bias, rounded to half), residual (fp32 hidden += Y),
// SiLU (out = silu(X Wg^T) * (X Wu^T) from fp32 sums, rounded to half).
// Two kernels: below kWgmmaMinM tokens the mma.sync one described here (with split-K), from
// there Hopper's wgmma (gemm_int4_wgmma_kernel, its own description further down).
//
// mma.sync m16n8k16, A = dequantized weights (16 rows of W), B = X (8 tokens). Lane (g, t) (g =
// lane/4, t = lane%4) holds the 16-byte chunk t (k = 32t .. 32t+31 of a group) of rows g and g+8,
// as the decode GEMV (gemv_int4.cu) does; word j of it gives, by Marlin's lop3 on the interleaved
// nibble order, the k pairs {0,1}, {2,3} (mma #1) and {4,5}, {6,7} (mma #2), so the mma's logical k
// slots (2t, 2t+1, 2t+8, 2t+9) are the physical k 32t + 8j + 4h + {0,1,2,3}; B takes X at the same
// physical k. The weight is q * s formed in fp16 (q exact, one rounding: bit-identical to
// dequant_int4's, the weight cuBLAS multiplied before), the products summed in fp32.
//
// A block owns BN = WR * 32 rows of W (2 tiles of 16 a warp; SiLU: tile 0 gate, tile 1 up of the
// same 16 output rows) and BM = WT * BT * 8 tokens; K advances KG groups a stage through an
// S-stage cp.async ring:
//   X stage: BM rows x KG x 256 B; token chunk c = 4t + j of a group stored at (4j + t) ^ (4 *
//            (token & 1)), so a quarter warp's 16-byte reads (two tokens, t = 0..3, one j) hit 8
//            distinct bank groups;
//   W stage: BN rows x KG x 64 B (a row's KG groups one contiguous run: DRAM reads of KG * 64 B
//            where one group a stage read 64 B of rows 1.8-9 KB apart); with KG > 1 an odd row's
//            chunks sit at index ^ 4, so a quarter warp's two rows hit 8 distinct bank groups;
//   scales:  KG x BN x 4 B: row r's scale of each group, copied by a 4-byte cp.async of the
//            aligned pair of halves holding it (the reader picks the half by the index's
//            parity), S - 1 stages ahead like the rest of the stage. (The first version loaded
//            them one group ahead into registers: a DRAM latency each group at small m.)
// Groups past the block's range (its split's end) are zero-filled: x = 0 and s = 0 add nothing.
// Tokens past m and rows past n are zero-filled (cp.async src-size 0) and never written.
//
// Split-K (short prompts, where the output tiles alone would leave most SMs idle): grid.z
// splits the groups into contiguous ranges; each block stores its fp32 partial sums in
// `partials` [split][m][cols] and counts itself in its tile's counter; the tile's last block
// sums the partials in split order (deterministic, whichever block comes last), resets the
// counter to 0 for the next launch, and runs the epilogue.
// The index math was emulated lane by lane on the CPU before the first device run
// (benchmarks/lab/w4a16_emulate.py, for KG = 1); benchmarks/lab/gemm_int4_shapes.cu launches
// this kernel at other block shapes.
#include <limits.h>

#include <algorithm>

#include "common.cuh"
#include "gemv.h"

namespace nanoqwen {
namespace {

constexpr int kGroup = 128;
enum { OP_STORE = 0, OP_RESID = 1, OP_SILU = 2 };

// Scale e of a row-major half [n, G] array (e = 0 where !ok) into a stage slot's 4 bytes: the
// cp.async of the aligned pair holding it, reading only as far as it must (the pair's first
// half when e is even: the last scale may end the array), zeros where !ok. The reader takes
// half e & 1, from the parity of its row's first index and the group's. Both kernels' stages.
__device__ __forceinline__ void scale_pair_fill(void* dst, const half* sc, size_t e, bool ok) {
  cp_async4_fill(dst, sc + (e & ~(size_t)1), !ok ? 0 : (e & 1) ? 4 : 2);
}

struct GArgs {
  void* out;
  const half* x;
  const uint32_t* qw;
  const half* sc;
  const uint32_t* qw2;
  const half* sc2;
  const half* bias;
  int m, n, k;
  float* partials;   // split-K: [splits][m][cols] fp32 (cols = n, SiLU: 2n); unused at 1 split
  int* counters;     // split-K: a zeroed int per output tile, left zeroed
  int splits;
};

template <int WR, int WT, int BT, int S, int OP, int KG>
struct Cfg {
  static constexpr int kThreads = WR * WT * 32;
  static constexpr int BN = WR * 32;                   // W rows a stage
  static constexpr int BM = WT * BT * 8;               // tokens
  static constexpr int ROWS_OUT = OP == OP_SILU ? WR * 16 : BN;
  static constexpr int X_BYTES = BM * 256 * KG;
  static constexpr int W_BYTES = BN * 64 * KG;
  static constexpr int STAGE = X_BYTES + W_BYTES + BN * 4 * KG;
  static constexpr int SMEM = S * STAGE;
};

template <int WR, int WT, int BT, int S, int OP, int KG>
__global__ void __launch_bounds__(WR * WT * 32) gemm_int4_kernel(const GArgs a) {
  using C = Cfg<WR, WT, BT, S, OP, KG>;
  constexpr int AT = 2;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wr = warp % WR, wt = warp / WR;
  const int row0 = blockIdx.x * C::ROWS_OUT;
  const int tok0 = blockIdx.y * C::BM;
  const int G = a.k / kGroup;
  const int kw4 = a.k / 32;   // 16-byte chunks a weight row
  // this block's groups (split-K: a contiguous share of them), KG a stage
  const int kb = (int)((long long)G * blockIdx.z / a.splits);
  const int ke = (int)((long long)G * (blockIdx.z + 1) / a.splits);
  const int nst = (ke - kb + KG - 1) / KG;

  // stage slot: X [BM][KG][256 B], W [BN][KG*4 chunks of 16 B], scales [KG][BN] x 4 B. Groups
  // past ke are zero-filled (x = 0: they add nothing)
  // the matrix row of stage row r; *up: it is the up matrix's (SiLU: the stage's rows are runs
  // of 16 gate rows and the same 16 up rows, so a warp's tile pair holds both for one row)
  auto stage_row = [&](int r, bool* up) {
    if constexpr (OP == OP_SILU) {
      const int rem = r % 32;
      *up = rem >= 16;
      return row0 + (r / 32) * 16 + (rem % 16);
    } else {
      *up = false;
      return row0 + r;
    }
  };
  auto load_stage = [&](int slot, int kg0) {
    unsigned char* xs = smem + slot * C::STAGE;
    unsigned char* ws = xs + C::X_BYTES;
    unsigned char* ss = ws + C::W_BYTES;
    for (int c = tid; c < C::BM * 16 * KG; c += C::kThreads) {
      const int tok = c / (16 * KG), gi = (c / 16) % KG, cc = c & 15;
      const int p = (((cc & 3) << 2) | (cc >> 2)) ^ ((tok & 1) << 2);
      const int gt = tok0 + tok;
      const bool ok = gt < a.m && kg0 + gi < ke;
      cp_async16_zfill(xs + (tok * KG + gi) * 256 + p * 16,
                       a.x + (ok ? (size_t)gt * a.k + (kg0 + gi) * kGroup + cc * 8 : 0), ok);
    }
    for (int c = tid; c < C::BN * 4 * KG; c += C::kThreads) {
      const int r = c / (4 * KG), ch = c % (4 * KG);
      bool up;
      const int grow = stage_row(r, &up);
      const uint4* base = reinterpret_cast<const uint4*>(up ? a.qw2 : a.qw);
      const bool ok = grow < a.n && kg0 + ch / 4 < ke;
      // chunk ch of row r at ch ^ 4 on odd rows (KG > 1): a quarter warp's two rows apart
      const int pc = KG > 1 ? ch ^ ((r & 1) << 2) : ch;
      cp_async16_zfill(ws + (r * 4 * KG + pc) * 16,
                       base + (ok ? (size_t)grow * kw4 + kg0 * 4 + ch : 0), ok);
    }
    for (int c = tid; c < C::BN * KG; c += C::kThreads) {
      const int r = c % C::BN, gi = c / C::BN;
      bool up;
      const int grow = stage_row(r, &up);
      const half* sbase = up ? a.sc2 : a.sc;
      const bool ok = grow < a.n && kg0 + gi < ke;
      const size_t e = ok ? (size_t)grow * G + kg0 + gi : 0;   // the scale's index
      scale_pair_fill(ss + (gi * C::BN + r) * 4, sbase, e, ok);
    }
  };

  // this lane's output row of tile at, half h (rows g and g + 8; SiLU: at 0 gate, at 1 up, of
  // the same row)
  auto lane_row = [&](int at, int h) {
    return OP == OP_SILU ? row0 + wr * 16 + g + 8 * h : row0 + (wr * AT + at) * 16 + g + 8 * h;
  };
  // the parity of this lane's scale rows' first index (row * G; the group adds its own), which
  // says which half of the stage's pair is the scale
  int spar[AT][2];
#pragma unroll
  for (int at = 0; at < AT; ++at)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int grow = lane_row(at, h);
      spar[at][h] = (int)(((size_t)(grow < a.n ? grow : 0) * G) & 1);
    }

  float acc[AT][BT][4];
#pragma unroll
  for (int at = 0; at < AT; ++at)
#pragma unroll
    for (int nt = 0; nt < BT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[at][nt][e] = 0.f;

#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < nst) load_stage(s, kb + s * KG);
    cp_async_commit();
  }

  const uint32_t kLo = 0x64006400u;
  const half2 k1032 = as_h2(0x64086408u), k16 = as_h2(0x2C002C00u), k72 = as_h2(0xD480D480u);

  for (int i = 0; i < nst; ++i) {
    cp_async_wait<S - 2>();
    __syncthreads();
    {
      const int ni = i + S - 1;
      if (ni < nst) load_stage(ni % S, kb + ni * KG);
      cp_async_commit();
    }
    const unsigned char* xs0 = smem + (i % S) * C::STAGE;
    const unsigned char* ws = xs0 + C::X_BYTES;
    const unsigned short* ss = reinterpret_cast<const unsigned short*>(ws + C::W_BYTES);
#pragma unroll
    for (int gi = 0; gi < KG; ++gi) {
      const int kg = kb + i * KG + gi;   // past ke: zeros (x = 0 and s = 0)
      half2 s2[AT][2];
#pragma unroll
      for (int at = 0; at < AT; ++at)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = (wr * AT + at) * 16 + g + 8 * h;
          s2[at][h] = __half2half2(
              __ushort_as_half(ss[2 * (gi * C::BN + r) + ((spar[at][h] ^ kg) & 1)]));
        }
      uint4 va[AT], vb[AT];
#pragma unroll
      for (int at = 0; at < AT; ++at) {
        const int r = (wr * AT + at) * 16 + g;   // r and r + 8: the same parity
        const int pc = KG > 1 ? (gi * 4 + t) ^ ((r & 1) << 2) : t;
        va[at] = *reinterpret_cast<const uint4*>(ws + (r * 4 * KG + pc) * 16);
        vb[at] = *reinterpret_cast<const uint4*>(ws + ((r + 8) * 4 * KG + pc) * 16);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t A0[AT][4], A1[AT][4];
#pragma unroll
        for (int at = 0; at < AT; ++at) {
          const uint32_t wa = j == 0 ? va[at].x : j == 1 ? va[at].y : j == 2 ? va[at].z : va[at].w;
          const uint32_t wb = j == 0 ? vb[at].x : j == 1 ? vb[at].y : j == 2 ? vb[at].z : vb[at].w;
          const uint32_t a8 = wa >> 8, b8 = wb >> 8;
          auto lo = [&](uint32_t v, half2 s) {
            return h2_bits(__hmul2(__hsub2(as_h2(lop3_and_or(v, 0x000F000Fu, kLo)), k1032), s));
          };
          auto hi = [&](uint32_t v, half2 s) {
            return h2_bits(__hmul2(__hfma2(as_h2(lop3_and_or(v, 0x00F000F0u, kLo)), k16, k72), s));
          };
          A0[at][0] = lo(wa, s2[at][0]);
          A0[at][1] = lo(wb, s2[at][1]);
          A0[at][2] = hi(wa, s2[at][0]);
          A0[at][3] = hi(wb, s2[at][1]);
          A1[at][0] = lo(a8, s2[at][0]);
          A1[at][1] = lo(b8, s2[at][1]);
          A1[at][2] = hi(a8, s2[at][0]);
          A1[at][3] = hi(b8, s2[at][1]);
        }
#pragma unroll
        for (int nt = 0; nt < BT; ++nt) {
          const int tok = (wt * BT + nt) * 8 + g;
          const int p = ((j << 2) | t) ^ ((tok & 1) << 2);
          const uint4 xv = *reinterpret_cast<const uint4*>(xs0 + (tok * KG + gi) * 256 + p * 16);
#pragma unroll
          for (int at = 0; at < AT; ++at) {
            mma16816(acc[at][nt], A0[at][0], A0[at][1], A0[at][2], A0[at][3], xv.x, xv.y);
            mma16816(acc[at][nt], A1[at][0], A1[at][1], A1[at][2], A1[at][3], xv.z, xv.w);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // f(tok, row, at, nt, q) for each output this lane holds (rows g / g + 8, tokens 2t, 2t + 1 of
  // each tile; SiLU: at 0 gate, at 1 up, of the same row): acc[at][nt][q]
  auto each_out = [&](auto&& f) {
#pragma unroll
    for (int nt = 0; nt < BT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = tok0 + (wt * BT + nt) * 8 + 2 * t + e;
        if (tok >= a.m) continue;
#pragma unroll
        for (int at = 0; at < AT; ++at)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = lane_row(at, h);
            if (row < a.n) f(tok, row, at, nt, 2 * h + e);
          }
      }
  };

  if (a.splits > 1) {
    // this split's partial sums out; the tile's last block sums them all in split order
    const int cols = OP == OP_SILU ? 2 * a.n : a.n;
    auto at_col = [&](int tok, int row, int at) {
      return (size_t)tok * cols + (OP == OP_SILU && at == 1 ? a.n : 0) + row;
    };
    float* mine = a.partials + (size_t)blockIdx.z * a.m * cols;
    each_out([&](int tok, int row, int at, int nt, int q) { mine[at_col(tok, row, at)] = acc[at][nt][q]; });
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (tid == 0) {
      const int tile = blockIdx.y * gridDim.x + blockIdx.x;
      last = atomicAdd(&a.counters[tile], 1) == a.splits - 1;
      if (last) a.counters[tile] = 0;   // stream order: the next launch finds it zeroed
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    each_out([&](int tok, int row, int at, int nt, int q) {
      const size_t i = at_col(tok, row, at);
      float sum = 0.f;
      for (int z = 0; z < a.splits; ++z) sum += __ldcg(a.partials + (size_t)z * a.m * cols + i);
      acc[at][nt][q] = sum;
    });
  }

  each_out([&](int tok, int row, int at, int nt, int q) {
    const size_t i = (size_t)tok * a.n + row;
    const float v = acc[at][nt][q];
    if constexpr (OP == OP_SILU) {
      if (at == 0) {   // gate; acc[1] the same row's up
        const float uv = acc[1][nt][q];
        static_cast<half*>(a.out)[i] = __float2half_rn(v / (1.f + __expf(-v)) * uv);
      }
    } else if constexpr (OP == OP_STORE) {
      const float b = a.bias ? __half2float(a.bias[row]) : 0.f;
      static_cast<half*>(a.out)[i] = __float2half_rn(v + b);
    } else {
      static_cast<float*>(a.out)[i] += v;
    }
  });
}

// ---- the wgmma kernel: prompts of kWgmmaMinM tokens and more -----------------------------
// Y [m, n] = X [m, k] . W[n, k]^T with W = (u - 8) * s in the .nanoqwen INT4 layout (gemv.h:
// word j of a row holds k = 8j .. 8j+7, nibble p holds k = 8j + {0,2,4,6,1,3,5,7}[p]), read
// directly: no fp16 copy, no repacking. Computed transposed, D [W rows, tokens] = W . X^T, so the
// weights are wgmma's A operand, dequantized in registers, and the activations its B operand in
// shared memory:
//   A (registers): warp q of a warpgroup holds 16 of its 64 rows in mma.m16n8k16's A layout; in
//     k16 step kk of a group lane (g, t) needs k = 16kk + {2t, 2t+1} (regs 0, 1: rows g, g+8) and
//     16kk + 8 + {2t, 2t+1} (regs 2, 3), i.e. pair t of words 2kk and 2kk+1 of its rows: nibbles
//     t and t+4, brought to bits 0-3 and 16-19 by a shift of 4t, then Marlin's lop3 gives
//     half2(1024 + u), minus 1032, times the scale: (u - 8) * s formed exactly and rounded once,
//     bit-identical to dequant_int4 (the weights cuBLAS multiplies in the dequant prefill).
//     The four lanes of a quad read the same 16-byte chunk (a broadcast); a row's 4 chunks sit at
//     c ^ ((row >> 1) & 3), so a warp's 8 rows hit 8 distinct 16-byte bank groups.
//   B (shared memory): the stage's X tile, BT tokens x 128 k, as two 64-k atoms of BT rows x 128
//     bytes in the canonical 128-byte swizzle (16-byte chunk c of token row r at c ^ (r & 7),
//     1024-byte aligned), K-major: descriptor SBO 1024, the k16 step kk at +32 (kk & 3) bytes
//     into atom kk >> 2.
// Each warpgroup owns MT tiles of 64 W rows and all BT tokens (wgmma m64nBTk16, fp32
// accumulators); a block is WG warpgroups, BR = WG * MT * 64 rows (SiLU: its first half gate rows,
// its second half the same rows of up), fed by an S-stage cp.async ring of one group (128 k)
// a stage; every thread copies, every warpgroup computes. Per step: dequantize, wgmma.fence,
// MT wgmmas, commit, wait until one group is in flight (so the step's dequantization overlaps
// the previous step's mma); the ring slot is released by waiting for all at the stage's end.
// cp.async writes are generic-proxy: fence.proxy.async before the barrier that hands a stage
// to the wgmmas (PTX ISA: async-proxy reads of shared memory written by the generic proxy).
// Epilogue through shared memory (the ring is free then): accumulators -> an fp32 or fp16 tile
// [token][row], then coalesced 16-byte stores (store: + bias, rounded once; residual: fp32 +=;
// SiLU: silu(gate) * up from the fp32 sums, rounded once).
// Block order: groups of 8 token tiles, the row tiles inside a group after each other, so the
// blocks running at once share a few MB of X and of W in L2 at any m.

// the accumulator operands of the wgmma wrappers: "+f"(d[i]) .. "+f"(d[i + 63])
#define NQ_ACC8(i)                                                                          \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define NQ_ACC32(i) NQ_ACC8(i), NQ_ACC8(i + 8), NQ_ACC8(i + 16), NQ_ACC8(i + 24)
#define NQ_ACC64(i) NQ_ACC32(i), NQ_ACC32(i + 32)
// d (+)= A . B, wgmma m64nNk16, f32 += f16 x f16, A from registers (K-major), B K-major from
// shared memory by descriptor (no transpose); scale-d 1 (accumulate), scales of A and B 1
// (one specialization a block width N; the product's: 128 and 256; lab/gemm_w4_wgmma.cu adds 64)
template <int N>
__device__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc);
template <>
__device__ __forceinline__ void wgmma_rs<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;"
      : NQ_ACC64(0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma_rs<256>(float (&d)[128], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, {%128, %129, %130, %131}, %132, 1, 1, 1, 0;"
      : NQ_ACC64(0), NQ_ACC64(64)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// compiler-only: the accumulators are (re)defined here, so no read or write of them moves
// across a wgmma fence / wait placed next to it (CUTLASS's warpgroup_fence_operand)
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// shared-memory matrix descriptor: 128-byte swizzle, K-major (LBO unused: 1), SBO 1024 bytes
// (8 rows of 128 B to the next 8), base offset 0 (atoms 1024-byte aligned)
__device__ __forceinline__ uint64_t desc_sw128(uint32_t saddr) {
  return (uint64_t)((saddr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
         ((uint64_t)1 << 62);
}

template <int WG, int MT, int BT, int S, int OP>
struct WgCfg {
  static constexpr int kThreads = WG * 128;
  static constexpr int BR = WG * MT * 64;                   // W rows a block
  static constexpr int ROWS_OUT = OP == OP_SILU ? BR / 2 : BR;
  static constexpr int X_BYTES = BT * 256;                  // two 64-k atoms of BT x 128 B
  static constexpr int W_BYTES = BR * 64;
  static constexpr int S_BYTES = BR * 4;
  static constexpr int STAGE = (X_BYTES + W_BYTES + S_BYTES + 1023) / 1024 * 1024;
  // epilogue tile [BT][ECOLS + pad]: fp16 for store (pad 8), fp32 otherwise (pad 4)
  static constexpr int ECOLS = OP == OP_SILU ? BR : ROWS_OUT;
  static constexpr int EPAD = OP == OP_STORE ? ECOLS + 8 : ECOLS + 4;
  static constexpr int EPI = BT * EPAD * (OP == OP_STORE ? 2 : 4);
  static constexpr int SMEM = (S * STAGE > EPI ? S * STAGE : EPI) + 1024;   // + alignment
};

// DR: drain the wgmma pipe at each stage's end and prefetch S - 1 stages ahead; !DR: prefetch
// S - 2 ahead, so the slot a stage overwrites was read two stages back (its wgmmas retired by
// the previous stage's first wait) and the last step's wgmmas overlap the next stage's start
template <int WG, int MT, int BT, int S, int OP, bool DR>
__global__ void __launch_bounds__(WG * 128, 1) gemm_int4_wgmma_kernel(const GArgs a) {
  static_assert(DR || S >= 3, "without the drain the ring needs 3 stages");
  constexpr int PD = DR ? S - 1 : S - 2;   // stages in flight ahead of the one computed
  using C = WgCfg<WG, MT, BT, S, OP>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~(uintptr_t)1023);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;
  // block order: groups of 8 token tiles; inside a group the row tiles one after another
  const int Tt = (a.m + BT - 1) / BT, Rt = (a.n + C::ROWS_OUT - 1) / C::ROWS_OUT;
  constexpr int GT = 8;
  const int b = blockIdx.x;
  const int grp = b / (GT * Rt), first = grp * GT;
  const int gsz = min(Tt - first, GT);
  const int tok0 = (first + (b % (GT * Rt)) % gsz) * BT;
  const int row0 = ((b % (GT * Rt)) / gsz) * C::ROWS_OUT;
  const int G = a.k / kGroup;
  const int kw4 = a.k / 32;   // 16-byte chunks a weight row

  // the matrix row of block row r; *up: the up matrix's (SiLU: rows BR/2.. are up)
  auto src_row = [&](int r, bool* up) {
    if constexpr (OP == OP_SILU) {
      *up = r >= C::BR / 2;
      return row0 + (*up ? r - C::BR / 2 : r);
    } else {
      *up = false;
      return row0 + r;
    }
  };
  auto load_stage = [&](int slot, int kg) {
    unsigned char* xs = smem + slot * C::STAGE;
    unsigned char* ws = xs + C::X_BYTES;
    unsigned char* ss = ws + C::W_BYTES;
#pragma unroll
    for (int i = 0; i < BT * 16 / C::kThreads; ++i) {
      const int c = tid + i * C::kThreads;
      const int r = c >> 4, ch = c & 15, atom = ch >> 3, cc = ch & 7;
      const bool ok = tok0 + r < a.m;
      cp_async16_zfill(xs + atom * (BT * 128) + r * 128 + ((cc ^ (r & 7)) << 4),
                       a.x + (ok ? (size_t)(tok0 + r) * a.k + kg * kGroup + ch * 8 : 0), ok);
    }
#pragma unroll
    for (int i = 0; i < C::BR * 4 / C::kThreads; ++i) {
      const int c = tid + i * C::kThreads;
      const int r = c >> 2, ch = c & 3;
      bool up;
      const int grow = src_row(r, &up);
      const bool ok = grow < a.n;
      const uint4* base = reinterpret_cast<const uint4*>(up ? a.qw2 : a.qw);
      cp_async16_zfill(ws + r * 64 + ((ch ^ ((r >> 1) & 3)) << 4),
                       base + (ok ? (size_t)grow * kw4 + kg * 4 + ch : 0), ok);
    }
    for (int r = tid; r < C::BR; r += C::kThreads) {
      bool up;
      const int grow = src_row(r, &up);
      const bool ok = grow < a.n;
      const size_t e = ok ? (size_t)grow * G + kg : 0;   // the scale's index
      scale_pair_fill(ss + r * 4, up ? a.sc2 : a.sc, e, ok);
    }
  };

  // this lane's block rows: tile mt, half h (rows g, g + 8 of its warp's 16)
  auto lane_row = [&](int mt, int h) { return (wg * MT + mt) * 64 + wq * 16 + g + 8 * h; };
  int spar[MT][2];   // parity of the lane's rows' first scale index (the pair's half to take)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      bool up;
      const int grow = src_row(lane_row(mt, h), &up);
      spar[mt][h] = (int)(((size_t)(grow < a.n ? grow : 0) * G) & 1);
    }

  float acc[MT][BT / 2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < BT / 2; ++i) acc[mt][i] = 0.f;

#pragma unroll
  for (int s = 0; s < PD; ++s) {
    if (s < G) load_stage(s, s);
    cp_async_commit();
  }
  const uint32_t sh = 4 * t;
  const half2 k1032 = as_h2(0x64086408u);
  auto pair = [&](uint32_t w, half2 s) {
    return h2_bits(__hmul2(__hsub2(as_h2(lop3_and_or(w >> sh, 0x000F000Fu, 0x64006400u)), k1032), s));
  };

  for (int kg = 0; kg < G; ++kg) {
    cp_async_wait<PD - 1>();
    fence_proxy_async();
    __syncthreads();   // stage kg is in; every wgmma that read slot (kg + PD) % S is done
    {
      const int nk = kg + PD;
      if (nk < G) load_stage(nk % S, nk);
      cp_async_commit();
    }
    const unsigned char* xs = smem + (kg % S) * C::STAGE;
    const unsigned char* ws = xs + C::X_BYTES;
    const unsigned short* ss = reinterpret_cast<const unsigned short*>(ws + C::W_BYTES);
    const uint32_t xaddr = smem_u32(xs);
    half2 s2[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        s2[mt][h] = __half2half2(
            __ushort_as_half(ss[2 * lane_row(mt, h) + ((spar[mt][h] ^ kg) & 1)]));
#pragma unroll
    for (int c = 0; c < 4; ++c) {   // 16-byte chunk c of each row: k16 steps 2c, 2c + 1
      uint4 wv[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = lane_row(mt, h);
          wv[mt][h] = *reinterpret_cast<const uint4*>(ws + r * 64 + ((c ^ ((r >> 1) & 3)) << 4));
        }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int kk = 2 * c + e;
        uint32_t A[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint32_t w0 = e ? wv[mt][0].z : wv[mt][0].x, w1 = e ? wv[mt][0].w : wv[mt][0].y;
          const uint32_t v0 = e ? wv[mt][1].z : wv[mt][1].x, v1 = e ? wv[mt][1].w : wv[mt][1].y;
          A[mt][0] = pair(w0, s2[mt][0]);   // row g,     k 2t, 2t+1
          A[mt][1] = pair(v0, s2[mt][1]);   // row g + 8, k 2t, 2t+1
          A[mt][2] = pair(w1, s2[mt][0]);   // row g,     k 2t+8, 2t+9
          A[mt][3] = pair(v1, s2[mt][1]);   // row g + 8, k 2t+8, 2t+9
        }
        const uint64_t desc = desc_sw128(xaddr + (kk >> 2) * (BT * 128) + (kk & 3) * 32);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) fence_regs(acc[mt]);
        wg_fence();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) wgmma_rs<BT>(acc[mt], A[mt], desc);
        wg_commit();
        wg_wait<1>();
      }
    }
    if constexpr (DR) wg_wait<0>();
  }
  wg_wait<0>();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) fence_regs(acc[mt]);
  cp_async_wait<0>();
  __syncthreads();   // the ring is free: the epilogue tile takes its place

  // accumulator i of tile mt: block row lane_row(mt, (i >> 1) & 1), token 8 (i >> 2) + 2t + (i & 1)
  if constexpr (OP == OP_STORE) {
    half* E = reinterpret_cast<half*>(smem);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < BT / 2; ++i) {
        const int r = lane_row(mt, (i >> 1) & 1), tok = 8 * (i >> 2) + 2 * t + (i & 1);
        const float bv = a.bias && row0 + r < a.n ? __half2float(a.bias[row0 + r]) : 0.f;
        E[tok * C::EPAD + r] = __float2half_rn(acc[mt][i] + bv);
      }
  } else {
    float* E = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < BT / 2; ++i) {
        const int r = lane_row(mt, (i >> 1) & 1), tok = 8 * (i >> 2) + 2 * t + (i & 1);
        E[tok * C::EPAD + r] = acc[mt][i];
      }
  }
  __syncthreads();
  // out rows row0 .. row0 + ROWS_OUT of tokens tok0 .. tok0 + BT, 8 outputs a thread a pass
  const bool vec = a.n % 8 == 0;
  constexpr int CPT = C::ROWS_OUT / 8;   // 8-output chunks a token
  for (int c = tid; c < BT * CPT; c += C::kThreads) {
    const int tok = c / CPT, j0 = (c % CPT) * 8;
    if (tok0 + tok >= a.m) continue;
    const size_t o = (size_t)(tok0 + tok) * a.n + row0 + j0;
    const int left = a.n - (row0 + j0);
    if (left <= 0) continue;
    if constexpr (OP == OP_STORE) {
      const half* e = reinterpret_cast<const half*>(smem) + tok * C::EPAD + j0;
      if (vec && left >= 8) {
        *reinterpret_cast<uint4*>(static_cast<half*>(a.out) + o) = *reinterpret_cast<const uint4*>(e);
      } else {
        for (int j = 0; j < 8 && j < left; ++j) static_cast<half*>(a.out)[o + j] = e[j];
      }
    } else if constexpr (OP == OP_RESID) {
      const float* e = reinterpret_cast<const float*>(smem) + tok * C::EPAD + j0;
      float* h = static_cast<float*>(a.out) + o;
      if (vec && left >= 8) {
        float4 h0 = reinterpret_cast<float4*>(h)[0], h1 = reinterpret_cast<float4*>(h)[1];
        const float4 e0 = reinterpret_cast<const float4*>(e)[0], e1 = reinterpret_cast<const float4*>(e)[1];
        h0.x += e0.x; h0.y += e0.y; h0.z += e0.z; h0.w += e0.w;
        h1.x += e1.x; h1.y += e1.y; h1.z += e1.z; h1.w += e1.w;
        reinterpret_cast<float4*>(h)[0] = h0;
        reinterpret_cast<float4*>(h)[1] = h1;
      } else {
        for (int j = 0; j < 8 && j < left; ++j) h[j] += e[j];
      }
    } else {
      const float* e = reinterpret_cast<const float*>(smem) + tok * C::EPAD + j0;
      half* y = static_cast<half*>(a.out) + o;
      __align__(16) half v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float gv = e[j], uv = e[j + C::BR / 2];
        v[j] = __float2half_rn(gv / (1.f + __expf(-gv)) * uv);
      }
      if (vec && left >= 8) {
        *reinterpret_cast<uint4*>(y) = *reinterpret_cast<const uint4*>(v);
      } else {
        for (int j = 0; j < 8 && j < left; ++j) y[j] = v[j];
      }
    }
  }
}

template <int WG_, int MT_, int BT_, int S_, bool DR_ = true>
struct WgShape {
  static constexpr int WG = WG_, MT = MT_, BT = BT_, S = S_;
  static constexpr bool DR = DR_;
};

template <class Sh, int OP>
cudaError_t wg_launch(const char* fn, const GArgs& a, cudaStream_t stream) {
  using C = WgCfg<Sh::WG, Sh::MT, Sh::BT, Sh::S, OP>;
  constexpr auto kern = gemm_int4_wgmma_kernel<Sh::WG, Sh::MT, Sh::BT, Sh::S, OP, Sh::DR>;
  static const cudaError_t attr = set_max_smem(kern, C::SMEM);
  if (attr != cudaSuccess) return smem_refused(attr, fn, C::SMEM);
  const long long blocks = (long long)((a.m + Sh::BT - 1) / Sh::BT) *
                           ((a.n + C::ROWS_OUT - 1) / C::ROWS_OUT);
  if (blocks > INT_MAX)
    return nq_fail(cudaErrorInvalidValue, "%s: m=%d n=%d needs %lld blocks", fn, a.m, a.n, blocks);
  kern<<<(unsigned)blocks, C::kThreads, C::SMEM, stream>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return e;
  return nq_fail(e, "%s: launch of %lld blocks x %d threads with %d bytes of shared memory "
                 "(m=%d n=%d k=%d) failed: %s", fn, blocks, C::kThreads, C::SMEM, a.m, a.n, a.k,
                 cudaGetErrorString(e));
}

// A block shape: WR x WT warps, BT token tiles of 8 a warp, an S-stage ring of KG groups a stage.
template <int WR_, int WT_, int BT_, int S_, int KG_>
struct Shape {
  static constexpr int WR = WR_, WT = WT_, BT = BT_, S = S_, KG = KG_;
};
template <class Sh, int OP>
using CfgOf = Cfg<Sh::WR, Sh::WT, Sh::BT, Sh::S, OP, Sh::KG>;
template <class Sh, int OP>
constexpr auto kKernel = gemm_int4_kernel<Sh::WR, Sh::WT, Sh::BT, Sh::S, OP, Sh::KG>;

// Split-K: how many splits an (m, n, k) launch of this shape takes: none once the output tiles
// fill half the card's resident blocks; otherwise enough to fill them, each split >= 2 stages,
// at most kMaxSplits, and kGemmCounters tiles at most.
constexpr int kMaxSplits = 16;

template <class Sh, int OP>
int splits_for(int m, int n, int k) {
  using C = CfgOf<Sh, OP>;
  static const int resident = [] {
    int dev = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        set_max_smem(kKernel<Sh, OP>, C::SMEM) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel<Sh, OP>, C::kThreads,
                                                      C::SMEM) != cudaSuccess) {
      cudaGetLastError();   // no split then: the launch reports what is wrong
      return 0;
    }
    return sms * (per_sm > 0 ? per_sm : 1);
  }();
  const long long tiles =
      (long long)((n + C::ROWS_OUT - 1) / C::ROWS_OUT) * ((m + C::BM - 1) / C::BM);
  if (tiles * 2 > resident || tiles > kGemmCounters) return 1;
  const int by_groups = (k / kGroup) / (2 * Sh::KG);
  const long long want = resident / tiles;
  return (int)std::max(1LL, std::min<long long>({want, (long long)by_groups, kMaxSplits}));
}

template <class Sh, int OP>
cudaError_t launch(const char* fn, GArgs a, const GemmScratch* scratch, cudaStream_t stream) {
  using C = CfgOf<Sh, OP>;
  static const cudaError_t attr = set_max_smem(kKernel<Sh, OP>, C::SMEM);
  if (attr != cudaSuccess) return smem_refused(attr, fn, C::SMEM);
  a.splits = scratch ? splits_for<Sh, OP>(a.m, a.n, a.k) : 1;
  if (a.splits > 1) {
    const size_t need = (size_t)a.splits * a.m * (OP == OP_SILU ? 2 * a.n : a.n);
    if (!scratch->partials || !scratch->counters || scratch->partial_floats < need)
      return nq_fail(cudaErrorInvalidValue, "%s: split-K scratch of %zu floats (counters %p) for "
                     "m=%d n=%d k=%d, which needs %zu (gemm_int4_scratch_floats)", fn,
                     scratch->partial_floats, (void*)scratch->counters, a.m, a.n, a.k, need);
    a.partials = scratch->partials;
    a.counters = scratch->counters;
  }
  const dim3 grid((a.n + C::ROWS_OUT - 1) / C::ROWS_OUT, (a.m + C::BM - 1) / C::BM, a.splits);
  if (grid.y > 65535u)
    return nq_fail(cudaErrorInvalidValue, "%s: m=%d needs %u token blocks of %d, at most 65535",
                   fn, a.m, grid.y, C::BM);
  kKernel<Sh, OP><<<grid, C::kThreads, C::SMEM, stream>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return e;
  return nq_fail(e, "%s: launch of grid (%u, %u, %u) x block %d with %d bytes of shared memory "
                 "(m=%d n=%d k=%d) failed: %s", fn, grid.x, grid.y, grid.z, C::kThreads, C::SMEM,
                 a.m, a.n, a.k, cudaGetErrorString(e));
}

// The product's block shapes, by m and by epilogue: the fastest of 14 candidates per 7B
// projection on an H100 (benchmarks/lab/gemm_int4_shapes.py, RESULTS.md session 18). Short
// prompts take few tokens a block (8 or 16: no mma on padding) and 2-4 groups a stage (row runs
// of 128-256 B instead of 64); gate/up (two matrices, 2x the rows) and long prompts 256-row
// blocks of 64 tokens.
using Tiny = Shape<4, 1, 1, 3, 2>;     // m <= 8: 128 rows x 8 tokens, 2 groups a stage
using Short = Shape<4, 1, 2, 3, 4>;    // 128 rows x 16 tokens, 4 groups a stage
using Mid = Shape<8, 1, 4, 4, 1>;      // 256 rows x 32 tokens
using Long = Shape<8, 1, 8, 3, 2>;     // 256 rows x 64 tokens, 2 groups a stage

template <int OP, class F>
auto with_shape(int m, F&& f) {
  if (m <= 8) return f(Tiny{});
  if (m <= (OP == OP_SILU ? 16 : 64)) return f(Short{});
  if (m <= 128 && OP != OP_SILU) return f(Mid{});
  return f(Long{});
}

// From kWgmmaMinM tokens on the wgmma kernel (no split-K), below it the mma.sync shapes above.
// Its block shape by epilogue and m: the fastest of 6 per 7B projection on an H100
// (lab/gemm_w4_wgmma.py, RESULTS.md session 22; us at m = 127 / 512 / 2048): qkv (store)
// 128 x 128 no drain 41.8 below 256, 128 x 256 67.8 / 198.9 from there; o and down (residual)
// 128 x 128 no drain (43.6 and 201.5 at 512), 128 x 256 from 1024 (143.7 and 617.1 at 2048);
// gate/up (SiLU) 128 x 128 127.8 below 256, 128 x 256 332.3 to 1023, 256 x 128 no drain
// 1231.9 from 1024.
constexpr int kWgmmaMinM = 128;
using WgSmall = WgShape<2, 1, 128, 5, false>;   // 128 rows x 128 tokens, no drain, 206 KB
using WgSmallD = WgShape<2, 1, 128, 4>;         // 128 x 128, 165 KB
using WgWide = WgShape<2, 1, 256, 3>;           // 128 rows x 256 tokens, 223 KB
using WgTall = WgShape<2, 2, 128, 4, false>;    // 256 rows x 128 tokens, no drain, 197 KB

template <int OP>
cudaError_t wg_run(const char* fn, const GArgs& a, cudaStream_t stream) {
  if constexpr (OP == OP_SILU) {
    if (a.m < 256) return wg_launch<WgSmallD, OP>(fn, a, stream);
    if (a.m < 1024) return wg_launch<WgWide, OP>(fn, a, stream);
    return wg_launch<WgTall, OP>(fn, a, stream);
  } else if constexpr (OP == OP_STORE) {
    if (a.m < 256) return wg_launch<WgSmall, OP>(fn, a, stream);
    return wg_launch<WgWide, OP>(fn, a, stream);
  } else {
    if (a.m < 1024) return wg_launch<WgSmall, OP>(fn, a, stream);
    return wg_launch<WgWide, OP>(fn, a, stream);
  }
}

template <int OP>
cudaError_t run(const char* fn, const GArgs& a, const GemmScratch* scratch, cudaStream_t stream) {
  if (a.m >= kWgmmaMinM) return wg_run<OP>(fn, a, stream);
  return with_shape<OP>(a.m, [&](auto sh) {
    return launch<decltype(sh), OP>(fn, a, scratch, stream);
  });
}

template <int OP>
int run_splits(int m, int n, int k) {
  if (m >= kWgmmaMinM) return 1;
  return with_shape<OP>(m, [&](auto sh) { return splits_for<decltype(sh), OP>(m, n, k); });
}

cudaError_t check(const char* fn, const void* out, const half* x, const uint32_t* qw,
                  const half* sc, int m, int n, int k) {
  if (!out || !x || !qw || !sc)
    return nq_fail(cudaErrorInvalidValue, "%s: null pointer (out=%p x=%p qweight=%p scales=%p)",
                   fn, out, (const void*)x, (const void*)qw, (const void*)sc);
  if (m < 1 || n < 1)
    return nq_fail(cudaErrorInvalidValue, "%s: m=%d and n=%d must be >= 1", fn, m, n);
  if (k < kGroup || k % kGroup)
    return nq_fail(cudaErrorInvalidValue,
                   "%s: k=%d is not a positive multiple of the INT4 group %d", fn, k, kGroup);
  if (misaligned16(x) || misaligned16(qw) || (reinterpret_cast<uintptr_t>(sc) & 3u))
    return nq_fail(cudaErrorInvalidValue,
                   "%s: x=%p and qweight=%p must be 16-byte aligned, scales=%p 4-byte aligned", fn,
                   (const void*)x, (const void*)qw, (const void*)sc);
  if ((long long)m * k > INT_MAX || (long long)n * (k / 32) > INT_MAX)
    return nq_fail(cudaErrorInvalidValue, "%s: m=%d n=%d k=%d is beyond the kernel's int offsets",
                   fn, m, n, k);
  return cudaSuccess;
}

}  // namespace

size_t gemm_int4_scratch_floats(int m, int n, int k, bool silu) {
  if (m < 1 || n < 1 || k < kGroup) return 0;
  // (store and residual share their shapes but not their registers, so maybe not their splits)
  const int s = silu ? run_splits<OP_SILU>(m, n, k)
                     : std::max(run_splits<OP_STORE>(m, n, k), run_splits<OP_RESID>(m, n, k));
  return s > 1 ? (size_t)s * m * (silu ? 2 * n : n) : 0;
}

cudaError_t gemm_int4(half* y, const half* x, const uint32_t* qweight, const half* scales,
                      const half* bias, int m, int n, int k, const GemmScratch* scratch,
                      cudaStream_t stream) {
  if (cudaError_t e = check("gemm_int4", y, x, qweight, scales, m, n, k)) return e;
  return run<OP_STORE>("gemm_int4",
                       GArgs{y, x, qweight, scales, nullptr, nullptr, bias, m, n, k, nullptr,
                             nullptr, 1},
                       scratch, stream);
}

cudaError_t gemm_int4_residual(float* hidden, const half* x, const uint32_t* qweight,
                               const half* scales, int m, int n, int k,
                               const GemmScratch* scratch, cudaStream_t stream) {
  if (cudaError_t e = check("gemm_int4_residual", hidden, x, qweight, scales, m, n, k)) return e;
  return run<OP_RESID>("gemm_int4_residual",
                       GArgs{hidden, x, qweight, scales, nullptr, nullptr, nullptr, m, n, k,
                             nullptr, nullptr, 1},
                       scratch, stream);
}

cudaError_t gemm_int4_silu_mul(half* out, const half* x, const uint32_t* qw_gate,
                               const half* sc_gate, const uint32_t* qw_up, const half* sc_up,
                               int m, int n, int k, const GemmScratch* scratch,
                               cudaStream_t stream) {
  if (cudaError_t e = check("gemm_int4_silu_mul", out, x, qw_gate, sc_gate, m, n, k)) return e;
  if (!qw_up || !sc_up || misaligned16(qw_up) || (reinterpret_cast<uintptr_t>(sc_up) & 3u))
    return nq_fail(cudaErrorInvalidValue,
                   "gemm_int4_silu_mul: up matrix qweight=%p (16-byte aligned) and scales=%p "
                   "(4-byte aligned) must be non-null", (const void*)qw_up, (const void*)sc_up);
  return run<OP_SILU>("gemm_int4_silu_mul",
                      GArgs{out, x, qw_gate, sc_gate, qw_up, sc_up, nullptr, m, n, k, nullptr,
                            nullptr, 1},
                      scratch, stream);
}

}  // namespace nanoqwen
