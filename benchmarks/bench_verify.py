"""t(k): the CUDA engine's verify step (csrc/engine.h launch_verify) at a model's shapes, against
its decode step (issue 13 item 3).

    python benchmarks/bench_verify.py [--preset 7b] [--context 512] [--reps 30]
                                      [--acceptance BENCH_SPEC_JSON] [--json FILE]

Synthetic random weights made on the GPU (CudaBackend.synthetic); the context is filled by a
prefill, so attention reads a real cache. For T = 1..16 tokens, the verify step at position
`context` (CUDA events on the engine's stream around one core.verify call),
median of --reps, graph mode (a graph per k) and eager; the decode step at the same position,
graph and eager (core.run_step). Ratios are against the decode step of the same mode.

With --kernels: where the verify step's time goes. The eager decode step and the eager verify
step at T = 1, 2, 4, 8, 16 under torch.profiler (CUPTI records the C++ core's launches too), each
kernel family's GPU time per step (the sum of its launches' durations over --reps steps, divided
by --reps; with PDL neighbouring kernels overlap, so the families' sum can exceed the step's
wall time) and its launches per step; written to the JSON as "kernels".

With --sampled: what a verify step costs speculation with a sampler (the app's defaults,
SamplerParams()) as the host sees it (wall clock around the call, which ends in a sync), for
T = 1, 2, 4, 8, 12, 16: the rows drawn on the device (core.verify_sample: the verify step, T
sample_token launches, T ids back), against the rows brought to the host and drawn there
(core.verify, .cpu(), T Sampler.sample calls: speculation's path before verify_sample), and the
greedy path (core.verify, the rows' argmax, T ids back). Written to the JSON as "sampled".

With --acceptance (a bench_spec.py JSON, greedy, prompt lookup): the effective ms per
generated token at these shapes if each request drafted and kept as measured there. Per
request: `verify_steps` steps of T = 1 + round(drafted / verify_steps) tokens at t(T), the
remaining tokens after the first at one graph decode step each, divided by the tokens after
the first. Two approximations, both stated in the output: the draft length varies step by
step (the mean stands for it), and the acceptance is the bundled model's (random weights at
7B shapes accept nothing real).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


COLS = (1, 2, 4, 8, 9, 13, 16)


def gemv_columns(be, cfg, stream) -> list[dict]:
    """Each GEMV of the step alone at `cols` columns: us per launch (us_per_launch)."""
    o = torch.ops.nanoqwen
    L = be.layers[0]
    H, I = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    qn = L.qkv_qw.shape[0]
    rows = []
    for c in COLS:
        xh = torch.randn(c, H, device=be.device).half()
        xq = torch.randn(c, q, device=be.device).half()
        xi = torch.randn(c, I, device=be.device).half()
        y = torch.empty(c, qn, dtype=torch.float16, device=be.device)
        hid = torch.zeros(c, H, device=be.device)
        act = torch.empty(c, I, dtype=torch.float16, device=be.device)
        lg = torch.empty(c, cfg.vocab_size, device=be.device)
        cases = [("qkv", lambda: o.gemv_int4(y, xh, L.qkv_qw, L.qkv_sc, L.qkv_b)),
                 ("o", lambda: o.gemv_int4_residual(hid, xq, L.o_qw, L.o_sc)),
                 ("gate/up", lambda: o.gemv_int4_silu_mul(act, xh, L.gate_qw, L.gate_sc,
                                                          L.up_qw, L.up_sc)),
                 ("down", lambda: o.gemv_int4_residual(hid, xi, L.down_qw, L.down_sc)),
                 ("lm_head", lambda: o.gemv_fp16(lg, xh, be.lm_head))]
        for name, fn in cases:
            rows.append(dict(op=name, cols=c, us=us_per_launch(fn, stream),
                             us_graph=us_per_launch_graph(fn, stream)))
    return rows


def us_per_launch_graph(fn, stream, launches: int = 20, runs: int = 5) -> float | None:
    """us per call of fn with the `launches` calls captured in one CUDA graph and replayed
    (`runs` replays after one warm-up, the median): the GPU's own time per launch, without the
    host's per-call cost that bounds us_per_launch for the short GEMVs (qkv, o: ~6 us a call
    from Python whatever the kernel takes). None, with the reason printed, where the capture
    fails."""
    try:
        fn()   # warm (the instances' one-time attributes are set outside the capture)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(launches):
                fn()
        return us_per_launch(g.replay, stream, launches=1, runs=runs) / launches
    except Exception as e:   # a lab figure, not a product path: report and go on
        print(f"graph timing unavailable: {type(e).__name__}: {e}", flush=True)
        return None


def us_per_launch(fn, stream, launches: int = 20, runs: int = 5) -> float:
    """us per call of fn (which enqueues on `stream`): `runs` runs of `launches` back-to-back
    calls between two CUDA events, after one warm-up run; the median run."""
    ts = []
    for _ in range(runs + 1):
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record(stream)
        for _ in range(launches):
            fn()
        s1.record(stream)
        s1.synchronize()
        ts.append(s0.elapsed_time(s1) * 1e3 / launches)
    return statistics.median(ts[1:])


def kernel_family(name: str) -> str:
    """A kernel's instance from its demangled name, without namespaces, return type and
    parameters: 'void nanoqwen::(anonymous namespace)::gemv_int4_tca_kernel<2, 2, 4, 2, 2,
    1>((anonymous namespace)::Args)' -> 'gemv_int4_tca_kernel<2, 2, 4, 2, 2, 1>' (the template
    arguments tell the verify step's column instances from the decode step's)."""
    s = name.replace("(anonymous namespace)::", "")
    depth = 0
    for i, ch in enumerate(s):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            s = s[:i]
            break
    head, sep, args = s.strip().partition("<")
    base = head.split("::")[-1].split(" ")[-1]
    return base + sep + args if base else name   # e.g. 'Memset (Device)' stays whole


def kernel_times(fn, reps: int) -> dict:
    """{family: {"us": GPU time per call, "launches": per call}} of `fn` run `reps` times under
    torch.profiler (after 3 calls outside it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    fam: dict = {}
    for e in prof.events():   # the GPU's own records (kernels, memsets), one per launch
        if e.device_type != DeviceType.CUDA:
            continue
        f = fam.setdefault(kernel_family(e.name), {"us": 0.0, "launches": 0})
        f["us"] += e.time_range.elapsed_us()
        f["launches"] += 1
    return {k: {"us": v["us"] / reps, "launches": v["launches"] / reps}
            for k, v in sorted(fam.items(), key=lambda kv: -kv[1]["us"])}


def print_kernels(kernels: dict) -> None:
    names = list(kernels)
    fams = list(dict.fromkeys(f for n in names for f in kernels[n]))
    print("GPU time per eager step by kernel (us; launches per step in brackets):")
    print(f"{'kernel':58s}" + "".join(f"{n:>18s}" for n in names))
    for f in fams:
        cells = []
        for n in names:
            v = kernels[n].get(f)
            cells.append(f"{v['us']:9.1f} ({v['launches']:4.0f})" if v else " " * 16 + "-")
        print(f"{f[:58]:58s}" + "".join(f"{c:>18s}" for c in cells))
    print(f"{'sum':58s}" + "".join(f"{sum(v['us'] for v in kernels[n].values()):18.1f}"
                                  for n in names))


def sampled_rows(be, cfg, context: int, reps: int, gen) -> list[dict]:
    """--sampled: host wall ms (medians of reps after 3 warm-ups) of a graph verify step at
    `context` with its rows drawn on the device, drawn on the host, and argmax'd (greedy)."""
    from nanoqwen.engine.sampling import Sampler, SamplerParams

    core = be.core
    params = SamplerParams(seed=1)
    sampler = Sampler(params)
    _, pf, pi = be._sampler_values(params, 1)
    history = list(range(1, context + 1))

    def wall(fn) -> float:
        times = []
        for _ in range(reps + 3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times[3:])

    def host(ids):
        rows = core.verify(ids, context, True).cpu()
        return [sampler.sample(rows[i], history + ids[:i + 1].tolist()) for i in range(len(ids))]

    out = []
    for T in (1, 2, 4, 8, 12, 16):
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen, dtype=torch.int32)
        out.append(dict(
            k=T, device_ms=wall(lambda: core.verify_sample(ids, context, True, pf, pi)),
            host_ms=wall(lambda: host(ids)),
            greedy_ms=wall(lambda: core.verify(ids, context, True).argmax(1).tolist())))
    return out


