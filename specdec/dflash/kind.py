"""The DFlash draft kind (specdec/draft_kind.py's interface): recognised by its config, loaded and published in
vLLM's and speculators' layouts, decoded a block a round with the target's hidden states, replayed by blocks; its
training side is train/kinds/dflash.py."""

from __future__ import annotations

import torch

from specdec.dflash import formats
from specdec.dflash.drafter import DFlashDrafter
from specdec.dflash.model import DFlashDraft
from specdec.dflash.replay import block_ranks
from specdec.draft_kind import PublishContext
from specdec.eagle3.states import target_states

NAME = "dflash"  # `draft: dflash` in a recipe


class DFlashKind:
    name = NAME
    vllm_method = "dflash"
    sglang_algorithm = "DFLASH"
    formats = formats.FORMATS
    maps_vocabulary = True  # vLLM reads d2t

    def recognises(self, config: dict) -> bool:
        return formats.is_dflash_config(config)

    def owns(self, model) -> bool:
        return isinstance(model, DFlashDraft)

    def needs_snapshot(self, config: dict) -> bool:
        return True

    def load(self, path: str, dtype: torch.dtype) -> DFlashDraft:
        return DFlashDraft.from_pretrained(path, dtype)

    def save(self, model: DFlashDraft, out_dir, format: str = "", context: PublishContext | None = None,
             state_dict: dict | None = None) -> None:
        format = format or formats.FORMATS[0]
        speculators = None
        if format == "speculators" and context is not None:
            speculators = {"verifier": context.verifier(), "num_draft_tokens": context.num_draft_tokens,
                           "verifier_architectures": list(getattr(model.config, "target_architectures", None)
                                                          or ["LlamaForCausalLM"])}
        model.save_pretrained(out_dir, state_dict=state_dict, format=format, speculators=speculators)

    def check_target(self, draft: DFlashDraft, target, name: str, target_name: str) -> None:
        draft.check_target(target, name, target_name)

    def drafter(self, draft: DFlashDraft, target, sampling) -> DFlashDrafter:
        draft.adopt_target(target)
        return DFlashDrafter(draft, target, sampling)

    def target_states(self, draft: DFlashDraft, target, input_ids, attention_mask) -> torch.Tensor:
        draft.adopt_target(target)
        return target_states(target, input_ids, attention_mask, draft.layer_ids)

    def replay_ranks(self, draft: DFlashDraft, input_ids, attention_mask, loss_mask, steps: int, states):
        return block_ranks(draft, input_ids, attention_mask, loss_mask, steps, states)

    def draft_forwards(self, proposal) -> int:
        return 1  # the whole block in one forward

    def card_facts(self, model: DFlashDraft) -> dict:
        return {"layer_ids": list(model.layer_ids), "block_size": model.block_size,
                "mask_token_id": model.mask_token_id}
