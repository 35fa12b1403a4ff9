"""The EAGLE-3 draft kind (specdec/draft_kind.py's interface): recognised by its config, loaded and published in
the engines' and speculators' layouts, decoded with the target's hidden states, replayed unrolled; its training
side is train/kinds/eagle3.py. P-EAGLE (`PEagleKind`, `draft: peagle`) is the same draft proposing a round in one
forward (vLLM's `parallel_drafting`): everything else is EAGLE-3's."""

from __future__ import annotations

from specdec.eagle3 import formats
from specdec.eagle3.drafter import Eagle3Drafter
from specdec.eagle3.model import Eagle3Draft
from specdec.eagle3.replay import unrolled_ranks
from specdec.hidden_state_kind import HiddenStateKind

NAME = "eagle3"  # `draft: eagle3` in a recipe
# The reduced head an EAGLE-3 draft over a larger vocabulary keeps by default: EAGLE-3's, SpecForge's and
# speculators' setting (a 128k-152k head would be most of the draft's weights and of its step's cost).
DEFAULT_VOCAB = 32_000


class Eagle3Kind(HiddenStateKind):
    name = NAME
    vllm_method = "eagle3"
    sglang_algorithm = "EAGLE3"
    formats = formats.FORMATS
    draft_class = Eagle3Draft
    drafter_class = Eagle3Drafter

    def recognises(self, config: dict) -> bool:
        return formats.is_eagle3_config(config) and not formats.is_parallel_config(config)

    def owns(self, model) -> bool:
        return isinstance(model, Eagle3Draft) and not model.parallel

    def replay_ranks(self, draft: Eagle3Draft, input_ids, attention_mask, loss_mask, steps: int, states):
        return unrolled_ranks(draft, input_ids, attention_mask, loss_mask, steps, states)

    def draft_forwards(self, proposal) -> int:
        return proposal.depth  # one token a forward (a tree: one forward a level)

    def card_facts(self, model: Eagle3Draft) -> dict:
        return {"layer_ids": list(model.layer_ids)}


PARALLEL_NAME = "peagle"  # `draft: peagle` in a recipe


class PEagleKind(Eagle3Kind):
    """P-EAGLE: an EAGLE-3 draft with a mask token (`ptd_token_id`) and a learned `mask_hidden`, proposing a
    round's k tokens in one forward (specdec/eagle3/drafter.py: propose_parallel), served by vLLM as `eagle3` with
    `parallel_drafting: true`, written by speculators as `peagle`."""

    name = PARALLEL_NAME

    def recognises(self, config: dict) -> bool:
        return formats.is_eagle3_config(config) and formats.is_parallel_config(config)

    def owns(self, model) -> bool:
        return isinstance(model, Eagle3Draft) and model.parallel

    def draft_forwards(self, proposal) -> int:
        return 1  # the whole chain in one forward (it proposes no trees)

    def vllm_speculative_config(self, model) -> dict:
        return {"parallel_drafting": True}

    def card_facts(self, model: Eagle3Draft) -> dict:
        return {**super().card_facts(model), "ptd_token_id": model.ptd_token_id}
