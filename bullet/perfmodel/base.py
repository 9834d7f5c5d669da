"""The interface every latency model implements, and the summary of a batch it predicts from.

The simulator and the policies see only this: a backend (analytic roofline now, fitted regressions
later) can be swapped without either noticing.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from ..batch import Batch


class Work(NamedTuple):
    """What one launch asks of the GPU, summed over its chunks."""

    num_layers: int  # layers in the slice
    tokens: int  # sum of chunk lengths (rows of every linear layer)
    seqs: int  # chunks
    attn_pairs: float  # query-key pairs: causal inside the chunk, full over the cached prefix
    kv_read: int  # KV tokens each layer reads: sum of (start + num_tokens)
    samples: int  # rows through the LM head and sampler (0 unless the slice reaches the last layer)
    embed: bool  # the slice starts at layer 0 (embedding lookup)


def work_of(batch: Batch, total_layers: int) -> Work:
    tokens = seqs = kv = samples = 0
    pairs = 0.0
    for c in batch.chunks:
        n = c.num_tokens
        tokens += n
        seqs += 1
        kv += c.start + n
        pairs += n * c.start + n * (n + 1) / 2
        samples += c.sample
    last = batch.layers.stop == total_layers
    return Work(len(batch.layers), tokens, seqs, pairs, kv, samples if last else 0, batch.layers.start == 0)


class LatencyModel(Protocol):
    def predict(self, work: Work, num_sms: int | np.ndarray, co: Work | None = None,
                co_sms: int = 0) -> float | np.ndarray:
        """Seconds for ``work`` on ``num_sms`` SMs (an array of SM counts gives an array), while ``co``
        runs on ``co_sms`` other SMs (None: alone on the GPU)."""

    def decode_steps(self, work: Work, steps: int, num_sms: int, co: Work | None = None,
                     co_sms: int = 0) -> np.ndarray:
        """Seconds of each of ``steps`` fused decode steps; every sequence grows by one token a step,
        so step i reads ``work.kv_read + i * work.seqs`` KV tokens."""
