"""The measurement switches (engine/switches.py): every accepted and rejected form of
NANOQWEN_PDL, NANOQWEN_ATTN_TMA, NANOQWEN_NORM_FOLD, NANOQWEN_SPEC_DEVICE, NANOQWEN_ATTN_MIN_PPS,
NANOQWEN_INT4_MAX_M and NANOQWEN_PREFILL_ATTN_MAX, the removed
NANOQWEN_FUSE_NORM refused when set, the C++ side's constants, and a bad value reaching the user
as a message (CUDA backend init, loader, CLI, app) instead of a traceback or a silent fallback.
CPU only: where a path needs CUDA, torch.cuda.is_available is patched to True and the check
fires before anything touches the device."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import torch

from nanoqwen import REPO_ROOT
from nanoqwen.engine import loader
from nanoqwen.engine.cli import main
from nanoqwen.engine.errors import BackendUnavailable, NanoqwenError
from nanoqwen.engine.switches import (ATTN_MIN_PPS, ATTN_MIN_PPS_DEFAULT, ATTN_MIN_PPS_MAX,
                                      ATTN_TMA, ATTN_TMA_DEFAULT, INT4_MAX_M, INT4_MAX_M_DEFAULT,
                                      INT4_MAX_M_MAX, NORM_FOLD, NORM_FOLD_DEFAULT, PDL,
                                      PREFILL_ATTN_MAX,
                                      PREFILL_ATTN_MAX_DEFAULT, PREFILL_ATTN_MAX_MAX, REMOVED,
                                      SPEC_DEVICE, SPEC_DEVICE_DEFAULT, SwitchError, Switches,
                                      read_switches)

FLAGS = [(PDL, "pdl", True), (ATTN_TMA, "attn_tma", ATTN_TMA_DEFAULT),
         (NORM_FOLD, "norm_fold", NORM_FOLD_DEFAULT),
         (SPEC_DEVICE, "spec_device", SPEC_DEVICE_DEFAULT)]  # (variable, field, default)
FUSE_NORM = "NANOQWEN_FUSE_NORM"  # removed: refused when set
ALL = (PDL, ATTN_TMA, NORM_FOLD, SPEC_DEVICE, ATTN_MIN_PPS, INT4_MAX_M, PREFILL_ATTN_MAX, *REMOVED)


@pytest.fixture
def env(monkeypatch):
    """os.environ without any switch; returns a setter."""
    for name in ALL:
        monkeypatch.delenv(name, raising=False)
    return lambda name, value: monkeypatch.setenv(name, value)


def test_defaults_when_unset_or_empty(env):
    assert read_switches() == Switches(pdl=True, attn_min_pps=8)
    for name in ALL:
        env(name, "")
    assert read_switches() == Switches()
    assert read_switches({}) == Switches()  # an explicit mapping instead of os.environ


@pytest.mark.parametrize("name,field,default", FLAGS)
@pytest.mark.parametrize("value,expected", [("0", False), ("1", True)])
def test_flags_accept_0_and_1(env, name, field, default, value, expected):
    env(name, value)
    assert getattr(read_switches(), field) is expected


@pytest.mark.parametrize("name,field,default", FLAGS)
@pytest.mark.parametrize("value", ["2", "-1", "00", "01", "10", " 1", "1 ", "0\n", "true",
                                   "false", "on", "off", "yes", "no", "x", "١"])
def test_flags_reject_anything_else(env, name, field, default, value):
    env(name, value)
    with pytest.raises(SwitchError) as ei:
        read_switches()
    msg = str(ei.value)
    assert name in msg and repr(value) in msg
    assert "use 0 or 1" in msg and f"default {int(default)}" in msg


# the whole-number switches: (variable, field, lowest, highest, default, accepted values with what
# they read as, rejected values)
COUNTS = [
    (ATTN_MIN_PPS, "attn_min_pps", 1, ATTN_MIN_PPS_MAX, ATTN_MIN_PPS_DEFAULT,
     [("1", 1), ("2", 2), ("3", 3), ("64", 64), ("007", 7), ("8192", 8192), ("08192", 8192)],
     ["0", "00", "8193", "9999", "10000", "99999999999", "-1", "+3", " 3", "3 ", "3\n", "3.0",
      "3.5", "1e3", "0x10", "1_0", "abc", "٣", "３", "9" * 5000]),
    (INT4_MAX_M, "int4_max_m", 0, INT4_MAX_M_MAX, INT4_MAX_M_DEFAULT,
     [("0", 0), ("00", 0), ("1", 1), ("64", 64), ("0128", 128), ("2048", 2048)],
     ["2049", "4096", "-1", "+3", " 3", "3 ", "3.0", "1e3", "0x10", "1_0", "abc", "٣",
      "9" * 5000, "0" * 5000 + "2049"]),
    (PREFILL_ATTN_MAX, "prefill_attn_max", 0, PREFILL_ATTN_MAX_MAX, PREFILL_ATTN_MAX_DEFAULT,
     [("0", 0), ("1", 1), ("2048", 2048), ("08192", 8192), ("131072", 131072)],
     ["131073", "-1", "+3", " 3", "3 ", "3.0", "1e3", "0x10", "1_0", "abc", "٣", "9" * 5000]),
]


@pytest.mark.parametrize("name,field,value,expected",
                         [(c[0], c[1], v, e) for c in COUNTS for v, e in c[5]])
def test_counts_accept_their_range(env, name, field, value, expected):
    env(name, value)
    assert getattr(read_switches(), field) == expected


@pytest.mark.parametrize("name,lo,hi,default,value",
                         [(c[0], c[2], c[3], c[4], v) for c in COUNTS for v in c[6]])
def test_counts_reject_anything_else(env, name, lo, hi, default, value):
    env(name, value)
    with pytest.raises(SwitchError) as ei:
        read_switches()
    msg = str(ei.value)
    assert name in msg and repr(value) in msg
    assert f"from {lo} to {hi}" in msg and f"default {default}" in msg


def test_int4_max_m_bound_is_the_prefill_chunk():
    """No prompt chunk is longer than PREFILL_CHUNK, so a larger bound would mean nothing."""
    from nanoqwen.engine.backends.cuda import PREFILL_CHUNK

    assert INT4_MAX_M_MAX == PREFILL_CHUNK


def test_every_switch_is_checked_with_the_others_valid(env):
    env(PDL, "0")
    env(ATTN_MIN_PPS, "5")
    env(ATTN_TMA, str(int(not ATTN_TMA_DEFAULT)))
    assert read_switches() == Switches(pdl=False, attn_min_pps=5, attn_tma=not ATTN_TMA_DEFAULT)
    env(ATTN_MIN_PPS, "0")
    with pytest.raises(SwitchError, match=ATTN_MIN_PPS):
        read_switches()


@pytest.mark.parametrize("value", ["0", "1", "yes"])
def test_removed_fuse_norm_is_refused_when_set(env, value):
    """NANOQWEN_FUSE_NORM selected the fused-norm GEMVs, which left the engine (benchmarks/lab/):
    an old script that still sets it must not silently measure the default."""
    assert FUSE_NORM in REMOVED
    env(FUSE_NORM, "")
    assert read_switches() == Switches()  # empty is unset
    env(FUSE_NORM, value)
    with pytest.raises(SwitchError) as ei:
        read_switches()
    msg = str(ei.value)
    assert f"{FUSE_NORM}={value!r}" in msg and "removed" in msg and "benchmarks/lab" in msg
    assert "unset it" in msg


def test_switch_error_is_a_user_error_and_a_value_error():
    # NanoqwenError: the CLI and the app print it; ValueError: a bad value, as callers expect
    assert issubclass(SwitchError, NanoqwenError) and issubclass(SwitchError, ValueError)


def test_cpp_side_uses_the_same_default_and_bounds():
    """attention_decode takes min_pps as an argument (csrc/kernels.h: default and bound equal to
    the ones validated here) and the only getenv in csrc/ is common.cuh's NANOQWEN_PDL, so
    engine/switches.py is NANOQWEN_ATTN_MIN_PPS's one reader; "0" is PDL's only off value."""
    hdr = (REPO_ROOT / "csrc" / "kernels.h").read_text()
    assert re.search(r"kDecMinPpsDefault = (\d+);", hdr).group(1) == str(ATTN_MIN_PPS_DEFAULT)
    assert re.search(r"kDecMinPpsMax = (\d+);", hdr).group(1) == str(ATTN_MIN_PPS_MAX)
    # the backend hands NANOQWEN_ATTN_TMA to the engine as int(attn_tma): 1 must be the TMA kernel
    assert re.search(r"kAttnCpAsync = (\d+);", hdr).group(1) == "0"
    assert re.search(r"kAttnTma = (\d+);", hdr).group(1) == "1"
    for f in sorted((REPO_ROOT / "csrc").iterdir()):
        if f.suffix in (".cu", ".cuh", ".h", ".cpp"):
            text = f.read_text()
            assert text.count("getenv") == text.count('getenv("NANOQWEN_PDL")'), f.name
    common = (REPO_ROOT / "csrc" / "common.cuh").read_text()
    assert "e[0] == '0' && e[1] == '\\0'" in common


# --- where a bad value surfaces ---------------------------------------------------------------

@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend a device exists so the loader tries the CUDA backend (whose init must stop at the
    switches, before touching it) and make the kernel build observable."""
    from nanoqwen.engine.backends import cuda

    calls = []

    def load_extension():
        calls.append(1)
        raise BackendUnavailable("stub: no kernels in this test")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "load_extension", load_extension)
    return calls


