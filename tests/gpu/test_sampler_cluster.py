"""sample_token's thread-block cluster (csrc/sampling.cu: the vocabulary cut into slices, one
a block, the radix passes' histograms and the draw's sums exchanged through distributed shared
memory) against the same code in one block over the whole vocabulary (`blocks=1`, the slice
read from global memory) and the reference sampler (engine/sampling.py).

The token must not depend on the number of blocks (integer sums, a fixed id-order walk), so
the automatic cluster, clusters of 2, 4 and 8 and one block draw the same token for every
counter. Equality alone would also hold if every launch ran one block, so
test_cluster_is_used reads the block count and the stages from the kernel (its optional `path`
output).

    pytest tests/gpu/test_sampler_cluster.py -v
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOP_P = (0.5, 0.9, 0.95, 0.999)
MIN_P = (0.0, 0.05)


def ops():
    return torch.ops.nanoqwen


def state(V: int, top_k: int, top_p: float, min_p: float, temperature: float = 0.8,
          seed: int = 1234, penalty: float = 1.0, history: list[int] | None = None):
    """(params_f, params_i, ctx_tokens, pos) for one setting; the repetition penalty applies
    to `history` (the context ids, positions 0..len - 1)."""
    from nanoqwen.engine.ops import sampler_tensors
    from nanoqwen.engine.sampling import SamplerParams

    params = SamplerParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           repeat_penalty=penalty, repeat_last_n=64)
    pf, pi = sampler_tensors(params, seed, "cuda")
    history = history or [0]
    ctx = torch.zeros(max(16, len(history)), dtype=torch.int32, device="cuda")
    ctx[:len(history)] = torch.tensor(history, dtype=torch.int32)
    pos = torch.tensor([len(history) - 1], dtype=torch.int32, device="cuda")
    return pf, pi, ctx, pos


def draws(logits: torch.Tensor, st, counters, blocks: int = 0) -> list[int]:
    """One sample_token launch per counter value (no sync in between) with `blocks` blocks (0:
    the automatic cluster, as the engine launches it); the tokens."""
    pf, pi, ctx, pos = st
    c = torch.tensor(list(counters), dtype=torch.int64, device="cuda")
    out = torch.full((len(c),), -1, dtype=torch.int32, device="cuda")
    work = torch.empty_like(logits)
    for i in range(len(c)):
        ops().sample_token(out[i:i + 1], work, logits, ctx, pos, pf, pi, c[i:i + 1],
                           blocks=blocks)
    return out.tolist()


def reference_set(logits: torch.Tensor, top_p: float, min_p: float,
                  temperature: float = 0.8) -> dict[int, float]:
    """{id: probability} of the reference sampler's kept set (top-k off)."""
    from nanoqwen.engine.sampling import SamplerParams, _candidates

    params = SamplerParams(temperature=temperature, top_k=0, top_p=top_p, min_p=min_p)
    vals, ids = _candidates(logits.cpu(), params)
    probs = torch.softmax(vals / temperature, 0)
    return dict(zip(ids.tolist(), probs.tolist()))


def some_ids(V: int, k: int, gen) -> torch.Tensor:
    return torch.randperm(V, generator=gen, device="cuda")[:min(k, V)]


