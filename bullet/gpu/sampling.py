"""Token sampling on the device, with no host sync: greedy where temperature is 0, else seeded temperature /
top-p sampling by the exponential race (argmax of ``p_i / E_i`` with ``E_i ~ Exp(1)``), the noise drawn from
a counter-based hash of ``(seed, offset, token id)``: the same seed and offset give the same token on any
batch composition, and nothing depends on a global generator."""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix on int64 tensors holding values in ``[0, 2^32)`` (no overflow: factors < 2^31)."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 ``[B, vocab]`` in (0, 1), a function of ``(seeds[b], offsets[b], token id)`` alone."""
    key = _hash32(_hash32(seeds.long()) ^ (offsets.long() * 0x2545F49 & _MASK32))  # [B]
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _hash32(_hash32(ids[None, :] + (key[:, None] << 1)) ^ key[:, None])
    # 24 high-quality bits -> (0, 1) exactly representable in float32
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits: torch.Tensor, temperature: torch.Tensor | None, top_p: torch.Tensor | None = None,
           seeds: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[B]`` token ids from float32 ``logits [B, vocab]``.

    ``temperature [B]``: 0 means greedy; None means every row is greedy (argmax only: the cheap path, for
    batches the host knows to be all-greedy). ``top_p [B]`` (None: no nucleus cut, and no sort) keeps the smallest
    set of most likely tokens whose probability reaches ``top_p``. ``seeds [B]`` / ``offsets [B]`` (e.g. the
    request's seed and the position being sampled) fix the noise; None means 0."""
    B, V = logits.shape
    greedy = logits.argmax(dim=-1)
    if temperature is None:
        return greedy
    temp = temperature.to(device=logits.device, dtype=torch.float32)
    t_safe = torch.where(temp > 0, temp, torch.ones_like(temp))
    probs = torch.softmax(logits / t_safe[:, None], dim=-1)
    if top_p is not None:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of strictly more likely tokens
        drop_sorted = before >= top_p.to(probs.device, torch.float32)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    zeros = torch.zeros(B, dtype=torch.int64, device=logits.device)
    u = uniform_noise(zeros if seeds is None else seeds.to(logits.device),
                      zeros if offsets is None else offsets.to(logits.device), V)
    race = probs / -torch.log(u)  # argmax of p / Exp(1) samples index i with probability p_i
    sampled = race.argmax(dim=-1)
    return torch.where(temp > 0, sampled, greedy)
