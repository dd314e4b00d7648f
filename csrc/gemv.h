// gemv.h -- the batch-1 decode GEMVs the engine launches: INT4 weight-only (group 128) for the
// projections, fp16 for the lm_head, and the INT4 -> fp16 dequantizer prefill feeds cuBLAS with.
//
// Torch-free: raw device pointers, a cudaStream_t, cudaError_t back. Every launcher checks its
// arguments and launches on `stream`; on any failure (a refused argument or shape, a refused
// shared-memory attribute, a failed launch) it records a message with the numbers (kernels.h's
// convention: nanoqwen::last_error_message()) before it returns the error, without launching
// when the arguments are at fault.
//
// INT4 layout (engine/quant.py is the reference): W [n, k] is
//   qweight uint32 [n, k/8]    eight 4-bit codes u (1..15) per word, rows contiguous; word j holds
//                              k = 8j..8j+7, nibble p holds k = 8j + ORDER[p],
//                              ORDER = {0,2,4,6,1,3,5,7}
//   scales  half   [n, k/128]  one scale per group of 128 consecutive inputs
//   W[n, k] = (u - 8) * scales[n, k/128]
//
// Invariants every launcher checks:
//   n >= 1, k >= 128 and k % 128 == 0 (INT4) / k >= 8 and k % 8 == 0 (fp16); 1 <= cols <= 16;
//   x, qweight, w 16-byte aligned (torch allocations are; a sliced view may not be);
//   the shape fits the one kernel instance of its op (gemv_int4.cu's table: shared memory for
//   x and the weight ring; n * k/32 within int) -- every Qwen2.5-Coder shape does; any other is
//   refused with n and k in the message, there is no fallback kernel;
//   all tensors contiguous, row-major, on the current device.
// n may be anything >= 1 (no multiple of 8/16/32 needed): rows past n are never written.
// Accuracy: the INT4 GEMVs multiply exact q (-7..7) by fp16 x on tensor cores with fp32
// accumulation and apply the group scale in fp32 (no |x| limit; relative error ~1e-6 before the
// output's rounding); gemv_fp16 converts w and x exactly to fp32 and sums in fp32.
// Determinism: every output is written by one thread after a fixed-order reduction (no atomics),
// so results are bit-identical run to run, graph or eager.
// PDL: every GEMV is launched with launch_pdl and follows common.cuh's rules (weights and scales
// are loaded before griddep_wait(); x, bias and outputs only after it).
// Outputs must not alias inputs. All launchers are safe to capture in a CUDA graph.
// The variants measured against these (benchmarks/GEMV_NOTES.md) live in benchmarks/lab/.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels.h"

