"""Where the data stage's prompts come from: local files, Hub datasets, the embedded set, self-written (self:N)."""

from __future__ import annotations

from pathlib import Path

import datasets

from specdec.prompts import Prompt, normalise_record, read_prompts
from specdec.train import self_prompts
from specdec.train.data.config import DataConfig
from specdec.train.data.processes import Processes
from specdec.train.prompt_templates import EMBEDDED_HELDOUT_PROMPTS, EMBEDDED_TRAIN_PROMPTS

EMBEDDED_PROMPT_SETS = ("embedded:train", "embedded:heldout")
_LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _drop_nulls(row: dict) -> dict:
    # Arrow gives every row every column of the file; a row's unused formats come back as None.
    return {k: v for k, v in row.items() if v is not None}


def _embedded_path(name: str) -> Path:
    return EMBEDDED_TRAIN_PROMPTS if name == "embedded:train" else EMBEDDED_HELDOUT_PROMPTS


def _load_rows(source: str, split: str) -> list[dict]:
    """Rows of a local file or Hub dataset, via `datasets` (ValueError with the cause otherwise)."""
    datasets.disable_progress_bars()
    path = _embedded_path(source) if source in EMBEDDED_PROMPT_SETS else Path(source)
    if path.suffix in _LOCAL_SUFFIXES or path.exists():
        if not path.is_file():
            raise ValueError(f"prompt file {path} does not exist; pass a local .jsonl/.json/.parquet/.csv file, "
                             f"a Hub dataset name, or embedded:train")
        if path.suffix not in _LOCAL_SUFFIXES:
            raise ValueError(f"prompt file {path}: unsupported extension; use one of {', '.join(_LOCAL_SUFFIXES)}")
        if path.stat().st_size == 0 or (path.suffix != ".parquet" and not path.read_text(errors="replace").strip()):
            raise ValueError(f"prompt file {path} is empty")
        try:
            ds = datasets.load_dataset(_LOCAL_SUFFIXES[path.suffix], data_files=str(path), split="train")
        except Exception as err:  # noqa: BLE001 - datasets wraps parse errors; find the bad line ourselves
            if path.suffix in (".jsonl", ".json"):
                read_prompts(path)  # raises with the line number
            raise ValueError(f"could not read prompt file {path}: {type(err).__name__}: {err}") from err
    else:
        try:
            ds = datasets.load_dataset(source, split=split)
        except Exception as err:  # noqa: BLE001 - network, auth, missing split: all end the same way
            raise ValueError(
                f"could not load prompts {source!r}: it is not a local file and loading it as a Hub dataset "
                f"(split {split!r}) failed with {type(err).__name__}: {err}"
            ) from err
    return [_drop_nulls(row) for row in ds]


def prompt_sources(cfg: DataConfig) -> list[str]:
    """`prompts` may name several sources, comma-separated (e.g. embedded:train,self:1500)."""
    sources = [part.strip() for part in cfg.prompts.split(",") if part.strip()]
    if not sources:
        raise ValueError("prompts is empty; name a prompt file, a Hub dataset, embedded:train or self:N")
    return sources


def _self_prompt_file(cfg: DataConfig, n: int, procs: Processes | None) -> Path:
    """The file of n target-written prompts (self:N), written first by the main process if needed."""
    if procs is None or procs.is_main:
        self_prompts.generate(cfg, n, Path(cfg.output_dir), procs.device if procs else None)
    if procs is not None:
        procs.barrier()
    return self_prompts.path_for(cfg, Path(cfg.output_dir))


def load_prompt_set(cfg: DataConfig, procs: Processes | None = None) -> list[Prompt]:
    """The configured prompts as Prompt objects (the first `limit` rows of all sources), with unique ids."""
    rows: list[dict] = []
    for source in prompt_sources(cfg):
        n = self_prompts.count_from(source)
        if n is None:
            rows += _load_rows(source, cfg.split)
        else:
            rows += _load_rows(str(_self_prompt_file(cfg, n, procs)), cfg.split)[:n]
    if cfg.limit is not None:
        rows = rows[: cfg.limit]
    if not rows:
        raise ValueError(f"prompt source {cfg.prompts!r} holds no rows")
    prompts = [normalise_record(row, i, cfg.column_map) for i, row in enumerate(rows)]
    seen: set[str] = set()
    for p in prompts:
        if p.prompt_id in seen:
            raise ValueError(f"prompt_id {p.prompt_id!r} appears more than once in {cfg.prompts!r}; ids must be "
                             f"unique (drop the id column with column_map to number rows instead)")
        seen.add(p.prompt_id)
    return prompts
