"""Where the target's tokens rank among a draft's proposals: what the held-out replay (specdec/replay.py) turns into
accepted runs and tau. Every draft kind's replay reports its ranks in this shape (`teacher_forced_ranks` for a
draft that reads tokens only)."""

from __future__ import annotations

import torch

RANK_CAP = 8  # ranks are kept up to the top 8; RANK_CAP means "not in the draft's top 8" (or not in its vocabulary)


def true_token_ranks(logits: torch.Tensor, tokens: torch.Tensor, id_map: torch.Tensor | None,
                     cap: int = RANK_CAP) -> torch.Tensor:
    """Rank of each target token among a draft's logits (0 = its first choice), `cap` beyond the top cap - 1 or
    outside a reduced vocabulary (`id_map`: draft row -> target id).  logits [..., V_draft], tokens [...] -> [...]"""
    if id_map is None:
        local, inside = tokens.clamp(max=logits.shape[-1] - 1), tokens < logits.shape[-1]
    else:
        id_map = id_map.to(tokens.device)
        inverse = torch.full((int(max(id_map.max(), tokens.max())) + 1,), -1, dtype=torch.long, device=tokens.device)
        inverse[id_map] = torch.arange(id_map.numel(), device=tokens.device)
        local = inverse[tokens]
        inside = local >= 0
    true_logit = logits.gather(-1, local.clamp(min=0)[..., None])
    rank = (logits > true_logit).sum(-1).clamp(max=cap)
    return torch.where(inside, rank, torch.full_like(rank, cap))


@torch.no_grad()
def teacher_forced_ranks(draft, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                         steps: int) -> list[list[list[int]]]:
    """The replay ranks of a causal LM that reads tokens only: its j-th proposal of a round reads the true prefix
    (the round accepted it), so one teacher-forced forward ranks every depth (RANK_CAP past the completion's end)."""
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = draft(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
    # logits position t proposes token t + 1
    rank = true_token_ranks(logits[:, :-1], input_ids[:, 1:], getattr(draft, "draft_to_target", None))
    out = []
    for row_rank, row_scored in zip(rank.tolist(), loss_mask[:, :-1].tolist()):
        scored = [r for r, s in zip(row_rank, row_scored) if s]
        padded = scored + [RANK_CAP] * steps
        out.append([padded[i : i + steps] for i in range(len(scored))])
    return out
