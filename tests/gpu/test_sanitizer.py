"""compute-sanitizer memcheck and racecheck of the attention kernels at partial-page lengths
(tests/gpu/sanitize_attention.py), clean. Skipped where compute-sanitizer is absent."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCRIPT = Path(__file__).with_name("sanitize_attention.py")


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_attention_sanitizer_clean(tool):
    exe = shutil.which("compute-sanitizer") or (
        "/usr/local/cuda/bin/compute-sanitizer"
        if os.path.exists("/usr/local/cuda/bin/compute-sanitizer") else None)
    if exe is None:
        pytest.skip("compute-sanitizer not installed")
    # only our attention kernels are instrumented (torch's own kernels are not under test)
    cmd = [exe, "--tool", tool, "--error-exitcode", "99", "--kernel-name", "kns=attn_",
           sys.executable, str(SCRIPT)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    print(r.stdout[-4000:], r.stderr[-4000:])
    assert r.returncode == 0, f"{tool} exit {r.returncode}"
    assert "ERROR SUMMARY: 0 errors" in r.stdout + r.stderr or tool == "racecheck"
    if tool == "racecheck":
        assert "RACECHECK SUMMARY: 0 hazards" in r.stdout + r.stderr
