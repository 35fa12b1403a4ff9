"""The trainer's data: generated-data folders, the held-out split, a deterministic batch schedule, collation.

The schedule is a pure function of (seed, epoch, micro-batch index), so a resumed run continues the data order
exactly and every rank agrees on it without communication.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

from specdec.train.data import load_generated, read_manifest
from specdec.train.eagle3_states import with_states_columns


def load_split(path: str | Path):
    """A generated-data folder (manifest.json + shards/*.parquet) as a memory-mapped datasets.Dataset, each row
    with where its recorded target states are (`states_file`, `states_row`; none where the folder has none)."""
    return with_states_columns(load_generated(path), path, read_manifest(path))


def row_lengths(dataset, max_length: int) -> list[int]:
    """Each row's token count, capped at max_length, read column-wise (no row is materialised in Python)."""
    lengths: list[int] = []
    for part in dataset.select_columns(["input_ids"]).with_format("arrow").iter(batch_size=65_536):
        lengths += pc.min_element_wise(pc.list_value_length(part["input_ids"]), max_length).to_pylist()
    return lengths


# Rows whose token lists `shared_prefixes` reads at a time: its memory follows this, not the folder.
PREFIX_CHUNK_ROWS = 1024


def _common_length(a, b) -> int:
    """How many first tokens two token lists share."""
    n = min(len(a), len(b))
    differ = (np.asarray(a[:n]) != np.asarray(b[:n])).nonzero()[0]
    return int(differ[0]) if len(differ) else n


def shared_prefixes(dataset, max_length: int) -> np.ndarray:
    """Per row, how many of its first tokens (at most its prompt's) an earlier row of the data already holds, so
    that scoring their positions again would repeat that row's loss: a prompt's positions are the target's states
    on the same tokens, whichever row holds them. The earlier row is the same prompt's first answer for a later
    answer (sample_index > 0), the turn before's row for a later turn (its prompt holds the earlier turns), and
    for every row but one the opening that all rows share (a chat template's system prompt, scored in each row
    otherwise). `collate` starts a row's prompt positions after them (`supervise_prompt`). Token lists are
    read PREFIX_CHUNK_ROWS rows at a time: memory follows the number of rows, not of tokens.  -> int32 [rows]"""
    earlier = {}
    if {"prompt_id", "sample_index", "turn"} <= set(dataset.column_names):  # a `specdec data` folder's rows
        keys = dataset.select_columns(["prompt_id", "sample_index", "turn"]).to_dict()
        key_rows = list(zip(keys["prompt_id"], keys["sample_index"], keys["turn"]))
        index = {key: i for i, key in enumerate(key_rows)}
        for i, (p, s, t) in enumerate(key_rows):
            source = index.get((p, s, t - 1)) if t > 0 else index.get((p, 0, 0)) if s > 0 else None
            if source is not None and source != i:
                earlier[i] = source
    shared = np.zeros(len(dataset), dtype=np.int32)
    tokens = dataset.select_columns(["input_ids"])
    opening = None  # the longest opening every row shares: only that many first tokens of each row are read
    for part in tokens.with_format("arrow").iter(batch_size=PREFIX_CHUNK_ROWS):
        for ids in pc.list_slice(part["input_ids"], 0, max_length if opening is None else len(opening)).to_pylist():
            opening = ids if opening is None else opening[:_common_length(opening, ids)]
    pairs = sorted(earlier.items())
    for start in range(0, len(pairs), PREFIX_CHUNK_ROWS // 2):
        chunk = pairs[start:start + PREFIX_CHUNK_ROWS // 2]
        ids = tokens[[i for pair in chunk for i in pair]]["input_ids"]
        for k, (i, _) in enumerate(chunk):
            shared[i] = _common_length(ids[2 * k][:max_length], ids[2 * k + 1][:max_length])
    # The opening stays scored in one row that takes no prefix from another: one always exists, since a row's
    # source is an earlier turn or a first answer, and following sources ends at a row with none.
    if len(dataset) > 1 and opening:
        owner = next(i for i in range(len(dataset)) if i not in earlier)
        shared = np.maximum(shared, len(opening))
        shared[owner] = 0
    return np.minimum(shared, np.asarray(dataset["prompt_length"], dtype=np.int32))


def _in_heldout(prompt_id: str, fraction: float) -> bool:
    # A hash, not an RNG: the split is the same on every rank, every run and every resume.
    return int(hashlib.sha1(prompt_id.encode()).hexdigest()[:8], 16) % 10_000 < fraction * 10_000


def data_folders(cfg) -> tuple[list[Path], Path | None]:
    """The training data folders and the held-out folder (None: a hash split of the training data)."""
    out = Path(cfg.output_dir)
    train_paths = [Path(p.strip()) for p in cfg.train_data.split(",") if p.strip()] or [out / "data"]
    for path in train_paths:
        if not path.is_dir():
            raise ValueError(f"training data {path} not found; run `specdec data --config ...` first or set "
                             "train_data=<folder>[,<folder>...]")
    heldout_path = Path(cfg.heldout_data) if cfg.heldout_data else out / "data_heldout"
    if heldout_path.is_dir():
        return train_paths, heldout_path
    if cfg.heldout_data:
        raise ValueError(f"heldout_data {heldout_path} not found")
    return train_paths, None


def load_data(cfg):
    """(train, heldout) datasets; held-out is its own folder or a hash split of prompt ids."""
    train_paths, heldout_path = data_folders(cfg)
    train = load_split(train_paths[0])
    if len(train_paths) > 1:  # several `specdec data` folders, e.g. a prompt set and self-written prompts
        train = datasets.concatenate_datasets([train, *(load_split(p) for p in train_paths[1:])])
    if heldout_path is not None:
        return train, load_split(heldout_path)
    flags = [_in_heldout(str(p), cfg.heldout_fraction) for p in train["prompt_id"]]
    held = [i for i, f in enumerate(flags) if f]
    kept = [i for i, f in enumerate(flags) if not f]
    return train.select(kept), train.select(held)


def sample_id(rows: dict, i: int) -> str:
    """A sample's identity: prompt_id/sample_index/turn."""
    return f"{rows['prompt_id'][i]}/{rows['sample_index'][i]}/{rows['turn'][i]}"


def epoch_batches(lengths: list[int], global_batch: int, seed: int, epoch: int, bucket: bool) -> list[list[int]]:
    """One epoch of global batches (lists of row indices): shuffled, length-bucketed, full batches only."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if bucket:
        # Sort within windows of 32 batches so rows of similar length share a batch (less padding), then
        # shuffle the batches so lengths do not trend through the epoch.
        window = global_batch * 32
        order = [i for s in range(0, len(order), window) for i in sorted(order[s:s + window], key=lengths.__getitem__)]
    batches = [order[s:s + global_batch] for s in range(0, len(order) - global_batch + 1, global_batch)]
    if bucket:
        rng.shuffle(batches)
    return batches


class Schedule:
    """Micro-batch m -> global batch indices, over endless epochs; a pure function of (seed, m)."""

    def __init__(self, lengths: list[int], global_batch: int, seed: int, bucket: bool):
        if len(lengths) < global_batch:
            raise ValueError(f"{len(lengths)} training samples are fewer than one global batch ({global_batch} = "
                             "per_device_batch_size x processes); lower per_device_batch_size or generate more data")
        self.lengths, self.global_batch, self.seed, self.bucket = lengths, global_batch, seed, bucket
        self.per_epoch = len(lengths) // global_batch
        self._epoch, self._batches = -1, []

    def padded_positions(self, per_device: int, epoch: int = 0, multiple: int = 1, max_length: int = 0) -> int:
        """Positions one epoch's steps compute, each process's micro-batch padded to its longest row (rounded up to
        `multiple`): the slowest process's, per step (the step waits for it). What an epoch costs, as against a
        few steps' rows."""
        total, cap = 0, max_length or max(self.lengths)
        for batch in epoch_batches(self.lengths, self.global_batch, self.seed, epoch, self.bucket):
            slices = [batch[s:s + per_device] for s in range(0, len(batch), per_device)]
            total += max(len(rows) * padded_width(max(self.lengths[i] for i in rows), cap, multiple)
                         for rows in slices)
        return total

    def __call__(self, m: int) -> list[int]:
        epoch = m // self.per_epoch
        if epoch != self._epoch:
            self._epoch = epoch
            self._batches = epoch_batches(self.lengths, self.global_batch, self.seed, epoch, self.bucket)
        return self._batches[m % self.per_epoch]


class MicroBatches(torch.utils.data.Dataset):
    """Micro-batch m of one process: (its sample ids, its collated batch, what the draft's kind reads ahead).

    Indexed by m, read by a DataLoader whose sampler counts up from the run's first micro-batch, so its workers
    collate (and read recorded target states) ahead of the step while the order stays the schedule's."""

    def __init__(self, dataset, schedule: Schedule, rank: int, per_device: int, pad_id: int, max_length: int,
                 read_ahead=None, packed: bool = False, prompt_positions: bool = False, multiple: int = 1,
                 shared=None):
        self.dataset, self.schedule, self.rank, self.per_device = dataset, schedule, rank, per_device
        self.pad_id, self.max_length, self.read_ahead, self.packed = pad_id, max_length, read_ahead, packed
        self.prompt_positions, self.multiple, self.shared = prompt_positions, multiple, shared

    def __getitem__(self, m: int):
        indices = self.schedule(m)[self.rank * self.per_device:(self.rank + 1) * self.per_device]
        rows = self.dataset[indices]
        shared = [int(self.shared[i]) for i in indices] if self.shared is not None else None
        batch = collate(rows, self.pad_id, self.max_length, self.prompt_positions, self.multiple, shared)
        if self.packed:
            batch = pack(batch, self.max_length, self.multiple)
        ahead = self.read_ahead(rows, batch) if self.read_ahead is not None else None
        return [sample_id(rows, i) for i in range(len(indices))], batch, ahead

    def __len__(self) -> int:
        return 1 << 62  # endless: the trainer stops taking


class CountFrom(torch.utils.data.Sampler):
    """m, m + 1, m + 2, ...: the micro-batches from the first one a (resumed) run trains."""

    def __init__(self, start: int):
        self.start = start

    def __iter__(self):
        m = self.start
        while True:
            yield m
            m += 1


def as_is(item):
    """The loader's collate_fn: a MicroBatches item is already collated."""
    return item


def padded_width(longest: int, max_length: int, multiple: int) -> int:
    """The batch's width: its longest row rounded up to a multiple of `multiple` (at most max_length), so that a
    run meets a few widths rather than one per longest row (train_config.py `pad_to_multiple_of`)."""
    return min(-(-longest // multiple) * multiple, max_length)  # rows are cut to max_length before


def collate(rows: dict, pad_id: int, max_length: int, prompt_positions: bool = False,
            multiple: int = 1, shared: list[int] | None = None) -> dict[str, Any]:
    """Right-padded tensors, `multiple` positions at a time (`padded_width`); `loss_mask[b, t]` marks logits
    positions t that predict a completion token, and with `prompt_positions` every position that predicts a token
    of the sample (its prompt's too: a teacher that reads the target's distribution there, `supervise_prompt`)
    after the first `shared[b]` tokens (`shared_prefixes`: another row scores those)."""
    seqs = [list(ids)[:max_length] for ids in rows["input_ids"]]
    batch, width = len(seqs), padded_width(max(len(s) for s in seqs), max_length, multiple)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(batch, width, dtype=torch.long)
    loss_mask = torch.zeros(batch, width, dtype=torch.bool)
    has_topn = rows.get("top_ids") is not None and all(t is not None for t in rows["top_ids"])
    if has_topn:
        n = max((len(t[0]) for t in rows["top_ids"] if len(t)), default=1)
        top_ids = torch.zeros(batch, width, n, dtype=torch.long)
        top_logprobs = torch.zeros(batch, width, n, dtype=torch.float32)
    for b, seq in enumerate(seqs):
        length, prompt = len(seq), max(int(rows["prompt_length"][b]), 1)
        input_ids[b, :length] = torch.tensor(seq)
        attention_mask[b, :length] = 1
        stop = length - 1
        if has_topn:
            comp = rows["top_ids"][b][: max(length - prompt, 0)]
            stop = min(stop, prompt - 1 + len(comp))
            if comp:
                top_ids[b, prompt - 1: prompt - 1 + len(comp)] = torch.tensor(comp)
                top_logprobs[b, prompt - 1: prompt - 1 + len(comp)] = torch.tensor(rows["top_logprobs"][b][: len(comp)])
        skip = shared[b] if shared is not None else 0  # positions 0 .. skip - 2 are scored in another row
        first = max(min(skip, prompt) - 1, 0) if prompt_positions else prompt - 1
        loss_mask[b, first: stop] = True
    labels = torch.roll(input_ids, -1, dims=1)  # labels[:, t] = input_ids[:, t + 1]
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask, "labels": labels,
           "n_tokens": int(loss_mask.sum())}
    if has_topn:
        out["top_ids"], out["top_logprobs"] = top_ids, top_logprobs
    return out


def pack_order(lengths: list[int], max_length: int) -> list[list[int]]:
    """Rows of sample indices whose lengths sum to at most max_length: first fit, longest first (the order
    within a row follows the samples' order, so packing a batch is deterministic)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((r for r, left in enumerate(room) if left >= lengths[i]), None)
        if fit is None:
            rows.append([i])
            room.append(max_length - lengths[i])
        else:
            rows[fit].append(i)
            room[fit] -= lengths[i]
    return [sorted(row) for row in rows]


def pack(batch: dict[str, Any], max_length: int, multiple: int = 1) -> dict[str, Any]:
    """A right-padded batch (`collate`) with its samples packed into rows of at most max_length tokens.

    Adds `document_ids` [R, L] (a sample's index in `batch` at its positions, -1 on padding) and keeps the
    unpacked batch as `unpacked` with `segments` [(row, offset, sample, length)], to place per-sample tensors
    (the target's states) with `place`. Labels and masks move with their samples: a sample's last position, whose
    label would be the next sample's first token, is never scored (collate leaves it out of loss_mask)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    order = pack_order(lengths, max_length)
    width = padded_width(max(sum(lengths[i] for i in row) for row in order), max_length, multiple)
    per_position = [k for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2 and k != "attention_mask"]
    out: dict[str, Any] = {"attention_mask": torch.zeros(len(order), width, dtype=torch.long),
                           "document_ids": torch.full((len(order), width), -1, dtype=torch.long)}
    for key in per_position:
        out[key] = batch[key].new_zeros((len(order), width, *batch[key].shape[2:]))
    segments = []
    for r, row in enumerate(order):
        offset = 0
        for b in row:
            n = lengths[b]
            for key in per_position:
                out[key][r, offset:offset + n] = batch[key][b, :n]
            out["attention_mask"][r, offset:offset + n] = 1
            out["document_ids"][r, offset:offset + n] = b
            segments.append((r, offset, b, n))
            offset += n
    out.update(n_tokens=batch["n_tokens"], unpacked=batch, segments=segments)
    return out


def place(per_sample: torch.Tensor, packed: dict[str, Any]) -> torch.Tensor:
    """Per-sample values [B, S, ...] of the unpacked batch at their packed positions.  -> [R, L, ...]"""
    rows, width = packed["input_ids"].shape
    out = per_sample.new_zeros((rows, width, *per_sample.shape[2:]))
    for r, offset, b, n in packed["segments"]:
        out[r, offset:offset + n] = per_sample[b, :n]
    return out


def to_device(batch: dict[str, Any], device) -> dict[str, Any]:
    """The batch's tensors (and a packed batch's unpacked one) on `device`."""
    return {k: v.to(device) if torch.is_tensor(v) else to_device(v, device) if isinstance(v, dict) else v
            for k, v in batch.items()}
