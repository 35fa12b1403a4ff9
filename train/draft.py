"""Draft construction: pretrained small model, derived from the target, or a fresh config; optional reduced head.

    derived     the target's embeddings, a chosen list of its layers (e.g. [0, 1, 29]), final norm and head,
                in a config with fewer layers: still a plain transformers model (save/from_pretrained work)
    scratch     the target's config with overrides (e.g. {num_hidden_layers: 2}), random layers, target
                embeddings / final norm / head copied (hidden sizes must match)
    otherwise   a Hub id or local path of a pretrained small model with the target's tokenizer

(A registered draft kind's name, such as eagle3, is built by that kind: train/kinds/.)

A reduced vocabulary keeps the N most frequent target tokens of the distillation completions
(`specdec.vocab.apply_reduced_head`; the id map is saved by `specdec.models.save_model`).
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterable, Sequence

import torch
from transformers import AutoModelForCausalLM

from specdec import vocab as vocab_lib
from specdec.models import load_model

log = logging.getLogger(__name__)

DERIVED = "derived"
SCRATCH = "scratch"
_LAYER_KEY = re.compile(r"^(.*\.layers\.)(\d+)\.(.*)$")
DEFAULT_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _resolve_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    out = [int(i) + num_layers if int(i) < 0 else int(i) for i in layers]
    if not out or any(not 0 <= i < num_layers for i in out):
        raise ValueError(f"draft_layers {list(layers)} must be a non-empty list of layer indices of the target "
                         f"(0..{num_layers - 1}, negatives count from the end), e.g. [0, 1, {num_layers - 1}]")
    if len(set(out)) != len(out):
        raise ValueError(f"draft_layers {list(layers)} repeats a layer; list each target layer once")
    return out


def _subset_layer_config(config, chosen: list[int]):
    config = copy.deepcopy(config)
    config.num_hidden_layers = len(chosen)
    # Models with per-layer attention kinds (sliding/full) list them in layer_types: keep the chosen ones.
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in chosen]
    return config


def derive_draft(target: torch.nn.Module, layers: Sequence[int]) -> torch.nn.Module:
    """A smaller copy of `target` keeping `layers` (+ embeddings, final norm, head), float32, train-ready."""

    num_layers = target.config.num_hidden_layers
    chosen = _resolve_layers(layers, num_layers)
    config = _subset_layer_config(target.config, chosen)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    new_index = {src: dst for dst, src in enumerate(chosen)}
    state = {}
    for key, value in target.state_dict().items():
        m = _LAYER_KEY.match(key)
        if m is None:
            state[key] = value
        elif int(m[2]) in new_index:
            state[f"{m[1]}{new_index[int(m[2])]}.{m[3]}"] = value
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if unexpected or (missing and missing != ["lm_head.weight"]):
        raise ValueError(f"could not derive a draft from {type(target).__name__}: missing {missing}, unexpected "
                         f"{unexpected}; use draft=<pretrained path> or draft=scratch instead")
    if missing:  # a tied head absent from the state dict: re-tie it explicitly
        model.tie_weights()
    model.generation_config = copy.deepcopy(target.generation_config)
    log.info("derived a %d-layer draft from target layers %s", len(chosen), chosen)
    return model


def draft_from_config(target: torch.nn.Module, overrides: dict, seed: int = 0) -> torch.nn.Module:
    """The target's config with `overrides`, random layers, target embeddings / norm / head copied."""

    config = copy.deepcopy(target.config)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"draft_config key {key!r} is not a field of {type(config).__name__}")
        setattr(config, key, value)
    if getattr(config, "layer_types", None) and "layer_types" not in overrides:
        config.layer_types = (list(config.layer_types) * config.num_hidden_layers)[: config.num_hidden_layers]
    if config.hidden_size != target.config.hidden_size:
        raise ValueError(f"draft_config hidden_size {config.hidden_size} differs from the target's "
                         f"{target.config.hidden_size}: the target's embeddings cannot be copied; keep hidden_size")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
        if not config.tie_word_embeddings:
            model.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight)
        t_norm, d_norm = getattr(target.base_model, "norm", None), getattr(model.base_model, "norm", None)
        if t_norm is not None and d_norm is not None:
            d_norm.load_state_dict(t_norm.state_dict())
    model.generation_config = copy.deepcopy(target.generation_config)
    return model


