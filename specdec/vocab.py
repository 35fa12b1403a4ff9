"""Reduced-vocabulary draft heads (as in EAGLE-3 and FR-Spec).

A reduced draft keeps its full input embedding (prompts use every target token) but its LM head scores only
N kept target ids. `draft_to_target[i]` is the target id of draft logit i. The decoder maps q into the target
vocabulary with q(x) = 0 outside the kept ids, which keeps speculative decoding exact (docs/design.md rule 4).

On disk the checkpoint is a plain transformers checkpoint whose `lm_head.weight` has N rows, plus
`draft_vocab.safetensors` holding `draft_to_target`, and `config.specdec_draft_vocab_size = N`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

VOCAB_MAP_FILE = "draft_vocab.safetensors"
CONFIG_KEY = "specdec_draft_vocab_size"


def draft_to_target_map(model: torch.nn.Module) -> torch.Tensor | None:
    """The draft's id map [N] (draft logit index -> target id), or None for a full-vocabulary head."""
    return getattr(model, "draft_to_target", None)


def apply_reduced_head(model: torch.nn.Module, keep_ids: torch.Tensor) -> torch.nn.Module:
    """Replace `model`'s LM head by one over `keep_ids` (target ids), copying those rows; returns the model."""
    keep_ids = torch.as_tensor(keep_ids, dtype=torch.long).flatten()
    vocab = model.get_input_embeddings().num_embeddings
    if keep_ids.numel() == 0 or int(keep_ids.min()) < 0 or int(keep_ids.max()) >= vocab:
        raise ValueError(f"reduced vocabulary ids must be non-empty and within [0, {vocab}); got {keep_ids.numel()} ids")
    if torch.unique(keep_ids).numel() != keep_ids.numel():
        raise ValueError("reduced vocabulary ids must be distinct")
    old = model.get_output_embeddings()
    new = torch.nn.Linear(old.in_features, keep_ids.numel(), bias=old.bias is not None)
    new = new.to(device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(old.weight[keep_ids.to(old.weight.device)])
        if old.bias is not None:
            new.bias.copy_(old.bias[keep_ids.to(old.bias.device)])
    # The reduced head can no longer share its weight with the input embedding.
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    model.set_output_embeddings(new)
    setattr(model.config, CONFIG_KEY, int(keep_ids.numel()))
    model.register_buffer("draft_to_target", keep_ids.to(old.weight.device), persistent=False)
    return model


def save_vocab_map(model: torch.nn.Module, out_dir: str | Path) -> None:
    """Write the id map beside a saved reduced-vocabulary checkpoint (no-op for a full head, and for drafts whose
    own format stores the map, such as EAGLE-3's d2t)."""
    ids = draft_to_target_map(model)
    if ids is not None and getattr(model.config, CONFIG_KEY, None):
        save_file({"draft_to_target": ids.detach().cpu().contiguous()}, str(Path(out_dir) / VOCAB_MAP_FILE))


def load_vocab_map(path: str | Path) -> torch.Tensor:
    """Read `draft_to_target` from a checkpoint folder."""
    file = Path(path) / VOCAB_MAP_FILE
    if not file.is_file():
        raise ValueError(f"{path} declares a reduced vocabulary but has no {VOCAB_MAP_FILE}; re-export the draft")
    return load_file(str(file))["draft_to_target"].long()
