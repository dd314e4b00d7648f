// gemm_w4_wgmma.cu -- the product's wgmma prefill GEMM (csrc/gemm_int4.cu, included whole: the
// same code, not a copy) at other block shapes, for benchmarks/lab/gemm_w4_wgmma.py to check
// against fp32 math and time against the product's shape, cuBLAS on the resident fp16 weights,
// dequant + cuBLAS and the mma.sync gemm_int4. Not launched by the engine. The product's kernel
// takes wgmma m64n128k16 and m64n256k16; the width 64 a variant below uses is specialized here.
#include "gemm_int4.cu"

namespace nanoqwen {
namespace {

template <>
__device__ __forceinline__ void wgmma_rs<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
      : NQ_ACC32(0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

typedef cudaError_t (*WLaunch)(const char*, const GArgs&, cudaStream_t);
struct WVariant {
  const char* name;
  WLaunch fn[3];   // by op
};
#define W4V(NAME, WG, MT, BT, S, DR)                                                         \
  {NAME,                                                                                   \
   {wg_launch<WgShape<WG, MT, BT, S, DR>, OP_STORE>,                                       \
    wg_launch<WgShape<WG, MT, BT, S, DR>, OP_RESID>,                                       \
    wg_launch<WgShape<WG, MT, BT, S, DR>, OP_SILU>}}

// name: wg<WG>_mt<MT>_n<BT>_s<S>[_nd]: warpgroups, 64-row tiles a warpgroup, tokens a block (the
// wgmma N), ring stages, _nd: no drain at a stage's end; rows a block = WG * MT * 64; smem a block in the comment
const WVariant kW4[] = {
    W4V("wg2_mt2_n128_s4", 2, 2, 128, 4, true),    // the product's: 256 rows x 128 tokens, 197 KB
    W4V("wg2_mt2_n128_s4_nd", 2, 2, 128, 4, false),   // the same, no drain (2 stages ahead)
    W4V("wg2_mt1_n128_s4", 2, 1, 128, 4, true),    // 128 x 128, 165 KB
    W4V("wg2_mt1_n128_s5_nd", 2, 1, 128, 5, false),   // 128 x 128, no drain, 206 KB
    W4V("wg2_mt1_n256_s3", 2, 1, 256, 3, true),    // 128 x 256, 223 KB
    W4V("wg2_mt2_n64_s4", 2, 2, 64, 4, true),      // 256 x 64, 133 KB
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
  const GArgs a{out, static_cast<const half*>(x), static_cast<const uint32_t*>(qw),
                static_cast<const half*>(sc), static_cast<const uint32_t*>(qw2),
                static_cast<const half*>(sc2), static_cast<const half*>(bias), m, n, k,
                nullptr, nullptr, 1};
  return (int)kW4[v].fn[op]("w4g_gemm", a, static_cast<cudaStream_t>(stream));
}
}
