"""The draft's side of speculative decoding: one interface for every kind of draft.

    drafter = make_drafter(draft, target, sampling)   # before the target's prefill: it may watch its forwards
                                                       # (specdec/draft_registry.py: the draft's kind makes it)
    drafter.start(batch)                               # after the prefill
    tokens, q = drafter.propose(batch, k, gen, stats)  # [B, k] target ids; q [B, k, V] when sampling, else None
    drafter.observe(position)                          # after each target forward, which computed from `position` on
    drafter.rollback(batch)                            # after verification: keep what the target accepted
    drafter.close()

A round of a draft tree (specdec/tree.py) uses `tree_root`, `tree_step`, `tree_cached` and `tree_rollback` instead
of `propose` and `rollback`; `observe(position, keep)` then gets the forward's rows that became the sequence.

A plain draft (any causal LM over the target's tokenizer) keeps its own KV cache over the token buffer. A kind of
draft that needs more (an EAGLE-3 draft reads the target's hidden states: specdec/eagle3/drafter.py) returns its
own subclass from its kind's `drafter` (specdec/draft_kind.py); the decode loop never asks which kind it holds.
"""

from __future__ import annotations

import torch

from specdec.kv import Batch, cache_kwarg, forward_cached, forward_masked, prefill, rollback
from specdec.sampling import SamplingConfig, probabilities, sample_from
from specdec.vocab import draft_to_target_map


class Drafter:
    """Proposal picking and the vocabulary map, shared by every kind of draft."""

    def __init__(self, draft, target, sampling: SamplingConfig):
        self.model, self.sampling = draft, sampling
        self.vocab = target.get_output_embeddings().out_features
        rows = draft.get_output_embeddings().out_features
        id_map = draft_to_target_map(draft)
        if id_map is None and rows < self.vocab:
            id_map = torch.arange(rows)  # a smaller padded vocabulary: the first `rows` ids, q = 0 beyond
        self.rows = rows if id_map is not None else min(rows, self.vocab)
        self.id_map = None if id_map is None else id_map.to(next(target.parameters()).device)

    def start(self, batch: Batch) -> None:
        """Called once after the target's prefill."""

    def observe(self, position: int, keep: list[int] | None = None) -> None:
        """Called after each target forward, which computed positions `position` onwards (in a tree round: its
        rows `keep`, the root and the accepted path)."""

    def rollback(self, batch: Batch) -> None:
        """Called after verification: drop what was computed from rejected proposals."""

    def close(self) -> None:
        """Called once when decoding ends (also after a failure)."""

    def propose(self, batch: Batch, k: int, generator, stats) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def timed_step(self, batch: Batch) -> None:
        """One draft forward of one new position, as a round's first proposal after a rejection, then undone:
        what `specdec eval` times as the draft's per-token cost. Needs one token appended after the prompt."""
        raise NotImplementedError

    # ---- draft trees (specdec/tree.py: `grow` calls these)
    def tree_root(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [V_draft] of the token after the last emitted one, and the state [1, ...] its children read."""
        raise NotImplementedError(f"{type(self.model).__name__} drafts cannot propose trees")

    def tree_step(self, tokens, parent_states, depths: list[int], allowed: torch.Tensor):
        """Feed m tree nodes (target ids [m], at `depths` below the root) attending as `allowed` [m, cached + m]
        says: their log-probs [m, V_draft] and states [m, ...] (None when the draft has none)."""
        raise NotImplementedError(f"{type(self.model).__name__} drafts cannot propose trees")

    def tree_cached(self) -> int:
        """Positions in the draft's cache (the mask columns before the next tree step)."""
        return self.cache.get_seq_length()

    def tree_rollback(self) -> None:
        """After a tree round: drop the tree from the draft's cache (the accepted path is read next round)."""
        raise NotImplementedError

    def to_target_ids(self, local: torch.Tensor) -> torch.Tensor:
        """Draft head rows -> target ids (the identity without an id map)."""
        return local if self.id_map is None else self.id_map[local]

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft log-probs over its head's rows (raw logits: the tree's ranking, whatever the sampling).  [..., V_d]"""
        return torch.log_softmax(logits[..., : self.rows].float(), dim=-1)

    def pick(self, logits: torch.Tensor, batch: Batch, generator, qs: list) -> torch.Tensor:
        """The draft's token (target ids) from its last logits [B, n, V_draft]; appends q when sampling.  [B]"""
        if logits.dim() != 3 or logits.shape[0] != batch.seq.shape[0] or logits.shape[-1] < self.rows:
            raise RuntimeError(f"draft returned logits of shape {tuple(logits.shape)}")
        logits = logits[:, -1, : self.rows]  # [B, V_draft]
        if self.sampling.greedy:
            local = logits.argmax(dim=-1)
        else:
            q_local = probabilities(logits, self.sampling)
            local = sample_from(q_local, generator)
            qs.append(self.to_target_space(q_local))
        return self.to_target_ids(local)

    def to_target_space(self, q_local: torch.Tensor) -> torch.Tensor:
        """q over the draft's head -> q over the target's vocabulary, zero outside the draft's ids.  [B, V]"""
        if self.id_map is None:
            return q_local
        q = q_local.new_zeros(q_local.shape[0], self.vocab)
        return q.index_copy_(1, self.id_map, q_local)


class PlainDrafter(Drafter):
    """A causal LM drafting from tokens alone, from its own KV cache (it never re-reads the accepted prefix)."""

    def start(self, batch: Batch) -> None:
        self.kwarg = cache_kwarg(self.model)
        self.cache, _ = prefill(self.model, batch, self.kwarg)

    def rollback(self, batch: Batch) -> None:
        # Keep what the draft has read of the accepted sequence: it may lag one token (after a full accept it
        # has not read the k-th proposal), which it reads first next round.
        rollback(self.cache, min(self.cache.get_seq_length(), batch.length - 1))

    def timed_step(self, batch: Batch) -> None:
        start = self.cache.get_seq_length()
        forward_cached(self.model, self.cache, batch, start + 1, 1, self.kwarg)
        rollback(self.cache, start)

    def tree_root(self, batch: Batch):
        logits = forward_cached(self.model, self.cache, batch, batch.length, 1, self.kwarg)
        self.tree_base = self.cache.get_seq_length()
        self.root_position = batch.length - 1 - int(batch.left_pad[0])
        return self.log_probs(logits[0, -1]), None

    def tree_step(self, tokens, parent_states, depths, allowed):
        device = next(self.model.parameters()).device
        positions = torch.tensor(depths, device=device)[None] + self.root_position
        logits = forward_masked(self.model, self.cache, tokens[None].to(device), positions, allowed, self.kwarg)
        return self.log_probs(logits[0]), None

    def tree_rollback(self) -> None:
        rollback(self.cache, self.tree_base)

    def propose(self, batch: Batch, k: int, generator, stats):
        tokens, qs = [], []
        stop = batch.length
        for _ in range(k):
            logits = forward_cached(self.model, self.cache, batch, stop, 1, self.kwarg)
            stats.draft_forwards += 1
            token = self.pick(logits, batch, generator, qs)
            tokens.append(token)
            # Proposals live in the buffer past the sequence end; verification overwrites what it rejects.
            batch.seq[:, stop] = token
            stop += 1
        return torch.stack(tokens, dim=1), (torch.stack(qs, dim=1) if qs else None)

