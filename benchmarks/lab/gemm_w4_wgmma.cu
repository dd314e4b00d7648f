// gemm_w4_wgmma.cu -- lab: the prefill's INT4-weight x fp16-activation GEMM on Hopper's wgmma
// (issue 14 item 1), for benchmarks/lab/gemm_w4_wgmma.py to check against fp32 math and time
// against cuBLAS on the resident fp16 weights and the product's mma.sync gemm_int4. Not launched
// by the engine.
//
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
#include <limits.h>

#include <algorithm>

#include "common.cuh"

namespace nanoqwen {
namespace {

constexpr int kGroup = 128;
enum { OP_STORE = 0, OP_RESID = 1, OP_SILU = 2 };

struct WArgs {
  void* out;
  const half* x;
  const uint32_t* qw;
  const half* sc;
  const uint32_t* qw2;   // SiLU: the up matrix
  const half* sc2;
  const half* bias;      // store: [n] or null
  int m, n, k;
};

// d (+)= A . B, wgmma m64nNk16, f32 += f16 x f16, A from registers (K-major), B K-major from
// shared memory by descriptor (no transpose); scale-d 1 (accumulate), scales of A and B 1
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
        "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
        "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t desc) {
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
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
        "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
        "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]),
        "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]),
        "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]),
        "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),
        "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
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
struct WCfg {
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

template <int WG, int MT, int BT, int S, int OP>
__global__ void __launch_bounds__(WG * 128, 1) gemm_w4_wgmma_kernel(const WArgs a) {
  using C = WCfg<WG, MT, BT, S, OP>;
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
      const size_t e = ok ? (size_t)grow * G + kg : 0;   // the scale's index; its pair e & ~1
      cp_async4_fill(ss + r * 4, (up ? a.sc2 : a.sc) + (e & ~(size_t)1),
                     !ok ? 0 : (e & 1) ? 4 : 2);
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
  for (int s = 0; s < S - 1; ++s) {
    if (s < G) load_stage(s, s);
    cp_async_commit();
  }
  const uint32_t sh = 4 * t;
  const half2 k1032 = as_h2(0x64086408u);
  auto pair = [&](uint32_t w, half2 s) {
    return h2_bits(__hmul2(__hsub2(as_h2(lop3_and_or(w >> sh, 0x000F000Fu, 0x64006400u)), k1032), s));
  };

  for (int kg = 0; kg < G; ++kg) {
    cp_async_wait<S - 2>();
    fence_proxy_async();
    __syncthreads();   // stage kg is in; every wgmma of stage kg - 1 is done (waited below)
    {
      const int nk = kg + S - 1;
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
        for (int mt = 0; mt < MT; ++mt) wgmma_rs(acc[mt], A[mt], desc);
        wg_commit();
        wg_wait<1>();
      }
    }
    wg_wait<0>();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) fence_regs(acc[mt]);
  }
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

template <int WG_, int MT_, int BT_, int S_>
struct WShape {
  static constexpr int WG = WG_, MT = MT_, BT = BT_, S = S_;
};

template <class Sh, int OP>
cudaError_t launch(const char* fn, const WArgs& a, cudaStream_t stream) {
  using C = WCfg<Sh::WG, Sh::MT, Sh::BT, Sh::S, OP>;
  constexpr auto kern = gemm_w4_wgmma_kernel<Sh::WG, Sh::MT, Sh::BT, Sh::S, OP>;
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

typedef cudaError_t (*WLaunch)(const char*, const WArgs&, cudaStream_t);
struct WVariant {
  const char* name;
  WLaunch fn[3];   // by op
};
#define W4V(NAME, WG, MT, BT, S)                                                               \
  {NAME,                                                                                     \
   {launch<WShape<WG, MT, BT, S>, OP_STORE>, launch<WShape<WG, MT, BT, S>, OP_RESID>,          \
    launch<WShape<WG, MT, BT, S>, OP_SILU>}}

// name: wg<WG>_mt<MT>_n<BT>_s<S>: warpgroups, 64-row tiles a warpgroup, tokens a block (the
// wgmma N), ring stages; rows a block = WG * MT * 64; smem a block in the comment
const WVariant kW4[] = {
    W4V("wg2_mt2_n128_s4", 2, 2, 128, 4),   // 256 rows x 128 tokens, 197 KB
    W4V("wg2_mt1_n128_s4", 2, 1, 128, 4),   // 128 x 128, 165 KB
    W4V("wg2_mt1_n256_s3", 2, 1, 256, 3),   // 128 x 256, 223 KB
    W4V("wg2_mt2_n64_s4", 2, 2, 64, 4),     // 256 x 64, 133 KB
};
constexpr int kW4Count = sizeof(kW4) / sizeof(kW4[0]);

}  // namespace
}  // namespace nanoqwen

extern "C" {
int w4g_count() { return nanoqwen::kW4Count; }
const char* w4g_name(int v) { return v >= 0 && v < nanoqwen::kW4Count ? nanoqwen::kW4[v].name : ""; }
const char* w4g_error() { return nanoqwen::last_error_message(); }
// op 0: y half = x W^T (+bias); 1: fp32 out += x W^T; 2: half out = silu(x Wg^T) * (x Wu^T).
// 0 = success
int w4g_gemm(int v, int op, void* out, const void* x, const void* qw, const void* sc,
             const void* qw2, const void* sc2, const void* bias, int m, int n, int k, void* stream) {
  using namespace nanoqwen;
  if (v < 0 || v >= kW4Count || op < 0 || op > 2) return (int)cudaErrorInvalidValue;
  if (!out || !x || !qw || !sc || m < 1 || n < 1 || k < kGroup || k % kGroup ||
      misaligned16(x) || misaligned16(qw) || (reinterpret_cast<uintptr_t>(sc) & 3u) ||
      (op == 2 && (!qw2 || !sc2 || misaligned16(qw2))) || (long long)n * (k / 32) > INT_MAX)
    return (int)nq_fail(cudaErrorInvalidValue, "w4g_gemm: bad arguments m=%d n=%d k=%d", m, n, k);
  const WArgs a{out, static_cast<const half*>(x), static_cast<const uint32_t*>(qw),
                static_cast<const half*>(sc), static_cast<const uint32_t*>(qw2),
                static_cast<const half*>(sc2), static_cast<const half*>(bias), m, n, k};
  return (int)kW4[v].fn[op]("w4g_gemm", a, static_cast<cudaStream_t>(stream));
}
}
