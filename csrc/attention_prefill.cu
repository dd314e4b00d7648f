// attention_prefill: the prefill's causal GQA attention of a prompt chunk's queries over the
// paged K/V cache, in one launch (kernels.h says what it promises). It replaces, per layer and
// chunk, two index_select gathers of the cached K/V into contiguous copies and PyTorch's SDPA
// (flash attention), whose host work made the small models' prefill wait for the CPU
// (benchmarks/RESULTS.md, session 21: 0.5B pp512 enqueued in 3.45 ms for 1.94 ms of kernels).
//
// FlashAttention-2 on mma.sync m16n8k16: grid (query tiles of 64 rows, n_heads), the longest
// rows' tiles first; 4 warps a block, warp w owns query rows 16w..16w+15 of the tile (its
// rotated q held as A fragments in registers for the whole loop). The block walks the keys
// 0 .. its last query's position in tiles of 64 (4 pages), double-buffered in shared memory:
// cp.async of tile t+1's K and V rows (page ids from the page table, 16 bytes a copy, rows past
// the last key zero-filled) while tile t is used. Per tile and warp: S = Q K^T (B = 16 keys of K
// by ldmatrix), the causal mask where the tile reaches past the warp's first row (scores of keys
// after a row's position are -inf by select), an online softmax in base 2 per row (fp32), then
// O += P V (A = P rounded to fp16 in the accumulator layout of S, as FlashAttention-2 does;
// B = V by ldmatrix.trans). A warp skips the tiles wholly after its last row. Shared rows are
// 16-byte chunks swizzled by the row (chunk c of row r at c ^ (r & 7) within its 8-chunk group),
// so ldmatrix's 8 rows at one logical chunk hit 8 bank groups. Running maxima start at -1e30
// (finite): a row with every key of a tile masked keeps corr = 1 and p = 0, no NaN. The block
// barriers sit outside every warp-dependent branch.
#include <math_constants.h>

#include "common.cuh"
#include "kernels.h"

