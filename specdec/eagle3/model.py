"""EAGLE-3 drafts (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv:2503.01840), computed as the serving engines compute them.

The draft reads, at draft position t, the token x_{t+1} and three of the target's hidden states at t, and
proposes x_{t+2}. Its one decoder layer is a Llama layer whose attention reads twice the hidden width:

    h       = fc(cat(a_1, a_2, a_3))                 a_i: the target's residual stream after layer id i
    x       = cat(input_layernorm(embed(x_{t+1})), hidden_norm(h))          [.., 2H]
    r       = attn(x) + h                             (hidden_norm(h) instead of h with norm_before_residual)
    out     = mlp(post_attention_layernorm(r)) + r    the pre-norm output, fed back as h on the next step
    logits  = lm_head(norm(out))                      over `draft_vocab_size` ids; target id = id + d2t[id]

This is what vLLM 0.32's `Eagle3LlamaForCausalLM` computes (vllm/model_executor/models/llama_eagle3.py) and
what SGLang's `LlamaForCausalLMEagle3` loads; the layer ids count "after i decoder layers", as vLLM's
`eagle_aux_hidden_state_layer_ids` does (default (2, N // 2, N - 3)). The weights keep the engines' names
(`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, `embed_tokens`), so a checkpoint saved here is served
unchanged (specdec/eagle3/formats.py writes the engines' config keys).

Later proposals of a round read the draft's own pre-norm output instead of fc's (`from_target=False`). Training
unrolls those steps ("training-time test") with an attention that costs each step the same (`unrolled`).

A P-EAGLE draft (config `ptd_token_id`) proposes a round's k tokens in one forward instead, as vLLM's
`parallel_drafting` feeds it: after the true positions, k - 1 masked slots read the mask token and fc of the
learned `mask_hidden` (in place of the target's states); `unrolled` then trains that objective.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from specdec.eagle3 import formats
from specdec.eagle3.attention import unrolled_attention
from specdec.hidden_state_draft import HiddenStateDraft, mark_target, target_text, text_config_kwargs


def default_layer_ids(num_layers: int) -> list[int]:
    """vLLM's and SGLang's default auxiliary layers: after 2, N // 2 and N - 3 decoder layers."""
    if num_layers < 7:
        raise ValueError(f"the engines' default EAGLE-3 layers (2, N // 2, N - 3) repeat for a {num_layers}-layer "
                         f"target: name them with eagle_aux_layer_ids (distinct ids in 1..{num_layers - 1})")
    return [2, num_layers // 2, num_layers - 3]


def check_layer_ids(layer_ids, num_layers: int, key: str = "eagle_aux_layer_ids") -> list[int]:
    """Sorted, distinct ids in 1..N-1 (id i = the residual stream after i of the target's N layers); `key` names
    the recipe key they came from in the error."""
    ids = sorted(int(i) for i in layer_ids)
    if not ids or len(set(ids)) != len(ids) or ids[0] < 1 or ids[-1] > num_layers - 1:
        raise ValueError(f"{key} must be distinct ids in 1..{num_layers - 1} (the residual stream "
                         f"after that many of the target's {num_layers} layers), got {list(layer_ids)}")
    return ids


def draft_config(target_config, layer_ids: list[int], draft_vocab_size: int) -> LlamaConfig:
    """The draft layer's Llama config from the target's (same widths), with the engines' EAGLE-3 keys."""
    config = LlamaConfig(**text_config_kwargs(target_config), num_hidden_layers=1, mlp_bias=False)
    mark_target(config, target_config, formats.ARCHITECTURE, draft_vocab_size)
    config.target_num_hidden_layers = target_text(target_config).num_hidden_layers
    config.eagle_aux_hidden_state_layer_ids = list(layer_ids)
    # Written out, not left to defaults: vLLM's plain path defaults it to false, speculators' format to true.
    config.norm_before_residual = False
    return config


class Eagle3Layer(nn.Module):
    """The draft's decoder layer: q/k/v read cat(input_layernorm(embeds), hidden_norm(h)), the residual is h."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.input_layernorm = LlamaRMSNorm(hidden, eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * hidden, self.heads * self.head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.mlp = LlamaMLP(config)

    def qkv(self, embeds, hidden, cos, sin):
        """Queries [B, heads, n, d], keys and values [B, kv_heads, n, d] (rotary applied), and the residual."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, n, 2H]
        b, n, _ = x.shape
        attn = self.self_attn
        q = attn.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v, residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o_proj, residual, MLP: the layer's pre-norm output from attention's output [B, heads, n, d].  [B, n, H]"""
        b, _, n, _ = attended.shape
        r = self.self_attn.o_proj(attended.transpose(1, 2).reshape(b, n, -1)) + residual
        return self.mlp(self.post_attention_layernorm(r)) + r


class Eagle3Draft(HiddenStateDraft):
    """An EAGLE-3 draft over a target (see the module docstring); `draft_to_target` maps its logits to target ids."""

    label = "EAGLE-3"
    retrain = ("an EAGLE-3 draft serves only the target it was trained for: pass that target, or train an EAGLE-3 "
               "draft for this one (draft: eagle3 in a recipe)")
    formats = formats

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.layer_ids = list(config.eagle_aux_hidden_state_layer_ids)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)  # the target's, frozen
        self.fc = nn.Linear(len(self.layer_ids) * config.target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_vocabulary(config)
        # P-EAGLE (parallel drafting): the learned stand-in for the target's states at a round's masked slots,
        # before fc (vLLM's `mask_hidden`, projected by fc as the target's states are)
        self.ptd_token_id = getattr(config, "ptd_token_id", None)
        if self.parallel:
            self.mask_hidden = nn.Parameter(torch.zeros(len(self.layer_ids) * config.target_hidden_size))

    @property
    def parallel(self) -> bool:
        """Whether this is a P-EAGLE draft: a round's k proposals in one forward, proposals 2..k read the mask
        token `ptd_token_id` and `mask_hidden` (vLLM's `parallel_drafting`)."""
        return self.ptd_token_id is not None

    def masked_inputs(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings, h) of masked slots shaped as the token ids `like` [B, n]: the mask token's embedding and
        fc(mask_hidden), the same at every slot (only the rotary position differs)."""
        embeds = self.embed_tokens(torch.full_like(like, self.ptd_token_id))
        h = self.fc(self.mask_hidden.to(self.fc.weight.dtype))
        return embeds, h.expand(*like.shape, h.shape[-1])

    def _rotary(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary_emb(x, position_ids)

    def hidden_in(self, hidden: torch.Tensor, from_target: bool) -> torch.Tensor:
        """h of the layer: fc of the target's concatenated hidden states, or the draft's own previous output."""
        return self.fc(hidden.to(self.fc.weight.dtype)) if from_target else hidden

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                from_target: bool = True, cache: DynamicCache | None = None,
                attention_mask: torch.Tensor | None = None, logits_to_keep: int = 0, ttt_steps: int = 0,
                tree_mask: torch.Tensor | None = None, document_ids: torch.Tensor | None = None):
        """One cached step: (pre-norm outputs [B, n, H], logits [B, n or logits_to_keep, draft_vocab]).

        `attention_mask` [B, past + n] marks real (1) and padding (0) positions of the cache and the new ones;
        `tree_mask` [n, past + n] (True = may attend) replaces causal attention for a draft tree's nodes.
        With `ttt_steps` > 0 it returns `unrolled(input_ids, hidden, attention_mask, ttt_steps, document_ids)`
        instead: training calls it through forward so that a DDP wrapper synchronises the gradients."""
        if ttt_steps:
            return self.unrolled(input_ids, hidden, attention_mask, ttt_steps, document_ids)
        h = self.hidden_in(hidden, from_target)
        embeds = self.embed_tokens(input_ids)
        cos, sin = self._rotary(h, position_ids)
        q, k, v, residual = self.midlayer.qkv(embeds, h, cos, sin)
        past = cache.get_seq_length() if cache is not None else 0
        if cache is not None:
            k, v = cache.update(k, v, 0)
        n, total = q.shape[2], k.shape[2]
        allowed = torch.arange(total, device=q.device)[None, :] <= past + torch.arange(n, device=q.device)[:, None]
        allowed = allowed[None, None]  # [1, 1, n, total]
        if tree_mask is not None:
            allowed = tree_mask.to(q.device)[None, None]
        elif attention_mask is not None:
            # A padding query may have no real key before it: letting it see itself keeps its row finite.
            itself = torch.arange(total, device=q.device)[None, :] == past + torch.arange(n, device=q.device)[:, None]
            allowed = (allowed & attention_mask[:, None, None, :total].bool()) | itself[None, None]
        rep = self.midlayer.heads // self.midlayer.kv_heads
        attended = F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), attn_mask=allowed)
        out = self.midlayer.finish(attended, residual)
        kept = out[:, -logits_to_keep:] if logits_to_keep else out
        return out, self.lm_head(self.norm(kept))

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Draft logits of pre-norm outputs.  [..., H] -> [..., draft_vocab]"""
        return self.lm_head(self.norm(prenorm))

    def unrolled(self, input_ids: torch.Tensor, target_hidden: torch.Tensor, attention_mask: torch.Tensor,
                 steps: int, document_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training-time test: the pre-norm outputs [B, n, H] of each of `steps` unrolled proposals, n = S - 1.

        Step 1 at draft position t reads (x_{t+1}, the target's hidden states at t) with causal attention: the
        first proposal of a round whose last true position is t. Step j at t reads (x_{t+1}, step j-1's output at
        t - 1): the j-th proposal of the round whose last true position is s = t - (j - 1). At decode time that
        proposal attends to the cache: true positions <= s (step 1's keys there) and the round's own proposals
        at s + 1 .. t (step i's key at t - (j - i), i = 2..j). Those are exactly the keys used here, so the
        unrolled outputs equal the decoder's proposals. Each step costs one causal attention over step 1's keys
        plus j - 1 single diagonal keys, so the cost grows linearly in `steps` (a dense mask over all steps' keys
        would grow quadratically). A P-EAGLE draft's step j >= 2 at t reads the mask token and `mask_hidden`
        instead (the round's (j - 1)-th masked slot) and attends to the same keys, the earlier slots' among them:
        its outputs equal the decoder's one parallel forward; that attention runs in chunks of queries, recomputed in backward, so memory
        grows linearly in n (specdec/eagle3/attention.py).  input_ids, attention_mask: [B, S] (rows right-padded);
        target_hidden: [B, S, 3 H_target].

        `document_ids` [B, S] (packed rows: each row several documents, each a contiguous run of positions) makes
        each document's outputs those of the document alone: draft position t belongs to position t's document,
        attends only within it, takes rotary positions counted from the document's start, and a document's first
        position reads no earlier step output. The position reading the next document's first token (the last of
        each document but the row's last) has no counterpart alone: its loss must be masked."""
        ids, valid = input_ids[:, 1:], attention_mask[:, 1:].bool()
        b, n = ids.shape
        docs = None if document_ids is None else document_ids[:, :-1]  # draft position t: its hidden state's document
        positions = torch.arange(n, device=ids.device)[None].expand(b, n) if docs is None else positions_in_documents(docs)
        embeds = self.embed_tokens(ids)
        h = self.hidden_in(target_hidden[:, :-1], from_target=True)
        cos, sin = self._rotary(h, positions)
        layer = self.midlayer
        first_keys = first_values = None
        diag_keys, diag_values, outputs = [], [], []
        for step in range(1, steps + 1):
            if step == 1 or not self.parallel:
                q, k, v, residual = layer.qkv(embeds, h, cos, sin)
            elif step == 2:  # P-EAGLE: every later proposal reads the masked slots' inputs (the same each step)
                q, k, v, residual = layer.qkv(*self.masked_inputs(ids), cos, sin)
            if step == 1:
                first_keys, first_values = k, v
            else:  # step i's key at t - (step - i) for i = 2..step: the round's own earlier proposals (and this one)
                diag_keys.append(k)
                diag_values.append(v)
            attended = unrolled_attention(q, first_keys, first_values, diag_keys, diag_values, valid, docs)
            out = layer.finish(attended, residual)
            outputs.append(out)
            # the next step at t reads this step's output at t - 1 (no fc: the draft's own hidden width)
            h = F.pad(out[:, :-1], (0, 0, 1, 0))
            if docs is not None:  # a document's first position reads nothing before it, as alone
                h = h.masked_fill((positions == 0)[..., None], 0.0)
        return outputs

    # ---- construction, saving and loading
    @classmethod
    def from_target(cls, target: nn.Module, layer_ids: list[int] | None = None,
                    keep_ids: torch.Tensor | None = None, seed: int = 0, layer_init: str = "random",
                    fc_init: str = "random", norm_before_residual: bool = False,
                    ptd_token_id: int | None = None) -> Eagle3Draft:
        """A new draft for `target`: its frozen embeddings, its final norm and head rows (the kept ids), and an fc
        and a layer (seeded), reading the target's residual stream after `layer_ids`. The layer starts random or
        as the target's last layer (`layer_init="target"`); fc random or passing the last state through
        (`fc_init="last_state"`). A `ptd_token_id` makes it a P-EAGLE draft (parallel drafting), whose
        `mask_hidden` starts seeded small."""
        num_layers = len(target.get_decoder().layers)
        ids = check_layer_ids(layer_ids or default_layer_ids(num_layers), num_layers)
        vocab = target.get_input_embeddings().num_embeddings
        config = draft_config(target.config, ids, vocab if keep_ids is None else int(keep_ids.numel()))
        config.vocab_size = vocab
        config.norm_before_residual = bool(norm_before_residual)
        if ptd_token_id is not None:
            if not 0 <= int(ptd_token_id) < vocab:
                raise ValueError(f"ptd_token_id must be a token id in [0, {vocab}), got {ptd_token_id}")
            config.ptd_token_id, config.parallel_drafting = int(ptd_token_id), True
        draft = cls.seeded(config, seed).take_target_parts(target, keep_ids)
        with torch.no_grad():
            if layer_init == "target":
                _start_as_layer(draft.midlayer, target.get_decoder().layers[-1])
            if fc_init == "last_state":
                _pass_last_state(draft.fc, config.target_hidden_size)
        return draft

    def init_new_weights(self) -> None:
        super().init_new_weights()
        if self.parallel:  # after the others: the seeded start P-EAGLE drafts have always had
            nn.init.normal_(self.mask_hidden, std=0.02)

    def save_pretrained(self, out_dir: str | Path, state_dict: dict | None = None, format: str = "engines",
                        speculators: dict | None = None, **_ignored) -> None:
        """config.json + model.safetensors in one of `formats.FORMATS` (specdec/eagle3/formats.py); `state_dict` =
        a gathered one (FSDP, DeepSpeed); `speculators` = the verifier for format="speculators". The weights keep
        the engines' names (vLLM maps `midlayer.` to `layers.0.`; SGLang reads them as they are)."""
        formats.write(out_dir, self.config, self.weights(state_dict), self.dtype, format, speculators)


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Each position's offset from the start of its document (documents are contiguous runs).  [B, n] -> [B, n]"""
    index = torch.arange(document_ids.shape[1], device=document_ids.device)[None].expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def _start_as_layer(layer: Eagle3Layer, source: nn.Module) -> None:
    """The draft layer as a copy of a target layer where their shapes meet: attention's weights on the state's
    half of q/k/v's input (the token's half keeps its random start), o_proj, the MLP and the norms."""
    hidden = layer.hidden_norm.weight.numel()
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(layer.self_attn, name).weight[:, hidden:].copy_(getattr(source.self_attn, name).weight)
    layer.self_attn.o_proj.weight.copy_(source.self_attn.o_proj.weight)
    layer.mlp.load_state_dict(source.mlp.state_dict())
    layer.hidden_norm.weight.copy_(source.input_layernorm.weight)
    layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)


def _pass_last_state(fc: nn.Linear, width: int) -> None:
    """fc(cat(states)) = the last of the states: the layer starts from the deepest recorded residual stream."""
    fc.weight.zero_()
    fc.weight[:, -width:].copy_(torch.eye(width, dtype=fc.weight.dtype, device=fc.weight.device))

