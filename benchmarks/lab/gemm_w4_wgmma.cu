// gemm_w4_wgmma.cu -- the product's wgmma prefill GEMM (csrc/gemm_int4.cu, included whole: the
// same code, not a copy) at other block shapes, for benchmarks/lab/gemm_w4_wgmma.py to check
// against fp32 math and time against the product's shape, cuBLAS on the resident fp16 weights,
// dequant + cuBLAS and the mma.sync gemm_int4. Not launched by the engine. The product's kernel
// takes wgmma m64n128k16; the widths 64 and 256 the variants below use are specialized here.
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
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
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
