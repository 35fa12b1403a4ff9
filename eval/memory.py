"""The draft's memory as accounted bytes: what serving it adds to target-only decoding, counted from its tensors and
its config, so the same draft at the same settings gives the same figure in every run.

The process's peak RSS (or CUDA peak) moves by tens of MB between runs of the same draft (allocator state, the CPU
fast path's kernel choices), so the memory gate reads this figure instead; eval keeps the measured one beside it.
Accounted, in bytes:

    weights      the draft's parameters and buffers, each storage once, less the storages the target holds (an
                 EAGLE-3 draft's embed_tokens, a head tied to shared embeddings)
    copies       the reordered weight copies specdec/fast_linear.py may make for the draft's layers: counted for
                 every layer that may run on one, since which layers keep theirs is measured in each run
    kv_cache     layers x 2 x kv_heads x head_dim x positions x batch x dtype bytes, at the run's longest prompt
                 + max_new_tokens + the round's proposals (the draft caches them before rollback)
    states       an EAGLE-3 draft: the target's hidden states its drafter holds after the prompt, twice (the
                 recorder's layer outputs and the drafter's window of them, concatenated)

The target-only side (the base of the gate's allowance) is the target's weights and its KV cache at the same
prompt, max_new_tokens and batch.
"""

from __future__ import annotations

import torch

from specdec import fast_linear

MB = 2**20


def _tensors(model) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()] if model is not None else []


def _storage_key(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr()


def weights_bytes(model, shared_with=None) -> int:
    """Bytes of `model`'s parameters and buffers, each storage once (tied weights share one), leaving out the
    storages `shared_with` also holds."""
    skip = {_storage_key(t) for t in _tensors(shared_with)}
    storages = {}
    for t in _tensors(model):
        key = _storage_key(t)
        if key not in skip:
            storages[key] = t.untyped_storage().nbytes()
    return sum(storages.values())


def copies_bytes(model, shared_with=None) -> int:
    """Bytes of the reordered weight copies specdec/fast_linear.py may make for `model`'s layers (one per weight,
    shared with `shared_with`'s copy when the weight is). Whether a layer keeps its copy depends on kernel timings
    taken in each run; counting every layer that can have one keeps the figure the same from run to run."""
    if not (fast_linear._enabled() and fast_linear._packing_available()):
        return 0
    skip = {_storage_key(t) for t in _tensors(shared_with)}
    weights = {}
    for layer in model.modules():
        w = getattr(layer, "weight", None)
        # fast_linear's layers: plain nn.Linear on the CPU; only float32 ones get a reordered copy
        if type(layer) is torch.nn.Linear and w.device.type == "cpu" and w.dtype == torch.float32:
            if _storage_key(w) not in skip:
                weights[_storage_key(w)] = w.numel() * w.element_size()
    return sum(weights.values())


def _dtype_bytes(model) -> int:
    return next(p for p in model.parameters() if p.is_floating_point()).element_size()


def kv_cache_bytes(config, positions: int, batch: int, dtype_bytes: int) -> int:
    """layers x 2 (keys, values) x kv_heads x head_dim x positions x batch x dtype bytes, from a model's config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers * 2 * kv_heads * head_dim * positions * batch * dtype_bytes


def states_bytes(draft_config, prompt_length: int, batch: int, dtype_bytes: int) -> int:
    """An EAGLE-3 drafter's copies of the target's hidden states after the prompt (0 for other drafts): the
    recorder keeps each auxiliary layer's output and the drafter concatenates them, [B, L, n_aux x H] twice."""
    layer_ids = getattr(draft_config, "eagle_aux_hidden_state_layer_ids", None)
    if not layer_ids:
        return 0
    return 2 * batch * prompt_length * len(layer_ids) * draft_config.target_hidden_size * dtype_bytes


def draft_overhead(draft, target, prompt_length: int, max_new_tokens: int, proposed: int, batch: int) -> dict:
    """What serving `draft` beside `target` adds, in bytes per item and in total, for prompts of up to
    `prompt_length` tokens, `max_new_tokens`, `proposed` draft tokens cached per round and `batch` rows."""
    positions = prompt_length + max_new_tokens + proposed
    items = {
        "weights": weights_bytes(draft, shared_with=target),
        "copies": copies_bytes(draft, shared_with=target),
        "kv_cache": kv_cache_bytes(draft.config, positions, batch, _dtype_bytes(draft)),
        "states": states_bytes(draft.config, prompt_length, batch, _dtype_bytes(target)),
    }
    return {**items, "total": sum(items.values()), "positions": positions, "batch_size": batch}


def target_only(target, prompt_length: int, max_new_tokens: int, batch: int) -> dict:
    """What target-only decoding holds at the same settings, in bytes: its weights and its KV cache."""
    positions = prompt_length + max_new_tokens
    items = {"weights": weights_bytes(target),
             "kv_cache": kv_cache_bytes(target.config, positions, batch, _dtype_bytes(target))}
    return {**items, "total": sum(items.values()), "positions": positions, "batch_size": batch}
