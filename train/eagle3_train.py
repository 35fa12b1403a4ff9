"""Training and held-out scoring of an EAGLE-3 draft (specdec/eagle3/).

Training-time test (EAGLE-3's scheme, Li et al. 2025, arXiv:2503.01840): at decode time only the first proposal
of a round reads the target's hidden states; proposal j reads the draft's own output from proposal j - 1. Each
batch therefore runs `ttt_steps` unrolled proposals over the whole sequence (`Eagle3Draft.unrolled`, whose step
j equals the decoder's j-th proposal), and the loss is the decayed mean of each step's loss:

    loss = sum_j decay^(j-1) loss_j / sum_j decay^(j-1)      (EAGLE-3 and SpecForge weigh step j by 0.8^(j-1))

loss_j, at the positions whose target token lies in the draft vocabulary (EAGLE-3's position mask), is the
configured loss (train/losses.py) of the draft against the target's distribution over the draft vocabulary,
renormalised there (and its tokens, for ce): online, the target's own head rows applied to its recorded final hidden state (no target forward),
or offline from the stored top-n log-probs. The target's states of each batch are read from the data stage's
recording (`specdec data record_features=true`) or computed by the target for that batch, and never all kept
(train/eagle3_states.py). Each step's loss is summed over chunks of positions, so no [positions, vocabulary]
tensor of a whole batch exists, and divided by the step's scored positions over every process and micro-batch:
two processes train exactly as one at the same global batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from specdec.compat import check_compatible
from specdec.eagle3 import Eagle3Draft, positions_in_documents, unrolled_ranks
from specdec.replay import runs_from_ranks, tau_from_runs
from specdec.train import losses
from specdec.train.batches import place
from specdec.train.draft import kept_vocab_size
from specdec.train.eagle3_states import States, StatesReader
from specdec.train.heldout import (
    collect_alphas,
    evaluating,
    heldout_figures,
    pooled,
    pooled_at,
    temperature_key,
)

log = logging.getLogger(__name__)


def teacher_head(target_head: torch.nn.Module, kept_ids: torch.Tensor) -> torch.nn.Module:
    """The online teacher's head: the target's rows of the draft's ids, frozen. Restricting the rows gives the
    same logits as restricting the full output (`losses.restrict_teacher`) for draft_vocab / V of the work."""
    rows = torch.nn.Linear(target_head.in_features, kept_ids.numel(), bias=target_head.bias is not None,
                           device=target_head.weight.device, dtype=target_head.weight.dtype)
    with torch.no_grad():
        rows.weight.copy_(target_head.weight[kept_ids.to(target_head.weight.device)])
        if target_head.bias is not None:
            rows.bias.copy_(target_head.bias[kept_ids.to(target_head.bias.device)])
    return rows.requires_grad_(False)


def step_weights(steps: int, decay: float) -> list[float]:
    """decay^(j-1) for j = 1..steps, normalised to sum to one (the loss keeps its scale whatever `steps`)."""
    raw = [decay ** j for j in range(steps)]
    return [w / sum(raw) for w in raw]


# The loss is taken over chunks of scored positions whose [positions, draft vocabulary] float32 logits hold about
# this many values each; beyond one chunk each is recomputed in the backward pass instead of kept (checkpointed),
# so the loss's memory stays bounded however many positions a batch scores (a 32k head at 16k positions would
# otherwise keep several 2 GB tensors per unrolled step).
LOSS_CHUNK_VALUES = 1 << 24


def loss_chunk_rows(draft_vocab_size: int) -> int:
    """Scored positions per chunk of the loss (and of the held-out alpha): LOSS_CHUNK_VALUES logits each."""
    return max(1, LOSS_CHUNK_VALUES // draft_vocab_size)


def scored_positions(cfg, batch: dict, inv_map, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per unrolled step j, the [B, S - 1] mask of positions its loss scores, and the target's tokens there in
    draft ids. Step j at t belongs to the round starting at t - (j - 1) >= 0; EAGLE-3's position mask keeps the
    positions whose target token the draft can propose.  -> ([steps, B, S - 1] bool, [B, S - 1] long)"""
    labels = batch["labels"][:, 1:]  # draft position t proposes x_{t+2}, which target position t + 1 predicts
    local, inside = losses.targets_in_draft_ids(labels, inv_map, draft_vocab_size)
    scored = batch["loss_mask"][:, 1:].bool() & inside
    if "document_ids" in batch:  # packed rows: a round starts within its own document
        position = positions_in_documents(batch["document_ids"][:, :-1])
    else:
        position = torch.arange(scored.shape[1], device=scored.device)[None]
    return torch.stack([scored & (position >= step) for step in range(cfg.options.ttt_steps)]), local


