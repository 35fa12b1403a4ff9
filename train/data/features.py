"""The recorded target states beside each shard (record_features=true): the spool a shard's features stream
into as they are computed, the features file it becomes, and reading them back."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdec.train.data.shards import read_manifest


def keep_features(row: dict, tensor, spool: FeatureSpool | None) -> None:
    """A row's features: into the shard's spool (then dropped from memory), or kept on the row without one."""
    if spool is None:
        row["features"] = tensor
    else:
        spool.add(row_key(row), tensor)


def row_key(row: dict) -> tuple:
    """A row's key in a FeatureSpool: unique within a shard."""
    return row["prompt_id"], row["sample_index"], row["turn"]


class FeatureSpool:
    """A shard's features written as they come, to a temporary file beside the shard, and assembled once the
    shard's row order is known into the one safetensors file readers expect (tensor "<row index>"): a process
    holds no more features than its current generation batch, whatever the shard size. The copy streams from the
    spool, a chunk at a time."""

    _DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    _COPY_CHUNK = 64 << 20

    def __init__(self, path: Path):
        self.path = path.with_name(f".{path.name}.spool.tmp-{os.getpid()}")
        self._file = open(self.path, "wb+")  # noqa: SIM115 - closed in write() / discard()
        self._where: dict[tuple, tuple[int, int, str, list[int]]] = {}  # key -> offset, bytes, dtype, shape

    def add(self, key: tuple, tensor: torch.Tensor) -> None:
        """Append one row's features (kept by key until `write`)."""
        if key in self._where:
            raise AssertionError(f"features of row {key} recorded twice")
        data = tensor.detach().to("cpu").contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
        self._where[key] = (self._file.tell(), len(raw), self._DTYPES[data.dtype], list(data.shape))
        self._file.write(raw)

    def write(self, keys: list[tuple], path: Path) -> None:
        """The features of `keys`, in that order, as tensors "0", "1", ... of one safetensors file, atomically."""
        header, offset = {}, 0
        for i, key in enumerate(keys):
            _, size, dtype, shape = self._where[key]
            header[str(i)] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(len(text) + 8) % 8)  # the data starts 8-byte aligned
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self._file.flush()
        with open(tmp, "wb") as out:
            out.write(len(text).to_bytes(8, "little") + text)
            for key in keys:
                start, size, _, _ = self._where[key]
                self._file.seek(start)
                while size:
                    piece = self._file.read(min(size, self._COPY_CHUNK))
                    out.write(piece)
                    size -= len(piece)
        os.replace(tmp, path)
        self.discard()

    def discard(self) -> None:
        """Close and delete the spool."""
        self._file.close()
        with contextlib.suppress(OSError):
            self.path.unlink()


def features_file(shard_file: str) -> str:
    """The features file beside a shard: shards/shard-00000.parquet -> shards/shard-00000.features.safetensors"""
    return shard_file.removesuffix(".parquet") + ".features.safetensors"


def write_features(rows: list[dict], path: Path) -> None:
    """The recorded features of rows that carry them, as tensors "0", "1", ... (the rows' order in the shard),
    atomically (`run` streams them through a FeatureSpool instead)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({str(i): r["features"].contiguous() for i, r in enumerate(rows)}, str(tmp))
    os.replace(tmp, path)


def recorded_features(folder: str | Path):
    """Per shard of a folder written with record_features=true: (its rows' prompt_id, sample_index, turn and
    input_ids as columns, its rows' features in order); nothing for a folder without them."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if not manifest.get("features"):
        return
    for shard in manifest["shards"]:
        columns = pq.read_table(folder / shard["file"], columns=["prompt_id", "sample_index", "turn",
                                                                  "input_ids"]).to_pydict()
        with safe_open(str(folder / features_file(shard["file"])), "pt") as f:
            yield columns, [f.get_tensor(str(i)) for i in range(len(columns["input_ids"]))]