def make_logits(kind: str, V: int, gen) -> torch.Tensor:
    """Rows of different shapes: model-like peaked ones (strong tokens in the first, the last
    and any slice), flat and big-tie ones (kept sets of thousands), ties at the top-p cut,
    -inf/huge values."""
    x = torch.randn(V, generator=gen, device="cuda")
    if kind == "peaked":  # ~a real model: a few dozen strong tokens over a 2-sigma bulk
        x *= 2
        x[some_ids(V, 50, gen)] += 14
    elif kind == "peaked_first":  # strong tokens in warp 0's segment
        x *= 2
        x[:50] += 14
    elif kind == "peaked_last":  # strong tokens in the last (partial) warp segment
        x *= 2
        x[-50:] += 14
    elif kind == "zipf":  # logit = -s log(rank): s 2 is peaked, s 1.1 has a heavy tail
        s = 2.0 if V % 2 == 0 else 1.1
        x = -s * torch.log(torch.arange(1, V + 1, device="cuda", dtype=torch.float32))
        x = x[torch.randperm(V, generator=gen, device="cuda")]
    elif kind == "dense_top":  # 900 strong tokens spread over ~3 nats: lists of hundreds
        x *= 2
        x[some_ids(V, 900, gen)] = 10 + 0.7 * torch.randn(min(900, V), generator=gen,
                                                          device="cuda")
    elif kind == "ties":  # integer logits: ties at every top-p cut, all kept together
        x = torch.round(x * 2)
        x[some_ids(V, 40, gen)] = 12.0
        x[some_ids(V, 30, gen)] = 11.0
    elif kind == "tie_600":  # 600 tokens tied at the max
        x *= 2
        x[some_ids(V, 600, gen)] = 15.0
    elif kind == "tie_3000":  # 3000 tied at the max
        x *= 2
        x[some_ids(V, 3000, gen)] = 15.0
    elif kind == "flat":  # top-p keeps most of the vocabulary
        x *= 0.5
    elif kind == "flat_wide":  # kept sets of thousands to tens of thousands over many bins
        x *= 1.5
    elif kind == "flat_ties":  # logits on a 1/256-nat grid: thousands of ties at every cut
        x = torch.round(x * 0.5 * 256) / 256
    elif kind == "neginf":  # -inf everywhere but 300 ids
        keep = some_ids(V, 300, gen)
        y = torch.full((V,), -math.inf, device="cuda")
        y[keep] = 3 * x[keep]
        x = y
    elif kind == "huge":  # +-3e38 (differences overflow to +-inf) and a -inf
        x *= 2
        ids = some_ids(V, 3, gen)
        x[ids[0]] = 3e38
        if V > 1:
            x[ids[1]] = -3e38
        if V > 2:
            x[ids[2]] = -math.inf
    else:
        raise ValueError(kind)
    return x.contiguous()


KINDS = ["peaked", "peaked_first", "peaked_last", "zipf", "dense_top", "ties", "tie_600",
         "tie_3000", "flat", "flat_wide", "flat_ties", "neginf", "huge"]


# vocabularies: Qwen's two (16 slices of 9504 / 9496 ids in shared memory; one block reads the
# whole row from global memory), uneven slices, fewer ids than blocks
VS = [152064, 151936, 33333, 1025, 1000, 5]


@pytest.mark.parametrize("V", VS)
@pytest.mark.parametrize("kind", KINDS)
def test_cluster_equals_one_block(gen, kind, V):
    """For top_p in {0.5, 0.9, 0.95, 0.999} x min_p in {0, 0.05} (top_k off): the automatic
    cluster and one block draw the same token for 16 counters, and every token is in the
    reference sampler's kept set."""
    logits = make_logits(kind, V, gen)
    counters = range(100, 116)
    for top_p in TOP_P:
        for min_p in MIN_P:
            st = state(V, 0, top_p, min_p)
            got = draws(logits, st, counters)
            one = draws(logits, st, counters, blocks=1)
            where = f"{kind} V={V} top_p={top_p} min_p={min_p}"
            assert got == one, f"{where}: cluster {got} != one block {one}"
            # The kernel's fixed-point masses and the reference's fp64 cumsum could only
            # disagree on a token whose cumulative probability lands within ~1e-7 of top_p;
            # drawing exactly that token is a ~1e-5 event, so membership is checked strictly.
            ref = reference_set(logits, top_p, min_p)
            bad = [t for t in got if t not in ref]
            assert not bad, f"{where}: tokens {bad} outside the kept set (size {len(ref)})"


