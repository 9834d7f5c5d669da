"""Green-context partitions: the nested menu, made once at start-up.

The device's SM resource is split ONCE into ``G`` groups of ``granule`` SMs and a remainder
(``cuDevSmResourceSplitByCount``; 15 x 8 + 12 on an H200). A prefill partition is the remainder plus the first
``k`` groups, a decode partition the last ``j`` groups (``cuDevResourceGenerateDesc`` accepts several
resources at once), each a green context (``cuGreenCtxCreate``) with one non-blocking stream
(``cuGreenCtxStreamCreate``) wrapped as ``torch.cuda.ExternalStream``. So a prefill partition of ``p`` SMs and
a decode partition of ``d`` SMs are disjoint whenever ``p + d <= num_sms``, whatever either lane ran before:
each lane may change its size at each of its own launches (:func:`bullet.config.nested_sizes`,
:func:`bullet.config.check_corun`). The whole GPU is an ordinary stream (lane "all"), and two more ordinary
whole-GPU streams serve naive concurrency (both lanes asking for every SM).

Kernels launched from the primary context onto such a stream run on that partition (docs/background.md), and a
CUDA graph captured on it keeps that partition when replayed anywhere. Partitions are never made per step:
contexts cost device memory (about 170 MiB for the whole nested menu on an H200) and the driver has been seen
to fail after ~30 contexts were created and leaked.

Where cuda.bindings or green contexts are missing (CPU, old drivers) the menu falls back, with one warning,
to ordinary whole-GPU streams (``green == False``) under the same sizes; with no CUDA at all, every stream
is ``None``.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..config import PartitionError, check_corun, nested_sizes


class GreenContextError(RuntimeError):
    """A CUDA driver call of the green-context set-up failed; the message names the call."""


@dataclass(frozen=True, slots=True)
class Side:
    """One partition: its stream (None without CUDA), the SMs it really has, and the green context."""

    stream: Any  # torch.cuda.Stream / ExternalStream, or None on a machine without CUDA
    num_sms: int
    key: str  # unique name of the partition ("p68", "d40", "all", "naive-a"): graphs are keyed by it
    ctx: Any = None  # CUgreenCtx, or None for ordinary streams


@dataclass(slots=True)
class PartitionMenu:
    device: int
    num_sms: int
    granule: int
    remainder: int  # SMs outside the granule groups (given to every prefill partition)
    green: bool
    prefill: dict[int, Side]  # by SM count, ascending, the whole GPU (a naive stream) last
    decode: dict[int, Side]
    full: Side  # lane "all": a whole-GPU stream
    naive: tuple[Side, Side]  # both split lanes on the whole GPU: two ordinary whole-GPU streams
    memory_bytes: int = 0  # device memory the menu cost (mem_get_info before - after)
    _streams: list = field(default_factory=list)  # raw CUstreams to destroy
    _ctxs: list = field(default_factory=list)  # green contexts to destroy
    _closed: bool = False

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, device: int = 0, granule: int = 8, order: tuple[int, ...] | None = None) -> PartitionMenu:
        """The nested menu for ``device``: green contexts where the driver supports them, else a fallback.
        ``order``: the split's groups in the order prefill takes them (decode from the other end); default the
        driver's. Any order keeps every legal pair disjoint; on an H200 the driver's puts the two 8-SM halves of
        each GPC 7 groups apart, so most splits share GPCs between the lanes (bench/sm_topology.py)."""
        try:
            import torch
        except ImportError:  # the core imports without torch; a menu without torch has no streams
            torch = None
        if torch is None or not torch.cuda.is_available():
            return cls.fallback(device, granule, num_sms=0, reason="CUDA is not available")
        torch.cuda.init()
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        try:
            from cuda.bindings import driver
        except ImportError as e:
            return cls.fallback(device, granule, num_sms, reason=f"cuda.bindings missing ({e})")
        if not hasattr(driver, "cuGreenCtxCreate"):
            return cls.fallback(device, granule, num_sms, reason="cuda.bindings has no green contexts")
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info(device)[0]
            try:
                menu = cls._create_green(driver, torch, device, granule, order)
            except _Unsupported as e:
                return cls.fallback(device, granule, num_sms, reason=str(e))
            torch.cuda.synchronize()
            menu.memory_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        return menu

    @classmethod
    def _create_green(cls, driver, torch, device: int, granule: int, order: tuple[int, ...] | None = None
                      ) -> PartitionMenu:
        check = _checker(driver)
        (err,) = driver.cuInit(0)[:1]
        check(err, "cuInit")
        err, dev = driver.cuDeviceGet(device)
        check(err, "cuDeviceGet")
        err, whole = driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
        if err in (driver.CUresult.CUDA_ERROR_NOT_SUPPORTED, driver.CUresult.CUDA_ERROR_INVALID_VALUE):
            raise _Unsupported(f"cuDeviceGetDevResource: {_name(driver, err)}")
        check(err, "cuDeviceGetDevResource")
        num_sms = int(whole.sm.smCount)
        err, groups, n, rest = driver.cuDevSmResourceSplitByCount(num_sms // granule, whole, 0, granule)
        check(err, f"cuDevSmResourceSplitByCount({num_sms // granule} x {granule})")
        groups = list(groups)[:n]
        remainder = int(rest.sm.smCount)
        if n < 2 or any(int(g.sm.smCount) != granule for g in groups) or remainder + n * granule != num_sms:
            raise GreenContextError(f"cuDevSmResourceSplitByCount gave {n} groups of "
                                    f"{[int(g.sm.smCount) for g in groups]} SMs and {remainder} left over "
                                    f"on a {num_sms}-SM device")
        if order is not None:
            if sorted(order) != list(range(n)):
                raise GreenContextError(f"group order {order} is not a permutation of the {n} groups")
            groups = [groups[i] for i in order]
        full = Side(torch.cuda.Stream(device), num_sms, "all")
        naive = (Side(torch.cuda.Stream(device), num_sms, "naive-a"),
                 Side(torch.cuda.Stream(device), num_sms, "naive-b"))
        menu = cls(device, num_sms, granule, remainder, True, {}, {}, full, naive)
        lead = [rest] if remainder else []
        try:
            for k in range(1, n):  # prefill: the remainder and the first k groups
                side = menu._make_side(driver, torch, dev, lead + groups[:k], "p", check)
                menu.prefill[side.num_sms] = side
            for j in range(1, n):  # decode: the last j groups
                side = menu._make_side(driver, torch, dev, groups[n - j:], "d", check)
                menu.decode[side.num_sms] = side
        except BaseException:
            menu.close()
            raise
        menu.prefill[num_sms], menu.decode[num_sms] = naive
        menu._check_sizes()
        return menu

    def _make_side(self, driver, torch, dev, resources: list, lane: str, check) -> Side:
        want = sum(int(r.sm.smCount) for r in resources)
        err, desc = driver.cuDevResourceGenerateDesc(resources, len(resources))
        check(err, f"cuDevResourceGenerateDesc({lane}{want})")
        err, ctx = driver.cuGreenCtxCreate(desc, dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
        check(err, f"cuGreenCtxCreate({lane}{want})")
        self._ctxs.append(ctx)
        err, raw = driver.cuGreenCtxStreamCreate(ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0)
        check(err, f"cuGreenCtxStreamCreate({lane}{want})")
        self._streams.append(raw)
        err, got = driver.cuGreenCtxGetDevResource(ctx, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
        check(err, f"cuGreenCtxGetDevResource({lane}{want})")
        if int(got.sm.smCount) != want:
            raise GreenContextError(f"green context {lane}{want} got {int(got.sm.smCount)} SMs")
        return Side(torch.cuda.ExternalStream(int(raw), device=self.device), want, f"{lane}{want}", ctx)

    def _check_sizes(self) -> None:
        pre, dec = nested_sizes(self.num_sms, self.granule, self.remainder)
        if tuple(self.prefill) != pre or tuple(self.decode) != dec:
            raise GreenContextError(f"partition menu sizes {tuple(self.prefill)} / {tuple(self.decode)} differ "
                                    f"from the nested rule's {pre} / {dec}")

    @classmethod
    def fallback(cls, device: int = 0, granule: int = 8, num_sms: int = 0, reason: str = "",
                 nominal: tuple[int, int] = (132, 12)) -> PartitionMenu:
        """Ordinary whole-GPU streams under the nested menu's sizes (``nominal`` SMs and remainder where the
        device has none to report): correct, not isolated. Warns with ``reason`` when one is given."""
        if reason:
            warnings.warn(f"green contexts unavailable ({reason}): every lane runs on whole-GPU streams",
                          RuntimeWarning, stacklevel=3)
        streams = [None, None, None]
        if num_sms:
            import torch

            streams = [torch.cuda.Stream(device) for _ in range(3)]
        total = num_sms or nominal[0]
        remainder = nominal[1] if total == nominal[0] else total % granule
        if (total - remainder) // granule < 2:  # a tiny device: one group each way
            granule, remainder = total // 2, total - 2 * (total // 2)
        full = Side(streams[0], total, "all")
        naive = (Side(streams[1], total, "naive-a"), Side(streams[2], total, "naive-b"))
        pre, dec = nested_sizes(total, granule, remainder)
        return cls(device, total, granule, remainder, False, dict.fromkeys(pre, naive[0]),
                   dict.fromkeys(dec, naive[1]), full, naive)

    # ------------------------------------------------------------------ lookup
    def side(self, lane: str, num_sms: int) -> Side:
        """The partition a Batch on ``lane`` asking for ``num_sms`` SMs runs on: exactly that size, or a
        :class:`~bullet.config.PartitionError` naming the sizes there are."""
        if lane == "all":
            if num_sms != self.num_sms:
                raise PartitionError(f"lane 'all' runs on the whole GPU ({self.num_sms} SMs), not {num_sms}")
            return self.full
        sides = self.prefill if lane == "prefill" else self.decode if lane == "decode" else None
        if sides is None:
            raise ValueError(f"unknown lane {lane!r}")
        side = sides.get(num_sms)
        if side is None:
            raise PartitionError(f"no {lane} partition of {num_sms} SMs: the menu has {', '.join(map(str, sides))}")
        return side

    def check_corun(self, prefill_sms: int, decode_sms: int) -> None:
        """Raise :class:`~bullet.config.PartitionError` unless the two lanes' partitions are disjoint."""
        check_corun(prefill_sms, decode_sms, self.num_sms)

    def describe(self) -> dict[str, list[int]]:
        """The SM counts of each lane's partitions."""
        return {"prefill": list(self.prefill), "decode": list(self.decode)}

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Destroy the streams and green contexts (idempotent). Synchronizes the device first."""
        if self._closed:
            return
        self._closed = True
        if not self.green:
            return
        import torch
        from cuda.bindings import driver

        torch.cuda.synchronize(self.device)
        for raw in self._streams:
            driver.cuStreamDestroy(raw)
        self._streams.clear()
        for ctx in self._ctxs:
            (err,) = driver.cuGreenCtxDestroy(ctx)
            _checker(driver)(err, "cuGreenCtxDestroy")
        self._ctxs.clear()
        self.prefill.clear()
        self.decode.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Unsupported(Exception):
    pass


def _name(driver, err) -> str:
    res = driver.cuGetErrorName(err)
    return res[1].decode() if res[0] == driver.CUresult.CUDA_SUCCESS else str(err)


def _checker(driver):
    def check(err, call: str) -> None:
        if err != driver.CUresult.CUDA_SUCCESS:
            raise GreenContextError(f"{call} failed: {_name(driver, err)}")
    return check


@functools.cache
def _smid_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def smid_kernel(out_ptr, spin):
        pid = tl.program_id(0)
        acc = tl.zeros((1,), tl.float32)
        for i in range(spin):  # keep the block resident a little, so blocks spread over every SM
            acc += i
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + pid + tl.arange(0, 1), sm + (acc * 0).to(tl.int32))

    return smid_kernel


def sm_ids(stream, blocks: int = 2048) -> set[int]:
    """The SMs that ``blocks`` thread blocks launched on ``stream`` ran on, read from ``%smid`` in a Triton kernel
    (a diagnostic: the partition tests and bench/sm_topology.py)."""
    import torch

    out = torch.full((blocks,), -1, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(stream):
        _smid_kernel()[(blocks,)](out, 2000)
    stream.synchronize()
    return set(out.tolist())
