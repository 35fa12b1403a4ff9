"""An EAGLE-3 draft's checkpoint layouts: what a config.json and a model.safetensors hold, written and read.

- engines: the layout vLLM (`"method": "eagle3"`) and SGLang (`--speculative-algorithm EAGLE3`) both load
  (architecture LlamaForCausalLMEagle3, weights under `midlayer.`);
- speculators: vLLM speculators' own layout (speculators 0.9's `Eagle3DraftModel`; `vllm serve DIR` detects it),
  weights under `layers.0.`.

A P-EAGLE draft (parallel drafting) adds its mask token (engines: `ptd_token_id`, with `parallel_drafting: true`;
speculators: `speculators_model_type: peagle`, `mask_token_id`) and the weight `mask_hidden`.

Both store an exact copy of the target's embeddings: vLLM then shares the target's, SGLang overwrites them, and
speculators 0.9 under transformers 5 would otherwise run with uninitialised ones. Reading accepts either layout,
and the checkpoints other tools write in them (`is_eagle3_config`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig

from specdec.hidden_state_draft import FORMATS, WEIGHTS_FILE, write_layout  # noqa: F401  (the formats: read by the kind)

ARCHITECTURE = "LlamaForCausalLMEagle3"  # the name vLLM and SGLang both resolve to their EAGLE-3 Llama draft
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format `format="speculators"` writes
# speculators' model types of this kind: a chain draft, and P-EAGLE (parallel drafting: its `mask_token_id` is the
# engines' `ptd_token_id`, its `mask_hidden` the same weight)
SPECULATORS_TYPES = ("eagle3", "peagle")


def is_eagle3_config(config: dict) -> bool:
    """An EAGLE-3 draft's config.json: speculators' format (`speculators_model_type: eagle3`) or an EAGLE-3
    architecture (the engines' LlamaForCausalLMEagle3, vLLM's Eagle3LlamaForCausalLM, speculators' Eagle3...)."""
    if str(config.get("speculators_model_type", "")).lower() in SPECULATORS_TYPES:
        return True
    return any("eagle3" in str(a).lower() for a in config.get("architectures") or [])


def is_parallel_config(config: dict) -> bool:
    """A P-EAGLE draft's config.json: the engines' `ptd_token_id` or speculators' `peagle` type."""
    return config.get("ptd_token_id") is not None or str(config.get("speculators_model_type", "")).lower() == "peagle"


def engine_config(config: LlamaConfig) -> dict:
    """config.json for vLLM (`method: eagle3`) and SGLang (`EAGLE3`): the draft layer's Llama config plus every
    EAGLE-3 key either engine reads, written out rather than left to defaults that differ between them."""
    out = config.to_dict()
    ids = list(config.eagle_aux_hidden_state_layer_ids)
    rope = dict(out.get("rope_parameters") or {})
    out.update(
        architectures=[ARCHITECTURE], model_type="llama", num_hidden_layers=1, tie_word_embeddings=False,
        draft_vocab_size=config.draft_vocab_size, target_hidden_size=config.target_hidden_size,
        # vLLM reads the top-level ids ("after i layers") before eagle_config's; SGLang reads eagle_config's
        # and counts "output of layer i" (it adds one): the same layers, in each engine's numbering.
        eagle_aux_hidden_state_layer_ids=ids, num_aux_hidden_states=len(ids),
        eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True},
        norm_before_residual=bool(getattr(config, "norm_before_residual", False)), norm_before_fc=False, fc_norm=False,
        norm_output=False,
        # transformers < 5 (which some engine releases pin) read rope_theta / rope_scaling, not rope_parameters
        rope_theta=rope.get("rope_theta", 10000.0),
        rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
    )
    return out


def speculators_config(config: LlamaConfig, dtype: torch.dtype, verifier: str, verifier_architectures: list[str],
                       num_draft_tokens: int) -> dict:
    """config.json in vLLM speculators' format (speculators 0.9's `Eagle3DraftModel`; `vllm serve DIR` detects
    it and serves DIR as the draft of `verifier`). No top-level model_type: vLLM reads it as this format."""
    layer = engine_config(config)
    for key in ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                "num_aux_hidden_states", "eagle_config", "norm_before_residual", "norm_before_fc", "fc_norm",
                "norm_output", "target_num_hidden_layers", "target_architectures", "ptd_token_id",
                "parallel_drafting"):
        layer.pop(key, None)
    ptd = getattr(config, "ptd_token_id", None)
    parallel = {} if ptd is None else {"mask_token_id": int(ptd)}
    return {
        "architectures": ["PEagleSpeculator" if parallel else "Eagle3DraftModel"],
        "speculators_model_type": "peagle" if parallel else "eagle3",
        **parallel,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "peagle" if parallel else "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_draft_tokens),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.eagle_aux_hidden_state_layer_ids),
        # vLLM reading this format defaults norm_before_residual to true, speculators to false: written out.
        "norm_before_residual": bool(getattr(config, "norm_before_residual", False)), "norm_before_fc": False, "fc_norm": False,
        "norm_output": False, "embed_requires_grad": False, "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def write(out_dir: str | Path, config: LlamaConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
          format: str = "engines", speculators: dict | None = None) -> None:
    """config.json + model.safetensors of `state` (the engines' weight names) in `format`; `speculators` =
    `speculators_config`'s verifier arguments (format="speculators" only)."""

    def speculators_layout(state: dict, **verifier) -> tuple[dict, dict]:
        state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
        if "mask_hidden" in state:  # speculators' parameter is [1, 1, W]
            state["mask_hidden"] = state["mask_hidden"].reshape(1, 1, -1)
        return speculators_config(config, dtype, **verifier), state

    write_layout(out_dir, format, speculators, state, config.draft_vocab_size == config.vocab_size,
                 lambda: engine_config(config), speculators_layout)


def read_config(path: str | Path) -> LlamaConfig:
    """The draft layer's config from either layout's config.json, checked for what specdec's decoder computes."""
    raw = json.loads((Path(path) / "config.json").read_text())
    if str(raw.get("speculators_model_type", "")).lower() in SPECULATORS_TYPES:
        layer = dict(raw.get("transformer_layer_config") or {})
        raw = {**layer, **{k: v for k, v in raw.items() if k not in ("transformer_layer_config", "architectures")}}
        if raw.get("speculators_model_type") == "peagle":
            raw["ptd_token_id"], raw["parallel_drafting"] = raw.pop("mask_token_id"), True
    raw.pop("model_type", None)
    # speculators writes null for a target as wide as the draft, and reads null so (issue 30)
    if raw.get("target_hidden_size") is None and raw.get("hidden_size") is not None:
        raw["target_hidden_size"] = raw["hidden_size"]
    config = LlamaConfig(**raw)
    config.architectures = [ARCHITECTURE]
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if getattr(config, key, None) is None:
            raise ValueError(f"{path}/config.json lacks {key}: not an EAGLE-3 draft config")
    config.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if getattr(config, flag, False):
            raise ValueError(f"{path}: {flag}=true EAGLE-3 drafts are not supported by specdec's decoder yet")
    return config


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights of either layout under the engines' names (`midlayer.`)."""
    from safetensors.torch import load_file

    state = load_file(str(Path(path) / WEIGHTS_FILE))
    if "mask_hidden" in state:  # one vector whatever the layout's shape (speculators [1, 1, W], vLLM views it flat)
        state["mask_hidden"] = state["mask_hidden"].reshape(-1)
    return {k.replace("layers.0.", "midlayer."): v for k, v in state.items()}
