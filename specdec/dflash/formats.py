"""A DFlash draft's checkpoint layouts: what a config.json and a model.safetensors hold, written and read.

- engines (default): the layout vLLM 0.32 loads with `"method": "dflash"` (architecture `DFlashDraftModel`, a
  Qwen3 config with `block_size`, `draft_vocab_size`, `target_hidden_size` and `dflash_config` =
  {mask_token_id, target_layer_ids}; weights `fc`, `hidden_norm`, `layers.N.*`, `norm`, `lm_head`, `d2t`), the
  layout z-lab publishes its DFlash drafts in;
- speculators: vLLM speculators 0.9's `dflash` format (`speculators_model_type: dflash`, the layer config under
  `transformer_layer_config`, `aux_hidden_state_layer_ids`, the verifier named), read by speculators'
  `DFlashDraftModel` and detected by `vllm serve DIR`.

Layer ids: specdec counts "after i of the target's layers" (as for EAGLE-3), and so does speculators'
`aux_hidden_state_layer_ids`; vLLM's `dflash_config.target_layer_ids` counts "the output of layer i", one less
(vLLM adds one when it reads them, and subtracts one converting speculators' config).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen3Config

from specdec.hidden_state_draft import FORMATS, WEIGHTS_FILE, write_layout  # noqa: F401  (the formats: read by the kind)

ARCHITECTURE = "DFlashDraftModel"  # vLLM's registry resolves it to qwen3_dflash's DFlashQwen3ForCausalLM
SPECULATORS_ARCHITECTURE = "DFlashSpeculator"
SPECULATORS_VERSION = "0.9.0"
_OWN_KEYS = ("architectures", "draft_vocab_size", "target_hidden_size", "num_target_layers", "target_architectures",
             "block_size", "dflash_layer_ids", "mask_token_id", "dflash_config")


def is_dflash_config(config: dict) -> bool:
    """A DFlash draft's config.json: speculators' format or vLLM's DFlash architecture."""
    if str(config.get("speculators_model_type", "")).lower() == "dflash":
        return True
    return ARCHITECTURE in (config.get("architectures") or [])


def engine_config(config: Qwen3Config) -> dict:
    out = config.to_dict()
    for key in ("dflash_layer_ids", "mask_token_id"):
        out.pop(key, None)
    out.update(architectures=[ARCHITECTURE], model_type="qwen3", tie_word_embeddings=False,
               dflash_config={"mask_token_id": int(config.mask_token_id),
                              "target_layer_ids": [i - 1 for i in config.dflash_layer_ids]})
    return out


def speculators_config(config: Qwen3Config, dtype: torch.dtype, verifier: str, verifier_architectures: list[str],
                       num_draft_tokens: int) -> dict:
    """config.json in speculators 0.9's `dflash` format (its DFlashSpeculatorConfig's fields)."""
    layer = engine_config(config)
    for key in _OWN_KEYS:
        layer.pop(key, None)
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "dflash", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_draft_tokens),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": int(config.draft_vocab_size),
        "block_size": int(config.block_size),
        "target_hidden_size": int(config.target_hidden_size),
        "aux_hidden_state_layer_ids": list(config.dflash_layer_ids),
        "mask_token_id": int(config.mask_token_id),
        "sample_from_anchor": False,  # the anchor is the accepted token; the mask slots propose
        # vLLM turns false into causal attention inside the block (dflash_config.causal); the draft has no
        # sliding-window layers, whose mask is all this flag sets in speculators
        "sliding_window_non_causal": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def write(out_dir: str | Path, config: Qwen3Config, state: dict[str, torch.Tensor], dtype: torch.dtype,
          format: str = "engines", speculators: dict | None = None) -> None:
    """config.json + model.safetensors of `state` in `format`; `speculators` = `speculators_config`'s verifier
    arguments (format="speculators" only)."""
    write_layout(out_dir, format, speculators, state, config.draft_vocab_size == config.vocab_size,
                 lambda: engine_config(config),
                 lambda state, **verifier: (speculators_config(config, dtype, **verifier), state))


def read_config(path: str | Path) -> Qwen3Config:
    """The draft's config from either layout's config.json (layer ids in specdec's numbering)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    if str(raw.get("speculators_model_type", "")).lower() == "dflash":
        layer = dict(raw.get("transformer_layer_config") or {})
        ids = [i - 1 for i in raw.get("aux_hidden_state_layer_ids") or []] or None
        mask = raw.get("mask_token_id")
        raw = {**layer, **{k: v for k, v in raw.items() if k in ("draft_vocab_size", "block_size",
                                                                  "target_hidden_size")}}
    else:
        ids = (raw.get("dflash_config") or {}).get("target_layer_ids")
        mask = (raw.get("dflash_config") or {}).get("mask_token_id", raw.get("mask_token_id"))
    if ids is None or mask is None or raw.get("block_size") is None:
        raise ValueError(f"{path}/config.json lacks the DFlash layer ids, mask_token_id or block_size: not a "
                         f"DFlash draft config")
    for key in ("model_type", "architectures", "dflash_config", "mask_token_id"):
        raw.pop(key, None)
    raw.setdefault("draft_vocab_size", raw.get("vocab_size"))
    if raw.get("target_hidden_size") is None:
        raw["target_hidden_size"] = raw.get("hidden_size")
    config = Qwen3Config(**raw)
    config.architectures = [ARCHITECTURE]
    config.dflash_layer_ids = [int(i) + 1 for i in ids]
    config.mask_token_id = int(mask)
    if any(t == "sliding_attention" for t in getattr(config, "layer_types", None) or []) \
            and getattr(config, "use_sliding_window", False):
        raise ValueError(f"{path}: DFlash drafts with sliding-window layers are not supported by specdec's decoder")
    return config


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / WEIGHTS_FILE))
