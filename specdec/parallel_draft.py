"""The parallel draft kind (PARD, arXiv 2504.18583): a causal LM over the target's tokenizer that proposes a round's
k tokens in ONE forward, served by vLLM as `draft_model` with `parallel_drafting: true`.

What the draft reads, as vLLM 0.32 feeds it (vllm/v1/spec_decode/llm_base_proposer.py `_init_parallel_drafting_params`
and vllm/v1/spec_decode/utils.py `copy_and_expand_eagle_inputs`): the accepted tokens, the round's last emitted
(bonus) token at position p, then k - 1 copies of one mask token at positions p + 1 .. p + k - 1, all causal. The
logits at p propose token p + 1, the mask at p + j proposes token p + j + 1. The mask token's id is the draft's
config.json key `pard_token` (vLLM also reads `mask_token_id`, `ptd_token_id`; specdec writes `pard_token`, as PARD
does); it is an id of the target's vocabulary, since vLLM's draft_model needs the two vocabularies equal.

`parallel_layout` lays out that input for a whole sequence at once (PARD's training layout: the sequence, then
copies of it made of mask tokens, copy j's position t reading the real tokens up to t - j and the masks of copies
1..j before it): the trainer (train/parallel_train.py) and the held-out replay use it, so both see exactly what the
decoder and vLLM feed.
"""

from __future__ import annotations

import torch

from specdec.drafter import PlainDrafter
from specdec.kv import forward_cached, rollback
from specdec.plain_draft import PlainKind
from specdec.ranks import RANK_CAP, true_token_ranks

CONFIG_KEY = "pard_token"  # the draft's config.json key vLLM reads the mask token's id from


def mask_token(model) -> int | None:
    """The mask token id a loaded draft declares (None: not a parallel draft)."""
    value = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    return None if value is None else int(value)


def parallel_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, copies: int, mask_id: int):
    """PARD's layout of `copies` - 1 mask copies after the sequence, as one forward's inputs.

    Query (copy j, position t) reads the real tokens at positions <= t - j and the mask at t - j + m of every copy
    m = 1..j: what vLLM's round feeds its mask j, with the round's last real token at t - j. Every copy keeps the
    sequence's positions.  input_ids, attention_mask [B, L] -> ids [B, cL], positions [B, cL], allowed [B, cL, cL]
    """
    batch, length = input_ids.shape
    device = input_ids.device
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0).repeat(1, copies)
    masks = torch.full((batch, length * (copies - 1)), mask_id, dtype=input_ids.dtype, device=device)
    ids = torch.cat([input_ids, masks], dim=1)
    j = torch.arange(copies, device=device).repeat_interleave(length)  # each row's copy
    t = torch.arange(length, device=device).repeat(copies)  # each row's position
    qj, qt, km, ks = j[:, None], t[:, None], j[None, :], t[None, :]
    real = (km == 0) & (ks <= qt - qj)  # [cL, cL]
    chain = (km >= 1) & (km <= qj) & (ks == qt - qj + km)
    diagonal = (km == qj) & (ks == qt)  # every row reads itself: no row without a key (padding, t < j)
    key_real = attention_mask.bool().repeat(1, copies)  # [B, cL]
    allowed = (real[None] & key_real[:, None, :]) | (chain | diagonal)[None]
    return ids, positions, allowed


def scored_in_copy(loss_mask: torch.Tensor, attention_mask: torch.Tensor, copy: int) -> torch.Tensor:
    """Where copy `copy` is scored: a scored position t whose round's last real token t - copy is in the sequence
    (not before its start, not padding).  [B, L] bool"""
    scored = loss_mask.bool().clone()
    if copy:
        scored[:, :copy] = False
        scored[:, copy:] &= attention_mask[:, :-copy].bool()
    return scored


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`allowed` [B, n, n] as the additive 4D mask eager and sdpa attention read as given.  -> [B, 1, n, n]"""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def layout_logits(model, input_ids, attention_mask, copies: int, mask_id: int) -> torch.Tensor:
    """The draft's logits over the parallel layout, one [B, L, V] block per copy.  -> [copies, B, L, V]"""
    ids, positions, allowed = parallel_layout(input_ids, attention_mask, copies, mask_id)
    param = next(model.parameters())
    dtype = param.dtype
    if torch.is_autocast_enabled(param.device.type):  # sdpa wants the mask in the queries' (autocast) dtype
        dtype = torch.get_autocast_dtype(param.device.type)
    logits = model(input_ids=ids, position_ids=positions, attention_mask=additive_mask(allowed, dtype)).logits
    return logits.unflatten(1, (copies, input_ids.shape[1])).transpose(0, 1)