@pytest.mark.parametrize("blocks", [2, 4, 8])
@pytest.mark.parametrize("V", [152064, 33333, 1025, 5])
def test_any_block_count_draws_the_same_token(gen, V, blocks):
    """Clusters of 2, 4 and 8 blocks (other slice lengths and boundaries; at 2 blocks Qwen's
    slices are longer than the shared row and are read from global memory) against one block,
    on rows whose kept sets straddle the slices, for top-k, top-p and min-p together."""
    for kind in ("peaked", "peaked_last", "flat", "ties", "neginf"):
        logits = make_logits(kind, V, gen)
        for top_k, top_p, min_p in [(0, 0.9, 0.0), (40, 0.95, 0.05), (1500, 1.0, 0.0),
                                    (0, 1.0, 0.05)]:
            st = state(V, top_k, top_p, min_p)
            got = draws(logits, st, range(8), blocks=blocks)
            one = draws(logits, st, range(8), blocks=1)
            assert got == one, (kind, V, blocks, top_k, top_p, min_p, got, one)


# rows with ties at the cuts (csrc/sampling.cu keeps all tokens tied at the k-th value)
TIED = {"ties", "tie_600", "tie_3000", "flat_ties"}


@pytest.mark.parametrize("V", [152064, 33333, 1025])
@pytest.mark.parametrize("kind", KINDS)
def test_top_k_cluster_equals_one_block(gen, kind, V):
    """top_k from 1 to 50000 (and V - 1, and >= V: off), alone and with top-p / min-p: the
    cluster and one block draw the same token for 16 counters, inside the reference's kept
    set."""
    from nanoqwen.engine.sampling import SamplerParams, _candidates

    logits = make_logits(kind, V, gen)
    counters = range(200, 216)
    for top_k in sorted({1, 40, 256, 1000, 1500, 5000, 50000, V - 1, V, V + 7}):
        for top_p, min_p in [(1.0, 0.0), (0.9, 0.0), (0.95, 0.05), (1.0, 0.05)]:
            st = state(V, top_k, top_p, min_p)
            got = draws(logits, st, counters)
            one = draws(logits, st, counters, blocks=1)
            where = f"{kind} V={V} top_k={top_k} top_p={top_p} min_p={min_p}"
            assert got == one, f"{where}: cluster {got} != one block {one}"
            if kind in TIED:
                continue  # the kernel keeps every tie at the cut, torch.topk exactly k of them
            _, ids = _candidates(logits.cpu(), SamplerParams(temperature=0.8, top_k=top_k,
                                                             top_p=top_p, min_p=min_p))
            kept = set(ids.tolist())
            bad = [t for t in got if t not in kept]
            assert not bad, f"{where}: tokens {bad} outside the kept set (size {len(kept)})"


@pytest.mark.parametrize("V", [152064, 1000])
def test_repeat_penalty_cluster_equals_one_block(gen, V):
    """The repetition penalty is applied to each block's slice (in shared memory), or to
    `work` when the slice is read from global memory (one block at 152064): greedy matches the
    reference's penalised argmax, and sampled draws match one block's."""
    from nanoqwen.engine.sampling import apply_repeat_penalty

    logits = make_logits("peaked", V, gen)
    top = torch.topk(logits, 6).indices.tolist()
    logits[top[0]] = -abs(float(logits[top[0]]))  # a negative logit: penalised by multiplying
    history = [top[0], top[1], top[2], top[1], top[3], V - 1, 0] * 9  # duplicates once
    ref = apply_repeat_penalty(logits.cpu(), history, 1.7, 64)
    before = logits.clone()
    greedy = state(V, 0, 1.0, 0.0, temperature=0.0, penalty=1.7, history=history)
    for blocks in (0, 1, 4):
        assert draws(logits, greedy, [0], blocks=blocks) == [int(torch.argmax(ref))], blocks
    for top_k, top_p in [(0, 0.9), (40, 0.95), (0, 1.0)]:
        st = state(V, top_k, top_p, 0.0, penalty=1.7, history=history)
        got = draws(logits, st, range(16))
        assert got == draws(logits, st, range(16), blocks=1), (top_k, top_p)
        assert got == draws(logits, st, range(16), blocks=4), (top_k, top_p)
    assert torch.equal(logits, before)  # the penalty works on copies, never on the logits


