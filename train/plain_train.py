"""Training and held-out scoring of a plain (token-only) draft: derived, scratch or a pretrained small model.

The teacher signal is online (the target's logits at the completion positions), offline (the stored top-n
log-probs) or on-policy (with probability lambda the draft samples a short continuation and the target scores
it); the loss is the configured one over completion tokens (train/losses.py's table, composed there). Held-out
figures replay the draft teacher-forced on the target's outputs (specdec/replay.py).
"""

from __future__ import annotations

import logging
import random
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache

from specdec.compat import check_compatible
from specdec.kv import cache_kwarg
from specdec.models import load_tokenizer
from specdec.ranks import true_token_ranks
from specdec.replay import simulated_tau
from specdec.tokens import tokenizer_pad_id
from specdec.train import draft as draft_lib
from specdec.train import losses
from specdec.train.heldout import (
    collect_alphas,
    evaluating,
    heldout_figures,
    pooled,
    pooled_at,
    temperature_key,
)
from specdec.vocab import draft_to_target_map

log = logging.getLogger(__name__)


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def on_policy_batch(model, batch: dict, max_new: int, temperature: float, id_map: torch.Tensor | None,
                    pad_id: int, eos_id: int | None, generator: torch.Generator) -> dict[str, Any]:
    """Replace completions by short continuations sampled from the draft (left-padded prompts), with a KV cache."""
    ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    prompt_lens = [int(m.nonzero()[0]) + 1 if m.any() else int(a.sum()) for m, a in zip(loss_mask, mask)]
    width = max(prompt_lens)
    new_ids = torch.full((ids.shape[0], width + max_new), pad_id, dtype=torch.long, device=ids.device)
    new_mask = torch.zeros_like(new_ids)
    for b, n in enumerate(prompt_lens):
        new_ids[b, width - n: width] = ids[b, :n]
        new_mask[b, width - n: width] = 1
    new_mask[:, width:] = 1
    positions = _positions(new_mask)
    # The wrapped model's forward (DDP) hides the signature: ask the plain module which cache kwarg it takes.
    inner = getattr(model, "module", model)
    cache = DynamicCache(config=inner.config)
    start = 0
    for cur in range(width, width + max_new):
        logits = model(input_ids=new_ids[:, start:cur], attention_mask=new_mask[:, :cur],
                       position_ids=positions[:, start:cur], use_cache=True, logits_to_keep=1,
                       **{cache_kwarg(inner): cache}).logits[:, -1].float()
        token = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator).squeeze(-1)
        new_ids[:, cur] = token if id_map is None else id_map[token]
        start = cur
    gen = new_ids[:, width:]
    # Tokens after the draft's first EOS are not a continuation the target would ever see: no loss there.
    after_eos = (gen == eos_id).long().cumsum(-1) - (gen == eos_id).long() > 0 if eos_id is not None else None
    new_loss = torch.zeros_like(new_ids, dtype=torch.bool)
    new_loss[:, width - 1: width + max_new - 1] = True if after_eos is None else ~after_eos
    return {"input_ids": new_ids, "attention_mask": new_mask, "loss_mask": new_loss,
            "labels": torch.roll(new_ids, -1, dims=1), "n_tokens": int(new_loss.sum())}


# ---- teacher signal and loss ------------------------------------------------------------------------------


def _forward(model, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 position_ids=_positions(batch["attention_mask"])).logits


@torch.no_grad()
def target_logits_at(target, batch: dict) -> torch.Tensor:
    """The target's logits at the loss positions only.  -> [N, V_target]

    The head runs on the selected hidden states: a [B, T, V] teacher tensor is most of the memory otherwise.
    """
    mask = batch["loss_mask"].bool()
    decoder, head = target.get_decoder(), target.get_output_embeddings()
    # Models that post-process logits (soft-capping) need their own forward.
    if decoder is None or head is None or getattr(target.config, "final_logit_softcapping", None):
        return _forward(target, batch)[mask]
    hidden = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=_positions(batch["attention_mask"])).last_hidden_state
    return head(hidden[mask])


