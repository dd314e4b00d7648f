// w4a16_gemm_lab.cu -- a lab candidate for issue 14 item 1: the prefill's projections as one
// INT4-weight x fp16-activation GEMM on tensor cores, reading the .nanoqwen INT4 layout
// directly (no fp16 copy of the weights, resident or per layer). Not launched by the engine.
//
// Y [m, n] = X [m, k] . W[n, k]^T with W = (u - 8) * s (group 128, engine/quant.py), and the
// prefill's three epilogues: store (+bias, rounded to half), residual (fp32 hidden += Y), SiLU
// (out = silu(X Wg^T) * (X Wu^T), rounded to half; gate and up two matrices).
//
// mma.sync m16n8k16 with A = dequantized weights (16 rows of W), B = X (8 tokens): lane (g, t)
// (g = lane/4, t = lane%4) holds the 16-byte chunk t (k = 32t .. 32t+31 of the group) of rows g
// and g+8, as csrc/gemv_int4.cu's decode GEMV does; its word j gives, with Marlin's lop3 trick on
// the interleaved nibble order, the k pairs {0,1}, {2,3} (mma #1) and {4,5}, {6,7} (mma #2), so the
// mma's logical k slots (2t, 2t+1, 2t+8, 2t+9) map to the physical k 32t + 8j + 4h + {0,1,2,3};
// B takes X at the same physical k: the 8 bytes 32t + 8j + 4h of the token's row. The weight is
// formed as q * s in fp16 (q exact, one rounding: bit-identical to csrc's dequant_int4, i.e. the
// fp16 weight cuBLAS multiplies today), products summed in fp32 by the tensor core.
//
// A block owns BN = WR * 16 * AT rows of W (AT = 2 tiles a warp; for SiLU tile 0 is gate and
// tile 1 up of the same 16 rows) and BM = WT * BT * 8 tokens; warps are WR x WT, each with
// AT x BT tiles of 16 x 8. K advances one group (128) a stage through an S-stage cp.async ring:
//   X stage: BM rows x 256 B; a token's 16 chunks (c = 4t + j) stored at (4j + t) ^ (4 * (token
//            & 1)), so the 8 lanes of a quarter warp (two tokens, t = 0..3, one j) hit 8 distinct
//            16-byte bank groups;
//   W stage: BN rows x 64 B (4 chunks), conflict-free as laid out (lane (g, t): 16B unit 4g + t);
//   scales: each lane loads its rows' scales of the next group from global memory (L2) while the
//            current group computes.
// Tokens past m and rows past n are zero-filled (cp.async src-size 0) and never written.
#include <stdio.h>

#include "common.cuh"

namespace {

constexpr int kGroup = 128;
enum { OP_STORE = 0, OP_RESID = 1, OP_SILU = 2 };

struct GArgs {
  void* out;
  const half* x;        // [m, k]
  const uint32_t* qw;   // [n, k/8]
  const half* sc;       // [n, k/128]
  const uint32_t* qw2;  // up (OP_SILU)
  const half* sc2;
  const half* bias;     // OP_STORE, may be null
  int m, n, k;
};

using nanoqwen::as_h2;   // the INT4 fragment helpers (csrc/common.cuh)
using nanoqwen::h2_bits;
using nanoqwen::lop3_and_or;
using nanoqwen::mma16816;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem),
               "r"(pred ? 16 : 0)
               : "memory");
}
using nanoqwen::cp_async_commit;
using nanoqwen::cp_async_wait;

__device__ __forceinline__ uint4 lds128(const void* p) {
  return *reinterpret_cast<const uint4*>(p);
}

template <int WR, int WT, int AT, int BT, int S, int OP>
struct Cfg {
  static constexpr int kWarps = WR * WT;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int BN = WR * 16 * AT;        // W rows a stage (gate + up rows for SiLU)
  static constexpr int BM = WT * BT * 8;         // tokens
  static constexpr int ROWS_OUT = OP == OP_SILU ? WR * 16 : BN;
  static constexpr int X_BYTES = BM * 256;
  static constexpr int W_BYTES = BN * 64;
  static constexpr int STAGE = X_BYTES + W_BYTES;
  static constexpr int SMEM = S * STAGE;
  static_assert(OP != OP_SILU || AT == 2, "SiLU: tile 0 gate, tile 1 up");
};

