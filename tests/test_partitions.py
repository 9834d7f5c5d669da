"""The nested green-context partition menu: the sizes rule and the legality rule (CPU, both executors); on a GPU,
the menu's SM counts read back, the memory it costs, that a partition really limits a kernel's SMs, and (from
%smid read inside kernels) that every legal prefill/decode pair uses disjoint SMs."""

from __future__ import annotations

import itertools
import warnings

import pytest

from bullet.batch import Batch, Chunk, Partition
from bullet.config import GPUS, MODELS, ConfigError, PartitionError, check_corun, nested_sizes

H200 = GPUS["h200"]


def test_nested_sizes_h200_by_hand():
    pre, dec = nested_sizes(132, 8, 12)  # 15 groups of 8 plus 12 (measured split, docs/background.md)
    assert pre == (20, 28, 36, 44, 52, 60, 68, 76, 84, 92, 100, 108, 116, 124, 132)
    assert dec == (8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 132)
    assert (H200.prefill_sizes, H200.decode_sizes) == (pre, dec)
    assert nested_sizes(108, 2, 0)[0][:3] == (2, 4, 6)
    with pytest.raises(ConfigError, match="do not split"):
        nested_sizes(130, 8, 4)


@pytest.mark.parametrize("p, d, ok", [(124, 8, True), (20, 112, True), (92, 40, True), (100, 40, False),
                                      (132, 132, True), (132, 8, False), (20, 132, False), (68, 64, True)])
def test_corun_rule(p, d, ok):
    if ok:
        check_corun(p, d, 132)
    else:
        with pytest.raises(PartitionError, match="overlap"):
            check_corun(p, d, 132)


def _batch(lane, sms):
    return Batch(Partition(lane, sms), range(32), (Chunk(0, 0, 4, [0], True),))


def test_simulator_enforces_the_menu():
    from simulator import SimExecutor
    from tests.latency import LinearLatency

    ex = SimExecutor(LinearLatency(32), 32, H200)
    with pytest.raises(PartitionError, match="no prefill partition of 96 SMs"):
        ex.launch(_batch("prefill", 96))
    ex.launch(_batch("prefill", 100))
    with pytest.raises(PartitionError, match="overlap"):
        ex.launch(_batch("decode", 40))
    ex.launch(_batch("decode", 32))  # 100 + 32 = 132: disjoint
    assert ex.busy("prefill") and ex.busy("decode")
    ex2 = SimExecutor(LinearLatency(32), 32, H200)
    ex2.launch(_batch("all", 132))
    with pytest.raises(PartitionError, match="lane 'all'"):
        ex2.launch(_batch("decode", 8))



def test_gpu_executor_enforces_the_menu_on_cpu():
    torch = pytest.importorskip("torch")
    from bullet.gpu.executor import GpuExecutor
    from bullet.gpu.partitions import PartitionMenu

    menu = PartitionMenu.fallback()  # the H200's sizes, no streams
    ex = GpuExecutor(MODELS["tiny-llama"], "dummy", "cpu", num_blocks=16, menu=menu, dtype=torch.float32)
    with pytest.raises(PartitionError, match="no decode partition of 36 SMs"):
        ex.launch(Batch(Partition("decode", 36), range(2), (Chunk(1, 0, 1, [0], True, (5,)),)))
    ex.launch(Batch(Partition("prefill", 124), range(2), (Chunk(1, 0, 4, [0], True, (1, 2, 3, 4)),)))
    with pytest.raises(PartitionError, match="overlap"):
        ex.launch(Batch(Partition("decode", 16), range(2), (Chunk(2, 0, 1, [1], True, (5,)),)))
    ex.close()


def test_fallback_without_green_contexts(monkeypatch):
    torch = pytest.importorskip("torch")
    from bullet.gpu.partitions import PartitionMenu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        menu = PartitionMenu.create()
    assert len([w for w in caught if "green contexts unavailable" in str(w.message)]) == 1
    assert not menu.green and menu.memory_bytes == 0
    assert tuple(menu.prefill) == H200.prefill_sizes and tuple(menu.decode) == H200.decode_sizes
    assert menu.side("all", 132) is menu.full
    assert menu.side("prefill", 20) is menu.naive[0] and menu.side("decode", 112) is menu.naive[1]
    with pytest.raises(PartitionError, match="no prefill partition of 96"):
        menu.side("prefill", 96)
    menu.close()
    menu.close()  # idempotent


# ------------------------------------------------------------------------------------------------ on a GPU

@pytest.fixture
def menu(gpu_menu):
    if not gpu_menu.green:
        pytest.skip("green contexts unavailable on this driver")
    return gpu_menu