@pytest.mark.parametrize("min_p", MIN_P)
def test_single_pos_inf(gen, min_p):
    """One +inf logit: every other token has zero probability, the cluster and one block
    return it (the reference sampler's softmax is NaN here, so it is not consulted)."""
    V = 152064
    logits = make_logits("peaked", V, gen)
    hot = int(some_ids(V, 1, gen))
    logits[hot] = math.inf
    for top_p in TOP_P:
        got = draws(logits, state(V, 0, top_p, min_p), range(8))
        one = draws(logits, state(V, 0, top_p, min_p), range(8), blocks=1)
        assert got == one == [hot] * 8, (top_p, got, one)


@pytest.mark.parametrize("top_p,min_p,temperature", [(0.9, 0.0, 0.8), (0.95, 0.05, 0.8),
                                                     (0.5, 0.0, 1.5)])
def test_peaked_distribution(gen, top_p, min_p, temperature):
    """20000 draws (counters 0..19999) on a peaked row against the reference probabilities."""
    V = 152064
    logits = make_logits("peaked", V, gen)
    ref = reference_set(logits, top_p, min_p, temperature)
    n = 20000
    toks = draws(logits, state(V, 0, top_p, min_p, temperature, seed=42), range(n))
    counts: dict[int, int] = {}
    for t in toks:
        assert t in ref, f"token {t} outside the kept set (size {len(ref)})"
        counts[t] = counts.get(t, 0) + 1
    # Pearson chi-square over the kept tokens; those expected fewer than 5 times are pooled
    # into one cell (the chi-square approximation needs expected counts >= 5).
    big = [t for t, p in ref.items() if n * p >= 5]
    cells = [(counts.get(t, 0), n * ref[t]) for t in big]
    rest_p = 1.0 - sum(ref[t] for t in big)
    if n * rest_p >= 5:
        cells.append((n - sum(c for c, _ in cells), n * rest_p))
    chi2 = sum((c - e) ** 2 / e for c, e in cells)
    dof = len(cells) - 1
    if dof > 0:
        # The kernel's weights are the softmax to ~1e-6 relative (2^32 fixed point, __expf), far
        # below the sampling noise of 20000 draws (~1/sqrt(20000) = 0.7%), so the draws should
        # follow the reference distribution. p-value = P(chi2_dof >= chi2) (regularised upper
        # gamma); 1e-4 makes a false alarm on a correct sampler a 1-in-10^4 event, while a kept
        # set off by one strong token or a biased walk gives p-values of ~0.
        pval = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                             torch.tensor(chi2 / 2, dtype=torch.float64)))
        assert pval > 1e-4, (chi2, dof, pval, len(ref))
    tv = 0.5 * sum(abs(counts.get(t, 0) / n - p) for t, p in ref.items())
    assert tv < 0.05, tv  # noise of 20000 draws over <= 50 outcomes is ~0.02


@pytest.mark.parametrize("kind,top_p,min_p", [("flat", 0.9, 0.0), ("flat_wide", 0.8, 0.0),
                                              ("flat", 0.95, 0.05)])
