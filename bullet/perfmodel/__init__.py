"""Latency models: predict how long a batch takes on a partition, next to what runs on the other lane."""

from .base import LatencyModel, Work, work_of

__all__ = ["LatencyModel", "Work", "work_of"]