@pytest.mark.gpu
def test_menu_sizes_read_back(menu):
    import torch

    props = torch.cuda.get_device_properties(0)
    assert menu.num_sms == props.multi_processor_count
    pre, dec = nested_sizes(menu.num_sms, menu.granule, menu.remainder)
    assert tuple(menu.prefill) == pre and tuple(menu.decode) == dec
    for lane, sides in (("prefill", menu.prefill), ("decode", menu.decode)):
        for sms, side in sides.items():
            assert side.num_sms == sms and menu.side(lane, sms) is side
    streams = {s.stream.cuda_stream for s in [*menu.prefill.values(), *menu.decode.values()]}
    assert len(streams) == len(menu.prefill) + len(menu.decode) - 2 + 2  # naive streams appear once each
    print(f"menu: {len(menu.prefill)} prefill + {len(menu.decode)} decode sizes, remainder {menu.remainder}, "
          f"{menu.memory_bytes / 2**20:.0f} MiB")
    assert 0 <= menu.memory_bytes < 2 << 30


def _smids(stream, blocks: int = 2048):
    """The SM each of ``blocks`` thread blocks ran on (``%smid``)."""
    from bullet.gpu.partitions import sm_ids

    return sm_ids(stream, blocks)


@pytest.mark.gpu
def test_every_legal_pair_is_disjoint_by_smid(menu):
    """Each partition's kernels run on exactly its SM count; prefill partitions nest, decode partitions nest,
    and for every legal pair (p + d <= N) the SMs are disjoint, also while both lanes run at once."""
    used = {("prefill", n): _smids(s.stream) for n, s in menu.prefill.items() if n < menu.num_sms}
    used |= {("decode", n): _smids(s.stream) for n, s in menu.decode.items() if n < menu.num_sms}
    for (_, n), sms in used.items():
        assert len(sms) == n and -1 not in sms
    pre = sorted(n for lane, n in used if lane == "prefill")
    dec = sorted(n for lane, n in used if lane == "decode")
    for a, b in itertools.pairwise(pre):
        assert used["prefill", a] < used["prefill", b]
    for a, b in itertools.pairwise(dec):
        assert used["decode", a] < used["decode", b]
    pairs = [(p, d) for p in pre for d in dec if p + d <= menu.num_sms]
    for p, d in pairs:
        assert not used["prefill", p] & used["decode", d], (p, d)
    assert len(pairs) == len(pre) * (len(pre) + 1) // 2
    # one pair at once: the sets seen while co-running are the same
    p, d = pre[len(pre) // 2], menu.num_sms - pre[len(pre) // 2]
    import threading

    got = {}
    t = threading.Thread(target=lambda: got.setdefault("d", _smids(menu.decode[d].stream, 8192)))
    t.start()
    got["p"] = _smids(menu.prefill[p].stream, 8192)
    t.join()
    assert got["p"] == used["prefill", p] and got["d"] == used["decode", d]
    print(f"{len(pairs)} legal pairs checked disjoint")


@pytest.mark.gpu
def test_a_permuted_group_order_nests_and_keeps_every_legal_pair_disjoint(menu):
    """``PartitionMenu.create(order=...)`` (bench/gpc_layout.py) with the driver's groups reversed: prefill then
    takes the groups decode took, so a prefill partition of r + 8k SMs is the remainder plus the driver menu's decode
    partition of 8k, and a decode partition of 8j the driver's prefill partition of r + 8j less the remainder; every
    legal pair stays disjoint; a non-permutation is refused."""
    from bullet.gpu.partitions import GreenContextError, PartitionMenu

    r, n = menu.remainder, (menu.num_sms - menu.remainder) // menu.granule
    pre = {k: _smids(s.stream) for k, s in menu.prefill.items() if k < menu.num_sms}
    dec = {k: _smids(s.stream) for k, s in menu.decode.items() if k < menu.num_sms}
    other = PartitionMenu.create(order=tuple(range(n - 1, -1, -1)))
    try:
        got_pre = {k: _smids(s.stream) for k, s in other.prefill.items() if k < other.num_sms}
        got_dec = {k: _smids(s.stream) for k, s in other.decode.items() if k < other.num_sms}
    finally:
        other.close()
    rest = pre[min(pre)] - got_dec[menu.granule]  # the remainder: in every prefill partition of both menus
    assert len(rest) == r and got_dec[menu.granule] < pre[min(pre)]
    for k, sms in got_pre.items():
        assert sms == rest | dec[k - r], k
    for j, sms in got_dec.items():
        assert sms == pre[j + r] - rest, j
    for p, sp in got_pre.items():
        for d, sd in got_dec.items():
            if p + d <= menu.num_sms:
                assert not sp & sd, (p, d)
    with pytest.raises(GreenContextError, match="not a permutation"):
        PartitionMenu.create(order=(0, 0, *range(2, n)))


@pytest.mark.gpu
def test_cublas_on_partitions_matches_the_whole_gpu(menu):
    """cuBLAS on the smallest prefill partition and the largest decode partition computes what it computes on
    the whole GPU. (That a partition confines kernels to its SMs is shown by %smid above; how much slower a
    GEMM runs there is a benchmark's business: bench/gpu_concurrency.py, bench/decode_partition.py.)"""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = (a.double() @ b.double())
    for side in (menu.prefill[min(menu.prefill)], menu.decode[max(n for n in menu.decode if n < menu.num_sms)],
                 menu.full):
        with torch.cuda.stream(side.stream):
            out = torch.mm(a, b)
        side.stream.synchronize()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (side.key, err)