def _loss_sum(cfg, inner, target_head, vocab_map, prenorm, teacher_in, top_ids, top_logprobs, local) -> torch.Tensor:
    """The summed loss over a chunk of scored positions.  prenorm [N, H]; teacher_in [N, H_t] or None."""
    student = inner.logits(prenorm).float()
    teacher = None
    if losses.reads_teacher(cfg) and target_head is not None:  # online: the target's head rows on its state at t + 1
        teacher = target_head(teacher_in.to(target_head.weight.dtype)).float()
    elif losses.reads_teacher(cfg):  # offline: the stored top-n
        teacher = losses.dense_teacher_logits(top_ids, top_logprobs, student.shape[-1], vocab_map)
    return losses.configured_loss(cfg, student, teacher, local, summed=True)


def eagle3_loss(cfg, draft, batch: dict, states: torch.Tensor, target_head, inv_map,
                denominators: torch.Tensor | None = None) -> torch.Tensor:
    """The decayed mean over unrolled steps of the configured loss at the scored positions (`scored_positions`).

    `states` = [B, S, (1 + 3) H] (`eagle3_states.States`); `target_head` = `teacher_head` (online) or None (the
    stored top-n). Step j's summed loss is divided by `denominators[j]`, the scored positions of the whole
    optimizer step over every process and micro-batch, times their number (the trainer passes it: gradients are
    then those of one process at the same global batch); None: this batch's own counts."""
    inner = getattr(draft, "module", draft)
    hidden = inner.config.target_hidden_size
    # Through the (possibly DDP-wrapped) forward, so that gradients synchronise across processes.
    outs = draft(batch["input_ids"], states[..., hidden:], attention_mask=batch["attention_mask"],
                 ttt_steps=cfg.options.ttt_steps, document_ids=batch.get("document_ids"))
    masks, local = scored_positions(cfg, batch, inv_map, inner.config.draft_vocab_size)
    if denominators is None:
        denominators = masks.flatten(1).sum(1).clamp(min=1)
    # Every parameter in the graph, even where nothing is scored: DDP's reducer expects a gradient for each.
    total = sum(out.sum() for out in outs) * 0.0 + inner.logits(outs[-1][:, :1]).sum() * 0.0
    chunk = loss_chunk_rows(inner.config.draft_vocab_size)
    weights = step_weights(cfg.options.ttt_steps, cfg.options.ttt_decay)
    for out, mask, weight, denominator in zip(outs, masks, weights, denominators):
        picked = [out[mask], states[:, 1:, :hidden][mask] if target_head is not None else None,
                  batch["top_ids"][:, 1:][mask] if target_head is None and "top_ids" in batch else None,
                  batch["top_logprobs"][:, 1:][mask] if target_head is None and "top_logprobs" in batch else None,
                  local[mask]]
        count = picked[0].shape[0]
        for start in range(0, count, chunk):
            part = [x[start:start + chunk] if x is not None else None for x in picked]
            if count > chunk:  # recomputed in backward: only one chunk's logits exist at a time
                step_sum = checkpoint(_loss_sum, cfg, inner, target_head, inv_map, *part, use_reentrant=False)
            else:
                step_sum = _loss_sum(cfg, inner, target_head, inv_map, *part)
            total = total + weight * step_sum / denominator
    return total


