// gemv_int8x_lab.cu -- issue 12 item 4, the seed's format lesson measured here: the decode GEMV
// with INT8 activations (x quantized per token) against the product's fp16 activations, in ONE
// kernel skeleton: a copy of csrc/gemv_int4.cu's tca kernel (one column, the decode step; the
// same cp.async weight ring, K split, scales, splitk_store, PDL launch, and the product's table
// of shapes per op), templated on the math only:
//   MATH 0  fp16 x: group_dot as in csrc (exact q from lop3, two mma.m16n8k16 f16 a word);
//   MATH 1  int8 x: x8 = rint(x / sx), sx = max|x| / 127 per token (int8x_quantize, a launch of
//           its own before the GEMV, its time counted), stored per 8-k word in the order the
//           nibble masks give the weights -- bytes (k0, k4, k1, k5 | k2, k6, k3, k7) -- so that
//           w & 0x0F0F0F0F and (w >> 4) & 0x0F0F0F0F are the codes u (0..15) of slots 4t..4t+3
//           and 4t+16..4t+19 of mma.m16n8k32 u8.s8 (no unpacking beyond two masks); the int32
//           sum over a group is exact, and sum(u x8) - 8 sum(x8) = sum(q x8) with the group's
//           sum(x8) precomputed by the quantizer; the group scale and sx applied in fp32.
// Not launched by the engine.
#include <limits.h>

#include "common.cuh"

namespace {

constexpr int kGroup = 128;
enum { OP_STORE = 0, OP_RESID = 1, OP_SILU = 2 };

struct Args {
  void* out;
  const void* x;        // MATH 0: half [k]; MATH 1: int8 [k] in the word order above
  const int* xsum;      // MATH 1: int32 [k/128], the sum of x8 over each group
  const float* sx;      // MATH 1: the token's scale
  const uint32_t* qw;
  const half* sc;
  const uint32_t* qw2;
  const half* sc2;
  const half* bias;
  int n;
  int k;
};

using nanoqwen::as_h2;   // the INT4 fragment helpers (csrc/common.cuh)
using nanoqwen::h2_bits;
using nanoqwen::lop3_and_or;
using nanoqwen::mma16816;

// A u8 (16 x 32, row), B s8 (32 x 8, col), int32 accumulate
__device__ __forceinline__ void mma16832_u8s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                              uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// csrc's group_dot (MATH 0)
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
    mma16816(d0, lo(lop3_and_or(wa[j], 0x000F000Fu, kLo)), lo(lop3_and_or(wb[j], 0x000F000Fu, kLo)),
             hi(lop3_and_or(wa[j], 0x00F000F0u, kLo)), hi(lop3_and_or(wb[j], 0x00F000F0u, kLo)),
             xv[j].x, xv[j].y);
    mma16816(d1, lo(lop3_and_or(a8, 0x000F000Fu, kLo)), lo(lop3_and_or(b8, 0x000F000Fu, kLo)),
             hi(lop3_and_or(a8, 0x00F000F0u, kLo)), hi(lop3_and_or(b8, 0x00F000F0u, kLo)),
             xv[j].z, xv[j].w);
  }
  return make_float2(d0[0] + d1[0], d0[2] + d1[2]);
}

// MATH 1: the group's exact integer dot products sum(u x8) of rows g and g+8 (x2[j]: this lane's
// 8 bytes of word j)
__device__ __forceinline__ int2 group_dot8(const uint4& va, const uint4& vb, const uint2 (&x2)[4]) {
  int d[4] = {0, 0, 0, 0};
  const uint32_t wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
  for (int j = 0; j < 4; ++j)
    mma16832_u8s8(d, wa[j] & 0x0F0F0F0Fu, wb[j] & 0x0F0F0F0Fu, (wa[j] >> 4) & 0x0F0F0F0Fu,
                  (wb[j] >> 4) & 0x0F0F0F0Fu, x2[j].x, x2[j].y);
  return make_int2(d[0], d[2]);
}

template <int OP>
__device__ __forceinline__ void emit_row(const Args& a, int row,
                                         const float (&v)[OP == OP_SILU ? 2 : 1]) {
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

template <int NM, int KS, int OP>
__device__ __forceinline__ void splitk_store(const Args& a, float* red, const float (&acc)[NM][2],
                                             int s, int g, int t, int row0, float post) {
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
        v[m] *= post;
      }
      emit_row<OP>(a, row, v);
    }
  }
}

__device__ __forceinline__ half ld_s_early(const half* p) {
  unsigned short v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return __ushort_as_half(v);
}

template <int GPS>
__device__ __forceinline__ int ring_swz(int col, int row) {
  return (GPS % 2 == 0) ? (col ^ ((row & 1) << 2)) : col;
}

