"""Decoding with a DFlash draft (specdec/drafter.py's interface): a round proposes its k tokens in one forward.

The round starting at length L feeds one block: the last accepted token (position L - 1, the anchor) and mask
tokens at L, L + 1, ..; mask slot j proposes the token at L - 1 + j. The block attends to the draft's context
cache, the projected keys and values of the target's states at positions 0 .. L - 2, all of them accepted
tokens: the cache grows by what the last verification accepted and never rolls back. The block itself is never
cached. It has the trained `block_size` slots (k + 1 when k is larger), so every round computes what training
and the held-out replay compute."""

from __future__ import annotations

import torch
from torch import nn

from specdec.dflash.model import AnchoredMask, DFlashDraft
from specdec.drafter import Drafter
from specdec.eagle3.drafter import _HiddenWindow
from specdec.eagle3.states import HiddenStateRecorder
from specdec.kv import Batch


class DFlashDrafter(Drafter):
    def __init__(self, draft: DFlashDraft, target: nn.Module, sampling):
        super().__init__(draft, target, sampling)
        self.recorder = HiddenStateRecorder(target, draft.layer_ids)
        self.window: _HiddenWindow | None = None
        self.context: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.cached = 0  # context positions in the cache

    def start(self, batch: Batch) -> None:
        self.window = _HiddenWindow(self.recorder.latest)

    def observe(self, position: int, keep: list[int] | None = None) -> None:
        states = self.recorder.latest
        self.window.write(position, states if keep is None else states[:, keep])

    def close(self) -> None:
        self.recorder.close()

    def _extend_context(self, batch: Batch, stop: int, states: torch.Tensor | None = None) -> None:
        """Project the target's states at positions `cached` .. stop - 1 into every layer's context cache."""
        if stop <= self.cached:
            return
        states = self.window.read(self.cached, stop) if states is None else states
        positions = batch.model_inputs(self.cached, stop)["position_ids"]
        new = self.model.context(states, positions)
        self.context = new if self.context is None else [
            (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2)) for (k, v), (nk, nv) in zip(self.context, new)]
        self.cached = stop

    def _block(self, batch: Batch, slots: int) -> torch.Tensor:
        """Logits [B, slots, V_draft] of the block anchored at the last accepted token."""
        anchor = batch.length - 1
        ids = torch.full((batch.seq.shape[0], slots), self.model.mask_token_id, dtype=torch.long,
                         device=batch.seq.device)
        ids[:, 0] = batch.seq[:, anchor]
        positions = batch.model_inputs(anchor, anchor + slots)["position_ids"]
        context = torch.ones(batch.seq.shape[0], self.cached, dtype=torch.bool, device=batch.seq.device)
        if batch.mask is not None:
            context = batch.mask[:, : self.cached].bool()
        return self.model.block(ids, positions, self.context, AnchoredMask(context[:, None], slots))

    def propose(self, batch: Batch, k: int, generator, stats):
        self._extend_context(batch, batch.length - 1)
        logits = self._block(batch, max(self.model.block_size, k + 1))
        stats.draft_forwards += 1
        tokens, qs = [], []
        for j in range(1, k + 1):
            token = self.pick(logits[:, j : j + 1], batch, generator, qs)
            tokens.append(token)
            batch.seq[:, batch.length - 1 + j] = token
        return torch.stack(tokens, dim=1), (torch.stack(qs, dim=1) if qs else None)

    def timed_step(self, batch: Batch) -> None:
        """One round's draft forward: one new context position (the target's latest states), then the block."""
        saved = self.context, self.cached
        if self.context is None:  # nothing cached yet: a one-position context is what the step costs
            self.cached = batch.length - 2
        self._extend_context(batch, self.cached + 1, self.recorder.latest[:, -1:])
        self._block(batch, self.model.block_size)
        self.context, self.cached = saved
