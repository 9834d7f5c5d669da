"""Green-context partitions: a fixed menu of disjoint (prefill, decode) stream pairs, made once at start-up.

For each prefill size ``p`` (granule steps, 8 SMs on Hopper) the device's SM resource is split ONCE into a
group of ``p`` SMs and its remainder (``cuDevSmResourceSplitByCount``); each half becomes a green context
(``cuDevResourceGenerateDesc`` -> ``cuGreenCtxCreate``) with one non-blocking stream
(``cuGreenCtxStreamCreate``), wrapped as ``torch.cuda.ExternalStream``. Two halves of one split are disjoint;
halves of different splits may overlap, so the two lanes should use the same pair at a time.

Kernels launched from the primary context onto such a stream run on that partition (BACKGROUND.md), and a
CUDA graph captured on it keeps that partition when replayed anywhere. Partitions are never made per step:
contexts cost device memory (about 176 MiB for 16 pairs on an H200) and the driver has been seen to fail
after ~30 contexts were created and leaked.

Where cuda.bindings or green contexts are missing (CPU, old drivers) the menu falls back, with one warning,
to ordinary whole-GPU streams (``green == False``); with no CUDA at all, every stream is ``None``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from ..config import partition_sizes


class GreenContextError(RuntimeError):
    """A CUDA driver call of the green-context set-up failed; the message names the call."""


@dataclass(frozen=True, slots=True)
class Side:
    """One partition: its stream (None without CUDA), the SMs it really has, and the green context."""

    stream: Any  # torch.cuda.Stream / ExternalStream, or None on a machine without CUDA
    num_sms: int
    key: str  # unique name of the partition ("p64", "d68", "all", "naive-a"): graphs are keyed by it
    ctx: Any = None  # CUgreenCtx, or None for ordinary streams


@dataclass(frozen=True, slots=True)
class Pair:
    """Two disjoint partitions from one split: ``prefill`` has ``requested`` SMs (rounded by the driver)."""

    requested: int
    prefill: Side
    decode: Side


@dataclass(slots=True)
class PartitionMenu:
    device: int
    num_sms: int
    granule: int
    green: bool
    pairs: dict[int, Pair]  # by the prefill side's actual SM count
    full: Side  # lane "all": a whole-GPU stream
    naive: tuple[Side, Side]  # naive concurrency: two ordinary whole-GPU streams
    memory_bytes: int = 0  # device memory the menu cost (mem_get_info before - after)
    _streams: list = field(default_factory=list)  # raw CUstreams to destroy
    _closed: bool = False

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, device: int = 0, granule: int = 8, sizes: list[int] | None = None) -> PartitionMenu:
        """The menu for ``device``: one pair per prefill size (default: :func:`default_sizes`). Green
        contexts where the driver supports them, else a fallback."""
        try:
            import torch
        except ImportError:  # the core imports without torch; a menu without torch has no streams
            torch = None
        if torch is None or not torch.cuda.is_available():
            return cls._fallback(device, granule, sizes, num_sms=0, reason="CUDA is not available")
        torch.cuda.init()
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        try:
            from cuda.bindings import driver
        except ImportError as e:
            return cls._fallback(device, granule, sizes, num_sms, reason=f"cuda.bindings missing ({e})")
        if not hasattr(driver, "cuGreenCtxCreate"):
            return cls._fallback(device, granule, sizes, num_sms, reason="cuda.bindings has no green contexts")
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info(device)[0]
            try:
                menu = cls._create_green(driver, torch, device, granule, sizes, num_sms)
            except _Unsupported as e:
                return cls._fallback(device, granule, sizes, num_sms, reason=str(e))
            torch.cuda.synchronize()
            menu.memory_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        return menu

    @classmethod
    def _create_green(cls, driver, torch, device: int, granule: int, sizes, num_sms: int) -> PartitionMenu:
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
        sizes = sizes or default_sizes(num_sms, granule)
        menu = cls(device, num_sms, granule, True, {}, Side(torch.cuda.Stream(device), num_sms, "all"),
                   (Side(torch.cuda.Stream(device), num_sms, "naive-a"),
                    Side(torch.cuda.Stream(device), num_sms, "naive-b")))
        try:
            for p in sizes:
                pair = menu._make_pair(driver, torch, dev, whole, p, check)
                if pair.prefill.num_sms in menu.pairs:  # the driver rounded two sizes to one: keep the first
                    menu._destroy_pair(driver, pair)
                    continue
                menu.pairs[pair.prefill.num_sms] = pair
        except BaseException:
            menu.close()
            raise
        return menu

    def _make_pair(self, driver, torch, dev, whole, p: int, check) -> Pair:
        err, groups, n, rest = driver.cuDevSmResourceSplitByCount(1, whole, 0, p)
        check(err, f"cuDevSmResourceSplitByCount(minCount={p})")
        if n < 1:
            raise GreenContextError(f"cuDevSmResourceSplitByCount(minCount={p}) made no group")
        sides = []
        for lane, res in (("p", groups[0]), ("d", rest)):
            err, desc = driver.cuDevResourceGenerateDesc([res], 1)
            check(err, f"cuDevResourceGenerateDesc({lane}{p})")
            err, ctx = driver.cuGreenCtxCreate(desc, dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
            check(err, f"cuGreenCtxCreate({lane}{p})")
            err, raw = driver.cuGreenCtxStreamCreate(ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0)
            if err != driver.CUresult.CUDA_SUCCESS:
                driver.cuGreenCtxDestroy(ctx)
                check(err, f"cuGreenCtxStreamCreate({lane}{p})")
            self._streams.append(raw)
            err, got = driver.cuGreenCtxGetDevResource(ctx, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
            check(err, f"cuGreenCtxGetDevResource({lane}{p})")
            stream = torch.cuda.ExternalStream(int(raw), device=self.device)
            sides.append(Side(stream, int(got.sm.smCount), "", ctx))
        pre, dec = sides
        return Pair(p, Side(pre.stream, pre.num_sms, f"p{pre.num_sms}", pre.ctx),
                    Side(dec.stream, dec.num_sms, f"d{dec.num_sms}/p{pre.num_sms}", dec.ctx))

    @classmethod
    def _fallback(cls, device: int, granule: int, sizes, num_sms: int, reason: str) -> PartitionMenu:
        warnings.warn(f"green contexts unavailable ({reason}): every lane runs on whole-GPU streams",
                      RuntimeWarning, stacklevel=3)
        streams = []
        if num_sms:
            import torch

            streams = [torch.cuda.Stream(device) for _ in range(3)]
        total = num_sms or 1
        s = streams or [None, None, None]
        full = Side(s[0], total, "all")
        naive = (Side(s[1], total, "naive-a"), Side(s[2], total, "naive-b"))
        sizes = sizes or default_sizes(max(total, 4 * granule), granule)
        # Without partitions each "pair" is the two naive whole-GPU streams: correct, not isolated.
        pairs = {p: Pair(p, naive[0], naive[1]) for p in sizes}
        return cls(device, total, granule, False, pairs, full, naive)

    # ------------------------------------------------------------------ lookup
    def pair(self, prefill_sms: int) -> Pair:
        """The pair whose prefill side has ``prefill_sms`` SMs (or was asked for that many); else the
        nearest prefill size."""
        if prefill_sms in self.pairs:
            return self.pairs[prefill_sms]
        for pair in self.pairs.values():
            if pair.requested == prefill_sms:
                return pair
        if not self.pairs:
            raise GreenContextError("the partition menu has no pairs")
        return self.pairs[min(self.pairs, key=lambda k: (abs(k - prefill_sms), k))]

    def pair_for_decode(self, decode_sms: int) -> Pair:
        """The pair whose decode side has ``decode_sms`` SMs (the complement of a prefill size)."""
        for pair in self.pairs.values():
            if pair.decode.num_sms == decode_sms:
                return pair
        return self.pair(self.num_sms - decode_sms)

    def streams(self, prefill_sms: int):
        """``(prefill_stream, decode_stream, actual_prefill_sms)`` of the pair for ``prefill_sms``."""
        pair = self.pair(prefill_sms)
        return pair.prefill.stream, pair.decode.stream, pair.prefill.num_sms

    def side(self, lane: str, num_sms: int) -> Side:
        """The partition a Batch on ``lane`` with ``num_sms`` runs on. Lane "all" -> the whole-GPU stream;
        a split lane asking for the whole GPU -> one of the two naive streams (naive concurrency); else the
        pair's prefill side, or for decode the side of the pair whose decode half has ``num_sms`` SMs."""
        if lane == "all":
            return self.full
        if num_sms >= self.num_sms:
            return self.naive[0] if lane == "prefill" else self.naive[1]
        if lane == "prefill":
            return self.pair(num_sms).prefill
        if lane == "decode":
            return self.pair_for_decode(num_sms).decode
        raise ValueError(f"unknown lane {lane!r}")

    def describe(self) -> list[tuple[int, int, int]]:
        """``(requested, prefill SMs, decode SMs)`` per pair, by prefill size."""
        return [(p.requested, p.prefill.num_sms, p.decode.num_sms) for _, p in sorted(self.pairs.items())]

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
        for pair in self.pairs.values():
            self._destroy_pair(driver, pair, streams=False)
        self.pairs.clear()

    def _destroy_pair(self, driver, pair: Pair, streams: bool = True) -> None:
        for side in (pair.prefill, pair.decode):
            if streams:
                raw = side.stream.cuda_stream
                for i, s in enumerate(self._streams):
                    if int(s) == raw:
                        driver.cuStreamDestroy(self._streams.pop(i))
                        break
            if side.ctx is not None:
                (err,) = driver.cuGreenCtxDestroy(side.ctx)
                _checker(driver)(err, "cuGreenCtxDestroy")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def default_sizes(num_sms: int, granule: int) -> list[int]:
    """Prefill sizes of the default menu: the same rule as the simulator's (``bullet.config``)."""
    return partition_sizes(num_sms, granule)


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
