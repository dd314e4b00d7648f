"""Speculative decoding (engine/spec.py, Backend._spec_chunks, Sampler.verify) on the CPU
reference backend: exact against plain decoding, the cache invariant of docs/INTERFACES.md at
every suspension and exit, the rejection rule's distribution, and the CLI.

The bundled model (assets/tiny) is trained, so prompt lookup gets real acceptance on
code-editing requests; the tests assert that some drafts were kept, so "identical" is not
the trivial result of never speculating.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from nanoqwen.engine.loader import load
from nanoqwen.engine.sampling import Sampler, SamplerParams
from nanoqwen.engine.spec import NgramDrafter

MODEL = Path(__file__).resolve().parents[1] / "assets" / "tiny" / "tiny.nanoqwen"
CODE = ("def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n\n"
        "def scale(w, h, k):\n    return w * k, h * k\n")
PROMPTS = [f"Add type hints to this code:\n\n```python\n{CODE}```",
           f"Rename w to width and h to height:\n\n```python\n{CODE}```",
           "Write a function that reverses a string."]
GREEDY = SamplerParams.greedy_params()


@pytest.fixture(scope="module")
def engine():
    if not MODEL.is_file():
        pytest.skip("the bundled model is absent")
    eng = load(MODEL, backend="reference")
    yield eng
    eng.close()


def prompt_ids(eng, text: str) -> list[int]:
    return eng.tokenizer.encode_chat([{"role": "user", "content": text}])


def run(be, ids, params, n, spec, stop_ids=frozenset(), cancel=None, window_s=0.0,
        check=None):
    """Tokens of one turn from an empty cache; `check(yielded)` runs at every suspension."""
    be.truncate(0)
    be.spec = spec
    out: list[int] = []
    try:
        for chunk in be.generate_chunks(ids, params, n, stop_ids, cancel, window_s):
            out += [e.token_id for e in chunk]
            if check is not None:
                check(out)
    finally:
        be.spec = None
    return out


def invariant(be, ids):
    """kv_tokens == the new tokens + every yielded token but the last (empty prefix)."""
    def check(out):
        assert be.kv_tokens == ids + out[:-1], (len(be.kv_tokens), len(ids), len(out))
        assert be.cache.length == len(be.kv_tokens)
    return check


def same_as_plain(be, ids, n, spec, stop_ids=frozenset(), window_s=0.0) -> list[int]:
    """The turn with speculation `spec` (the invariant checked at every suspension) equals the
    plain turn, token for token; the tokens."""
    plain = run(be, ids, GREEDY, n, None, stop_ids)
    out = run(be, ids, GREEDY, n, spec, stop_ids, window_s=window_s, check=invariant(be, ids))
    assert out == plain
    return out


# --- the drafter ---------------------------------------------------------------------------
def test_drafter_takes_the_longest_latest_match():
    d = NgramDrafter([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3], k_start=3)
    # the last 2-gram (2, 3) last occurred ending at 7 (followed by 7, 8, 4); the 3-gram
    # (4, 2, 3) never did
    assert d.draft() == [7, 8, 4]
    assert d.draft(limit=1) == [7]
    d.extend([7])           # (2, 3, 7) matches at 6..8: continue with what followed
    assert d.draft() == [8, 4, 2]


def test_drafter_no_match_no_draft_and_adapts():
    d = NgramDrafter([5, 6, 7], k_start=4, k_min=2, k_max=8)
    assert d.draft() == []      # nothing earlier to match
    assert NgramDrafter([]).draft() == []
    d.update(4, 4)
    assert d.k == 6             # all kept: longer drafts
    d.update(6, 1)
    assert d.k == 2             # rejected early: just past what was kept
    d.update(2, 2)
    d.update(4, 4)
    d.update(6, 6)
    d.update(8, 8)
    assert d.k == 8             # bounded
    with pytest.raises(ValueError):
        NgramDrafter([], min_n=3, max_n=2)


def _latest_longest_match(toks: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The drafter's rule by brute force: for n from max_n down to min_n, the ids after the
    latest earlier occurrence of the last n ids (ending before the last position)."""
    end = len(toks) - 1
    for n in range(max_n, min_n - 1, -1):
        if n > len(toks):
            continue
        for p in range(end - 1, n - 2, -1):
            if toks[p + 1 - n:p + 1] == toks[end + 1 - n:]:
                return toks[p + 1:p + 1 + k]
    return []


