// decode_segment.cu -- the decode step's GEMV chain as persistent segment kernels (issue 12 item 1):
// one launch runs, for a layer boundary, o_proj (+residual) -> RMSNorm -> gate/up (SiLU*mul) ->
// down_proj (+residual) of layer l-1 and RMSNorm -> q/k/v (+bias) of layer l. A step is then
// L + 1 segments with attention_decode between them (2L + 5 launches with the logits and the
// sampler, against 7L + 4 for the chain), and the weights of a segment's four GEMVs stream through
// one shared-memory ring without a gap at the GEMV boundaries.
//
// Grid: one block per SM (all resident: the blocks wait for each other). Block: 8 consumer warps
// and one producer warp (warp 8).
//   * The producer streams the block's share of the segment's INT4 weights and scales, in the
//     order the consumers use them, through a ring of `stages` stages by cp.async, each stage
//     announced on its `full` mbarrier by cp.async.mbarrier.arrive.noinc (32 arrivals, one a
//     lane) and recycled through its `empty` mbarrier (8 arrivals, one a consumer warp). The
//     weights do not depend on the step's data, so the producer never waits for anything but a
//     free stage: it is ahead while the consumers wait for another block's results, and it
//     starts before griddep_wait() (PDL; common.cuh rule 1: it only reads weights).
//   * Work: phase p's 16-row tiles go round-robin over the blocks, continuing the count of the
//     phases before it (phase p's tile t belongs to block (base_p + t) % grid), so every block
//     streams about the same bytes in a segment. A block takes its tiles in sets of 8/KS, KS the
//     chain's K split for that GEMV (gemv_int4.cu's table: 4 q/k/v, 4 o, 2 gate/up, 8 down):
//     consumer warp w serves tile w / KS of the set and K range w % KS, the contiguous groups
//     [s*G/KS, (s+1)*G/KS) -- the chain kernel's warp s. A stage holds, for each warp, one group
//     (16 rows x 64 bytes + the 16 rows' scales) of its range; gate and up are separate stages.
//   * So every row's sum is the chain's, bit for bit: group_dot (int4_dot.cuh) per group, the
//     group scale by fmaf in group order, the KS range sums added in range order, the same
//     epilogue; and the norm is rmsnorm_kernel's (512 virtual threads on 256, the same partial
//     sums and the same reduction tree). The step's hidden state and logits equal the chain's.
//   * Between phases: a block that ends its last tile of phase p adds 1 to counters[p]
//     (every writer __threadfence(), a named barrier, one release add); a block that has tiles in
//     phase p + 1 waits (one acquire load loop, then the named barrier) until counters[p] counts
//     every block that had tiles in p, then stages its x (the norm of hidden, or the attention /
//     SiLU output) in shared memory. Data other blocks wrote in this launch is read with
//     ld.global.cg (L2), never from L1.
//   * Segment 0 starts with the embedding: block 0 writes hidden = embed[token] and publishes it
//     on counters[kSegEmbed]. The last block to finish (counters[kSegExit]) zeroes the counters.
// Barriers: the block barriers (__syncthreads) sit outside the role branches; inside them only
// mbarriers, __syncwarp and a named barrier among the 256 consumer threads (bar.sync 1, 256).
#include <algorithm>

#include "common.cuh"
#include "engine.h"
#include "gemv.h"
#include "int4_dot.cuh"