@torch.no_grad()
def evaluate_part(draft, states, chunks, ks: Sequence[int], temperatures: Sequence[float] = ()) -> dict[str, list]:
    """This process's share of the held-out figures: the ranks of the target's tokens among the draft's
    proposals, unrolled max(ks) deep exactly as the decoder proposes, and alpha per position (a lower bound from
    the stored top-n) at temperature 1 and at each of `temperatures` (`alphas_at`). `chunks` yields (rows,
    collated batch); `states` is an `eagle3_states.States`."""
    hidden = draft.config.target_hidden_size
    ranks, alphas = [], []
    alphas_at: dict[str, list] = {temperature_key(t): [] for t in temperatures}
    for rows, batch in chunks:
        full = states.complete(batch, states.read(rows, batch["input_ids"].shape[1]))[..., hidden:]
        outs = draft.unrolled(batch["input_ids"], full, batch["attention_mask"], max(ks))
        ranks += unrolled_ranks(draft, batch["input_ids"], batch["attention_mask"], batch["loss_mask"], max(ks), full,
                                outs)
        if "top_ids" in batch:
            first = outs[0]  # step 1: the rounds' first proposals
            mask = batch["loss_mask"][:, 1:].bool()
            prenorm, top_ids, top_lp = first[mask], batch["top_ids"][:, 1:][mask], batch["top_logprobs"][:, 1:][mask]
            chunk = loss_chunk_rows(draft.config.draft_vocab_size)  # [chunk, vocabulary] at a time
            for s in range(0, len(prenorm), chunk):
                alpha_at = partial(losses.acceptance_alpha_topn, draft.logits(prenorm[s:s + chunk]).float(),
                                   top_ids[s:s + chunk], top_lp[s:s + chunk], None, draft.draft_to_target,
                                   target_vocab=draft.config.vocab_size)
                collect_alphas(alpha_at, temperatures, alphas, alphas_at)
    return {"ranks": ranks, "alphas": alphas, "alphas_at": alphas_at}


def merge_parts(parts: list[dict[str, list]], ks: Sequence[int]) -> dict[str, Any]:
    """The held-out figures (`heldout.heldout_figures`) of every process's `evaluate_part`: greedy agreement at the
    first proposal of each round, tau(k) from the accepted runs, alpha a lower bound (the stored top-n)."""
    ranks = pooled(parts, "ranks")
    runs = runs_from_ranks(ranks, [1] * max(ks))
    return heldout_figures(pooled(parts, "alphas"), [r >= 1 for row in runs for r in row], tau_from_runs(runs, ks),
                           ranks, alpha_is_lower_bound=True, alphas_at=pooled_at(parts))


class StatesTraining:
    """What the trainings of the drafts that read the target's states share (EAGLE-3, P-EAGLE, DFlash: train/
    dflash_train.py): the online teacher's head rows, the target-to-draft id map and the target's states per
    batch, recorded or computed (train/eagle3_states.py). A subclass sets `cfg` and `autocast` first."""

    def take_draft(self, model, target, tokenizer, device, folders) -> None:
        """Train `model` (float32 on `device`) against `target`, its states read from `folders` or computed."""
        model = model.float().to(device)
        check_compatible(tokenizer, tokenizer, target, model)
        self.teacher = teacher_head(target.get_output_embeddings(), model.kept_ids()) \
            if self.cfg.teacher == "online" else None
        self.inv_map = losses.target_to_draft_map(model.draft_to_target, target.get_output_embeddings().out_features)
        width = (1 + len(model.layer_ids)) * model.config.target_hidden_size
        reader = StatesReader(folders, model.layer_ids, width)
        self.states = States(self.cfg.options.states, target, self.autocast, reader, model.layer_ids)
        self.prefetch = partial(read_ahead, self.states.source, reader)
        self.model = model

    def batch_states(self, batch: dict, prefetched) -> torch.Tensor:
        """The target's states of a micro-batch, completed from what the loader read ahead."""
        states = self.states.complete(batch.get("unpacked", batch), prefetched)
        if "segments" in batch:  # packed: each sample's states at its place in the packed rows
            states = place(states, batch)
        return states