namespace nanoqwen {

// Columns: every GEMV takes `cols` (1..kMaxGemvCols) activation rows at once -- x [cols, k],
// the output [cols, n], both row-major -- and reads the weights once for all of them (the
// speculative verify step's k tokens; the decode step passes 1). Column c's result is
// bit-identical to a cols = 1 call on row c of x (the same products, sums and order per column;
// tests/gpu checks it), so a verified token sees exactly the numbers a decode step would.
constexpr int kMaxGemvCols = 16;

// y[c][n] = sum_k W[n,k]*x[c][k] + (bias ? bias[n] : 0)     y: half [cols, n]; x: half [cols, k];
// bias: half [n] (q/k/v are one call on the concatenated [q_size + 2*kv_size, k] matrix)
cudaError_t gemv_int4(half* y, const half* x, const uint32_t* qweight, const half* scales,
                      const half* bias, int n, int k, int cols, cudaStream_t stream);

// hidden[c][n] += sum_k W[n,k]*x[c][k]    fp32 residual stream, in place (o_proj, down_proj).
cudaError_t gemv_int4_residual(float* hidden, const half* x, const uint32_t* qweight,
                               const half* scales, int n, int k, int cols, cudaStream_t stream);

// out[c][j] = silu(Wg x[c])[j] * (Wu x[c])[j], j < n; gate and up are two INT4 matrices [n, k].
// Both dot products and the SiLU are fp32; only `out` is rounded to half.
cudaError_t gemv_int4_silu_mul(half* out, const half* x, const uint32_t* qw_gate,
                               const half* sc_gate, const uint32_t* qw_up, const half* sc_up,
                               int n, int k, int cols, cudaStream_t stream);

// The decode step's folded norms (one column; the order of the sum of squares: common.cuh).
// gemv_int4_norm / gemv_int4_silu_mul_norm: gemv_int4 / gemv_int4_silu_mul of
// x = rmsnorm(hidden, ln, eps), which each block forms itself from hidden [k] fp32, the k/16
// parts of its sum of squares (parts [k/16] fp32, written by gemv_int4_residual_parts or
// embed_gather) and ln [k] fp16 -- bit-identical to rmsnorm() followed by the plain GEMV.
// gemv_int4_residual_parts: gemv_int4_residual (one column) that also writes parts [ceil(n/16)]:
// part b = the sum of squares of the updated hidden[16b .. 16b+15], in that order.
cudaError_t gemv_int4_norm(half* y, const float* hidden, const float* parts, const half* ln,
                           float eps, const uint32_t* qweight, const half* scales,
                           const half* bias, int n, int k, cudaStream_t stream);
cudaError_t gemv_int4_silu_mul_norm(half* out, const float* hidden, const float* parts,
                                    const half* ln, float eps, const uint32_t* qw_gate,
                                    const half* sc_gate, const uint32_t* qw_up, const half* sc_up,
                                    int n, int k, cudaStream_t stream);
cudaError_t gemv_int4_residual_parts(float* hidden, float* parts, const half* x,
                                     const uint32_t* qweight, const half* scales, int n, int k,
                                     cudaStream_t stream);

// logits[c][n] = sum_k W[n,k]*x[c][k]   W fp16 row-major [n, k] (the lm_head), fp32 products and
// sums.
cudaError_t gemv_fp16(float* logits, const half* x, const half* w, int n, int k, int cols,
                      cudaStream_t stream);

// The prefill's projections over m tokens at once (gemm_int4.cu; issue 14 item 1): the same
// INT4 layout, on tensor cores, no fp16 copy of the weight. x [m, k] half, m >= 1 (any m; the
// kernel picks its block shape by m); n, k as above (scales 4-byte aligned); the weight is formed
// exactly as dequant_int4's and multiplied in fp32. Not captured in a graph, no PDL.
// `scratch` (may be null: no split): where a short prompt's output tiles would leave SMs idle,
// K is split across blocks whose fp32 partials go to scratch->partials (at least
// gemm_int4_scratch_floats(m, n, k, silu) floats; 0 means no split for that shape) and are
// summed in a fixed order (deterministic); scratch->counters: kGemmCounters ints, zeroed once,
// which every launch leaves zeroed (launches sharing them must be stream-ordered).
constexpr int kGemmCounters = 1024;
struct GemmScratch {
  float* partials;
  size_t partial_floats;
  int* counters;
};
size_t gemm_int4_scratch_floats(int m, int n, int k, bool silu);
//   y[t][n] = sum_k W[n,k] x[t][k] (+ bias[n])           y half [m, n]
cudaError_t gemm_int4(half* y, const half* x, const uint32_t* qweight, const half* scales,
                      const half* bias, int m, int n, int k, const GemmScratch* scratch,
                      cudaStream_t stream);
//   hidden[t][n] += sum_k W[n,k] x[t][k]                  hidden fp32 [m, n]
cudaError_t gemm_int4_residual(float* hidden, const half* x, const uint32_t* qweight,
                               const half* scales, int m, int n, int k,
                               const GemmScratch* scratch, cudaStream_t stream);
//   out[t][j] = silu(Wg x[t])[j] * (Wu x[t])[j]           out half [m, n], fp32 sums
cudaError_t gemm_int4_silu_mul(half* out, const half* x, const uint32_t* qw_gate,
                               const half* sc_gate, const uint32_t* qw_up, const half* sc_up,
                               int m, int n, int k, const GemmScratch* scratch,
                               cudaStream_t stream);

// w half [n, k] = dequantize(qweight, scales); bit-identical to quant.dequantize(...).half()
// ((u-8)*s is formed exactly and rounded once). Prefill uses it to feed cuBLAS.
cudaError_t dequant_int4(half* w, const uint32_t* qweight, const half* scales, int n, int k,
                         cudaStream_t stream);

}  // namespace nanoqwen