namespace nanoqwen {
namespace {

constexpr int kGroup = 128;
constexpr int kSegConsumers = 8;
constexpr int kSegConsumerThreads = kSegConsumers * 32;
constexpr int kSegThreads = kSegConsumerThreads + 32;
constexpr int kSegSubBytes = 16 * 64;                        // one warp's group: 16 rows x 64 B
constexpr int kSegScaleOff = kSegConsumers * kSegSubBytes;   // then 8 x 16 scale pairs (4 B)
constexpr int kSegStageBytes = kSegScaleOff + kSegConsumers * 16 * 4;
constexpr int kSegMaxSmemBytes = 227 * 1024;
constexpr int kSegMinStages = 4;
constexpr int kSegMaxStages = 64;
constexpr int kSegPhases = 4;
constexpr int kSegEmbed = kSegPhases, kSegExit = kSegPhases + 1;
static_assert(kSegCounters > kSegExit, "engine.h's kSegCounters holds the phase, embed and exit counters");
// the fixed shared memory before x: mbarriers (2 x kSegMaxStages), the split sums (two sets of
// 8 warps x 2 matrices x 16 rows), the norm's 16 warp sums
constexpr int kSegBarBytes = 2 * kSegMaxStages * 8;
constexpr int kSegRedFloats = 2 * kSegConsumers * 2 * 16;
constexpr int kSegFixedBytes = kSegBarBytes + kSegRedFloats * 4 + 16 * 4;
static_assert(kSegFixedBytes % 16 == 0, "x must start 16-byte aligned");

enum { OP_STORE = 0, OP_RESID = 1, OP_SILU = 2 };

struct SegPhase {
  const uint32_t* qw;
  const half* sc;
  const uint32_t* qw2;   // up (OP_SILU)
  const half* sc2;
  const half* bias;      // OP_STORE, may be null
  void* out;             // half [n] (store, SiLU) or the fp32 hidden (residual)
  const half* norm_w;    // x = rmsnorm(hidden) * norm_w, or null: x = xin
  const half* xin;       // half [k]
  int op, n, k, ks_log2, base;
};

struct SegArgs {
  SegPhase ph[kSegPhases];
  int nph;
  const half* embed;        // non-null in segment 0: hidden = embed[*token_in] first
  const int32_t* token_in;
  int vocab;
  float* hidden;
  int H;
  float eps;
  int32_t* counters;        // [kSegCounters], zero before and after
  int stages;
  int xbytes;
};

// a block's share of phase p: its first tile, how many tiles, and the tile sets
struct Share {
  int first, count, tps, nm, G, C, cntmax;
  __device__ Share(const SegPhase& ph, int b, int grid) {
    const int nt = (ph.n + 15) >> 4;
    first = ((b - ph.base) % grid + grid) % grid;
    count = first < nt ? (nt - 1 - first) / grid + 1 : 0;
    tps = kSegConsumers >> ph.ks_log2;
    nm = ph.op == OP_SILU ? 2 : 1;
    G = ph.k / kGroup;
    C = ph.k / 32;
    cntmax = (G + (1 << ph.ks_log2) - 1) >> ph.ks_log2;
  }
  __device__ int sets() const { return (count + tps - 1) / tps; }
  __device__ int set_tiles(int set) const { return min(tps, count - set * tps); }
  __device__ int tile_row0(int set, int j, int grid) const {
    return (first + (set * tps + j) * grid) * 16;
  }
};

// warp w's range in a tile set: the tile j, the group range [gb, gb + cnt)
__device__ __forceinline__ void warp_range(const SegPhase& ph, const Share& sh, int w, int& j,
                                           int& gb, int& cnt) {
  const int s = w & ((1 << ph.ks_log2) - 1);
  j = w >> ph.ks_log2;
  gb = (s * sh.G) >> ph.ks_log2;
  cnt = (((s + 1) * sh.G) >> ph.ks_log2) - gb;
}

__device__ __forceinline__ void consumer_bar() {
  asm volatile("bar.sync 1, %0;" ::"n"(kSegConsumerThreads) : "memory");
}

__device__ __forceinline__ float4 ldcg4(const float* p) {
  return __ldcg(reinterpret_cast<const float4*>(p));
}

// the producer warp: every stage of the segment, in the consumers' order. Lane l copies, for each
// warp w's group, the 16-byte chunk l % 4 of rows l / 4 and l / 4 + 8, and the scale pair of row
// l % 16 for warps 2i + l / 16.
__device__ void seg_producer(const SegArgs& a, unsigned char* ring, uint64_t* full,
                             uint64_t* empty, int lane) {
  const int grid = gridDim.x, b = blockIdx.x, S = a.stages;
  const int r0 = lane >> 2, ch = lane & 3, sr = lane & 15, sw = lane >> 4;
  int slot = 0, parity = 0;
  for (int p = 0; p < a.nph; ++p) {
    const SegPhase& ph = a.ph[p];
    const Share sh(ph, b, grid);
    const int nsets = sh.sets();
    for (int set = 0; set < nsets; ++set) {
      const int ntiles = sh.set_tiles(set);
      for (int st = 0; st < sh.cntmax; ++st) {
        for (int m = 0; m < sh.nm; ++m) {
          mbar_wait(&empty[slot], parity ^ 1);   // the first pass over the ring passes at once
          unsigned char* dst = ring + (size_t)slot * kSegStageBytes;
          const uint4* qw = reinterpret_cast<const uint4*>(m ? ph.qw2 : ph.qw);
          const half* sc = m ? ph.sc2 : ph.sc;
#pragma unroll
          for (int w = 0; w < kSegConsumers; ++w) {
            int j, gb, cnt;
            warp_range(ph, sh, w, j, gb, cnt);
            if (j < ntiles && st < cnt) {
              const int row0 = sh.tile_row0(set, j, grid);
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int r = r0 + 8 * h, row = min(row0 + r, ph.n - 1);
                cp_async16(dst + w * kSegSubBytes + r * 64 + ch * 16,
                           qw + (size_t)row * sh.C + (gb + st) * 4 + ch);
              }
            }
          }
#pragma unroll
          for (int i = 0; i < kSegConsumers / 2; ++i) {
            const int w = 2 * i + sw;
            int j, gb, cnt;
            warp_range(ph, sh, w, j, gb, cnt);
            if (j < ntiles && st < cnt) {
              const int row = min(sh.tile_row0(set, j, grid) + sr, ph.n - 1);
              const size_t idx = (size_t)row * sh.G + gb + st;
              cp_async4_fill(dst + kSegScaleOff + (w * 16 + sr) * 4, sc + (idx & ~(size_t)1),
                             (idx & 1) ? 4 : 2);
            }
          }
          mbar_cp_async_arrive(&full[slot]);
          if (++slot == S) {
            slot = 0;
            parity ^= 1;
          }
        }
      }
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// x of phase ph into shared memory in the tca kernel's staged order (per group, piece p = 4t + j
// of 8 halves at 4j + t): rmsnorm_kernel's arithmetic on 512 virtual threads (ctid, ctid + 256)
// when ph.norm_w is set, else a copy of ph.xin. Ends with the consumer barrier.
__device__ void stage_x(const SegArgs& a, const SegPhase& ph, uint4* xs, float* nsum, int ctid) {
  const int lane = ctid & 31, w = ctid >> 5;
  if (ph.norm_w) {
    constexpr int kVirt = 512, kVec = 4;   // rmsnorm_kernel's kNormThreads, kMaxVec
    const int n4 = a.H / 4;
    float4 v[2][kVec];
    float ss[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ss[h] = 0.f;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const int i = ctid + h * kSegConsumerThreads + j * kVirt;
        if (i < n4) {
          v[h][j] = ldcg4(a.hidden + 4 * i);
          ss[h] = sq_acc(ss[h], v[h][j]);
        }
      }
    }
    // block_sum over the 16 virtual warps: warp w holds virtual warps w and w + 8
    const float s0 = warp_sum(ss[0]), s1 = warp_sum(ss[1]);
    if (lane == 0) {
      nsum[w] = s0;
      nsum[w + 8] = s1;
    }
    consumer_bar();
    const float tot = warp_sum(lane < 16 ? nsum[lane] : 0.f);
    const float r = rms_scale(tot, a.H, a.eps);
    const half2* w2 = reinterpret_cast<const half2*>(ph.norm_w);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const int i = ctid + h * kSegConsumerThreads + j * kVirt;
        if (i < n4) {
          const float2 wa = __half22float2(w2[2 * i]), wb = __half22float2(w2[2 * i + 1]);
          half2 o[2];
          o[0] = __floats2half2_rn(wa.x * (v[h][j].x * r), wa.y * (v[h][j].y * r));
          o[1] = __floats2half2_rn(wb.x * (v[h][j].z * r), wb.y * (v[h][j].w * r));
          const int P = i >> 1, pp = P & 15;   // float4 i is half (i & 1) of piece P
          uint2* dst = reinterpret_cast<uint2*>(xs + (P >> 4) * 16 + (pp & 3) * 4 + (pp >> 2));
          dst[i & 1] = *reinterpret_cast<uint2*>(o);
        }
      }
  } else {
    const uint4* src = reinterpret_cast<const uint4*>(ph.xin);
    for (int P = ctid; P < ph.k / 8; P += kSegConsumerThreads) {
      const int pp = P & 15;
      xs[(P >> 4) * 16 + (pp & 3) * 4 + (pp >> 2)] = __ldcg(src + P);
    }
  }
  consumer_bar();
}

// until *c >= target (one thread; the named barrier after it hands the acquire to the others).
// No phase takes a second (20 s leaves room for compute-sanitizer's slowdown): a longer wait is a
// broken schedule (or blocks that are not all resident), and the kernel traps -- a launch error
// the engine reports -- instead of hanging.
constexpr unsigned long long kSegWaitNs = 20000000000ull;
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ void wait_count(const int32_t* c, int target) {
  if (ld_acquire_gpu(c) >= target) return;
  const unsigned long long t0 = globaltimer_ns();
  for (unsigned i = 1; ld_acquire_gpu(c) < target; ++i)
    if ((i & 1023) == 0 && globaltimer_ns() - t0 > kSegWaitNs) __trap();
}

// the 8 consumer warps
__device__ void seg_consumer(const SegArgs& a, unsigned char* ring, uint64_t* full,
                             uint64_t* empty, float* red, float* nsum, uint4* xs, int ctid) {
  const int grid = gridDim.x, b = blockIdx.x, S = a.stages;
  const int lane = ctid & 31, w = ctid >> 5, g = lane >> 2, t = lane & 3;
  griddep_wait();   // attn (and pos, the token) come from the launches before
  griddep_launch_dependents();
  if (a.embed && b == 0) {   // segment 0: the embedding row into the fp32 residual
    int id = *a.token_in;
    id = id < 0 ? 0 : (id >= a.vocab ? a.vocab - 1 : id);
    const half2* src = reinterpret_cast<const half2*>(a.embed + (size_t)id * a.H);
    for (int i = ctid; i < a.H / 2; i += kSegConsumerThreads) {
      const float2 f = __half22float2(src[i]);
      __stcg(reinterpret_cast<float2*>(a.hidden) + i, f);
    }
    __threadfence();
    consumer_bar();
    if (ctid == 0) red_release_gpu(&a.counters[kSegEmbed], 1);
  }
  int slot = 0, parity = 0, rb = 0;
  for (int p = 0; p < a.nph; ++p) {
    const SegPhase& ph = a.ph[p];
    const Share sh(ph, b, grid);
    if (sh.count == 0) continue;
    if (ctid == 0) {
      if (p > 0) {
        const int prev_tiles = (a.ph[p - 1].n + 15) >> 4;
        wait_count(&a.counters[p - 1], min(grid, prev_tiles));
      } else if (a.embed) {
        wait_count(&a.counters[kSegEmbed], 1);
      }
    }
    consumer_bar();
    stage_x(a, ph, xs, nsum, ctid);
    const int nsets = sh.sets();
    int j, gb, cnt;
    warp_range(ph, sh, w, j, gb, cnt);
    for (int set = 0; set < nsets; ++set) {
      const int ntiles = sh.set_tiles(set);
      const bool mine = j < ntiles;
      const int myrow0 = mine ? sh.tile_row0(set, j, grid) : 0;
      const int rlo = min(myrow0 + g, ph.n - 1), rhi = min(myrow0 + g + 8, ph.n - 1);
      float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
      for (int st = 0; st < sh.cntmax; ++st) {
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          if (m == sh.nm) break;
          mbar_wait(&full[slot], parity);
          __syncwarp();   // the lanes leave the wait loop apart; the mma below is .aligned
          if (mine && st < cnt) {
            const unsigned char* stg = ring + (size_t)slot * kSegStageBytes;
            const uint4* sub = reinterpret_cast<const uint4*>(stg + w * kSegSubBytes);
            const int gi = gb + st;
            uint4 xv[4];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) xv[jj] = xs[gi * 16 + jj * 4 + t];
            const float2 dd = group_dot(sub[g * 4 + t], sub[(g + 8) * 4 + t], xv);
            const half* sp = reinterpret_cast<const half*>(stg + kSegScaleOff + w * 64);
            const size_t ilo = (size_t)rlo * sh.G + gi, ihi = (size_t)rhi * sh.G + gi;
            const float slo = __half2float(sp[g * 2 + (int)(ilo & 1)]);
            const float shi = __half2float(sp[(g + 8) * 2 + (int)(ihi & 1)]);
            acc[m][0] = fmaf(slo, dd.x, acc[m][0]);
            acc[m][1] = fmaf(shi, dd.y, acc[m][1]);
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[slot]);
          if (++slot == S) {
            slot = 0;
            parity ^= 1;
          }
        }
      }
      // the K ranges' sums meet in red[rb] and are added in range order (splitk_store's)
      float* rr = red + rb * (kSegConsumers * 2 * 16);
      if (t == 0) {
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          rr[(w * 2 + m) * 16 + g] = acc[m][0];
          rr[(w * 2 + m) * 16 + g + 8] = acc[m][1];
        }
      }
      consumer_bar();
      if (ctid < ntiles * 16) {
        const int tj = ctid >> 4, r = ctid & 15;
        const int row = sh.tile_row0(set, tj, grid) + r;
        if (row < ph.n) {
          const int ks = 1 << ph.ks_log2;
          float v[2];
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            v[m] = 0.f;
            for (int s = 0; s < ks; ++s) v[m] += rr[((tj * ks + s) * 2 + m) * 16 + r];
          }
          if (ph.op == OP_STORE) {
            static_cast<half*>(ph.out)[row] = int4_store_value(v[0], ph.bias, row);
          } else if (ph.op == OP_RESID) {
            float* hp = static_cast<float*>(ph.out) + row;
            __stcg(hp, __ldcg(hp) + v[0]);
          } else {
            static_cast<half*>(ph.out)[row] = int4_silu_value(v[0], v[1]);
          }
        }
      }
      rb ^= 1;
    }
    // this block's tiles of phase p are written: publish them
    __threadfence();
    consumer_bar();
    if (ctid == 0) red_release_gpu(&a.counters[p], 1);
  }
}

__global__ void __launch_bounds__(kSegThreads, 1) decode_segment_kernel(const SegArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kSegMaxStages;
  float* red = reinterpret_cast<float*>(smem + kSegBarBytes);
  float* nsum = red + kSegRedFloats;
  uint4* xs = reinterpret_cast<uint4*>(smem + kSegFixedBytes);
  unsigned char* ring = smem + kSegFixedBytes + a.xbytes;
  if (threadIdx.x == 0) {
    for (int s = 0; s < a.stages; ++s) {
      mbar_init(&full[s], 32);               // the producer's lanes, once their copies land
      mbar_init(&empty[s], kSegConsumers);   // every consumer warp, once it read the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5;
  if (warp == kSegConsumers)
    seg_producer(a, ring, full, empty, threadIdx.x & 31);
  else
    seg_consumer(a, ring, full, empty, red, nsum, xs, threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) {   // the last block out leaves the counters zero for the next launch
    __threadfence();
    if (atomicAdd(&a.counters[kSegExit], 1) == (int)gridDim.x - 1) {
      __threadfence();   // acquire side of the other blocks' exits
      for (int i = 0; i < kSegCounters; ++i) a.counters[i] = 0;
      __threadfence();
    }
  }
}

int log2_of(int ks) { return ks == 2 ? 1 : ks == 4 ? 2 : 3; }

SegPhase int4_phase(int op, const uint32_t* qw, const half* sc, const uint32_t* qw2,
                    const half* sc2, const half* bias, void* out, const half* norm_w,
                    const half* xin, int n, int k) {
  SegPhase p{};
  p.qw = qw; p.sc = sc; p.qw2 = qw2; p.sc2 = sc2; p.bias = bias; p.out = out;
  p.norm_w = norm_w; p.xin = xin; p.op = op; p.n = n; p.k = k;
  p.ks_log2 = log2_of(gemv_int4_k_split(op == OP_STORE ? 0 : op == OP_RESID ? 1 : 2, k));
  return p;
}


// the longest x a segment stages: max(H, I, q) halves
int seg_kmax(const StepArgs& a) {
  const int q = a.n_heads * a.head_dim;
  return std::max(std::max(a.H, a.I), q);
}

}  // namespace

size_t decode_segment_smem(const StepArgs& a, int stages) {
  return (size_t)kSegFixedBytes + (size_t)seg_kmax(a) * 2 + (size_t)stages * kSegStageBytes;
}

cudaError_t decode_segment(const StepArgs& a, int seg, cudaStream_t stream) {
  const int L = (int)a.layers.size();
  if (seg < 0 || seg > L)
    return nq_fail(cudaErrorInvalidValue, "decode_segment: segment %d of a %d-layer model (0..%d)",
                   seg, L, L);
  if (a.seg_grid < 1 || !a.seg_counters)
    return nq_fail(cudaErrorInvalidValue,
                   "decode_segment: grid %d and counters %p (the engine sets both)", a.seg_grid,
                   (const void*)a.seg_counters);
  if (a.H > 512 * 4 * 4 || a.H % 128 || a.I % 128 || (a.n_heads * a.head_dim) % 128)
    return nq_fail(cudaErrorInvalidValue,
                   "decode_segment: H=%d (at most 8192, as rmsnorm), I=%d and q=%d must be "
                   "multiples of 128", a.H, a.I, a.n_heads * a.head_dim);
  const int q = a.n_heads * a.head_dim, qkv_n = q + 2 * a.n_kv * a.head_dim;
  SegArgs s{};
  int nph = 0;
  if (seg > 0) {
    const LayerPtrs& P = a.layers[seg - 1];
    s.ph[nph++] = int4_phase(OP_RESID, P.o_qw, P.o_sc, nullptr, nullptr, nullptr, a.hidden,
                             nullptr, a.attn, a.H, q);
    s.ph[nph++] = int4_phase(OP_SILU, P.gate_qw, P.gate_sc, P.up_qw, P.up_sc, nullptr, a.act,
                             P.ln2, nullptr, a.I, a.H);
    s.ph[nph++] = int4_phase(OP_RESID, P.down_qw, P.down_sc, nullptr, nullptr, nullptr, a.hidden,
                             nullptr, a.act, a.H, a.I);
  }
  if (seg < L) {
    const LayerPtrs& N = a.layers[seg];
    s.ph[nph++] = int4_phase(OP_STORE, N.qkv_qw, N.qkv_sc, nullptr, nullptr, N.qkv_b, a.qkv,
                             N.ln1, nullptr, qkv_n, a.H);
  }
  s.nph = nph;
  // what the kernel's copies need (the chain's launchers check the same): 16-byte weights and
  // x, scales 4-byte aligned (their 4-byte cp.async reads the aligned pair)
  for (int p = 0; p < nph; ++p) {
    const SegPhase& ph = s.ph[p];
    const bool silu = ph.op == OP_SILU;
    if (!ph.qw || !ph.sc || !ph.out || (silu && (!ph.qw2 || !ph.sc2)) ||
        (!ph.norm_w && !ph.xin))
      return nq_fail(cudaErrorInvalidValue, "decode_segment: segment %d phase %d: null pointer",
                     seg, p);
    if (misaligned16(ph.qw) || (silu && misaligned16(ph.qw2)) || (ph.xin && misaligned16(ph.xin)) ||
        (reinterpret_cast<uintptr_t>(ph.sc) & 3) ||
        (silu && (reinterpret_cast<uintptr_t>(ph.sc2) & 3)))
      return nq_fail(cudaErrorInvalidValue,
                     "decode_segment: segment %d phase %d (n=%d, k=%d): weights and x must be "
                     "16-byte aligned, scales 4-byte aligned", seg, p, ph.n, ph.k);
  }
  // round-robin continues over the phases and the segments (each block streams ~the same bytes)
  long long base = 0;
  for (int i = 0; i < seg; ++i) base += (i > 0 ? (a.H + 15) / 16 * 2 + (a.I + 15) / 16 : 0) +
                                       (i < L ? (qkv_n + 15) / 16 : 0);
  for (int p = 0; p < nph; ++p) {
    s.ph[p].base = (int)(base % a.seg_grid);
    base += (s.ph[p].n + 15) / 16;
  }
  s.embed = seg == 0 ? a.embed : nullptr;
  s.token_in = a.token_in;
  s.vocab = a.vocab;
  s.hidden = a.hidden;
  s.H = a.H;
  s.eps = a.eps;
  s.counters = a.seg_counters;
  const int kmax = seg_kmax(a);
  s.xbytes = kmax * 2;
  const long long room = (long long)kSegMaxSmemBytes - kSegFixedBytes - s.xbytes;
  const long long stages = room / kSegStageBytes;
  if (stages < kSegMinStages)
    return nq_fail(cudaErrorInvalidValue,
                   "decode_segment: x of %d halves leaves room for %lld ring stages of %d bytes, "
                   "at least %d are needed", kmax, stages, kSegStageBytes, kSegMinStages);
  s.stages = (int)(stages < kSegMaxStages ? stages : kSegMaxStages);
  const size_t smem = decode_segment_smem(a, s.stages);
  static const cudaError_t attr = set_max_smem(decode_segment_kernel, kSegMaxSmemBytes);
  if (attr != cudaSuccess) return smem_refused(attr, "decode_segment_kernel", kSegMaxSmemBytes);
  // the blocks wait for each other: one must fit on every SM at this shared memory (a device
  // shared with other work, MPS or green contexts with fewer SMs would trap, not hang)
  static thread_local size_t occ_smem = 0;
  static thread_local int occ = 0;
  if (occ_smem != smem) {
    const cudaError_t oe = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &occ, decode_segment_kernel, kSegThreads, smem);
    if (oe != cudaSuccess) {
      (void)cudaGetLastError();
      return nq_fail(oe, "decode_segment: cudaOccupancyMaxActiveBlocksPerMultiprocessor (%zu "
                     "bytes of shared memory): %s", smem, cudaGetErrorString(oe));
    }
    occ_smem = smem;
  }
  if (occ < 1)
    return nq_fail(cudaErrorInvalidConfiguration,
                   "decode_segment: no block of %d threads with %zu bytes of shared memory fits "
                   "an SM; the segment kernels need one on each of the %d SMs", kSegThreads, smem,
                   a.seg_grid);
  const cudaError_t e = launch_pdl("decode_segment_kernel", decode_segment_kernel,
                                   dim3(a.seg_grid), dim3(kSegThreads), smem, stream, s);
  if (e == cudaSuccess) return e;
  return nq_fail(e, "decode_segment: segment %d (%d phases, %d stages): %s", seg, nph, s.stages,
                 last_error_message());
}

}  // namespace nanoqwen
