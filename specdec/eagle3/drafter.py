"""Decoding with an EAGLE-3 draft (specdec/drafter.py's interface): the target's hidden states, recorded during its
own forwards, feed each round's first proposal; the draft's own outputs feed the later ones."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from specdec.drafter import Drafter
from specdec.eagle3.model import Eagle3Draft
from specdec.eagle3.states import HiddenStateRecorder
from specdec.kv import Batch, rollback


class _HiddenWindow:
    """The target's hidden states at the positions the draft has yet to read, [B, n, W] from position `start`.

    Written after each target forward (prompt, then each verification), read once per round; what the draft has
    read is then dropped, since its KV cache holds it: the buffer stays a few positions long."""

    def __init__(self, prompt_states: torch.Tensor):
        self.start, self.values = 0, prompt_states

    def write(self, position: int, values: torch.Tensor) -> None:
        """States from `position` on (later positions, read with guessed states, are replaced)."""
        self.values = torch.cat([self.values[:, : position - self.start], values], dim=1)

    def read(self, start: int, stop: int) -> torch.Tensor:
        """States at positions start..stop-1; positions before `stop` are then dropped (the next round starts there)."""
        out = self.values[:, start - self.start : stop - self.start]
        self.values, self.start = self.values[:, stop - self.start :], stop
        return out


class Eagle3Drafter(Drafter):
    """Drafting with an EAGLE-3 draft: draft position t reads x_{t+1} and the target's hidden states at t.

    A round starting at length L first feeds the positions the draft has not read, up to L - 2, with the target's
    states, then feeds back its own output for each further proposal. Those guessed positions (L - 1 on) are
    dropped afterwards (`rollback`): the next round re-reads them with the target's states, which its
    verification forward has computed by then (`observe`)."""

    def __init__(self, draft: Eagle3Draft, target: nn.Module, sampling):
        super().__init__(draft, target, sampling)
        self.recorder = HiddenStateRecorder(target, draft.layer_ids)
        self.cache = DynamicCache(config=draft.config)
        self.window: _HiddenWindow | None = None
        self.round_length = 1

    def start(self, batch: Batch) -> None:
        self.window = _HiddenWindow(self.recorder.latest)

    def observe(self, position: int, keep: list[int] | None = None) -> None:
        states = self.recorder.latest
        self.window.write(position, states if keep is None else states[:, keep])

    def rollback(self, batch: Batch) -> None:
        rollback(self.cache, self.round_length - 1)

    def close(self) -> None:
        self.recorder.close()

    def timed_step(self, batch: Batch) -> None:
        start = self.cache.get_seq_length()
        inputs = batch.model_inputs(start, start + 1)
        states = self.recorder.latest[:, -1:]  # the target's latest states: the values do not change the cost
        self.model(batch.seq[:, start + 1 : start + 2], states, inputs["position_ids"], True, self.cache,
                   inputs["attention_mask"], logits_to_keep=1)
        rollback(self.cache, start)

    def tree_root(self, batch: Batch):
        if self.model.parallel:
            raise ValueError("a P-EAGLE draft (ptd_token_id in its config.json) proposes a chain of k in one "
                             "forward, not a tree: drop tree= (use num_draft_tokens)")
        length = self.round_length = batch.length
        start = self.cache.get_seq_length()
        inputs = batch.model_inputs(start, length - 1)
        out, logits = self.model(batch.seq[:, start + 1 : length], self.window.read(start, length - 1),
                                 inputs["position_ids"], True, self.cache, inputs["attention_mask"], logits_to_keep=1)
        return self.log_probs(logits[0, -1]), out[0, -1:]

    def tree_step(self, tokens, parent_states, depths, allowed):
        # A node at depth d is fed at draft position L - 2 + d (a round's j-th proposal is fed at L - 2 + j).
        device = self.model.device
        positions = torch.tensor(depths, device=device)[None] + self.round_length - 2
        out, logits = self.model(tokens[None].to(device), parent_states[None], positions, False, self.cache,
                                 tree_mask=allowed)
        return self.log_probs(logits[0]), out[0]

    def tree_rollback(self) -> None:
        rollback(self.cache, self.round_length - 1)

    def propose(self, batch: Batch, k: int, generator, stats):
        if self.model.parallel:
            return self.propose_parallel(batch, k, generator, stats)
        length = self.round_length = batch.length
        start = self.cache.get_seq_length()
        ids, hidden, from_target = batch.seq[:, start + 1 : length], self.window.read(start, length - 1), True
        inputs = batch.model_inputs(start, length - 1)
        tokens, qs = [], []
        for j in range(k):
            out, logits = self.model(ids, hidden, inputs["position_ids"], from_target, self.cache,
                                     inputs["attention_mask"], logits_to_keep=1)
            stats.draft_forwards += 1
            token = self.pick(logits, batch, generator, qs)
            tokens.append(token)
            batch.seq[:, length + j] = token
            ids, hidden, from_target = token[:, None], out[:, -1:], False
            inputs = batch.model_inputs(length - 1 + j, length + j)
        return torch.stack(tokens, dim=1), (torch.stack(qs, dim=1) if qs else None)

    def propose_parallel(self, batch: Batch, k: int, generator, stats):
        """P-EAGLE: the round's k proposals from one forward, as vLLM's parallel drafting feeds it. The unread true
        positions (up to L - 2: the last proposes token L) are followed by k - 1 masked slots at L - 1 .. L + k - 3
        (the mask token, `mask_hidden` for the target's states), slot j proposing token L + j; each proposal is
        picked from its own q. `rollback` then drops the slots, as it drops a chain's guessed positions."""
        length = self.round_length = batch.length
        start = self.cache.get_seq_length()
        true_ids = batch.seq[:, start + 1 : length]
        rows, width = true_ids.shape[0], self.model.mask_hidden.numel()
        masked = torch.full((rows, k - 1), self.model.ptd_token_id, dtype=true_ids.dtype, device=true_ids.device)
        states = self.window.read(start, length - 1).to(self.model.dtype)
        hidden = torch.cat([states, self.model.mask_hidden.to(states.dtype).expand(rows, k - 1, width)], dim=1)
        inputs = batch.model_inputs(start, length - 2 + k)
        _, logits = self.model(torch.cat([true_ids, masked], dim=1), hidden, inputs["position_ids"], True,
                               self.cache, inputs["attention_mask"], logits_to_keep=k)
        stats.draft_forwards += 1
        tokens, qs = [], []
        for j in range(k):
            token = self.pick(logits[:, j : j + 1], batch, generator, qs)
            tokens.append(token)
            batch.seq[:, length + j] = token
        return torch.stack(tokens, dim=1), (torch.stack(qs, dim=1) if qs else None)
