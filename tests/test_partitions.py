"""The green-context partition menu: the CPU fallback everywhere; on a GPU, disjoint pairs with SM counts
read back, the memory the menu costs, and that a partition really limits a kernel's SMs."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from bullet.gpu.partitions import PartitionMenu


def test_fallback_without_green_contexts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        menu = PartitionMenu.create()
    assert len([w for w in caught if "green contexts unavailable" in str(w.message)]) == 1
    assert not menu.green and menu.memory_bytes == 0
    assert menu.pairs
    _pre, _dec, sms = menu.streams(8)
    assert sms == menu.num_sms  # no partition: each stream sees the whole device
    # lane mapping works the same (streams are None without CUDA)
    assert menu.side("all", 132) is menu.full
    assert menu.side("prefill", 10_000) is menu.naive[0] and menu.side("decode", 10_000) is menu.naive[1]
    menu.close()
    menu.close()  # idempotent


@pytest.fixture
def menu(gpu_menu):
    return gpu_menu


@pytest.mark.gpu
def test_menu_pairs_are_disjoint_and_read_back(menu):
    props = torch.cuda.get_device_properties(0)
    if not menu.green:
        pytest.skip("green contexts unavailable on this driver")
    assert menu.num_sms == props.multi_processor_count
    sizes = menu.describe()
    assert len(sizes) >= 8
    for requested, p, d in sizes:
        assert p >= requested and p % menu.granule == 0
        assert p + d == menu.num_sms  # one split: group + remainder cover the device exactly once
        pair = menu.pair(p)
        assert pair.prefill.stream.cuda_stream != pair.decode.stream.cuda_stream
        assert menu.side("prefill", p) is pair.prefill and menu.side("decode", d) is pair.decode
    streams = {s.stream.cuda_stream for pair in menu.pairs.values() for s in (pair.prefill, pair.decode)}
    assert len(streams) == 2 * len(menu.pairs)
    print(f"menu: {len(sizes)} pairs, {menu.memory_bytes / 2**20:.0f} MiB")
    assert 0 <= menu.memory_bytes < 2 << 30


@pytest.mark.gpu
def test_partition_limits_sms(menu):
    """An 8192^3 GEMM on a 32-SM partition is several times slower than on the whole GPU, and the other
    half of the pair computes the same product."""
    if not menu.green:
        pytest.skip("green contexts unavailable on this driver")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def timed(stream, reps=5):
        with torch.cuda.stream(stream):
            torch.mm(a, b, out=c)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                torch.mm(a, b, out=c)
            e.record()
        e.synchronize()
        return s.elapsed_time(e) / reps

    full = timed(menu.full.stream)
    pair = menu.pair(32)
    small = timed(pair.prefill.stream)
    assert small > 2.0 * full, (small, full)
    ref = torch.mm(a, b)
    with torch.cuda.stream(pair.decode.stream):
        out = torch.mm(a, b)
    pair.decode.stream.synchronize()
    assert torch.equal(out, ref) or (out - ref).abs().max() < 1e-2 * ref.abs().max()