def teacher_logits(target, batch: dict, student_vocab: int, id_map, inv_map) -> torch.Tensor:
    """Teacher logits over the draft's vocabulary at the loss positions: online from the target, else dense
    from the stored top-n log-probs.  -> [N, V_draft]"""
    if target is not None:
        logits = target_logits_at(target, batch)
        return losses.restrict_teacher(logits, id_map) if id_map is not None else logits[:, :student_vocab]
    if "top_ids" not in batch:
        raise ValueError("teacher=offline with a divergence loss needs stored top-n log-probs (top_ids, top_logprobs)"
                         " in the data: regenerate with `specdec data ... top_logprobs=20`, or use loss=ce")
    mask = batch["loss_mask"].bool()
    return losses.dense_teacher_logits(batch["top_ids"][mask], batch["top_logprobs"][mask], student_vocab, inv_map)


def compute_loss(cfg, student_logits, teacher, batch: dict, inv_map) -> torch.Tensor:
    """The configured loss (`losses.configured_loss`), the mean over completion positions.  teacher [N, V] or None"""
    mask = batch["loss_mask"].bool()
    student = student_logits[mask]  # [N, V_draft]
    width = min(student.shape[-1], teacher.shape[-1]) if teacher is not None else student.shape[-1]
    targets, inside = losses.targets_in_draft_ids(batch["labels"][mask], inv_map, width)
    return losses.configured_loss(cfg, student[:, :width], teacher[:, :width] if teacher is not None else None,
                                  targets, inside)


# ---- held-out metrics ------------------------------------------------------------------------------------


def _unknown_alpha(shape: torch.Size, temperature: float) -> torch.Tensor:
    """No teacher distribution (offline data without a stored top-n): alpha unknown at every temperature."""
    return torch.full(shape, float("nan"))


@torch.no_grad()
def evaluate_part(model, target, chunks, id_map, temperatures=(), target_vocab: int | None = None) -> dict[str, list]:
    """This process's share of the held-out figures, per position: alpha (at temperature 1 and at each of
    `temperatures`: `alphas_at`), greedy agreement and the rank of the target's token among the draft's
    (teacher-forced). `chunks` yields (rows, collated batch); the caller puts `model` in eval mode
    (`heldout.evaluating`). `target_vocab` bounds the unseen mass of a stored top-n above temperature 1."""
    alphas, agreements, ranks = [], [], []
    alphas_at: dict[str, list] = {temperature_key(t): [] for t in temperatures}
    for _rows, batch in chunks:
        mask = batch["loss_mask"].bool()
        student = _forward(model, batch)[mask].float()  # [N, V_draft]
        if target is not None:
            t_logits = target_logits_at(target, batch).float()  # [N, V_target]
            alpha_at = partial(losses.acceptance_alpha, student, t_logits, None, id_map)
            agree = losses.greedy_agreement(student, t_logits, None, id_map)
            target_top = t_logits.argmax(-1)
        else:
            # The target's greedy token is the stored top-1 (else the data's next token: exact for greedy data).
            has_topn = "top_ids" in batch
            target_top = (batch["top_ids"][..., 0] if has_topn else batch["labels"])[mask]
            agree = losses.draft_argmax_in_target_ids(student, id_map) == target_top
            alpha_at = (partial(losses.acceptance_alpha_topn, student, batch["top_ids"][mask],
                                batch["top_logprobs"][mask], None, id_map, target_vocab=target_vocab)
                        if has_topn else partial(_unknown_alpha, agree.shape))
        counts = mask.sum(-1).tolist()
        collect_alphas(alpha_at, temperatures, alphas, alphas_at)
        agreements += [a.tolist() for a in agree.cpu().split(counts)]
        # A plain draft's later proposals are teacher-forced too: one rank per position serves every depth.
        rank = true_token_ranks(student, target_top.to(student.device), id_map)
        ranks += [[[r] for r in row.tolist()] for row in rank.cpu().split(counts)]
    return {"alphas": alphas, "alphas_at": alphas_at, "agreements": agreements, "ranks": ranks}


