"""The DFlash draft kind (specdec/draft_kind.py's interface): recognised by its config, loaded and published in
vLLM's and speculators' layouts, decoded a block a round with the target's hidden states, replayed by blocks; its
training side is train/kinds/dflash.py."""

from __future__ import annotations

from specdec.dflash import formats
from specdec.dflash.drafter import DFlashDrafter
from specdec.dflash.model import DFlashDraft
from specdec.dflash.replay import block_ranks
from specdec.hidden_state_kind import HiddenStateKind

NAME = "dflash"  # `draft: dflash` in a recipe


class DFlashKind(HiddenStateKind):
    name = NAME
    vllm_method = "dflash"
    sglang_algorithm = "DFLASH"
    formats = formats.FORMATS
    draft_class = DFlashDraft
    drafter_class = DFlashDrafter

    def recognises(self, config: dict) -> bool:
        return formats.is_dflash_config(config)

    def owns(self, model) -> bool:
        return isinstance(model, DFlashDraft)

    def replay_ranks(self, draft: DFlashDraft, input_ids, attention_mask, loss_mask, steps: int, states):
        return block_ranks(draft, input_ids, attention_mask, loss_mask, steps, states)

    def draft_forwards(self, proposal) -> int:
        return 1  # the whole block in one forward

    def card_facts(self, model: DFlashDraft) -> dict:
        return {"layer_ids": list(model.layer_ids), "block_size": model.block_size,
                "mask_token_id": model.mask_token_id}
