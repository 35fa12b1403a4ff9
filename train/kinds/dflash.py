"""DFlash's training side (train/kinds/base.py: TrainingKind): its options block, its run (train/dflash_train.py),
its memory-plan terms (train/kinds/dflash_plan.py) and its model card's usage (vLLM's `dflash` method)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from specdec.dflash.kind import NAME
from specdec.train.card_engines import vllm_lines
from specdec.train.dflash_train import DFlashTraining
from specdec.train.eagle3_states import SOURCES as STATES_SOURCES
from specdec.train.kinds.base import KindOptions, TrainingFacts
from specdec.train.kinds.dflash_plan import dflash_plan
from specdec.train.plan.kind import KindPlan, PlanContext

# The reduced head a DFlash draft over a larger vocabulary keeps by default (speculators' draft_vocab_size default)
DEFAULT_VOCAB = 32_000


@dataclass
class DFlashOptions(KindOptions):
    """draft=dflash's keys (specdec/dflash/)."""

    block_size: int = 16  # slots per block: the anchor and block_size - 1 proposals (z-lab's published drafts: 16)
    num_anchors: int = 512  # blocks trained per row, at random scored positions (speculators' max_anchors)
    # slot j's loss weighs exp(-(j - 1) / loss_decay) (the paper: 7 for blocks of 16, 5 for 10, 4 for 8).
    loss_decay: float = 7.0
    # the target layers whose residual streams it reads, counted after i layers (specdec's numbering; the
    # published config's target_layer_ids are one less); [] = 5 ids spread from after layer 2 to after N - 2
    dflash_layer_ids: list[int] = field(default_factory=list)
    dflash_layers: int = 5  # the draft's decoder layers (z-lab's Qwen3-8B draft: 5)
    mask_token_id: int = -1  # the token the mask slots read; -1 = the target vocabulary's last id
    # Where the target's states come from per batch (train/eagle3_states.py): recorded, online or auto.
    states: str = "auto"
    # The draft's final norm at the start: the target's final norm weights ("target"), or ones ("ones", as
    # speculators' DFlash starts: a lower first loss, but a lower held-out tau at bench/peer_dflash.py's budget,
    # docs/results/2026-12-05-peer-dflash.md).
    norm_init: str = "target"

    def __post_init__(self) -> None:
        for name, low in (("block_size", 2), ("num_anchors", 1), ("dflash_layers", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if not self.loss_decay > 0:
            raise ValueError(f"loss_decay must be > 0, got {self.loss_decay}")
        if self.norm_init not in ("target", "ones"):
            raise ValueError(f"norm_init must be target or ones, got {self.norm_init!r}")
        if self.states not in STATES_SOURCES:
            raise ValueError(f"states must be one of {', '.join(STATES_SOURCES)}, got {self.states!r}")


class DFlashTrainingKind:
    name = NAME
    facts = TrainingFacts(
        teachers=("online", "offline"), lora=False, packing=True, reads_target_states=True, row_slices=True,
        # its loss and replay call the module outside its wrapped forward, which sharded parameters do not allow
        replicated=True, default_vocab_size=DEFAULT_VOCAB)
    options = DFlashOptions

    def start(self, cfg, target, tokenizer, vocabulary, device, autocast, folders) -> DFlashTraining:
        return DFlashTraining(cfg, target, tokenizer, vocabulary, device, autocast, folders)

    def plan(self, context: PlanContext) -> KindPlan:
        return dflash_plan(context)

    def card_usage(self, info, k: int) -> list[str]:
        return dflash_usage(info, k)


def dflash_usage(info, k: int, q=json.dumps) -> list[str]:
    """How vLLM (both layouts) and speculators run this draft."""
    draft, target, facts = info.model_ref, info.target_ref, info.kind_facts
    k = min(k, facts["block_size"] - 1)
    vllm_config = json.dumps({"method": "dflash", "model": draft, "num_speculative_tokens": k})
    lines = [
        "## Usage",
        "",
        "A DFlash draft (Chen et al. 2026, arXiv:2602.06036): it proposes a block of up to "
        f"{facts['block_size'] - 1} tokens in one forward, reading the target's residual stream after layers "
        f"{facts['layer_ids']} (its config's `dflash_config.target_layer_ids` numbers them one less) and the mask "
        f"token {facts['mask_token_id']}. vLLM serves it with `method: dflash` (a backend with non-causal "
        "attention); SGLang does not read this layout, and transformers' assisted generation does not run it.",
        "",
        "The draft only changes speed: greedy output is token-identical to the target alone, and sampled "
        "output is distributed as the target's.",
        "",
    ]
    if info.format == "speculators":
        return lines + ["This folder is in vLLM speculators' format: `vllm serve` detects it and takes the target "
                        "from its config, and `speculators`' `DFlashDraftModel.from_pretrained` loads it.", "",
                        "### vLLM", "", "```bash", f"vllm serve {draft}", "```", ""]
    return lines + ["### vLLM", "", *vllm_lines(target, vllm_config, q)]
