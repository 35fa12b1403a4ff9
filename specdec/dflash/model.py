"""DFlash drafts (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv:2602.06036),
computed as vLLM 0.32's `DFlashQwen3ForCausalLM` (vllm/model_executor/models/qwen3_dflash.py) computes them.

A DFlash draft proposes a whole block in one forward. Its queries are a block of positions: the last accepted
token (the anchor) at its own position, then mask tokens at the next positions; each mask slot's logits propose
the token at its position. Its context is the target's hidden states at every position before the anchor, read
after several of the target's layers and fused by one projection:

    c            = hidden_norm(fc(cat(a_1, .., a_m)))        a_i: the residual stream after layer id i
    per layer    keys/values = [k_norm(k_proj(c)), v_proj(c)]  (context, rotary at its own positions)
                             + the block's own keys/values   (input_layernorm'd slots, no causal mask in the block)
                 x = x + o_proj(attn(q_norm(q_proj(input_layernorm(x))), keys, values))
                 x = x + mlp(post_attention_layernorm(x))
    logits       = lm_head(norm(x))                          draft id i is target id i + d2t[i]

Its decoder layers are Qwen3's (q_norm and k_norm), whatever the target's architecture, as both peers build them.
The embeddings and the head are the target's (the head's rows of the kept ids), frozen. The context's keys and
values depend on the target's states alone, never on the block: the decoder caches them and feeds the block only.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.llama.modeling_llama import repeat_kv
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from specdec.dflash import formats
from specdec.eagle3.model import check_layer_ids, positions_in_documents
from specdec.hidden_state_draft import (
    EMBEDDINGS,
    HEAD,
    HiddenStateDraft,
    mark_target,
    target_text,
    text_config_kwargs,
)

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per draft layer: keys, values [B, kv_heads, n, head_dim]


def default_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """`count` ids spread evenly from after layer 2 to after layer N - 2 (z-lab's and speculators' default reads
    5 layers from the second to the third-last), distinct; fewer when the target is too shallow."""
    low, high = 2, max(2, num_layers - 2)
    if num_layers < 4:
        raise ValueError(f"a {num_layers}-layer target is too shallow for the default DFlash layers: name them "
                         f"with dflash_layer_ids (distinct ids in 1..{num_layers - 1})")
    ids = sorted({round(low + (high - low) * i / max(1, count - 1)) for i in range(count)})
    return check_layer_ids(ids, num_layers, "dflash_layer_ids")


def draft_config(target_config, layer_ids: list[int], draft_vocab_size: int, num_layers: int, block_size: int,
                 mask_token_id: int) -> Qwen3Config:
    """The draft's Qwen3 config from the target's widths, with the keys vLLM's DFlash loader reads."""
    text = target_text(target_config)
    config = Qwen3Config(**text_config_kwargs(target_config), num_hidden_layers=int(num_layers),
                         use_sliding_window=False)
    mark_target(config, target_config, formats.ARCHITECTURE, draft_vocab_size)
    config.num_target_layers = text.num_hidden_layers
    config.block_size = int(block_size)
    config.dflash_layer_ids = list(layer_ids)  # specdec's numbering (after i layers); formats.py converts
    config.mask_token_id = int(mask_token_id)
    return config


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer whose keys and values also cover the projected target context."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.input_layernorm = Qwen3RMSNorm(hidden, eps)
        self.post_attention_layernorm = Qwen3RMSNorm(hidden, eps)
        attn = self.self_attn = nn.Module()
        attn.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        attn.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        attn.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        attn.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        attn.q_norm = Qwen3RMSNorm(self.head_dim, eps)
        attn.k_norm = Qwen3RMSNorm(self.head_dim, eps)
        self.mlp = Qwen3MLP(config)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated, normed keys and values of already-normed inputs x [B, n, H].  [B, kv_heads, n, d] each"""
        b, n, _ = x.shape
        attn = self.self_attn
        k = attn.k_norm(attn.k_proj(x).view(b, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = attn.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        return k * cos + _rotate_half(k) * sin, v

    def forward(self, x: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor], cos, sin,
                allowed: AnchoredMask, group: int | None = None) -> torch.Tensor:
        """The block's slots x [B, q, H] after this layer; `allowed` says which context keys and slots each slot
        attends to. With `group`, the slots attend in groups of that many, each to the context and its own group's
        slots: exact when no slot attends to a slot of another group (whole blocks per group, `attention_group`)."""
        b, n, _ = x.shape
        attn = self.self_attn
        h = self.input_layernorm(x)
        q = attn.q_norm(attn.q_proj(h).view(b, n, self.heads, self.head_dim)).transpose(1, 2)
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k, v = self.keys_values(h, cos, sin)
        step = group or n
        if step >= n:
            out = self.attend(q, *context, k, v, allowed.dense())
        else:  # each group's keys copy the context's, and its mask is built for it alone: both recomputed in
            parts = []  # backward, so a group keeps neither, only the compact mask that every group shares
            for start in range(0, n, step):
                own = slice(start, start + step)
                args = (q[:, :, own], *context, k[:, :, own], v[:, :, own], allowed, start, min(start + step, n))
                parts.append(checkpoint(self.attend_group, *args, use_reentrant=False) if torch.is_grad_enabled()
                             else self.attend_group(*args))
            out = torch.cat(parts, dim=2)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def attend_group(self, q, context_k, context_v, k, v, allowed: AnchoredMask, start: int, stop: int):
        """Slots start .. stop - 1 (q, k, v theirs alone) attending as `allowed` says."""
        return self.attend(q, context_k, context_v, k, v, allowed.dense(start, stop))

    def attend(self, q, context_k, context_v, k, v, mask) -> torch.Tensor:
        """Slots q attending to the context's keys and values, then to slots' k and v, as `mask` allows."""
        rep = self.heads // self.kv_heads
        keys, values = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
        return F.scaled_dot_product_attention(q, repeat_kv(keys, rep), repeat_kv(values, rep), attn_mask=mask)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class DFlashDraft(HiddenStateDraft):
    """A DFlash draft over a target (see the module docstring); `draft_to_target` maps its logits to target ids."""

    label = "DFlash"
    retrain = ("a DFlash draft serves only the target it was trained for: pass that target, or train a DFlash "
               "draft for this one (draft: dflash in a recipe)")
    target_parts = (EMBEDDINGS, HEAD)  # vLLM's DFlash loader takes both from the target when a checkpoint has none
    formats = formats

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.layer_ids = list(config.dflash_layer_ids)
        self.block_size = int(config.block_size)
        self.mask_token_id = int(config.mask_token_id)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)  # the target's, frozen
        self.fc = nn.Linear(len(self.layer_ids) * config.target_hidden_size, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.register_vocabulary(config)

    # ---- the computation
    def context(self, states: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Each layer's keys and values of the target's states [B, n, m H_target] at `positions` [B, n]."""
        c = self.hidden_norm(self.fc(states.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(c, positions)
        return [layer.keys_values(c, cos, sin) for layer in self.layers]

    def block(self, ids: torch.Tensor, positions: torch.Tensor, context: ContextKV,
              allowed: AnchoredMask, head: bool = True, group: int | None = None) -> torch.Tensor:
        """Logits [B, q, draft_vocab] of block slots `ids` [B, q] at `positions` [B, q] (the final norm's output
        [B, q, H] without `head`); `allowed` says which context keys and slots each slot attends to; `group`:
        DFlashLayer.forward's."""
        x = self.embed_tokens(ids)
        cos, sin = self.rotary_emb(x, positions)
        for layer, kv in zip(self.layers, context):
            x = layer(x, kv, cos, sin, allowed, group)
        return self.lm_head(self.norm(x)) if head else self.norm(x)

    def forward(self, input_ids: torch.Tensor, states: torch.Tensor, anchors: torch.Tensor,
                attention_mask: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                block_size: int | None = None, head: bool = True) -> torch.Tensor:
        """Training's and the replay's forward: one block at each anchor, all at once.  Logits [B, A, bs, V_d]
        (the final norm's output [B, A, bs, H] without `head`: training applies the head in chunks).

        input_ids [B, S], states [B, S, m H_target], anchors [B, A] (positions; -1 = none). The block at anchor a
        reads a's token then mask tokens at positions a + 1 .., attends to the context before a (real positions of
        a's document) and to its own slots, exactly as the decoder's round whose last accepted token is a."""
        bs = block_size or self.block_size
        b, s = input_ids.shape
        docs = torch.zeros_like(input_ids) if document_ids is None else document_ids
        positions = torch.arange(s, device=input_ids.device)[None].expand(b, s) if document_ids is None \
            else positions_in_documents(docs)
        context = self.context(states, positions)
        anchor = anchors.clamp_min(0)
        ids = torch.full((b, anchors.shape[1], bs), self.mask_token_id, dtype=torch.long, device=input_ids.device)
        ids[:, :, 0] = input_ids.gather(1, anchor)
        slot_positions = positions.gather(1, anchor)[..., None] + torch.arange(bs, device=input_ids.device)
        allowed = anchored_mask(anchors, docs, attention_mask, bs)
        out = self.block(ids.flatten(1), slot_positions.flatten(1), context, allowed, head,
                         attention_group(s, anchors.shape[1], bs))
        return out.view(b, anchors.shape[1], bs, -1)

    # ---- construction, saving and loading
    @classmethod
    def from_target(cls, target: nn.Module, layer_ids: list[int] | None = None, keep_ids: torch.Tensor | None = None,
                    num_layers: int = 1, block_size: int = 8, mask_token_id: int | None = None,
                    seed: int = 0) -> DFlashDraft:
        """A new draft for `target`: its frozen embeddings, final norm and head rows (the kept ids), and a seeded
        fc and `num_layers` layers reading the target's residual stream after `layer_ids`."""
        target_layers = len(target.get_decoder().layers)
        ids = check_layer_ids(layer_ids or default_layer_ids(target_layers), target_layers, "dflash_layer_ids")
        vocab = target.get_input_embeddings().num_embeddings
        mask = vocab - 1 if mask_token_id is None else int(mask_token_id)
        if not 0 <= mask < vocab:
            raise ValueError(f"mask_token_id must be a token id in [0, {vocab}), got {mask_token_id}")
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the anchor and at least one proposed token), got {block_size}")
        rows = vocab if keep_ids is None else int(keep_ids.numel())
        config = draft_config(target.config, ids, rows, num_layers, block_size, mask)
        config.vocab_size = vocab
        draft = cls.seeded(config, seed).take_target_parts(target, keep_ids)
        draft.lm_head.weight.requires_grad_(False)
        return draft

    def save_pretrained(self, out_dir: str | Path, state_dict: dict | None = None, format: str = "",
                        speculators: dict | None = None, **_ignored) -> None:
        formats.write(out_dir, self.config, self.weights(state_dict), self.dtype, format or formats.FORMATS[0],
                      speculators)


def attention_group(context: int, anchors: int, block_size: int) -> int:
    """Slots per attention call when many blocks run at once: whole blocks, about half the context's length and
    at least 64 slots. A slot reads no other block's slots, so one call over every block would spend most of its
    work on masked keys; each group's call reads the context and its own slots only (half the context: at most
    1.5x the context's keys, against 1 + slots / context for one call)."""
    slots = max(64, context // 2)
    return min(anchors, max(1, -(-slots // block_size))) * block_size


class AnchoredMask:
    """Which keys each block slot attends to, kept compact: per block, the context positions its slots read
    (`context` [B, A, S] bool, the same for every slot of a block), and every slot of its own block, none of
    another. `dense(start, stop)` is the attention mask of slots start .. stop - 1 alone: a forward over many
    blocks in groups then never holds every slot's mask (slots x (context + slots) booleans a row), and a group's
    checkpointed attention keeps this compact mask for backward, not its dense part."""

    def __init__(self, context: torch.Tensor, block_size: int):
        self.context, self.block_size = context, block_size
        self._whole: torch.Tensor | None = None

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """[B, 1, stop - start, S + stop - start] bool: the context's keys, then the slots start .. stop - 1
        (`start` on a block's first slot). The whole mask is built once and shared by every layer."""
        bs, total = self.block_size, self.context.shape[1] * self.block_size
        stop = total if stop is None else stop
        whole = start == 0 and stop == total
        if whole and self._whole is not None:
            return self._whole
        context = self.context[:, start // bs: -(-stop // bs)].repeat_interleave(bs, dim=1)[:, : stop - start]
        block_of = torch.arange(start, stop, device=context.device) // bs
        own = (block_of[:, None] == block_of[None, :])[None].expand(context.shape[0], -1, -1)
        mask = torch.cat([context, own], dim=2)[:, None]
        if whole:
            self._whole = mask
        return mask


def anchored_mask(anchors: torch.Tensor, docs: torch.Tensor, attention_mask: torch.Tensor | None,
                  block_size: int) -> AnchoredMask:
    """Which keys each block slot attends to: the real context positions before its anchor in the anchor's
    document, and every slot of its own block.  anchors [B, A], docs [B, S]"""
    s = docs.shape[1]
    index = torch.arange(s, device=docs.device)
    anchor = anchors.clamp_min(0)
    same_doc = docs[:, None, :] == docs.gather(1, anchor)[..., None]  # [B, A, S]
    context = same_doc & (index[None, None] < anchors[..., None])
    if attention_mask is not None:
        context = context & attention_mask[:, None, :].bool()
    return AnchoredMask(context, block_size)
