"""A micro-batch run in slices of whole rows, so that one forward and backward never holds more than `slice_tokens`
padded positions (train_config.py `slice_tokens`).

Why: a micro-batch's activations grow with rows x its longest row, so the widest batch the data happens to draw
(16 rows of ~830-token long-summarisation prompts in the demo's data) sets the run's memory peak, whatever the
rest of the data looks like. Sliced, the peak follows the bound instead. The gradient is the same: the kinds that
allow slices (`TrainingFacts.row_slices`) divide their summed loss by the step's scored positions counted over the
whole micro-batch (`KindRun.counts`), so the slices' losses add up to the micro-batch's.

A packed batch (batches.py `pack`) is sliced by its packed rows, each slice keeping the samples those rows hold.
"""

from __future__ import annotations

from typing import Any

import torch


def row_groups(rows: int, width: int, slice_tokens: int) -> list[list[int]]:
    """Consecutive groups of `rows` rows whose padded positions (rows x width) stay within `slice_tokens`; one row
    a group where a single row is wider than the bound (a row is never cut); one group when the bound is 0."""
    if slice_tokens <= 0 or rows * width <= slice_tokens:
        return [list(range(rows))]
    per = max(1, slice_tokens // max(width, 1))
    return [list(range(s, min(s + per, rows))) for s in range(0, rows, per)]


def take_rows(value: Any, rows: list[int], n: int) -> Any:
    """`value` with only `rows` of whatever is per-row in it: tensors whose first dimension is the n rows, lists of
    n items, and tuples and dicts of them; anything else as it is (a count, a flag)."""
    if torch.is_tensor(value):
        return value[rows] if value.dim() >= 1 and value.shape[0] == n else value
    if isinstance(value, list) and len(value) == n:
        return [value[r] for r in rows]
    if isinstance(value, tuple):
        return tuple(take_rows(v, rows, n) for v in value)
    if isinstance(value, dict):
        return {k: take_rows(v, rows, n) for k, v in value.items()}
    return value


def _take_packed(batch: dict, ahead: Any, rows: list[int]) -> tuple[dict, Any]:
    """Packed rows `rows` of a packed batch with the samples they hold (renumbered), and those samples' part of
    what was read ahead (per unpacked sample)."""
    unpacked, n_rows, n_samples = batch["unpacked"], batch["input_ids"].shape[0], unpacked_rows(batch)
    row_at = {r: i for i, r in enumerate(rows)}
    samples = sorted({b for r, _, b, _ in batch["segments"] if r in row_at})
    sample_at = {b: i for i, b in enumerate(samples)}
    part = {k: take_rows(v, rows, n_rows) for k, v in batch.items() if k not in ("unpacked", "segments")}
    documents = part["document_ids"]  # each position's sample: renumbered to the slice's own
    renumbered = torch.full_like(documents, -1)
    for b, i in sample_at.items():
        renumbered[documents == b] = i
    part["document_ids"] = renumbered
    part["segments"] = [(row_at[r], offset, sample_at[b], length) for r, offset, b, length in batch["segments"]
                        if r in row_at]
    part["unpacked"] = take_rows(unpacked, samples, n_samples)
    part["unpacked"]["n_tokens"] = int(part["unpacked"]["loss_mask"].sum())
    part["n_tokens"] = part["unpacked"]["n_tokens"]
    return part, take_rows(ahead, samples, n_samples)


def unpacked_rows(batch: dict) -> int:
    return batch["unpacked"]["input_ids"].shape[0]


def slices(batch: dict, ahead: Any, slice_tokens: int) -> list[tuple[dict, Any]]:
    """The micro-batch as (batch, read-ahead) slices of whole rows within `slice_tokens` padded positions each;
    [(batch, ahead)] itself when it fits or the bound is 0."""
    rows, width = batch["input_ids"].shape
    groups = row_groups(rows, width, slice_tokens)
    if len(groups) == 1:
        return [(batch, ahead)]
    if "segments" in batch:
        return [_take_packed(batch, ahead, group) for group in groups]
    out = []
    for group in groups:
        part = take_rows(batch, group, rows)
        part["n_tokens"] = int(part["loss_mask"].sum())
        out.append((part, take_rows(ahead, group, rows)))
    return out
