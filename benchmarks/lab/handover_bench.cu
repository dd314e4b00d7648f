// handover_bench.cu -- issue 12 item 1: what a persistent decode kernel's phase hand-over costs
// against the chain's launch boundary, with no weights in the way (RESULTS.md, session 22: "Before
// writing it: time a segment that only hands over (no weights) to price the four hand-overs a
// layer").
//
// A step here is what sits between two GEMV phases of the decode step: every block reads the
// whole residual (hidden floats, the RMSNorm prologue's read; the buffer the previous step's
// blocks wrote, so it comes from L2 across SMs), reduces its sum of squares, and writes its own
// slice of the next residual. S steps (28 layers x 4 phases = 112 at 7B), one block per SM,
// 256 threads, timed six ways:
//   graph_empty      S launches of an empty kernel in one CUDA graph (the bare launch boundary)
//   graph            S launches of the step kernel in one CUDA graph, no PDL
//   graph_pdl        the same with programmatic dependent launch (griddepcontrol.wait first,
//                    launch_dependents after it: the chain's pattern, csrc/common.cuh)
//   persistent       one launch of S steps; between steps a grid-wide hand-over: each block's
//                    thread 0 adds 1 to the step's counter (red.release.gpu) after the block's
//                    writes, then spins (ld.acquire.gpu) until all blocks have added
//   persistent_empty the same hand-overs with no residual read or write (the bare counter wait)
//   persistent_1     one launch, one step (the launch itself, to subtract)
// Each variant: 5 warm-up runs, then 31 timed runs (cudaEvent around each), median. Output: one
// JSON object on stdout. The three variants that run all S steps of work (graph, graph_pdl,
// persistent) are checked: they must end with the residual the host computes in double (a
// relative check; the GPU's sums are in another order). The empty variants and persistent_1 are
// not checked (max_rel_err 0 in the JSON means "not checked" there); exit status 3 on a mismatch.
//
// Build and run (GPU machine; no torch, no csrc):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/handover \
//        benchmarks/lab/handover_bench.cu && /tmp/handover [hidden] [steps] > handover.json
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)

constexpr int kThreads = 256;

// One step's work for this block: the sum of squares of all of `in` (hidden floats), then this
// block's slice of `out`: out[i] = in[i] * rsqrt(mean square + eps) * 0.5 + 0.25 (a bounded map,
// so S steps neither blow up nor vanish).
__device__ __forceinline__ void step_body(const float* __restrict__ in, float* __restrict__ out,
                                          int hidden) {
  __shared__ float warp_sums[kThreads / 32];
  __shared__ float inv_rms;
  float s = 0.f;
  for (int i = threadIdx.x * 4; i < hidden; i += kThreads * 4) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(in + i));  // L2, not a stale L1 line
    s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.f;
    for (int w = 0; w < kThreads / 32; ++w) t += warp_sums[w];
    inv_rms = rsqrtf(t / hidden + 1e-6f);
  }
  __syncthreads();
  const int per = (hidden + gridDim.x - 1) / gridDim.x;
  const int lo = blockIdx.x * per, hi = min(hidden, lo + per);
  for (int i = lo + threadIdx.x; i < hi; i += kThreads)
    __stcg(out + i, __ldcg(in + i) * inv_rms * 0.5f + 0.25f);
}

__global__ void empty_kernel() {}

