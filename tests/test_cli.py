"""`nanoqwen generate` end to end on a tiny `.nanoqwen` file (random weights, tiny tokenizer).

The happy paths run the real console entry point in a subprocess (stdout/stdin as a user
sees them); the error paths call cli.main in-process, which is the same code minus the
interpreter start-up.
"""

from __future__ import annotations

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