def test_flat_distribution(gen, kind, top_p, min_p):
    """20000 draws on a flat row, where the kept set has thousands of tokens spread over every
    slice, against the reference probabilities: the kept tokens
    sorted by logit and cut into 40 groups of equal reference mass, a chi-square over the
    groups' counts (each expects 500: a misplaced threshold or a biased walk shifts mass
    between groups far beyond that noise)."""
    V = 152064
    logits = make_logits(kind, V, gen)
    ref = reference_set(logits, top_p, min_p)
    assert len(ref) > 2000, len(ref)  # thousands of kept tokens, in every slice
    n, groups = 20000, 40
    toks = draws(logits, state(V, 0, top_p, min_p, seed=7), range(n))
    bad = [t for t in toks if t not in ref]
    assert not bad, f"{len(bad)} tokens outside the kept set"
    cpu = logits.cpu()
    order = sorted(ref, key=lambda t: -float(cpu[t]))
    cum, group_of = 0.0, {}
    for t in order:
        group_of[t] = min(int(cum * groups), groups - 1)
        cum += ref[t]
    mass = [0.0] * groups
    for t in order:
        mass[group_of[t]] += ref[t]
    counts = [0] * groups
    for t in toks:
        counts[group_of[t]] += 1
    chi2 = sum((c - n * m) ** 2 / (n * m) for c, m in zip(counts, mass) if m > 0)
    dof = sum(m > 0 for m in mass) - 1
    # p-value as in test_peaked_distribution (1e-4: a 1-in-10^4 false alarm)
    pval = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))
    assert pval > 1e-4, (chi2, dof, pval, len(ref))


def test_graph_replay_equals_eager(gen):
    """Captured and replayed launches draw the same tokens as eager ones (integer masses and
    a fixed walk order: nothing depends on scheduling)."""
    V = 152064
    logits = make_logits("peaked", V, gen)
    st = state(V, 0, 0.9, 0.05)
    n = 16
    eager = draws(logits, st, range(n))
    pf, pi, ctx, pos = st
    c = torch.arange(n, dtype=torch.int64, device="cuda")
    out = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    work = torch.empty_like(logits)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for i in range(n):
                ops().sample_token(out[i:i + 1], work, logits, ctx, pos, pf, pi, c[i:i + 1])
        out.fill_(-1)
        g.replay()
    torch.cuda.synchronize()
    assert out.tolist() == eager


# csrc/kernels.h: the kPath* bits sample_token writes to its optional `path` output
P_GREEDY, P_TOP_K, P_TOP_P, P_MIN_P, P_DRAW, P_ROW_SHARED, P_BLOCKS_SHIFT = 1, 2, 4, 8, 16, 32, 8
P_STAGES = P_GREEDY | P_TOP_K | P_TOP_P | P_MIN_P | P_DRAW


def path_bits(logits: torch.Tensor, st, blocks: int = 0) -> tuple[int, int]:
    """(token, the kPath* bits of the launch that drew it)."""
    pf, pi, ctx, pos = st
    out = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    path = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    c = torch.zeros(1, dtype=torch.int64, device="cuda")
    ops().sample_token(out, torch.empty_like(logits), logits, ctx, pos, pf, pi, c, path,
                       blocks=blocks)
    return int(out.item()), int(path.item())


def test_cluster_is_used(gen):
    """The equality tests pass trivially if every launch ran one block: the kernel reports its
    block count and the stages that ran (the `path` output). At Qwen's vocabulary the engine's
    launch (automatic) must be a cluster of at least 8 blocks with the slices in shared memory,
    run exactly the stages the setting asks for, and draw one block's token; a vocabulary of 5
    takes one block. How fast each is, is bench_step's and bench_samplers' question."""
    V = 152064
    peaked, flat = make_logits("peaked", V, gen), make_logits("flat", V, gen)
    for logits, top_k, top_p, min_p, temperature, stages in [
            (peaked, 0, 0.9, 0.0, 0.8, P_TOP_P | P_DRAW),
            (flat, 0, 0.95, 0.05, 0.8, P_TOP_P | P_MIN_P | P_DRAW),
            (peaked, 40, 0.95, 0.05, 0.8, P_TOP_K | P_TOP_P | P_MIN_P | P_DRAW),
            (flat, 5000, 1.0, 0.0, 0.8, P_TOP_K | P_DRAW),
            (flat, 0, 1.0, 0.0, 1.0, P_DRAW),
            (peaked, 40, 0.9, 0.0, 0.0, P_GREEDY)]:
        st = state(V, top_k, top_p, min_p, temperature)
        token, bits = path_bits(logits, st)
        one_token, one_bits = path_bits(logits, st, blocks=1)
        setting = (top_k, top_p, min_p, temperature, f"bits {bits:#x}, one block {one_bits:#x}")
        print(setting)
        assert bits >> P_BLOCKS_SHIFT >= 8 and bits & P_ROW_SHARED, setting
        assert bits & P_STAGES == stages == one_bits & P_STAGES, setting
        assert one_bits >> P_BLOCKS_SHIFT == 1 and not one_bits & P_ROW_SHARED, setting
        assert token == one_token, setting
    _, bits = path_bits(make_logits("peaked", 5, gen), state(5, 0, 0.9, 0.0))
    assert bits >> P_BLOCKS_SHIFT == 1 and bits & P_ROW_SHARED, f"{bits:#x}"