def test_drafter_index_is_the_brute_force_rule():
    """The packed-int n-gram index gives the brute-force rule's draft at every length of fresh
    random sequences over small vocabularies (many repeats, so long and 1-token matches both
    occur), extended one id at a time and in chunks, with ids up to the largest allowed."""
    from nanoqwen.engine.spec import MAX_N, MIN_N, _ID_BITS

    seed = int(torch.randint(0, 2**31, (1,)))
    g = torch.Generator().manual_seed(seed)
    for min_n, max_n in ((MIN_N, MAX_N), (1, 8)):
        for vocab in (2, 3, 7, 50):
            toks = torch.randint(0, vocab, (300,), generator=g).tolist()
            toks = [t if t else (1 << _ID_BITS) - 2 for t in toks]   # the top id packs exactly
            d = NgramDrafter(toks[:5], min_n=min_n, max_n=max_n, k_start=6, k_min=6, k_max=6)
            n = 5
            while n < len(toks):
                step = int(torch.randint(1, 4, (1,), generator=g))
                d.extend(toks[n:n + step])
                n = min(n + step, len(toks))
                want = _latest_longest_match(toks[:n], min_n, max_n, 6)
                assert d.draft() == want, (seed, min_n, max_n, vocab, n)
    with pytest.raises(ValueError, match="outside"):
        NgramDrafter([1, 1 << _ID_BITS])
    with pytest.raises(ValueError, match="outside"):
        NgramDrafter([3, -1])


@pytest.mark.parametrize("vocab,min_n,max_n", [(3, 2, 4), (5, 1, 3), (40, 2, 4)])
def test_will_draft_says_whether_a_draft_comes(vocab, min_n, max_n):
    """will_draft() (a plain run's check after every id) is exactly whether draft() proposes
    anything, id by id over fresh random sequences, small vocabularies to match often."""
    gen = torch.Generator().manual_seed(vocab * 10 + min_n)
    ids = torch.randint(0, vocab, (300,), generator=gen).tolist()
    d = NgramDrafter(min_n=min_n, max_n=max_n)
    seen = set()
    for t in ids:
        d.extend([t])
        seen.add(d.will_draft())
        assert d.will_draft() == bool(d.draft()) == bool(d.draft(limit=1))
    assert seen == {True, False}


def test_a_draft_models_will_draft_follows_its_cache(engine):
    """ModelDrafter.will_draft(): true while the context and k ids fit the draft model's cache
    (draft() makes no draft otherwise)."""
    from nanoqwen.engine.spec import ModelDrafter

    be = engine.backend
    d = ModelDrafter(be, [1] * (be.max_context - 2), k_start=3)   # + 3 - 1 ids: just fits
    assert d.will_draft()
    d.extend([1])
    assert not d.will_draft() and d.draft() == []
    assert not ModelDrafter(be, []).will_draft()


def test_prompt_lookup_drafts_at_least_ngram_k_min_after_a_rejection():
    """Prompt lookup's drafts are free and the verify step's time hardly grows from 2 to 4
    tokens (spec.NGRAM_K_MIN's reason): after a rejection the next draft is not cut below
    NGRAM_K_MIN; a draft model's ids cost its own steps, so ModelDrafter keeps K_MIN."""
    import inspect

    from nanoqwen.engine.spec import K_MIN, NGRAM_K_MIN, ModelDrafter

    d = NgramDrafter([1, 2, 3, 4, 5, 6, 7, 1, 2])
    assert d.draft() == [3, 4, 5, 6]          # K_START ids after the earlier (1, 2)
    d.update(4, 0)
    assert d.k == NGRAM_K_MIN == 3
    assert d.draft() == [3, 4, 5]
    assert d.draft(limit=2) == [3, 4]          # the caller's limit still caps it
    assert inspect.signature(ModelDrafter).parameters["k_min"].default == K_MIN


# --- the rejection rule ----------------------------------------------------------------------
def test_verify_greedy_is_the_argmax():
    s = Sampler(GREEDY)
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0])
    assert s.verify(logits, [], 1) == (1, True)
    assert s.verify(logits, [], 2) == (1, False)


