// gemv_int4_family_lab.cu -- the product's one-column INT4 decode GEMV (csrc/gemv_int4.cu's
// gemv_int4_tca_kernel, included whole: so it builds alone, lab.py's ALONE) in other shapes of
// its K split (KS warps a block) and ring (S stages of GPS groups), with the decode step's own
// epilogues and prologues: qkv with the folded norm and bias, o and down with the residual add
// and the sum-of-squares parts, gate/up with the folded norm and SiLU * up. Driven by
// gemv_int4_family.py, which times each at every family preset's shapes against the product's
// torch op. kInt4Table was chosen at the 7B's shapes (GEMV_NOTES.md runs 7-8); its rows are keyed
// by k only, so the 0.5B's down_proj (k = 4864) runs o_proj's 4-warp instance, and every small
// preset's GEMV runs a 7B-tuned one. The S-1 first ring stages are copied before griddep_wait
// (PDL), so a warp whose slice fits S-1 stages has all its weights on the way before the kernel
// before it ends: the small presets' slices do at more warps (KS) or deeper rings (S), at the
// cost of shared memory, which may keep the next kernel's blocks off the SM. Nothing in the
// engine links this.
#include "gemv_int4.cu"

namespace nanoqwen {
namespace {

using Launch = cudaError_t (*)(const Args&, cudaStream_t);
struct FamilyVariant {
  int op, ks, s, gps;
  Launch fn;
};

template <int OP, int KS, int S, int GPS>
constexpr FamilyVariant fv() {
  return {OP, KS, S, GPS, &Tca<OP, KS, S, GPS>::template launch<0>};
}

constexpr FamilyVariant kFamily[] = {
    fv<OP_STORE, 2, 4, 2>(), fv<OP_STORE, 4, 4, 2>(), fv<OP_STORE, 8, 4, 2>(),
    fv<OP_STORE, 4, 4, 1>(), fv<OP_STORE, 8, 4, 1>(), fv<OP_STORE, 4, 6, 2>(),
    fv<OP_RESID, 2, 4, 2>(), fv<OP_RESID, 4, 4, 2>(), fv<OP_RESID, 8, 4, 2>(),
    fv<OP_RESID, 16, 4, 2>(), fv<OP_RESID, 8, 4, 1>(), fv<OP_RESID, 16, 4, 1>(),
    fv<OP_RESID, 16, 2, 2>(), fv<OP_RESID, 4, 8, 2>(), fv<OP_RESID, 8, 6, 2>(),
    fv<OP_SILU, 1, 4, 2>(), fv<OP_SILU, 2, 4, 2>(), fv<OP_SILU, 4, 4, 2>(),
    fv<OP_SILU, 8, 4, 2>(), fv<OP_SILU, 4, 4, 1>(), fv<OP_SILU, 8, 4, 1>(),
    fv<OP_SILU, 2, 6, 2>(),
};
constexpr int kFamilyCount = sizeof(kFamily) / sizeof(kFamily[0]);

}  // namespace
}  // namespace nanoqwen

using namespace nanoqwen;

extern "C" {
int family_count() { return kFamilyCount; }
// "op KS S GPS": op 0 qkv (store + folded norm + bias), 1 o/down (residual + parts), 2 gate/up
// (SiLU * up + folded norm)
void family_shape(int v, int* out4) {
  const FamilyVariant& f = kFamily[v];
  out4[0] = f.op; out4[1] = f.ks; out4[2] = f.s; out4[3] = f.gps;
}
// One launch of variant v, one column, the decode step's form of its op:
//   op 0: y half [n] = rmsnorm(hid) @ W^T + bias (hid fp32 [k], parts [k/16], ln half [k])
//   op 1: hidden fp32 [n] += x half [k] @ W^T, parts_out [n/16]
//   op 2: out half [n] = silu(x W_gate^T) * (x W_up^T), x = rmsnorm(hid)
int family_launch(int v, void* out, const void* x, const void* qw, const void* sc, const void* qw2,
                  const void* sc2, const void* bias, int n, int k, const float* hid,
                  const float* parts, const void* ln, float eps, float* parts_out,
                  void* stream) {
  if (v < 0 || v >= kFamilyCount) return (int)cudaErrorInvalidValue;
  const FamilyVariant& f = kFamily[v];
  if (tca_smem_bytes(k, f.op == OP_SILU ? 2 : 1, f.ks, f.s, f.gps, 0) > kTcaMaxSmemBytes)
    return (int)cudaErrorInvalidValue;
  Args a{out, (const half*)x, (const uint32_t*)qw, (const half*)sc, (const uint32_t*)qw2,
         (const half*)sc2, (const half*)bias, n, k, 1};
  if (f.op == OP_RESID) {
    a.parts_out = parts_out;
  } else {  // x is formed from the norm's inputs
    a.x = nullptr;
    a.hid = hid; a.parts = parts; a.ln = (const half*)ln; a.eps = eps;
  }
  return (int)f.fn(a, (cudaStream_t)stream);
}
}
