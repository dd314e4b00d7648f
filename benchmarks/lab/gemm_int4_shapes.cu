// gemm_int4_shapes.cu -- the product's prefill GEMM kernel (csrc/gemm_int4.cu, included whole:
// the same code, not a copy) launched at other block shapes, for benchmarks/lab/gemm_int4_shapes.py
// to time against the shapes the product picks. Not launched by the engine.
#include "gemm_int4.cu"

namespace nanoqwen {
namespace {

typedef cudaError_t (*LabLaunch)(const char*, GArgs, const GemmScratch*, cudaStream_t);
typedef int (*LabSplits)(int, int, int);
struct LabVariant {
  const char* name;
  LabLaunch fn[3];   // by op
  LabSplits splits[3];
};

#define LABV(NAME, WR, WT, BT, S, KG)                                                          \
  {NAME,                                                                                     \
   {launch<Shape<WR, WT, BT, S, KG>, OP_STORE>, launch<Shape<WR, WT, BT, S, KG>, OP_RESID>,  \
    launch<Shape<WR, WT, BT, S, KG>, OP_SILU>},                                              \
   {splits_for<Shape<WR, WT, BT, S, KG>, OP_STORE>, splits_for<Shape<WR, WT, BT, S, KG>, OP_RESID>, \
    splits_for<Shape<WR, WT, BT, S, KG>, OP_SILU>}}

// name: r<WR>t<WT>_b<BT>_s<S>_g<KG> (warps over rows x tokens, token tiles of 8 a warp, ring
// stages, groups of 128 a stage); smem a block in the comment
const LabVariant kLab[] = {
    LABV("r4t1_b4_s4_g1", 4, 1, 4, 4, 1),   // the product's short shape, 68 KB
    LABV("r4t1_b1_s4_g1", 4, 1, 1, 4, 1),   // 8 tokens, 43 KB
    LABV("r4t1_b2_s4_g1", 4, 1, 2, 4, 1),   // 16 tokens, 51 KB
    LABV("r4t1_b8_s4_g1", 4, 1, 8, 4, 1),   // 64 tokens, 100 KB
    LABV("r4t1_b4_s3_g2", 4, 1, 4, 3, 2),   // 32 tokens, 2 groups a stage, 101 KB
    LABV("r4t1_b1_s3_g2", 4, 1, 1, 3, 2),   // 8 tokens, 2 groups, 52 KB
    LABV("r4t1_b8_s3_g2", 4, 1, 8, 3, 2),   // 64 tokens, 2 groups, 150 KB
    LABV("r4t1_b2_s3_g4", 4, 1, 2, 3, 4),   // 16 tokens, 4 groups, 102 KB
    LABV("r8t1_b4_s4_g1", 8, 1, 4, 4, 1),   // 256 rows, 32 tokens, 100 KB
    LABV("r8t1_b8_s4_g1", 8, 1, 8, 4, 1),   // 256 rows, 64 tokens, 132 KB
    LABV("r4t2_b8_s3_g1", 4, 2, 8, 3, 1),   // the product's long shape, 122 KB
    LABV("r8t2_b8_s3_g1", 8, 2, 8, 3, 1),   // 256 x 128, 147 KB
    LABV("r4t2_b8_s2_g2", 4, 2, 8, 2, 2),   // 128 x 128, 2 groups, 162 KB
    LABV("r8t1_b8_s3_g2", 8, 1, 8, 3, 2),   // 256 x 64, 2 groups, 198 KB
};
constexpr int kLabCount = sizeof(kLab) / sizeof(kLab[0]);

}  // namespace
}  // namespace nanoqwen

extern "C" {
int gi4_count() { return nanoqwen::kLabCount; }
const char* gi4_name(int v) { return v >= 0 && v < nanoqwen::kLabCount ? nanoqwen::kLab[v].name : ""; }
const char* gi4_error() { return nanoqwen::last_error_message(); }
// split-K partial floats variant v needs for (op, m, n, k); 0: no split
long long gi4_scratch_floats(int v, int op, int m, int n, int k) {
  const int s = nanoqwen::kLab[v].splits[op](m, n, k);
  return s > 1 ? (long long)s * m * (op == 2 ? 2 * n : n) : 0;
}
// op 0: y half = x W^T (+bias); 1: fp32 out += x W^T; 2: half out = silu(x Wg^T) * (x Wu^T).
// partials/counters: split-K scratch (null: no split). 0 = success.
int gi4_gemm(int v, int op, void* out, const void* x, const void* qw, const void* sc,
             const void* qw2, const void* sc2, const void* bias, int m, int n, int k,
             float* partials, long long partial_floats, int* counters, void* stream) {
  using namespace nanoqwen;
  if (v < 0 || v >= kLabCount || op < 0 || op > 2) return (int)cudaErrorInvalidValue;
  if (cudaError_t e = check("gi4_gemm", out, static_cast<const half*>(x),
                            static_cast<const uint32_t*>(qw), static_cast<const half*>(sc), m, n, k))
    return (int)e;
  const GArgs a{out, static_cast<const half*>(x), static_cast<const uint32_t*>(qw),
                static_cast<const half*>(sc), static_cast<const uint32_t*>(qw2),
                static_cast<const half*>(sc2), static_cast<const half*>(bias), m, n, k,
                nullptr, nullptr, 1};
  const GemmScratch s{partials, (size_t)partial_floats, counters};
  return (int)kLab[v].fn[op]("gi4_gemm", a, partials ? &s : nullptr,
                             static_cast<cudaStream_t>(stream));
}
}
