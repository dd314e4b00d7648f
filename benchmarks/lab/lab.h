// lab.h -- the C API of the lab library (benchmarks/lab/lab.py builds it; ctypes loads it): the
// measured alternatives that left csrc/ (benchmarks/lab/README.md), as they were in csrc/ at
// commit 2047cf7. Nothing in the engine links this.
//
// The GEMV part below is csrc/gemv.h of 2047cf7 unchanged, except that messages now go through
// csrc's error convention (kernels.h: gemv_last_error_message() returns
// nanoqwen::last_error_message()). gemv_int4 / gemv_int4_residual / gemv_int4_silu_mul /
// gemv_fp16 / dequant_int4 here are the lab's copies of 2047cf7's launchers (the same kernel
// instances production runs; see README.md), exported under their old C names.
//
// Torch-free: raw device pointers, a cudaStream_t, cudaError_t back. Every launcher checks its
// arguments, launches on `stream` and returns the error. On a failed argument check it returns
// cudaErrorInvalidValue WITHOUT launching, and gemv_last_error_message() (per host thread) then
// says what was wrong, with the numbers ("k=3500 is not a multiple of 128").
//
// INT4 layout (engine/quant.py is the reference): W [n, k] is
//   qweight uint32 [n, k/8]    eight 4-bit codes u (1..15) per word, rows contiguous; word j holds
//                              k = 8j..8j+7, nibble p holds k = 8j + ORDER[p],
//                              ORDER = {0,2,4,6,1,3,5,7}
//   scales  half   [n, k/128]  one scale per group of 128 consecutive inputs
//   W[n, k] = (u - 8) * scales[n, k/128]
//
// Invariants every launcher checks:
//   n >= 1, k >= 128 and k % 128 == 0 (INT4) / k % 8 == 0 (fp16);
//   x, qweight, w 16-byte aligned (torch allocations are; a sliced view may not be);
//   all tensors contiguous, row-major, on the current device.
// n may be anything >= 1 (no multiple of 8/32 needed): rows past n are never read or written.
// INT4 accuracy (variants chosen per launcher in gemv_int4.cu from GEMV_NOTES.md's run 7):
// gemv_int4, gemv_int4_residual and gemv_int4_silu_mul (v5 tca_exact): exact q times fp16 x on
// tensor cores, fp32 sums, group scale applied in fp32 -- no |x| limit, rel. error ~1e-6 before
// the output's rounding.
// The fused-norm launchers (v5 tca_exact with the norm in the prologue): the same fp32 sums;
// x is formed per block exactly as the rmsnorm kernel forms it (only the sum of squares is
// reduced in another order, so x can differ from rmsnorm()'s in the last bit).
// Determinism: every output is written by one thread after a fixed-order reduction (no atomics),
// so results are bit-identical run to run, graph or eager.
// PDL: every GEMV is launched with nanoqwen::launch_pdl and follows common.cuh's rules (weights
// and scales are loaded before griddep_wait(); x, hidden, bias and outputs only after it).
// Outputs must not alias inputs. All launchers are safe to capture in a CUDA graph.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// y[n] = sum_k W[n,k]*x[k] + (bias ? bias[n] : 0)      y, bias: half [n]; x: half [k]
// (q/k/v are one call on the concatenated [q_size + 2*kv_size, k] matrix with one bias)
cudaError_t gemv_int4(half* y, const half* x, const uint32_t* qweight, const half* scales,
                      const half* bias, int n, int k, cudaStream_t stream);

// hidden[n] += sum_k W[n,k]*x[k]    fp32 residual stream, in place (o_proj, down_proj).
// Each row is written by exactly one warp (no atomics), so the result is deterministic.
cudaError_t gemv_int4_residual(float* hidden, const half* x, const uint32_t* qweight,
                               const half* scales, int n, int k, cudaStream_t stream);

// out[j] = silu(Wg x)[j] * (Wu x)[j], j < n; gate and up are two INT4 matrices [n, k].
// Both dot products and the SiLU are fp32; only `out` is rounded to half.
cudaError_t gemv_int4_silu_mul(half* out, const half* x, const uint32_t* qw_gate,
                               const half* sc_gate, const uint32_t* qw_up, const half* sc_up,
                               int n, int k, cudaStream_t stream);

// logits[n] = sum_k W[n,k]*x[k]   W fp16 row-major [n, k] (the lm_head), fp32 products and sums.
cudaError_t gemv_fp16(float* logits, const half* x, const half* w, int n, int k,
                      cudaStream_t stream);