def main(argv=None) -> int:
    from nanoqwen.engine.backends.cuda import MAX_VERIFY, CudaBackend
    from nanoqwen.engine.bench import _commit
    from nanoqwen.engine.config import ModelConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--acceptance", default=None, help="a bench_spec.py --json file")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sampled", action="store_true",
                    help="the verify step with its rows sampled on the device / on the host")
    ap.add_argument("--kernels", action="store_true",
                    help="each kernel family's GPU time per eager step (torch.profiler)")
    a = ap.parse_args(argv)
    cfg = ModelConfig.from_name(a.preset)
    be = CudaBackend.synthetic(cfg, max_context=a.context + 64)
    be.forward(list(range(1, a.context + 1)))   # K/V of positions 0..context-1
    core, stream = be.core, be.stream
    gen = torch.Generator().manual_seed(0)

    def timed(fn) -> float:
        times = []
        for _ in range(a.reps + 3):   # 3 warm-up runs
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[3:])

    with torch.cuda.device(be.device), torch.cuda.stream(stream), torch.inference_mode():
        be._reserve(a.context + MAX_VERIFY)

        def decode(graph: bool) -> float:
            times = []
            for _ in range(a.reps + 3):
                be.pos.fill_(a.context)
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                core.run_step(graph)
                end.record(stream)
                end.synchronize()
                times.append(start.elapsed_time(end))
            return statistics.median(times[3:])

        t_graph, t_eager = decode(True), decode(False)
        rows = []
        for T in range(1, MAX_VERIFY + 1):
            ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen, dtype=torch.int32)
            t = timed(lambda: core.verify(ids, a.context, True))
            te = timed(lambda: core.verify(ids, a.context, False))
            rows.append(dict(k=T, ms=t, vs_decode_graph=t / t_graph, eager_ms=te,
                             eager_vs_decode_eager=te / t_eager, ms_per_token=t / T))
        note = core.verify_note()
        sampled = sampled_rows(be, cfg, a.context, a.reps, gen) if a.sampled else None
        ops_rows = gemv_columns(be, cfg, stream)
        kernels = None
        if a.kernels:
            def decode_eager():
                be.pos.fill_(a.context)
                core.run_step(False)
            steps = {"decode": decode_eager}
            for T in (1, 2, 4, 8, 16):
                if T <= MAX_VERIFY:
                    ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen, dtype=torch.int32)
                    steps[f"verify T={T}"] = (lambda ids=ids: core.verify(ids, a.context, False))
            kernels = {name: kernel_times(fn, a.reps) for name, fn in steps.items()}
    print(f"{cfg.name} context {a.context}: decode step graph {t_graph:.3f} ms, eager "
          f"{t_eager:.3f} ms ({torch.cuda.get_device_name(be.device)})")
    if note:
        print(f"verify graphs refused, eager figures only: {note}")
    print(" k   graph ms   / graph step   ms per token   eager ms   / eager step")
    for r in rows:
        print(f"{r['k']:2d}   {r['ms']:8.3f}   {r['vs_decode_graph']:11.3f}   "
              f"{r['ms_per_token']:11.3f}   {r['eager_ms']:8.3f}   {r['eager_vs_decode_eager']:9.3f}")
    for key, what in (("us", "20 back-to-back launches"),
                      ("us_graph", "20 launches in one CUDA graph, replayed")):
        print(f"GEMV us per launch by columns (layer 0's weights; {what}):")
        print("op            " + "".join(f"{c:>9d}" for c in COLS))
        for name in dict.fromkeys(r["op"] for r in ops_rows):
            print(f"{name:13s} " + "".join(
                f"{r[key]:9.2f}" if r[key] is not None else f"{'-':>9s}"
                for r in ops_rows if r["op"] == name))
    if kernels:
        print_kernels(kernels)
    if sampled:
        print("sampled rows, host wall ms per verify step (graph; app default sampler):")
        print(" k   device rows   host rows   greedy (argmax)")
        for r in sampled:
            print(f"{r['k']:2d}   {r['device_ms']:11.3f}   {r['host_ms']:9.3f}   {r['greedy_ms']:9.3f}")
    out = dict(bench="bench_verify", preset=cfg.name, context=a.context, reps=a.reps,
               device=torch.cuda.get_device_name(be.device), commit=_commit(),
               date=time.strftime("%Y-%m-%d"), decode_graph_ms=t_graph, decode_eager_ms=t_eager,
               verify_mode="graph (one per k; eager_ms: the same launches from C++)",
               verify_graph_note=note, rows=rows,
               gemv_columns=ops_rows, kernels=kernels, sampled=sampled)
    if a.acceptance:
        spec = json.load(open(a.acceptance))
        t_of = {r["k"]: r["ms"] for r in rows}
        est = []
        for r in spec["rows"]:
            n_after = r["n_generated"] - 1
            if n_after <= 0:
                continue
            v = r["verify_steps"]
            k = min(MAX_VERIFY, 1 + round(r["drafted"] / v)) if v else 1
            from_verify = r["accepted"] + v   # each verify step emits its kept drafts + 1
            ms = v * t_of[k] + max(0, n_after - from_verify) * t_graph
            est.append(dict(kind=r["kind"], request=r["request"], n_after_first=n_after,
                            verify_steps=v, mean_k=k, accepted=r["accepted"],
                            est_ms_per_token=ms / n_after))
        summary = {}
        for kind in ("edit", "new"):
            xs = [e["est_ms_per_token"] for e in est if e["kind"] == kind]
            if xs:
                summary[kind] = dict(requests=len(xs), median_est_ms_per_token=statistics.median(xs),
                                     plain_ms_per_token=t_graph,
                                     speedup=t_graph / statistics.median(xs))
                print(f"{kind}: estimated {statistics.median(xs):.3f} ms per generated token at "
                      f"{cfg.name} shapes (plain decode {t_graph:.3f}; x"
                      f"{t_graph / statistics.median(xs):.2f}) from {len(xs)} requests of "
                      f"{spec.get('model', '?')} on {spec.get('backend', '?')}")
        out["estimate"] = dict(
            acceptance_from=a.acceptance, method="per request: verify_steps x t(1 + round(drafted "
            "/ verify_steps)) + the other tokens after the first x the graph decode step, over "
            "the tokens after the first; acceptance of the bundled model (real text), t(k) at "
            "these shapes (random weights)", summary=summary, rows=est)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
