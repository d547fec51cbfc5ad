"""GPU tests: skipped cleanly where CUDA is absent."""

from __future__ import annotations

import gc

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def give_back_gpu_memory():
    """After each module, its engines' blocks leave this process's caching allocator: a later module that
    starts a server as a subprocess (tests/gpu/test_serve_gpu.py) finds the GPU's memory free, since the
    server counts another process's memory as taken."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