@torch.no_grad()
def parallel_ranks(draft, input_ids, attention_mask, loss_mask, steps: int,
                   mask_id: int | None = None, id_map: torch.Tensor | None = None) -> list[list[list[int]]]:
    """The replay ranks (specdec/ranks.py's shape) of a parallel draft: a round starting at scored position t
    proposes token t + 1 + j from mask copy j at t + j, which reads the real tokens up to t only. `mask_id`: the
    draft's own when None (a wrapped draft in training passes it and its `id_map`)."""
    mask_id = mask_token(draft) if mask_id is None else mask_id
    id_map = getattr(draft, "draft_to_target", None) if id_map is None else id_map
    logits = layout_logits(draft, input_ids, attention_mask, steps, mask_id)
    following = torch.roll(input_ids, -1, dims=1).expand(steps, -1, -1)
    ranks = true_token_ranks(logits, following, id_map).tolist()  # [steps, B, L]
    scored, length = loss_mask.bool().tolist(), input_ids.shape[1]
    out = []
    for row in range(input_ids.shape[0]):
        # the round's j-th proposal is scored while position t + j is still in the completion
        out.append([[ranks[j][row][t + j] if t + j < length - 1 and scored[row][t + j] else RANK_CAP
                     for j in range(steps)] for t in range(length - 1) if scored[row][t]])
    return out


class ParallelDrafter(PlainDrafter):
    """Proposes k tokens in one draft forward: [unread accepted tokens, last emitted token, k - 1 masks]; the
    masks' cache entries are dropped at once (next round reads the real tokens at their positions)."""

    def __init__(self, draft, target, sampling):
        super().__init__(draft, target, sampling)
        self.mask_id = mask_token(draft)

    def propose(self, batch, k: int, generator, stats):
        stop = batch.length
        # The round's logits start at the last emitted token, so the cache must not hold it yet (it lags by one
        # or more in decoding; the guard keeps a caller's fresh prefill of the whole sequence right too).
        rollback(self.cache, min(self.cache.get_seq_length(), stop - 1))
        batch.seq[:, stop : stop + k - 1] = self.mask_id  # the buffer past the sequence end holds proposals
        logits = forward_cached(self.model, self.cache, batch, stop + k - 1, k, self.kwarg)  # [B, k, V]
        stats.draft_forwards += 1
        rollback(self.cache, stop)
        qs: list = []
        tokens = torch.stack([self.pick(logits[:, j : j + 1], batch, generator, qs) for j in range(k)], dim=1)
        batch.seq[:, stop : stop + k] = tokens
        return tokens, (torch.stack(qs, dim=1) if qs else None)

    def tree_root(self, batch):
        raise NotImplementedError("a parallel draft proposes chains (num_draft_tokens=k), not trees")


class ParallelKind(PlainKind):
    """The parallel draft kind (specdec/draft_kind.py's interface): a plain causal LM whose config.json names its
    mask token; loaded and saved as a plain one (save_pretrained writes `pard_token` with the config)."""

    name = "parallel"

    def recognises(self, config: dict) -> bool:
        return config.get(CONFIG_KEY) is not None

    def owns(self, model) -> bool:
        return mask_token(model) is not None

    def drafter(self, draft, target, sampling) -> ParallelDrafter:
        return ParallelDrafter(draft, target, sampling)

    def replay_ranks(self, draft, input_ids, attention_mask, loss_mask, steps: int, states=None):
        return parallel_ranks(draft, input_ids, attention_mask, loss_mask, steps)

    def draft_forwards(self, proposal) -> int:
        return 1  # the whole chain in one forward

    def card_facts(self, model) -> dict:
        return {"mask_token": mask_token(model)}

    def vllm_speculative_config(self, model) -> dict:
        return {"parallel_drafting": True}
