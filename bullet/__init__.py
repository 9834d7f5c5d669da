"""bullet: LLM serving with prefill and decode on disjoint SM partitions, and the simulator that plans it.

The core (this package minus ``bullet.gpu``) imports without torch."""

__version__ = "0.1.0"