def merge_parts(parts: list[dict[str, list]], ks, alpha_is_lower_bound: bool) -> dict[str, Any]:
    """The held-out figures (`heldout.heldout_figures`) of every process's `evaluate_part`; tau(k) simulated from
    the greedy agreements."""
    agreements = pooled(parts, "agreements")
    return heldout_figures(pooled(parts, "alphas"), [x for row in agreements for x in row],
                           simulated_tau(agreements, ks), pooled(parts, "ranks"), alpha_is_lower_bound,
                           pooled_at(parts))


class PlainTraining:
    """A token-only draft for the trainer (train/distill.py): built here, its loss per micro-batch, its held-out
    figures. `model` is the draft to optimise (a peft model with lora=true)."""

    def __init__(self, cfg, target, tokenizer, vocabulary, device):
        self.cfg, self.pad_id, self.eos_id = cfg, tokenizer_pad_id(tokenizer), tokenizer.eos_token_id
        model = draft_lib.build_draft(cfg.draft, target, cfg.draft_layers, cfg.draft_config, cfg.seed, device)
        own_tokenizer = cfg.draft in (draft_lib.DERIVED, draft_lib.SCRATCH)
        check_compatible(tokenizer, tokenizer if own_tokenizer else load_tokenizer(cfg.draft), target, model)
        vocab = model.get_input_embeddings().num_embeddings
        size = draft_lib.kept_vocab_size(cfg, vocab)
        if size:
            draft_lib.reduce_vocab(model, vocabulary(vocab, size).to(device))
        self.id_map = draft_to_target_map(model)
        self.target = target if cfg.needs_target else None  # derived from it; the offline teacher needs no more
        target_vocab = target.get_output_embeddings().out_features if target is not None else len(tokenizer)
        self.inv_map = losses.target_to_draft_map(self.id_map, max(target_vocab, len(tokenizer)))
        # at least the target's vocabulary (a padded draft head may be wider): what a stored top-n leaves unseen
        self.target_vocab = max(target_vocab, len(tokenizer), model.get_output_embeddings().out_features)
        if cfg.freeze_embeddings:
            model.get_input_embeddings().weight.requires_grad_(False)
        if cfg.freeze_head:
            model.get_output_embeddings().requires_grad_(False)
        self.student_vocab = model.get_output_embeddings().out_features
        if cfg.lora:
            model = draft_lib.add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
        self.model = model

    # The trainer's loader reads nothing ahead for a token-only draft, and its loss is each micro-batch's mean.
    prefetch = None

    def counts(self, batch: dict) -> None:
        return None

    def loss(self, model, batch: dict, micro: int, rank: int, prefetched=None, denominators=None) -> torch.Tensor:
        """The loss of micro-batch `micro` (on-policy draws are seeded by it: the same on every rank and resume)."""
        cfg = self.cfg
        if cfg.teacher == "on_policy" and random.Random(cfg.seed * 7919 + micro).random() < cfg.on_policy_fraction:
            gen = torch.Generator(device=batch["input_ids"].device).manual_seed(cfg.seed * 1_000_003 + micro * 131 + rank)
            batch = on_policy_batch(model, batch, cfg.on_policy_max_new_tokens, cfg.on_policy_temperature,
                                    self.id_map, self.pad_id, self.eos_id, gen)
        student = _forward(model, batch)
        teacher = (teacher_logits(self.target, batch, self.student_vocab, self.id_map, self.inv_map)
                   if losses.reads_teacher(cfg) else None)
        return compute_loss(cfg, student, teacher, batch, self.inv_map)

    def evaluate(self, model, chunks, gather) -> dict[str, Any]:
        """Held-out figures over every process's `chunks`, merged through `gather` (accelerate's gather_object)."""
        with evaluating(model):
            part = evaluate_part(model, self.target, chunks, self.id_map, self.cfg.heldout_temperatures,
                                 self.target_vocab)
        return merge_parts(gather([part]), self.cfg.eval_k, alpha_is_lower_bound=self.target is None)