constexpr int kMaxSmem = 227 * 1024;
constexpr long long smem_bytes(long long k, int nm, int ks, int s, int gps, int math) {
  return (math ? k : k * 2) + ks * nm * 16 * 4 + ks * ((k / kGroup + ks - 1) / ks) * nm * 8 * 4 +
         (long long)ks * s * nm * 16 * gps * 64;
}

template <int NM, int KS, int S, int GPS, int OP, int MATH>
__global__ void __launch_bounds__(KS * 32, KS >= 16 ? 1 : 16 / KS) tca_kernel(const Args a) {
  extern __shared__ uint4 xs[];
  constexpr int RC = GPS * 4;
  constexpr int SLOT = NM * 16 * RC;
  constexpr int CPL = 16 * RC / 32;
  const int lane = threadIdx.x & 31, s = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int C = a.k >> 5, G = a.k >> 7;
  const int row0 = blockIdx.x * 16;
  const int gb = s * G / KS, cnt = (s + 1) * G / KS - gb;
  const int maxcnt = (G + KS - 1) / KS;
  float* red = reinterpret_cast<float*>(xs + (MATH ? (a.k >> 4) : (a.k >> 3)));
  half2* ss_all = reinterpret_cast<half2*>(red + KS * NM * 16);
  half2* ss = ss_all + s * maxcnt * NM * 8;
  uint4* ring = reinterpret_cast<uint4*>(ss_all + KS * maxcnt * NM * 8) + s * S * SLOT;
  const int nst = (cnt + GPS - 1) / GPS;

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
          if (st * GPS + gcol[i] < cnt)
            nanoqwen::cp_async16(dst + m * 16 * RC + soff[i], src + goff[i]);
      }
    }
    nanoqwen::cp_async_commit();
  };
#pragma unroll
  for (int st = 0; st < S - 1; ++st) issue(st);
  for (int e = lane; e < cnt * NM * 8; e += 32) {
    const int i = e / (NM * 8), m = (e / 8) % NM, gg = e % 8;
    const half* scm = m ? a.sc2 : a.sc;
    const size_t rlo = (size_t)min(row0 + gg, a.n - 1), rhi = (size_t)min(row0 + gg + 8, a.n - 1);
    ss[e] = __halves2half2(ld_s_early(scm + rlo * G + gb + i), ld_s_early(scm + rhi * G + gb + i));
  }
  nanoqwen::griddep_wait();
  nanoqwen::griddep_launch_dependents();
  const uint4* x4 = reinterpret_cast<const uint4*>(a.x);
  if constexpr (MATH == 0) {  // piece p = 4t + j stored at 4j + t (csrc's layout)
    const int p = lane & 15;
    for (int i = lane >> 4; i < cnt; i += 2) {
      const int gi = gb + i;
      xs[gi * 16 + (p & 3) * 4 + (p >> 2)] = __ldg(x4 + gi * 16 + p);
    }
  } else {                    // 8 pieces a group, as stored
    for (int i = lane; i < cnt * 8; i += 32) xs[gb * 8 + i] = __ldg(x4 + gb * 8 + i);
  }
  __syncwarp();

  float acc[NM][2];
#pragma unroll
  for (int m = 0; m < NM; ++m) acc[m][0] = acc[m][1] = 0.f;
  for (int st = 0; st < nst; ++st) {
    nanoqwen::cp_async_wait<S - 2>();
    __syncwarp();
    issue(st + S - 1);
    const uint4* slot = ring + (st % S) * SLOT;
#pragma unroll
    for (int jj = 0; jj < GPS; ++jj) {
      const int i = st * GPS + jj;
      if (i < cnt) {
        const int gi = gb + i;
        if constexpr (MATH == 0) {
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
          const uint2* x2p = reinterpret_cast<const uint2*>(xs) + gi * 16 + 4 * t;
          uint2 x2[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) x2[j] = x2p[j];
          const int corr = 8 * __ldg(a.xsum + gi);
#pragma unroll
          for (int m = 0; m < NM; ++m) {
            const uint4& va = slot[(m * 16 + g) * RC + ring_swz<GPS>(4 * jj + t, g)];
            const uint4& vb = slot[(m * 16 + g + 8) * RC + ring_swz<GPS>(4 * jj + t, g + 8)];
            const int2 dd = group_dot8(va, vb, x2);
            const float2 sc2 = __half22float2(ss[(i * NM + m) * 8 + g]);
            acc[m][0] = fmaf(sc2.x, (float)(dd.x - corr), acc[m][0]);
            acc[m][1] = fmaf(sc2.y, (float)(dd.y - corr), acc[m][1]);
          }
        }
      }
    }
  }
  nanoqwen::cp_async_wait<0>();
  splitk_store<NM, KS, OP>(a, red, acc, s, g, t, row0, MATH ? __ldg(a.sx) : 1.f);
}