@pytest.mark.parametrize("draft,params", [
    (2, SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)),
    (0, SamplerParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0)),
    (4, SamplerParams(temperature=1.0, top_k=4, top_p=0.9, min_p=0.0)),   # draft outside
    (1, SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5)),
])
def test_verify_keeps_the_target_distribution(draft, params):
    """20000 verifications of one draft on a 6-token row: the emitted token's frequencies
    against the reference sampler's kept distribution p (chi-square; p-value > 1e-4 makes a
    false alarm a 1-in-10^4 event), and the draft kept with frequency p(draft)."""
    from nanoqwen.engine.sampling import _candidates, apply_repeat_penalty

    logits = torch.tensor([1.0, 0.2, 0.6, -0.5, 0.9, 0.0])
    history = [1, 3]
    s = Sampler(SamplerParams(**{**params.to_dict(), "seed": 99}))
    pen = apply_repeat_penalty(logits, history, params.repeat_penalty, params.repeat_last_n)
    vals, ids = _candidates(pen, params)
    probs = torch.softmax(vals / params.temperature, 0).double()
    p = {int(i): float(q) for i, q in zip(ids, probs)}
    n = 20000
    counts = [0] * 6
    kept = 0
    for _ in range(n):
        t, ok = s.verify(logits, history, draft)
        counts[t] += 1
        kept += ok
        assert not ok or t == draft   # kept means the draft itself
    assert all(counts[t] == 0 for t in range(6) if t not in p)
    cells = [(counts[t], n * q) for t, q in p.items() if n * q >= 5]
    chi2 = sum((c - e) ** 2 / e for c, e in cells)
    dof = len(cells) - 1
    if dof > 0:
        pval = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                             torch.tensor(chi2 / 2, dtype=torch.float64)))
        assert pval > 1e-4, (chi2, dof, counts, p)
    pd = p.get(draft, 0.0)
    # binomial noise of the kept count: sd = sqrt(n p (1-p)) <= 71; 5 sd
    assert abs(kept - n * pd) <= 5 * (n * pd * (1 - pd)) ** 0.5 + 1, (kept, n * pd)


# --- the backend ----------------------------------------------------------------------------
@pytest.mark.parametrize("text", PROMPTS)
def test_greedy_identical_with_and_without_speculation(engine, text):
    be = engine.backend
    ids = prompt_ids(engine, text)
    same_as_plain(be, ids, 160, "ngram", engine.tokenizer.stop_ids)
    st = be.spec_stats
    assert st["verify_steps"] > 0 and 0 <= st["accepted"] <= st["drafted"]
    if text != PROMPTS[-1]:
        assert st["accepted"] > 0, st   # a code edit repeats its input: drafts are kept


def test_the_policy_replay_is_the_backends_own_loop(engine):
    """benchmarks/spec_policy.py replays greedy speculation from the plain reply alone (no
    model): its drafted / accepted / verify-step counts must be the backend's own for the same
    request, or its 7B estimates describe another loop than the product's."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "spec_policy.py"
    spec_ = importlib.util.spec_from_file_location("spec_policy", path)
    sp = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(sp)
    be, stop = engine.backend, engine.tokenizer.stop_ids
    for text in PROMPTS[:2]:
        ids = prompt_ids(engine, text)
        plain = run(be, ids, GREEDY, 120, None, stop)
        run(be, ids, GREEDY, 120, "ngram", stop)
        req = dict(prompt=ids, reply=plain, stop_ids=sorted(stop))
        steps = sp.replay(lambda ctx, req: NgramDrafter(ctx), req, 120)
        got = dict(drafted=sum(d for d, _ in steps), accepted=sum(a for _, a in steps),
                   verify_steps=sum(1 for d, _ in steps if d))
        assert got == be.spec_stats and got["verify_steps"] > 0, (got, be.spec_stats)


def test_chunks_at_a_window_and_stats_in_the_session(engine):
    """With a 30 ms window steps are merged into lists (never split); the session reports the
    turn's drafted / accepted ids."""
    from nanoqwen.engine.session import ChatSession, Stats

    be = engine.backend
    ids = prompt_ids(engine, PROMPTS[0])
    same_as_plain(be, ids, 120, "ngram", window_s=0.03)
    be.truncate(0)
    be.spec = "ngram"
    try:
        s = ChatSession(be, engine.tokenizer)
        stats = [e for e in s.generate(PROMPTS[1], GREEDY, 80) if isinstance(e, Stats)][0]
    finally:
        be.spec = None
    assert stats.spec == "ngram" and stats.n_verify_steps > 0
    assert 0 < stats.n_accepted <= stats.n_drafted


@pytest.mark.parametrize("n", [1, 2, 3, 17])
def test_max_new_tokens_is_never_overrun(engine, n):
    be = engine.backend
    ids = prompt_ids(engine, PROMPTS[0])
    assert len(same_as_plain(be, ids, n, "ngram")) == n


