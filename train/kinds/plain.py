"""The plain kind's training side (train/kinds/base.py: TrainingKind): a causal LM over the target's tokenizer,
derived from the target, from its config (scratch) or pretrained; its options block, its run
(train/plain_train.py), its memory-plan terms (train/kinds/plain_plan.py) and its model card's usage
(transformers' assisted generation, vLLM's draft_model, SGLang's STANDALONE)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from specdec.train.card_engines import sglang_lines, vllm_lines
from specdec.train.kinds.base import KindOptions, TrainingFacts
from specdec.train.kinds.plain_plan import plain_plan
from specdec.train.plain_train import PlainTraining
from specdec.train.plan.kind import KindPlan, PlanContext


@dataclass
class PlainOptions(KindOptions):
    """None of its own: the keys that build it (draft_layers, draft_config) are shared, so that a recipe written
    for a derived draft still runs with another `draft:` value, which ignores them."""


class PlainTrainingKind:
    name = "plain"
    facts = TrainingFacts()
    options = PlainOptions

    def start(self, cfg, target, tokenizer, vocabulary, device, autocast, folders) -> PlainTraining:
        return PlainTraining(cfg, target, tokenizer, vocabulary, device)

    def plan(self, context: PlanContext) -> KindPlan:
        return plain_plan(context)

    def card_usage(self, info, k: int) -> list[str]:
        if info.head == "reduced":
            return ["## Usage", "", "Only specdec can run this export (see the warning above).", ""]
        return token_usage(info, k)


def token_usage(info, k: int, q=json.dumps) -> list[str]:
    """How transformers, vLLM and SGLang run a draft that reads tokens only."""
    draft, target = info.model_ref, info.target_ref
    vllm_config = json.dumps({"model": draft, "method": info.method, "num_speculative_tokens": k})
    return [
        "## Usage",
        "",
        "The draft only changes speed: greedy output is token-identical to the target alone, and sampled "
        "output is distributed as the target's.",
        "",
        "### transformers (assisted generation)",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"tok = AutoTokenizer.from_pretrained({q(target)})",
        f"target = AutoModelForCausalLM.from_pretrained({q(target)})",
        f"draft = AutoModelForCausalLM.from_pretrained({q(draft)})",
        f"draft.generation_config.num_assistant_tokens = {k}",
        'draft.generation_config.num_assistant_tokens_schedule = "constant"',
        'inputs = tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True,',
        '                                 return_tensors="pt", return_dict=True)',
        "out = target.generate(**inputs, assistant_model=draft, do_sample=False, max_new_tokens=128)",
        'print(tok.decode(out[0, inputs["input_ids"].shape[1]:]))',
        "```",
        "",
        "### vLLM (draft-model speculative decoding)",
        "",
        *vllm_lines(target, vllm_config, q),
        "### SGLang (standalone draft model)",
        "",
        *sglang_lines(target, draft, info.sglang_algorithm, k),
        "",
    ]