__global__ void step_kernel(const float* in, float* out, int hidden, int pdl) {
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  step_body(in, out, hidden);
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_add(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// S steps in one launch; buffers alternate (step s reads buf[s & 1], writes buf[(s + 1) & 1]).
// counters[s] reaches gridDim.x once every block has finished step s.
__global__ void persistent_kernel(float* buf0, float* buf1, int hidden, int steps,
                                  unsigned* counters, int work) {
  for (int s = 0; s < steps; ++s) {
    if (s > 0) {
      if (threadIdx.x == 0)
        while (ld_acquire(counters + s - 1) < gridDim.x) {
        }
      __syncthreads();
    }
    if (work) step_body((s & 1) ? buf1 : buf0, (s & 1) ? buf0 : buf1, hidden);
    __syncthreads();  // the block's writes of step s are done before its arrival
    if (threadIdx.x == 0) {
      __threadfence();  // as cooperative groups' grid sync does before its arrival
      red_release_add(counters + s, 1u);
    }
  }
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// run(timed) enqueues one run; when timed it records a before the timed work and b after it
// (untimed set-up, such as the counters' memset, goes before a).
template <class F>
static float time_runs(F&& run, cudaStream_t st, cudaEvent_t a, cudaEvent_t b, int warm = 5,
                       int reps = 31) {
  for (int i = 0; i < warm; ++i) run(false);
  CK(cudaStreamSynchronize(st));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    run(true);
    float t;
    CK(cudaEventSynchronize(b));
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  return median(ms) * 1000.f;  // us
}

int main(int argc, char** argv) {
  const int hidden = argc > 1 ? atoi(argv[1]) : 3584;
  const int steps = argc > 2 ? atoi(argv[2]) : 112;
  if (hidden < 4 || hidden % 4 || steps < 2) {
    fprintf(stderr, "usage: handover [hidden (multiple of 4)] [steps >= 2]\n");
    return 2;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int blocks = prop.multiProcessorCount;
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  float *buf0, *buf1;
  unsigned* counters;
  CK(cudaMalloc(&buf0, hidden * sizeof(float)));
  CK(cudaMalloc(&buf1, hidden * sizeof(float)));
  CK(cudaMalloc(&counters, steps * sizeof(unsigned)));
  std::vector<float> init(hidden);
  for (int i = 0; i < hidden; ++i) init[i] = std::sin(0.37f * i) + 0.1f;
  auto reset = [&] {
    CK(cudaMemcpyAsync(buf0, init.data(), hidden * sizeof(float), cudaMemcpyHostToDevice, st));
  };
  // the host's result after `steps` steps (buf[steps & 1])
  std::vector<double> ref(init.begin(), init.end());
  for (int s = 0; s < steps; ++s) {
    double ss = 0;
    for (double v : ref) ss += v * v;
    const double inv = 1.0 / std::sqrt(ss / hidden + 1e-6);
    for (double& v : ref) v = v * inv * 0.5 + 0.25;
  }
  auto check = [&](const char* name) {
    std::vector<float> got(hidden);
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(got.data(), (steps & 1) ? buf1 : buf0, hidden * sizeof(float),
                  cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int i = 0; i < hidden; ++i)
      worst = std::max(worst, std::fabs(got[i] - ref[i]) / (std::fabs(ref[i]) + 1e-3));
    // fp32 sums of `hidden` squares in another order, S times through a contracting map: 1e-4
    if (!(worst < 1e-4)) {
      fprintf(stderr, "%s: relative error %.3g against the host\n", name, worst);
      exit(3);
    }
    return worst;
  };

  cudaEvent_t ea, eb;  // the timed window of one run
  CK(cudaEventCreate(&ea));
  CK(cudaEventCreate(&eb));
  auto make_graph = [&](int kind) {  // 0 empty, 1 step, 2 step + PDL
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int s = 0; s < steps; ++s) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(blocks);
      cfg.blockDim = dim3(kThreads);
      cfg.stream = st;
      cudaLaunchAttribute a[1];
      a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      a[0].val.programmaticStreamSerializationAllowed = kind == 2 ? 1 : 0;
      cfg.attrs = a;
      cfg.numAttrs = 1;
      const float* in = (s & 1) ? buf1 : buf0;
      float* out = (s & 1) ? buf0 : buf1;
      if (kind == 0)
        CK(cudaLaunchKernelEx(&cfg, empty_kernel));
      else
        CK(cudaLaunchKernelEx(&cfg, step_kernel, in, out, hidden, kind == 2 ? 1 : 0));
    }
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphDestroy(g));
    return ge;
  };
  struct Row {
    std::string name;
    float us;
    int steps;
    double err;
  };
  std::vector<Row> rows;
  const char* names[3] = {"graph_empty", "graph", "graph_pdl"};
  for (int kind = 0; kind < 3; ++kind) {
    cudaGraphExec_t ge = make_graph(kind);
    const float us = time_runs(
        [&](bool timed) {
          reset();
          if (timed) CK(cudaEventRecord(ea, st));
          CK(cudaGraphLaunch(ge, st));
          if (timed) CK(cudaEventRecord(eb, st));
        },
        st, ea, eb);
    rows.push_back({names[kind], us, steps, kind ? check(names[kind]) : 0.0});
    CK(cudaGraphExecDestroy(ge));
  }
  struct P {
    const char* name;
    int steps, work;
  } ps[3] = {{"persistent", steps, 1}, {"persistent_empty", steps, 0}, {"persistent_1", 1, 1}};
  for (const P& p : ps) {
    const float us = time_runs(
        [&](bool timed) {
          reset();
          CK(cudaMemsetAsync(counters, 0, steps * sizeof(unsigned), st));
          if (timed) CK(cudaEventRecord(ea, st));
          persistent_kernel<<<blocks, kThreads, 0, st>>>(buf0, buf1, hidden, p.steps, counters,
                                                        p.work);
          CK(cudaGetLastError());
          if (timed) CK(cudaEventRecord(eb, st));
        },
        st, ea, eb);
    rows.push_back({p.name, us, p.steps, p.steps == steps && p.work ? check(p.name) : 0.0});
  }
  printf("{\n  \"device\": \"%s\", \"sms\": %d, \"blocks\": %d, \"threads\": %d,\n"
         "  \"hidden\": %d, \"steps\": %d,\n  \"rows\": [\n",
         prop.name, prop.multiProcessorCount, blocks, kThreads, hidden, steps);
  for (size_t i = 0; i < rows.size(); ++i)
    printf("    {\"name\": \"%s\", \"median_us\": %.2f, \"steps\": %d, \"us_per_step\": %.3f, "
           "\"max_rel_err\": %.3g}%s\n",
           rows[i].name.c_str(), rows[i].us, rows[i].steps, rows[i].us / rows[i].steps,
           rows[i].err, i + 1 < rows.size() ? "," : "");
  printf("  ]\n}\n");
  return 0;
}