template <int WR, int WT, int AT, int BT, int S, int OP>
__global__ void __launch_bounds__(WR * WT * 32) w4a16_kernel(const GArgs a) {
  using C = Cfg<WR, WT, AT, BT, S, OP>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wr = warp % WR, wt = warp / WR;
  const int row0 = blockIdx.x * C::ROWS_OUT;     // first output row
  const int tok0 = blockIdx.y * C::BM;
  const int G = a.k / kGroup;
  const int kw4 = a.k / 32;                      // 16-byte chunks a weight row

  // the global row of smem W row r, and its matrix
  auto w_row = [&](int r, const uint4*& base, int& grow) {
    if constexpr (OP == OP_SILU) {
      const int w = r / 32, rem = r % 32, mat = rem / 16;
      grow = row0 + w * 16 + (rem % 16);
      base = reinterpret_cast<const uint4*>(mat ? a.qw2 : a.qw);
    } else {
      grow = row0 + r;
      base = reinterpret_cast<const uint4*>(a.qw);
    }
  };

  auto load_stage = [&](int slot, int kg) {
    unsigned char* xs = smem + slot * C::STAGE;
    unsigned char* ws = xs + C::X_BYTES;
    for (int c = tid; c < C::BM * 16; c += C::kThreads) {
      const int tok = c >> 4, cc = c & 15;
      const int p = (((cc & 3) << 2) | (cc >> 2)) ^ ((tok & 1) << 2);
      const int gt = tok0 + tok;
      const bool ok = gt < a.m;
      const half* src = a.x + (size_t)(ok ? gt : 0) * a.k + kg * kGroup + cc * 8;
      cp_async16(xs + tok * 256 + p * 16, src, ok);
    }
    for (int c = tid; c < C::BN * 4; c += C::kThreads) {
      const int r = c >> 2, ch = c & 3;
      const uint4* base;
      int grow;
      w_row(r, base, grow);
      const bool ok = grow < a.n;
      cp_async16(ws + r * 64 + ch * 16, base + (size_t)(ok ? grow : 0) * kw4 + kg * 4 + ch, ok);
    }
  };

  // this lane's rows: tile a, rows g and g+8 -> global row and scale pointer
  const half* scp[AT][2];
  bool rok[AT][2];
#pragma unroll
  for (int at = 0; at < AT; ++at)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int grow;
      const half* sbase;
      if constexpr (OP == OP_SILU) {
        grow = row0 + wr * 16 + g + 8 * h;
        sbase = at ? a.sc2 : a.sc;
      } else {
        grow = row0 + (wr * AT + at) * 16 + g + 8 * h;
        sbase = a.sc;
      }
      rok[at][h] = grow < a.n;
      scp[at][h] = sbase + (size_t)(rok[at][h] ? grow : 0) * G;
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
    if (s < G) load_stage(s, s);
    cp_async_commit();
  }
  half sc_next[AT][2];
#pragma unroll
  for (int at = 0; at < AT; ++at)
#pragma unroll
    for (int h = 0; h < 2; ++h) sc_next[at][h] = scp[at][h][0];

  const uint32_t kLo = 0x64006400u;
  const half2 k1032 = as_h2(0x64086408u), k16 = as_h2(0x2C002C00u), k72 = as_h2(0xD480D480u);

  for (int kg = 0; kg < G; ++kg) {
    cp_async_wait<S - 2>();
    __syncthreads();
    {
      const int nk = kg + S - 1;
      if (nk < G) load_stage(nk % S, nk);
      cp_async_commit();
    }
    half2 s2[AT][2];
#pragma unroll
    for (int at = 0; at < AT; ++at)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        s2[at][h] = __half2half2(sc_next[at][h]);
        if (kg + 1 < G) sc_next[at][h] = scp[at][h][kg + 1];
      }
    const unsigned char* xs = smem + (kg % S) * C::STAGE;
    const unsigned char* ws = xs + C::X_BYTES;
    uint4 va[AT], vb[AT];
#pragma unroll
    for (int at = 0; at < AT; ++at) {
      const int r = (wr * AT + at) * 16 + g;
      va[at] = lds128(ws + r * 64 + t * 16);
      vb[at] = lds128(ws + (r + 8) * 64 + t * 16);
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
        const uint4 xv = lds128(xs + tok * 256 + p * 16);
#pragma unroll
        for (int at = 0; at < AT; ++at) {
          mma16816(acc[at][nt], A0[at][0], A0[at][1], A0[at][2], A0[at][3], xv.x, xv.y);
          mma16816(acc[at][nt], A1[at][0], A1[at][1], A1[at][2], A1[at][3], xv.z, xv.w);
        }
      }
    }
  }
  cp_async_wait<0>();

  // epilogue: lane holds (row g / g+8, tokens 2t, 2t+1) of each tile
