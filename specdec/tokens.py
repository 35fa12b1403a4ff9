"""Token-list helpers every stage needs, written once: EOS ids, cutting at EOS, the pad-id fallback, left padding."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def as_id_list(eos_token_id: int | Sequence[int] | None) -> list[int]:
    """An EOS setting (None, one id or several) as a list of ids."""
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(i) for i in eos_token_id]


def eos_ids(model, tokenizer) -> list[int]:
    """Every id that ends a turn: the model's generation config's eos ids and the tokenizer's."""
    gen = getattr(model, "generation_config", None)
    ids = as_id_list(getattr(gen, "eos_token_id", None)) + as_id_list(tokenizer.eos_token_id)
    return sorted(set(ids))


def pad_id(pad_token_id: int | None, eos_token_id: int | Sequence[int] | None = None) -> int:
    """The pad id: the tokenizer's, else the (first) EOS, else 0 (padding is masked or cut, never read)."""
    if pad_token_id is not None:
        return int(pad_token_id)
    eos = as_id_list(eos_token_id)
    return eos[0] if eos else 0


def tokenizer_pad_id(tokenizer) -> int:
    """`pad_id` of a tokenizer."""
    return pad_id(tokenizer.pad_token_id, tokenizer.eos_token_id)


def generated_length(tokens: Sequence[int], eos_token_id: int | Sequence[int] | None) -> int:
    """Real generated tokens: up to and including the first EOS (the rest is padding)."""
    eos = set(as_id_list(eos_token_id))
    for i, token in enumerate(tokens):
        if token in eos:
            return i + 1
    return len(tokens)


def cut_at_eos(tokens: Sequence[int], eos_token_id: int | Sequence[int] | None) -> list[int]:
    """Tokens up to and including the first EOS."""
    return list(tokens[: generated_length(tokens, eos_token_id)])


def left_pad(rows: Sequence[Sequence[int]], pad: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input_ids and attention_mask [B, L] for token lists of any lengths."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)
