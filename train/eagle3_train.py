"""Training and held-out scoring of an EAGLE-3 draft (specdec/eagle3.py).

Training-time test (EAGLE-3's scheme, Li et al. 2025, arXiv:2503.01840): at decode time only the first proposal
of a round reads the target's hidden states; proposal j reads the draft's own output from proposal j - 1. Each
batch therefore runs `ttt_steps` unrolled proposals over the whole sequence (`Eagle3Draft.unrolled`, whose step
j equals the decoder's j-th proposal), and the loss is the decayed mean of each step's loss:

    loss = sum_j decay^(j-1) loss_j / sum_j decay^(j-1)      (EAGLE-3 and SpecForge weigh step j by 0.8^(j-1))

loss_j, at the positions whose target token lies in the draft vocabulary (EAGLE-3's position mask), is the
configured divergence between the draft and the target's distribution over the draft vocabulary, renormalised
there: online, the target's own head rows applied to its recorded final hidden state (no target forward),
or offline from the stored top-n log-probs. The target's states of each sample are read from the data stage's
recording (`specdec data record_features=true`) or computed once and kept (`StatesCache`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from specdec.compat import check_compatible
from specdec.eagle3 import Eagle3Draft, HiddenStateRecorder
from specdec.replay import runs_from_ranks, tau_from_runs, top_n_agreement
from specdec.tokens import tokenizer_pad_id
from specdec.train import draft as draft_lib
from specdec.train import losses
from specdec.train.data import read_manifest, recorded_features

log = logging.getLogger(__name__)


def target_states(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids) -> torch.Tensor:
    """The target's final hidden state (the head's input), then its residual stream after each of `layer_ids`;
    no head computed.  [B, S, (1 + len(layer_ids)) H]"""
    with HiddenStateRecorder(target, list(layer_ids), final=True) as recorder, torch.no_grad():
        target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask)
        return recorder.latest


class StatesCache:
    """The target's states (`target_states`) of each training and held-out sample, computed on first use and
    kept (float16, in host memory: 4.6 KB a token for SmolLM2 with three layers), so later epochs and
    evaluations cost no target forward. States the data stage recorded are read in up front (`preload`)."""

    def __init__(self, target, autocast, layer_ids, hidden_size: int):
        self.target, self.autocast, self.layer_ids, self.store = target, autocast, list(layer_ids), {}
        self.width = (1 + len(self.layer_ids)) * hidden_size

    @staticmethod
    def key(sample_id: str, tokens) -> tuple[str, int]:
        # Keyed by the tokens too: two data folders may reuse a prompt id for different sequences.
        return sample_id, hash(tuple(tokens))

    def preload(self, samples, max_length: int) -> int:
        """Keep recorded states: `samples` yields (sample id, input_ids, states [n <= len(input_ids), width]),
        truncated to max_length as the batches are. Returns how many were kept."""
        kept = 0
        for sid, tokens, states in samples:
            if states.shape[-1] != self.width:
                raise ValueError(f"recorded target states are {states.shape[-1]} wide, the draft reads {self.width} "
                                 "(another target or other layers?): regenerate the data with this recipe")
            tokens = list(tokens)[:max_length]
            padded = torch.zeros(len(tokens), self.width, dtype=torch.float16)
            padded[: min(len(states), len(tokens))] = states[: len(tokens)]  # the last token was never fed: zeros
            self.store[self.key(sid, tokens)] = padded
            kept += 1
        return kept

    def __call__(self, sample_ids: list[str], batch: dict) -> torch.Tensor:
        """States [B, S, width] (float32, on the batch's device) for the right-padded `batch`."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        keys = [self.key(sid, ids[b, : int(mask[b].sum())].tolist()) for b, sid in enumerate(sample_ids)]
        missing = [b for b, key in enumerate(keys) if key not in self.store]
        if missing:
            with self.autocast():
                fresh = target_states(self.target, ids[missing], mask[missing], self.layer_ids).float()
            for row, b in enumerate(missing):
                self.store[keys[b]] = fresh[row, : int(mask[b].sum())].to("cpu", torch.float16)
        out = torch.zeros(*ids.shape, self.width, device=ids.device)
        for b, key in enumerate(keys):
            states = self.store[key]
            out[b, : len(states)] = states.to(out.device, torch.float32)
        return out


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


def eagle3_loss(cfg, draft, batch: dict, states: torch.Tensor, target_head, inv_map) -> torch.Tensor:
    """The decayed mean over unrolled steps of the configured loss at the scored positions whose target token the
    draft vocabulary holds. `states` = StatesCache's [B, S, (1 + 3) H]; `target_head` = `teacher_head` (online) or
    None (the stored top-n)."""
    inner = getattr(draft, "module", draft)
    hidden = inner.config.target_hidden_size
    # Through the (possibly DDP-wrapped) forward, so that gradients synchronise across processes.
    outs = draft(batch["input_ids"], states[..., hidden:], attention_mask=batch["attention_mask"],
                 ttt_steps=cfg.ttt_steps)
    labels = batch["labels"][:, 1:]  # draft position t proposes x_{t+2}, which target position t + 1 predicts
    local = inv_map[labels] if inv_map is not None else labels
    # EAGLE-3's position mask: the target's token must be one the draft can propose.
    scored = batch["loss_mask"][:, 1:].bool() & (local >= 0) & (local < inner.config.draft_vocab_size)
    position = torch.arange(scored.shape[1], device=scored.device)[None]
    total = 0.0
    for step, (out, weight) in enumerate(zip(outs, step_weights(cfg.ttt_steps, cfg.ttt_decay)), start=1):
        mask = scored & (position >= step - 1)  # step j at t belongs to the round starting at t - (j - 1) >= 0
        if not bool(mask.any()):
            continue
        student = inner.logits(out[mask]).float()
        loss = student.new_zeros(())
        if cfg.loss != "ce":
            if target_head is not None:  # online: the target's own head rows on its final hidden state at t + 1
                teacher = target_head(states[:, 1:, :hidden][mask].to(target_head.weight.dtype)).float()
            else:
                teacher = losses.dense_teacher_logits(batch["top_ids"][:, 1:][mask],
                                                      batch["top_logprobs"][:, 1:][mask], student.shape[-1], inv_map)
            loss = loss + losses.distill_loss(cfg.loss, *losses.with_teacher_mass(student, teacher), None, cfg.beta,
                                              cfg.temperature)
        if cfg.loss == "ce" or cfg.ce_weight > 0:
            ce = losses.cross_entropy(student, local[mask].clamp(min=0))
            loss = loss + (ce if cfg.loss == "ce" else cfg.ce_weight * ce)
        total = total + weight * loss
    return total if torch.is_tensor(total) else outs[0].sum() * 0.0


@torch.no_grad()
def evaluate(draft, states_of, chunks, ks: Sequence[int]) -> dict[str, Any]:
    """alpha (a lower bound from the stored top-n), greedy agreement at the first proposal, top-n agreement per
    round position (what a tree would find) and tau(k) of an
    EAGLE-3 draft, unrolled max(ks) proposals deep exactly as the decoder proposes. `chunks` yields (sample_ids,
    collated batch)."""
    hidden = draft.config.target_hidden_size
    ranks, alphas = [], []
    for sample_ids, batch in chunks:
        states = states_of(sample_ids, batch)[..., hidden:]
        ranks += draft.replay_ranks(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], max(ks), states)
        if "top_ids" in batch:
            first = draft.unrolled(batch["input_ids"], states, batch["attention_mask"], 1)[0]
            mask = batch["loss_mask"][:, 1:].bool()
            alphas.append(losses.acceptance_alpha_topn(draft.logits(first[mask]).float(), batch["top_ids"][:, 1:][mask],
                                                       batch["top_logprobs"][:, 1:][mask], None,
                                                       draft.draft_to_target).cpu())
    runs = runs_from_ranks(ranks, [1] * max(ks))
    flat = [r for row in runs for r in row]
    alpha = torch.cat(alphas) if alphas else torch.zeros(0)
    return {"alpha": float(alpha.mean()) if alpha.numel() else float("nan"),
            "agreement": sum(r >= 1 for r in flat) / max(len(flat), 1), "tau": tau_from_runs(runs, ks),
            "positions": len(flat), "top_n_agreement": top_n_agreement(ranks), "alpha_is_lower_bound": True}


