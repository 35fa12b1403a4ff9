"""Shared fixtures: seeded tiny random Llama models built from config (no downloads)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(min(2, torch.get_num_threads()))


def tiny_llama(seed: int = 0, vocab_size: int = 128, layers: int = 2, hidden: int = 32,
               dtype: torch.dtype = torch.float64, max_positions: int = 256) -> LlamaForCausalLM:
    """A seeded random LlamaForCausalLM; float64 by default so that argmax ties between batched and
    one-token forwards (different GEMM shapes) cannot flip a greedy token."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    # Random init gives near-uniform logits; a larger head spreads them so decoding is not a coin toss.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def draft():
    return tiny_llama(seed=1, layers=1)


def ragged_prompts(batch: int, vocab: int, seed: int, min_len: int = 3, max_len: int = 9):
    """Left-padded random prompts of different lengths: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g).tolist()
    width = max(lengths)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask
