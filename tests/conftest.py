"""Shared test setup: torch on one CPU thread; tests marked ``gpu`` are skipped where CUDA is not available."""

from __future__ import annotations

import os
import sys

import pytest

# One intra-op thread for torch's CPU kernels (read when torch starts, so set before any test imports it; kept
# if the caller set it). The tests' tensors are small: on a shared 2-core machine torch's default of one
# thread per core made the suite about 8x slower (19 s -> 160 s), threads contending with other processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    torch = sys.modules.get("torch")  # already imported (a plugin): the variable came too late for it
    if torch is not None:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_menu():
    """One green-context partition menu for the whole GPU test session: menus are made once and reused
    (contexts that pile up without being destroyed broke cuBLAS on the H200, docs/background.md)."""
    from bullet.gpu.partitions import PartitionMenu

    menu = PartitionMenu.create(0)
    yield menu
    menu.close()
