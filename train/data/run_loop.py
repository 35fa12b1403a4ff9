"""The data stage's run: plan the work, deal its shards to the processes, make each missing shard with the
configured backend and record it; resumable (a rerun redoes exactly the shards not yet listed)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm
from transformers import AutoConfig

from specdec.models import load_tokenizer, resolve_dtype, resolve_path
from specdec.train.data.backend import Backend
from specdec.train.data.backend_dataset import DatasetBackend
from specdec.train.data.backend_transformers import TransformersBackend
from specdec.train.data.backend_vllm import VLLMBackend
from specdec.train.data.config import VLLM_DTYPES, DataConfig, fingerprinted_settings
from specdec.train.data.features import FeatureSpool, features_file, row_key
from specdec.train.data.planning import Item, plan_items
from specdec.train.data.processes import Processes, processes
from specdec.train.data.shards import (
    SHARD_DIR,
    finalise,
    manifest_base,
    prepare_output,
    read_manifest,
    record_shard,
    write_shard,
)
from specdec.train.data.sources import load_prompt_set
from specdec.vllm_env import find_vllm_python, vllm_python

log = logging.getLogger(__name__)

# A knob for the interruption test only: seconds to sleep after each shard is recorded.
PAUSE_ENV = "_SPECDEC_DATA_SHARD_PAUSE"


def resolve_backend(cfg: DataConfig) -> str:
    """backend=auto: vllm where vLLM's environment exists (and the dtype is one vLLM computes in), else transformers."""
    if cfg.backend != "auto":
        return cfg.backend
    dtype = str(resolve_dtype(cfg.dtype)).removeprefix("torch.")
    chosen = "vllm" if dtype in VLLM_DTYPES and find_vllm_python(cfg.vllm_python) is not None else "transformers"
    log.info("backend=auto: %s", chosen if chosen == "transformers" else f"vllm ({find_vllm_python(cfg.vllm_python)})")
    return chosen


def make_backend(cfg: DataConfig, tokenizer, procs: Processes | None = None) -> Backend:
    """The configured backend (on this process's device, under `accelerate launch`)."""
    device = procs.device if procs is not None else None
    if cfg.responses == "dataset":
        return DatasetBackend(cfg, tokenizer, device)
    if resolve_backend(cfg) == "vllm":
        return VLLMBackend(cfg, tokenizer, device, procs)
    return TransformersBackend(cfg, tokenizer, device)


def _context_limit(target: str) -> int | None:
    try:
        config = AutoConfig.from_pretrained(resolve_path(target))
    except OSError as err:
        raise ValueError(f"could not read the config of target {target!r}: {err}") from err
    return getattr(config, "max_position_embeddings", None)


