"""EAGLE-3's training side (train/kinds/base.py: TrainingKind): its options block, its run (train/eagle3_train.py),
its memory-plan terms (train/kinds/eagle3_plan.py) and its model card's usage (vLLM's and SGLang's EAGLE-3 path)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from specdec.eagle3.kind import DEFAULT_VOCAB, NAME, PARALLEL_NAME
from specdec.train.card_engines import sglang_lines, vllm_lines
from specdec.train.eagle3_states import SOURCES as STATES_SOURCES
from specdec.train.eagle3_train import Eagle3Training, PEagleTraining
from specdec.train.kinds.base import KindOptions, TrainingFacts
from specdec.train.kinds.eagle3_plan import eagle3_plan
from specdec.train.plan.kind import KindPlan, PlanContext


@dataclass
class Eagle3Options(KindOptions):
    """draft=eagle3's keys (specdec/eagle3/)."""

    # the target layers whose residual streams it reads, counted as vLLM's eagle_aux_hidden_state_layer_ids (after
    # i layers); [] = the engines' default (2, N // 2, N - 3)
    eagle_aux_layer_ids: list[int] = field(default_factory=list)
    ttt_steps: int = 3  # training-time test: proposals unrolled per position (EAGLE-3's scheme; 1 = the first only)
    ttt_decay: float = 0.8  # step j's loss weighs decay^(j-1) (EAGLE-3, SpecForge), normalised to sum to one
    # How its new weights start: the decoder layer `random` (Llama's init) or `target` (the target's last decoder
    # layer, read where the draft reads the states)
    layer_init: str = "random"
    fc_init: str = "random"  # fc `random` or `last_state` (it passes the last recorded state through)
    # Whether the residual is the normed state (speculators' CLI default; written into the draft's config, which
    # vLLM and SGLang read)
    norm_before_residual: bool = False
    # Where the target's states come from, per batch (train/eagle3_states.py): recorded (the data stage's
    # record_features=true), online (the target runs on each batch; nothing is stored), or auto (recorded where a
    # row has them, else online)
    states: str = "auto"

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        if not 0.0 < self.ttt_decay <= 1.0:
            raise ValueError(f"ttt_decay must be in (0, 1], got {self.ttt_decay}")
        for name, allowed in (("states", STATES_SOURCES), ("layer_init", ("random", "target")),
                              ("fc_init", ("random", "last_state"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")


@dataclass
class PEagleOptions(Eagle3Options):
    """draft=peagle's keys: EAGLE-3's (`ttt_steps`: the k proposals a round trains in one forward), and:"""

    # The mask token the masked slots read (config.json's ptd_token_id, which vLLM reads); -1 = the tokenizer's
    # pad token, else its EOS.
    ptd_token_id: int = -1


class Eagle3TrainingKind:
    name = NAME
    facts = TrainingFacts(
        # its unrolled steps already show it its own proposals: no on-policy teacher
        teachers=("online", "offline"), lora=False, packing=True, reads_target_states=True, row_slices=True,
        # one decoder layer and a head: replicated whole, and its loss and replay call the module outside its
        # wrapped forward, which sharded parameters do not allow
        replicated=True, default_vocab_size=DEFAULT_VOCAB)
    options = Eagle3Options

    def start(self, cfg, target, tokenizer, vocabulary, device, autocast, folders) -> Eagle3Training:
        return Eagle3Training(cfg, target, tokenizer, vocabulary, device, autocast, folders)

    def plan(self, context: PlanContext) -> KindPlan:
        return eagle3_plan(context)

    def card_usage(self, info, k: int) -> list[str]:
        return eagle3_usage(info, k)


class PEagleTrainingKind(Eagle3TrainingKind):
    """P-EAGLE (specdec/eagle3/kind.py: PEagleKind): EAGLE-3's training with the parallel objective."""

    name = PARALLEL_NAME
    options = PEagleOptions

    def start(self, cfg, target, tokenizer, vocabulary, device, autocast, folders) -> PEagleTraining:
        return PEagleTraining(cfg, target, tokenizer, vocabulary, device, autocast, folders)

    def card_usage(self, info, k: int) -> list[str]:
        lines = eagle3_usage(info, k, parallel=True)
        return lines[:3] + [
            "It is a P-EAGLE draft: it proposes a round's k tokens in one forward (the mask token "
            f"`ptd_token_id` {info.kind_facts['ptd_token_id']} and the learned `mask_hidden` at the masked slots), "
            "which vLLM serves as `eagle3` with `parallel_drafting: true` (speculators' layout: a `peagle` "
            "checkpoint, which `vllm serve` runs so by itself). SGLang has no parallel drafting for EAGLE-3: "
            "serve it with vLLM.", ""] + lines[3:]


def eagle3_usage(info, k: int, q=json.dumps, parallel: bool = False) -> list[str]:
    """How vLLM and SGLang (engines layout) or speculators and `vllm serve` (speculators layout) run this draft."""
    draft, target = info.model_ref, info.target_ref
    spec = {"method": info.method, "model": draft, "num_speculative_tokens": k}
    vllm_config = json.dumps(spec | ({"parallel_drafting": True} if parallel else {}))
    ids = info.kind_facts["layer_ids"]
    lines = [
        "## Usage",
        "",
        "An EAGLE-3 draft (Li et al. 2025, arXiv:2503.01840): besides the tokens, its one layer reads the "
        f"target's residual stream after layers {ids} (vLLM's `eagle_aux_hidden_state_layer_ids`; SGLang's "
        f"`eagle_config` numbers the same layers {[i - 1 for i in ids]}), which the serving engine passes to it. "
        "Every flag whose default differs between engines is written out (`norm_before_residual: false`). "
        "transformers' assisted generation does not run EAGLE drafts.",
        "",
        "The draft only changes speed: greedy output is token-identical to the target alone, and sampled "
        "output is distributed as the target's.",
        "",
    ]
    if info.format == "speculators":
        return lines + [
            "This folder is in vLLM speculators' format: `vllm serve` detects it and takes the target from "
            "its config, and `speculators`' `Eagle3DraftModel.from_pretrained` loads it. SGLang does not read "
            "this layout: for SGLang, publish with `format=engines`.",
            "",
            "### vLLM",
            "",
            "```bash",
            f"vllm serve {draft}",
            "```",
            "",
            *vllm_lines(target, vllm_config, q)[:7],
        ]
    return lines + [
        "This folder is in the layout both vLLM and SGLang load (`LlamaForCausalLMEagle3`). Name the method "
        "explicitly: vLLM otherwise guesses it from the folder's name.",
        "",
        "### vLLM",
        "",
        *vllm_lines(target, vllm_config, q),
        "### SGLang",
        "",
        *sglang_lines(target, draft, info.sglang_algorithm, k),
        "",
    ]


