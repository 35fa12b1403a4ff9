"""Training and held-out scoring of a feature-conditioned draft (specdec/feature_draft.py).

Unrolled steps ("training-time test", as EAGLE-3 trains: Li et al. 2025, arXiv:2503.01840). At decode time
only the first proposal of a round reads the target's true feature; proposal j reads the draft's own
prediction from step j - 1 while attending to true features further back. Training on true features alone
would never show the draft its own errors, so each batch runs `steps` blocks over the whole sequence:

    block 1, draft position t: (f_t, x_{t+1}), causal attention over block 1           -> proposal 1 of a round at t
    block j, draft position t: (block j-1's output at t - 1, x_{t+1}), attending to block 1 up to t - (j - 1)
                               and to block i (2 <= i <= j) at t - (j - i) only           -> proposal j of a round at t - (j - 1)

Blocks share one KV cache and position ids, so block j's attention sees exactly what the decoder's draft
cache holds at proposal j. The same unrolling scores held-out data: for greedy data it gives, for every
round start, how many proposals in a row the target would accept, so tau(k) follows exactly as for plain
drafts (train/simulate.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specdec.feature_draft import FeatureRecorder
from train import losses


def block_mask(valid: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask of block `block` (1-based) over blocks 1..block.  valid: [B, n] -> [B, 1, n, block*n]"""
    batch, n = valid.shape
    device = valid.device
    query = torch.arange(n, device=device)[:, None]
    key = torch.arange(n, device=device)[None, :]
    parts = [(key <= query - (block - 1))[None] & valid[:, None, :].bool()]  # block 1: true features, causal
    for i in range(2, block + 1):
        parts.append((key == query - (block - i))[None].expand(batch, n, n))
    allowed = torch.cat(parts, dim=-1)[:, None]  # [B, 1, n, block*n]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def unrolled(draft, input_ids: torch.Tensor, features: torch.Tensor, attention_mask: torch.Tensor, steps: int):
    """Per block j = 1..steps: the predicted features [B, n, H], n = seq_len - 1.

    Position t of every block reads token x_{t+1}; `draft.lm_head` of its output proposes x_{t+2} (left to the
    caller, which needs it at the scored positions only: the head is most of the compute)."""
    ids = input_ids[:, 1:]
    valid = attention_mask[:, 1:]
    n = ids.shape[1]
    positions = torch.arange(n, device=ids.device)[None].expand(ids.shape[0], n)
    inner = getattr(draft, "module", draft)  # through a DDP wrapper's forward, so that gradients synchronise
    cache = DynamicCache(config=inner.config)
    feats = features[:, :-1].to(inner.dtype)
    outputs = []
    for block in range(1, steps + 1):
        mask = block_mask(valid, block, inner.dtype)
        hidden, _ = draft(ids, feats, position_ids=positions, attention_mask=mask, cache=cache, head=False)
        outputs.append(hidden)
        # block j + 1 at t reads block j's prediction at t - 1 (final feature only: auxiliary parts read zeros)
        feats = F.pad(hidden[:, :-1], (0, 0, 1, 0))
    return outputs


def target_features(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, aux_layers=()) -> torch.Tensor:
    """The target's features f: final hidden states (post-norm), then layers `aux_layers`' outputs; no head
    computed.  [B, S, (1 + len(aux_layers)) H]"""
    with FeatureRecorder(target, aux_layers) as rec, torch.no_grad():
        target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask)
        return rec.latest


def run_lengths(head, outputs, input_ids: torch.Tensor, loss_mask: torch.Tensor, id_map) -> list[list[int]]:
    """For each completion position i of each row: how many proposals in a row a round whose first proposal is
    token i would have accepted (greedy, the data being the target's greedy output), up to len(outputs)."""
    steps = len(outputs)
    preds = []
    for hidden in outputs:
        local = head(hidden).argmax(dim=-1)
        preds.append(local if id_map is None else id_map.to(local.device)[local])  # [B, n] target ids
    preds = torch.stack(preds).tolist()  # [steps][B][n], read element by element below
    runs = []
    for b, (scored, x) in enumerate(zip(loss_mask.tolist(), input_ids.tolist())):
        # scored[p] marks positions p whose next token x_{p+1} is a completion token.
        row = []
        for p in (p for p, s in enumerate(scored) if s):
            first = p + 1  # the round's first proposal is token `first`; block 1 proposes it at t = first - 2
            run = 0
            for j in range(1, steps + 1):
                t, token = first - 2 + (j - 1), first + j - 1
                if t < 0 or token >= len(x) or not scored[token - 1] or preds[j - 1][b][t] != x[token]:
                    break
                run += 1
            row.append(run)
        runs.append(row)
    return runs


