"""Shared pytest fixtures. The building blocks live in tests/helpers.py (importable as
`helpers` from any test folder, tests/gpu included, because this file puts tests/ on
sys.path)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import helpers  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The tiny byte-level BPE tokenizer with the ChatML template (helpers.tiny_tokenizer)."""
    return helpers.tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A `.nanoqwen` file of helpers.TINY_UNTIED with random weights and the tiny tokenizer,
    written once per test run."""
    return helpers.write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.nanoqwen")
