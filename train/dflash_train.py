"""Training and held-out scoring of a DFlash draft (specdec/dflash/).

Anchored blocks (DFlash, Chen et al. 2026, arXiv:2602.06036, and speculators' `dflash` trainer): in each row,
`num_anchors` random scored positions a become anchors; the block at a reads a's real token then mask tokens,
attends to the target's states before a (its own document's), and slot j = 1 .. block_size - 1 is trained to
propose the token at a + j, exactly the round whose last accepted token is a (`DFlashDraft.forward`). All of a
row's blocks run in one forward. Slot j's loss weighs exp(-(j - 1) / loss_decay) (the paper's position weight:
gamma 7 for blocks of 16, 5 for 10, 4 for 8; speculators' `fixed-exp-decay`, default 4), normalised by the
step's total weight over every process and micro-batch, so two processes train exactly as one.

The loss is the configured one (train/losses.py) against the target's distribution over the draft vocabulary
(online: the target's head rows on its final hidden state at a + j - 1; offline: the stored top-n there) and
its tokens, at slots whose token the draft's vocabulary holds. It is summed over chunks of slots recomputed in
backward, so no [slots, vocabulary] tensor of a whole batch exists; the teacher's head runs once per predicting
position of a chunk (overlapping blocks share them). The target's states come per batch from the
data stage's recording or from the target (train/eagle3_states.py, shared with EAGLE-3).

Anchors are drawn from a generator seeded by the run's seed and the row's tokens: the same on any number of
processes, and `counts` and `loss` draw the same ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from specdec.dflash import DFlashDraft
from specdec.dflash.replay import block_ranks
from specdec.train import losses
from specdec.train.eagle3_train import StatesTraining, kept_ids, loss_chunk_rows, merge_parts
from specdec.train.heldout import evaluating


def slot_weights(block_size: int, decay: float) -> torch.Tensor:
    """exp(-(j - 1) / decay) for slots j = 1 .. block_size - 1 (slot 0, the anchor, weighs 0).  [block_size]"""
    j = torch.arange(block_size, dtype=torch.float32)
    return torch.where(j >= 1, torch.exp(-(j - 1) / decay), torch.zeros(()))


def choose_anchors(batch: dict, num_anchors: int, block_size: int, seed: int) -> torch.Tensor:
    """Up to `num_anchors` scored positions per row (ascending; -1 fills), drawn from the row's own generator.
    A position p is eligible when it predicts a completion token (loss_mask[p]).  -> [B, A] long"""
    mask = batch["loss_mask"].bool().cpu()
    ids, real = batch["input_ids"].cpu(), batch["attention_mask"].bool().cpu()
    rows = []
    for b in range(mask.shape[0]):
        eligible = mask[b].nonzero().flatten()
        tokens = ids[b][real[b]]  # the row's own tokens: the same key whatever its batch's padded width
        key = (seed * 1_000_003 + int((tokens * torch.arange(1, tokens.numel() + 1)).sum())) % (2 ** 62)
        order = torch.randperm(eligible.numel(), generator=torch.Generator().manual_seed(key))
        rows.append(eligible[order[:num_anchors]].sort().values)
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out.to(batch["input_ids"].device)


def block_targets(batch: dict, anchors: torch.Tensor, block_size: int, inv_map, draft_vocab: int):
    """Per slot: the position whose logits predict its token (a + j - 1), its token in draft ids, and whether it is
    scored (a real anchor, the token inside the row, its document and the completion, in the draft's vocabulary).
    -> ([B, A, bs] long, [B, A, bs] long, [B, A, bs] bool)"""
    s = batch["input_ids"].shape[1]
    j = torch.arange(block_size, device=anchors.device)
    predictor = anchors.clamp_min(0)[..., None] + j - 1  # slot j's token is labels[a + j - 1]
    inside = (anchors[..., None] >= 0) & (j >= 1) & (predictor < s)
    predictor = predictor.clamp(0, s - 1)
    flat = predictor.flatten(1)
    scored = batch["loss_mask"].bool().gather(1, flat).view_as(predictor) & inside
    if "document_ids" in batch:
        docs = batch["document_ids"]
        same = docs.gather(1, flat).view_as(predictor) == docs.gather(1, anchors.clamp_min(0))[..., None]
        scored &= same
    local, known = losses.targets_in_draft_ids(batch["labels"].gather(1, flat).view_as(predictor), inv_map,
                                               draft_vocab)
    return predictor, local, scored & known


def _loss_sum(cfg, inner, target_head, vocab_map, hidden, teacher_in, top_ids, top_logprobs, teacher_of, local,
              weights) -> torch.Tensor:
    """The weighted summed loss over a chunk of scored slots.  hidden [N, H]; weights [N]. The teacher's inputs
    (teacher_in, or top_ids and top_logprobs) hold each predicting position of the chunk once, and teacher_of [N]
    points each slot at its position's: overlapping blocks predict from the same position at up to
    block_size - 1 slots, and the teacher's head is computed once for them."""
    student = inner.lm_head(hidden).float()
    teacher = None
    if losses.reads_teacher(cfg) and target_head is not None:
        teacher = target_head(teacher_in.to(target_head.weight.dtype)).float()[teacher_of]
    elif losses.reads_teacher(cfg):
        teacher = losses.dense_teacher_logits(top_ids, top_logprobs, student.shape[-1], vocab_map)[teacher_of]
    total = student.new_zeros(())
    # configured_loss averages over its rows: one call per distinct weight (a slot index) keeps the weights exact
    for w in weights.unique():
        rows = weights == w
        part = losses.configured_loss(cfg, student[rows], None if teacher is None else teacher[rows], local[rows],
                                      summed=True)
        total = total + w * part
    return total


def teacher_inputs(cfg, batch: dict, states: torch.Tensor, target_head, hidden: int, where: torch.Tensor):
    """The teacher's inputs at each distinct flat position of `where` [N] (row * width + position) and each
    slot's index into them: (final states [U, H] or None, top_ids [U, n] or None, top_logprobs [U, n] or None,
    [N] long); all None when no loss term reads the teacher."""
    if not losses.reads_teacher(cfg):
        return None, None, None, None
    positions, teacher_of = torch.unique(where, return_inverse=True)
    if target_head is not None:
        return states.flatten(0, 1)[positions, :hidden], None, None, teacher_of
    top = [batch[k].flatten(0, 1)[positions] if k in batch else None for k in ("top_ids", "top_logprobs")]
    return None, *top, teacher_of


def dflash_loss(cfg, draft, batch: dict, states: torch.Tensor, target_head, inv_map, anchors: torch.Tensor,
                denominator: torch.Tensor | None = None) -> torch.Tensor:
    """The slot-weighted loss of every anchored block in `batch` (module docstring), divided by `denominator` (the
    step's total slot weight over processes and micro-batches; None: this batch's)."""
    inner = getattr(draft, "module", draft)
    opts, hidden = cfg.options, inner.config.target_hidden_size
    hiddens = draft(batch["input_ids"], states[..., hidden:], anchors, batch["attention_mask"],
                    batch.get("document_ids"), head=False)  # through the (DDP-wrapped) forward
    predictor, local, scored = block_targets(batch, anchors, opts.block_size, inv_map, inner.config.draft_vocab_size)
    weights = slot_weights(opts.block_size, opts.loss_decay).to(hiddens.device).expand_as(scored)
    if denominator is None:
        denominator = weights[scored].sum().clamp(min=1)
    total = hiddens.sum() * 0.0 + inner.lm_head(hiddens[:, :1, 0]).sum() * 0.0  # every parameter in the graph
    b_index = torch.arange(scored.shape[0], device=scored.device)[:, None, None].expand_as(scored)
    # each slot's predicting position, flat over the batch's rows
    where = b_index[scored] * batch["input_ids"].shape[1] + predictor[scored]
    picked = [hiddens[scored], local[scored], weights[scored]]
    chunk, count = loss_chunk_rows(inner.config.draft_vocab_size), picked[0].shape[0]
    for start in range(0, count, chunk):
        slots, teacher = slice(start, start + chunk), teacher_inputs(cfg, batch, states, target_head, hidden,
                                                                     where[start:start + chunk])
        part = [picked[0][slots], *teacher, *(x[slots] for x in picked[1:])]
        if count > chunk:  # recomputed in backward: one chunk's logits at a time
            total = total + checkpoint(_loss_sum, cfg, inner, target_head, inv_map, *part, use_reentrant=False)
        else:
            total = total + _loss_sum(cfg, inner, target_head, inv_map, *part)
    return total / denominator


class DFlashTraining(StatesTraining):
    """A DFlash draft for the trainer (train/distill.py): built here, its loss per micro-batch, its held-out
    figures (the block replay, specdec/dflash/replay.py)."""

    def __init__(self, cfg, target, tokenizer, vocabulary, device, autocast, folders):
        self.cfg, self.autocast = cfg, autocast
        opts = cfg.options  # train/kinds/dflash.py: DFlashOptions
        mask = opts.mask_token_id if opts.mask_token_id >= 0 else None
        model = DFlashDraft.from_target(target, opts.dflash_layer_ids or None, kept_ids(cfg, target, vocabulary),
                                        opts.dflash_layers, opts.block_size, mask, cfg.seed)
        if opts.norm_init == "ones":
            with torch.no_grad():
                model.norm.weight.fill_(1.0)
        self.take_draft(model, target, tokenizer, device, folders)

    def anchors(self, batch: dict) -> torch.Tensor:
        if "dflash_anchors" not in batch:  # drawn once: `counts` and `loss` see the same
            opts = self.cfg.options
            batch["dflash_anchors"] = choose_anchors(batch, opts.num_anchors, opts.block_size, self.cfg.seed)
        return batch["dflash_anchors"]

    def counts(self, batch: dict) -> torch.Tensor:
        """The total slot weight `batch` scores.  [1]"""
        opts = self.cfg.options
        _, _, scored = block_targets(batch, self.anchors(batch), opts.block_size, self.inv_map,
                                     self.model.config.draft_vocab_size)
        weights = slot_weights(opts.block_size, opts.loss_decay).to(scored.device).expand_as(scored)
        return weights[scored].sum()[None]

    def loss(self, model, batch: dict, micro: int, rank: int, prefetched, denominators=None) -> torch.Tensor:
        states = self.batch_states(batch, prefetched)
        with self.autocast():
            return dflash_loss(self.cfg, model, batch, states, self.teacher, self.inv_map, self.anchors(batch),
                               None if denominators is None else denominators[0])

    def evaluate(self, model, chunks, gather) -> dict[str, Any]:
        with evaluating(getattr(model, "module", model)) as inner:
            hidden, ks, ranks = inner.config.target_hidden_size, self.cfg.eval_k, []
            for rows, batch in chunks:
                full = self.states.complete(batch, self.states.read(rows, batch["input_ids"].shape[1]))[..., hidden:]
                ranks += block_ranks(inner, batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                                     max(ks), full)
        return merge_parts(gather([{"ranks": ranks, "alphas": []}]), ks)


__all__ = ["DFlashTraining", "block_targets", "choose_anchors", "dflash_loss", "slot_weights"]