class _Progress:
    """A tqdm bar over examples with the generated tokens per second in its postfix."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = tqdm(total=total, initial=initial, unit="ex", desc="specdec data", disable=not enabled,
                        dynamic_ncols=True)
        self.tokens, self.start = 0, time.perf_counter()

    def __call__(self, examples: int, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        self.bar.update(examples)

    def close(self) -> None:
        self.bar.close()


@dataclass
class _Plan:
    """What a run works on: the work list cut into shards, and the manifest it starts from."""

    items: list[Item]
    tokenizer: object
    context_limit: int | None
    settings: dict
    fingerprint: str
    base: dict
    num_shards: int

    def shard_items(self, s: int, shard_size: int) -> list[Item]:
        return self.items[s * shard_size: (s + 1) * shard_size]


def _plan(cfg: DataConfig, procs: Processes) -> _Plan:
    prompts = load_prompt_set(cfg, procs)
    tokenizer = load_tokenizer(cfg.target)
    context_limit = _context_limit(cfg.target)
    items, skipped, prompt_digest = plan_items(prompts, tokenizer, cfg, context_limit)
    if skipped:
        log.warning("skipped %d prompt(s) over %d tokens (too_long=skip): %s%s", len(skipped), cfg.max_prompt_tokens,
                    ", ".join(skipped[:5]), " ..." if len(skipped) > 5 else "")
    if not items:
        raise ValueError(f"no prompts left to generate from: all {len(prompts)} are over the prompt-length limit; "
                         f"raise max_prompt_tokens")
    settings = fingerprinted_settings(cfg)
    fingerprint = hashlib.sha256(json.dumps([settings, prompt_digest], sort_keys=True).encode()).hexdigest()
    num_shards = math.ceil(len(items) / cfg.shard_size)
    base = manifest_base(cfg, settings, fingerprint, len(prompts), skipped, len(items), num_shards)
    return _Plan(items, tokenizer, context_limit, settings, fingerprint, base, num_shards)


def _make_shard(s: int, plan: _Plan, backend: Backend, cfg: DataConfig, progress: _Progress) -> dict:
    """Write shard s (its features first: a listed shard always has them) and list it; its manifest entry."""
    out = Path(cfg.output_dir)
    started, states_before = time.perf_counter(), backend.states_seconds
    name = f"{SHARD_DIR}/shard-{s:05d}.parquet"
    spool = FeatureSpool(out / features_file(name)) if cfg.record_features else None
    try:
        rows, counts = backend.shard_rows(plan.shard_items(s, cfg.shard_size), plan.tokenizer,
                                          seed=cfg.seed * 1_000_003 + s, context_limit=plan.context_limit,
                                          progress=progress, features=spool)
        if spool is not None:
            spool.write([row_key(r) for r in rows], out / features_file(name))
    finally:
        if spool is not None:
            spool.discard()
    mixed = {"sampling": True} if cfg.mixes_sampling else {}  # per-row sampling columns only where mixed
    write_shard(rows, out / name, cfg.top_logprobs > 0, **mixed)
    counts["seconds"] = round(time.perf_counter() - started, 3)  # generation only, for tokens/s
    if states_before is not None:  # a separate prefill of the states: its share of the seconds
        counts["states_seconds"] = round(backend.states_seconds - states_before, 3)
    entry = {"index": s, "file": name, **counts}
    record_shard(out, entry)
    return entry


def _make_shards(cfg: DataConfig, plan: _Plan, procs: Processes, mine: list[int], todo: list[int],
                 deadline: float) -> None:
    """This process's missing shards, in order, until done or until the next would end past the deadline."""
    backend = make_backend(cfg, plan.tokenizer, procs)
    turns_of = lambda s: sum(len(it.user_turns) for it in plan.shard_items(s, cfg.shard_size))  # noqa: E731
    progress = _Progress(sum(turns_of(s) for s in mine), sum(turns_of(s) for s in mine if s not in todo),
                         enabled=procs.index == 0)
    pause = float(os.environ.get(PAUSE_ENV, "0") or 0)
    last_shard_s = generation_s = 0.0
    try:
        for s in todo:
            # No shard that would end past max_minutes at the last one's pace; but a run always adds one,
            # so that a budget spent on loading still makes progress.
            if s != todo[0] and time.perf_counter() + last_shard_s > deadline:
                log.warning("max_minutes=%s: stopping before shard %d (%d of this process's %d shards done); "
                            "rerun the same command to continue", cfg.max_minutes, s,
                            len(mine) - len(todo) + todo.index(s), len(mine))
                break
            shard_started = time.perf_counter()
            entry = _make_shard(s, plan, backend, cfg, progress)
            generation_s += entry["seconds"]
            log.info("process %d/%d wrote %s (%d examples)", procs.index, procs.count, entry["file"],
                     entry["examples"])
            if pause:
                time.sleep(pause)
            last_shard_s = time.perf_counter() - shard_started
    finally:
        progress.close()
        backend.close()
    if backend.states_seconds is not None:
        log.info("prefill of states: %.1f s of %.1f s (process %d's shards, engine start excluded)",
                 backend.states_seconds, generation_s, procs.index)


def run(cfg: DataConfig) -> dict:
    """Generate (or finish generating) the dataset; returns the manifest."""
    deadline = time.perf_counter() + cfg.max_minutes * 60 if cfg.max_minutes else math.inf
    procs = processes(cfg)
    cfg = dataclasses.replace(cfg, backend=resolve_backend(cfg))  # the manifest records the backend used
    if cfg.backend == "vllm" and cfg.responses == "target":
        vllm_python(cfg.vllm_python)  # raises with how to make it, before minutes of prompt loading, not after
    plan = _plan(cfg, procs)
    out = Path(cfg.output_dir)
    if procs.is_main:
        prepare_output(cfg, plan.settings, plan.fingerprint, plan.base)
    procs.barrier()
    manifest = read_manifest(out)
    done = {s["index"] for s in manifest["shards"] if (out / s["file"]).is_file()}
    mine = [s for s in range(plan.num_shards) if s % procs.count == procs.index]
    todo = [s for s in mine if s not in done]
    if todo:
        _make_shards(cfg, plan, procs, mine, todo, deadline)
    procs.barrier()
    return finalise(out) if procs.is_main else read_manifest(out)