def tau_from_runs(runs: Sequence[Sequence[int]], ks: Sequence[int] = range(1, 9)) -> dict[int, float]:
    """Greedy rounds over each completion (as train/simulate.py), with a round at i accepting min(run[i], k)."""
    out = {}
    for k in ks:
        rounds = tokens = 0
        for run in runs:
            n, i = len(run), 0
            while i < n:
                emitted = min(min(run[i], k) + 1, n - i)
                rounds, tokens, i = rounds + 1, tokens + emitted, i + emitted
        out[int(k)] = tokens / rounds if rounds else 0.0
    return out


class FeatureCache:
    """The target's features of each training and held-out sample, computed on first use and kept (float16, in
    host memory: 1.1 KB per token and feature layer for a 576-wide target), so later epochs and evaluations cost
    no target forward. A resumed run recomputes them as it meets each sample again. Features the data stage
    recorded (`specdec data record_features=true`) are read in up front (`preload`): no target forward at all."""

    def __init__(self, target, autocast, aux_layers=()):
        self.target, self.autocast, self.aux_layers, self.store = target, autocast, list(aux_layers), {}
        self.width = (1 + len(self.aux_layers)) * target.config.hidden_size

    @staticmethod
    def key(sample_id: str, tokens) -> tuple[str, int]:
        # Keyed by the tokens too: two data folders may reuse a prompt id for different sequences.
        return sample_id, hash(tuple(tokens))

    def preload(self, samples, max_length: int) -> int:
        """Keep recorded features: `samples` yields (sample id, input_ids, features [n <= len(input_ids), width]),
        truncated to max_length as the batches are. Returns how many were kept."""
        kept = 0
        for sid, tokens, feats in samples:
            if feats.shape[-1] != self.width:
                raise ValueError(f"recorded features are {feats.shape[-1]} wide, the draft reads {self.width} "
                                 "(another target or feature_aux_layers?): regenerate the data with this recipe")
            tokens = list(tokens)[:max_length]
            padded = torch.zeros(len(tokens), self.width, dtype=torch.float16)
            padded[: min(len(feats), len(tokens))] = feats[: len(tokens)]  # the last token was never fed: zeros
            self.store[self.key(sid, tokens)] = padded
            kept += 1
        return kept

    def __call__(self, sample_ids: list[str], batch: dict) -> torch.Tensor:
        """Features [B, S, width] (float32, on the batch's device) for the right-padded `batch`."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        keys = [self.key(sid, ids[b, : int(mask[b].sum())].tolist()) for b, sid in enumerate(sample_ids)]
        missing = [b for b, key in enumerate(keys) if key not in self.store]
        if missing:
            with self.autocast():
                fresh = target_features(self.target, ids[missing], mask[missing], self.aux_layers).float()
            for row, b in enumerate(missing):
                self.store[keys[b]] = fresh[row, : int(mask[b].sum())].to("cpu", torch.float16)
        out = torch.zeros(*ids.shape, self.width, device=ids.device)
        for b, key in enumerate(keys):
            f = self.store[key]
            out[b, : len(f)] = f.to(out.device, torch.float32)
        return out


def teacher_head(target_head: torch.nn.Module, id_map: torch.Tensor | None) -> torch.nn.Module:
    """The online teacher's head: the target's, restricted to the draft's ids when the draft's head is reduced.

    Restricting the head's rows gives the same logits as restricting its full output (`losses.restrict_teacher`)
    for N / V of the work (4,096 of 49,152 rows for the SmolLM2 feature recipe)."""
    if id_map is None:
        return target_head
    rows = torch.nn.Linear(target_head.in_features, id_map.numel(), bias=target_head.bias is not None,
                           device=target_head.weight.device, dtype=target_head.weight.dtype)
    with torch.no_grad():
        rows.weight.copy_(target_head.weight[id_map.to(target_head.weight.device)])
        if target_head.bias is not None:
            rows.bias.copy_(target_head.bias[id_map.to(target_head.bias.device)])
    return rows.requires_grad_(False)


def prompt_positions(batch: dict) -> torch.Tensor:
    """[B, S] bool: the prompt's positions j whose feature f_j is known (the teacher there: the draft at j - 1 reads
    (f_{j-1}, x_j) and proposes x_{j+1}), i.e. real tokens before the first completion position, not the last one."""
    real = batch["attention_mask"].bool()
    before_completion = batch["loss_mask"].long().cumsum(1) == 0
    not_last = F.pad(real[:, 1:], (0, 1), value=False)
    return real & before_completion & not_last


def feature_loss(cfg, draft, head, batch: dict, features: torch.Tensor, target_head, inv_map) -> torch.Tensor:
    """Mean over unrolled blocks of the configured divergence (+ ce_weight x cross-entropy) at the scored
    positions, plus feature_regression_weight x smooth-L1 between predicted and true next features; plus
    `cfg.prompt_loss_weight` x the divergence at the prompt's positions (online teacher only: no stored top-n
    there, and the prompt's tokens are not the target's, so no cross-entropy on them).
    `target_head`: the online teacher's head over the draft's ids (`teacher_head`), or None for the stored top-n."""
    outs = unrolled(draft, batch["input_ids"], features, batch["attention_mask"], cfg.feature_steps)
    scored = batch["loss_mask"][:, 1:].bool()  # draft position t proposes the token target position t + 1 predicts
    in_prompt = prompt_positions(batch)[:, 1:] if cfg.prompt_loss_weight else None
    position = torch.arange(scored.shape[1], device=scored.device)[None]
    true_next = features[:, 1:, : outs[0].shape[-1]]  # the final feature (before any auxiliary ones): the draft's aim

    def divergence(mask, student):
        if target_head is not None:  # online: the target's own head on its true features
            teacher = target_head(true_next[mask].to(target_head.weight.dtype)).float()
        else:
            teacher = losses.dense_teacher_logits(batch["top_ids"][:, 1:][mask], batch["top_logprobs"][:, 1:][mask],
                                                  student.shape[-1], inv_map)
        return losses.distill_loss(cfg.loss, *losses.with_teacher_mass(student, teacher), None, cfg.beta,
                                   cfg.temperature)

    total = 0.0
    for block, hidden in enumerate(outs, start=1):
        reachable = position >= block - 1  # block j at t belongs to a round starting at t - (j - 1) >= 0
        mask = scored & reachable
        student = head(hidden[mask]).float()
        loss = cfg.feature_regression_weight * F.smooth_l1_loss(hidden[mask].float(), true_next[mask])
        if cfg.loss != "ce":
            loss = loss + divergence(mask, student)
        if cfg.loss == "ce" or cfg.ce_weight > 0:
            labels = batch["labels"][:, 1:][mask]  # x_{t+2}
            labels = labels if inv_map is None else inv_map[labels]
            valid = (labels >= 0) & (labels < student.shape[-1])
            ce = losses.cross_entropy(student, labels.clamp(min=0), valid)
            loss = loss + (ce if cfg.loss == "ce" else cfg.ce_weight * ce)
        if in_prompt is not None and bool((prompt := in_prompt & reachable).any()):
            loss = loss + cfg.prompt_loss_weight * divergence(prompt, head(hidden[prompt]).float())
        total = total + loss
    return total / len(outs)


@torch.no_grad()
def evaluate_feature_draft(draft, head, features_of, chunks, ks: Sequence[int], id_map) -> dict[str, Any]:
    """alpha (a lower bound from the stored top-n), greedy agreement and tau(k) of a feature draft, unrolled
    max(ks) proposals deep. `chunks` yields (sample_ids, collated batch)."""
    runs, alphas = [], []
    for sample_ids, batch in chunks:
        features = features_of(sample_ids, batch)
        outs = unrolled(draft, batch["input_ids"], features, batch["attention_mask"], max(ks))
        runs += run_lengths(head, outs, batch["input_ids"], batch["loss_mask"], id_map)
        if "top_ids" in batch:
            mask = batch["loss_mask"][:, 1:].bool()
            alphas.append(losses.acceptance_alpha_topn(head(outs[0][mask]).float(), batch["top_ids"][:, 1:][mask],
                                                       batch["top_logprobs"][:, 1:][mask], None, id_map).cpu())
    flat = [r for row in runs for r in row]
    alpha = torch.cat(alphas) if alphas else torch.zeros(0)
    return {"alpha": float(alpha.mean()) if alpha.numel() else float("nan"),
            "agreement": sum(r >= 1 for r in flat) / max(len(flat), 1), "tau": tau_from_runs(runs, ks),
            "positions": len(flat), "alpha_is_lower_bound": True}
