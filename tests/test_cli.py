"""`nanoqwen generate` end to end on a tiny `.nanoqwen` file (random weights, tiny tokenizer).

The happy paths run the real console entry point in a subprocess (stdout/stdin as a user
sees them); the error paths call cli.main in-process, which is the same code minus the
interpreter start-up.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import TINY_UNTIED, write_tiny_model
from nanoqwen.engine.cli import main
from nanoqwen.engine.loader import LoadedEngine, default_model_path, load
from nanoqwen.engine.sampling import SamplerParams
from nanoqwen.engine.session import ChatSession, TextDelta, generate_raw

SYSTEM = "You are a helpful assistant."
PROMPT = "write a function that adds two numbers"


def nanoqwen(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoqwen.engine.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def session_text(path, user, n, system=None, raw=False):
    eng = load(path, backend="reference")
    try:
        params = SamplerParams.greedy_params()
        if raw:
            evs = generate_raw(eng.backend, eng.tokenizer, user, params, n)
        else:
            evs = ChatSession(eng.backend, eng.tokenizer, system_prompt=system).generate(user, params, n)
        return "".join(e.text for e in evs if isinstance(e, TextDelta))
    finally:
        eng.close()


def test_generate_streams_the_session_text(tiny_model_path):
    r = nanoqwen("generate", "-m", str(tiny_model_path), "-p", PROMPT, "--system", SYSTEM,
                 "--temp", "0", "-n", "24", "--stats")
    assert r.returncode == 0, r.stderr
    expected = session_text(tiny_model_path, PROMPT, 24, system=SYSTEM)
    assert r.stdout == expected and len(expected) > 0
    assert "TTFT" in r.stderr and "generated 24" in r.stderr and "done: length" in r.stderr
    # --stats: the engine's figures and what stdout saw, from the same engine service as the app
    num = r"(\d+\.\d+)"
    m = re.search(rf"engine: decode {num} tok/s, median {num} ms/token; TTFT {num} ms", r.stderr)
    assert m and float(m[1]) > 0 and float(m[2]) > 0, r.stderr
    engine_ttft = float(m[3])
    seen = re.search(rf"stdout: TTFT {num} ms \(request to first character\); text {num} tok/s",
                     r.stderr)
    # stdout's clock starts before the prefill that the engine's TTFT times
    assert seen and float(seen[1]) >= engine_ttft > 0 and float(seen[2]) > 0, r.stderr
    assert re.search(rf"prompt \d+ tokens \(\d+ prefilled, {num} tok/s\)", r.stderr), r.stderr


def test_generate_reads_the_prompt_from_stdin_raw(tiny_model_path):
    r = nanoqwen("generate", "-m", str(tiny_model_path), "--raw", "--temp", "0", "-n", "10",
                 stdin="def add(a, b):\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == session_text(tiny_model_path, "def add(a, b):\n", 10, raw=True)


def test_sampler_defaults_come_from_the_file(tmp_path, capsys):
    # do_sample false in the file's generation config means greedy, with no --temp flag
    path = write_tiny_model(tmp_path / "g.nanoqwen", generation={"do_sample": False})
    assert main(["generate", "-m", str(path), "-p", PROMPT, "-n", "8"]) == 0
    assert capsys.readouterr().out == session_text(path, PROMPT, 8)


def test_bad_model_path(tmp_path, capsys):
    missing = tmp_path / "nope.nanoqwen"
    assert main(["generate", "-m", str(missing), "-p", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("nanoqwen generate: error:") and str(missing) in err


def test_not_a_model_file(tmp_path, capsys):
    junk = tmp_path / "junk.nanoqwen"
    junk.write_bytes(b"hello, not a model" * 10)
    assert main(["generate", "-m", str(junk), "-p", "hi"]) == 1
    assert "not a .nanoqwen file" in capsys.readouterr().err


def test_threads_reach_the_cpu_backend_and_bad_counts_are_refused(tiny_model_path):
    """In subprocesses: the thread count is the process's (the CPU backend's one team)."""
    import json

    r = nanoqwen("bench", "-m", str(tiny_model_path), "--backend", "reference", "-p", "8",
                 "-n", "4", "-r", "1", "-t", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["threads"] == 1
    too_many = str((os.cpu_count() or 1) + 1)
    r = nanoqwen("generate", "-m", str(tiny_model_path), "-p", "hi", "-n", "2", "-t", too_many)
    assert r.returncode == 1 and f"threads={too_many}" in r.stderr
    assert "this machine's CPUs" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("flags, named", [
    (["--top-p", "2"], "--top-p"),
    (["--min-p", "-0.5"], "--min-p"),
    (["--repeat-penalty", "0"], "--repeat-penalty"),
    (["-n", "0"], "-n 0"),
])
def test_bad_flag_values_name_the_flag(tiny_model_path, capsys, flags, named):
    assert main(["generate", "-m", str(tiny_model_path), "-p", "hi", *flags]) == 1
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_prompt_too_long_is_a_clear_error(tiny_model_path, capsys):
    # the reference backend's CPU context is 4096 tokens; this prompt is far longer
    assert main(["generate", "-m", str(tiny_model_path), "-p", "xq7 " * 3000]) == 1
    err = capsys.readouterr().err
    assert "context holds 4096 tokens" in err


def test_cuda_backend_requested_without_cuda(tiny_model_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["generate", "-m", str(tiny_model_path), "-p", "hi", "--backend", "cuda"]) == 1
    assert "no CUDA device" in capsys.readouterr().err


def test_loader_auto_falls_back_with_a_reason(tiny_model_path):
    import torch

    eng = load(tiny_model_path, max_context=100)
    try:
        assert isinstance(eng, LoadedEngine)
        backend, tok, mf = eng                     # unpacks like the old tuple
        assert backend.config == TINY_UNTIED and backend.max_context == 100
        assert mf.path == tiny_model_path and 2 in tok.stop_ids
        if not torch.cuda.is_available():
            assert backend.name == "reference" and "no CUDA device" in eng.fallback_reason
            assert backend.mode == "eager"        # the reference backend has no graph mode
    finally:
        eng.close()
    assert default_model_path().parts[-3:] == ("assets", "tiny", "tiny.nanoqwen")


# --- a Unix tool's edges: closed pipe, full disk, bad --temp, corrupt file ---------------------
def nanoqwen_cmd(*args: str) -> str:
    import shlex
    return " ".join(shlex.quote(a) for a in (sys.executable, "-m", "nanoqwen.engine.cli", *args))


def test_closed_pipe_ends_quietly_with_141(tiny_model_path):
    # `| head -c 20` closes the pipe after 20 bytes; the reply (400 tokens) is far longer
    cmd = nanoqwen_cmd("generate", "-m", str(tiny_model_path), "-p", PROMPT, "--temp", "0",
                       "-n", "400")
    r = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd} | head -c 20"],
                       capture_output=True, timeout=120)
    assert len(session_text(tiny_model_path, PROMPT, 400).encode()) > 200  # long enough
    assert r.returncode == 141, r.stderr.decode()
    assert len(r.stdout) == 20 and r.stderr == b""  # no traceback, no "Exception ignored"


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("cmd", ["generate", "info"])
def test_full_disk_is_one_error_line(tiny_model_path, cmd):
    args = (["generate", "-m", str(tiny_model_path), "-p", PROMPT, "--temp", "0", "-n", "16"]
            if cmd == "generate" else ["info", str(tiny_model_path)])
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "nanoqwen.engine.cli", *args], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr == f"nanoqwen {cmd}: error: cannot write to stdout: No space left on device\n"


@pytest.mark.parametrize("value", ["-1", "-0.5", "nan", "inf"])
def test_negative_temperature_is_refused_with_the_range(tiny_model_path, capsys, value):
    assert main(["generate", "-m", str(tiny_model_path), "-p", "hi", "--temp", value]) == 1
    err = capsys.readouterr().err
    assert err == (f"nanoqwen generate: error: --temp: sampler setting temperature="
                   f"{float(value)!r} is invalid: must be a number >= 0 (0: greedy)\n")


def test_temperature_zero_is_greedy(tiny_model_path, capsys):
    assert main(["generate", "-m", str(tiny_model_path), "-p", PROMPT, "--temp", "0",
                 "--seed", "1", "-n", "12"]) == 0
    assert capsys.readouterr().out == session_text(tiny_model_path, PROMPT, 12)


def test_a_flipped_byte_inside_a_tensor_stops_the_load(tiny_model_path, tmp_path, capsys):
    from nanoqwen.engine.format import open_model
    bad = tmp_path / "bad.nanoqwen"
    data = bytearray(tiny_model_path.read_bytes())
    with open_model(tiny_model_path) as mf:
        t = mf.tensors["model.layers.1.mlp.up_proj.qweight"]
    data[t.offset + t.nbytes // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    assert main(["generate", "-m", str(bad), "-p", PROMPT, "-n", "4"]) == 1
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.splitlines()) == 1
    assert "checksum mismatch in tensor 'model.layers.1.mlp.up_proj.qweight'" in cap.err
    assert "the file is corrupt" in cap.err
    # the app opens models through the same service: the same error, no model
    from nanoqwen.engine import EngineService
    from nanoqwen.engine.errors import FormatError
    with pytest.raises(FormatError, match="checksum mismatch"):
        EngineService.open(bad, backend="reference")


# --- nanoqwen bench on the reference backend ---------------------------------------------------
def test_bench_reference_backend(tiny_model_path, capsys):
    import json
    assert main(["bench", "--backend", "reference", "-m", str(tiny_model_path), "-p", "16",
                 "-n", "8", "-r", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "reference" and out["device"] == "cpu" and out["threads"] >= 1
    assert out["source"] == str(tiny_model_path) and out["n_prompt"] == 16
    pp, tg = out["rows"]
    assert pp["test"] == "pp16" and tg["test"] == "tg8" and pp["mode"] == tg["mode"] == "eager"
    assert pp["tokens_per_s"] > 0 and len(pp["ttft_all"]) == 2
    assert tg["tokens_per_s"] == pytest.approx(1e3 / tg["ms_per_token"])
    assert "gb_per_s" not in tg  # INT4 bandwidth means nothing for fp32 weights on the CPU


def test_bench_sampler_flags(tiny_model_path, capsys):
    """Decode samples with the flags given over the app's defaults (greedy without any); the
    rows and the header say which sampler ran; a bad value is refused naming the setting."""
    import json
    base = ["bench", "--backend", "reference", "-m", str(tiny_model_path), "-p", "8", "-n", "4",
            "-r", "1", "--json"]
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["sampler"] == "greedy"
    assert main(base + ["--top-k", "0", "--top-p", "0.8", "--repeat-penalty", "1.1"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = ("temp 0.8, top-k 0, top-p 0.8, min-p 0.05, repeat-penalty 1.1 (last 64)")
    assert out["sampler"] == want and all(r["sampler"] == want for r in out["rows"])
    assert main(base + ["--top-p", "1.5"]) == 1
    err = capsys.readouterr().err
    assert "top_p=1.5 is invalid" in err and len(err.splitlines()) == 1, err


def test_bench_sampler_draws_the_same_tokens_every_repetition(tiny_model_path):
    """A sampled bench fixes the seed, so its repetitions (and the warm-up) time the same
    tokens; at temperature 1.5 over the whole vocabulary they are not the greedy ones."""
    from nanoqwen.engine import loader
    from nanoqwen.engine.bench import run_bench
    from nanoqwen.engine.sampling import SamplerParams

    loaded = loader.load(tiny_model_path, backend="reference", max_context=64)
    try:
        be = loaded.backend
        runs = []
        real = be.generate

        def generate(prompt, params, max_new_tokens):  # the real decode, its tokens noted
            runs.append([])
            for ev in real(prompt, params, max_new_tokens):
                runs[-1].append(ev.token_id)
                yield ev
        be.generate = generate
        run_bench(be, 8, 12, 2, ["eager"], params=SamplerParams(temperature=1.5, top_k=0,
                                                                top_p=1.0, min_p=0.0))
        sampled = runs[:]
        runs.clear()
        run_bench(be, 8, 12, 1, ["eager"])
        greedy = runs[0]
    finally:
        loaded.close()
    assert len(sampled) == 3 and sampled[0] == sampled[1] == sampled[2], sampled
    assert sampled[0] != greedy


def test_bench_defaults_to_the_bundled_model(capsys):
    if not default_model_path().is_file():
        pytest.skip("the bundled model is absent")
    assert main(["bench", "--backend", "reference", "-p", "8", "-n", "4", "-r", "1"]) == 0
    out = capsys.readouterr().out
    assert str(default_model_path()) in out and "| tg4 |" in out and "reference" in out


@pytest.mark.parametrize("args, says", [
    (["--mode", "graph"], "--mode graph: the reference backend has only eager"),
    (["--synthetic", "7b"], "--synthetic makes its weights on the GPU"),
    (["-p", "4000"], "exceeds the model's context 4096"),
    (["-d", "-1"], "--depth -1: the cached tokens before each test, 0 or more"),
    (["--prefill-weights", "int4"], "--prefill-weights int4: the reference backend prefills one way"),
    (["-d", "3800", "-p", "200", "-n", "128"],
     "-d + -p + -n = 4128 exceeds the model's context 4096"),
])
def test_bench_reference_refusals(tiny_model_path, capsys, args, says):
    model = [] if "--synthetic" in args else ["-m", str(tiny_model_path)]
    assert main(["bench", "--backend", "reference", *model, *args]) == 1
    err = capsys.readouterr().err
    assert says in err and len(err.splitlines()) == 1, err


def test_bench_on_the_reference_backend_claims_no_bandwidth(tiny_model_path):
    """The reference backend runs fp32 weights dequantized at load: its rows carry no GB/s and
    no share of a copy bandwidth, and a CPU has no device copy figure (engine/bench.py)."""
    from nanoqwen.engine import loader
    from nanoqwen.engine.bench import copy_bandwidth, format_table, run_bench

    assert copy_bandwidth("cpu") is None
    loaded = loader.load(tiny_model_path, backend="reference", max_context=64)
    try:
        rows = run_bench(loaded.backend, 8, 4, 1, ["eager"])
    finally:
        loaded.close()
    assert [r["test"] for r in rows] == ["pp8", "tg4"]
    assert not any(k in r for r in rows for k in ("gb_per_s", "copy_gb_per_s", "pct_of_copy_bw"))
    assert "| % of copy |" in format_table(rows, 1)


def test_bench_commit_names_the_tree(monkeypatch, tmp_path):
    """A benchmark JSON's commit: NANOQWEN_COMMIT when set (the device's copy has no .git); in
    this checkout its short HEAD, marked "-dirty" exactly when tracked files differ from it;
    "unknown" for an installed copy without a checkout (engine/bench.py _commit)."""
    import nanoqwen
    from nanoqwen.engine.bench import _commit

    monkeypatch.setenv("NANOQWEN_COMMIT", "abc1234")
    assert _commit() == "abc1234"
    monkeypatch.delenv("NANOQWEN_COMMIT")
    if (nanoqwen.REPO_ROOT / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=nanoqwen.REPO_ROOT,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=nanoqwen.REPO_ROOT, capture_output=True, text=True).stdout
        assert _commit() == head + ("-dirty" if dirty.strip() else "")
    monkeypatch.setattr(nanoqwen, "REPO_ROOT", tmp_path)   # no .git there
    assert _commit() == "unknown"


def test_bench_depth_prefills_the_prompt_after_the_cached_context(tiny_model_path, capsys):
    """`-d` (llama-bench's depth): every repetition forwards the same `depth` random ids first
    and then times the prompt's prefill and the decode on top of them: generate is called with
    exactly those ids cached, its first token is the one the whole sequence forwarded at once
    gives (greedy; either of two logits closer than 1e-3, a near-tie that the split of the
    forward into two calls may flip in fp32), and the rows say the depth as llama-bench does."""
    import json

    from nanoqwen.engine import loader
    from nanoqwen.engine.bench import run_bench

    loaded = loader.load(tiny_model_path, backend="reference", max_context=64)
    try:
        be = loaded.backend
        calls = []
        real = be.generate

        def generate(prompt, params, max_new_tokens):
            cached = list(be.kv_tokens)
            events = list(real(prompt, params, max_new_tokens))
            calls.append((cached, list(prompt), events[0].token_id))
            yield from events
        be.generate = generate
        rows = run_bench(be, 8, 4, 2, ["eager"], depth=20)
        assert [r["test"] for r in rows] == ["pp8 @ d20", "tg4 @ d20"]
        assert all(r["depth"] == 20 for r in rows)
        assert len(calls) == 3 and all(c == calls[0] for c in calls)   # warm-up + 2 reps
        cached, prompt, first = calls[0]
        assert len(cached) == 20 and len(prompt) == 8
        be.truncate(0)
        logits = be.forward_all(cached + prompt)[-1]
        top2 = logits.topk(2)
        best = int(top2.indices[0])
        near_tie = float(top2.values[0] - top2.values[1]) < 1e-3
        assert first == best or (near_tie and first == int(top2.indices[1]))
    finally:
        loaded.close()
    assert main(["bench", "--backend", "reference", "-m", str(tiny_model_path), "-d", "16",
                 "-p", "8", "-n", "4", "-r", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["depth"] == 16 and [r["test"] for r in out["rows"]] == ["pp8 @ d16", "tg4 @ d16"]
