"""Verification of a round of k draft tokens against the target: pure tensor functions, no host syncs.

Names follow Leviathan et al. (2022), "Fast Inference from Transformers via Speculative Decoding":
p = target distribution, q = draft distribution. A draft token x is accepted with probability
min(1, p(x) / q(x)); at the first rejection the emitted token is drawn from norm(max(p - q, 0)); when all k
are accepted a bonus token is drawn from p at position k + 1. The emitted tokens are then distributed as p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling import sample_from


@dataclass
class Verdict:
    """Outcome of one verification, per row."""

    num_accepted: torch.Tensor  # [B] leading draft tokens accepted, 0..k
    next_token: torch.Tensor  # [B] correction at position num_accepted (< k), or bonus (== k)


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row, without a host sync.  [B, k] bool -> [B] long"""
    return (~mask).long().cumsum(dim=-1).eq(0).sum(dim=-1)


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Accept draft tokens while they equal the target's argmax; the next token is the target's argmax there.

    draft_tokens [B, k], target_logits [B, k+1, V].
    """
    k = draft_tokens.shape[1]
    target_choice = target_logits.argmax(dim=-1)  # [B, k+1]
    num_accepted = leading_true(draft_tokens == target_choice[:, :k])  # [B]
    next_token = target_choice.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return Verdict(num_accepted, next_token)


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)), with 0 where q(x) = 0 (such x is never proposed)."""
    ratio = p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)
    return torch.where(q_x > 0, ratio.clamp(max=1.0), torch.zeros_like(ratio))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)); falls back to p where p == q everywhere (then a rejection cannot happen).  [..., V]"""
    residual = (p - q).clamp_min(0.0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p)


def rejection_verify(
    draft_tokens: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Speculative sampling: accept with min(1, p/q), then sample the correction or the bonus token.

    draft_tokens [B, k] (sampled from q), q [B, k, V], p [B, k+1, V]; q and p float32 and already warped.
    """
    batch, k = draft_tokens.shape
    p_x = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    q_x = q.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    u = torch.rand(p_x.shape, generator=generator, device=p_x.device)  # [B, k]
    num_accepted = leading_true(u < acceptance_probability(p_x, q_x))  # [B]
    # q padded with a zero row at position k makes the bonus case residual(p_k, 0) = p_k: one code path.
    q_padded = torch.cat([q, q.new_zeros(batch, 1, q.shape[-1])], dim=1)  # [B, k+1, V]
    rows = torch.arange(batch, device=p.device)
    next_probs = residual_distribution(p[rows, num_accepted], q_padded[rows, num_accepted])  # [B, V]
    return Verdict(num_accepted, sample_from(next_probs, generator))


def emitted_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Analytical distribution of the first emitted token of a round, from the same pieces the sampler uses.

    P(x) = q(x) * a(x) + P(reject) * r(x), with a = acceptance_probability and r = residual_distribution.
    Equals p for any q; the property tests check that identity.  p, q [..., V] -> [..., V]
    """
    accepted = q * acceptance_probability(p, q)
    reject = 1.0 - accepted.sum(dim=-1, keepdim=True)
    return accepted + reject * residual_distribution(p, q)
