"""The target's states an EAGLE-3 draft trains on, one batch at a time and never all in memory.

Two sources (`states:` in the recipe):

- recorded: the data stage's recording (`specdec data record_features=true`), one safetensors file per shard
  beside its parquet file. Each training row carries where its states are (`states_file`, `states_row`: columns
  that `with_states_columns` adds when a folder is loaded), and a batch reads just its rows, opening each file
  memory-mapped for that read only, so host memory is bounded by the batches in flight (the prefetch depth of the
  trainer's loader), whatever the dataset's size.
- online: the target runs on the training device for each batch, and its states are used and dropped. This is
  what large runs do (EAGLE's and SpecForge's default): a recording costs 32 KiB a token for an 8B Llama target.

`auto` reads recorded states where a row has them, and computes the others online.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors import safe_open

from specdec.eagle3 import target_states
from specdec.train.data import features_file, read_manifest

log = logging.getLogger(__name__)

SOURCES = ("auto", "recorded", "online")


def recorded_layer_ids(folder: str | Path) -> list[int] | None:
    """The layer ids whose states `folder` recorded (None: it recorded none)."""
    recorded = read_manifest(folder).get("features")
    if not recorded:
        return None
    # Folders written before the key was renamed name the decoder layers' outputs (one less) as aux_layers.
    return list(recorded.get("layer_ids") or [i + 1 for i in recorded.get("aux_layers", [])])


def with_states_columns(dataset, folder: str | Path, manifest: dict):
    """`dataset` (a loaded data folder, rows in the manifest's shard order) with `states_file` and `states_row`:
    where each row's recorded states are ("" and -1 where the folder recorded none)."""
    files, rows = [], []
    for shard in manifest["shards"]:
        count = pq.ParquetFile(Path(folder) / shard["file"]).metadata.num_rows
        recorded = str(Path(folder) / features_file(shard["file"])) if manifest.get("features") else ""
        files += [recorded] * count
        rows += list(range(count)) if recorded else [-1] * count
    if len(files) != len(dataset):
        raise ValueError(f"{folder}: its shards hold {len(files)} rows but {len(dataset)} were loaded; rerun "
                         "`specdec data` with this output_dir to repair it")
    return dataset.add_column("states_file", files).add_column("states_row", rows)


class StatesReader:
    """Reads a batch's recorded states from their files; knows which files hold the layers the draft reads."""

    def __init__(self, folders, layer_ids, width: int):
        self.width = width
        self.usable: set[str] = set()
        for folder in folders:
            ids = recorded_layer_ids(folder)
            if ids is None:
                continue
            if ids != list(layer_ids):
                log.warning("%s recorded the target's states after layers %s, the draft reads those after %s: "
                            "computing them online", folder, ids, list(layer_ids))
                continue
            self.usable.add(str(Path(folder).resolve()))

    def has(self, states_file: str | None) -> bool:
        return bool(states_file) and str(Path(states_file).parent.parent.resolve()) in self.usable

    def read(self, rows: dict, length: int) -> tuple[torch.Tensor, list[bool]]:
        """[B, length, width] float32 on the CPU (zeros past a row's recording: its last token was never fed),
        and per row whether it was read (False: to compute online)."""
        files, where = rows.get("states_file") or [None] * len(rows["input_ids"]), rows.get("states_row")
        out = torch.zeros(len(files), length, self.width)
        found = [self.has(f) for f in files]
        by_file: dict[str, list[int]] = {}
        for b, f in enumerate(files):
            if found[b]:
                by_file.setdefault(f, []).append(b)
        for f, members in by_file.items():
            # Opened for this read only: a handle kept open maps the file and its pages count as this process's.
            with safe_open(f, "pt") as recording:
                for b in members:
                    states = recording.get_tensor(str(where[b]))[:length]
                    if states.shape[-1] != self.width:
                        raise ValueError(f"{f} records target states {states.shape[-1]} wide, the draft reads "
                                         f"{self.width} (another target?): regenerate the data with this recipe")
                    out[b, : len(states)] = states.float()
        return out, found


class States:
    """The target's states of a collated batch, [B, S, (1 + layers) H] float32 on the batch's device: read from
    the recording where `source` allows and the row has one, else computed by the target now and not kept.
    `read` needs no target (the trainer's loader calls it ahead of the step); `complete` runs the target."""

    def __init__(self, source: str, target, autocast, reader: StatesReader, layer_ids):
        if source not in SOURCES:
            raise ValueError(f"states must be one of {', '.join(SOURCES)}, got {source!r}")
        self.source, self.target, self.autocast, self.reader = source, target, autocast, reader
        self.layer_ids = list(layer_ids)

    def read(self, rows: dict, length: int) -> tuple[torch.Tensor, list[bool]]:
        """The recorded states of `rows` collated to `length` positions, and which rows had them."""
        if self.source == "online":
            return torch.zeros(0), [False] * len(rows["input_ids"])
        states, found = self.reader.read(rows, length)
        if self.source == "recorded" and not all(found):
            raise ValueError("states=recorded, but some rows have no recorded target states (a data folder "
                             "written without record_features=true, or with other layers): regenerate it with "
                             "this recipe's data section, or set states=auto or states=online")
        return states, found

    def complete(self, batch: dict, read: tuple[torch.Tensor, list[bool]]) -> torch.Tensor:
        """The batch's states on its device: those read, with the missing rows computed by the target."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        states, found = read
        missing = [b for b, f in enumerate(found) if not f]
        if not missing:
            return states.to(ids.device)
        if self.target is None:
            raise ValueError("some rows need the target's states computed online, but the target is not loaded")
        with self.autocast():
            with torch.no_grad():
                fresh = target_states(self.target, ids[missing], mask[missing], self.layer_ids, final=True).float()
        if len(missing) == len(found):
            return fresh
        out = states.to(ids.device)
        out[missing] = fresh
        return out