def completion_token_counts(rows: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """How often each target id appears among completion tokens (after `prompt_length`).  -> [vocab_size]"""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        ids = torch.as_tensor(row["input_ids"][row["prompt_length"]:], dtype=torch.long)
        if ids.numel():
            counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def kept_share(counts: torch.Tensor, keep_ids) -> float | None:
    """The share of the counted tokens among `keep_ids` (None when nothing was counted)."""
    total = float(counts.sum())
    return float(counts[torch.as_tensor(keep_ids, dtype=torch.long)].sum()) / total if total else None


def completion_coverage(rows: Iterable[dict], keep_ids, vocab_size: int) -> float | None:
    """The share of `rows`' completion tokens among `keep_ids` (None without any): a reduced head never proposes
    the rest, so on held-out rows it is the most first-proposal agreement the head can reach."""
    return kept_share(completion_token_counts(rows, vocab_size), keep_ids)


def select_vocab(counts: torch.Tensor, size: int, always_keep: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent ids (ties -> lower id), always including `always_keep`; sorted ascending."""
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab} (0 = full vocabulary), got {size}")
    forced = sorted({int(i) for i in always_keep if i is not None and 0 <= int(i) < vocab})
    # Stable sort on -count keeps lower ids first among equal counts: deterministic across runs and ranks.
    order = torch.sort(-counts, stable=True).indices.tolist()
    keep = list(forced)
    seen = set(forced)
    for i in order:
        if len(keep) >= size:
            break
        if i not in seen:
            keep.append(i)
            seen.add(i)
    return torch.tensor(sorted(keep[:size]), dtype=torch.long)


def kept_vocab_size(cfg, target_vocab: int) -> int:
    """The reduced head's size for a TrainConfig over `target_vocab` ids, 0 = the full vocabulary:
    `draft_vocab_size` where set (>= 0); auto (-1): the draft kind's default over a larger vocabulary (an EAGLE-3
    draft keeps 32,000 ids, the peers' setting), else the full one."""
    if cfg.draft_vocab_size >= 0:
        return cfg.draft_vocab_size
    default = cfg.kind.facts.default_vocab_size  # train/kinds/base.py: TrainingFacts
    return default if default and target_vocab > default else 0


def frequent_ids(train_ds, size: int, vocab_size: int, always_keep: Iterable[int] = ()) -> torch.Tensor:
    """The `size` target ids most frequent among the training completions (a reduced draft head's ids)."""
    counts = completion_token_counts(train_ds.select_columns(["input_ids", "prompt_length"]), vocab_size)
    keep = select_vocab(counts, size, always_keep)
    log.info("reduced draft head: %d ids cover %.1f%% of completion tokens", keep.numel(),
             100 * (kept_share(counts, keep) or 0.0))
    return keep


def reduce_vocab(model: torch.nn.Module, keep_ids: torch.Tensor) -> torch.nn.Module:
    """Give `model` a head over `keep_ids` only (target ids); see specdec.vocab."""
    return vocab_lib.apply_reduced_head(model, keep_ids)


def build_draft(spec: str, target: torch.nn.Module | None, layers: Sequence[int] = (0, -1),
                config_overrides: dict | None = None, seed: int = 0, device: str | torch.device = "cpu"):
    """Build the draft named by `spec` (derived / scratch / pretrained path or Hub id), float32."""
    if spec in (DERIVED, SCRATCH):
        if target is None:
            raise ValueError(f"draft={spec} needs the target's weights; load the target first")
        model = derive_draft(target, layers) if spec == DERIVED else draft_from_config(target, config_overrides or {},
                                                                                      seed)
        return model.to(device)

    return load_model(spec, dtype=torch.float32, device=device).train()


def add_lora(model: torch.nn.Module, r: int, alpha: int, dropout: float,
             target_modules: Sequence[str] = DEFAULT_LORA_MODULES):
    """Wrap `model` with LoRA adapters (peft); a reduced head is trained fully (it is new)."""
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    modules = [m for m in target_modules if m in present]
    if not modules:
        raise ValueError(f"none of lora_target_modules {list(target_modules)} exist in the draft; "
                         f"pick from {sorted(present)[:20]}")
    save = ["lm_head"] if vocab_lib.draft_to_target_map(model) is not None else None
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules,
                        modules_to_save=save, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """A plain transformers model: LoRA adapters merged into a copy (the model itself is untouched)."""
    if not hasattr(model, "merge_and_unload"):
        return model
    base = copy.deepcopy(model).merge_and_unload()
    id_map = vocab_lib.draft_to_target_map(model.get_base_model())
    if id_map is not None and vocab_lib.draft_to_target_map(base) is None:
        base.register_buffer("draft_to_target", id_map.clone(), persistent=False)
    return base
