"""Training of a parallel draft (PARD, Chen et al. 2025, arXiv 2504.18583; AMD-AGI/PARD's pard/pard_train.py): a
plain draft (train/plain_train.py builds it, by composition: derived, scratch or pretrained, LoRA or full) that
learns to propose k tokens in one forward.

Each training row is the sequence followed by k - 1 copies of it made of the mask token (specdec/parallel_draft.py:
`parallel_layout`), every copy at the sequence's positions: copy j's position t reads the real tokens up to t - j
and the masks of copies 1..j before it, and predicts token t + 1, as PARD's collator lays it out and as vLLM's
`parallel_drafting` feeds the draft (its mask j sits j positions after the round's last real token). One forward
therefore trains every depth 1..k at every position. Each copy's loss is the configured one (train/losses.py)
against the same teacher row (the target's distribution of token t + 1), averaged over copies. PARD gives each
depth its own unused id; vLLM's `pard_token` is one id, so every copy here uses that one.

Memory: the forward is k times the sequence long and its [kL, kL] mask is explicit (sdpa or eager attention), so
activations grow k-fold (train/kinds/parallel_plan.py counts them); lower max_length or parallel_tokens to fit.
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.parallel_draft import CONFIG_KEY, layout_logits, parallel_ranks, scored_in_copy
from specdec.replay import runs_from_ranks, tau_from_runs
from specdec.train import draft as draft_lib
from specdec.train import losses
from specdec.train.heldout import evaluating, heldout_figures, pooled, pooled_at
from specdec.train.plain_train import PlainTraining, compute_loss, evaluate_part, teacher_logits


class BaseDraftConfig:
    """The run's TrainConfig as plain's builder reads it: `draft` is the base the parallel draft starts from."""

    def __init__(self, cfg, base: str):
        self._cfg, self.draft = cfg, base

    def __getattr__(self, name: str):
        return getattr(self._cfg, name)


def chosen_mask_token(wanted: int, tokenizer, vocab: int) -> int:
    """The mask token id: `wanted`, or (-1) the tokenizer's highest special id other than bos, eos, pad and unk's
    roles in text (a token the data never holds, so its embedding is free to become the mask's)."""
    if wanted >= 0:
        if wanted >= vocab:
            raise ValueError(f"pard_token={wanted} is outside the draft's vocabulary of {vocab}; pick an unused id "
                             "below it (vLLM's draft_model needs the target's vocabulary, so no new row is added)")
        return wanted
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    spare = [i for i in tokenizer.all_special_ids if i not in used and i < vocab]
    if not spare:
        raise ValueError("the tokenizer has no spare special token to serve as the mask: set train.parallel."
                         "pard_token to an id the data never uses")
    return max(spare)


class ParallelTraining:
    """A parallel draft for the trainer (train/distill.py): plain's draft, loss and teacher over PARD's layout."""

    def __init__(self, cfg, target, tokenizer, vocabulary, device):
        options = cfg.options
        if target is None and options.parallel_base in (draft_lib.DERIVED, draft_lib.SCRATCH):
            raise ValueError(f"parallel_base={options.parallel_base} builds the draft from the target, which "
                             "teacher=offline does not load: use teacher=online, or a pretrained parallel_base")
        self.plain = PlainTraining(BaseDraftConfig(cfg, options.parallel_base), target, tokenizer, vocabulary, device)
        self.cfg, self.copies, self.model = cfg, options.parallel_tokens, self.plain.model
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self.mask_id = chosen_mask_token(options.pard_token, tokenizer, base.get_input_embeddings().num_embeddings)
        setattr(base.config, CONFIG_KEY, self.mask_id)  # saved with the config: what vLLM and specdec read

    prefetch = None

    def counts(self, batch: dict) -> None:
        return None

    def loss(self, model, batch: dict, micro: int, rank: int, prefetched=None, denominators=None) -> torch.Tensor:
        """The configured loss of every copy (depth), averaged over the copies that score any position."""
        plain, cfg = self.plain, self.cfg
        teacher = (teacher_logits(plain.target, batch, plain.student_vocab, plain.id_map, plain.inv_map)
                   if losses.reads_teacher(cfg) else None)
        logits = layout_logits(model, batch["input_ids"], batch["attention_mask"], self.copies, self.mask_id)
        scored_rows = batch["loss_mask"].bool()
        parts = []
        for copy in range(self.copies):
            scored = scored_in_copy(batch["loss_mask"], batch["attention_mask"], copy)
            if not bool(scored.any()):
                continue
            rows = None if teacher is None else teacher[scored[scored_rows]]
            parts.append(compute_loss(cfg, logits[copy], rows, {**batch, "loss_mask": scored}, plain.inv_map))
        return torch.stack(parts).mean()

    def evaluate(self, model, chunks, gather) -> dict[str, Any]:
        """Held-out figures: alpha and agreement of the first proposal (plain's), the ranks and tau(k) of the
        parallel rounds (every depth from one forward, as the decoder proposes), up to `parallel_tokens` deep (the
        layout's memory grows with the depth squared)."""
        chunks = list(chunks)
        steps = min(max(self.cfg.eval_k), self.copies)  # the depths it learnt; deeper rounds accept no more
        with evaluating(model):
            part = evaluate_part(model, self.plain.target, chunks, self.plain.id_map,
                                 self.cfg.heldout_temperatures, self.plain.target_vocab)
            part["ranks"] = [r for _rows, batch in chunks
                             for r in parallel_ranks(model, batch["input_ids"], batch["attention_mask"],
                                                     batch["loss_mask"], steps, self.mask_id,
                                                     self.plain.id_map)]
        parts = gather([part])
        ranks = pooled(parts, "ranks")
        tau = tau_from_runs(runs_from_ranks(ranks, [1] * steps), self.cfg.eval_k)
        agreements = [x for row in pooled(parts, "agreements") for x in row]
        return heldout_figures(pooled(parts, "alphas"), agreements, tau, ranks,
                               alpha_is_lower_bound=self.plain.target is None, alphas_at=pooled_at(parts))
