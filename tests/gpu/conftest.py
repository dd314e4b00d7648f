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


@pytest.fixture(scope="module")
def bundled():
    """The bundled (trained) model on the CUDA engine, for speculation's real acceptance
    (test_verify.py, test_spec_device.py); one load a module."""
    from test_spec import MODEL

    from nanoqwen.engine.loader import load

    if not MODEL.is_file():
        pytest.skip("the bundled model is absent")
    eng = load(MODEL, backend="cuda")
    yield eng
    eng.close()
