"""A data folder's files: the shards (parquet, written atomically), the manifest that lists them (updated under a
lock, so processes take turns), and loading the result."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from specdec.eagle3 import RECORDED_STATES_DTYPE
from specdec.overwrite import check_replaceable, replace_folder_atomically, temp_sibling
from specdec.train import self_prompts
from specdec.train.data.config import DataConfig

log = logging.getLogger(__name__)

FORMAT = "specdec-data/1"
MANIFEST = "manifest.json"
SHARD_DIR = "shards"


def _schema(top_logprobs: bool, sampling: bool = False):
    fields = [("prompt_id", pa.string()), ("category", pa.string()), ("sample_index", pa.int64()),
              ("turn", pa.int64()), ("input_ids", pa.list_(pa.int64())), ("prompt_length", pa.int64())]
    if top_logprobs:
        fields += [("top_ids", pa.list_(pa.list_(pa.int64()))), ("top_logprobs", pa.list_(pa.list_(pa.float32())))]
    if sampling:  # temperatures / top_ps: what each row was sampled at
        fields += [("temperature", pa.float64()), ("top_p", pa.float64())]
    return pa.schema(fields)


def write_shard(rows: list[dict], path: Path, top_logprobs: bool, sampling: bool = False) -> None:
    """Write rows as one parquet file, atomically (temporary file, then rename)."""
    table = pa.Table.from_pylist([{k: v for k, v in r.items() if k != "features"} for r in rows],
                                 schema=_schema(top_logprobs, sampling))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(out: Path):
    """An exclusive lock on the output folder, so processes take turns updating the manifest."""
    try:
        import fcntl
    except ImportError:  # not POSIX: single-process runs need no lock
        yield
        return
    with open(out / ".manifest.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_manifest(out: str | Path) -> dict:
    """The manifest of a data folder (ValueError when there is none)."""
    path = Path(out) / MANIFEST
    if not path.is_file():
        raise ValueError(f"{out} has no {MANIFEST}: it is not a `specdec data` output folder "
                         f"(run `specdec data output_dir={out}` first)")
    return json.loads(path.read_text())


def _old_manifest(out: Path) -> dict | None:
    """The manifest already in `out`, None when there is none (ValueError when its manifest.json is not ours)."""
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        old = None
    if not isinstance(old, dict) or not str(old.get("format", "")).startswith(FORMAT.split("/")[0]):
        raise ValueError(f"output_dir {out} holds a {MANIFEST} that specdec data did not write; choose another "
                         "output_dir")
    return old


def prepare_output(cfg: DataConfig, settings: dict, fingerprint: str, base: dict) -> dict:
    """Create the output folder and manifest, or check that an existing one holds this very run (or, with
    overwrite=true, replace a data folder of other settings: only one that specdec data wrote)."""
    out = Path(cfg.output_dir)
    old = _old_manifest(out)
    if old is not None and old.get("fingerprint") == fingerprint:
        log.info("resuming %s: %d of %d shards done", out, len(old.get("shards", [])), old.get("num_shards", 0))
        (out / SHARD_DIR).mkdir(exist_ok=True)
        for stray in (out / SHARD_DIR).glob(".*.tmp-*"):  # half-written by an interrupted run
            stray.unlink()
        return old
    if old is not None and not cfg.overwrite:
        changed = sorted(k for k in set(settings) | set(old.get("settings", {}))
                         if settings.get(k) != old.get("settings", {}).get(k))
        what = f"settings {', '.join(changed)} differ" if changed else "the prompts (or their tokenization) differ"
        raise ValueError(f"{out} already holds data generated with other settings ({what}); use another "
                         f"output_dir, or overwrite=true to replace it")
    if old is None and (out / SHARD_DIR).exists():
        raise ValueError(f"output_dir {out} has a {SHARD_DIR}/ folder but no {MANIFEST}: specdec data did not "
                         "write it and will not replace it; use another output_dir")
    manifest = dict(base, shards=[], complete=False)
    if old is not None:
        check_replaceable(out, (MANIFEST,), "output_dir")  # never a home folder, the current folder or above
        log.warning("overwrite=true: replacing the data in %s", out)
        _replace_data_folder(cfg, out, manifest)
        return manifest
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / MANIFEST, manifest)  # first: a folder with shards/ and no manifest is not ours
    (out / SHARD_DIR).mkdir(exist_ok=True)
    return manifest


def _replace_data_folder(cfg: DataConfig, out: Path, manifest: dict) -> None:
    """A new data folder (the manifest, no shards yet) in place of `out` in one swap. This run's self-written
    prompts (prompts=self:N), already in `out`, come along."""
    tmp = temp_sibling(out)
    try:
        _write_json(tmp / MANIFEST, manifest)
        (tmp / SHARD_DIR).mkdir()
        prompts = self_prompts.path_for(cfg, out)
        if prompts.is_file():
            shutil.copy2(prompts, tmp / prompts.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # `out` is untouched
        raise
    replace_folder_atomically(tmp, out)


def record_shard(out: Path, entry: dict) -> dict:
    """List a finished shard in the manifest (its file is in place)."""
    with _locked(out):
        manifest = json.loads((out / MANIFEST).read_text())
        manifest["shards"] = sorted([s for s in manifest["shards"] if s["index"] != entry["index"]] + [entry],
                                    key=lambda s: s["index"])
        _write_json(out / MANIFEST, manifest)
    return manifest


def finalise(out: Path) -> dict:
    """The manifest's counts summed over its shards, and whether every shard is done."""
    with _locked(out):
        manifest = json.loads((out / MANIFEST).read_text())
        shards = manifest["shards"]
        manifest["counts"]["examples"] = sum(s["examples"] for s in shards)
        manifest["counts"]["generated_tokens"] = sum(s["generated_tokens"] for s in shards)
        manifest["counts"]["dropped_turns"] = sum(s.get("dropped_turns", 0) for s in shards)
        manifest["complete"] = len(shards) == manifest["num_shards"] and all(
            (out / s["file"]).is_file() for s in shards)
        _write_json(out / MANIFEST, manifest)
    return manifest