def test_stop_inside_a_drafted_run(engine):
    """A stop id the sampler keeps inside a draft ends the turn there: every id after it is
    dropped and the cache holds the turn up to (not including) the stop."""
    be = engine.backend
    ids = prompt_ids(engine, PROMPTS[0])
    plain = run(be, ids, GREEDY, 160, None)
    # stop at a token the reply repeats (so speculation had drafted it): its second occurrence
    counts: dict[int, int] = {}
    for t in plain:
        counts[t] = counts.get(t, 0) + 1
    stop = next(t for t in plain[20:] if counts[t] >= 3)
    want = plain[:plain.index(stop) + 1]
    out = run(be, ids, GREEDY, 160, "ngram", frozenset({stop}), check=invariant(be, ids))
    assert out == want
    assert be.kv_tokens == ids + out[:-1]


def test_context_full_in_the_middle_of_a_draft(engine):
    """A cache that fills while drafts are on offer: drafts are capped to what fits, the turn
    yields the token that cannot be forwarded and stops, as plain decoding does."""
    ids = prompt_ids(engine, PROMPTS[0])
    eng2 = load(MODEL, backend="reference", max_context=len(ids) + 37)
    try:
        be = eng2.backend
        same_as_plain(be, ids, 500, "ngram")
        assert len(be.kv_tokens) == be.max_context
    finally:
        eng2.close()


def test_cancel_and_close_leave_the_cache_exact(engine):
    be = engine.backend
    ids = prompt_ids(engine, PROMPTS[0])
    cancel = threading.Event()
    be.truncate(0)
    be.spec = "ngram"
    try:
        out: list[int] = []
        for chunk in be.generate_chunks(ids, GREEDY, 160, frozenset(), cancel, 0.0):
            out += [e.token_id for e in chunk]
            if len(out) >= 10:
                cancel.set()
        assert 10 <= len(out) < 40   # a step at most after the cancel
        assert be.kv_tokens == ids + out[:-1]
        # abandoned after two lists, closed: the same invariant
        be.truncate(0)
        it = be.generate_chunks(ids, GREEDY, 160, frozenset(), None, 0.0)
        out = [e.token_id for e in next(it)] + [e.token_id for e in next(it)]
        it.close()
        assert be.kv_tokens == ids + out[:-1]
    finally:
        be.spec = None


def test_sampled_speculation_keeps_the_invariant(engine):
    be = engine.backend
    ids = prompt_ids(engine, PROMPTS[0])
    params = SamplerParams(temperature=0.8, seed=5)
    out = run(be, ids, params, 120, "ngram", engine.tokenizer.stop_ids,
              check=invariant(be, ids))
    assert 1 <= len(out) <= 120 and all(0 <= t < be.config.vocab_size for t in out)
    assert be.spec_stats["verify_steps"] > 0


def test_draw_seed_is_the_samplers_own_sequence():
    a, b = Sampler(SamplerParams(seed=3)), Sampler(SamplerParams(seed=3))
    xs = [a.draw_seed() for _ in range(4)]
    assert xs == [b.draw_seed() for _ in range(4)]      # a fixed seed: the same seeds
    assert len(set(xs)) == 4 and all(0 <= x < 2 ** 63 for x in xs)
    assert Sampler(SamplerParams(seed=4)).draw_seed() != xs[0]


@pytest.mark.parametrize("params", [
    SamplerParams(temperature=0.0, repeat_penalty=1.1, repeat_last_n=64),
    SamplerParams(temperature=0.8, repeat_penalty=1.2, seed=5),
], ids=["greedy-penalty", "sampled"])
def test_rows_drawn_where_the_logits_are(engine, monkeypatch, params):
    """Backend._verify_step's branch for a backend that draws its verify rows itself
    (`samples_rows`: the CUDA engine's verify_sample, checked against its sampler bit for bit
    in tests/gpu/test_verify.py). Here the rows are drawn on the host the way the device draws
    them: row i by a sampler seeded with the step's draw_seed(), over the context through
    tokens[i]. Greedy with a repetition penalty takes this branch and must give the plain
    reply token for token with drafts kept; a sampled turn must keep the cache invariant at
    every suspension and be the same twice with a fixed seed."""
    import dataclasses

    be = engine.backend

    def forward_all_sample(tokens, sampler):
        n0 = len(be.kv_tokens)
        rows = be.forward_all(tokens)
        draw = Sampler(dataclasses.replace(sampler.params, seed=sampler.draw_seed()))
        history = be.kv_tokens[:n0]
        return [draw.sample(rows[i], history + tokens[:i + 1]) for i in range(len(tokens))]

    monkeypatch.setattr(be, "samples_rows", True, raising=False)
    monkeypatch.setattr(be, "forward_all_sample", forward_all_sample, raising=False)
    ids = prompt_ids(engine, PROMPTS[0])
    stop = engine.tokenizer.stop_ids
    out = run(be, ids, params, 120, "ngram", stop, check=invariant(be, ids))
    st = be.spec_stats
    assert st["verify_steps"] > 0 and st["accepted"] > 0, st
    if params.greedy:
        assert out == run(be, ids, params, 120, None, stop)
    else:
        assert run(be, ids, params, 120, "ngram", stop) == out and len(out) > 20


