"""Distillation losses and acceptance metrics: pure functions over logits.

Conventions (docs/design.md): `p` is the target (teacher) distribution, `q` the draft (student) distribution.
Every loss takes `student_logits` and `teacher_logits` of shape [..., V] and an optional boolean `mask` [...]
that selects the positions to average over (completion tokens). Masked positions are dropped *before* any
softmax, so padded rows can hold anything, and the result is the mean over the selected positions.

Teacher logits may hold -inf entries: that is how a truncated teacher is expressed (offline top-n
log-probabilities, see `dense_teacher_logits`). Terms with p(x) = 0 contribute 0, as in the maths.

The generalized JSD follows TRL's GKD `generalized_jsd_loss` (Agarwal et al. 2024, eq. 1):
    M = beta * p + (1 - beta) * q,   JSD(beta) = beta * KL(p || M) + (1 - beta) * KL(q || M),
with beta = 0 defined as forward KL(p || q) and beta = 1 as reverse KL(q || p) (the limits of JSD(beta) / beta
and JSD(beta) / (1 - beta)). Temperature divides both logits before the softmax (no T^2 factor).

The losses a recipe's `loss` key can name are the table `LOSSES` (name -> `Loss`); `configured_loss` composes a
config's losses for both trainers (train/plain_train.py, train/eagle3_train.py). A new loss is a function here
and a row of that table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def _select(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[..., V] -> [N, V]: the masked positions only (all positions when mask is None)."""
    if mask is None:
        return x.reshape(-1, x.shape[-1])
    return x[mask.bool()]


def _log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log-softmax in float32 (-inf entries stay -inf).  [N, V] -> [N, V]"""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return F.log_softmax(logits, dim=-1)


def _kl(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row, with 0 * log(0 / x) = 0.  [N, V] x2 -> [N]"""
    a = logp_a.exp()
    # where() rather than multiplication: a(x) = 0 with log a(x) = -inf would give 0 * -inf = nan.
    diff = torch.where(a > 0, logp_a - logp_b, torch.zeros_like(logp_a))
    return (a * diff).sum(dim=-1)


def _mean(values: torch.Tensor) -> torch.Tensor:
    """Mean over positions; 0 (with a graph) when there are none."""
    return values.sum() / max(values.numel(), 1)