namespace nanoqwen {
namespace {

constexpr int kPfWarps = 4;
constexpr int kPfThreads = kPfWarps * 32;
constexpr int kPfRows = 16 * kPfWarps;   // query rows a block
constexpr int kPfKeys = 64;              // keys a tile (4 pages)

template <int HD>
struct PfTile {
  static constexpr int kChunks = HD / 8;              // 16-byte chunks a row
  static constexpr int kBytes = kPfKeys * HD * 2;     // K (or V) of one tile
  static constexpr int kSmem = 2 * 2 * kBytes;        // two buffers of K and V
  __device__ static __forceinline__ int at(int r, int c) {
    return r * (HD * 2) + (((c & ~7) | ((c ^ r) & 7)) << 4);
  }
};

__device__ __forceinline__ uint32_t ld_u32(const half* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <int HD>
__global__ void __launch_bounds__(kPfThreads)
attn_prefill_kernel(half* __restrict__ out, const half* __restrict__ q,
                    const half* __restrict__ k_cache, const half* __restrict__ v_cache,
                    const int32_t* __restrict__ page_table, int q0, int T, int n_heads,
                    int n_kv, float scale_log2) {
  using Tile = PfTile<HD>;
  constexpr int NT = HD / 8;   // 8-dim tiles of the output row
  extern __shared__ __align__(128) unsigned char s_tiles[];
  griddep_wait();   // q and this chunk's K/V rows: rope_kv_write, the kernel before
  griddep_launch_dependents();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gid = lane >> 2, tig = lane & 3;
  const int tile = gridDim.x - 1 - blockIdx.x;   // the longest rows first
  const int h = blockIdx.y, kvh = h / (n_heads / n_kv);
  const int r0 = tile * kPfRows;
  const int n_keys = q0 + min(T, r0 + kPfRows);   // keys 0 .. the block's last position
  const int n_tiles = (n_keys + kPfKeys - 1) / kPfKeys;
  const size_t slot = (size_t)n_kv * HD;          // halves between a page's token slots

  auto load_tile = [&](int kt, int buf) {
    unsigned char* ks = s_tiles + buf * 2 * Tile::kBytes;
    unsigned char* vs = ks + Tile::kBytes;
    for (int i = threadIdx.x; i < kPfKeys * Tile::kChunks; i += kPfThreads) {
      const int r = i / Tile::kChunks, c = i % Tile::kChunks;
      const int key = kt * kPfKeys + r;
      const bool ok = key < n_keys;
      size_t off = 0;   // a valid address even when nothing is read
      if (ok)
        off = ((size_t)page_table[key / kPageSize] * kPageSize + key % kPageSize) * slot +
              (size_t)kvh * HD + c * 8;
      cp_async16_zfill(ks + Tile::at(r, c), k_cache + off, ok);
      cp_async16_zfill(vs + Tile::at(r, c), v_cache + off, ok);
    }
    cp_async_commit();
  };
  load_tile(0, 0);

  // rows a = r0 + 16 warp + gid and b = a + 8 of the chunk; their positions q0 + row
  const int ta = r0 + 16 * warp + gid, tb = ta + 8;
  const int pos_a = q0 + ta, pos_b = q0 + tb;
  const bool warp_rows = r0 + 16 * warp < T;                    // warp-uniform
  const int warp_first = q0 + r0 + 16 * warp;                   // its first row's position
  const int warp_last = q0 + min(r0 + 16 * warp + 15, T - 1);   // and its last's
  uint32_t qa[HD / 16][4];   // A fragments: (a, k lo), (b, k lo), (a, k hi), (b, k hi)
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    const half* pa = q + ((size_t)ta * n_heads + h) * HD + kk * 16 + 2 * tig;
    const half* pb = q + ((size_t)tb * n_heads + h) * HD + kk * 16 + 2 * tig;
    qa[kk][0] = ta < T ? ld_u32(pa) : 0u;
    qa[kk][1] = tb < T ? ld_u32(pb) : 0u;
    qa[kk][2] = ta < T ? ld_u32(pa + 8) : 0u;
    qa[kk][3] = tb < T ? ld_u32(pb + 8) : 0u;
  }
  // ldmatrix row addresses: lane l feeds row (l & 7) of matrix l >> 3
  const int mi = lane >> 3, mr = lane & 7;
  const int k_row = (mi >> 1) * 8 + mr, k_q = mi & 1;   // K: key row, chunk within a k16 step
  const int v_row = (mi & 1) * 8 + mr, v_q = mi >> 1;   // V (transposed): the same for a d16 tile

  float m_a = kNegBig, m_b = kNegBig, l_a = 0.f, l_b = 0.f;   // l: this lane's share
  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  for (int kt = 0; kt < n_tiles; ++kt) {
    if (kt + 1 < n_tiles) {
      load_tile(kt + 1, (kt + 1) & 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();   // tile kt has landed for every thread's copies
    const unsigned char* ks = s_tiles + (kt & 1) * 2 * Tile::kBytes;
    const unsigned char* vs = ks + Tile::kBytes;
    const int key0 = kt * kPfKeys;
    if (warp_rows && key0 <= warp_last) {   // warp-uniform; no barrier inside
      // S = Q K^T: 8 n8 tiles of keys
      float sc[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          uint32_t b[4];
          ldmatrix_x4(b, ks + Tile::at(16 * g + k_row, 2 * kk + k_q));
          mma16816(sc[2 * g], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
          mma16816(sc[2 * g + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[2], b[3]);
        }
      }
      // scale (base 2) and the causal mask where the tile reaches past the warp's first row
      const bool masked = key0 + kPfKeys - 1 > warp_first;   // warp-uniform
      float mx_a = kNegBig, mx_b = kNegBig;
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = key0 + 8 * n + 2 * tig + e;
          float xa = sc[n][e] * scale_log2, xb = sc[n][2 + e] * scale_log2;
          if (masked) {
            xa = key <= pos_a ? xa : -CUDART_INF_F;
            xb = key <= pos_b ? xb : -CUDART_INF_F;
          }
          sc[n][e] = xa;
          sc[n][2 + e] = xb;
          mx_a = fmaxf(mx_a, xa);
          mx_b = fmaxf(mx_b, xb);
        }
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
      const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);   // finite
      const float corr_a = exp2f(m_a - mn_a), corr_b = exp2f(m_b - mn_b);
      float ps_a = 0.f, ps_b = 0.f;
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          sc[n][e] = exp2f(sc[n][e] - mn_a);   // 0 for masked keys
          sc[n][2 + e] = exp2f(sc[n][2 + e] - mn_b);
          ps_a += sc[n][e];
          ps_b += sc[n][2 + e];
        }
      l_a = fmaf(l_a, corr_a, ps_a);
      l_b = fmaf(l_b, corr_b, ps_b);
      m_a = mn_a;
      m_b = mn_b;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        acc[n][0] *= corr_a;
        acc[n][1] *= corr_a;
        acc[n][2] *= corr_b;
        acc[n][3] *= corr_b;
      }
      // O += P V: P's accumulator layout is the A fragment's (rows a / b, keys 2 tig (+8))
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t p0 = h2_bits(__floats2half2_rn(sc[2 * kk][0], sc[2 * kk][1]));
        const uint32_t p1 = h2_bits(__floats2half2_rn(sc[2 * kk][2], sc[2 * kk][3]));
        const uint32_t p2 = h2_bits(__floats2half2_rn(sc[2 * kk + 1][0], sc[2 * kk + 1][1]));
        const uint32_t p3 = h2_bits(__floats2half2_rn(sc[2 * kk + 1][2], sc[2 * kk + 1][3]));
#pragma unroll
        for (int dt = 0; dt < HD / 16; ++dt) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, vs + Tile::at(16 * kk + v_row, 2 * dt + v_q));
          mma16816(acc[2 * dt], p0, p1, p2, p3, b[0], b[1]);
          mma16816(acc[2 * dt + 1], p0, p1, p2, p3, b[2], b[3]);
        }
      }
    }
    __syncthreads();   // every warp is done with buffer kt & 1: the load of tile kt + 2 may go
  }

  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  const size_t row = (size_t)n_heads * HD;
  if (ta < T) {
    const float inv = 1.f / l_a;   // l_a >= 1: the row's maximum key contributes 2^0
    half2* o = reinterpret_cast<half2*>(out + ta * row + (size_t)h * HD + 2 * tig);
#pragma unroll
    for (int n = 0; n < NT; ++n) o[4 * n] = __floats2half2_rn(acc[n][0] * inv, acc[n][1] * inv);
  }
  if (tb < T) {
    const float inv = 1.f / l_b;
    half2* o = reinterpret_cast<half2*>(out + tb * row + (size_t)h * HD + 2 * tig);
#pragma unroll
    for (int n = 0; n < NT; ++n) o[4 * n] = __floats2half2_rn(acc[n][2] * inv, acc[n][3] * inv);
  }
}