@pytest.mark.parametrize("blocks", [-1, 17])
def test_bad_block_count_is_refused(gen, blocks):
    """blocks outside 0..16 raises naming it, before anything is launched."""
    V = 4096
    logits = make_logits("peaked", V, gen)
    pf, pi, ctx, pos = state(V, 40, 0.9, 0.0)
    out = torch.full((1,), -7, dtype=torch.int32, device="cuda")
    c = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="blocks"):
        ops().sample_token(out, torch.empty_like(logits), logits, ctx, pos, pf, pi, c,
                           blocks=blocks)
    torch.cuda.synchronize()
    assert out.item() == -7


def test_largest_vocabulary_draws_the_same_token(gen):
    """At the largest vocabulary the sampler takes (2^19: csrc/sampling.cu kMaxSampleVocab) one
    block's warps see the most ids, so its 32-bit histogram words come closest to 2^32 (flat
    rows: every id taken, a mass part added per id in the later passes). The cluster and one
    block draw the same tokens, inside the reference's kept set; one id more is refused
    before anything is launched."""
    from nanoqwen.engine.sampling import SamplerParams, _candidates

    V = 1 << 19
    for kind in ("flat", "peaked"):
        logits = make_logits(kind, V, gen)
        for top_k, top_p in [(0, 0.9), (1000, 1.0), (50000, 0.95)]:
            st = state(V, top_k, top_p, 0.0)
            got = draws(logits, st, range(8))
            one = draws(logits, st, range(8), blocks=1)
            assert got == one, (kind, top_k, top_p, got, one)
            _, ids = _candidates(logits.cpu(), SamplerParams(temperature=0.8, top_k=top_k,
                                                             top_p=top_p, min_p=0.0))
            kept = set(ids.tolist())
            assert all(t in kept for t in got), (kind, top_k, top_p, got, len(kept))
    logits = make_logits("flat", V + 1, gen)
    pf, pi, ctx, pos = state(V + 1, 0, 0.9, 0.0)
    out = torch.full((1,), -7, dtype=torch.int32, device="cuda")
    c = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="largest vocabulary"):
        ops().sample_token(out, torch.empty_like(logits), logits, ctx, pos, pf, pi, c)
    torch.cuda.synchronize()
    assert out.item() == -7


@pytest.mark.parametrize("bad, names", [
    (lambda: torch.zeros(1, dtype=torch.int64, device="cuda"), "path"),     # dtype
    (lambda: torch.zeros(2, dtype=torch.int32, device="cuda"), "path"),     # shape
    (lambda: torch.zeros((1, 1), dtype=torch.int32, device="cuda"), "path"),
    (lambda: torch.zeros(1, dtype=torch.int32), "path")])                   # device
def test_bad_path_output_is_refused_and_draws_nothing(gen, bad, names):
    """sample_token's optional `path` output is checked like its other arguments: a wrong
    dtype, shape or device raises naming it, before anything is launched (the token output
    keeps its value)."""
    V = 4096
    logits = make_logits("peaked", V, gen)
    pf, pi, ctx, pos = state(V, 40, 0.9, 0.0)
    out = torch.full((1,), -7, dtype=torch.int32, device="cuda")
    c = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match=names):
        ops().sample_token(out, torch.empty_like(logits), logits, ctx, pos, pf, pi, c, bad())
    torch.cuda.synchronize()
    assert out.item() == -7
