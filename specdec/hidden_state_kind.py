"""What the kinds of the drafts that read the target's hidden states share (EAGLE-3, P-EAGLE: specdec/eagle3/kind.py;
DFlash: specdec/dflash/kind.py): loading and saving through the draft's class, the speculators layout's verifier,
the target check and the target's states for the replay. Each kind adds its recognition, drafter and replay."""

from __future__ import annotations

import torch

from specdec.draft_kind import PublishContext
from specdec.eagle3.states import target_states
from specdec.hidden_state_draft import HiddenStateDraft


class HiddenStateKind:
    """The shared part of such a kind; a subclass sets `draft_class`, `drafter_class` (its decoder side, built
    over the draft, the target and the sampling) and `formats` (its layouts, the default first)."""

    draft_class: type[HiddenStateDraft]
    drafter_class: type
    formats: tuple[str, ...]
    maps_vocabulary = True  # the engines read d2t

    def needs_snapshot(self, config: dict) -> bool:
        return True

    def load(self, path: str, dtype: torch.dtype) -> HiddenStateDraft:
        return self.draft_class.from_pretrained(path, dtype)

    def save(self, model: HiddenStateDraft, out_dir, format: str = "", context: PublishContext | None = None,
             state_dict: dict | None = None) -> None:
        format = format or self.formats[0]
        speculators = None
        if format == "speculators" and context is not None:
            speculators = {"verifier": context.verifier(), "num_draft_tokens": context.num_draft_tokens,
                           "verifier_architectures": list(getattr(model.config, "target_architectures", None)
                                                          or ["LlamaForCausalLM"])}
        model.save_pretrained(out_dir, state_dict=state_dict, format=format, speculators=speculators)

    def check_target(self, draft: HiddenStateDraft, target, name: str, target_name: str) -> None:
        draft.check_target(target, name, target_name)

    def drafter(self, draft: HiddenStateDraft, target, sampling):
        draft.adopt_target(target)
        return self.drafter_class(draft, target, sampling)

    def target_states(self, draft: HiddenStateDraft, target, input_ids, attention_mask) -> torch.Tensor:
        draft.adopt_target(target)
        return target_states(target, input_ids, attention_mask, draft.layer_ids)
