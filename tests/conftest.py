"""Shared test set-up: a private build cache, the repository root, and the GPU marker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "src" / "kbv" / "suite" / "problems"
FOUNDATION = ROOT / "tests" / "fixtures" / "candidates" / "foundation"
RELU = SUITE / "level1" / "1_ReLU.py"


def pytest_configure(config: pytest.Config) -> None:
    # One build cache per test session so CI compiles each source once.
    if "KBV_CACHE_DIR" not in os.environ:
        import tempfile

        os.environ["KBV_CACHE_DIR"] = tempfile.mkdtemp(prefix="kbv-test-cache-")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
