"""An EAGLE-3 draft's held-out replay (specdec/replay.py): its proposals unrolled exactly as the decoder makes them,
the target's tokens ranked among each (specdec/ranks.py)."""

from __future__ import annotations

import torch

from specdec.ranks import RANK_CAP, true_token_ranks


@torch.no_grad()
def unrolled_ranks(draft, input_ids, attention_mask, loss_mask, steps: int, states,
                   outs: list[torch.Tensor] | None = None) -> list[list[list[int]]]:
    """For each scored position p (p predicts completion token p + 1) of each row: the ranks of tokens
    p + 1 .. p + steps among the draft's proposals 1..steps of the round whose first proposal is token p + 1,
    unrolled exactly as the decoder proposes (`Eagle3Draft.unrolled`); `states` = the target's [B, S, 3 H].
    `outs`: the unrolled outputs when the caller has them already (at least `steps` of them)."""
    if outs is None:
        outs = draft.unrolled(input_ids, states, attention_mask, steps)
    # Step j's output at draft position t proposes token t + 2 (t + 2 - j is the round's last true position), and
    # is read below only where token t + 2 is a scored one (position t + 1 scored): the head runs there alone, not
    # over prompts and padding (docs/results/2026-12-07-heldout-eval.md).
    read = loss_mask[:, 1:-1].bool()  # [B, n - 1]
    tokens = input_ids[:, 2:][read]
    ranks = torch.full((steps, *read.shape), RANK_CAP, dtype=torch.long, device=input_ids.device)
    for j, o in enumerate(outs[:steps]):
        ranks[j][read] = true_token_ranks(draft.logits(o[:, :-1][read]), tokens, draft.draft_to_target)
    ranks = ranks.tolist()  # [j][B][n - 1]: RANK_CAP where unread (token t + 2 past the completion or unscored)
    out = []
    for b, scored in enumerate(loss_mask.tolist()):
        # the round's j-th proposal is token p + j, at draft position t = p + j - 2
        out.append([[ranks[j - 1][b][p + j - 2] if 0 <= p + j - 2 < len(scored) - 2 else RANK_CAP
                     for j in range(1, steps + 1)] for p, s in enumerate(scored) if s])
    return out