class _ForwardKL(torch.autograd.Function):
    """Per-row KL(p || q) from student and teacher logits [N, V] (float32), its gradient q - p written by hand.

    The same sum through autograd (log-softmax, exp, where, subtract, multiply) keeps about six [N, V] tensors and
    walks each back; this keeps two (log q, p) and writes one gradient. A reduced draft head's loss is a few such
    passes over every scored position's vocabulary, a large share of a training step on a CPU
    (bench/train_throughput.py measures the step)."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        log_q = F.log_softmax(student, dim=-1)
        log_p = F.log_softmax(teacher, dim=-1)
        p = log_p.exp()
        # 0 * log(0 / x) = 0 where the teacher has no mass (-inf); a row with none at all stays nan, as in `_kl`.
        rows = torch.where(p == 0, 0.0, p * (log_p - log_q)).sum(dim=-1)
        ctx.save_for_backward(log_q, p)
        return rows

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_rows: torch.Tensor):
        log_q, p = ctx.saved_tensors
        return log_q.exp().sub_(p).mul_(grad_rows[:, None]), None


def forward_kl(student_logits, teacher_logits, mask=None, temperature: float = 1.0) -> torch.Tensor:
    """KL(p || q), mean over masked positions (mass-covering; the classic KD loss)."""
    student = _select(student_logits, mask).float()
    teacher = _select(teacher_logits, mask).float()
    if temperature != 1.0:
        student, teacher = student / temperature, teacher / temperature
    if teacher.requires_grad:  # a teacher that learns as well: autograd's graph gives it its gradient
        return _mean(_kl(_log_probs(teacher), _log_probs(student)))
    return _mean(_ForwardKL.apply(student, teacher))


def reverse_kl(student_logits, teacher_logits, mask=None, temperature: float = 1.0) -> torch.Tensor:
    """KL(q || p), mean over masked positions (mode-seeking).

    Where the teacher is truncated (-inf, offline top-n) the student is restricted to the teacher's support
    and renormalised there (as TRL's GOLD top-k does); otherwise the divergence would be infinite.
    """
    s = _select(student_logits, mask).float()
    t = _select(teacher_logits, mask).float()
    s = s.masked_fill(torch.isneginf(t), float("-inf"))
    return _mean(_kl(_log_probs(s, temperature), _log_probs(t, temperature)))


def generalized_jsd(student_logits, teacher_logits, mask=None, beta: float = 0.5,
                    temperature: float = 1.0) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence (TRL GKD convention): 0 -> forward KL, 1 -> reverse KL."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta}")
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits, mask, temperature)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits, mask, temperature)
    logq = _log_probs(_select(student_logits, mask), temperature)
    logp = _log_probs(_select(teacher_logits, mask), temperature)
    logm = torch.logsumexp(torch.stack([logq + math.log(1.0 - beta), logp + math.log(beta)]), dim=0)
    return _mean(beta * _kl(logp, logm) + (1.0 - beta) * _kl(logq, logm))


def total_variation(student_logits, teacher_logits, mask=None, temperature: float = 1.0) -> torch.Tensor:
    """TVD = 1 - sum_x min(p(x), q(x)) = 1 - expected acceptance alpha; minimising it maximises alpha."""
    q = _log_probs(_select(student_logits, mask), temperature).exp()
    p = _log_probs(_select(teacher_logits, mask), temperature).exp()
    return _mean(1.0 - torch.minimum(p, q).sum(dim=-1))


def cross_entropy(student_logits, targets, mask=None) -> torch.Tensor:
    """-log q(target token), mean over masked positions (sequence-level KD on the target's tokens)."""
    logq = _log_probs(_select(student_logits, mask))
    ids = targets.reshape(-1) if mask is None else targets[mask.bool()]
    return _mean(-logq.gather(-1, ids.unsqueeze(-1)).squeeze(-1))


# ---- the loss table and its composition ----------------------------------------------------------------------

TEACHER = "teacher"  # the loss compares the draft with the teacher's logits over the draft's vocabulary
TARGETS = "targets"  # the loss scores the target's tokens (in draft ids)


@dataclass(frozen=True)
class Loss:
    """A loss a config can name: `compute(student_logits [..., V], reference, mask, **options)` -> the mean over
    the masked positions. `reference` is the teacher's logits [..., V] (reads=TEACHER) or the target's token ids
    [...] (reads=TARGETS); `options` names the config fields (TrainConfig) it takes by keyword."""

    compute: Callable[..., torch.Tensor]
    reads: str
    options: tuple[str, ...] = ()

    def __call__(self, student_logits, reference, mask=None, **options) -> torch.Tensor:
        # Options it does not declare are left out: one set of settings (a config's) serves every loss.
        return self.compute(student_logits, reference, mask, **{k: options[k] for k in self.options if k in options})


LOSSES: dict[str, Loss] = {
    "fkl": Loss(forward_kl, TEACHER, ("temperature",)),
    "rkl": Loss(reverse_kl, TEACHER, ("temperature",)),
    "jsd": Loss(generalized_jsd, TEACHER, ("beta", "temperature")),
    "tvd": Loss(total_variation, TEACHER, ("temperature",)),
    "ce": Loss(cross_entropy, TARGETS),
}


def configured_terms(cfg) -> list[tuple[Loss, float]]:
    """(loss, weight) of each term a config trains on: `loss` at weight 1, plus `ce_weight` x cross-entropy on the
    target's tokens when that is not already the loss."""
    terms = [(LOSSES[cfg.loss], 1.0)]
    if cfg.loss != "ce" and cfg.ce_weight > 0:
        terms.append((LOSSES["ce"], cfg.ce_weight))
    return terms


def reads_teacher(cfg) -> bool:
    """Whether the configured loss needs teacher logits (a ce-only run needs none: no target forward, no top-n)."""
    return any(loss.reads == TEACHER for loss, _ in configured_terms(cfg))


def configured_loss(cfg, student_logits, teacher_logits=None, targets=None, target_mask=None,
                    summed: bool = False) -> torch.Tensor:
    """The configured loss over scored positions (rows).  student_logits [N, V]; teacher_logits [N, V] (None when
    no term reads it, `reads_teacher`); targets [N] draft ids, scored where `target_mask` (None: every row).

    A teacher term skips the rows whose teacher has no mass in the draft's vocabulary (`with_teacher_mass`). Each
    term is its mean over its rows, or with `summed` that mean times its row count (a caller that divides by
    positions counted over several chunks and processes), weighted and added."""
    terms = configured_terms(cfg)
    options = {name: getattr(cfg, name) for loss, _ in terms for name in loss.options}
    total = None
    for loss, weight in terms:
        if loss.reads == TEACHER:
            student, teacher = with_teacher_mass(student_logits, teacher_logits)
            value, rows = loss(student, teacher, None, **options), student.shape[0]
        else:
            rows = student_logits.shape[0] if target_mask is None else target_mask.sum()
            value = loss(student_logits, targets, target_mask, **options)
        if summed:
            value = value * rows
        if weight != 1.0:  # the configured `loss` itself is the bare term
            value = weight * value
        total = value if total is None else total + value
    return total


def targets_in_draft_ids(labels: torch.Tensor, target_to_draft: torch.Tensor | None,
                         draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's tokens as draft ids (0 where the draft lacks one) and where the draft has them: a reduced
    head cannot predict the others.  [...] -> ([...] long, [...] bool)"""
    local = labels if target_to_draft is None else target_to_draft[labels]
    return local.clamp(min=0), (local >= 0) & (local < draft_vocab)


# ---- teacher signal in the draft's vocabulary ------------------------------------------------------------


def restrict_teacher(teacher_logits: torch.Tensor, draft_to_target: torch.Tensor | None) -> torch.Tensor:
    """Teacher logits in the draft's vocabulary.  [..., V_target] -> [..., N]

    For a reduced-vocabulary draft the teacher is restricted to the kept ids and (by the later softmax)
    renormalised over them: the draft cannot place mass elsewhere, so the loss asks it to match p
    conditioned on the kept set. The acceptance metrics below do NOT renormalise (see `acceptance_alpha`).
    """
    if draft_to_target is None:
        return teacher_logits
    return teacher_logits.index_select(-1, draft_to_target.to(teacher_logits.device))


def target_to_draft_map(draft_to_target: torch.Tensor | None, target_vocab: int) -> torch.Tensor | None:
    """Inverse id map [V_target]: draft index of each target id, -1 where the draft has none."""
    if draft_to_target is None:
        return None
    inv = torch.full((target_vocab,), -1, dtype=torch.long, device=draft_to_target.device)
    inv[draft_to_target] = torch.arange(draft_to_target.numel(), device=draft_to_target.device)
    return inv


def with_teacher_mass(student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the rows whose teacher has no id in the draft's vocabulary (a reduced head missing all of the
    stored top-n): their renormalised teacher is undefined and would make the loss nan.  [N, V] x2"""
    # One pass over the rows' maxima (isfinite would write two [N, V] temporaries); a row holding nan keeps it.
    keep = teacher.amax(dim=-1) != float("-inf")
    if bool(keep.all()):  # every row (always, for an online teacher): no [N, V] copies
        return student, teacher
    return student[keep], teacher[keep]


def dense_teacher_logits(top_ids: torch.Tensor, top_logprobs: torch.Tensor, vocab: int,
                         target_to_draft: torch.Tensor | None = None) -> torch.Tensor:
    """Stored top-n teacher log-probs as dense logits over the draft's vocabulary.  [..., n] -> [..., vocab]

    Ids outside the top-n are -inf, so the softmax renormalises the teacher over its top-n (the offline
    teacher). With a reduced draft, top-n ids the draft lacks are dropped too (restricted, renormalised).
    """
    ids = top_ids.long()
    logprobs = top_logprobs.float()
    if target_to_draft is not None:
        ids = target_to_draft.to(ids.device)[ids]
    keep = ids >= 0
    out = torch.full((*ids.shape[:-1], vocab), float("-inf"), dtype=torch.float32, device=ids.device)
    values = torch.where(keep, logprobs, torch.full_like(logprobs, float("-inf")))
    # Dropped ids point at slot 0 with value -inf; "amax" keeps slot 0's own value whatever the write order.
    out.scatter_reduce_(-1, ids.clamp(min=0), values, reduce="amax")
    return out


# ---- acceptance metrics (never renormalised) -------------------------------------------------------------


def _draft_probs_in_target_space(draft_logits: torch.Tensor, draft_to_target: torch.Tensor | None,
                                 target_vocab: int, temperature: float = 1.0) -> torch.Tensor:
    """q over target ids (0 outside a reduced draft's kept ids), at `temperature`.  [N, V_d] -> [N, V_target]"""
    q = _log_probs(draft_logits, temperature).exp()
    if draft_to_target is None:
        width = min(q.shape[-1], target_vocab)
        out = torch.zeros(q.shape[0], target_vocab, dtype=q.dtype, device=q.device)
        out[:, :width] = q[:, :width]
        return out
    out = torch.zeros(q.shape[0], target_vocab, dtype=q.dtype, device=q.device)
    out[:, draft_to_target.to(q.device)] = q
    return out


def acceptance_alpha(draft_logits, target_logits, mask=None, draft_to_target=None,
                     temperature: float = 1.0) -> torch.Tensor:
    """Expected acceptance alpha = sum_x min(p(x), q(x)) per selected position.  -> [N]

    p is the target's full softmax: mass on ids a reduced draft lacks can never be accepted, and counts so.
    `temperature` divides both logits first, as the decoder's SamplingConfig warps p and q (no top-k / top-p).
    """
    p = _log_probs(_select(target_logits, mask), temperature).exp()
    q = _draft_probs_in_target_space(_select(draft_logits, mask), draft_to_target, p.shape[-1], temperature)
    return torch.minimum(p, q).sum(dim=-1)


def _topn_at_temperature(p_top: torch.Tensor, temperature: float, target_vocab: int | None) -> torch.Tensor:
    """A lower bound on the target's probabilities at `temperature` of its stored top-n (taken at temperature 1).
    [N, n] -> [N, n]

    p_T(x) = p(x)^(1/T) / Z_T with Z_T = sum over the whole vocabulary, of which only the top-n terms are known.
    Z_T is bounded above from the unseen mass R = 1 - sum(top-n), every unseen p(y) being at most the smallest
    stored p_min: for T <= 1, sum p(y)^(1/T) <= p_min^(1/T - 1) R; for T > 1 (a concave power), at most the
    `target_vocab` - n unseen ids sharing R evenly, and at most each of them at p_min."""
    if temperature == 1.0:
        return p_top
    powered = p_top.pow(1.0 / temperature)
    unseen = (1.0 - p_top.sum(-1, keepdim=True)).clamp(min=0.0)
    smallest = p_top.min(-1, keepdim=True).values
    if temperature < 1.0:
        rest = smallest.pow(1.0 / temperature - 1.0) * unseen
    else:
        if target_vocab is None:
            raise ValueError("alpha from a stored top-n at a temperature above 1 needs the target's vocabulary size")
        count = max(target_vocab - p_top.shape[-1], 0)
        rest = torch.minimum(count ** (1.0 - 1.0 / temperature) * unseen.pow(1.0 / temperature),
                             count * smallest.pow(1.0 / temperature))
    return powered / (powered.sum(-1, keepdim=True) + rest).clamp(min=torch.finfo(powered.dtype).tiny)


def acceptance_alpha_topn(draft_logits, top_ids, top_logprobs, mask=None, draft_to_target=None,
                          temperature: float = 1.0, target_vocab: int | None = None) -> torch.Tensor:
    """alpha against stored top-n target log-probs (not renormalised): a lower bound.  -> [N]

    The target's mass outside its stored top-n is unknown and counted as not accepted. q is read at the top-n ids
    only (0 where a reduced draft lacks the id): no [N, target vocabulary] tensor is made. At a `temperature`
    other than 1, q is the draft's softmax of logits / T and p a lower bound on the target's (`_topn_at_temperature`;
    above 1 it needs `target_vocab`), so the figure stays a lower bound.
    """
    d = _select(draft_logits, mask)
    ids = _select(top_ids, mask).long()
    p_top = _topn_at_temperature(_select(top_logprobs, mask).float().exp(), temperature, target_vocab)
    q = _log_probs(d, temperature).exp()  # [N, V_d]
    if draft_to_target is None:
        local = ids
    else:
        d2t = draft_to_target.to(ids.device)
        inverse = torch.full((max(int(d2t.max()), int(ids.max()) if ids.numel() else 0) + 1,), -1,
                             dtype=torch.long, device=ids.device)
        inverse[d2t] = torch.arange(d2t.numel(), device=ids.device)
        local = inverse[ids]
    inside = (local >= 0) & (local < q.shape[-1])
    q_top = torch.where(inside, q.gather(-1, local.clamp(0, q.shape[-1] - 1)), torch.zeros_like(p_top))
    return torch.minimum(p_top, q_top).sum(dim=-1)


def draft_argmax_in_target_ids(draft_logits: torch.Tensor, draft_to_target: torch.Tensor | None) -> torch.Tensor:
    """The draft's greedy token as a target id.  [..., V_d] -> [...]"""
    top = draft_logits.argmax(dim=-1)
    return top if draft_to_target is None else draft_to_target.to(top.device)[top]


def greedy_agreement(draft_logits, target_logits, mask=None, draft_to_target=None) -> torch.Tensor:
    """Per selected position: does the draft's argmax equal the target's?  -> bool [N]"""
    d = draft_argmax_in_target_ids(_select(draft_logits, mask), draft_to_target)
    return d == _select(target_logits, mask).argmax(dim=-1)