template <int HD>
cudaError_t launch_prefill(half* out, const half* q, const half* k_cache, const half* v_cache,
                           const int32_t* page_table, int q0, int T, int n_heads, int n_kv,
                           cudaStream_t stream) {
  constexpr int smem = PfTile<HD>::kSmem;
  static const cudaError_t attr = set_max_smem(attn_prefill_kernel<HD>, smem);
  if (attr != cudaSuccess) return smem_refused(attr, "attn_prefill_kernel", smem);
  const float scale_log2 = 1.4426950408889634f / sqrtf((float)HD);
  const dim3 grid((unsigned)((T + kPfRows - 1) / kPfRows), (unsigned)n_heads);
  return launch_pdl("attn_prefill_kernel", attn_prefill_kernel<HD>, grid, dim3(kPfThreads),
                    (size_t)smem, stream, out, q, k_cache, v_cache, page_table, q0, T, n_heads,
                    n_kv, scale_log2);
}

}  // namespace

cudaError_t attention_prefill(half* out, const half* q, const half* k_cache, const half* v_cache,
                              const int32_t* page_table, int q0, int T, int n_heads, int n_kv,
                              int head_dim, cudaStream_t stream) {
  if (T <= 0) return cudaSuccess;
  if (q0 < 0 || n_kv < 1 || n_heads < n_kv || n_heads % n_kv || n_heads > 65535 ||
      (head_dim != 64 && head_dim != 128))
    return nq_fail(cudaErrorInvalidValue,
                   "attention_prefill: q0=%d, n_heads=%d, n_kv=%d, head_dim=%d: q0 >= 0, n_heads "
                   "a multiple of n_kv (at most 65535) and head_dim 64 or 128 are required (T=%d)",
                   q0, n_heads, n_kv, head_dim, T);
  if (!out || !q || !k_cache || !v_cache || !page_table || misaligned16(out) || misaligned16(q) ||
      misaligned16(k_cache) || misaligned16(v_cache))
    return nq_fail(cudaErrorInvalidValue,
                   "attention_prefill: out=%p q=%p k_cache=%p v_cache=%p must be 16-byte aligned "
                   "and page_table=%p non-null", (void*)out, (const void*)q,
                   (const void*)k_cache, (const void*)v_cache, (const void*)page_table);
  const cudaError_t e =
      head_dim == 128
          ? launch_prefill<128>(out, q, k_cache, v_cache, page_table, q0, T, n_heads, n_kv, stream)
          : launch_prefill<64>(out, q, k_cache, v_cache, page_table, q0, T, n_heads, n_kv, stream);
  if (e == cudaSuccess) return e;
  return nq_fail(e, "attention_prefill: q0=%d T=%d n_heads=%d n_kv=%d head_dim=%d: %s", q0, T,
                 n_heads, n_kv, head_dim, last_error_message());
}

}  // namespace nanoqwen
