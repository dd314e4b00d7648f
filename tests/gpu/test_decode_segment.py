"""The persistent segment kernels (csrc/decode_segment.cu, NANOQWEN_DECODE_SEGMENTS=1) against the
chain of launches they replace, on the same weights: the decode step's logits must be equal bit for
bit (the kernels form every row's sum in the chain's operations and order, and the norm on the
chain's reduction tree), in graph and eager mode, at every family shape that decides the kernel's
geometry (K split 2/4/8, rows not a multiple of the grid, more or fewer 16-row tiles than SMs,
x of 256 to 27648 halves), and against the fp32 oracle with the usual budget. The verify step's
rows equal these decode steps too (tests/gpu/test_verify.py runs it with the segments)."""

from __future__ import annotations

import pytest
import torch

import helpers
from nanoqwen.engine.config import PRESETS, ModelConfig
from nanoqwen.engine.sampling import SamplerParams
from nanoqwen.engine.switches import DECODE_SEGMENTS

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def shapes(preset: str, layers: int) -> ModelConfig:
    return ModelConfig(name=f"{preset}-shapes-{layers}-layers",
                       **{**PRESETS[preset], "num_hidden_layers": layers})


def build(cfg: ModelConfig, tensors, segments: bool, max_context: int = 512):
    """A CUDA backend with NANOQWEN_DECODE_SEGMENTS set while it is built (read there)."""
    from nanoqwen.engine.backends.cuda import CudaBackend

    with helpers.environ(**{DECODE_SEGMENTS: "1" if segments else "0"}):
        be = CudaBackend(cfg, tensors, max_context=max_context)
    assert be.switches.decode_segments is segments
    return be


def step_logits(be, tokens, n_prompt):
    """The prompt's prefill, then one decode step a token (graph or eager, as be.mode says)."""
    be.truncate(0)
    out = [be.forward(tokens[:n_prompt])]
    out += [be.forward([t]) for t in tokens[n_prompt:]]
    return torch.stack(out[1:])


CASES = [
    ("tiny-untied", lambda: helpers.TINY_UNTIED, False),
    ("tiny-tied", lambda: helpers.TINY_TIED, False),
    ("0.5b-2l", lambda: shapes("0.5b", 2), True),     # x 896 / 4864, KS 4 for down, tied
    ("1.5b-2l", lambda: shapes("1.5b", 2), True),     # down K 8960: KS 8
    ("7b-2l", lambda: shapes("7b", 2), True),
    ("32b-1l", lambda: shapes("32b", 1), True),       # x of 27648 halves: the fewest ring stages
]


@pytest.mark.parametrize("name,cfg_fn,gpu", CASES, ids=[c[0] for c in CASES])
def test_segments_equal_the_chain_bit_for_bit(name, cfg_fn, gpu):
    from nanoqwen.engine.synthetic import SyntheticWeights

    cfg = cfg_fn()
    tensors = SyntheticWeights(cfg, 0, device="cuda") if gpu else \
        helpers.file_tensors(cfg, helpers.random_weights(cfg, seed=0))
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (40,), generator=g).tolist()
    n_prompt = 17   # decode positions 17..39: a partial page, a page boundary, the next page
    chain = build(cfg, tensors, segments=False)
    try:
        want = {}
        for mode in ("graph", "eager"):
            chain.mode = mode
            want[mode] = step_logits(chain, tokens, n_prompt)
        assert torch.equal(want["graph"], want["eager"])
    finally:
        del chain
        torch.cuda.empty_cache()
    seg = build(cfg, tensors, segments=True)
    try:
        for mode in ("graph", "eager"):
            seg.mode = mode
            got = step_logits(seg, tokens, n_prompt)
            assert torch.isfinite(got).all()
            diff = (got - want[mode]).abs().max()
            assert torch.equal(got, want[mode]), f"{name} {mode}: max |dlogit| {float(diff):.3e}"
        # a sampled generation: the same tokens as the chain gives, graph == eager
        params = SamplerParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02,
                               repeat_penalty=1.1, seed=5)
        toks = {}
        for mode in ("graph", "eager"):
            seg.mode = mode
            seg.truncate(0)
            toks[mode] = [e.token_id for e in seg.generate(tokens[:n_prompt], params, 48)]
        assert toks["graph"] == toks["eager"] and len(toks["graph"]) == 48
    finally:
        del seg
        torch.cuda.empty_cache()


def test_segments_agree_with_the_oracle(monkeypatch):
    """The fp32 reference on the same INT4 weights (test_cuda_backend's budget and near-tie rule),
    long enough to cross several pages of the cache."""
    from test_cuda_backend import check_teacher_forced, make_pair

    monkeypatch.setenv(DECODE_SEGMENTS, "1")
    ref, cuda = make_pair(helpers.TINY_UNTIED)
    try:
        assert cuda.switches.decode_segments
        check_teacher_forced(ref, cuda, n_prompt=5, n_total=120)
    finally:
        del ref, cuda
        torch.cuda.empty_cache()


def test_engine_rejects_an_unknown_decode_kernel():
    from test_cuda_backend import make_pair

    _, cuda = make_pair(helpers.TINY_UNTIED)
    g, layer, dense, ints = cuda.core_args(n_layers=1)
    Engine = torch.classes.nanoqwen.Engine
    s = cuda.stream.cuda_stream
    with pytest.raises(RuntimeError, match="decode kernel=2 must be 0 .the chain. or 1"):
        Engine(g, layer, dense, ints[:13] + [2], 1e-6, s)
    core = Engine(g, layer, dense, ints[:13] + [1], 1e-6, s)   # one layer: segments 0 and 1
    del core
