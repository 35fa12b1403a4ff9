"""The plain draft kind: any causal LM over the target's tokenizer, drafting from tokens alone (served as vLLM's
`draft_model`, SGLang's STANDALONE, transformers' `assistant_model`). It is the registry's fallback: a checkpoint or
model no other kind recognises is plain. Trained by train/plain_train.py (derived, scratch or pretrained drafts)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec import vocab
from specdec.draft_kind import PublishContext
from specdec.drafter import PlainDrafter
from specdec.ranks import teacher_forced_ranks


def declared_reduced_vocab(path: str) -> int | None:
    """The reduced head's size a local checkpoint declares (specdec's id-map format), else None."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    return json.loads(config_file.read_text()).get(vocab.CONFIG_KEY)


def load_reduced(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """A causal LM with a reduced-vocabulary head and its id map (specdec/vocab.py)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    vocab.apply_reduced_head(model, vocab.load_vocab_map(path))
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        if file.name != vocab.VOCAB_MAP_FILE:
            state.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.endswith("rotary_emb.inv_freq")]:
        raise ValueError(f"{path}: checkpoint does not match its config (missing {missing}, unexpected {unexpected})")
    return model


class PlainKind:
    """The plain draft kind (specdec/draft_kind.py's interface)."""

    name = "plain"
    vllm_method = "draft_model"
    sglang_algorithm = "STANDALONE"
    formats = ("engines",)  # a transformers checkpoint (with specdec's id map when its head is reduced)
    maps_vocabulary = False  # only specdec reads the id map: stock engines need the expanded head

    def recognises(self, config: dict) -> bool:
        return True

    def owns(self, model) -> bool:
        return True

    def needs_snapshot(self, config: dict) -> bool:
        return vocab.CONFIG_KEY in config  # AutoModelForCausalLM cannot load the smaller head

    def load(self, path: str, dtype: torch.dtype) -> torch.nn.Module:
        if declared_reduced_vocab(path) is not None:
            return load_reduced(path, dtype)
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)

    def save(self, model, out_dir, format: str = "", context: PublishContext | None = None,
             state_dict: dict | None = None) -> None:
        model.save_pretrained(out_dir, **({} if state_dict is None else {"state_dict": state_dict}))
        vocab.save_vocab_map(model, out_dir)

    def drafter(self, draft, target, sampling) -> PlainDrafter:
        return PlainDrafter(draft, target, sampling)

    def target_states(self, draft, target, input_ids, attention_mask) -> None:
        return None

    def replay_ranks(self, draft, input_ids, attention_mask, loss_mask, steps: int, states=None):
        return teacher_forced_ranks(draft, input_ids, attention_mask, loss_mask, steps)

    def draft_forwards(self, proposal) -> int:
        return proposal.depth  # one token a forward (a tree: one forward a level)

    def card_facts(self, model) -> dict:
        return {}
