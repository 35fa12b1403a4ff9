"""Sampling settings and the logits -> distribution warp shared by the target (p) and the draft (q).

docs/design.md rule 3: temperature, top-k and top-p warp p and q identically, before the acceptance test, and the
softmax runs in float32 whatever the models' dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean no truncation."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        # nan fails no comparison below and would reach torch.multinomial as a table of nans; inf flattens p to uniform
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p, in float32; removed entries become -inf.  [..., V] -> [..., V]"""
    logits = logits.float()
    if sampling.temperature not in (0.0, 1.0):
        logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probabilities(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The warped distribution, float32.  [..., V] -> [..., V]"""
    return warp_logits(logits, sampling).softmax(dim=-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of a probability table.  [..., V] -> [...]"""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """Greedy argmax or a sample from the warped distribution.  [..., V] -> [...]"""
    if sampling.greedy:
        # In float32: the conversion is exact (the same first maximum), and torch's CPU argmax over bf16 logits is
        # slower than converting them and taking it there (docs/results/2026-12-06-greedy-pick.md).
        return logits.float().argmax(dim=-1)
    return sample_from(probabilities(logits, sampling), generator)