#pragma unroll
  for (int nt = 0; nt < BT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int tok = tok0 + (wt * BT + nt) * 8 + 2 * t + e;
      if (tok >= a.m) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (OP == OP_SILU) {
          const int row = row0 + wr * 16 + g + 8 * h;
          if (row >= a.n) continue;
          const float gv = acc[0][nt][2 * h + e], uv = acc[1][nt][2 * h + e];
          static_cast<half*>(a.out)[(size_t)tok * a.n + row] =
              __float2half_rn(gv / (1.f + __expf(-gv)) * uv);
        } else {
#pragma unroll
          for (int at = 0; at < AT; ++at) {
            const int row = row0 + (wr * AT + at) * 16 + g + 8 * h;
            if (row >= a.n) continue;
            const float v = acc[at][nt][2 * h + e];
            const size_t i = (size_t)tok * a.n + row;
            if constexpr (OP == OP_STORE) {
              const float b = a.bias ? __half2float(a.bias[row]) : 0.f;
              static_cast<half*>(a.out)[i] = __float2half_rn(v + b);
            } else {
              static_cast<float*>(a.out)[i] += v;
            }
          }
        }
      }
    }
}

template <int WR, int WT, int AT, int BT, int S, int OP>
cudaError_t launch(const GArgs& a, cudaStream_t st) {
  using C = Cfg<WR, WT, AT, BT, S, OP>;
  auto kern = w4a16_kernel<WR, WT, AT, BT, S, OP>;
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
  if (e != cudaSuccess) return e;
  const dim3 grid((a.n + C::ROWS_OUT - 1) / C::ROWS_OUT, (a.m + C::BM - 1) / C::BM);
  kern<<<grid, C::kThreads, C::SMEM, st>>>(a);
  return cudaGetLastError();
}

typedef cudaError_t (*LaunchFn)(const GArgs&, cudaStream_t);
struct Variant {
  const char* name;
  LaunchFn fn[3];  // by op
};

#define VAR(NAME, WR, WT, AT, BT, S)                                                      \
  {NAME,                                                                                 \
   {launch<WR, WT, AT, BT, S, OP_STORE>, launch<WR, WT, AT, BT, S, OP_RESID>,            \
    launch<WR, WT, AT, BT, S, OP_SILU>}}

const Variant kVariants[] = {
    VAR("r4t2_b8_s3", 4, 2, 2, 8, 3),   // 128 W rows x 128 tokens, 256 threads, 120 KB
    VAR("r8t2_b8_s3", 8, 2, 2, 8, 3),   // 256 x 128, 512 threads, 144 KB
    VAR("r8t1_b8_s4", 8, 1, 2, 8, 4),   // 256 x 64, 256 threads, 128 KB
    VAR("r4t1_b8_s4", 4, 1, 2, 8, 4),   // 128 x 64, 128 threads, 96 KB
    VAR("r4t2_b4_s4", 4, 2, 2, 4, 4),   // 128 x 64, 256 threads, 96 KB
    VAR("r2t4_b8_s3", 2, 4, 2, 8, 3),   // 64 x 256, 256 threads, 204 KB
    VAR("r4t4_b4_s3", 4, 4, 2, 4, 3),   // 128 x 128, 512 threads, 120 KB
    VAR("r4t1_b4_s4", 4, 1, 2, 4, 4),   // 128 x 32, 128 threads, 64 KB (short prompts)
};
constexpr int kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);

}  // namespace

extern "C" {

int w4a16_num_variants() { return kNumVariants; }
const char* w4a16_variant_name(int v) { return v >= 0 && v < kNumVariants ? kVariants[v].name : ""; }

// op 0: out half [m, n] = X W^T (+ bias); 1: out fp32 [m, n] += X W^T; 2: out half [m, n] =
// silu(X Wg^T) * (X Wu^T) (qw/sc gate, qw2/sc2 up, n rows each). 0 = success.
int w4a16_gemm(int v, int op, void* out, const void* x, const void* qw, const void* sc,
               const void* qw2, const void* sc2, const void* bias, int m, int n, int k,
               void* stream) {
  if (v < 0 || v >= kNumVariants || op < 0 || op > 2 || m < 1 || n < 1 || k < kGroup ||
      k % kGroup)
    return (int)cudaErrorInvalidValue;
  const GArgs a{out, static_cast<const half*>(x), static_cast<const uint32_t*>(qw),
                static_cast<const half*>(sc), static_cast<const uint32_t*>(qw2),
                static_cast<const half*>(sc2), static_cast<const half*>(bias), m, n, k};
  return (int)kVariants[v].fn[op](a, static_cast<cudaStream_t>(stream));
}

}  // extern "C"