def load_generated(path: str | Path, require_complete: bool = False):
    """The generated examples of a `specdec data` folder as a `datasets.Dataset` (columns as written)."""
    out = Path(path)
    manifest = read_manifest(out)
    if not manifest["complete"]:
        if require_complete:
            raise ValueError(f"{out} is incomplete ({len(manifest['shards'])} of {manifest['num_shards']} shards); "
                             f"rerun the same `specdec data` command to finish it")
        log.warning("%s is incomplete: using its %d finished shards of %d", out, len(manifest["shards"]),
                    manifest["num_shards"])
    files = [str(out / s["file"]) for s in manifest["shards"]]
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise ValueError(f"{out}: shard file(s) listed in the manifest are missing: {missing[:3]}; rerun "
                         f"`specdec data` with this output_dir to regenerate them")
    if not files:
        raise ValueError(f"{out} holds no finished shards yet; run `specdec data output_dir={out}`")
    datasets.disable_progress_bars()
    # Memory-mapped (datasets' Arrow cache), not loaded: 100k+ conversations with top-n log-probs would not fit
    # in host memory, once per process.
    return datasets.Dataset.from_parquet(files, keep_in_memory=False)


def manifest_base(cfg: DataConfig, settings: dict, fingerprint: str, num_prompts: int, skipped: list[str],
                   num_items: int, num_shards: int) -> dict:
    """The manifest of a run before any shard: its settings, what it read and how it splits the work."""
    return {
        "format": FORMAT,
        "target": cfg.target,
        "settings": settings,
        "generation": {**{k: settings[k] for k in ("temperature", "top_k", "top_p", "max_new_tokens", "num_samples",
                                                     "seed", "top_logprobs", "use_chat_template", "backend", "dtype")},
                       "responses": cfg.responses, "chat_template_kwargs": cfg.chat_template_kwargs,
                       "temperatures": cfg.temperatures or [cfg.temperature], "top_ps": cfg.top_ps or [cfg.top_p],
                       "sampling_mix": cfg.sampling_mix if cfg.mixes_sampling else None,
                       "tensor_parallel_size": cfg.tensor_parallel_size,
                       "pipeline_parallel_size": cfg.pipeline_parallel_size},
        "top_logprobs_of": "log_softmax of the target's raw logits (temperature 1, no top-k/top-p)",
        "features": {"layer_ids": cfg.eagle_aux_layer_ids, "dtype": str(RECORDED_STATES_DTYPE).removeprefix("torch."),
                     "of": "the final norm's output, then the residual stream after each of layer_ids, at the "
                           "positions fed to the target"}
        if cfg.record_features else None,
        "prompt_source": {"prompts": cfg.prompts, "split": cfg.split, "column_map": cfg.column_map,
                          "spec_bench_turns": cfg.spec_bench_turns, "limit": cfg.limit},
        "counts": {"prompts": num_prompts, "skipped_too_long": len(skipped), "work_items": num_items,
                   "examples": 0, "generated_tokens": 0, "dropped_turns": 0},
        "skipped_prompt_ids": skipped,
        "num_shards": num_shards,
        "shard_size": cfg.shard_size,
        "fingerprint": fingerprint,
    }
