"""The target's config without weights, the widths the formulas read, and parameter counts of modules built on
the meta device (so they follow the code exactly)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec import models
from specdec.models import is_embedded


def config_from_dict(values: dict):
    """A transformers config from a plain dict with `model_type` (a config.json's content)."""
    from transformers import CONFIG_MAPPING

    values = dict(values)
    kind = values.pop("model_type", None)
    if kind not in CONFIG_MAPPING:
        raise ValueError(f"the target config needs a model_type transformers knows (llama, qwen3, ...), got {kind!r}")
    return CONFIG_MAPPING[kind](**values)


def target_config(target: str, override: str | dict | None = None, convert_embedded: bool = False):
    """The target's transformers config: `override` (a dict, inline JSON or a config.json path) when given, else
    from the target's folder or Hub id; the embedded target's from its cache or its GGUF file's metadata (or
    converted once with `convert_embedded`, as a run does anyway)."""
    from transformers import AutoConfig

    if override:
        if isinstance(override, dict):
            return config_from_dict(override)
        text = override.strip()
        if not text.startswith("{"):
            path = Path(text)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ValueError(f"target_config {override!r}: neither inline JSON nor a config.json file")
            text = path.read_text()
        return config_from_dict(json.loads(text))
    if is_embedded(target):
        cache = models.cache_root() / "smollm2-135m-instruct"
        if convert_embedded or (cache / "config.json").is_file():
            return AutoConfig.from_pretrained(models.embedded_checkpoint())
        return AutoConfig.from_pretrained(models._gguf_dir(), gguf_file=models._GGUF_FILE)
    try:
        return AutoConfig.from_pretrained(target)
    except (OSError, ValueError) as err:
        raise ValueError(f"could not read the config of target {target!r} ({err}); pass its config instead: "
                         "--target-config config.json (or inline JSON with model_type, hidden_size, ...)") from err


def text_config(config):
    """The text model's config (a multimodal config's text part)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class Widths:
    """The sizes of a decoder stack that the formulas read."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config) -> Widths:
        text = text_config(config)
        heads = text.num_attention_heads
        return cls(hidden=text.hidden_size, layers=text.num_hidden_layers, heads=heads,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                   intermediate=text.intermediate_size, vocab=text.vocab_size)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim


def meta_counts(module: torch.nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts, each storage once (tied weights)."""
    seen, trainable, frozen = set(), 0, 0
    for p in module.parameters():
        key = id(p)
        if key in seen:
            continue
        seen.add(key)
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen


def on_meta(build):
    """`build()` on the meta device: shapes and requires_grad, no memory."""
    with torch.device("meta"):
        return build()


def target_parameters(config) -> int:
    """The target's parameter count, from its module built on the meta device."""
    from transformers import AutoModelForCausalLM

    return sum(meta_counts(on_meta(lambda: AutoModelForCausalLM.from_config(config))))


# ---- activations -----------------------------------------------------------------------------------------