def preload_folder(cache: StatesCache, folder, layer_ids, max_length: int, sample_id) -> int:
    """Read into `cache` the target states the data stage recorded in `folder` (`record_features=true` with the
    same layers), so that they cost no target forward. Returns how many samples it read (0 when the folder has
    none, or other layers: they are then computed in the loop). `sample_id(columns, i)` names a row."""

    recorded = read_manifest(folder).get("features")
    if not recorded:
        log.info("%s has no recorded target states: computing them in the loop (specdec data "
                 "record_features=true would spare that)", folder)
        return 0
    # Folders written before the key was renamed name the decoder layers' outputs (one less) as aux_layers.
    recorded_ids = recorded.get("layer_ids") or [i + 1 for i in recorded.get("aux_layers", [])]
    if list(recorded_ids) != list(layer_ids):
        log.warning("%s recorded the target's states after layers %s, the draft reads those after %s: computing "
                    "them in the loop", folder, recorded_ids, list(layer_ids))
        return 0
    kept = sum(cache.preload(((sample_id(cols, i), cols["input_ids"][i], f) for i, f in enumerate(states)),
                             max_length) for cols, states in recorded_features(folder))
    log.info("read the target's recorded states of %d samples from %s", kept, folder)
    return kept


class Eagle3Training:
    """An EAGLE-3 draft for the trainer (train/distill.py): built here, its loss per micro-batch, its held-out
    figures; the target's states come from the data stage's recording or are computed once per sample."""

    def __init__(self, cfg, target, tokenizer, train_ds, device, autocast, folders, sample_id):
        self.cfg = cfg
        keep = None
        if cfg.draft_vocab_size:
            pad = tokenizer_pad_id(tokenizer)
            keep = draft_lib.frequent_ids(train_ds, cfg.draft_vocab_size, target.get_input_embeddings().num_embeddings,
                                          [tokenizer.eos_token_id, tokenizer.bos_token_id, pad])
        model = Eagle3Draft.from_target(target, cfg.eagle_aux_layer_ids or None, keep, cfg.seed).float().to(device)
        check_compatible(tokenizer, tokenizer, target, model)
        if cfg.freeze_head:
            model.lm_head.requires_grad_(False)
        self.teacher = teacher_head(target.get_output_embeddings(), model.kept_ids()) \
            if cfg.teacher == "online" else None
        self.inv_map = losses.target_to_draft_map(model.draft_to_target, target.get_output_embeddings().out_features)
        self.states = StatesCache(target, autocast, model.layer_ids, model.config.target_hidden_size)
        for folder in folders:
            preload_folder(self.states, folder, model.layer_ids, cfg.max_length, sample_id)
        self.model = model

    def loss(self, model, batch: dict, micro: int, rank: int, sample_ids: list[str]) -> torch.Tensor:
        return eagle3_loss(self.cfg, model, batch, self.states(sample_ids, batch), self.teacher, self.inv_map)

    def evaluate(self, model, chunks) -> dict[str, Any]:
        inner = getattr(model, "module", model)
        was_training = inner.training
        inner.eval()
        try:
            return evaluate(inner, self.states, chunks, self.cfg.eval_k)
        finally:
            inner.train(was_training)
