"""Prefill and decode lanes run concurrently on two streams that both span the whole GPU: no
partitioning, so the hardware scheduler decides who gets which SM."""

from __future__ import annotations

from ..batch import Partition
from .static_split import StaticSplit


class NaiveConcurrent(StaticSplit):
    __slots__ = ()

    def _partitions(self) -> tuple[Partition, Partition]:
        return Partition("prefill", self.gpu.num_sms), Partition("decode", self.gpu.num_sms)
