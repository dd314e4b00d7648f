// Small device helpers shared by the torch-free kernel files (not part of the launcher API), and
// launch_pdl, through which every decode kernel is launched. kernels.h brings the error
// convention (nq_fail / last_error_message) to every file that includes this one.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include <utility>

#include "kernels.h"

namespace nanoqwen {

// ---- programmatic dependent launch (PDL, sm_90) -------------------------------------------------
// Every decode kernel is launched with launch_pdl(), which lets the GPU start it while the
// previous kernel on the stream is still running (its blocks fill SMs the previous grid leaves
// free). Rules each kernel follows (the whole chain stays correct because every kernel obeys
// them):
//   1. Before griddep_wait() a kernel may only READ data written by kernels at least two
//      launches back (weights, K/V of earlier positions, tables) and must not WRITE anything
//      another kernel reads or writes. Everything the immediately preceding kernel writes is
//      read after griddep_wait(), which returns once that grid has completed and its memory is
//      visible.
//   2. griddep_launch_dependents() is called only after griddep_wait(): so when kernel N starts,
//      kernel N-1 has passed its wait, i.e. kernel N-2 and everything before it are complete --
//      that is what makes rule 1's early reads safe.
//   3. A kernel launched without the attribute (PDL off, or a non-PDL predecessor such as a
//      cuBLAS call) sees both instructions as no-ops / immediate returns.
// NANOQWEN_PDL=0 in the environment turns the attribute off (for A/B measurements); the
// kernels are then ordinary stream-ordered launches. Read once per process; only exactly "0"
// means off, anything else the default (on): engine/switches.py rejects values other than
// "", "0" and "1" before the kernels load, so a user never meets that fallback.
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

inline bool pdl_enabled() {
  static const bool on = [] {
    const char* e = getenv("NANOQWEN_PDL");
    return !(e && e[0] == '0' && e[1] == '\0');
  }();
  return on;
}

// kern<<<grid, block, smem, stream>>>(args...) with the programmatic-stream-serialization
// attribute (see above). On failure (the launch's own error, or one cudaGetLastError reports
// right after it) records "<what>: launch of grid (x, y, z) x block b with s bytes of dynamic
// shared memory (PDL on|off) failed: <CUDA error>" and returns the error. `what` names the
// kernel and its instance, e.g. "attention_decode<128, 7>"; the launcher wraps the message with
// its shape arguments.
template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(const char* what, void (*kern)(KArgs...), dim3 grid, dim3 block,
                       size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kern, std::forward<Args>(args)...);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e == cudaSuccess) return e;
  return nq_fail(e, "%s: launch of grid (%u, %u, %u) x block %u with %zu bytes of dynamic shared "
                 "memory (PDL %s) failed: %s", what, grid.x, grid.y, grid.z, block.x, smem,
                 pdl_enabled() ? "on" : "off", cudaGetErrorString(e));
}

// Dynamic shared memory above 48 KB needs the kernel's attribute raised. Call sites do it once
// per kernel instance (not a stream operation, so also legal when the first call happens during
// graph capture) and report a refusal on every call, with the numbers:
//   static const cudaError_t attr = set_max_smem(kern, bytes);
//   if (attr != cudaSuccess) return smem_refused(attr, "<kernel instance>", bytes);
template <typename... KArgs>
cudaError_t set_max_smem(void (*kern)(KArgs...), int bytes) {
  const cudaError_t e =
      cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) (void)cudaGetLastError();  // not sticky: the next launch must not see it
  return e;
}
inline cudaError_t smem_refused(cudaError_t e, const char* what, int bytes) {
  return nq_fail(e, "%s: cudaFuncSetAttribute(MaxDynamicSharedMemorySize, %d bytes) refused: %s",
                 what, bytes, cudaGetErrorString(e));
}

