"""Shared pytest setup: deterministic torch, few threads (CI has 2 cores), GPU marker."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# Triton kernels run on CPU only under the interpreter, and TRITON_INTERPRET must be set before
# any @triton.jit decoration runs: set it here, before any test package imports `kernels`.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="session")
def _torch_threads() -> None:
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(2)