def test_cuda_backend_checks_switches_before_loading_kernels(env, fake_cuda, tiny_model_path):
    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.format import open_model

    with open_model(tiny_model_path) as mf:
        env(PDL, "2")
        with pytest.raises(SwitchError, match="NANOQWEN_PDL='2'"):
            CudaBackend.from_model_file(mf)
        assert fake_cuda == []                      # the kernels were not built or loaded
        env(PDL, "0")
        with pytest.raises(BackendUnavailable, match="stub"):
            CudaBackend.from_model_file(mf)
        assert fake_cuda == [1]                     # valid switches: on to the build


@pytest.mark.parametrize("backend", ["auto", "cuda"])
def test_loader_does_not_fall_back_on_a_bad_switch(env, fake_cuda, tiny_model_path, backend):
    """A bad switch is the user's error, not "CUDA is unavailable": "auto" must not hide it
    behind the reference backend (which would measure nothing the switch asked for)."""
    env(PDL, "yes")
    with pytest.raises(SwitchError, match="NANOQWEN_PDL='yes'"):
        loader.load(tiny_model_path, backend=backend)
    assert fake_cuda == []


def test_reference_backend_ignores_the_switches(env, tiny_model_path):
    env(PDL, "2")  # CUDA-only switches: an explicit reference run neither reads nor needs them
    eng = loader.load(tiny_model_path, backend="reference")
    eng.close()
    assert eng.backend.name == "reference"