// The same three GEMVs with the RMSNorm fused into the prologue: x = half(float(norm_w) *
// hidden * rsqrt(mean(hidden^2) + eps)), hidden fp32 [k] (the residual stream), computed per
// block in fp32 and rounded once to half exactly as the rmsnorm kernel rounds it (the sum of
// squares may be reduced in another order, so x can differ from rmsnorm()'s in the last bit).
// What the decode step launched with NANOQWEN_FUSE_NORM=1 (no separate rmsnorm kernel, no xn
// round trip) until the switch was removed: 1.93 against 1.89 ms/token (RESULTS.md).
cudaError_t gemv_int4_norm(half* y, const float* hidden, const half* norm_w, float eps,
                           const uint32_t* qweight, const half* scales, const half* bias, int n,
                           int k, cudaStream_t stream);
cudaError_t gemv_int4_silu_mul_norm(half* out, const float* hidden, const half* norm_w, float eps,
                                    const uint32_t* qw_gate, const half* sc_gate,
                                    const uint32_t* qw_up, const half* sc_up, int n, int k,
                                    cudaStream_t stream);
cudaError_t gemv_fp16_norm(float* logits, const float* hidden, const half* norm_w, float eps,
                           const half* w, int n, int k, cudaStream_t stream);

// w half [n, k] = dequantize(qweight, scales); bit-identical to quant.dequantize(...).half()
// ((u-8)*s is formed exactly and rounded once). Prefill uses it to feed cuBLAS.
cudaError_t dequant_int4(half* w, const uint32_t* qweight, const half* scales, int n, int k,
                         cudaStream_t stream);

// The message of the last failed argument check in this host thread ("" if none yet).
const char* gemv_last_error_message(void);

// ---- benchmark hooks (benchmarks/lab/gemv_harness.py) ----------------------------------------
// Same math as the launchers above, with the kernel variant picked by index so one build can
// time the alternatives recorded in benchmarks/GEMV_NOTES.md. op: 0 = gemv_int4 (out half,
// bias may be null), 1 = gemv_int4_residual (out float), 2 = gemv_int4_silu_mul (qw2/sc2 = up).
int gemv_int4_variant_count(void);
const char* gemv_int4_variant_name(int variant);
cudaError_t gemv_int4_bench(int variant, int op, void* out, const half* x, const uint32_t* qw,
                            const half* sc, const uint32_t* qw2, const half* sc2,
                            const half* bias, int n, int k, cudaStream_t stream);
// The same with the fused RMSNorm (op 0 = gemv_int4_norm, 2 = gemv_int4_silu_mul_norm); only the
// variants for which gemv_int4_variant_supports_norm() is 1 accept it (others fail).
cudaError_t gemv_int4_norm_bench(int variant, int op, void* out, const float* hidden,
                                 const half* norm_w, float eps, const uint32_t* qw, const half* sc,
                                 const uint32_t* qw2, const half* sc2, const half* bias, int n,
                                 int k, cudaStream_t stream);
int gemv_int4_variant_supports_norm(int variant);
int gemv_fp16_variant_count(void);
const char* gemv_fp16_variant_name(int variant);
cudaError_t gemv_fp16_bench(int variant, float* logits, const half* x, const half* w, int n,
                            int k, cudaStream_t stream);
cudaError_t gemv_fp16_norm_bench(int variant, float* logits, const float* hidden,
                                 const half* norm_w, float eps, const half* w, int n, int k,
                                 cudaStream_t stream);

// internal: shared by the lab .cu files to record a failed check; returns cudaErrorInvalidValue.
cudaError_t gemv_fail_(const char* fmt, ...);

// ---- paged_attention (attention_lab.cu): the split + combine decode attention that
// attention_decode replaced (csrc/attention.cu of 2047cf7). Decode attention of one token
// (position pos[0]) over positions 0..pos[0] of a paged cache; q [n_heads, head_dim] after RoPE,
// out [n_heads, head_dim]. Split-K: grid (n_kv, num_splits), split s takes a contiguous run of
// ceil(pages / num_splits) pages; a second kernel merges the splits' (max, sum, acc).
//   ws_acc fp32 [n_heads, num_splits, head_dim], ws_ml fp32 [n_heads, num_splits, 2].
// head_dim 64 or 128; n_heads / n_kv <= 8. scale = 1/sqrt(head_dim). A failed check records a
// message (gemv_last_error_message()).
cudaError_t paged_attention(half* out, float* ws_acc, float* ws_ml, const half* q,
                            const half* k_cache, const half* v_cache, const int32_t* page_table,
                            int table_len, const int32_t* pos, int n_heads, int n_kv,
                            int head_dim, int num_splits, float scale, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
