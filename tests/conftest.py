"""Shared test setup: tests marked ``gpu`` are skipped where CUDA is not available."""

from __future__ import annotations

import pytest


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
    (contexts that pile up without being destroyed broke cuBLAS on the H200, BACKGROUND.md)."""
    from bullet.gpu.partitions import PartitionMenu

    menu = PartitionMenu.create(0)
    yield menu
    menu.close()