// Streaming 16-byte weight load: read-only path, no L1 allocation (the weights are read
// once per token; L1 is left to the activations). Used by the GEMV kernels. volatile: the
// kernels issue their first weight loads before griddep_wait() on purpose (PDL), and a
// non-volatile asm could be sunk past the wait by the compiler.
__device__ __forceinline__ uint4 ld_weights(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// cp.async (LDGSTS) of 16 bytes global -> shared, bypassing L1 (.cg). Completion per thread:
// cp_async_commit() closes a group, cp_async_wait<N>() returns once at most N of this thread's
// groups are pending; other threads' copies need a barrier (__syncwarp / __syncthreads) after
// that before they are read. Used by the attention page ring and the INT4 GEMV weight ring.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
// The same, zero-filled when !pred (src-size 0: nothing is read, but src must still be a valid
// address). Used by the prefill GEMM (gemm_int4.cu) for tokens and rows past the matrix.
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem),
               "r"(pred ? 16 : 0)
               : "memory");
}
// 4 bytes global -> shared through L1 (.ca: .cg takes 16 only), the first `bytes` (0, 2 or 4)
// read and the rest zero-filled; both addresses 4-byte aligned. Used by gemm_int4.cu for the
// scales (2 bytes each: the aligned pair holding one, read only as far as it must be).
__device__ __forceinline__ void cp_async4_fill(void* smem, const void* gmem, int bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(gmem), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// HF rotate_half of the pair (a, b) = (x[d], x[d + D/2]) by (c, s) in fp32, with explicit
// roundings so the result cannot depend on how the compiler contracts it. rope_kv_write
// (prefill) and attention_decode (decode) both use it, so they rotate q and k bit for bit alike.
__device__ __forceinline__ void rope_pair(float a, float b, float c, float s, half& lo, half& hi) {
  lo = __float2half_rn(__fmaf_rn(a, c, -__fmul_rn(b, s)));
  hi = __float2half_rn(__fmaf_rn(b, c, __fmul_rn(a, s)));
}

// ---- RMSNorm's sum of squares, in ONE order everywhere ---------------------------------------
// The decode step folds its norms into neighbours (engine.cu launch_step, StepArgs::norm_parts):
// the residual GEMVs that update hidden (and the embedding gather) each write, per 16
// consecutive entries of the row, a partial sum of squares ("part" b = entries 16b .. 16b+15),
// and the GEMVs after the norm fold the H/16 parts into the row's sum and form x = w * (h * r)
// themselves. rmsnorm_kernel (the verify step, the prefill, the final norm) computes the same
// parts and the same fold, so a row normed either way is bit-identical: a verified token sees a
// decode step's numbers. Every operation is an explicit _rn (no contraction into FMAs), so
// torch can replay the order exactly (tests/gpu/test_norm_fold.py):
//   part  = tree over the 16 squares: a_i = s_i + s_{i+8}, b_i = a_i + a_{i+4}, c_i = b_i +
//           b_{i+2}, part = c_0 + c_1 (s_i = h_i * h_i)  -- a 16-lane xor butterfly's lane 0;
//   fold  = lane l sums parts l, l+32, ... in order from 0, then a 32-lane xor butterfly
//           (16, 8, 4, 2, 1); r = rsqrt(fold / H + eps).
__device__ __forceinline__ float sq_part16(const float (&h)[16]) {
  float a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = __fadd_rn(__fmul_rn(h[i], h[i]), __fmul_rn(h[i + 8], h[i + 8]));
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = __fadd_rn(a[i], a[i + 4]);
#pragma unroll
  for (int i = 0; i < 2; ++i) a[i] = __fadd_rn(a[i], a[i + 2]);
  return __fadd_rn(a[0], a[1]);
}
// The same part when lane i (< 16) of a warp holds h_i (lanes 16..31 pass 0): lane 0 returns it.
// Called by every lane of the warp.
__device__ __forceinline__ float sq_part16_lanes(float h) {
  float v = __fmul_rn(h, h);
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// The fold of np <= 512 parts (H <= 8192; global or shared memory), by one whole warp; every
// lane gets r. A lane's loads all go out before its adds (a part past np reads as 0: v + 0 = v).
constexpr int kNormMaxParts = 512;
__device__ __forceinline__ float norm_fold_rs(const float* parts, int np, int H, float eps) {
  const int lane = threadIdx.x & 31;
  float pv[kNormMaxParts / 32];
#pragma unroll
  for (int u = 0; u < kNormMaxParts / 32; ++u)
    pv[u] = lane + 32 * u < np ? parts[lane + 32 * u] : 0.f;
  float v = 0.f;
#pragma unroll
  for (int u = 0; u < kNormMaxParts / 32; ++u) v = __fadd_rn(v, pv[u]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  return rsqrtf(__fadd_rn(__fdiv_rn(v, (float)H), eps));
}
// One normed entry: half(w * (h * r)), rounded once.
__device__ __forceinline__ half norm_entry(float h, float r, float w) {
  return __float2half_rn(__fmul_rn(w, __fmul_rn(h, r)));
}

// ---- INT4 words and tensor-core fragments (the INT4 GEMVs; the lab's variants of them) --------
// (a & b) | c in one instruction: lop3 with immLut = (0xF0 & 0xCC) | 0xAA = 0xEA. With b a nibble
// mask and c = 0x64006400 it turns two 4-bit codes into half2(1024 + u) (Marlin's trick).
__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ half2 as_h2(uint32_t u) { return *reinterpret_cast<half2*>(&u); }
__device__ __forceinline__ uint32_t h2_bits(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// d += A . B, mma.sync m16n8k16 with fp16 A (row) and B (col) fragments, fp32 accumulators
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// finite "minus infinity" for the attention kernels' running maxima: a row that has seen only
// masked keys keeps corr = exp2(m - m) = 1 and p = 0, never inf - inf = NaN
constexpr float kNegBig = -1e30f;

// shared-memory address of a generic pointer into shared memory (for PTX operands)
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// four 8x8 fp16 matrices from shared memory: lane l gives the address of row (l & 7) of matrix
// l >> 3; register i holds matrix i in the mma fragment layout (the decode and prefill
// attention kernels' K operands; _trans: transposed, their V operands)
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}

// host: the launchers' 16-byte alignment check of the pointers their kernels load as uint4
inline bool misaligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) != 0; }

}  // namespace nanoqwen