def test_spec_refused_where_it_is_not_built(engine):
    from nanoqwen.engine.backends.cuda import CudaBackend

    with pytest.raises(ValueError, match="'medusa' is not available on the reference backend"):
        engine.backend.spec = "medusa"
    assert CudaBackend.spec_modes == ("ngram", "draft")   # its verify step: tests/gpu/test_verify.py


def test_cli_generate_spec_stats(capsys):
    if not MODEL.is_file():
        pytest.skip("the bundled model is absent")
    from nanoqwen.engine.cli import main

    args = ["generate", "-m", str(MODEL), "--backend", "reference", "-n", "60", "--temp", "0",
            "--prompt", PROMPTS[0]]
    assert main(args + ["--spec", "ngram", "--stats"]) == 0
    spec = capsys.readouterr()
    assert main(args) == 0
    plain = capsys.readouterr()
    assert spec.out == plain.out
    assert "spec ngram: drafted" in spec.err and "spec ngram" not in plain.err


# --- the draft-model drafter -------------------------------------------------------------------
def test_a_draft_model_gives_the_same_reply(engine):
    """The bundled model drafting for itself (the same tokenizer): greedy replies identical
    to plain decoding, the cache invariant at every suspension, nearly every draft kept (the
    same weights; a draft made one token at a time and its check in a multi-token forward
    may round a near-tie differently)."""
    from nanoqwen.engine.service import EngineService

    svc = EngineService.open(MODEL, backend="reference")
    try:
        svc.set_spec("draft", draft=MODEL)
        be = svc.backend
        assert be.draft_backend is not None and svc.spec == "draft"
        for text in PROMPTS[::2]:
            ids = prompt_ids(engine, text)
            same_as_plain(be, ids, 120, "draft", engine.tokenizer.stop_ids)
            st = be.spec_stats
            assert st["verify_steps"] > 0 and st["accepted"] >= 0.9 * st["drafted"], st
    finally:
        svc.close()
    assert be.draft_backend is None   # closed with the service


def test_a_draft_model_of_another_tokenizer_is_refused(tiny_model_path):
    from nanoqwen.engine.errors import NanoqwenError
    from nanoqwen.engine.service import EngineService

    if not MODEL.is_file():
        pytest.skip("the bundled model is absent")
    svc = EngineService.open(MODEL, backend="reference")
    try:
        with pytest.raises(NanoqwenError, match="has another tokenizer than .*same vocabulary"):
            svc.set_spec("draft", draft=tiny_model_path)
        assert svc.spec is None and svc.backend.draft_backend is None
        with pytest.raises(ValueError, match="'draft' needs a draft model"):
            svc.set_spec("draft")
    finally:
        svc.close()


def test_a_missing_or_truncated_draft_file_is_refused_and_loses_nothing(tmp_path):
    """A draft file that does not load: a clear error naming it, no speculation set, and the
    engine still answers as before (the same greedy reply)."""
    from nanoqwen.engine.errors import NanoqwenError
    from nanoqwen.engine.service import EngineService, Finished

    if not MODEL.is_file():
        pytest.skip("the bundled model is absent")
    truncated = tmp_path / "cut.nanoqwen"
    truncated.write_bytes(MODEL.read_bytes()[:5000])
    svc = EngineService.open(MODEL, backend="reference")
    try:
        def reply():
            return [e for e in svc.submit([], "def add", GREEDY, 12)
                    if isinstance(e, Finished)][0].stats.n_generated
        before = reply()
        for bad, says in [(tmp_path / "nope.nanoqwen", "does not exist"),
                          (truncated, "is truncated")]:
            with pytest.raises(NanoqwenError, match=says) as e:
                svc.set_spec("draft", draft=bad)
            assert str(bad) in str(e.value)
            assert svc.spec is None and svc.backend.draft_backend is None
        assert reply() == before
    finally:
        svc.close()


