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
import torch

from specdec.train.data import load_generated


def load_split(path: str | Path):
    """A generated-data folder (manifest.json + shards/*.parquet) as a datasets.Dataset."""
    return load_generated(path)


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

    def __call__(self, m: int) -> list[int]:
        epoch = m // self.per_epoch
        if epoch != self._epoch:
            self._epoch = epoch
            self._batches = epoch_batches(self.lengths, self.global_batch, self.seed, epoch, self.bucket)
        return self._batches[m % self.per_epoch]


def collate(rows: dict, pad_id: int, max_length: int) -> dict[str, Any]:
    """Right-padded tensors; `loss_mask[b, t]` marks logits positions t that predict a completion token."""
    seqs = [list(ids)[:max_length] for ids in rows["input_ids"]]
    batch, width = len(seqs), max(len(s) for s in seqs)
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
        loss_mask[b, prompt - 1: stop] = True
    labels = torch.roll(input_ids, -1, dims=1)  # labels[:, t] = input_ids[:, t + 1]
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask, "labels": labels,
           "n_tokens": int(loss_mask.sum())}
    if has_topn:
        out["top_ids"], out["top_logprobs"] = top_ids, top_logprobs
    return out
