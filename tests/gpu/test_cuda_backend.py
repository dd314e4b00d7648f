"""The CUDA backend end to end against the reference backend (the plain-PyTorch oracle) on the
same INT4 weights: teacher-forced logits, greedy agreement where the reference is sure,
graph == eager bit for bit, mode switches mid-generation, stop/cancel leaving the cache
exact, prefix reuse. Models: tiny untied head_dim 128, tiny tied head_dim 64, and the 7B's
shapes with random weights (2 of its 28 layers, so the fp32 oracle stays quick)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

import helpers
from nanoqwen.engine.config import PRESETS, ModelConfig
from nanoqwen.engine.sampling import SamplerParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplerParams.greedy_params()
SEVEN_B_2L = ModelConfig(name="7b-shapes-2-layers", **{**PRESETS["7b"], "num_hidden_layers": 2})


def make_pair(cfg: ModelConfig, seed: int = 0, max_context: int = 512, gpu_weights=False):
    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.backends.reference import ReferenceBackend
    from nanoqwen.engine.synthetic import SyntheticWeights

    if gpu_weights:
        tensors = SyntheticWeights(cfg, seed, device="cuda")
    else:
        tensors = helpers.file_tensors(cfg, helpers.random_weights(cfg, seed=seed))
    ref = ReferenceBackend(cfg, tensors, device="cuda", max_context=max_context)
    cuda = CudaBackend(cfg, tensors, max_context=max_context)
    return ref, cuda


@pytest.fixture(scope="module")
def untied():
    return make_pair(helpers.TINY_UNTIED)


@pytest.fixture(scope="module")
def tied():
    return make_pair(helpers.TINY_TIED)


def teacher_forced(backend, tokens, n_prompt):
    backend.truncate(0)
    out = [backend.forward(tokens[:n_prompt])]
    for t in tokens[n_prompt:]:
        out.append(backend.forward([t]))
    return torch.stack(out)


def check_teacher_forced(ref, cuda, n_prompt=37, n_total=90, seed=0):
    V = ref.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (n_total,), generator=g).tolist()
    lr = teacher_forced(ref, tokens, n_prompt)
    results = {}
    for mode in ("graph", "eager"):
        cuda.mode = mode
        lc = teacher_forced(cuda, tokens, n_prompt)
        results[mode] = lc
        err = (lc - lr).norm(dim=-1) / lr.norm(dim=-1)
        max_abs = (lc - lr).abs().max()
        print(f"{ref.config.name} {mode}: rel err max {err.max():.2e} mean {err.mean():.2e}, "
              f"max |dlogit| {max_abs:.2e}, max |logit| {lr.abs().max():.2e}")
        # fp16 activations (normed x, q/k/v, attention output, SiLU product: each rounded at
        # 2^-11 relative) and the fp16 KV cache against an all-fp32 oracle; a few such
        # roundings per layer add up to ~1e-3 relative; 1e-2 leaves room for long contexts.
        assert float(err.max()) < 1e-2
        # greedy must agree wherever the reference's top-1 is clear of the runner-up by more
        # than the largest logit error seen on that step (random weights give near-ties)
        top2 = torch.topk(lr, 2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        step_err = (lc - lr).abs().max(dim=-1).values
        clear = margin > 2 * step_err
        assert int(clear.sum()) >= len(lr) // 4
        assert torch.equal(lc.argmax(-1)[clear], lr.argmax(-1)[clear])
    # the same kernels in the same order: graph replay and eager launches agree bit for bit
    assert torch.equal(results["graph"], results["eager"])


def test_teacher_forced_untied_hd128(untied):
    check_teacher_forced(*untied)


def test_teacher_forced_tied_hd64(tied):
    check_teacher_forced(*tied)


@pytest.mark.parametrize("which", ["untied", "tied"])
@pytest.mark.parametrize("cuts", [(50, 51, 120), (17, 18, 118), (99, 140, 141), (16, 17, 33)])
def test_teacher_forced_prefix_chunks(request, which, cuts):
    """A follow-up prefill starts after the cached prefix (the causal mask aligned to the
    bottom right: query i of the new block sees the prefix and the block's first i+1 keys):
    fewer or more new tokens than cached ones, page-aligned or not, head_dim 128 and 64."""
    ref, cuda = request.getfixturevalue(which)
    g = torch.Generator().manual_seed(3 + cuts[0])
    tokens = torch.randint(0, ref.config.vocab_size, (cuts[-1],), generator=g).tolist()
    for be in (ref, cuda):
        be.truncate(0)
    outs = []
    for be in (ref, cuda):
        be.forward(tokens[:cuts[0]])
        be.forward(tokens[cuts[0]:cuts[1]])
        outs.append(be.forward(tokens[cuts[1]:cuts[2]]))
    err = float((outs[1] - outs[0]).norm() / outs[0].norm())
    assert err < 1e-2, err  # same budget as the teacher-forced test


def test_teacher_forced_7b_shapes():
    ref, cuda = make_pair(SEVEN_B_2L, max_context=256, gpu_weights=True)
    try:
        check_teacher_forced(ref, cuda, n_prompt=17, n_total=40)
    finally:
        del ref, cuda
        torch.cuda.empty_cache()


@pytest.mark.parametrize("min_pps", ["1", "64"])
def test_attn_min_pps_switch_reaches_the_step(monkeypatch, min_pps):
    """NANOQWEN_ATTN_MIN_PPS is read by engine/switches.py at backend init and handed to every
    attention_decode launch of the step as its min_pps argument (graph and eager alike);
    another split sizing changes only the summation order, so the oracle still agrees."""
    monkeypatch.setenv("NANOQWEN_ATTN_MIN_PPS", min_pps)
    ref, cuda = make_pair(helpers.TINY_UNTIED)
    assert cuda.attn_min_pps == int(min_pps)
    check_teacher_forced(ref, cuda)


@pytest.mark.parametrize("tma", ["0", "1"])
def test_attn_tma_switch_reaches_the_step(monkeypatch, tma):
    """NANOQWEN_ATTN_TMA picks attention_decode's page loop for every launch of the decode and
    verify steps (the engine's ints[11]); both agree with the fp32 oracle, and graph and eager
    generate the same greedy tokens with either."""
    monkeypatch.setenv("NANOQWEN_ATTN_TMA", tma)
    ref, cuda = make_pair(helpers.TINY_UNTIED)
    try:
        assert cuda.switches.attn_tma is (tma == "1")
        check_teacher_forced(ref, cuda)
        out = {}
        for mode in ("graph", "eager"):
            cuda.mode = mode
            cuda.truncate(0)
            out[mode] = gen_tokens(cuda, list(range(3, 40)), n=80)
        assert out["graph"] == out["eager"]
    finally:
        del ref, cuda
        torch.cuda.empty_cache()


def test_norm_fold_switch_changes_no_bit(monkeypatch):
    """NANOQWEN_NORM_FOLD (the engine's ints[13]): the decode step's norms folded into its GEMVs
    (1, the default) or launched as rmsnorm (0) compute the same numbers in the same order
    (csrc/common.cuh), so teacher-forced logits are equal bit for bit, graph and eager, and so
    are greedy and sampled generations; each also agrees with the fp32 oracle."""
    out = {}
    for fold in ("1", "0"):
        monkeypatch.setenv("NANOQWEN_NORM_FOLD", fold)
        ref, cuda = make_pair(helpers.TINY_UNTIED)
        try:
            assert cuda.switches.norm_fold is (fold == "1")
            check_teacher_forced(ref, cuda)
            g = torch.Generator().manual_seed(5)
            tokens = torch.randint(0, cuda.config.vocab_size, (70,), generator=g).tolist()
            for mode in ("graph", "eager"):
                cuda.mode = mode
                out[fold, mode, "logits"] = teacher_forced(cuda, tokens, 23)
                for name, params in (("greedy", GREEDY),
                                     ("sampled", SamplerParams(temperature=0.9, top_k=40,
                                                               top_p=0.95, repeat_penalty=1.1,
                                                               seed=7))):
                    cuda.truncate(0)
                    out[fold, mode, name] = gen_tokens(cuda, list(range(3, 40)), params, n=60)
        finally:
            del ref, cuda
            torch.cuda.empty_cache()
    for mode in ("graph", "eager"):
        assert torch.equal(out["1", mode, "logits"], out["0", mode, "logits"])
        for name in ("greedy", "sampled"):
            assert out["1", mode, name] == out["0", mode, name]
    assert out["1", "graph", "greedy"] == out["1", "eager", "greedy"]


def gen_tokens(backend, prompt, params=GREEDY, n=64, **kw):
    return [e.token_id for e in backend.generate(prompt, params, n, **kw)]


def test_graph_equals_eager_generation(untied):
    _, cuda = untied
    prompt = list(range(3, 40))
    out = {}
    for params in (GREEDY, SamplerParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02,
                                         repeat_penalty=1.1, seed=42)):
        for mode in ("graph", "eager"):
            cuda.mode = mode
            cuda.truncate(0)
            out[mode] = gen_tokens(cuda, prompt, params, n=80)
        assert out["graph"] == out["eager"]
        assert len(out["graph"]) == 80


def test_mode_switch_mid_generation(untied):
    _, cuda = untied
    prompt = list(range(5, 30))
    cuda.mode = "graph"
    cuda.truncate(0)
    want = gen_tokens(cuda, prompt, n=70)
    cuda.truncate(0)
    got = []
    for i, e in enumerate(cuda.generate(prompt, GREEDY, 70)):
        got.append(e.token_id)
        cuda.mode = "eager" if i % 20 < 10 else "graph"  # takes effect at the next token
    cuda.mode = "graph"
    assert got == want


def test_greedy_generation_matches_reference_prefix(untied):
    """Generated greedily, the CUDA tokens follow the reference until their first near-tie."""
    ref, cuda = untied
    prompt = list(range(7, 31))
    ref.truncate(0)
    cuda.truncate(0)
    want = gen_tokens(ref, prompt, n=32)
    got = gen_tokens(cuda, prompt, n=32)
    ref.truncate(0)
    lr = teacher_forced(ref, prompt + want, len(prompt))
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top2 = torch.topk(lr[i], 2).values
            assert float(top2[0] - top2[1]) < 0.05, (i, a, b)  # diverged only at a near-tie
            break


def assert_cache_consistent(cuda):
    n = len(cuda.kv_tokens)
    assert cuda.cache.length == n
    assert len(cuda.cache.page_table) == math.ceil(n / 16)


@pytest.mark.parametrize("how", ["stop", "cancel", "close", "length"])
def test_stop_and_cancel_leave_exact_cache(untied, how):
    _, cuda = untied
    prompt = list(range(9, 40))
    cuda.mode = "graph"
    cuda.truncate(0)
    free = gen_tokens(cuda, prompt, n=40)
    stop_at = 13
    cuda.truncate(0)
    cancel = threading.Event()
    got = []
    if how == "stop":
        stops = frozenset({free[stop_at]})
        first = free.index(free[stop_at])
        got = gen_tokens(cuda, prompt, n=40, stop_ids=stops)
        assert got == free[:first + 1]
    elif how == "cancel":
        for e in cuda.generate(prompt, GREEDY, 40, cancel=cancel):
            got.append(e.token_id)
            if len(got) == stop_at:
                cancel.set()
        assert got == free[:stop_at]
    elif how == "close":
        it = cuda.generate(prompt, GREEDY, 40)
        got = [next(it).token_id for _ in range(stop_at)]
        it.close()
    else:
        got = gen_tokens(cuda, prompt, n=stop_at)
    assert got == free[:len(got)]
    # the last yielded token was never forwarded; everything before it is in the cache
    assert cuda.kv_tokens == prompt + got[:-1]
    assert_cache_consistent(cuda)
    # the next turn continues from exactly that cache and matches a fresh run of the same ids
    turn2 = [got[-1], 5, 6, 7]
    cont = gen_tokens(cuda, turn2, n=20)
    history = list(cuda.kv_tokens)
    cuda.truncate(0)
    cuda.forward(prompt)
    for t in got[:-1]:
        cuda.forward([t])  # the decode path, as generation computed those K/V
    fresh = gen_tokens(cuda, turn2, n=20)
    assert cont == fresh
    assert cuda.kv_tokens == history


def test_context_full_stops():
    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.errors import ContextFullError

    cfg = helpers.TINY_TIED
    tensors = helpers.file_tensors(cfg, helpers.random_weights(cfg, seed=1))
    cuda = CudaBackend(cfg, tensors, max_context=40)
    got = gen_tokens(cuda, list(range(30)), n=100)
    assert len(got) == 11  # positions 30..39 forwarded, the 11th token cannot be
    assert len(cuda.kv_tokens) == 40
    assert_cache_consistent(cuda)
    with pytest.raises(ContextFullError):
        cuda.generate([1], GREEDY, 5)


def test_abandoned_generator_then_forward(untied):
    ref, cuda = untied
    prompt = list(range(11, 50))
    cuda.truncate(0)
    it = cuda.generate(prompt, GREEDY, 30)
    toks = [next(it).token_id for _ in range(6)]
    # not closed: a forward() takes the cache over from the suspended generator
    n = len(cuda.kv_tokens)
    assert cuda.kv_tokens == prompt + toks[:-1]
    logits = cuda.forward([toks[-1]])
    ref.truncate(0)
    ref.forward(prompt)
    for t in toks[:-1]:
        ref.forward([t])
    want = ref.forward([toks[-1]])
    assert float((logits - want).norm() / want.norm()) < 1e-2
    assert len(cuda.kv_tokens) == n + 1
    del it
    assert len(cuda.kv_tokens) == n + 1
    assert_cache_consistent(cuda)


def test_step_events_are_timed(untied):
    _, cuda = untied
    cuda.truncate(0)
    ev = list(cuda.generate(list(range(20)), GREEDY, 10))
    assert ev[0].first and not any(e.first for e in ev[1:])
    assert all(e.step_ms > 0 for e in ev)


def test_bench_rows_are_a_share_of_this_cards_copy_bandwidth(untied):
    """`nanoqwen bench`'s GB/s share is of the copy bandwidth measured on the card it runs
    on (engine/bench.py copy_bandwidth), not a fixed H200 figure: every tg row carries the
    measured figure and its share of it; the pp rows carry neither."""
    from nanoqwen.engine.bench import copy_bandwidth, format_table, run_bench

    _, cuda = untied
    copy = copy_bandwidth(cuda.device)
    assert copy is not None and copy > 0
    rows = run_bench(cuda, 16, 8, 1, ["graph", "eager"])
    tg = [r for r in rows if r["test"].startswith("tg")]
    assert len(tg) == 2 and all(r["copy_gb_per_s"] > 0 for r in tg)
    for r in tg:
        assert r["pct_of_copy_bw"] == pytest.approx(100 * r["gb_per_s"] / r["copy_gb_per_s"])
    assert not any("copy_gb_per_s" in r for r in rows if r["test"].startswith("pp"))
    assert f"% of copy ({tg[0]['copy_gb_per_s']:.0f})" in format_table(rows, 1)
    # at a depth (-d): the prompt after 40 cached ids, on the CUDA engine's prefill too
    deep = run_bench(cuda, 16, 8, 1, ["graph"], depth=40)
    assert [r["test"] for r in deep] == ["pp16 @ d40", "tg8 @ d40"]
    assert deep[0]["ttft_ms"] > 0 and deep[1]["ms_per_token"] > 0 and len(cuda.kv_tokens) == 0


def greedy_with_margins(ref, prompt, n, stop_ids):
    """The reference's greedy reply and, per step, its top-1 minus top-2 logit."""
    ref.truncate(0)
    logits = ref.forward(prompt)
    toks, margins = [], []
    for _ in range(n):
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        t = int(logits.argmax())
        toks.append(t)
        if t in stop_ids:
            break
        logits = ref.forward([t])
    return toks, margins


def test_bundled_model_greedy_matches_reference():
    """The trained tiny model (assets/tiny): greedy replies to held-out requests, token for
    token identical to the reference backend (fp32), graph and eager identical to each other,
    >= 256 identical tokens in all.

    A trained model still has the odd near-tie: on 2026-12-02 the H200 run diverged at step
    94 of `_get_pjrt_plugin_config`, where the fp32 reference's top-1 beat the runner-up by
    0.001 logits -- below what fp16 activations can resolve. So a reply may part from the
    reference only at a step whose reference margin is within twice the CUDA path's measured
    logit error there (teacher-forced on the reference's own prefix); the tokens before that
    step count, and must be identical."""
    import json

    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.backends.reference import ReferenceBackend
    from nanoqwen.engine.format import open_model
    from nanoqwen.engine.loader import default_model_path
    from nanoqwen.engine.tokenizer import Tokenizer

    path = default_model_path()
    if not path.exists():
        pytest.skip(f"{path} is not there")
    mf = open_model(path)
    tok = Tokenizer.from_model_file(mf)
    held = json.loads((path.parent / "heldout_requests.json").read_text())
    ref = ReferenceBackend.from_model_file(mf, device="cuda", max_context=1024)
    cuda = CudaBackend.from_model_file(mf, max_context=1024)
    identical, near_ties = 0, []
    for req in held["requests"]:
        ids = tok.encode_chat([{"role": "system", "content": held["system"]},
                               {"role": "user", "content": req["request"]}])
        want, margins = greedy_with_margins(ref, ids, 256, tok.stop_ids)
        got = {}
        for mode in ("graph", "eager"):
            cuda.mode = mode
            cuda.truncate(0)
            got[mode] = gen_tokens(cuda, ids, n=256, stop_ids=tok.stop_ids)
        assert got["graph"] == got["eager"], req["name"]
        g = got["graph"]
        k = next((i for i, (a, b) in enumerate(zip(g, want)) if a != b), min(len(g), len(want)))
        if g != want:
            assert k < len(want), (req["name"], "CUDA reply is longer than the reference's")
            prefix = ids + want[:k]
            lr = teacher_forced(ref, prefix, len(ids))[-1]
            lc = teacher_forced(cuda, prefix, len(ids))[-1]
            step_err = float((lc - lr).abs().max())
            assert margins[k] < 2 * step_err, (
                req["name"], k, margins[k], step_err, tok.decode(g), tok.decode(want))
            near_ties.append((req["name"], k, margins[k], step_err))
        identical += k
        if identical >= 256:
            break
    print(f"identical greedy tokens: {identical}; near-tie divergences: {near_ties}")
    assert identical >= 256

def chunk_tokens(chunks) -> list[int]:
    return [e.token_id for chunk in chunks for e in chunk]


def test_stop_halts_the_queued_graph_steps(untied):
    """A stop id sets the device halt flag: the graph steps the launcher queued after it do
    nothing (the GPU's position stays at the stop token's), and the chunks end at the stop."""
    _, cuda = untied
    assert cuda.gated, cuda.capture_note
    prompt = list(range(9, 40))
    cuda.mode = "graph"
    cuda.truncate(0)
    free = gen_tokens(cuda, prompt, n=60)
    stop = free[21]
    first = free.index(stop)
    cuda.truncate(0)
    got = chunk_tokens(cuda.generate_chunks(prompt, GREEDY, 400, stop_ids=frozenset({stop})))
    assert got == free[:first + 1]
    assert cuda.kv_tokens == prompt + got[:-1]
    assert_cache_consistent(cuda)
    # pos is where the next token would be forwarded: right after the stop token's step
    assert int(cuda.pos) == len(prompt) + first


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_chunks_equal_per_token_generation(untied, mode):
    """generate_chunks (one C++ wait per window) yields exactly generate()'s tokens, the first
    one alone, and leaves the same cache."""
    _, cuda = untied
    prompt = list(range(4, 44))
    params = SamplerParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=7)
    cuda.mode = mode
    cuda.truncate(0)
    want = gen_tokens(cuda, prompt, params, n=150)
    cuda.truncate(0)
    chunks = list(cuda.generate_chunks(prompt, params, 150, window_s=0.002))
    assert len(chunks[0]) == 1 and chunks[0][0].first
    assert chunk_tokens(chunks) == want
    assert cuda.kv_tokens == prompt + want[:-1]
    assert_cache_consistent(cuda)
    cuda.mode = "graph"


def test_request_cancel_halts_the_turn(untied):
    """request_cancel() (any thread) halts the GPU: every step that ran produced an id the
    generator delivered, and none ran after the halt (pos == the last delivered token's)."""
    _, cuda = untied
    prompt = list(range(3, 34))
    cuda.mode = "graph"
    cuda.truncate(0)
    it = cuda.generate_chunks(prompt, GREEDY, 450)
    got = [e.token_id for e in next(it)]
    cuda.request_cancel()
    got += chunk_tokens(it)
    assert len(got) < 450
    assert cuda.kv_tokens == prompt + got[:-1]
    assert_cache_consistent(cuda)
    assert int(cuda.pos) == len(prompt) + len(got) - 1
    # the next turn starts clean (the halt flag is reset)
    cuda.truncate(0)
    assert len(gen_tokens(cuda, prompt, n=20)) == 20


def test_engine_core_rejects_bad_tensors(untied):
    """The C++ core checks what it is given and names the tensor and the numbers."""
    _, cuda = untied
    c = cuda.config
    g, layer, dense, ints = cuda.core_args(n_layers=1)  # what the backend gives its own core
    Engine = torch.classes.nanoqwen.Engine
    s = cuda.stream.cuda_stream
    Engine(g, layer, dense, ints, 1e-6, s)  # the good arguments are accepted
    bad = list(g)
    bad[8] = torch.zeros(c.vocab_size + 1, device="cuda")
    with pytest.raises(RuntimeError, match=r"logits has shape \[%d\], expected \[%d\]"
                       % (c.vocab_size + 1, c.vocab_size)):
        Engine(bad, layer, dense, ints, 1e-6, s)
    with pytest.raises(RuntimeError, match="layers has 14 tensors, expected 15 a layer"):
        Engine(g, layer[:-1], dense, ints, 1e-6, s)
    with pytest.raises(RuntimeError, match="a dense matrix has shape"):
        Engine(g, layer, dense[::-1], ints, 1e-6, s)
    with pytest.raises(RuntimeError, match="ints has 13 values, expected 14"):
        Engine(g, layer, dense, ints[:-1], 1e-6, s)
    with pytest.raises(RuntimeError, match="prefill_attn_max=-1 must be >= 0"):
        Engine(g, layer, dense, ints[:-2] + [-1, 1], 1e-6, s)
    with pytest.raises(RuntimeError, match="norm_fold=2 must be 0 or 1"):
        Engine(g, layer, dense, ints[:-1] + [2], 1e-6, s)
    core = cuda.core
    prompt = list(range(3, 20))
    cuda.truncate(0)
    before = gen_tokens(cuda, prompt, n=12)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        core.prefill(torch.tensor([1, c.vocab_size], dtype=torch.int32), 0, False, True)
    with pytest.raises(RuntimeError, match="do not fit the cache"):
        core.prefill(torch.tensor([1, 2], dtype=torch.int32), cuda.max_context + 64, False, True)
    with pytest.raises(RuntimeError, match="at most 8"):
        core.begin_turn(list(range(9)))
    # start_turn checks everything before it changes anything on the device
    n_pages = cuda.cache.num_pages
    one = torch.tensor([1, 2, 3], dtype=torch.int32)

    def start_turn(stops=(), pf=(1.0, 1.0, 0.0, 1.0), pi=(0, 0, 1, 0), pt=(), ids=one, pos0=0,
                   n_steps=4, spec=()):
        core.start_turn(list(stops), list(pf), list(pi), list(pt), ids, pos0, n_steps, True, 4,
                        list(spec))
    for kwargs, match in [
            (dict(stops=range(9)), "at most 8"),
            (dict(pf=(1.0,)), "params_f and params_i hold 4 values each, got 1 and 4"),
            (dict(pi=(0, 0, 0, 0, 0)), "params_f and params_i hold 4 values each, got 4 and 5"),
            (dict(pt=[0] * (n_pages + 1)), f"{n_pages + 1} page table entries, the table "
                                             f"holds {n_pages}"),
            (dict(pt=[0, n_pages]), f"page {n_pages} at 1 is outside the pool"),
            (dict(pt=[-1]), "page -1 at 0 is outside the pool"),
            (dict(ids=torch.tensor([1, c.vocab_size], dtype=torch.int32)), "outside the vocab"),
            (dict(ids=torch.tensor([], dtype=torch.int32)), "ids must be a contiguous CPU"),
            (dict(pos0=cuda.max_context + 64), "do not fit the cache"),
            (dict(n_steps=-1), "n_steps=-1"),
            (dict(spec=(4, 3, 12, 2)), "spec holds .k_start, k_min, k_max, min_n, max_n. or "
                                        "nothing, got 4 values"),
            (dict(spec=(2, 3, 12, 2, 4)), "k_min=3 <= k_start=2 <= k_max=12 < 16 do not hold"),
            (dict(spec=(4, 3, 16, 2, 4)), "k_max=16 < 16 do not hold"),
            (dict(spec=(4, 0, 12, 2, 4)), "k_min=0 <= k_start=4"),
            (dict(spec=(4, 3, 12, 5, 4)), "min_n=5 <= max_n=4 .1..64. do not hold"),
            (dict(spec=(4, 3, 12, 2, 4), pi=(0, 0, 1, 2)), "the n-gram watch .params_i.3.. "
                                                           "must be 0")]:
        with pytest.raises(RuntimeError, match=match):
            start_turn(**kwargs)
    # none of that touched the turn the backend starts next
    cuda.truncate(0)
    assert gen_tokens(cuda, prompt, n=12) == before
    assert_cache_consistent(cuda)
