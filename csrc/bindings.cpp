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
#include <Python.h>  // only to release the GIL around the engine core's waits (class Engine)

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>
#include <type_traits>

#include "engine.h"
#include "gemv.h"
#include "kernels.h"

namespace nanoqwen_ops {

// Scoped: SDPA calls in this scope do not pick the cuDNN backend (Engine::attention says why).
struct NoCudnnSdp {
  bool was = at::globalContext().userEnabledCuDNNSDP();
  NoCudnnSdp() { at::globalContext().setSDPUseCuDNN(false); }
  ~NoCudnnSdp() { at::globalContext().setSDPUseCuDNN(was); }
  NoCudnnSdp(const NoCudnnSdp&) = delete;
  NoCudnnSdp& operator=(const NoCudnnSdp&) = delete;
};

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
                const std::vector<int64_t>& dims) {
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

// A failed launcher has recorded what was wrong, with the numbers (kernels.h's convention, every
// csrc/ function): the exception carries it. Taken, so a later failure cannot show it again.
void check_launch(const char* op, cudaError_t err) {
  if (err == cudaSuccess) return;
  const std::string m = nanoqwen::take_last_error();
  fail("nanoqwen::", op, " failed: ", cudaGetErrorString(err), m.empty() ? "" : " (" + m + ")");
}

cudaStream_t stream_of(const Tensor& t) {
  return at::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

half* hp(const Tensor& t) { return reinterpret_cast<half*>(t.data_ptr()); }
const half* chp(const Tensor& t) { return reinterpret_cast<const half*>(t.data_ptr()); }

// ---- embedding / norm ------------------------------------------------------------------------

void embed_gather(Tensor& hidden, const Tensor& table, const Tensor& ids,
                  const c10::optional<Tensor>& parts) {
  const char* op = "embed_gather";
  check_arg(op, "hidden", hidden, at::kFloat);
  check_arg(op, "table", table, at::kHalf);
  check_arg(op, "ids", ids, at::kInt);
  check_dims(op, "table", table, {-1, -1});
  check_dims(op, "ids", ids, {-1});
  const int64_t T = ids.size(0), H = table.size(1);
  check_dims(op, "hidden", hidden, {T, H});
  NQ_CHECK(H % 16 == 0, op, ": hidden size ", H, " is not a multiple of 16");
  same_device(op, hidden, table, "table");
  same_device(op, hidden, ids, "ids");
  float* pp = nullptr;
  if (parts.has_value()) {  // the folded norm's sum-of-squares parts, [T, H/16]
    check_arg(op, "parts", *parts, at::kFloat);
    check_dims(op, "parts", *parts, {T, H / 16});
    same_device(op, hidden, *parts, "parts");
    pp = parts->data_ptr<float>();
  }
  const c10::cuda::CUDAGuard g(hidden.device());
  check_launch(op, nanoqwen::embed_gather(hidden.data_ptr<float>(), chp(table),
                                          ids.data_ptr<int32_t>(), (int)T, (int)H,
                                          (int)table.size(0), stream_of(hidden), pp));
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
  NQ_CHECK(H % 16 == 0 && H <= 8192, op, ": hidden size ", H,
              " must be a multiple of 16 and at most 8192");
  NQ_CHECK(eps > 0, op, ": eps=", eps, " must be > 0");
  same_device(op, out, hidden, "hidden");
  same_device(op, out, weight, "weight");
  const c10::cuda::CUDAGuard g(out.device());
  check_launch(op, nanoqwen::rmsnorm(hp(out), hidden.data_ptr<float>(), chp(weight), (int)T,
                                     (int)H, (float)eps, stream_of(out)));
}

// The fp16 prefill's SiLU*mul: out [T, I] from gu [T, 2I] (gate columns, then up columns).
void silu_mul(Tensor& out, const Tensor& gu) {
  const char* op = "silu_mul";
  check_arg(op, "out", out, at::kHalf);
  check_arg(op, "gu", gu, at::kHalf);
  check_dims(op, "gu", gu, {-1, -1});
  const int64_t T = gu.size(0), I2 = gu.size(1);
  NQ_CHECK(I2 % 16 == 0, op, ": gu has ", I2, " columns; it must be 2I with I a multiple of 8");
  check_dims(op, "out", out, {T, I2 / 2});
  same_device(op, out, gu, "gu");
  const c10::cuda::CUDAGuard g(out.device());
  check_launch(op, nanoqwen::silu_mul(hp(out), chp(gu), (int)T, (int)(I2 / 2), stream_of(out)));
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

// The prefill's paged causal attention of q [T, n_heads, head_dim] at positions q0.. (the
// engine's prefill launches the kernel itself; this op is its tests'). The page ids in
// page_table[0 .. ceil((q0 + T) / 16)) must name pages of the caches, as the engine's do.
void attention_prefill(Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& page_table, int64_t q0) {
  const char* op = "attention_prefill";
  check_arg(op, "out", out, at::kHalf);
  check_arg(op, "q", q, at::kHalf);
  check_cache(op, k_cache, v_cache);
  check_arg(op, "page_table", page_table, at::kInt);
  const int64_t D = k_cache.size(3), nkv = k_cache.size(2);
  check_dims(op, "q", q, {-1, -1, D});
  const int64_t T = q.size(0), nh = q.size(1);
  NQ_CHECK(T >= 1 && nh >= nkv && nh % nkv == 0, op, ": q has ", T, " rows of ", nh,
           " heads; at least one row, and a whole multiple of the cache's ", nkv,
           " kv heads, are required");
  check_dims(op, "out", out, {T, nh * D});
  check_dims(op, "page_table", page_table, {-1});
  NQ_CHECK(q0 >= 0 && q0 + T <= page_table.size(0) * nanoqwen::kPageSize, op, ": positions ", q0,
           "..", q0 + T - 1, " are not covered by the page table's ", page_table.size(0),
           " pages");
  NQ_CHECK(q0 + T <= INT32_MAX, op, ": q0 + T=", q0 + T, " beyond int32");
  for (const Tensor* t : Ts{&q, &k_cache, &v_cache, &page_table})
    same_device(op, out, *t, "an input");
  const c10::cuda::CUDAGuard g(out.device());
  check_launch(op, nanoqwen::attention_prefill(hp(out), chp(q), chp(k_cache), chp(v_cache),
                                               page_table.data_ptr<int32_t>(), (int)q0, (int)T,
                                               (int)nh, (int)nkv, (int)D, stream_of(out)));
}

// attention_decode (verify false: one query, out [n_heads, D], ws_acc [n_heads, S, D], ws_ml
// [n_heads, S, 2], counters [n_kv], qkv [(n_heads + 2 n_kv) D]) and attention_verify (T queries:
// qkv [T, (n_heads + 2 n_kv) D], out [T, n_heads, D], ws_acc [T, n_heads, S, D], ws_ml
// [T, n_heads, S, 2], counters [T, n_kv]); the rest alike.
static void attention_op(const char* op, bool verify, Tensor& out, Tensor& ws_acc, Tensor& ws_ml,
                         Tensor& counters, const Tensor& qkv, Tensor& k_cache, Tensor& v_cache,
                         const Tensor& cos, const Tensor& sin, const Tensor& page_table,
                         const Tensor& pos, int64_t min_pps, int64_t kernel) {
  NQ_CHECK(min_pps >= 0 && min_pps <= nanoqwen::kDecMinPpsMax, op, ": min_pps=", min_pps,
           " must be 0 (the default, ", nanoqwen::kDecMinPpsDefault,
           " KV pages per split) or 1 to ", nanoqwen::kDecMinPpsMax);
  NQ_CHECK(kernel == nanoqwen::kAttnCpAsync || kernel == nanoqwen::kAttnTma, op, ": kernel=",
           kernel, " must be ", nanoqwen::kAttnCpAsync, " (cp.async split-K) or ",
           nanoqwen::kAttnTma, " (TMA, warp-specialized, tensor cores)");
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
  int64_t T = 1, nh, S;
  if (verify) {
    check_dims(op, "out", out, {-1, -1, D});
    T = out.size(0);
    nh = out.size(1);
    NQ_CHECK(T >= 1 && T <= nanoqwen::kMaxVerifyQueries, op, ": out has ", T,
             " query rows, expected 1..", nanoqwen::kMaxVerifyQueries);
  } else {
    check_dims(op, "out", out, {-1, D});
    nh = out.size(0);
  }
  NQ_CHECK(nh % nkv == 0 && nh / nkv <= nanoqwen::kMaxGqa, op, ": n_heads=", nh,
              " / n_kv_heads=", nkv, " must be a whole GQA ratio of at most ", nanoqwen::kMaxGqa);
  if (verify) {
    check_dims(op, "qkv", qkv, {T, (nh + 2 * nkv) * D});
    check_dims(op, "ws_acc", ws_acc, {T, nh, -1, D});
    S = ws_acc.size(2);
    NQ_CHECK(S >= 1, op, ": ws_acc has no split slots");
    check_dims(op, "ws_ml", ws_ml, {T, nh, S, 2});
    check_dims(op, "counters", counters, {T, nkv});
  } else {
    NQ_CHECK(qkv.numel() == (nh + 2 * nkv) * D, op, ": qkv has ", qkv.numel(),
                " elements, expected (n_heads + 2 n_kv) * head_dim = ", (nh + 2 * nkv) * D);
    check_dims(op, "ws_acc", ws_acc, {nh, -1, D});
    S = ws_acc.size(1);
    NQ_CHECK(S >= 1, op, ": ws_acc has no split slots");
    check_dims(op, "ws_ml", ws_ml, {nh, S, 2});
    check_dims(op, "counters", counters, {nkv});
  }
  check_dims(op, "page_table", page_table, {-1});
  const int64_t table_len = page_table.size(0);
  NQ_CHECK(table_len >= 1, op, ": page_table is empty");
  // the TMA kernel reads the caches through tensor maps over table_len pages (kernels.h)
  NQ_CHECK(kernel != nanoqwen::kAttnTma || k_cache.size(0) == table_len, op, ": kernel=",
           kernel, " (TMA) needs a cache of exactly page_table's ", table_len, " pages, got ",
           k_cache.size(0));
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
  const float scale = (float)(1.0 / std::sqrt((double)D));
  if (verify)
    check_launch(op, nanoqwen::attention_verify(
                         hp(out), ws_acc.data_ptr<float>(), ws_ml.data_ptr<float>(),
                         counters.data_ptr<int32_t>(), chp(qkv), hp(k_cache), hp(v_cache),
                         cos.data_ptr<float>(), sin.data_ptr<float>(),
                         page_table.data_ptr<int32_t>(), (int)table_len,
                         pos.data_ptr<int32_t>(), (int)T, (int)nh, (int)nkv, (int)D, (int)S,
                         (int)min_pps, (int)kernel, scale, stream_of(out)));
  else
    check_launch(op, nanoqwen::attention_decode(
                         hp(out), ws_acc.data_ptr<float>(), ws_ml.data_ptr<float>(),
                         counters.data_ptr<int32_t>(), chp(qkv), hp(k_cache), hp(v_cache),
                         cos.data_ptr<float>(), sin.data_ptr<float>(),
                         page_table.data_ptr<int32_t>(), (int)table_len,
                         pos.data_ptr<int32_t>(), (int)nh, (int)nkv, (int)D, (int)S,
                         (int)min_pps, (int)kernel, scale, stream_of(out)));
}

void attention_decode(Tensor& out, Tensor& ws_acc, Tensor& ws_ml, Tensor& counters,
                      const Tensor& qkv, Tensor& k_cache, Tensor& v_cache, const Tensor& cos,
                      const Tensor& sin, const Tensor& page_table, const Tensor& pos,
                      int64_t min_pps, int64_t kernel) {
  attention_op("attention_decode", false, out, ws_acc, ws_ml, counters, qkv, k_cache, v_cache,
               cos, sin, page_table, pos, min_pps, kernel);
}

// The verify step's attention (kernels.h attention_verify), for tests: T queries at pos..
void attention_verify(Tensor& out, Tensor& ws_acc, Tensor& ws_ml, Tensor& counters,
                      const Tensor& qkv, Tensor& k_cache, Tensor& v_cache, const Tensor& cos,
                      const Tensor& sin, const Tensor& page_table, const Tensor& pos,
                      int64_t min_pps, int64_t kernel) {
  attention_op("attention_verify", true, out, ws_acc, ws_ml, counters, qkv, k_cache, v_cache,
               cos, sin, page_table, pos, min_pps, kernel);
}

// ---- sampling / advance ---------------------------------------------------------------------

void sample_token(Tensor& out_token, Tensor& work, const Tensor& logits, const Tensor& ctx_tokens,
                  const Tensor& pos, const Tensor& params_f, const Tensor& params_i,
                  const Tensor& counter, const c10::optional<Tensor>& path, int64_t blocks) {
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
  int32_t* path_ptr = nullptr;
  if (path.has_value()) {
    check_arg(op, "path", *path, at::kInt);
    check_dims(op, "path", *path, {1});
    same_device(op, out_token, *path, "an input");
    path_ptr = path->data_ptr<int32_t>();
  }
  NQ_CHECK(blocks >= 0 && blocks <= 16, op, ": blocks=", blocks,
           " must be 0 (automatic) or 1..16");
  const c10::cuda::CUDAGuard g(out_token.device());
  check_launch(op, nanoqwen::sample_token(out_token.data_ptr<int32_t>(), work.data_ptr<float>(),
                                          logits.data_ptr<float>(), (int)V,
                                          ctx_tokens.data_ptr<int32_t>(),
                                          (int)ctx_tokens.size(0), pos.data_ptr<int32_t>(),
                                          params_f.data_ptr<float>(),
                                          params_i.data_ptr<int64_t>(),
                                          counter.data_ptr<int64_t>(), stream_of(out_token),
                                          path_ptr, (int)blocks));
}

void check_pinned(const char* op, const char* name, const Tensor& t, int64_t cols) {
  NQ_CHECK(t.device().is_cpu() && t.is_pinned(), op, ": ", name,
           " must be a pinned CPU tensor (the kernel writes it directly)");
  NQ_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && t.size(0) >= 1 &&
               (cols == 0 ? t.dim() == 1 : (t.dim() == 2 && t.size(1) == cols)),
           op, ": ", name, " must be a contiguous int32 ", cols == 0 ? "[n >= 1]" : "[R >= 1, 4]",
           ", got ", at::toString(t.scalar_type()), " ", shape_str(t));
}

// The device alias of pinned host memory. A refusal is not an error here: torch's pinned memory
// may not be mapped explicitly, and with unified addressing (every sm_90 host) the host address
// is the device's, so the fallback is exact; the refusal is cleared so no launch reports it.
void* mapped(const Tensor& t) {
  void* dev = nullptr;
  if (cudaHostGetDevicePointer(&dev, t.data_ptr(), 0) != cudaSuccess) {
    (void)cudaGetLastError();
    dev = t.data_ptr();
  }
  return dev;
}

void advance_step(Tensor& token_in, Tensor& pos, Tensor& ctx_tokens, Tensor& counter,
                  Tensor& host_ring, const Tensor& sampled, const Tensor& stops, Tensor& halt,
                  const c10::optional<Tensor>& params_i) {
  const char* op = "advance_step";
  check_arg(op, "token_in", token_in, at::kInt);
  check_arg(op, "pos", pos, at::kInt);
  check_arg(op, "ctx_tokens", ctx_tokens, at::kInt);
  check_arg(op, "counter", counter, at::kLong);
  check_arg(op, "sampled", sampled, at::kInt);
  check_arg(op, "stops", stops, at::kInt);
  check_pinned(op, "host_ring", host_ring, 4);
  check_pinned(op, "halt", halt, 0);
  for (const Tensor* t : Ts{&token_in, &pos, &counter, &sampled}) check_dims(op, "a scalar", *t, {1});
  check_dims(op, "ctx_tokens", ctx_tokens, {-1});
  check_dims(op, "stops", stops, {1 + nanoqwen::kMaxStops});
  for (const Tensor* t : Ts{&pos, &ctx_tokens, &counter, &sampled, &stops})
    same_device(op, token_in, *t, "an input");
  if (params_i.has_value()) {   // the sampler's parameters: [3] is the n-gram watch
    check_arg(op, "params_i", *params_i, at::kLong);
    check_dims(op, "params_i", *params_i, {4});
    same_device(op, token_in, *params_i, "an input");
  }
  const c10::cuda::CUDAGuard g(token_in.device());
  check_launch(op, nanoqwen::advance_step(token_in.data_ptr<int32_t>(), pos.data_ptr<int32_t>(),
                                          ctx_tokens.data_ptr<int32_t>(),
                                          (int)ctx_tokens.size(0), counter.data_ptr<int64_t>(),
                                          static_cast<int32_t*>(mapped(host_ring)),
                                          (int)host_ring.size(0), sampled.data_ptr<int32_t>(),
                                          stops.data_ptr<int32_t>(),
                                          static_cast<int32_t*>(mapped(halt)),
                                          params_i.has_value() ? params_i->data_ptr<int64_t>()
                                                               : nullptr,
                                          stream_of(token_in)));
}

// ---- GEMVs (csrc/gemv.h) ---------------------------------------------------------------------

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

// The columns of a GEMV's x: x is [k] (one column, the decode step) or [cols, k] with
// 1 <= cols <= kMaxGemvCols (the verify step's tokens); the output has cols * n elements.
int64_t gemv_cols(const char* op, const Tensor& x, int64_t k) {
  NQ_CHECK((x.dim() == 1 && x.size(0) == k) || (x.dim() == 2 && x.size(1) == k), op,
           ": x is ", shape_str(x), ", expected [k] or [cols, k] with k=", k);
  const int64_t cols = x.dim() == 1 ? 1 : x.size(0);
  NQ_CHECK(cols >= 1 && cols <= nanoqwen::kMaxGemvCols, op, ": x has ", cols,
           " columns, expected 1..", nanoqwen::kMaxGemvCols);
  return cols;
}

// an INT4 matrix and the fp16 x [k] or [cols, k] it multiplies; sets cols
void check_int4(const char* op, const Tensor& x, const Tensor& qweight, const Tensor& scales,
                int64_t* n_out, int64_t* k_out, int64_t* cols, const char* qname = "qweight",
                const char* sname = "scales") {
  check_arg(op, "x", x, at::kHalf);
  check_qweight(op, qweight, scales, n_out, k_out, qname, sname);
  *cols = gemv_cols(op, x, *k_out);
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
  int64_t n, k, c;
  check_int4(op, x, qweight, scales, &n, &k, &c);
  check_arg(op, "y", y, at::kHalf);
  NQ_CHECK(y.numel() == c * n, op, ": y has ", y.numel(), " elements, expected cols*n=", c * n);
  const half* b = opt_bias(op, bias, y, n);
  for (const Tensor* t : Ts{&x, &qweight, &scales}) same_device(op, y, *t, "an input");
  const c10::cuda::CUDAGuard g(y.device());
  check_launch(op, nanoqwen::gemv_int4(hp(y), chp(x), qw(qweight), chp(scales), b, (int)n,
                                       (int)k, (int)c, stream_of(y)));
}

void gemv_int4_residual(Tensor& hidden, const Tensor& x, const Tensor& qweight,
                        const Tensor& scales, const c10::optional<Tensor>& parts) {
  const char* op = "gemv_int4_residual";
  int64_t n, k, c;
  check_int4(op, x, qweight, scales, &n, &k, &c);
  check_arg(op, "hidden", hidden, at::kFloat);
  NQ_CHECK(hidden.numel() == c * n, op, ": hidden has ", hidden.numel(),
           " elements, expected cols*n=", c * n);
  for (const Tensor* t : Ts{&x, &qweight, &scales}) same_device(op, hidden, *t, "an input");
  const c10::cuda::CUDAGuard g(hidden.device());
  if (!parts.has_value()) {
    check_launch(op, nanoqwen::gemv_int4_residual(hidden.data_ptr<float>(), chp(x), qw(qweight),
                                                  chp(scales), (int)n, (int)k, (int)c,
                                                  stream_of(hidden)));
    return;
  }
  // the decode step's form: one column, and the parts of the updated rows' sum of squares
  NQ_CHECK(c == 1, op, ": parts are written for one column only, x has ", c);
  check_arg(op, "parts", *parts, at::kFloat);
  check_dims(op, "parts", *parts, {(n + 15) / 16});
  same_device(op, hidden, *parts, "parts");
  check_launch(op, nanoqwen::gemv_int4_residual_parts(hidden.data_ptr<float>(),
                                                      parts->data_ptr<float>(), chp(x),
                                                      qw(qweight), chp(scales), (int)n, (int)k,
                                                      stream_of(hidden)));
}

// The decode step's folded norm in place of x: hidden [k] fp32, its parts [k/16] fp32, the norm
// weight ln [k] fp16, eps > 0.
void check_norm_in(const char* op, const Tensor& out, const Tensor& hidden, const Tensor& parts,
                   const Tensor& ln, double eps, int64_t k) {
  check_arg(op, "hidden", hidden, at::kFloat);
  check_arg(op, "parts", parts, at::kFloat);
  check_arg(op, "ln", ln, at::kHalf);
  NQ_CHECK(hidden.numel() == k, op, ": hidden has ", hidden.numel(), " elements, expected k=", k);
  check_dims(op, "parts", parts, {k / 16});
  check_dims(op, "ln", ln, {k});
  NQ_CHECK(eps > 0, op, ": eps=", eps, " must be > 0");
  for (const Tensor* t : Ts{&hidden, &parts, &ln}) same_device(op, out, *t, "an input");
}

void gemv_int4_norm(Tensor& y, const Tensor& hidden, const Tensor& parts, const Tensor& ln,
                    double eps, const Tensor& qweight, const Tensor& scales,
                    const c10::optional<Tensor>& bias) {
  const char* op = "gemv_int4_norm";
  int64_t n, k;
  check_qweight(op, qweight, scales, &n, &k);
  check_norm_in(op, y, hidden, parts, ln, eps, k);
  check_arg(op, "y", y, at::kHalf);
  NQ_CHECK(y.numel() == n, op, ": y has ", y.numel(), " elements, expected n=", n);
  const half* b = opt_bias(op, bias, y, n);
  for (const Tensor* t : Ts{&qweight, &scales}) same_device(op, y, *t, "an input");
  const c10::cuda::CUDAGuard g(y.device());
  check_launch(op, nanoqwen::gemv_int4_norm(hp(y), hidden.data_ptr<float>(),
                                            parts.data_ptr<float>(), chp(ln), (float)eps,
                                            qw(qweight), chp(scales), b, (int)n, (int)k,
                                            stream_of(y)));
}

void gemv_int4_silu_mul_norm(Tensor& out, const Tensor& hidden, const Tensor& parts,
                             const Tensor& ln, double eps, const Tensor& qw_gate,
                             const Tensor& sc_gate, const Tensor& qw_up, const Tensor& sc_up) {
  const char* op = "gemv_int4_silu_mul_norm";
  int64_t n, k, n2, k2;
  check_qweight(op, qw_gate, sc_gate, &n, &k, "qw_gate", "sc_gate");
  check_qweight(op, qw_up, sc_up, &n2, &k2, "qw_up", "sc_up");
  NQ_CHECK(n == n2 && k == k2, op, ": gate is [", n, ", ", k, "] but up is [", n2, ", ", k2, "]");
  check_norm_in(op, out, hidden, parts, ln, eps, k);
  check_arg(op, "out", out, at::kHalf);
  NQ_CHECK(out.numel() == n, op, ": out has ", out.numel(), " elements, expected n=", n);
  for (const Tensor* t : Ts{&qw_gate, &sc_gate, &qw_up, &sc_up}) same_device(op, out, *t, "an input");
  const c10::cuda::CUDAGuard g(out.device());
  check_launch(op, nanoqwen::gemv_int4_silu_mul_norm(hp(out), hidden.data_ptr<float>(),
                                                     parts.data_ptr<float>(), chp(ln), (float)eps,
                                                     qw(qw_gate), chp(sc_gate), qw(qw_up),
                                                     chp(sc_up), (int)n, (int)k, stream_of(out)));
}

void gemv_int4_silu_mul(Tensor& out, const Tensor& x, const Tensor& qw_gate, const Tensor& sc_gate,
                        const Tensor& qw_up, const Tensor& sc_up) {
  const char* op = "gemv_int4_silu_mul";
  int64_t n, k, n2, k2, c;
  check_int4(op, x, qw_gate, sc_gate, &n, &k, &c, "qw_gate", "sc_gate");
  check_int4(op, x, qw_up, sc_up, &n2, &k2, &c, "qw_up", "sc_up");
  NQ_CHECK(n == n2, op, ": gate has n=", n, " rows but up has ", n2);
  check_arg(op, "out", out, at::kHalf);
  NQ_CHECK(out.numel() == c * n, op, ": out has ", out.numel(), " elements, expected cols*n=",
           c * n);
  for (const Tensor* t : Ts{&x, &qw_gate, &sc_gate, &qw_up, &sc_up}) same_device(op, out, *t, "an input");
  const c10::cuda::CUDAGuard g(out.device());
  check_launch(op, nanoqwen::gemv_int4_silu_mul(hp(out), chp(x), qw(qw_gate), chp(sc_gate),
                                                qw(qw_up), chp(sc_up), (int)n, (int)k, (int)c,
                                                stream_of(out)));
}

// The prefill GEMMs' x: [m, k], m >= 1 tokens; m.
int64_t gemm_rows(const char* op, const Tensor& x, int64_t k) {
  check_arg(op, "x", x, at::kHalf);
  NQ_CHECK(x.dim() == 2 && x.size(1) == k && x.size(0) >= 1, op, ": x is ", shape_str(x),
           ", expected [m, k] with m >= 1 and k=", k);
  return x.size(0);
}

// gemm_int4's split-K scratch for one (m, n, k) launch: fp32 partials from the caching allocator
// (none where the shape takes no split) and zeroed counters (`counters`: a kGemmCounters int
// tensor that launches leave zeroed; undefined: fresh zeros, as the single ops use).
struct Int4Scratch {
  Tensor partials, counters;
  nanoqwen::GemmScratch s{nullptr, 0, nullptr};
  Int4Scratch(const Tensor& like, int64_t m, int64_t n, int64_t k, bool silu,
              const Tensor& counters_in = Tensor()) {
    const size_t floats = nanoqwen::gemm_int4_scratch_floats((int)m, (int)n, (int)k, silu);
    if (floats == 0) return;
    partials = at::empty({(int64_t)floats}, like.options().dtype(at::kFloat));
    counters = counters_in.defined()
        ? counters_in : at::zeros({nanoqwen::kGemmCounters}, like.options().dtype(at::kInt));
    s = {partials.data_ptr<float>(), floats, counters.data_ptr<int>()};
  }
  const nanoqwen::GemmScratch* get() const { return s.partials ? &s : nullptr; }
};

void gemm_int4(Tensor& y, const Tensor& x, const Tensor& qweight, const Tensor& scales,
               const c10::optional<Tensor>& bias) {
  const char* op = "gemm_int4";
  int64_t n, k;
  check_qweight(op, qweight, scales, &n, &k);
  const int64_t m = gemm_rows(op, x, k);
  check_arg(op, "y", y, at::kHalf);
  NQ_CHECK(y.numel() == m * n, op, ": y has ", y.numel(), " elements, expected m*n=", m * n);
  const half* b = opt_bias(op, bias, y, n);
  for (const Tensor* t : Ts{&x, &qweight, &scales}) same_device(op, y, *t, "an input");
  const c10::cuda::CUDAGuard g(y.device());
  const Int4Scratch sc(y, m, n, k, false);
  check_launch(op, nanoqwen::gemm_int4(hp(y), chp(x), qw(qweight), chp(scales), b, (int)m, (int)n,
                                       (int)k, sc.get(), stream_of(y)));
}

void gemm_int4_residual(Tensor& hidden, const Tensor& x, const Tensor& qweight,
                        const Tensor& scales) {
  const char* op = "gemm_int4_residual";
  int64_t n, k;
  check_qweight(op, qweight, scales, &n, &k);
  const int64_t m = gemm_rows(op, x, k);
  check_arg(op, "hidden", hidden, at::kFloat);
  NQ_CHECK(hidden.numel() == m * n, op, ": hidden has ", hidden.numel(),
           " elements, expected m*n=", m * n);
  for (const Tensor* t : Ts{&x, &qweight, &scales}) same_device(op, hidden, *t, "an input");
  const c10::cuda::CUDAGuard g(hidden.device());
  const Int4Scratch sc(hidden, m, n, k, false);
  check_launch(op, nanoqwen::gemm_int4_residual(hidden.data_ptr<float>(), chp(x), qw(qweight),
                                                chp(scales), (int)m, (int)n, (int)k, sc.get(),
                                                stream_of(hidden)));
}

void gemm_int4_silu_mul(Tensor& out, const Tensor& x, const Tensor& qw_gate, const Tensor& sc_gate,
                        const Tensor& qw_up, const Tensor& sc_up) {
  const char* op = "gemm_int4_silu_mul";
  int64_t n, k, n2, k2;
  check_qweight(op, qw_gate, sc_gate, &n, &k, "qw_gate", "sc_gate");
  check_qweight(op, qw_up, sc_up, &n2, &k2, "qw_up", "sc_up");
  NQ_CHECK(n == n2 && k == k2, op, ": gate is [", n, ", ", k, "] but up is [", n2, ", ", k2, "]");
  const int64_t m = gemm_rows(op, x, k);
  check_arg(op, "out", out, at::kHalf);
  NQ_CHECK(out.numel() == m * n, op, ": out has ", out.numel(), " elements, expected m*n=", m * n);
  for (const Tensor* t : Ts{&x, &qw_gate, &sc_gate, &qw_up, &sc_up}) same_device(op, out, *t, "an input");
  const c10::cuda::CUDAGuard g(out.device());
  const Int4Scratch sc(out, m, n, k, true);
  check_launch(op, nanoqwen::gemm_int4_silu_mul(hp(out), chp(x), qw(qw_gate), chp(sc_gate),
                                                qw(qw_up), chp(sc_up), (int)m, (int)n, (int)k,
                                                sc.get(), stream_of(out)));
}

void gemv_fp16(Tensor& logits, const Tensor& x, const Tensor& w) {
  const char* op = "gemv_fp16";
  check_arg(op, "logits", logits, at::kFloat);
  check_arg(op, "x", x, at::kHalf);
  check_arg(op, "w", w, at::kHalf);
  check_dims(op, "w", w, {-1, -1});
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t c = gemv_cols(op, x, k);
  NQ_CHECK(logits.numel() == c * n, op, ": logits has ", logits.numel(),
           " elements, expected cols*n=", c * n);
  same_device(op, logits, x, "x");
  same_device(op, logits, w, "w");
  const c10::cuda::CUDAGuard g(logits.device());
  check_launch(op, nanoqwen::gemv_fp16(logits.data_ptr<float>(), chp(x), chp(w), (int)n,
                                       (int)k, (int)c, stream_of(logits)));
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
  check_launch(op, nanoqwen::dequant_int4(hp(w), qw(qweight), chp(scales), (int)n, (int)k,
                                          stream_of(w)));
}


// ---- the engine core (csrc/engine.h): decode step, gated graph, launcher thread, prefill ------
//
// torch.classes.nanoqwen.Engine owns a StepArgs built from the backend's tensors (checked here
// once, kept alive here) and a DecodeLoop. Every method that waits or enqueues many launches
// releases the GIL itself (whether or not the caller's binding already did), so a busy Python
// thread (the UI) never delays the GPU and the engine never waits for the UI.

// Releases the GIL for its scope if this thread holds it.
struct NoGil {
  PyThreadState* st = nullptr;
  NoGil() {
    if (Py_IsInitialized() && PyGILState_Check()) st = PyEval_SaveThread();
  }
  ~NoGil() {
    if (st) PyEval_RestoreThread(st);
  }
};

// engine.cu's failures carry their context and the CUDA error (kernels.h's convention): the
// exception is "nanoqwen engine: <what>: <that message>".
void check_engine(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  const std::string m = nanoqwen::take_last_error();
  fail("nanoqwen engine: ", what, ": ", m.empty() ? std::string(cudaGetErrorString(e)) : m);
}

// A raw CUDA call of this class: the same form, "nanoqwen engine: <what>: <CUDA error>", where
// `what` names the call and its numbers. The error is cleared first (a failed copy or sync is
// not sticky), so the next launch's cudaGetLastError check does not report it as its own.
void check_cuda(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  fail("nanoqwen engine: ", what, ": ", cudaGetErrorString(e));
}

class Engine : public torch::CustomClassHolder {
 public:
  // globals: embed [V,H] fp16, final_norm [H] fp16, lm_head [V,H] fp16, hidden [1,H] fp32,
  //   xn [1,H] fp16, qkv [1,q+2kv] fp16, attn [nh,hd] fp16, act [I] fp16, logits [V] fp32,
  //   work [V] fp32, ws_acc [nh,S,hd] fp32, ws_ml [nh,S,2] fp32, attn_counters [nkv] int32,
  //   cos/sin [P*16, hd/2] fp32, page_table [P] int32, token_in/pos/sampled [1] int32,
  //   counter [1] int64, ctx_tokens [C] int32, params_f [4] fp32, params_i [4] int64,
  //   stops [1+8] int32                                                        (24 tensors)
  // layers: 15 a layer: ln1, ln2, qkv_qw, qkv_sc, qkv_b, o_qw, o_sc, gate_qw, gate_sc, up_qw,
  //   up_sc, down_qw, down_sc, k_cache, v_cache
  // dense: 4 a layer (resident fp16 W_qkv, W_o, W_gate_up, W_down), or 8 scratch matrices
  //   (per-layer dequant: two sets of 4, the next layer dequantized into one on a side stream
  //   while the current layer's prefill GEMMs read the other)
  // ints: H, I, n_heads, n_kv, head_dim, vocab, int4_max_m (with dequant prefill weights, prompt
  //   chunks of at most this many tokens go through gemm_int4 instead; 0: never), min_pps, num_splits,
  //   prefill weights (0 dequant, 1 resident, 2 int4: no dense matrices, gemm_int4 on the INT4
  //   weights), prefill_chunk, attention kernel (kAttnCpAsync / kAttnTma), prefill_attn_max
  //   (prompt chunks whose context ends at most this many positions in take attention_prefill,
  //   longer ones SDPA over gathered K/V; 0: always SDPA), norm_fold (1: the decode step's norms
  //   folded into the GEMVs, its parts buffer owned here; 0: rmsnorm launches)
  Engine(std::vector<Tensor> globals, std::vector<Tensor> layers, std::vector<Tensor> dense,
         std::vector<int64_t> ints, double eps, int64_t stream_ptr)
      : g_(std::move(globals)), l_(std::move(layers)), d_(std::move(dense)) {
    const char* op = "Engine";
    NQ_CHECK(ints.size() == 14, op, ": ints has ", (int64_t)ints.size(), " values, expected 14");
    NQ_CHECK(g_.size() == 24, op, ": globals has ", (int64_t)g_.size(), " tensors, expected 24");
    NQ_CHECK(!l_.empty() && l_.size() % 15 == 0, op, ": layers has ", (int64_t)l_.size(),
             " tensors, expected 15 a layer");
    const int64_t nl = (int64_t)l_.size() / 15;
    // ints[9], the prefill's weights: 0 per-layer dequant into 4 scratch matrices, 1 resident
    // fp16 (4 a layer), 2 the INT4 weights themselves through gemm_int4 (no dense matrices)
    NQ_CHECK(ints[9] >= 0 && ints[9] <= 2, op, ": ints[9]=", ints[9],
             " must be 0 (dequant), 1 (resident) or 2 (int4)");
    resident_ = ints[9] == 1;
    int4_ = ints[9] == 2;
    const int64_t n_dense = resident_ ? 4 * nl : int4_ ? 0 : 8;
    NQ_CHECK(d_.size() == (size_t)n_dense, op, ": dense has ", (int64_t)d_.size(),
             " matrices, expected ", n_dense);
    chunk_ = ints[10];
    NQ_CHECK(chunk_ >= 1, op, ": prefill_chunk=", chunk_, " must be >= 1");
    nanoqwen::StepArgs& a = a_;
    a.H = (int)ints[0]; a.I = (int)ints[1]; a.n_heads = (int)ints[2]; a.n_kv = (int)ints[3];
    a.head_dim = (int)ints[4]; a.vocab = (int)ints[5];
    NQ_CHECK(ints[6] >= 0, op, ": int4_max_m=", ints[6], " must be >= 0");
    int4_max_m_ = ints[6];
    a.min_pps = (int)ints[7]; a.num_splits = (int)ints[8]; a.eps = (float)eps;
    const int64_t H = a.H, I = a.I, nh = a.n_heads, nkv = a.n_kv, hd = a.head_dim, V = a.vocab;
    const int64_t qn = (nh + 2 * nkv) * hd, S = a.num_splits;
    NQ_CHECK(H % 128 == 0 && I % 128 == 0 && (nh * hd) % 128 == 0, op, ": H=", H, ", I=", I,
             " and q_size=", nh * hd, " must be multiples of 128 (INT4 group size)");
    NQ_CHECK(nh % nkv == 0 && nh / nkv <= nanoqwen::kMaxGqa, op, ": n_heads=", nh, " / n_kv=", nkv,
             " must be a whole GQA ratio of at most ", nanoqwen::kMaxGqa);
    NQ_CHECK(a.min_pps >= 0 && a.min_pps <= nanoqwen::kDecMinPpsMax, op, ": min_pps=", a.min_pps);
    NQ_CHECK(ints[11] == nanoqwen::kAttnCpAsync || ints[11] == nanoqwen::kAttnTma, op,
             ": attention kernel=", ints[11], " must be ", nanoqwen::kAttnCpAsync, " or ",
             nanoqwen::kAttnTma);
    a.attn_kernel = (int)ints[11];
    NQ_CHECK(ints[12] >= 0, op, ": prefill_attn_max=", ints[12], " must be >= 0");
    prefill_attn_max_ = ints[12];
    NQ_CHECK(ints[13] == 0 || ints[13] == 1, op, ": norm_fold=", ints[13], " must be 0 or 1");
    const bool norm_fold = ints[13] == 1;
    struct Want { const char* name; at::ScalarType dt; std::vector<int64_t> dims; };
    const std::vector<Want> want = {
        {"embed", at::kHalf, {V, H}}, {"final_norm", at::kHalf, {H}}, {"lm_head", at::kHalf, {V, H}},
        {"hidden", at::kFloat, {1, H}}, {"xn", at::kHalf, {1, H}}, {"qkv", at::kHalf, {1, qn}},
        {"attn", at::kHalf, {nh, hd}}, {"act", at::kHalf, {I}}, {"logits", at::kFloat, {V}},
        {"work", at::kFloat, {V}}, {"ws_acc", at::kFloat, {nh, S, hd}},
        {"ws_ml", at::kFloat, {nh, S, 2}}, {"attn_counters", at::kInt, {nkv}},
        {"cos", at::kFloat, {-1, hd / 2}}, {"sin", at::kFloat, {-1, hd / 2}},
        {"page_table", at::kInt, {-1}}, {"token_in", at::kInt, {1}}, {"pos", at::kInt, {1}},
        {"sampled", at::kInt, {1}}, {"counter", at::kLong, {1}}, {"ctx_tokens", at::kInt, {-1}},
        {"params_f", at::kFloat, {4}}, {"params_i", at::kLong, {4}},
        {"stops", at::kInt, {1 + nanoqwen::kMaxStops}}};
    NQ_CHECK(want.size() == g_.size(), op, ": internal: the tensor table has ", (int64_t)want.size(), " rows");
    for (size_t i = 0; i < want.size(); ++i) {
      check_arg(op, want[i].name, g_[i], want[i].dt);
      check_dims(op, want[i].name, g_[i], want[i].dims);
      same_device(op, g_[0], g_[i], want[i].name);
    }
    device_ = g_[0].device();
    const Tensor& page_table = g_[15];
    a.table_len = (int)page_table.size(0);
    NQ_CHECK(a.table_len >= 1 && g_[13].size(0) >= a.table_len * nanoqwen::kPageSize &&
                 g_[14].size(0) == g_[13].size(0),
             op, ": the RoPE tables have ", g_[13].size(0), " rows, the page table covers ",
             (int64_t)a.table_len * nanoqwen::kPageSize, " positions");
    a.ctx_capacity = (int)g_[20].size(0);
    a.embed = chp(g_[0]); a.final_norm = chp(g_[1]); a.lm_head = chp(g_[2]);
    a.hidden = g_[3].data_ptr<float>(); a.xn = hp(g_[4]); a.qkv = hp(g_[5]); a.attn = hp(g_[6]);
    a.act = hp(g_[7]); a.logits = g_[8].data_ptr<float>(); a.work = g_[9].data_ptr<float>();
    a.ws_acc = g_[10].data_ptr<float>(); a.ws_ml = g_[11].data_ptr<float>();
    a.attn_counters = g_[12].data_ptr<int32_t>(); a.cos = g_[13].data_ptr<float>();
    a.sin = g_[14].data_ptr<float>(); a.page_table = page_table.data_ptr<int32_t>();
    a.token_in = g_[16].data_ptr<int32_t>(); a.pos = g_[17].data_ptr<int32_t>();
    a.sampled = g_[18].data_ptr<int32_t>(); a.counter = g_[19].data_ptr<int64_t>();
    a.ctx_tokens = g_[20].data_ptr<int32_t>(); a.params_f = g_[21].data_ptr<float>();
    a.params_i = g_[22].data_ptr<int64_t>(); a.stops = g_[23].data_ptr<int32_t>();
    if (norm_fold) {  // fp32 on hidden's device; null parts: the step launches rmsnorm
      norm_parts_ = at::zeros({H / 16}, g_[3].options());
      a.norm_parts = norm_parts_.data_ptr<float>();
    }
    for (int64_t li = 0; li < nl; ++li) {
      const Tensor* t = &l_[15 * li];
      const std::string pfx = "layer " + std::to_string(li) + " ";
      int64_t n, k;
      check_arg(op, (pfx + "ln1").c_str(), t[0], at::kHalf);
      check_dims(op, (pfx + "ln1").c_str(), t[0], {H});
      check_arg(op, (pfx + "ln2").c_str(), t[1], at::kHalf);
      check_dims(op, (pfx + "ln2").c_str(), t[1], {H});
      check_qweight(op, t[2], t[3], &n, &k, "qkv_qw", "qkv_sc");
      NQ_CHECK(n == qn && k == H, op, ": ", pfx, "qkv is [", n, ", ", k, "], expected [", qn, ", ", H, "]");
      check_arg(op, (pfx + "qkv_b").c_str(), t[4], at::kHalf);
      check_dims(op, (pfx + "qkv_b").c_str(), t[4], {qn});
      check_qweight(op, t[5], t[6], &n, &k, "o_qw", "o_sc");
      NQ_CHECK(n == H && k == nh * hd, op, ": ", pfx, "o is [", n, ", ", k, "]");
      check_qweight(op, t[7], t[8], &n, &k, "gate_qw", "gate_sc");
      NQ_CHECK(n == I && k == H, op, ": ", pfx, "gate is [", n, ", ", k, "]");
      check_qweight(op, t[9], t[10], &n, &k, "up_qw", "up_sc");
      NQ_CHECK(n == I && k == H, op, ": ", pfx, "up is [", n, ", ", k, "]");
      check_qweight(op, t[11], t[12], &n, &k, "down_qw", "down_sc");
      NQ_CHECK(n == H && k == I, op, ": ", pfx, "down is [", n, ", ", k, "]");
      check_cache(op, t[13], t[14]);
      NQ_CHECK(t[13].size(0) == a.table_len && t[13].size(2) == nkv && t[13].size(3) == hd, op,
               ": ", pfx, "k_cache is ", shape_str(t[13]), ", expected [", (int64_t)a.table_len,
               ", 16, ", nkv, ", ", hd, "]");
      for (int j = 0; j < 15; ++j) same_device(op, g_[0], t[j], "a layer tensor");
      nanoqwen::LayerPtrs L;
      L.ln1 = chp(t[0]); L.ln2 = chp(t[1]); L.qkv_qw = qw(t[2]); L.qkv_sc = chp(t[3]);
      L.qkv_b = chp(t[4]); L.o_qw = qw(t[5]); L.o_sc = chp(t[6]); L.gate_qw = qw(t[7]);
      L.gate_sc = chp(t[8]); L.up_qw = qw(t[9]); L.up_sc = chp(t[10]); L.down_qw = qw(t[11]);
      L.down_sc = chp(t[12]); L.k_cache = hp(t[13]); L.v_cache = hp(t[14]);
      a.layers.push_back(L);
    }
    const int64_t dshape[4][2] = {{qn, H}, {H, nh * hd}, {2 * I, H}, {H, I}};
    for (size_t j = 0; j < d_.size(); ++j) {
      check_arg(op, "a dense matrix", d_[j], at::kHalf);
      check_dims(op, "a dense matrix", d_[j], {dshape[j % 4][0], dshape[j % 4][1]});
      same_device(op, g_[0], d_[j], "a dense matrix");
    }
    stream_ = reinterpret_cast<cudaStream_t>(stream_ptr);
    const c10::cuda::CUDAGuard dg(device_);
    loop_ = std::make_unique<nanoqwen::DecodeLoop>(&a_, stream_, (int)device_.index());
    NQ_CHECK(loop_->ring() != nullptr, op, ": ", nanoqwen::take_last_error());
    if (!resident_ && !int4_) {   // the dequant prefill's side stream and its events
      check_cuda(cudaStreamCreateWithFlags(&dq_stream_, cudaStreamNonBlocking),
                 "Engine: cudaStreamCreateWithFlags (the dequantization stream)");
      for (cudaEvent_t* e : {&dq_start_, &dq_ready_[0], &dq_ready_[1], &dq_free_[0], &dq_free_[1]})
        check_cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming),
                   "Engine: cudaEventCreateWithFlags (the dequantization events)");
    }
  }

  // Capture the decode step; true when the graph is halt-gated (engine.h).
  bool capture() {
    NoGil nogil;
    const c10::cuda::CUDAGuard dg(device_);
    check_engine(loop_->capture(), "capturing the decode step");
    return loop_->gated();
  }
  std::string capture_note() { return loop_->capture_note(); }

  // One decode step (graph replay or eager launches) on the engine's stream.
  void run_step(bool graph) {
    NoGil nogil;
    const c10::cuda::CUDAGuard dg(device_);
    check_engine(loop_->run_step(graph), graph ? "decode step (graph)" : "decode step (eager)");
  }

  // Wait for the stream, stop any launcher thread, clear the ring and the halt flag, set the
  // turn's stop ids (host and device) and stamp the turn's start on the GPU.
  void begin_turn(std::vector<int64_t> stop_ids) {
    check_stops(stop_ids, "begin_turn");
    NoGil nogil;
    const c10::cuda::CUDAGuard dg(device_);
    begin_turn_nogil(stop_ids);
  }

  // begin_turn() once checked, the GIL released.
  void begin_turn_nogil(const std::vector<int64_t>& stop_ids) {
    loop_->stop();
    check_cuda(cudaStreamSynchronize(stream_),
               "begin_turn: cudaStreamSynchronize (waiting for the previous turn)");
    loop_->reset_turn();
    loop_->spec_on(false);   // a plain turn unless start_turn says otherwise
    stops_host_[0] = (int32_t)stop_ids.size();
    loop_->host_stops.clear();
    for (size_t i = 0; i < stop_ids.size(); ++i) {
      stops_host_[1 + i] = (int32_t)stop_ids[i];
      loop_->host_stops.push_back((int32_t)stop_ids[i]);
    }
    // pageable source, stream idle: the copy is complete when this returns
    check_cuda(cudaMemcpyAsync(const_cast<int32_t*>(a_.stops), stops_host_, sizeof(stops_host_),
                               cudaMemcpyHostToDevice, stream_),
               "begin_turn: cudaMemcpyAsync of " + std::to_string(stop_ids.size()) +
                   " stop ids (" + std::to_string(sizeof(stops_host_)) + " bytes) to the device");
    check_cuda(cudaStreamSynchronize(stream_),
               "begin_turn: cudaStreamSynchronize after the stop ids' copy");
    *reinterpret_cast<volatile uint64_t*>(loop_->start_stamp()) = 0;   // start_turn waits for it
    check_engine(nanoqwen::stamp_time(loop_->start_stamp(), stream_), "begin_turn");
  }

  // A generation turn's start in one call that releases the GIL once: finish(); the sampler's
  // parameters (sample_token's params_f, params_i), the draw counter (0) and the page table's
  // first page_table.size() entries (none: unchanged) to the device; begin_turn(stop_ids);
  // prefill(ids, pos0, sample = true, graph); start(n_steps, graph, run_ahead); returns the
  // turn's start stamp (start_ns(), GPU ns; it ran before the prefill's kernels). A call of a
  // torch.classes method, like a torch op, runs with the GIL released (torch's
  // runAndInsertCall), and while another thread is busy in Python (the app's UI painting the
  // new messages) getting it back costs about the switch interval (0.5 ms in the app): the
  // nine calls and ops this replaces (finish, three copies, a fill, begin_turn, prefill,
  // start, start_ns) took 4-6 ms of the app's Enter -> text on the H200.
  //
  // spec: [] plain decoding, or prompt-lookup speculation on the device (engine.h DecodeLoop
  // spec_on; kernels.h spec_draft / spec_accept) as [k_start, k_min, k_max, min_n, max_n]
  // (engine/spec.py's NgramDrafter sizes; 1 <= k_min <= k_start <= k_max < kMaxVerify, 1 <=
  // min_n <= max_n <= 64): the turn's n_steps steps are then speculative steps, which stop on
  // the device once the turn has n_steps + 1 ids; params_i[3] (the n-gram watch) must be 0.
  int64_t start_turn(std::vector<int64_t> stop_ids, std::vector<double> params_f,
                  std::vector<int64_t> params_i, std::vector<int64_t> page_table,
                  const Tensor& ids, int64_t pos0, int64_t n_steps, bool graph,
                  int64_t run_ahead, std::vector<int64_t> spec) {
    const char* op = "start_turn";
    check_stops(stop_ids, op);
    NQ_CHECK(params_f.size() == 4 && params_i.size() == 4, op, ": params_f and params_i hold 4 ",
             "values each, got ", (int64_t)params_f.size(), " and ", (int64_t)params_i.size());
    const bool on = !spec.empty();
    if (on) {
      NQ_CHECK(spec.size() == 5, op, ": spec holds [k_start, k_min, k_max, min_n, max_n] or ",
               "nothing, got ", (int64_t)spec.size(), " values");
      NQ_CHECK(1 <= spec[1] && spec[1] <= spec[0] && spec[0] <= spec[2] &&
                   spec[2] < nanoqwen::kMaxVerify,
               op, ": draft lengths k_min=", spec[1], " <= k_start=", spec[0], " <= k_max=",
               spec[2], " < ", nanoqwen::kMaxVerify, " do not hold");
      NQ_CHECK(1 <= spec[3] && spec[3] <= spec[4] && spec[4] <= 64, op, ": n-gram sizes min_n=",
               spec[3], " <= max_n=", spec[4], " (1..64) do not hold");
      NQ_CHECK(params_i[3] == 0, op, ": speculation on the device drafts every step; the n-gram ",
               "watch (params_i[3]) must be 0");
      NQ_CHECK(n_steps + 1 < ((int64_t)1 << 31), op, ": n_steps=", n_steps, " is too many");
    }
    NQ_CHECK((int64_t)page_table.size() <= (int64_t)a_.table_len, op, ": ",
             (int64_t)page_table.size(), " page table entries, the table holds ",
             (int64_t)a_.table_len);
    std::vector<int32_t> pt(page_table.size());
    for (size_t i = 0; i < page_table.size(); ++i) {
      NQ_CHECK(page_table[i] >= 0 && page_table[i] < a_.table_len, op, ": page ",
               page_table[i], " at ", (int64_t)i, " is outside the pool 0..",
               (int64_t)a_.table_len - 1);
      pt[i] = (int32_t)page_table[i];
    }
    NQ_CHECK(n_steps >= 0 && run_ahead >= 1, op, ": n_steps=", n_steps, ", run_ahead=", run_ahead);
    const int64_t T = check_ids(op, ids, pos0);
    float pf[4];
    for (int i = 0; i < 4; ++i) pf[i] = (float)params_f[i];
    const int64_t zero = 0;
    if (on) {   // everything checked: the first speculative turn's buffers (GIL held: ATen)
      if (v_.empty()) alloc_verify();
      if (!spec_state_.defined()) alloc_spec();
    }
    int32_t st[nanoqwen::kSpecStateLen] = {};
    if (on) {
      st[nanoqwen::kSpecK] = (int32_t)spec[0];
      st[nanoqwen::kSpecKMin] = (int32_t)spec[1];
      st[nanoqwen::kSpecKMax] = (int32_t)spec[2];
      st[nanoqwen::kSpecMinN] = (int32_t)spec[3];
      st[nanoqwen::kSpecMaxN] = (int32_t)spec[4];
      st[nanoqwen::kSpecTotal] = (int32_t)(n_steps + 1);
    }
    NoGil nogil;
    const c10::cuda::CUDAGuard dg(device_);
    finish_nogil();
    // the speculative graph at the first speculative turn in graph mode, the stream idle (a
    // refusal leaves a note and eager speculative steps: spec_note())
    if (on && graph) check_engine(loop_->capture_spec(), "capturing the speculative step");
    // pageable sources: each copy has left them when it returns; begin_turn syncs after them
    const auto h2d = [&](void* dst, const void* src, size_t bytes, const char* what) {
      check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_),
                 std::string("start_turn: cudaMemcpyAsync of ") + what + " (" +
                     std::to_string(bytes) + " bytes) to the device");
    };
    if (on) h2d(sargs_.state, st, sizeof(st), "speculation's state");
    h2d(const_cast<float*>(a_.params_f), pf, sizeof(pf), "the sampler's params_f");
    h2d(const_cast<int64_t*>(a_.params_i), params_i.data(), 4 * sizeof(int64_t),
        "the sampler's params_i");
    h2d(a_.counter, &zero, sizeof(zero), "the draw counter");
    if (!pt.empty())
      h2d(const_cast<int32_t*>(a_.page_table), pt.data(), pt.size() * sizeof(int32_t),
          "the page table");
    begin_turn_nogil(stop_ids);
    prefill_nogil(ids.data_ptr<int32_t>(), T, pos0, true, graph);
    loop_->set_graph(graph);
    loop_->spec_on(on);
    if (n_steps > 0) loop_->start(n_steps, (int)run_ahead);
    // the stamp ran before the prefill's kernels, long done by now unless the stream failed
    const volatile uint64_t* stamp = loop_->start_stamp();
    for (int i = 0; *stamp == 0; ++i) {
      if (i % 64 == 63) {
        const cudaError_t q = cudaStreamQuery(stream_);
        if (q != cudaSuccess && q != cudaErrorNotReady)
          check_cuda(q, "start_turn: the stream failed before the turn's start stamp");
        NQ_CHECK(i < 64 * 20000, "start_turn: the turn's start stamp did not land in ~10 s");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(5));
    }
    return (int64_t)*stamp;
  }

  // K/V of ids (CPU int32 [T]) at positions pos0.. and the logits of the last one; with
  // `sample`, also sample + advance (ring slot = counter). T == 1 is a decode step (graph or
  // eager as `graph` says). The page table must already cover pos0 + T positions.
  void prefill(const Tensor& ids, int64_t pos0, bool sample, bool graph) {
    const int64_t T = check_ids("prefill", ids, pos0);
    NoGil nogil;
    prefill_nogil(ids.data_ptr<int32_t>(), T, pos0, sample, graph);
  }

  // prefill()'s checks of ids and positions (GIL held); T.
  int64_t check_ids(const char* op, const Tensor& ids, int64_t pos0) const {
    NQ_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kInt && ids.dim() == 1 &&
                 ids.size(0) >= 1 && ids.is_contiguous(),
             op, ": ids must be a contiguous CPU int32 [T >= 1], got ", at::toString(ids.scalar_type()),
             " ", shape_str(ids), " on ", ids.device());
    const int64_t T = ids.size(0);
    NQ_CHECK(pos0 >= 0 && pos0 + T <= (int64_t)a_.table_len * nanoqwen::kPageSize &&
                 pos0 + T < a_.ctx_capacity,
             op, ": positions ", pos0, "..", pos0 + T - 1, " do not fit the cache of ",
             (int64_t)a_.table_len * nanoqwen::kPageSize, " positions");
    const int32_t* idp = ids.data_ptr<int32_t>();
    for (int64_t i = 0; i < T; ++i)
      NQ_CHECK(idp[i] >= 0 && idp[i] < a_.vocab, op, ": token id ", (int64_t)idp[i], " at ", i,
               " is outside the vocabulary 0..", (int64_t)a_.vocab - 1);
    return T;
  }

  static void check_stops(const std::vector<int64_t>& stop_ids, const char* op) {
    NQ_CHECK(stop_ids.size() <= (size_t)nanoqwen::kMaxStops, op, ": ",
             (int64_t)stop_ids.size(), " stop ids, at most ", nanoqwen::kMaxStops);
  }

  // prefill() once checked, the GIL released.
  void prefill_nogil(const int32_t* idp, int64_t T, int64_t pos0, bool sample, bool graph) {
    c10::InferenceMode im;
    const c10::cuda::CUDAGuard dg(device_);
    const c10::cuda::CUDAStreamGuard sg(c10::cuda::getStreamFromExternal(stream_, device_.index()));
    const nanoqwen::StepArgs& a = a_;
    Tensor ctx = g_[20].narrow(0, pos0, T);
    check_cuda(cudaMemcpyAsync(ctx.data_ptr(), idp, T * sizeof(int32_t), cudaMemcpyHostToDevice,
                               stream_),
               "prefill: cudaMemcpyAsync of " + std::to_string(T) + " prompt ids (" +
                   std::to_string(T * sizeof(int32_t)) + " bytes) to ctx_tokens[" +
                   std::to_string(pos0) + "..]");
    if (T == 1) {
      check_cuda(cudaMemcpyAsync(a.token_in, ctx.data_ptr(), sizeof(int32_t),
                                 cudaMemcpyDeviceToDevice, stream_),
                 "prefill: cudaMemcpyAsync of the token id (4 bytes) to token_in");
      g_[17].fill_((int)pos0);
      check_engine(loop_->run_step(graph), "prefill of one token (a decode step)");
      return;
    }
    const int64_t H = a.H, I = a.I, nh = a.n_heads, nkv = a.n_kv, hd = a.head_dim;
    const int64_t qn = (nh + 2 * nkv) * hd;                                     // q, k, v columns
    const auto fopt = g_[3].options(), hopt = g_[4].options(), iopt = g_[17].options();
    Tensor hidden = at::empty({T, H}, fopt);
    check_launch("prefill embed_gather", nanoqwen::embed_gather(hidden.data_ptr<float>(), a.embed,
                                                                static_cast<const int32_t*>(ctx.data_ptr()),
                                                                (int)T, (int)H, a.vocab, stream_));
    std::vector<std::pair<int64_t, int64_t>> chunks;
    // per chunk: its first position; for SDPA (a chunk ending past prefill_attn_max_) the int64
    // ids of the pages its attention reads (the same in every layer; undefined otherwise)
    std::vector<Tensor> pos_t, tables;
    for (int64_t s = 0; s < T; s += chunk_) {
      chunks.push_back({s, std::min(T, s + chunk_)});
      pos_t.push_back(at::full({1}, pos0 + s, iopt));
      const int64_t end = pos0 + chunks.back().second, page = nanoqwen::kPageSize;
      tables.push_back(end <= prefill_attn_max_
                           ? Tensor()
                           : g_[15].narrow(0, 0, (end + page - 1) / page).to(at::kLong));
    }
    // a chunk of tc tokens through gemm_int4: always with int4 weights; with dequant ones where it
    // is short (a next turn: gemm_int4 reads the INT4 weights once, the dequant path writes and
    // rereads a layer's fp16 copy); never with resident ones (cuBLAS on them is faster from 32
    // tokens: benchmarks/RESULTS.md, session 18)
    const auto via_int4 = [&](int64_t tc) { return int4_ || (!resident_ && tc <= int4_max_m_); };
    bool all_int4 = true;   // every chunk through gemm_int4: the dequant path dequantizes nothing
    for (const auto& ch : chunks) all_int4 = all_int4 && via_int4(ch.second - ch.first);
    if (!split_counters_.defined())
      split_counters_ = at::zeros({nanoqwen::kGemmCounters}, iopt);
    // dequant weights: layer li's fp16 copy in scratch set li % 2, written on dq_stream_ while
    // stream_ runs layer li - 1 on the other set (the dequantization is memory-bound, the
    // GEMMs mostly compute-bound): ready[set] orders a set's writes before its layer's reads,
    // free[set] its layer's last reads before the writes of the layer two on, and start orders
    // the first two sets' writes after all that stream_ held before this prefill
    const bool dq = !resident_ && !int4_ && !all_int4;
    const size_t nl = a.layers.size();
    if (dq) {
      check_cuda(cudaEventRecord(dq_start_, stream_), "prefill: cudaEventRecord (dequant start)");
      check_cuda(cudaStreamWaitEvent(dq_stream_, dq_start_, 0),
                 "prefill: cudaStreamWaitEvent (the dequantization stream on the prefill's start)");
      dequant_layer(0, 0, dq_stream_);
      check_cuda(cudaEventRecord(dq_ready_[0], dq_stream_), "prefill: cudaEventRecord (layer 0)");
    }
    for (size_t li = 0; li < nl; ++li) {
      const nanoqwen::LayerPtrs& L = a.layers[li];
      const Tensor* lt = &l_[15 * li];
      const int set = (int)(li & 1);
      const Tensor* W = resident_ ? &d_[4 * li] : int4_ ? nullptr : &d_[4 * set];
      if (dq) {
        if (li + 1 < nl) {   // the next layer into the other set, once layer li - 1 is done
          const int next = set ^ 1;
          if (li >= 1)
            check_cuda(cudaStreamWaitEvent(dq_stream_, dq_free_[next], 0),
                       "prefill: cudaStreamWaitEvent (a dequantization set's last reads)");
          dequant_layer(li + 1, next, dq_stream_);
          check_cuda(cudaEventRecord(dq_ready_[next], dq_stream_),
                     "prefill: cudaEventRecord (a layer's fp16 copy written)");
        }
        check_cuda(cudaStreamWaitEvent(stream_, dq_ready_[set], 0),
                   "prefill: cudaStreamWaitEvent (the layer's fp16 copy)");
      }
      for (size_t c = 0; c < chunks.size(); ++c) {
        const int64_t s = chunks[c].first, e = chunks[c].second, tc = e - s;
        const bool q4 = via_int4(tc);
        Tensor h = hidden.narrow(0, s, tc);                                       // [Tc, H]
        Tensor xn = at::empty({tc, H}, hopt);
        check_launch("prefill rmsnorm", nanoqwen::rmsnorm(hp(xn), h.data_ptr<float>(), L.ln1, (int)tc,
                                                          (int)H, a.eps, stream_));
        Tensor qkv;                                                               // [Tc, q+2kv]
        if (q4) {
          qkv = at::empty({tc, qn}, hopt);
          const Int4Scratch sc(qkv, tc, qn, H, false, split_counters_);
          check_launch("prefill gemm_int4 (qkv)",
                       nanoqwen::gemm_int4(hp(qkv), chp(xn), qw(lt[2]), chp(lt[3]), chp(lt[4]),
                                           (int)tc, (int)qn, (int)H, sc.get(), stream_));
        } else {
          qkv = at::linear(xn, W[0], lt[4]);
        }
        Tensor q = at::empty({tc, nh, hd}, hopt);
        check_launch("prefill rope_kv_write",
                     nanoqwen::rope_kv_write(hp(q), L.k_cache, L.v_cache, chp(qkv), a.cos, a.sin,
                                             pos_t[c].data_ptr<int32_t>(), a.page_table,
                                             a.table_len, (int)tc, (int)nh, (int)nkv, (int)hd,
                                             stream_));
        Tensor att;                                                               // [Tc, nh*hd]
        if (tables[c].defined()) {
          att = attention(q, lt[13], lt[14], tables[c], pos0 + s, pos0 + e);
        } else {
          att = at::empty({tc, nh * hd}, hopt);
          check_launch("prefill attention_prefill",
                       nanoqwen::attention_prefill(hp(att), chp(q), chp(lt[13]), chp(lt[14]),
                                                   a.page_table, (int)(pos0 + s), (int)tc,
                                                   (int)nh, (int)nkv, (int)hd, stream_));
        }
        if (q4) {
          const Int4Scratch sc(h, tc, H, nh * hd, false, split_counters_);
          check_launch("prefill gemm_int4_residual (o_proj)",
                       nanoqwen::gemm_int4_residual(h.data_ptr<float>(), chp(att), qw(lt[5]),
                                                    chp(lt[6]), (int)tc, (int)H, (int)(nh * hd),
                                                    sc.get(), stream_));
        } else {
          // h += att W_o^T in one cuBLAS call: fp16 operands, fp32 accumulation into the fp32
          // residual (beta = 1), no fp16 product written, read back and added by a second kernel
          at::addmm_out(h, h, att, W[1].t(), at::kFloat, 1, 1);
        }
        check_launch("prefill rmsnorm", nanoqwen::rmsnorm(hp(xn), h.data_ptr<float>(), L.ln2, (int)tc,
                                                          (int)H, a.eps, stream_));
        if (q4) {
          // gate and up summed in fp32 and SiLU*mul in fp32, one rounding (the decode GEMV's)
          Tensor act = at::empty({tc, I}, hopt);
          {
            const Int4Scratch sc(act, tc, I, H, true, split_counters_);
            check_launch("prefill gemm_int4_silu_mul (gate/up)",
                         nanoqwen::gemm_int4_silu_mul(hp(act), chp(xn), qw(lt[7]), chp(lt[8]),
                                                      qw(lt[9]), chp(lt[10]), (int)tc, (int)I,
                                                      (int)H, sc.get(), stream_));
          }
          const Int4Scratch sc(h, tc, H, I, false, split_counters_);
          check_launch("prefill gemm_int4_residual (down_proj)",
                       nanoqwen::gemm_int4_residual(h.data_ptr<float>(), chp(act), qw(lt[11]),
                                                    chp(lt[12]), (int)tc, (int)H, (int)I,
                                                    sc.get(), stream_));
        } else {
          Tensor gu = at::linear(xn, W[2]);                                       // [Tc, 2I]
          // fp32 math, one rounding, as the decode GEMV; one pass (the ATen chain of fp32
          // copies it replaced cost ~160 us a layer at 512 tokens: benchmarks/RESULTS.md)
          Tensor act = at::empty({tc, I}, hopt);
          check_launch("prefill silu_mul",
                       nanoqwen::silu_mul(hp(act), chp(gu), (int)tc, (int)I, stream_));
          at::addmm_out(h, h, act, W[3].t(), at::kFloat, 1, 1);   // h += act W_down^T, as o
        }
      }
      if (dq)   // the set's last reader is enqueued: the layer after next may overwrite it
        check_cuda(cudaEventRecord(dq_free_[set], stream_), "prefill: cudaEventRecord (set free)");
    }
    // the last row into the decode step's residual buffer: the same logits tail as a step
    g_[3].copy_(hidden.narrow(0, T - 1, 1));
    check_engine(nanoqwen::launch_logits(a, stream_), "prefill logits");
    if (sample) {
      g_[17].fill_((int)(pos0 + T - 1));
      check_engine(nanoqwen::launch_sample_advance(a, stream_), "prefill sample");
    }
  }

  // The verify step of speculative decoding (engine.h launch_verify): ids (CPU int32 [T], T <=
  // kMaxVerify) at positions pos0.. into the cache as T decode steps would write them; returns
  // the device logits of all of them, [T, V] fp32 (a view of the engine's buffer, valid until
  // the next verify; read it on the engine's stream). The page table must cover pos0 + T.
  // graph: replay the verify graph of T tokens (captured at its first use; eager when the
  // capture is refused, said once by verify_note()); otherwise the same launches, eager.
  Tensor verify(const Tensor& ids, int64_t pos0, bool graph) {
    const int64_t T = check_ids("verify", ids, pos0);
    NQ_CHECK(T <= nanoqwen::kMaxVerify, "verify: ", T, " tokens, at most ", nanoqwen::kMaxVerify);
    if (v_.empty()) alloc_verify();   // GIL held: allocates through ATen
    NoGil nogil;
    c10::InferenceMode im;
    const c10::cuda::CUDAGuard dg(device_);
    verify_nogil(ids.data_ptr<int32_t>(), T, pos0, graph);
    return v_[5].narrow(0, 0, T);
  }

  // The verify step with its T rows sampled on the device (speculation with a sampler or a
  // repetition penalty): verify(ids, pos0, graph), then row i sampled by sample_token as the
  // decode step at position pos0 + i samples it -- the penalty window ctx_tokens[..pos0 + i],
  // where the verify wrote the ids -- with params_f / params_i (start_turn's form; params_i[3],
  // the n-gram watch, is not read) and the draw Philox(params_i[2], i). Returns the T ids: no
  // logits leave the device, and nothing needs the GIL. Speculation keeps draft i iff row i's id
  // is the draft (Sampler.verify's rule, which keeps the target distribution).
  std::vector<int64_t> verify_sample(const Tensor& ids, int64_t pos0, bool graph,
                                     std::vector<double> params_f, std::vector<int64_t> params_i) {
    const char* op = "verify_sample";
    const int64_t T = check_ids(op, ids, pos0);
    NQ_CHECK(T <= nanoqwen::kMaxVerify, op, ": ", T, " tokens, at most ", nanoqwen::kMaxVerify);
    NQ_CHECK(params_f.size() == 4 && params_i.size() == 4, op, ": params_f and params_i hold 4 ",
             "values each, got ", (int64_t)params_f.size(), " and ", (int64_t)params_i.size());
    if (v_.empty()) alloc_verify();   // GIL held: allocates through ATen
    // v_[11] int32 [M pos rows | 4 params_f bits | M ids], v_[12] int64 [M counters | 4 params_i]
    constexpr int64_t M = nanoqwen::kMaxVerify;
    int32_t up[M + 4];
    for (int64_t i = 0; i < T; ++i) up[i] = (int32_t)(pos0 + i);
    for (int i = 0; i < 4; ++i) {
      const float f = (float)params_f[i];
      std::memcpy(&up[M + i], &f, sizeof(f));
    }
    int32_t got[M];
    NoGil nogil;
    c10::InferenceMode im;
    const c10::cuda::CUDAGuard dg(device_);
    int32_t* const rows = v_[11].data_ptr<int32_t>();
    int64_t* const counters = v_[12].data_ptr<int64_t>();
    // pageable sources: each copy has left them when it returns
    check_cuda(cudaMemcpyAsync(rows, up, T * sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
               "verify_sample: cudaMemcpyAsync of the rows' positions to the device");
    check_cuda(cudaMemcpyAsync(rows + M, up + M, 4 * sizeof(int32_t), cudaMemcpyHostToDevice,
                               stream_),
               "verify_sample: cudaMemcpyAsync of the sampler's params_f to the device");
    check_cuda(cudaMemcpyAsync(counters + M, params_i.data(), 4 * sizeof(int64_t),
                               cudaMemcpyHostToDevice, stream_),
               "verify_sample: cudaMemcpyAsync of the sampler's params_i to the device");
    verify_nogil(ids.data_ptr<int32_t>(), T, pos0, graph);
    const float* pf = reinterpret_cast<const float*>(rows + M);
    // the T rows in one launch, a cluster each (work: v_[13], a row each)
    check_engine(nanoqwen::sample_token(rows + M + 4, v_[13].data_ptr<float>(), vargs_.logits,
                                        a_.vocab, a_.ctx_tokens, a_.ctx_capacity, rows, pf,
                                        counters + M, counters, stream_, nullptr, 0, (int)T),
                 "verify_sample: sample_token of the verify rows");
    check_cuda(cudaMemcpyAsync(got, rows + M + 4, T * sizeof(int32_t), cudaMemcpyDeviceToHost,
                               stream_),
               "verify_sample: cudaMemcpyAsync of the sampled ids to the host");
    check_cuda(cudaStreamSynchronize(stream_), "verify_sample: the stream after the verify step");
    return std::vector<int64_t>(got, got + T);
  }

  // verify()'s work after its checks (GIL released, the device set): the ids and position up,
  // the ids into ctx_tokens, the verify step (graph or eager).
  void verify_nogil(const int32_t* idp, int64_t T, int64_t pos0, bool graph) {
    const int32_t pos32 = (int32_t)pos0;
    // pageable sources: each copy has left them when it returns
    check_cuda(cudaMemcpyAsync(vargs_.ids, idp, T * sizeof(int32_t), cudaMemcpyHostToDevice,
                               stream_),
               "verify: cudaMemcpyAsync of " + std::to_string(T) + " ids to the device");
    check_cuda(cudaMemcpyAsync(vargs_.pos, &pos32, sizeof(int32_t), cudaMemcpyHostToDevice,
                               stream_),
               "verify: cudaMemcpyAsync of the position to the device");
    // and into ctx_tokens at their positions, as the prefill and every decode step's advance
    // write theirs: the sampler's repetition penalty reads its window there, and a sampled
    // step after speculation (a plain run, a later turn) must see these ids, not stale ones.
    // A rejected draft's slot is rewritten by whatever fills its position next.
    check_cuda(cudaMemcpyAsync(g_[20].data_ptr<int32_t>() + pos0, vargs_.ids, T * sizeof(int32_t),
                               cudaMemcpyDeviceToDevice, stream_),
               "verify: cudaMemcpyAsync of " + std::to_string(T) + " ids to ctx_tokens[" +
                   std::to_string(pos0) + "..]");
    if (graph && !vexec_[T] && !vgraph_refused_) {
      if (nanoqwen::capture_verify(a_, vargs_, (int)T, stream_, &vexec_[T]) != cudaSuccess) {
        vgraph_refused_ = true;   // eager from now on; the reason kept for verify_note()
        vnote_ = nanoqwen::take_last_error();
        (void)cudaGetLastError();
      }
    }
    if (graph && vexec_[T])
      check_cuda(cudaGraphLaunch(vexec_[T], stream_),
                 "verify: cudaGraphLaunch of the verify graph (T=" + std::to_string(T) + ")");
    else
      check_engine(nanoqwen::launch_verify(a_, vargs_, (int)T, stream_), "verify step");
  }
  std::string verify_note() { return vnote_; }

  // The latest speculative turn's figures so far: [ids drafted, drafts kept, verify steps]
  // (spec_accept writes them to pinned host memory as each verify step ends; no sync).
  std::vector<int64_t> spec_stats() {
    const volatile int64_t* h = sargs_.host;
    if (h == nullptr) return {0, 0, 0};
    return {h[nanoqwen::kSpecHostDrafted], h[nanoqwen::kSpecHostAccepted],
            h[nanoqwen::kSpecHostVerifySteps]};
  }
  // Why graph-mode speculative steps launch eagerly ("" when the speculative graph was captured
  // or never asked for).
  std::string spec_note() { return loop_->spec_note(); }

  ~Engine() {
    for (cudaGraphExec_t& x : vexec_)
      if (x) cudaGraphExecDestroy(x);
    for (cudaEvent_t e : {dq_start_, dq_ready_[0], dq_ready_[1], dq_free_[0], dq_free_[1]})
      if (e) cudaEventDestroy(e);
    if (dq_stream_) cudaStreamDestroy(dq_stream_);
  }

  // Start the launcher thread for steps 1..n_steps (engine.h).
  void start(int64_t n_steps, bool graph, int64_t run_ahead) {
    NQ_CHECK(n_steps >= 0 && run_ahead >= 1, "start: n_steps=", n_steps, ", run_ahead=", run_ahead);
    loop_->set_graph(graph);
    if (n_steps > 0) loop_->start(n_steps, (int)run_ahead);
  }
  void set_graph(bool graph) { loop_->set_graph(graph); }
  void cancel() { loop_->cancel(); }
  void consumed(int64_t n) { loop_->consumed(n); }

  // Tokens first.. as they land (DecodeLoop::collect): (ids, GPU end times in ns, status).
  std::tuple<std::vector<int64_t>, std::vector<int64_t>, int64_t> collect(
      int64_t first, int64_t max_n, double min_wait_ms, double timeout_ms) {
    NQ_CHECK(first >= 0 && max_n >= 1, "collect: first=", first, ", max_n=", max_n);
    std::vector<nanoqwen::RingToken> got;
    int status;
    {
      NoGil nogil;
      const c10::cuda::CUDAGuard dg(device_);
      status = loop_->collect(first, max_n, (int64_t)(min_wait_ms * 1e3),
                              (int64_t)(timeout_ms * 1e3), &got);
    }
    std::vector<int64_t> ids, ts;
    ids.reserve(got.size());
    ts.reserve(got.size());
    for (const auto& t : got) {
      ids.push_back(t.token);
      ts.push_back((int64_t)t.t_ns);
    }
    return {ids, ts, (int64_t)status};
  }

  // Stop the launcher thread and wait for every queued step (the turn is over).
  void finish() {
    NoGil nogil;
    const c10::cuda::CUDAGuard dg(device_);
    finish_nogil();
  }

  void finish_nogil() {
    loop_->cancel();
    loop_->stop();
    check_cuda(cudaStreamSynchronize(stream_),
               "finish: cudaStreamSynchronize (the decode stream failed after " +
                   std::to_string(loop_->launched()) + " launched steps)");
  }

  std::string error() { return loop_->error(); }
  int64_t start_ns() { return (int64_t)*reinterpret_cast<volatile uint64_t*>(loop_->start_stamp()); }
  int64_t launched() { return loop_->launched(); }
  bool halted() { return loop_->halted(); }
  bool gated() { return loop_->gated(); }

 private:
  // layer li's INT4 weights -> fp16 scratch set `set` (d_[4 set .. 4 set + 3]) on `stream`
  void dequant_layer(size_t li, int set, cudaStream_t stream) {
    const Tensor* lt = &l_[15 * li];
    const Tensor* d = &d_[4 * set];
    const int64_t I = a_.I;
    auto dq = [&](const Tensor& w, const Tensor& qweight, const Tensor& scales) {
      check_launch("prefill dequant_int4",
                   nanoqwen::dequant_int4(hp(w), qw(qweight), chp(scales), (int)w.size(0),
                                          (int)w.size(1), stream));
    };
    dq(d[0], lt[2], lt[3]);
    dq(d[1], lt[5], lt[6]);
    dq(d[2].narrow(0, 0, I), lt[7], lt[8]);
    dq(d[2].narrow(0, I, I), lt[9], lt[10]);
    dq(d[3], lt[11], lt[12]);
  }

  // Causal GQA attention of queries at positions q0..q1-1 over cached positions 0..q1-1, whose
  // pages are `table` (int64, the first ceil(q1 / 16) entries of the page table).
  Tensor attention(const Tensor& q, const Tensor& k_l, const Tensor& v_l, const Tensor& table,
                   int64_t q0, int64_t q1) {
    const int64_t s = q1, used = table.size(0);
    const int64_t nkv = a_.n_kv, hd = a_.head_dim;
    Tensor k = k_l.index_select(0, table).reshape({used * nanoqwen::kPageSize, nkv, hd})
                   .narrow(0, 0, s).permute({1, 0, 2}).unsqueeze(0);
    Tensor v = v_l.index_select(0, table).reshape({used * nanoqwen::kPageSize, nkv, hd})
                   .narrow(0, 0, s).permute({1, 0, 2}).unsqueeze(0);
    Tensor qq = q.permute({1, 0, 2}).unsqueeze(0);                                  // [1, nh, Tc, D]
    // Not cuDNN's SDPA, PyTorch's first choice on Hopper: it builds an execution plan for each
    // new sequence length, measured 60-90 ms on the first prefill at a length (every chat turn
    // has a new one) against 6-11 ms after (benchmarks/RESULTS.md, session 6); flash and
    // memory-efficient attention take any length as it comes.
    NoCudnnSdp no_cudnn;
    Tensor out;
    if (q0 == 0) {
      out = at::scaled_dot_product_attention(qq, k, v, {}, 0.0, true, c10::nullopt, true);
    } else {
      // A cached prefix: query i sees keys 0..q0+i, the causal mask aligned to the bottom
      // right. The flash kernel's own causal mask is aligned so when there are fewer queries
      // than keys (what torch.nn.attention.bias.causal_lower_right calls), and it takes the
      // GQA heads as they are. SDPA with that mask as a boolean tensor ran the masked
      // fallback: 14-15 ms for 40 new tokens at 7B against 6-7 ms without a prefix
      // (benchmarks/RESULTS.md, session 9).
      out = std::get<0>(at::_scaled_dot_product_flash_attention(qq, k, v, 0.0, true, false,
                                                                 c10::nullopt));
    }
    return out[0].permute({1, 0, 2}).reshape({q1 - q0, a_.n_heads * hd});
  }

  // verify()'s buffers (engine.h VerifyArgs), kMaxVerify rows each, made at the first verify:
  // ids, pos, hidden, xn, qkv, logits, attn, act, ws_acc, ws_ml, counters; then verify_sample's
  // int32 [M positions | 4 params_f | M ids], int64 [M draw counters | 4 params_i] and fp32
  // [M, V] (the draws' scratch)
  void alloc_verify() {
    const int64_t M = nanoqwen::kMaxVerify, H = a_.H, I = a_.I, nh = a_.n_heads,
                  nkv = a_.n_kv, hd = a_.head_dim, S = a_.num_splits;
    const auto f = g_[3].options(), h = g_[4].options(), i = g_[17].options();
    v_ = {at::empty({M}, i), at::empty({1}, i), at::empty({M, H}, f), at::empty({M, H}, h),
          at::empty({M, (nh + 2 * nkv) * hd}, h), at::empty({M, (int64_t)a_.vocab}, f),
          at::empty({M, nh * hd}, h), at::empty({M, I}, h),
          at::empty({M * nh * S * hd}, f), at::empty({M * nh * S * 2}, f),
          at::zeros({M * nkv}, i), at::empty({2 * M + 4}, i),
          at::arange(M + 4, g_[19].options()),    // verify_sample's (the counters 0..M-1)
          at::empty({M, (int64_t)a_.vocab}, f)};  // and its draws' scratch (sample_token's work)
    nanoqwen::VerifyArgs& v = vargs_;
    v.ids = v_[0].data_ptr<int32_t>(); v.pos = v_[1].data_ptr<int32_t>();
    v.hidden = v_[2].data_ptr<float>(); v.xn = hp(v_[3]); v.qkv = hp(v_[4]);
    v.logits = v_[5].data_ptr<float>(); v.attn = hp(v_[6]); v.act = hp(v_[7]);
    v.ws_acc = v_[8].data_ptr<float>(); v.ws_ml = v_[9].data_ptr<float>();
    v.attn_counters = v_[10].data_ptr<int32_t>();
  }

  // speculation on the device (engine.h SpecArgs): its rows' positions, draw counters and ids,
  // the drafter's state; the rows' sampling scratch is verify_sample's (v_[13]: the two never
  // run at once); the host block is the loop's. After alloc_verify().
  void alloc_spec() {
    const int64_t M = nanoqwen::kMaxVerify;
    const auto i = g_[17].options(), l = g_[19].options();
    s_ = {at::zeros({M}, i), at::zeros({M}, l), at::zeros({M}, i),
          at::zeros({nanoqwen::kSpecStateLen}, i)};
    sargs_.v = vargs_;
    sargs_.row_pos = s_[0].data_ptr<int32_t>();
    sargs_.row_counter = s_[1].data_ptr<int64_t>();
    sargs_.row_ids = s_[2].data_ptr<int32_t>();
    sargs_.row_work = v_[13].data_ptr<float>();
    sargs_.state = s_[3].data_ptr<int32_t>();
    check_engine(loop_->set_spec(&sargs_), "speculation's buffers");
    spec_state_ = s_[3];
  }

  std::vector<Tensor> g_, l_, d_, v_, s_;
  nanoqwen::SpecArgs sargs_;
  Tensor spec_state_;   // defined once alloc_spec() ran
  nanoqwen::VerifyArgs vargs_;
  cudaGraphExec_t vexec_[nanoqwen::kMaxVerify + 1] = {};   // by T
  bool vgraph_refused_ = false;
  std::string vnote_;
  bool resident_ = false;
  bool int4_ = false;   // the prefill multiplies the INT4 weights (gemm_int4), no fp16 copy
  int64_t int4_max_m_ = 0;   // dequant weights: chunks this short through gemm_int4 instead
  int64_t prefill_attn_max_ = 0;   // chunks ending at most here: attention_prefill, else SDPA
  Tensor split_counters_;    // gemm_int4's split-K tile counters (kGemmCounters, kept zeroed)
  Tensor norm_parts_;        // the folded norm's parts [H/16] (StepArgs::norm_parts); none: fold off
  int64_t chunk_ = 2048;
  c10::Device device_{c10::kCUDA, 0};
  cudaStream_t stream_ = nullptr;
  cudaStream_t dq_stream_ = nullptr;   // dequant weights: the next layer's dequantization
  cudaEvent_t dq_start_ = nullptr, dq_ready_[2] = {}, dq_free_[2] = {};
  nanoqwen::StepArgs a_;
  std::unique_ptr<nanoqwen::DecodeLoop> loop_;
  int32_t stops_host_[1 + nanoqwen::kMaxStops] = {};
};

}  // namespace nanoqwen_ops

