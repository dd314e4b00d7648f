"""GPU tests: skipped cleanly without a CUDA device; the extension is built (or reused from
the per-user cache) once per session, before the first test that needs it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def nanoqwen_extension():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from nanoqwen.engine.build import load_extension

    return load_extension()


@pytest.fixture
def gen():
    """A fresh seeded CUDA generator per test (fresh random data, reproducible on failure)."""
    seed = torch.randint(0, 2**31 - 1, (1,)).item()
    print(f"seed={seed}")
    return torch.Generator(device="cuda").manual_seed(seed)