def kept_ids(cfg, target, vocabulary) -> torch.Tensor | None:
    """The target ids the draft's head keeps (None: all of them), from the run's draft_vocab_size."""
    vocab = target.get_input_embeddings().num_embeddings
    size = kept_vocab_size(cfg, vocab)
    return vocabulary(vocab, size) if size else None


class Eagle3Training(StatesTraining):
    """An EAGLE-3 draft for the trainer (train/distill.py): built here, its loss per micro-batch, its held-out
    figures; the target's states are read per batch from the data stage's recording or computed per batch
    (train/eagle3_states.py)."""

    def __init__(self, cfg, target, tokenizer, vocabulary, device, autocast, folders):
        self.cfg, self.autocast = cfg, autocast
        opts = cfg.options  # train/kinds/eagle3.py: Eagle3Options
        model = Eagle3Draft.from_target(target, opts.eagle_aux_layer_ids or None, kept_ids(cfg, target, vocabulary),
                                        cfg.seed, layer_init=opts.layer_init, fc_init=opts.fc_init,
                                        norm_before_residual=opts.norm_before_residual,
                                        **self.draft_extras(opts, target, tokenizer))
        if cfg.freeze_head:
            model.lm_head.requires_grad_(False)
        self.take_draft(model, target, tokenizer, device, folders)

    def draft_extras(self, opts, target, tokenizer) -> dict:
        """Further `Eagle3Draft.from_target` arguments of a variant (P-EAGLE's mask token)."""
        return {}

    def counts(self, batch: dict) -> torch.Tensor:
        """The positions each unrolled step scores in `batch`.  [ttt_steps]"""
        masks, _ = scored_positions(self.cfg, batch, self.inv_map, self.model.config.draft_vocab_size)
        return masks.flatten(1).sum(1)

    def loss(self, model, batch: dict, micro: int, rank: int, prefetched, denominators=None) -> torch.Tensor:
        states = self.batch_states(batch, prefetched)
        with self.autocast():  # the head and the teacher's too, in bf16 where the run's mixed precision says so
            return eagle3_loss(self.cfg, model, batch, states, self.teacher, self.inv_map, denominators)

    def evaluate(self, model, chunks, gather) -> dict[str, Any]:
        """Held-out figures over every process's `chunks`, merged through `gather` (accelerate's gather_object)."""
        with evaluating(getattr(model, "module", model)) as inner:
            part = evaluate_part(inner, self.states, chunks, self.cfg.eval_k, self.cfg.heldout_temperatures)
        return merge_parts(gather([part]), self.cfg.eval_k)


class PEagleTraining(Eagle3Training):
    """P-EAGLE (parallel drafting): the same run with the parallel objective. `Eagle3Draft.unrolled` computes it for
    a draft with a mask token: step j >= 2 at each position reads the mask token and the learned `mask_hidden`
    instead of the draft's own previous output, so the decayed loss over `ttt_steps` steps trains the k proposals
    of one forward, as vLLM's parallel drafting reads them."""

    def draft_extras(self, opts, target, tokenizer) -> dict:
        return {"ptd_token_id": mask_token_id(opts.ptd_token_id, tokenizer, target)}


def mask_token_id(configured: int, tokenizer, target) -> int:
    """The configured mask token, else the tokenizer's pad token, else its EOS (the masked slots' token only
    marks them: its embedding is the target's, frozen; `mask_hidden` is what is learned)."""
    if configured >= 0:
        return configured
    for token in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                  getattr(target.config, "eos_token_id", None)):
        if isinstance(token, int):
            return token
    raise ValueError("draft=peagle needs a mask token: set ptd_token_id (the tokenizer has no pad or EOS token)")


def read_ahead(source: str, reader: StatesReader, rows: dict, batch: dict):
    """What the trainer's loader reads for a micro-batch before its step: the rows' recorded states."""
    unpacked = batch.get("unpacked", batch)
    return States(source, None, None, reader, []).read(rows, unpacked["input_ids"].shape[1])
