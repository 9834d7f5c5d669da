"""Discrete-event simulation of bullet's executors: the same scheduler, a virtual GPU."""

from .executor import SimExecutor
from .run import SimulationResult, simulate

__all__ = ["SimExecutor", "SimulationResult", "simulate"]