def test_cli_prints_the_error_without_a_traceback(env, fake_cuda, tiny_model_path, capsys):
    env(ATTN_MIN_PPS, "0")
    assert main(["generate", "-m", str(tiny_model_path), "-p", "hi", "-n", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("nanoqwen generate: error: NANOQWEN_ATTN_MIN_PPS='0' is not allowed")
    assert "Traceback" not in err and err.count("\n") == 1


def test_app_shows_the_error_on_the_model_screen(env, fake_cuda, tiny_model_path, tmp_path,
                                                monkeypatch):
    from nanoqwen.app.main import NanoqwenApp
    from nanoqwen.app.screens import ModelScreen

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    env(PDL, "off")

    async def run() -> str:
        app = NanoqwenApp(model=tiny_model_path)
        async with app.run_test(size=(110, 32)) as pilot:
            t0 = time.monotonic()
            while not isinstance(app.screen, ModelScreen):
                assert time.monotonic() - t0 < 30, "timed out waiting for the error screen"
                await pilot.pause(0.02)
            assert app.engine is None
            return str(app.screen.query_one("#path-message").render())

    msg = asyncio.run(run())
    assert "Could not use the model" in msg and "NANOQWEN_PDL='off' is not allowed" in msg
    assert "SwitchError" not in msg  # a user error, shown as its message alone
