"""The decoders' shared state: the running token buffer (`Batch`) and the cached forwards over it.

Every KV cache is a prefix of the one token buffer `Batch.seq`; `rollback` is the only place that discards KV
entries (rejected proposals), for the target and every kind of draft alike. A tree round (specdec/tree.py) caches
the whole tree, then `keep_path` moves the accepted path's entries next to the prefix and rolls back the rest.
The target-only decoding of the data stage may also drop whole finished rows (`Batch.drop_finished`, `keep_rows`):
rows, never positions, and only where no draft shares the buffer.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class Batch:
    """The running sequences: a preallocated token buffer, left-padding offsets and finished rows. `rows` are the
    running rows' places in the batch as given: all of them, unless `drop_finished` took finished rows out."""

    def __init__(self, input_ids, attention_mask, max_new_tokens, lookahead, eos_token_id, pad_token_id):
        batch, prompt_len = input_ids.shape
        device = input_ids.device
        capacity = prompt_len + max_new_tokens + lookahead
        self.prompt_length = prompt_len
        self.max_length = prompt_len + max_new_tokens
        self.length = prompt_len
        self.seq = torch.full((batch, capacity), pad_token_id, dtype=torch.long, device=device)
        self.seq[:, :prompt_len] = input_ids
        self.pad_token_id = pad_token_id
        if attention_mask is None or bool(attention_mask.all()):
            self.mask = None  # no padding: the models' plain causal path, and no mask to build each step
            self.left_pad = torch.zeros(batch, dtype=torch.long, device=device)
        else:
            self.mask = torch.ones(batch, capacity, dtype=torch.long, device=device)
            self.mask[:, :prompt_len] = attention_mask
            self.left_pad = (attention_mask == 0).sum(dim=1)
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        self.eos = torch.tensor(list(eos), dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.live_appended = torch.zeros((), dtype=torch.long, device=device)
        self.ends = torch.full((batch,), capacity, dtype=torch.long, device=device)  # length at each row's EOS
        self.rows = torch.arange(batch, device=device)
        self._whole: tuple[torch.Tensor, torch.Tensor] | None = None  # every row's (seq, ends), once rows are dropped

    def model_inputs(self, start: int, stop: int) -> dict:
        """Positions and attention mask for feeding seq[:, start:stop] after a cache of length `start`."""
        positions = torch.arange(start, stop, device=self.seq.device)[None, :] - self.left_pad[:, None]
        mask = None if self.mask is None else self.mask[:, :stop]
        return {"position_ids": positions.clamp_min(0), "attention_mask": mask}

    def append(self, new: torch.Tensor) -> int:
        """Append [B, m] tokens (cut at max_new_tokens); tokens after a row's EOS become padding."""
        new = new[:, : self.max_length - self.length]
        self.finished_before = self.finished.clone()
        if self.eos.numel():
            is_eos = torch.isin(new, self.eos)
            after_eos = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0
            new = new.masked_fill(after_eos | self.finished_before[:, None], self.pad_token_id)
            first_eos = is_eos.long().argmax(dim=1)  # [B]
            newly = is_eos.any(dim=1) & ~self.finished_before
            self.ends = torch.where(newly, self.length + first_eos + 1, self.ends)
            self.finished |= newly
        else:
            after_eos = torch.zeros_like(new, dtype=torch.bool)
        # Real tokens appended (not padding after an EOS): an on-device count, read once at the end.
        self.live_appended += (~after_eos).sum(dim=1).masked_fill(self.finished_before, 0).sum()
        m = new.shape[1]
        self.seq[:, self.length : self.length + m] = new
        self.length += m
        return m

    def sequences(self) -> torch.Tensor:
        """The generated batch, every row as given, cut after the last row's EOS (a round may have appended past
        it).  [B, S]"""
        seq, ends = self._every_row()
        width = self.length
        if self.eos.numel() and bool(self.finished.all()):  # a dropped row had finished
            width = min(width, int(ends.max()))
        return seq[:, :width]

    def drop_finished(self) -> torch.Tensor:
        """Take the finished rows out of the running batch: their tokens are final (kept for `sequences`), and a
        step no longer computes them. Returns the kept rows' places in the running batch as it was, for the caller
        to narrow its caches alike (`keep_rows`)."""
        keep = (~self.finished).nonzero().squeeze(1)
        self._whole = self._every_row()
        self.rows, self.seq, self.left_pad = self.rows[keep], self.seq[keep], self.left_pad[keep]
        self.finished, self.ends = self.finished[keep], self.ends[keep]
        if self.mask is not None:
            self.mask = self.mask[keep]
        return keep

    def _every_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(seq, ends) of every row as given: the running rows written back over what the dropped ones left."""
        if self._whole is None:
            return self.seq, self.ends
        seq, ends = self._whole
        seq[self.rows], ends[self.rows] = self.seq, self.ends
        return seq, ends

    def done(self) -> bool:
        return self.length >= self.max_length or (self.eos.numel() > 0 and bool(self.finished.all()))


def cache_kwarg(model) -> str:
    # transformers 5.x renamed `past_key_values` to `cache` in forward(); accept either.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def forward_cached(model, cache: DynamicCache, batch: Batch, stop: int, logits_to_keep: int, kwarg: str):
    """Feed seq[:, cache_len:stop] to a causal LM and return its last `logits_to_keep` logits.  -> [B, n, V]"""
    start = cache.get_seq_length()
    out = model(
        input_ids=batch.seq[:, start:stop],
        **batch.model_inputs(start, stop),
        **{kwarg: cache},
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return out.logits


def forward_masked(model, cache: DynamicCache, input_ids, position_ids, allowed: torch.Tensor, kwarg: str):
    """Feed [1, n] tokens after the cache with an explicit mask `allowed` [n, cached + n] (True = may attend),
    passed as the additive 4D mask (0 or the dtype's minimum) that eager and sdpa attention read as given.
    -> logits [1, n, V]"""
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=input_ids.device)
    mask = mask.masked_fill(~allowed.to(input_ids.device), torch.finfo(dtype).min)
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask[None, None],
                **{kwarg: cache}, use_cache=True)
    return out.logits


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers sized for the whole decoding: a step writes its
    entries in place, where DynamicLayer's torch.cat copies the whole cache (at batch 64 in bf16 on a CPU, a third
    of a decoding step). The views hold the same values in the same shapes, so every forward computes what it did
    over DynamicLayer's tensors; crop, rollback and keep_path work on the views as before."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = self._value_buffer = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        stop = start + key_states.shape[-2]
        if self._key_buffer is None or stop > self._key_buffer.shape[-2]:
            self._grow(key_states, value_states, start, max(stop, self.capacity))
        self._key_buffer[:, :, start:stop] = key_states
        self._value_buffer[:, :, start:stop] = value_states
        self.keys, self.values = self._key_buffer[:, :, :stop], self._value_buffer[:, :, :stop]
        return self.keys, self.values

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Keep only the rows `keep` (a batch that dropped its finished rows): new buffers of the same capacity,
        the cached positions copied."""
        if self._key_buffer is None:
            return
        stop = self.get_seq_length()
        keys = self._key_buffer.new_empty((len(keep), *self._key_buffer.shape[1:]))
        values = self._value_buffer.new_empty((len(keep), *self._value_buffer.shape[1:]))
        keys[:, :, :stop], values[:, :, :stop] = self.keys[keep], self.values[keep]
        self._key_buffer, self._value_buffer = keys, values
        self.keys, self.values = keys[:, :, :stop], values[:, :, :stop]

    def place(self, rows: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor, batch: int) -> None:
        """Write a group's prefill entries [len(rows), H, n, D] at positions start..start + n of those rows (a grouped
        prefill); positions no group writes stay zero, padding that the attention mask keeps out."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        if self._key_buffer is None:
            shape = (batch, keys.shape[1], self.capacity, keys.shape[-1])
            self._key_buffer, self._value_buffer = keys.new_zeros(shape), values.new_zeros(shape)
        stop = start + keys.shape[-2]
        self._key_buffer[rows, :, start:stop] = keys
        self._value_buffer[rows, :, start:stop] = values
        self.keys, self.values = self._key_buffer[:, :, :stop], self._value_buffer[:, :, :stop]

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, kept: int, capacity: int) -> None:
        """New buffers of `capacity` positions holding the `kept` cached ones (a tree round may outgrow a chain's)."""
        keys = key_states.new_empty((*key_states.shape[:2], capacity, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:2], capacity, value_states.shape[-1]))
        if kept:
            keys[:, :, :kept], values[:, :, :kept] = self.keys, self.values
        self._key_buffer, self._value_buffer = keys, values
        self.capacity = capacity


def new_cache(model, capacity: int) -> DynamicCache:
    """The model's cache for a decoding of up to `capacity` positions: its full-attention layers preallocated
    (sliding-window and other layer kinds stay as transformers builds them)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def prefill(model, batch: Batch, kwarg: str,
            groups: list[list[int]] | None = None) -> tuple[DynamicCache, torch.Tensor]:
    """Run the prompt through a causal LM; returns its cache and the last position's logits [B, V]. With `groups`
    (`prefill_groups`), one forward per group of rows, each padded only to its own longest prompt, the entries
    written right-aligned into the batch's left-padded cache: the padding a length-sorted batch of still unequal
    prompts computed is left out. Positions and later steps are as with one forward; the rounding may differ
    (other matmul shapes), so a decoder checked against one forward keeps one. A cache with layers other than full
    attention (sliding windows) prefills as one forward."""
    cache = new_cache(model, batch.seq.shape[1])
    if groups and len(groups) > 1 and all(isinstance(layer, PreallocatedLayer) for layer in cache.layers):
        return cache, _prefill_in_groups(model, cache, batch, kwarg, groups)
    logits = forward_cached(model, cache, batch, batch.prompt_length, 1, kwarg)
    return cache, logits[:, -1]


def _prefill_in_groups(model, cache: DynamicCache, batch: Batch, kwarg: str, groups: list[list[int]]) -> torch.Tensor:
    width, rows_total = batch.prompt_length, batch.seq.shape[0]
    last = None
    for group in groups:
        rows = torch.tensor(group, device=batch.seq.device)
        start = width - int((width - batch.left_pad[rows]).max())
        positions = batch.model_inputs(start, width)["position_ids"][rows]
        mask = None if batch.mask is None else batch.mask[rows, start:width]
        part = DynamicCache(config=model.config)
        out = model(input_ids=batch.seq[rows, start:width], position_ids=positions,
                    attention_mask=None if mask is None or bool(mask.all()) else mask,
                    **{kwarg: part}, use_cache=True, logits_to_keep=1)
        for layer, written in zip(cache.layers, part.layers):
            layer.place(rows, start, written.keys, written.values, rows_total)
        logits = out.logits[:, -1]
        if last is None:
            last = logits.new_empty((rows_total, logits.shape[-1]))
        last[rows] = logits
    return last


def prefill_groups(lengths: list[int], slack: float = 1.1, alone: int = 512) -> list[list[int]]:
    """Rows (indices of `lengths`, the prompts' lengths) grouped for a grouped prefill, longest first: a group
    grows while its padded positions stay within `slack` times its real ones, and a prompt of `alone` tokens or
    more is prefilled by itself (no padding and no mask, so causal attention skips the masked half of its scores).
    The defaults: bench/data_prefill.py."""
    groups: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        group = groups[-1] if groups else None
        if (group and lengths[group[0]] < alone
                and (len(group) + 1) * lengths[group[0]] <= slack * (sum(lengths[i] for i in group) + lengths[row])):
            group.append(row)
        else:
            groups.append([row])
    return groups


def can_keep_rows(cache: DynamicCache) -> bool:
    """Whether `keep_rows` can narrow this cache: every layer preallocated (full attention)."""
    return all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)


def keep_rows(cache: DynamicCache, keep: torch.Tensor) -> None:
    """Narrow every layer to the rows `keep` (`Batch.drop_finished`'s answer)."""
    for layer in cache.layers:
        layer.keep_rows(keep)


def by_row(steps: list[torch.Tensor], rows: list[torch.Tensor], batch: int) -> torch.Tensor:
    """Per-step tensors [len(rows[j]), ...] of a decoding that dropped finished rows as it went (`rows[j]`: the
    rows step j ran, one tensor shared by the steps between two drops) as one [batch, steps, ...], zeros where a
    row no longer ran (past its EOS)."""
    out = steps[0].new_zeros((batch, len(steps), *steps[0].shape[1:]))
    start = 0
    for stop in range(1, len(steps) + 1):
        if stop == len(steps) or rows[stop] is not rows[start]:
            out[rows[start], start:stop] = torch.stack(steps[start:stop], dim=1)
            start = stop
    return out


def keep_path(cache: DynamicCache, start: int, slots: list[int]) -> None:
    """Keep positions < start, then the entries at `slots` (ascending, >= start) moved to start, start + 1, ...:
    a tree round's accepted path. The rest goes through `rollback`."""
    if slots and slots != list(range(start, start + len(slots))):
        for layer in cache.layers:
            index = torch.tensor(slots, device=layer.keys.device)
            layer.keys[:, :, start : start + len(slots)] = layer.keys.index_select(2, index)
            layer.values[:, :, start : start + len(slots)] = layer.values.index_select(2, index)
    rollback(cache, start + len(slots))


def rollback(cache: DynamicCache, length: int) -> None:
    """Drop cached positions >= length: rejected proposals. The only place KV entries are discarded."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)
