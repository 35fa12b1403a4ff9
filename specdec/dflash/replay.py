"""A DFlash draft's held-out replay (specdec/replay.py): the block each round's decoder feeds, at every scored
position, the target's tokens ranked among each slot's proposal (specdec/ranks.py)."""

from __future__ import annotations

import torch

from specdec.ranks import RANK_CAP, true_token_ranks

ANCHORS_PER_FORWARD = 256  # blocks per forward: bounds the replay's attention mask on long rows


@torch.no_grad()
def block_ranks(draft, input_ids, attention_mask, loss_mask, steps: int, states) -> list[list[list[int]]]:
    """For each scored position p (p predicts completion token p + 1) of each row: the ranks of tokens
    p + 1 .. p + steps among slots 1..steps of the block anchored at p (the round whose last accepted token is
    p), computed as the decoder computes it (`DFlashDraft.forward`, max(block_size, steps + 1) slots)."""
    slots = max(draft.block_size, steps + 1)
    out = []
    for b in range(input_ids.shape[0]):
        scored = loss_mask[b].tolist()
        anchors = [p for p, s in enumerate(scored) if s]
        ranks: list[list[int]] = []
        for i in range(0, len(anchors), ANCHORS_PER_FORWARD):
            chunk = torch.tensor(anchors[i : i + ANCHORS_PER_FORWARD], device=input_ids.device)[None]
            logits = draft(input_ids[b : b + 1], states[b : b + 1], chunk, attention_mask[b : b + 1],
                           block_size=slots)[0]  # [A, slots, V_d]
            index = (chunk[0, :, None] + torch.arange(1, steps + 1, device=chunk.device)).clamp(
                max=input_ids.shape[1] - 1)
            got = true_token_ranks(logits[:, 1 : steps + 1], input_ids[b, index], draft.draft_to_target).tolist()
            for p, row in zip(chunk[0].tolist(), got):
                ranks.append([r if p + j < len(scored) and scored[p + j - 1] else RANK_CAP
                              for j, r in zip(range(1, steps + 1), row)])
        out.append(ranks)
    return out
