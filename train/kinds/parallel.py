"""The parallel kind's training side (train/kinds/base.py: TrainingKind): a plain draft fine-tuned PARD's way to
propose k tokens in one forward (train/parallel_train.py), its options block, its memory-plan terms
(train/kinds/parallel_plan.py) and its model card's usage (vLLM's draft_model with `parallel_drafting: true`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from specdec.train.card_engines import vllm_lines
from specdec.train.kinds.base import KindOptions, TrainingFacts
from specdec.train.kinds.parallel_plan import parallel_plan
from specdec.train.parallel_train import ParallelTraining
from specdec.train.plan.kind import KindPlan, PlanContext

NAME = "parallel"


@dataclass
class ParallelOptions(KindOptions):
    # The plain draft it starts from: derived (the target's layers: draft_layers), scratch (draft_config) or a
    # pretrained model id / path with the target's tokenizer.
    parallel_base: str = "derived"
    # Tokens it learns to propose in one forward (PARD's para_num: the sequence and parallel_tokens - 1 mask copies
    # in each training row; the train step's activations grow as many times). Serve it with k up to this.
    parallel_tokens: int = 4
    # The mask token's id (config.json's pard_token, which vLLM reads): an id of the target's vocabulary that the
    # data never holds; -1 = the tokenizer's highest special id other than bos, eos and pad.
    pard_token: int = -1

    def __post_init__(self) -> None:
        if self.parallel_tokens < 2:
            raise ValueError(f"parallel_tokens must be >= 2 (one real and at least one mask position), got "
                             f"{self.parallel_tokens}")
        if self.parallel_base == NAME:
            raise ValueError("parallel_base names the plain draft to start from (derived, scratch, a model id or "
                             "path), not parallel")


class ParallelTrainingKind:
    name = NAME
    # its proposals read masks, not its own samples: no on-policy teacher; pack=true would let copies cross samples
    facts = TrainingFacts(teachers=("online", "offline"))
    options = ParallelOptions

    def start(self, cfg, target, tokenizer, vocabulary, device, autocast, folders) -> ParallelTraining:
        return ParallelTraining(cfg, target, tokenizer, vocabulary, device)

    def plan(self, context: PlanContext) -> KindPlan:
        return parallel_plan(context)

    def card_usage(self, info, k: int) -> list[str]:
        if info.head == "reduced":
            return ["## Usage", "", "Only specdec can run this export (see the warning above).", ""]
        vllm_config = json.dumps({"model": info.model_ref, "method": info.method, "num_speculative_tokens": k,
                                  "parallel_drafting": True})
        return [
            "## Usage",
            "",
            "A parallel draft (PARD, arXiv:2504.18583): it proposes a round's k tokens in one forward, reading "
            f"the last token and k - 1 copies of its mask token (config.json `pard_token`: "
            f"{info.kind_facts.get('mask_token')}). The draft only changes speed: greedy output is token-identical "
            "to the target alone, and sampled output is distributed as the target's.",
            "",
            "### vLLM (draft model, parallel drafting)",
            "",
            *vllm_lines(info.target_ref, vllm_config, json.dumps),
        ]