TORCH_LIBRARY(nanoqwen, m) {
  // the engine core: decode step, halt-gated graph, launcher thread, prefill (csrc/engine.h)
  m.class_<nanoqwen_ops::Engine>("Engine")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<int64_t>, double, int64_t>())
      .def("capture", &nanoqwen_ops::Engine::capture)
      .def("capture_note", &nanoqwen_ops::Engine::capture_note)
      .def("run_step", &nanoqwen_ops::Engine::run_step)
      .def("begin_turn", &nanoqwen_ops::Engine::begin_turn)
      .def("start_turn", &nanoqwen_ops::Engine::start_turn)
      .def("prefill", &nanoqwen_ops::Engine::prefill)
      .def("verify", &nanoqwen_ops::Engine::verify)
      .def("verify_sample", &nanoqwen_ops::Engine::verify_sample)
      .def("verify_note", &nanoqwen_ops::Engine::verify_note)
      .def("spec_stats", &nanoqwen_ops::Engine::spec_stats)
      .def("spec_note", &nanoqwen_ops::Engine::spec_note)
      .def("start", &nanoqwen_ops::Engine::start)
      .def("set_graph", &nanoqwen_ops::Engine::set_graph)
      .def("cancel", &nanoqwen_ops::Engine::cancel)
      .def("consumed", &nanoqwen_ops::Engine::consumed)
      .def("collect", &nanoqwen_ops::Engine::collect)
      .def("finish", &nanoqwen_ops::Engine::finish)
      .def("error", &nanoqwen_ops::Engine::error)
      .def("start_ns", &nanoqwen_ops::Engine::start_ns)
      .def("launched", &nanoqwen_ops::Engine::launched)
      .def("halted", &nanoqwen_ops::Engine::halted)
      .def("gated", &nanoqwen_ops::Engine::gated);
  // token ids -> fp32 residual rows (decode: T=1 reading the id the last step sampled)
  // (parts: the decode step's folded norm's sum-of-squares parts of each row, [T, H/16])
  m.def("embed_gather(Tensor! hidden, Tensor table, Tensor ids, Tensor(a!)? parts=None) -> ()");
  // fp32 residual rows -> fp16 normed rows (input/post-attention/final norm)
  m.def("rmsnorm(Tensor! out, Tensor hidden, Tensor weight, float eps) -> ()");
  // RoPE on q,k of qkv rows at positions pos.. + write k,v into the layer's 16-token pages
  m.def("rope_kv_write(Tensor! q_out, Tensor! k_cache, Tensor! v_cache, Tensor qkv, Tensor cos, "
        "Tensor sin, Tensor pos, Tensor page_table) -> ()");
  // penalty/greedy/top-k/top-p/min-p/temperature sampling with params in device memory
  m.def("sample_token(Tensor! out_token, Tensor! work, Tensor logits, Tensor ctx_tokens, "
        "Tensor pos, Tensor params_f, Tensor params_i, Tensor counter, "
        "Tensor(a!)? path=None, int blocks=0) -> ()");
  // end of step: sampled id -> next input, pos += 1, context ids, pinned host ring, counter += 1;
  // with params_i, its [3] the n-gram watch (kernels.h)
  m.def("advance_step(Tensor! token_in, Tensor! pos, Tensor! ctx_tokens, Tensor! counter, "
        "Tensor! host_ring, Tensor sampled, Tensor stops, Tensor! halt, "
        "Tensor? params_i=None) -> ()");
  // INT4 g128 GEMV y = W x + bias (the fused q/k/v projection); every GEMV takes x [k] or
  // [cols <= 16, k] (the verify step's tokens; each column as a one-column call computes it)
  m.def("gemv_int4(Tensor! y, Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> ()");
  // INT4 GEMV accumulated into the fp32 residual (o_proj, down_proj); with parts (one column)
  // also the updated rows' sum-of-squares parts (the decode step's folded norm, gemv.h)
  m.def("gemv_int4_residual(Tensor! hidden, Tensor x, Tensor qweight, Tensor scales, "
        "Tensor(a!)? parts=None) -> ()");
  // the decode step's folded norms: gemv_int4 / gemv_int4_silu_mul of rmsnorm(hidden, ln) formed
  // from hidden's parts
  m.def("gemv_int4_norm(Tensor! y, Tensor hidden, Tensor parts, Tensor ln, float eps, "
        "Tensor qweight, Tensor scales, Tensor? bias) -> ()");
  m.def("gemv_int4_silu_mul_norm(Tensor! out, Tensor hidden, Tensor parts, Tensor ln, float eps, "
        "Tensor qw_gate, Tensor sc_gate, Tensor qw_up, Tensor sc_up) -> ()");
  // fused gate/up INT4 GEMV with silu(gate) * up
  m.def("gemv_int4_silu_mul(Tensor! out, Tensor x, Tensor qw_gate, Tensor sc_gate, Tensor qw_up, "
        "Tensor sc_up) -> ()");
  // fp16 lm_head GEMV to fp32 logits
  m.def("gemv_fp16(Tensor! logits, Tensor x, Tensor w) -> ()");
  // RoPE + K/V write + split-K paged attention + split merge for one decode token, one launch
  // (min_pps: minimum KV pages per split, 0 = kDecMinPpsDefault; kernel: the page loop, 0
  // cp.async split-K, 1 TMA warp-specialized on tensor cores; the engine passes its switches)
  // the prefill's causal GQA attention of a chunk's rotated q over the paged cache
  m.def("attention_prefill(Tensor! out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor page_table, int q0) -> ()");
  m.def("attention_decode(Tensor! out, Tensor! ws_acc, Tensor! ws_ml, Tensor! counters, "
        "Tensor qkv, Tensor! k_cache, Tensor! v_cache, Tensor cos, Tensor sin, "
        "Tensor page_table, Tensor pos, int min_pps=0, int kernel=0) -> ()");
  m.def("attention_verify(Tensor! out, Tensor! ws_acc, Tensor! ws_ml, Tensor! counters, "
        "Tensor qkv, Tensor! k_cache, Tensor! v_cache, Tensor cos, Tensor sin, "
        "Tensor page_table, Tensor pos, int min_pps=0, int kernel=0) -> ()");
  // INT4 -> fp16 weight (prefill feeds cuBLAS with it)
  m.def("dequant_int4(Tensor! w, Tensor qweight, Tensor scales) -> ()");
  // the fp16 prefill's silu(gate) * up from the fused gate/up GEMM's rows
  m.def("silu_mul(Tensor! out, Tensor gu) -> ()");
  // the prefill's INT4 GEMMs over m tokens (prefill_weights "int4")
  m.def("gemm_int4(Tensor! y, Tensor x, Tensor qweight, Tensor scales, Tensor? bias=None) -> ()");
  m.def("gemm_int4_residual(Tensor! hidden, Tensor x, Tensor qweight, Tensor scales) -> ()");
  m.def("gemm_int4_silu_mul(Tensor! out, Tensor x, Tensor qw_gate, Tensor sc_gate, Tensor qw_up, "
        "Tensor sc_up) -> ()");
}