@pytest.mark.parametrize("args, says", [
    (["--spec", "draft"], "--spec draft: speculative decoding 'draft' needs a draft model"),
    (["--draft", "x.nanoqwen"], "--draft FILE goes with --spec draft"),
])
def test_cli_draft_flags_are_checked(capsys, args, says):
    if not MODEL.is_file():
        pytest.skip("the bundled model is absent")
    from nanoqwen.engine.cli import main

    assert main(["generate", "-m", str(MODEL), "--backend", "reference", "-n", "4",
                 "--prompt", "hi", *args]) == 1
    err = capsys.readouterr().err
    assert says in err, err


# --- nanoqwen bench --spec --------------------------------------------------------------------
def test_bench_spec_rows_on_the_code_edit_workload(capsys):
    """`nanoqwen bench --spec ngram` on the bundled model (trained: its acceptance is real):
    per request group a plain and a spec row; greedy replies identical; the counts add up
    (accepted <= drafted, tokens a verify step = (accepted + steps) / steps >= 1); on the edit
    requests some drafts are kept (a code edit repeats its input). No figure is asserted on
    this machine's speed: only that the rates are the tokens over the times given."""
    import json

    from nanoqwen.engine.cli import main
    from nanoqwen.engine.spec_workload import requests

    if not MODEL.is_file():
        pytest.skip("the bundled model is absent")
    assert main(["bench", "--backend", "reference", "--spec", "ngram", "-n", "24", "-r", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"] == "ngram" and out["draft"] is None and out["n_gen"] == 24
    kinds = [k for k, _ in requests()]
    groups = [f"edit{kinds.count('edit')}", f"new{kinds.count('new')}"]
    rows = out["rows"]
    assert [r["test"] for r in rows] == [f"{g} tg24{s}" for g in groups
                                         for s in ("", " spec=ngram")]
    for plain, spec in zip(rows[::2], rows[1::2]):
        assert plain["spec"] is None and spec["spec"] == "ngram"
        assert spec["identical"] is True and spec["n_generated"] == plain["n_generated"]
        assert 0 <= spec["accepted"] <= spec["drafted"]
        assert spec["tokens_per_s"] == pytest.approx(1e3 / spec["wall_ms_per_token"])
        assert spec["speedup"] == pytest.approx(plain["wall_ms_per_token"]
                                                / spec["wall_ms_per_token"])
        if spec["tokens_per_verify_step"] is not None:
            assert spec["tokens_per_verify_step"] >= 1
    assert rows[1]["accepted"] > 0, rows[1]   # the edits


def test_bench_spec_draft_and_refusals(tiny_model_path, capsys, tmp_path):
    """--spec draft with the model itself as its draft: every greedy draft is the target's own
    pick, so nearly all are kept (a multi-token forward may flip a near-tie in fp32); and the
    refusals, each one line before any work."""
    import json

    from nanoqwen.engine.cli import main

    if not MODEL.is_file():
        pytest.skip("the bundled model is absent")
    assert main(["bench", "--backend", "reference", "--spec", "draft", "--draft", str(MODEL),
                 "-n", "12", "-r", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["draft"] == str(MODEL)
    for spec in out["rows"][1::2]:
        assert spec["identical"] is True and spec["accepted"] >= 0.9 * spec["drafted"] > 0, spec
    for args, says in [
            (["--spec", "draft"], "--spec draft needs --draft FILE"),
            (["--draft", str(MODEL)], "--draft FILE goes with --spec draft"),
            (["--spec", "ngram", "--synthetic", "7b"], "--spec answers the code-editing requests"),
            (["--spec", "ngram", "-p", "64"], "-p and -d do not apply to --spec"),
            (["--spec", "ngram", "-d", "64"], "-p and -d do not apply to --spec"),
            (["--spec", "draft", "--draft", str(tiny_model_path)], "has another tokenizer than"),
            (["--spec", "draft", "--draft", str(tmp_path / "gone.nanoqwen")], "does not exist")]:
        assert main(["bench", "--backend", "reference", *args]) == 1, args
        err = capsys.readouterr().err
        assert says in err and len(err.splitlines()) == 1, (args, err)
