"""Latency models: predict how long a batch takes on a partition, next to what runs on the other lane."""

from .base import LatencyModel, Work, work_of
from .fitted import FittedModel, ModelMismatch
from .roofline import GPU_CONSTANTS, RooflineConstants, RooflineModel

__all__ = ["GPU_CONSTANTS", "FittedModel", "LatencyModel", "ModelMismatch", "RooflineConstants", "RooflineModel",
           "Work", "work_of"]