TORCH_LIBRARY_IMPL(nanoqwen, CUDA, m) {
  m.impl("embed_gather", &nanoqwen_ops::embed_gather);
  m.impl("rmsnorm", &nanoqwen_ops::rmsnorm);
  m.impl("rope_kv_write", &nanoqwen_ops::rope_kv_write);
  m.impl("sample_token", &nanoqwen_ops::sample_token);
  m.impl("advance_step", &nanoqwen_ops::advance_step);
  m.impl("gemv_int4", &nanoqwen_ops::gemv_int4);
  m.impl("gemv_int4_residual", &nanoqwen_ops::gemv_int4_residual);
  m.impl("gemv_int4_norm", &nanoqwen_ops::gemv_int4_norm);
  m.impl("gemv_int4_silu_mul_norm", &nanoqwen_ops::gemv_int4_silu_mul_norm);
  m.impl("gemm_int4", &nanoqwen_ops::gemm_int4);
  m.impl("gemm_int4_residual", &nanoqwen_ops::gemm_int4_residual);
  m.impl("gemm_int4_silu_mul", &nanoqwen_ops::gemm_int4_silu_mul);
  m.impl("gemv_int4_silu_mul", &nanoqwen_ops::gemv_int4_silu_mul);
  m.impl("gemv_fp16", &nanoqwen_ops::gemv_fp16);
  m.impl("dequant_int4", &nanoqwen_ops::dequant_int4);
  m.impl("silu_mul", &nanoqwen_ops::silu_mul);
  m.impl("attention_decode", &nanoqwen_ops::attention_decode);
  m.impl("attention_verify", &nanoqwen_ops::attention_verify);
  m.impl("attention_prefill", &nanoqwen_ops::attention_prefill);
}
