// The one file that includes torch: registers every nanoqwen op with TORCH_LIBRARY.
//
// Each op checks device, dtype, shape and contiguity (messages carry the numbers), launches
// the torch-free launcher on the current CUDA stream of the tensors' device, and turns a
// failed launch into a RuntimeError naming the op. Schemas: outputs first, mutated `Tensor!`,
// no return values (outputs are preallocated, so every op is safe inside CUDA-graph capture).
//
// No iostreams here: on the GPU machine a std::ostringstream instantiated in this library
// crashed inside libstdc++'s locale code (H200 run, 2026-12-02: SIGSEGV in
// basic_ostream::_M_insert<long> from check_dims). Messages are built with std::string and
// std::to_string and handed to TORCH_CHECK as one std::string, which c10::str passes through
// without a stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <type_traits>

#include "gemv.h"
#include "kernels.h"

namespace nanoqwen_ops {

using at::Tensor;
using Ts = std::initializer_list<const Tensor*>;

inline void app(std::string& s, const char* v) { s += v; }
inline void app(std::string& s, const std::string& v) { s += v; }
inline void app(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
inline void app(std::string& s, T v) { s += std::to_string(v); }
inline void app(std::string& s, double v) { s += std::to_string(v); }
inline void app(std::string& s, at::ScalarType v) { s += at::toString(v); }
inline void app(std::string& s, const c10::Device& d) { s += d.str(); }
inline void app(std::string& s, c10::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += "]";
}

// Raise a c10::Error (RuntimeError in Python) whose message is the concatenation of `a...`.
template <typename... A>
void fail(const A&... a) {
  std::string msg;
  (app(msg, a), ...);
  TORCH_CHECK(false, msg.c_str());  // one C string: passed through, no c10::str stream
}

// TORCH_CHECK without c10::str's stream: the message is only built when `cond` fails.
#define NQ_CHECK(cond, ...) \
  do {                      \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

std::string shape_str(const Tensor& t) {
  std::string s;
  app(s, t.sizes());
  return s;
}

// device (CUDA), dtype and contiguity of one argument
void check_arg(const char* op, const char* name, const Tensor& t, at::ScalarType dtype) {
  NQ_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got device ", t.device());
  NQ_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", at::toString(dtype),
              ", got ", at::toString(t.scalar_type()));
  NQ_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (shape ", shape_str(t),
              ", strides ", t.strides(), ")");
}

void check_dims(const char* op, const char* name, const Tensor& t,
                std::initializer_list<int64_t> dims) {
  bool ok = t.dim() == (int64_t)dims.size();
  int64_t i = 0;
  for (int64_t d : dims) {
    if (ok && d >= 0 && t.size(i) != d) ok = false;
    ++i;
  }
  if (ok) return;
  std::string want = "[";
  i = 0;
  for (int64_t d : dims) {
    if (i++) want += ", ";
    want += d >= 0 ? std::to_string(d) : std::string("*");
  }
  want += "]";
  fail(op, ": ", name, " has shape ", shape_str(t), ", expected ", want);
}

void same_device(const char* op, const Tensor& a, const Tensor& b, const char* bname) {
  NQ_CHECK(a.device() == b.device(), op, ": ", bname, " is on ", b.device(),
              " but the output is on ", a.device());
}

void check_launch(const char* op, cudaError_t err, bool gemv = false) {
  if (err == cudaSuccess) return;
  std::string extra;
  if (gemv && err == cudaErrorInvalidValue) extra = std::string(" (") + gemv_last_error_message() + ")";
  fail("nanoqwen::", op, " failed: ", cudaGetErrorString(err), extra);
}

cudaStream_t stream_of(const Tensor& t) {
  return at::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

half* hp(const Tensor& t) { return reinterpret_cast<half*>(t.data_ptr()); }
const half* chp(const Tensor& t) { return reinterpret_cast<const half*>(t.data_ptr()); }

// ---- embedding / norm ------------------------------------------------------------------------

void embed_gather(Tensor& hidden, const Tensor& table, const Tensor& ids) {
  const char* op = "embed_gather";
  check_arg(op, "hidden", hidden, at::kFloat);
  check_arg(op, "table", table, at::kHalf);
  check_arg(op, "ids", ids, at::kInt);
  check_dims(op, "table", table, {-1, -1});
  check_dims(op, "ids", ids, {-1});
  const int64_t T = ids.size(0), H = table.size(1);
  check_dims(op, "hidden", hidden, {T, H});
  NQ_CHECK(H % 8 == 0, op, ": hidden size ", H, " is not a multiple of 8");
  same_device(op, hidden, table, "table");
  same_device(op, hidden, ids, "ids");
  const c10::cuda::CUDAGuard g(hidden.device());
  check_launch(op, nanoqwen::embed_gather(hidden.data_ptr<float>(), chp(table),
                                          ids.data_ptr<int32_t>(), (int)T, (int)H,
                                          (int)table.size(0), stream_of(hidden)));
}

void rmsnorm(Tensor& out, const Tensor& hidden, const Tensor& weight, double eps) {
  const char* op = "rmsnorm";
  check_arg(op, "out", out, at::kHalf);
  check_arg(op, "hidden", hidden, at::kFloat);
  check_arg(op, "weight", weight, at::kHalf);
  check_dims(op, "hidden", hidden, {-1, -1});
  const int64_t T = hidden.size(0), H = hidden.size(1);
  check_dims(op, "out", out, {T, H});
  check_dims(op, "weight", weight, {H});
  NQ_CHECK(H % 4 == 0 && H <= 8192, op, ": hidden size ", H,
              " must be a multiple of 4 and at most 8192");
  NQ_CHECK(eps > 0, op, ": eps=", eps, " must be > 0");
  same_device(op, out, hidden, "hidden");
  same_device(op, out, weight, "weight");
  const c10::cuda::CUDAGuard g(out.device());
  check_launch(op, nanoqwen::rmsnorm(hp(out), hidden.data_ptr<float>(), chp(weight), (int)T,
                                     (int)H, (float)eps, stream_of(out)));
}

// ---- RoPE + KV write, attention ----------------------------------------------------------------

void check_cache(const char* op, const Tensor& k_cache, const Tensor& v_cache) {
  check_arg(op, "k_cache", k_cache, at::kHalf);
  check_arg(op, "v_cache", v_cache, at::kHalf);
  check_dims(op, "k_cache", k_cache, {-1, nanoqwen::kPageSize, -1, -1});
  NQ_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache shape ", shape_str(v_cache),
              " differs from k_cache shape ", shape_str(k_cache));
  const int64_t D = k_cache.size(3);
  NQ_CHECK(D == 64 || D == 128, op, ": head_dim=", D, " is not supported (64 or 128)");
}

void rope_kv_write(Tensor& q_out, Tensor& k_cache, Tensor& v_cache, const Tensor& qkv,
                   const Tensor& cos, const Tensor& sin, const Tensor& pos,
                   const Tensor& page_table) {
  const char* op = "rope_kv_write";
  check_arg(op, "q_out", q_out, at::kHalf);
  check_cache(op, k_cache, v_cache);
  check_arg(op, "qkv", qkv, at::kHalf);
  check_arg(op, "cos", cos, at::kFloat);
  check_arg(op, "sin", sin, at::kFloat);
  check_arg(op, "pos", pos, at::kInt);
  check_arg(op, "page_table", page_table, at::kInt);
  check_dims(op, "q_out", q_out, {-1, -1, -1});
  const int64_t T = q_out.size(0), nh = q_out.size(1), D = k_cache.size(3);
  const int64_t nkv = k_cache.size(2);
  check_dims(op, "q_out", q_out, {T, nh, D});
  NQ_CHECK(nh % nkv == 0, op, ": n_heads=", nh, " is not a multiple of n_kv_heads=", nkv);
  check_dims(op, "qkv", qkv, {T, (nh + 2 * nkv) * D});
  check_dims(op, "pos", pos, {1});
  check_dims(op, "page_table", page_table, {-1});
  const int64_t table_len = page_table.size(0);
  NQ_CHECK(table_len >= 1, op, ": page_table is empty");
  check_dims(op, "cos", cos, {-1, D / 2});
  check_dims(op, "sin", sin, {cos.size(0), D / 2});
  NQ_CHECK(cos.size(0) >= table_len * nanoqwen::kPageSize, op, ": the RoPE tables have ",
              cos.size(0), " rows but the page table covers ", table_len * nanoqwen::kPageSize,
              " positions");
  for (const Tensor* t : Ts{&k_cache, &v_cache, &qkv, &cos, &sin, &pos, &page_table})
    same_device(op, q_out, *t, "an input");
  const c10::cuda::CUDAGuard g(q_out.device());
  check_launch(op, nanoqwen::rope_kv_write(hp(q_out), hp(k_cache), hp(v_cache), chp(qkv),
                                           cos.data_ptr<float>(), sin.data_ptr<float>(),
                                           pos.data_ptr<int32_t>(),
                                           page_table.data_ptr<int32_t>(), (int)table_len,
                                           (int)T, (int)nh, (int)nkv, (int)D, stream_of(q_out)));
}

void paged_attention(Tensor& out, Tensor& ws_acc, Tensor& ws_ml, const Tensor& q,
                     const Tensor& k_cache, const Tensor& v_cache, const Tensor& page_table,
                     const Tensor& pos) {
  const char* op = "paged_attention";
  check_arg(op, "out", out, at::kHalf);
  check_arg(op, "ws_acc", ws_acc, at::kFloat);
  check_arg(op, "ws_ml", ws_ml, at::kFloat);
  check_arg(op, "q", q, at::kHalf);
  check_cache(op, k_cache, v_cache);
  check_arg(op, "page_table", page_table, at::kInt);
  check_arg(op, "pos", pos, at::kInt);
  check_dims(op, "q", q, {-1, k_cache.size(3)});
  const int64_t nh = q.size(0), D = q.size(1), nkv = k_cache.size(2);
  NQ_CHECK(nh % nkv == 0 && nh / nkv <= nanoqwen::kMaxGqa, op, ": n_heads=", nh,
              " / n_kv_heads=", nkv, " must be a whole GQA ratio of at most ", nanoqwen::kMaxGqa);
  check_dims(op, "out", out, {nh, D});
  check_dims(op, "ws_acc", ws_acc, {nh, -1, D});
  const int64_t S = ws_acc.size(1);
  NQ_CHECK(S >= 1, op, ": ws_acc has no split slots");
  check_dims(op, "ws_ml", ws_ml, {nh, S, 2});
  check_dims(op, "page_table", page_table, {-1});
  NQ_CHECK(page_table.size(0) >= 1, op, ": page_table is empty");
  check_dims(op, "pos", pos, {1});
  for (const Tensor* t : Ts{&ws_acc, &ws_ml, &q, &k_cache, &v_cache, &page_table, &pos})
    same_device(op, out, *t, "an input");
  const c10::cuda::CUDAGuard g(out.device());
  check_launch(op, nanoqwen::paged_attention(
                       hp(out), ws_acc.data_ptr<float>(), ws_ml.data_ptr<float>(), chp(q),
                       chp(k_cache), chp(v_cache), page_table.data_ptr<int32_t>(),
                       (int)page_table.size(0), pos.data_ptr<int32_t>(), (int)nh, (int)nkv,
                       (int)D, (int)S, (float)(1.0 / std::sqrt((double)D)), stream_of(out)));
}

void attention_decode(Tensor& out, Tensor& ws_acc, Tensor& ws_ml, Tensor& counters,
                      const Tensor& qkv, Tensor& k_cache, Tensor& v_cache, const Tensor& cos,
                      const Tensor& sin, const Tensor& page_table, const Tensor& pos,
                      int64_t min_pps) {
  const char* op = "attention_decode";
  NQ_CHECK(min_pps >= 0 && min_pps <= nanoqwen::kDecMinPpsMax, op, ": min_pps=", min_pps,
           " must be 0 (the default, ", nanoqwen::kDecMinPpsDefault,
           " KV pages per split) or 1 to ", nanoqwen::kDecMinPpsMax);
  check_arg(op, "out", out, at::kHalf);
  check_arg(op, "ws_acc", ws_acc, at::kFloat);
  check_arg(op, "ws_ml", ws_ml, at::kFloat);
  check_arg(op, "counters", counters, at::kInt);
  check_arg(op, "qkv", qkv, at::kHalf);
  check_cache(op, k_cache, v_cache);
  check_arg(op, "cos", cos, at::kFloat);
  check_arg(op, "sin", sin, at::kFloat);
  check_arg(op, "page_table", page_table, at::kInt);
  check_arg(op, "pos", pos, at::kInt);
  const int64_t D = k_cache.size(3), nkv = k_cache.size(2);
  check_dims(op, "out", out, {-1, D});
  const int64_t nh = out.size(0);
  NQ_CHECK(nh % nkv == 0 && nh / nkv <= nanoqwen::kMaxGqa, op, ": n_heads=", nh,
              " / n_kv_heads=", nkv, " must be a whole GQA ratio of at most ", nanoqwen::kMaxGqa);
  NQ_CHECK(qkv.numel() == (nh + 2 * nkv) * D, op, ": qkv has ", qkv.numel(),
              " elements, expected (n_heads + 2 n_kv) * head_dim = ", (nh + 2 * nkv) * D);
  check_dims(op, "ws_acc", ws_acc, {nh, -1, D});
  const int64_t S = ws_acc.size(1);
  NQ_CHECK(S >= 1, op, ": ws_acc has no split slots");
  check_dims(op, "ws_ml", ws_ml, {nh, S, 2});
  check_dims(op, "counters", counters, {nkv});
  check_dims(op, "page_table", page_table, {-1});
  const int64_t table_len = page_table.size(0);
  NQ_CHECK(table_len >= 1, op, ": page_table is empty");
  check_dims(op, "pos", pos, {1});
  check_dims(op, "cos", cos, {-1, D / 2});
  check_dims(op, "sin", sin, {cos.size(0), D / 2});
  NQ_CHECK(cos.size(0) >= table_len * nanoqwen::kPageSize, op, ": the RoPE tables have ",
              cos.size(0), " rows but the page table covers ", table_len * nanoqwen::kPageSize,
              " positions");
  for (const Tensor* t : Ts{&ws_acc, &ws_ml, &counters, &qkv, &k_cache, &v_cache, &cos, &sin,
                            &page_table, &pos})
    same_device(op, out, *t, "an input");
  const c10::cuda::CUDAGuard g(out.device());
  check_launch(op, nanoqwen::attention_decode(
                       hp(out), ws_acc.data_ptr<float>(), ws_ml.data_ptr<float>(),
                       counters.data_ptr<int32_t>(), chp(qkv), hp(k_cache), hp(v_cache),
                       cos.data_ptr<float>(), sin.data_ptr<float>(),
                       page_table.data_ptr<int32_t>(), (int)table_len, pos.data_ptr<int32_t>(),
                       (int)nh, (int)nkv, (int)D, (int)S, (int)min_pps,
                       (float)(1.0 / std::sqrt((double)D)), stream_of(out)));
}

// ---- sampling / advance ---------------------------------------------------------------------

void sample_token(Tensor& out_token, Tensor& work, const Tensor& logits, const Tensor& ctx_tokens,
                  const Tensor& pos, const Tensor& params_f, const Tensor& params_i,
                  const Tensor& counter) {
  const char* op = "sample_token";
  check_arg(op, "out_token", out_token, at::kInt);
  check_arg(op, "work", work, at::kFloat);
  check_arg(op, "logits", logits, at::kFloat);
  check_arg(op, "ctx_tokens", ctx_tokens, at::kInt);
  check_arg(op, "pos", pos, at::kInt);
  check_arg(op, "params_f", params_f, at::kFloat);
  check_arg(op, "params_i", params_i, at::kLong);
  check_arg(op, "counter", counter, at::kLong);
  check_dims(op, "logits", logits, {-1});
  const int64_t V = logits.size(0);
  check_dims(op, "out_token", out_token, {1});
  check_dims(op, "work", work, {V});
  check_dims(op, "ctx_tokens", ctx_tokens, {-1});
  NQ_CHECK(ctx_tokens.size(0) >= 1, op, ": ctx_tokens is empty");
  check_dims(op, "pos", pos, {1});
  check_dims(op, "params_f", params_f, {4});
  check_dims(op, "params_i", params_i, {4});
  check_dims(op, "counter", counter, {1});
  for (const Tensor* t : Ts{&work, &logits, &ctx_tokens, &pos, &params_f, &params_i, &counter})
    same_device(op, out_token, *t, "an input");
  const c10::cuda::CUDAGuard g(out_token.device());
  check_launch(op, nanoqwen::sample_token(out_token.data_ptr<int32_t>(), work.data_ptr<float>(),
                                          logits.data_ptr<float>(), (int)V,
                                          ctx_tokens.data_ptr<int32_t>(),
                                          (int)ctx_tokens.size(0), pos.data_ptr<int32_t>(),
                                          params_f.data_ptr<float>(),
                                          params_i.data_ptr<int64_t>(),
                                          counter.data_ptr<int64_t>(), stream_of(out_token)));
}

void advance_step(Tensor& token_in, Tensor& pos, Tensor& ctx_tokens, Tensor& counter,
                  Tensor& host_ring, const Tensor& sampled) {
  const char* op = "advance_step";
  check_arg(op, "token_in", token_in, at::kInt);
  check_arg(op, "pos", pos, at::kInt);
  check_arg(op, "ctx_tokens", ctx_tokens, at::kInt);
  check_arg(op, "counter", counter, at::kLong);
  check_arg(op, "sampled", sampled, at::kInt);
  NQ_CHECK(host_ring.device().is_cpu() && host_ring.is_pinned(), op,
              ": host_ring must be a pinned CPU tensor (the kernel writes it directly)");
  NQ_CHECK(host_ring.scalar_type() == at::kInt && host_ring.is_contiguous() &&
                  host_ring.dim() == 1 && host_ring.size(0) >= 1,
              op, ": host_ring must be a contiguous int32 [R >= 1], got ",
              at::toString(host_ring.scalar_type()), " ", shape_str(host_ring));
  for (const Tensor* t : Ts{&token_in, &pos, &counter, &sampled}) check_dims(op, "a scalar", *t, {1});
  check_dims(op, "ctx_tokens", ctx_tokens, {-1});
  for (const Tensor* t : Ts{&pos, &ctx_tokens, &counter, &sampled})
    same_device(op, token_in, *t, "an input");
  const c10::cuda::CUDAGuard g(token_in.device());
  // Pinned host memory is mapped into the device's address space (unified addressing); ask
  // for the device alias explicitly in case the allocator registered it differently.
  void* ring = host_ring.data_ptr();
  void* dev_ring = nullptr;
  if (cudaHostGetDevicePointer(&dev_ring, ring, 0) != cudaSuccess) {
    (void)cudaGetLastError();  // not fatal: with UVA the host pointer is the device pointer
    dev_ring = ring;
  }
  check_launch(op, nanoqwen::advance_step(token_in.data_ptr<int32_t>(), pos.data_ptr<int32_t>(),
                                          ctx_tokens.data_ptr<int32_t>(),
                                          (int)ctx_tokens.size(0), counter.data_ptr<int64_t>(),
                                          static_cast<int32_t*>(dev_ring),
                                          (int)host_ring.size(0), sampled.data_ptr<int32_t>(),
                                          stream_of(token_in)));
}

// ---- GEMVs (csrc/gemv.h, the GEMV engineer's launchers) ---------------------------------------

// One INT4 g128 matrix (quant.py's layout): qweight int32 [n, k/8] (8 nibbles a word), scales
// fp16 [n, k/128]. Sets n and k (k = 8 * qweight's columns, a multiple of the group 128).
void check_qweight(const char* op, const Tensor& qweight, const Tensor& scales, int64_t* n_out,
                   int64_t* k_out, const char* qname = "qweight", const char* sname = "scales") {
  check_arg(op, qname, qweight, at::kInt);
  check_arg(op, sname, scales, at::kHalf);
  check_dims(op, qname, qweight, {-1, -1});
  const int64_t n = qweight.size(0), k = qweight.size(1) * 8;
  NQ_CHECK(k % 128 == 0, op, ": k=", k, " is not a multiple of group 128");
  check_dims(op, sname, scales, {n, k / 128});
  *n_out = n;
  *k_out = k;
}

// an INT4 matrix and the fp16 x [k] it multiplies
void check_int4(const char* op, const Tensor& x, const Tensor& qweight, const Tensor& scales,
                int64_t* n_out, int64_t* k_out, const char* qname = "qweight",
                const char* sname = "scales") {
  check_arg(op, "x", x, at::kHalf);
  check_qweight(op, qweight, scales, n_out, k_out, qname, sname);
  NQ_CHECK(x.numel() == *k_out, op, ": x has ", x.numel(), " elements, expected k=", *k_out);
}

// The optional bias of y = W x + bias: fp16 with n elements on y's device; nullptr when absent.
const half* opt_bias(const char* op, const c10::optional<Tensor>& bias, const Tensor& y,
                     int64_t n) {
  if (!bias.has_value()) return nullptr;
  check_arg(op, "bias", *bias, at::kHalf);
  NQ_CHECK(bias->numel() == n, op, ": bias has ", bias->numel(), " elements, expected n=", n);
  same_device(op, y, *bias, "bias");
  return chp(*bias);
}

const uint32_t* qw(const Tensor& t) { return reinterpret_cast<const uint32_t*>(t.data_ptr()); }

void gemv_int4(Tensor& y, const Tensor& x, const Tensor& qweight, const Tensor& scales,
               const c10::optional<Tensor>& bias) {
  const char* op = "gemv_int4";
  int64_t n, k;
  check_int4(op, x, qweight, scales, &n, &k);
  check_arg(op, "y", y, at::kHalf);
  NQ_CHECK(y.numel() == n, op, ": y has ", y.numel(), " elements, expected n=", n);
  const half* b = opt_bias(op, bias, y, n);
  for (const Tensor* t : Ts{&x, &qweight, &scales}) same_device(op, y, *t, "an input");
  const c10::cuda::CUDAGuard g(y.device());
  check_launch(op, ::gemv_int4(hp(y), chp(x), qw(qweight), chp(scales), b, (int)n, (int)k,
                               stream_of(y)), true);
}

void gemv_int4_residual(Tensor& hidden, const Tensor& x, const Tensor& qweight,
                        const Tensor& scales) {
  const char* op = "gemv_int4_residual";
  int64_t n, k;
  check_int4(op, x, qweight, scales, &n, &k);
  check_arg(op, "hidden", hidden, at::kFloat);
  NQ_CHECK(hidden.numel() == n, op, ": hidden has ", hidden.numel(), " elements, expected n=", n);
  for (const Tensor* t : Ts{&x, &qweight, &scales}) same_device(op, hidden, *t, "an input");
  const c10::cuda::CUDAGuard g(hidden.device());
  check_launch(op, ::gemv_int4_residual(hidden.data_ptr<float>(), chp(x), qw(qweight),
                                        chp(scales), (int)n, (int)k, stream_of(hidden)), true);
}

void gemv_int4_silu_mul(Tensor& out, const Tensor& x, const Tensor& qw_gate, const Tensor& sc_gate,
                        const Tensor& qw_up, const Tensor& sc_up) {
  const char* op = "gemv_int4_silu_mul";
  int64_t n, k, n2, k2;
  check_int4(op, x, qw_gate, sc_gate, &n, &k, "qw_gate", "sc_gate");
  check_int4(op, x, qw_up, sc_up, &n2, &k2, "qw_up", "sc_up");
  NQ_CHECK(n == n2, op, ": gate has n=", n, " rows but up has ", n2);
  check_arg(op, "out", out, at::kHalf);
  NQ_CHECK(out.numel() == n, op, ": out has ", out.numel(), " elements, expected n=", n);
  for (const Tensor* t : Ts{&x, &qw_gate, &sc_gate, &qw_up, &sc_up}) same_device(op, out, *t, "an input");
  const c10::cuda::CUDAGuard g(out.device());
  check_launch(op, ::gemv_int4_silu_mul(hp(out), chp(x), qw(qw_gate), chp(sc_gate), qw(qw_up),
                                        chp(sc_up), (int)n, (int)k, stream_of(out)), true);
}

void gemv_fp16(Tensor& logits, const Tensor& x, const Tensor& w) {
  const char* op = "gemv_fp16";
  check_arg(op, "logits", logits, at::kFloat);
  check_arg(op, "x", x, at::kHalf);
  check_arg(op, "w", w, at::kHalf);
  check_dims(op, "w", w, {-1, -1});
  const int64_t n = w.size(0), k = w.size(1);
  NQ_CHECK(x.numel() == k, op, ": x has ", x.numel(), " elements, expected k=", k);
  NQ_CHECK(logits.numel() == n, op, ": logits has ", logits.numel(), " elements, expected n=", n);
  same_device(op, logits, x, "x");
  same_device(op, logits, w, "w");
  const c10::cuda::CUDAGuard g(logits.device());
  check_launch(op, ::gemv_fp16(logits.data_ptr<float>(), chp(x), chp(w), (int)n, (int)k,
                               stream_of(logits)), true);
}

// ---- GEMVs with the RMSNorm fused into their prologue (x = norm(hidden) never leaves the SM) --

void check_norm(const char* op, const Tensor& hidden, const Tensor& norm_w, double eps, int64_t k) {
  check_arg(op, "hidden", hidden, at::kFloat);
  check_arg(op, "norm_w", norm_w, at::kHalf);
  NQ_CHECK(hidden.numel() == k, op, ": hidden has ", hidden.numel(), " elements, expected k=", k);
  check_dims(op, "norm_w", norm_w, {k});
  NQ_CHECK(eps > 0, op, ": eps=", eps, " must be > 0");
}

void gemv_int4_norm(Tensor& y, const Tensor& hidden, const Tensor& norm_w, double eps,
                    const Tensor& qweight, const Tensor& scales, const c10::optional<Tensor>& bias) {
  const char* op = "gemv_int4_norm";
  int64_t n, k;
  check_qweight(op, qweight, scales, &n, &k);
  check_norm(op, hidden, norm_w, eps, k);
  check_arg(op, "y", y, at::kHalf);
  NQ_CHECK(y.numel() == n, op, ": y has ", y.numel(), " elements, expected n=", n);
  const half* b = opt_bias(op, bias, y, n);
  for (const Tensor* t : Ts{&hidden, &norm_w, &qweight, &scales}) same_device(op, y, *t, "an input");
  const c10::cuda::CUDAGuard g(y.device());
  check_launch(op, ::gemv_int4_norm(hp(y), hidden.data_ptr<float>(), chp(norm_w), (float)eps,
                                    qw(qweight), chp(scales), b, (int)n, (int)k, stream_of(y)),
               true);
}

void gemv_int4_silu_mul_norm(Tensor& out, const Tensor& hidden, const Tensor& norm_w, double eps,
                             const Tensor& qw_gate, const Tensor& sc_gate, const Tensor& qw_up,
                             const Tensor& sc_up) {
  const char* op = "gemv_int4_silu_mul_norm";
  int64_t n, k, n2, k2;
  check_qweight(op, qw_gate, sc_gate, &n, &k, "qw_gate", "sc_gate");
  check_dims(op, "qw_up", qw_up, {n, k / 8});  // the up matrix has the gate matrix's shape
  check_qweight(op, qw_up, sc_up, &n2, &k2, "qw_up", "sc_up");
  check_norm(op, hidden, norm_w, eps, k);
  check_arg(op, "out", out, at::kHalf);
  NQ_CHECK(out.numel() == n, op, ": out has ", out.numel(), " elements, expected n=", n);
  for (const Tensor* t : Ts{&hidden, &norm_w, &qw_gate, &sc_gate, &qw_up, &sc_up})
    same_device(op, out, *t, "an input");
  const c10::cuda::CUDAGuard g(out.device());
  check_launch(op, ::gemv_int4_silu_mul_norm(hp(out), hidden.data_ptr<float>(), chp(norm_w),
                                             (float)eps, qw(qw_gate), chp(sc_gate), qw(qw_up),
                                             chp(sc_up), (int)n, (int)k, stream_of(out)),
               true);
}

void gemv_fp16_norm(Tensor& logits, const Tensor& hidden, const Tensor& norm_w, double eps,
                    const Tensor& w) {
  const char* op = "gemv_fp16_norm";
  check_arg(op, "logits", logits, at::kFloat);
  check_arg(op, "w", w, at::kHalf);
  check_dims(op, "w", w, {-1, -1});
  const int64_t n = w.size(0), k = w.size(1);
  check_norm(op, hidden, norm_w, eps, k);
  NQ_CHECK(logits.numel() == n, op, ": logits has ", logits.numel(), " elements, expected n=", n);
  for (const Tensor* t : Ts{&hidden, &norm_w, &w}) same_device(op, logits, *t, "an input");
  const c10::cuda::CUDAGuard g(logits.device());
  check_launch(op, ::gemv_fp16_norm(logits.data_ptr<float>(), hidden.data_ptr<float>(),
                                    chp(norm_w), (float)eps, chp(w), (int)n, (int)k,
                                    stream_of(logits)), true);
}

void dequant_int4(Tensor& w, const Tensor& qweight, const Tensor& scales) {
  const char* op = "dequant_int4";
  check_arg(op, "w", w, at::kHalf);
  int64_t n, k;
  check_qweight(op, qweight, scales, &n, &k);
  check_dims(op, "w", w, {n, k});
  same_device(op, w, qweight, "qweight");
  same_device(op, w, scales, "scales");
  const c10::cuda::CUDAGuard g(w.device());
  check_launch(op, ::dequant_int4(hp(w), qw(qweight), chp(scales), (int)n, (int)k,
                                  stream_of(w)), true);
}

}  // namespace nanoqwen_ops

TORCH_LIBRARY(nanoqwen, m) {
  // token ids -> fp32 residual rows (decode: T=1 reading the id the last step sampled)
  m.def("embed_gather(Tensor! hidden, Tensor table, Tensor ids) -> ()");
  // fp32 residual rows -> fp16 normed rows (input/post-attention/final norm)
  m.def("rmsnorm(Tensor! out, Tensor hidden, Tensor weight, float eps) -> ()");
  // RoPE on q,k of qkv rows at positions pos.. + write k,v into the layer's 16-token pages
  m.def("rope_kv_write(Tensor! q_out, Tensor! k_cache, Tensor! v_cache, Tensor qkv, Tensor cos, "
        "Tensor sin, Tensor pos, Tensor page_table) -> ()");
  // split-K paged GQA decode attention of the token at pos over positions 0..pos
  m.def("paged_attention(Tensor! out, Tensor! ws_acc, Tensor! ws_ml, Tensor q, Tensor k_cache, "
        "Tensor v_cache, Tensor page_table, Tensor pos) -> ()");
  // penalty/greedy/top-k/top-p/min-p/temperature sampling with params in device memory
  m.def("sample_token(Tensor! out_token, Tensor! work, Tensor logits, Tensor ctx_tokens, "
        "Tensor pos, Tensor params_f, Tensor params_i, Tensor counter) -> ()");
  // end of step: sampled id -> next input, pos += 1, context ids, pinned host ring, counter += 1
  m.def("advance_step(Tensor! token_in, Tensor! pos, Tensor! ctx_tokens, Tensor! counter, "
        "Tensor! host_ring, Tensor sampled) -> ()");
  // INT4 g128 GEMV y = W x + bias (the fused q/k/v projection)
  m.def("gemv_int4(Tensor! y, Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> ()");
  // INT4 GEMV accumulated into the fp32 residual (o_proj, down_proj)
  m.def("gemv_int4_residual(Tensor! hidden, Tensor x, Tensor qweight, Tensor scales) -> ()");
  // fused gate/up INT4 GEMV with silu(gate) * up
  m.def("gemv_int4_silu_mul(Tensor! out, Tensor x, Tensor qw_gate, Tensor sc_gate, Tensor qw_up, "
        "Tensor sc_up) -> ()");
  // fp16 lm_head GEMV to fp32 logits
  m.def("gemv_fp16(Tensor! logits, Tensor x, Tensor w) -> ()");
  // RoPE + K/V write + split-K paged attention + split merge for one decode token, one launch
  // (min_pps: minimum KV pages per split, 0 = kDecMinPpsDefault; the engine passes its switch)
  m.def("attention_decode(Tensor! out, Tensor! ws_acc, Tensor! ws_ml, Tensor! counters, "
        "Tensor qkv, Tensor! k_cache, Tensor! v_cache, Tensor cos, Tensor sin, "
        "Tensor page_table, Tensor pos, int min_pps=0) -> ()");
  // the GEMVs above with x = rmsnorm(hidden) * norm_w computed in their prologue
  m.def("gemv_int4_norm(Tensor! y, Tensor hidden, Tensor norm_w, float eps, Tensor qweight, "
        "Tensor scales, Tensor? bias) -> ()");
  m.def("gemv_int4_silu_mul_norm(Tensor! out, Tensor hidden, Tensor norm_w, float eps, "
        "Tensor qw_gate, Tensor sc_gate, Tensor qw_up, Tensor sc_up) -> ()");
  m.def("gemv_fp16_norm(Tensor! logits, Tensor hidden, Tensor norm_w, float eps, Tensor w) -> ()");
  // INT4 -> fp16 weight (prefill feeds cuBLAS with it)
  m.def("dequant_int4(Tensor! w, Tensor qweight, Tensor scales) -> ()");
}

TORCH_LIBRARY_IMPL(nanoqwen, CUDA, m) {
  m.impl("embed_gather", &nanoqwen_ops::embed_gather);
  m.impl("rmsnorm", &nanoqwen_ops::rmsnorm);
  m.impl("rope_kv_write", &nanoqwen_ops::rope_kv_write);
  m.impl("paged_attention", &nanoqwen_ops::paged_attention);
  m.impl("sample_token", &nanoqwen_ops::sample_token);
  m.impl("advance_step", &nanoqwen_ops::advance_step);
  m.impl("gemv_int4", &nanoqwen_ops::gemv_int4);
  m.impl("gemv_int4_residual", &nanoqwen_ops::gemv_int4_residual);
  m.impl("gemv_int4_silu_mul", &nanoqwen_ops::gemv_int4_silu_mul);
  m.impl("gemv_fp16", &nanoqwen_ops::gemv_fp16);
  m.impl("dequant_int4", &nanoqwen_ops::dequant_int4);
  m.impl("attention_decode", &nanoqwen_ops::attention_decode);
  m.impl("gemv_int4_norm", &nanoqwen_ops::gemv_int4_norm);
  m.impl("gemv_int4_silu_mul_norm", &nanoqwen_ops::gemv_int4_silu_mul_norm);
  m.impl("gemv_fp16_norm", &nanoqwen_ops::gemv_fp16_norm);
}
