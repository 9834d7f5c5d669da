"""A hand-computable latency model for scheduler and simulator tests (not a performance model)."""

import numpy as np

from bullet.perfmodel import Work


class LinearLatency:
    """seconds = base + per_token * tokens + per_kv * kv_read, per layer fraction; co-running slows
    both lanes by ``contention``; SMs scale time by num_sms_full / num_sms."""

    def __init__(self, num_layers: int, full_sms: int = 132, base=2e-3, per_token=1e-5, per_kv=1e-7,
                 contention=1.0):
        self.num_layers, self.full_sms = num_layers, full_sms
        self.base, self.per_token, self.per_kv, self.contention = base, per_token, per_kv, contention

    def _t(self, layers, tokens, kv, num_sms, co):
        t = (self.base + self.per_token * tokens + self.per_kv * kv) * layers / self.num_layers
        t = t * self.full_sms / np.asarray(num_sms, dtype=float)
        return t * (self.contention if co is not None else 1.0)

    def predict(self, work: Work, num_sms, co=None, co_sms=0):
        t = self._t(work.num_layers, work.tokens, work.kv_read, num_sms, co)
        return float(t) if np.ndim(t) == 0 else t

    def decode_steps(self, work: Work, steps, num_sms, co=None, co_sms=0):
        kv = work.kv_read + np.arange(steps) * work.seqs
        return self._t(work.num_layers, work.tokens, kv, num_sms, co)