// x half [k] -> x8 int8 [k] (per 8-k word: k0, k4, k1, k5, k2, k6, k3, k7), xsum int32 [k/128],
// sx = max|x| / 127 (1 for an all-zero x). One block of 1024 threads.
__global__ void __launch_bounds__(1024) quantize_kernel(int8_t* x8, int* xsum, float* sx,
                                                        const half* x, int k) {
  __shared__ float wmax[32];
  float m = 0.f;
  for (int i = threadIdx.x; i < k; i += blockDim.x) m = fmaxf(m, fabsf(__half2float(x[i])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) wmax[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < (blockDim.x >> 5) ? wmax[threadIdx.x] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (threadIdx.x == 0) wmax[0] = m;
  }
  __syncthreads();
  const float scale = wmax[0] > 0.f ? wmax[0] / 127.f : 1.f;
  if (threadIdx.x == 0) *sx = scale;
  const float inv = 1.f / scale;
  // a warp per group: lane l quantizes k = 128 gi + 4 l .. +3 (word w = l / 2, half l % 2)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  constexpr int kPos[8] = {0, 2, 4, 6, 1, 3, 5, 7};   // position in the word of k = 0..7
  for (int gi = warp; gi < k / kGroup; gi += nw) {
    int s = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int kk = 4 * lane + e, w = kk >> 3, in = kk & 7;
      const int q = max(-127, min(127, __float2int_rn(__half2float(x[gi * kGroup + kk]) * inv)));
      x8[gi * kGroup + 8 * w + kPos[in]] = (int8_t)q;
      s += q;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) xsum[gi] = s;
  }
}

template <int OP, int KS, int S, int GPS, int MATH>
cudaError_t launch(const Args& a, cudaStream_t stream) {
  constexpr int NM = OP == OP_SILU ? 2 : 1;
  auto kern = tca_kernel<NM, KS, S, GPS, OP, MATH>;
  static const cudaError_t attr = nanoqwen::set_max_smem(kern, kMaxSmem);
  if (attr != cudaSuccess) return nanoqwen::smem_refused(attr, "int8x tca_kernel", kMaxSmem);
  const long long smem = smem_bytes(a.k, NM, KS, S, GPS, MATH);
  if (smem > kMaxSmem) return cudaErrorInvalidValue;
  return nanoqwen::launch_pdl("int8x tca_kernel", kern, dim3((a.n + 15) / 16), dim3(KS * 32),
                              (size_t)smem, stream, a);
}

// the product's table (csrc/gemv_int4.cu kInt4Table): qkv, o_proj (k <= 8192), down_proj, gate/up
template <int MATH>
cudaError_t run(int op, const Args& a, cudaStream_t st) {
  if (op == OP_STORE) return launch<OP_STORE, 4, 4, 2, MATH>(a, st);
  if (op == OP_RESID) return a.k <= 8192 ? launch<OP_RESID, 4, 4, 2, MATH>(a, st)
                                         : launch<OP_RESID, 8, 4, 2, MATH>(a, st);
  return launch<OP_SILU, 2, 4, 2, MATH>(a, st);
}

}  // namespace

extern "C" {

// x half [k] -> x8, xsum, sx for math 1
int int8x_quantize(void* x8, void* xsum, void* sx, const void* x, int k, void* stream) {
  if (k < kGroup || k % kGroup) return (int)cudaErrorInvalidValue;
  quantize_kernel<<<1, 1024, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<int8_t*>(x8), static_cast<int*>(xsum), static_cast<float*>(sx),
      static_cast<const half*>(x), k);
  return (int)cudaGetLastError();
}

// math 0: x half [k]; math 1: x = x8 with xsum, sx from int8x_quantize. op 0 store (+bias),
// 1 residual (out fp32 +=), 2 silu (qw2/sc2 up). One column (the decode step).
int int8x_gemv(int math, int op, void* out, const void* x, const void* xsum, const void* sx,
               const void* qw, const void* sc, const void* qw2, const void* sc2, const void* bias,
               int n, int k, void* stream) {
  if (n < 1 || k < kGroup || k % kGroup || op < 0 || op > 2 || math < 0 || math > 1)
    return (int)cudaErrorInvalidValue;
  const Args a{out, x, static_cast<const int*>(xsum), static_cast<const float*>(sx),
               static_cast<const uint32_t*>(qw), static_cast<const half*>(sc),
               static_cast<const uint32_t*>(qw2), static_cast<const half*>(sc2),
               static_cast<const half*>(bias), n, k};
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  return (int)(math ? run<1>(op, a, st) : run<0>(op, a, st));
}

}  // extern "C"
