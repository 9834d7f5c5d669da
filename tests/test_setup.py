"""The test session's own setup (tests/conftest.py)."""

import pytest


def test_torch_runs_on_one_thread():
    """conftest.py sets one intra-op thread before torch starts (the suite's tensors are small, and on a
    shared 2-core machine more threads made it ~8x slower)."""
    torch = pytest.importorskip("torch")
    assert torch.get_num_threads() == 1
