"""Target-generated distillation data: prompts -> the target's own completions (+ its top-n log-probs).

    specdec data --config recipes/smollm2-135m.yaml                      # one process
    python -m specdec.train.data prompts=my.jsonl target=HuggingFaceTB/SmolLM2-1.7B-Instruct output_dir=runs/data
    accelerate launch --multi_gpu --num_processes 4 -m specdec.train.data --config recipes/X.yaml  # shards split
    specdec data prompts=sharegpt.jsonl responses=dataset record_features=true eagle_aux_layer_ids=[2,15,27]

Prompts come from a local .jsonl/.json/.parquet/.csv file, a Hub dataset name, the embedded prompt set
(`embedded:train`, `embedded:heldout`), or `self:N`: N requests the target writes itself (train/self_prompts.py).
Every row goes through `specdec.prompts.normalise_record`. With responses=dataset nothing is generated: each
assistant answer of a conversation (`messages`, ShareGPT `conversations`) becomes a row of the dataset's own tokens.

Output, resumable (rerun the same command after a crash; finished shards are kept):

    <output_dir>/manifest.json                 settings, prompt source, counts, shard list, complete flag
    <output_dir>/shards/shard-00000.parquet     prompt_id, category, sample_index, turn, input_ids (prompt +
                                                completion), prompt_length [, top_ids, top_logprobs]
    <output_dir>/shards/shard-00000.features.safetensors   with record_features=true: the target's states
                                                (specdec/eagle3.py) at each row's fed positions, tensor
                                                "<row index>" [prompt + completion - 1, W] bfloat16, so an EAGLE-3
                                                draft trains with no target forward
    <output_dir>/vllm-worker.log               with backend=vllm: the engine's own log (of the latest run;
                                                vllm-worker-<i>.log per process under accelerate launch)

Backends: `transformers` (specdec's batched decoder, in this process) or `vllm`: vLLM's offline engine in its own
environment (`make vllm-env`), reached through train/vllm_worker.py, started once per run and kept across shards
(one engine per process under accelerate launch: its GPU, or its share of a CPU's cores). With record_features
vLLM's features come from its own forwards (its extract_hidden_states method, `vllm_states=extract`) or from one
batched transformers prefill over each prompt + completion (`prefill`), so the stored result has the same format
whichever backend made it. `auto` picks vllm where its environment exists.

The work list (prompt x sample, shuffled) is cut into shards of `shard_size` items; shard s belongs to
process s % num_processes. A shard is written to a temporary file and renamed, then recorded in the manifest,
so a shard is either complete and listed or absent/ignored: a rerun redoes exactly the missing ones. Its features
are written as each generation batch is done (to a spool beside it, assembled into its features file at the end),
so a process holds one batch's features, not a shard's.
Each shard samples from its own generator seeded by (seed, shard), so for a given batch_size the result does
not depend on where a run was interrupted or on the number of processes (greedy data does not depend on
batch_size either, up to floating-point near-ties).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from accelerate import PartialState
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig, GenerationConfig

from specdec.config import config_from_cli, to_dict
from specdec.decode import target_generate
from specdec.eagle3 import RECORDED_STATES_DTYPE, HiddenStateRecorder
from specdec.models import (
    EMBEDDED_TARGET,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_path,
)
from specdec.prompts import Prompt, encode_prompt, normalise_record, read_prompts
from specdec.sampling import SamplingConfig
from specdec.tokens import cut_at_eos, eos_ids, pad_id
from specdec.train import self_prompts
from specdec.train.budget import check_minutes
from specdec.train.prompt_set import EMBEDDED_HELDOUT_PROMPTS, EMBEDDED_TRAIN_PROMPTS
from specdec.vllm_env import find_vllm_python, vllm_python

log = logging.getLogger(__name__)

FORMAT = "specdec-data/1"
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
EMBEDDED_PROMPT_SETS = ("embedded:train", "embedded:heldout")
_LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Settings that do not change what is generated; a resumed run may change them.
_RESUMABLE_KEYS = ("batch_size", "device", "output_dir", "overwrite", "max_minutes", "vllm_python", "vllm_states")
# Settings added later, left out of the fingerprint at their defaults: folders made before they existed still resume.
_LATER_DEFAULTS = {"responses": "target"}
# A knob for the interruption test only: seconds to sleep after each shard is recorded.
_PAUSE_ENV = "_SPECDEC_DATA_SHARD_PAUSE"
BACKENDS = ("transformers", "vllm", "auto")
RESPONSES = ("target", "dataset")
VLLM_STATES = ("auto", "extract", "prefill")
_VLLM_WORKER = Path(__file__).with_name("vllm_worker.py")
_VLLM_LOG = "vllm-worker.log"  # vLLM's own log, beside the data
_VLLM_START_TIMEOUT_S = 1800.0  # a first start may download the model, and on a CPU compiles it for minutes
_VLLM_REQUEST_TIMEOUT_S = 600.0  # plus the request's tokens at the slowest rate an engine plausibly decodes
_VLLM_SLOWEST_TOKENS_PER_S = 5.0
_VLLM_CPU_KVCACHE_GIB = "2"  # GiB of KV cache on a CPU: 1 is plenty for small models; 2 holds a batch of 64 SmolLM2 rows
_VLLM_DTYPES = ("float32", "bfloat16", "float16")  # vLLM has no float64


@dataclass
class DataConfig:
    """`specdec data` settings (recipe section `data:` plus the shared keys)."""

    target: str = EMBEDDED_TARGET
    prompts: str = "embedded:train"  # local file, Hub dataset name, embedded:train / embedded:heldout, or self:N
    split: str = "train"  # Hub datasets only
    column_map: dict[str, str] | None = None  # rename a data set's columns, e.g. {instruction: prompt}
    spec_bench_turns: str = "all"  # multi-turn prompts: "all" turns (each after the target's own answers) or "first"
    use_chat_template: bool = True
    max_prompt_tokens: int = 1024
    too_long: str = "skip"  # "skip" (counted in the manifest) or "error"
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    num_samples: int = 1  # completions per prompt
    # "target": the target answers each user turn (generation); "dataset": keep the conversations' own assistant
    # answers (`messages` or ShareGPT `conversations` with assistant turns), one row per answer, nothing generated;
    # record_features / top_logprobs then come from one prefill of each row
    responses: str = "target"
    seed: int = 0
    max_new_tokens: int = 256
    batch_size: int = 16
    sort_by_length: bool = True  # batches of similar lengths inside each shard (less padding)
    # Deal the work list to shards in a seeded random order (the longest item first), so that any run of
    # finished shards is a uniform sample of the prompt set: a run stopped by max_minutes keeps every source and
    # length in proportion. false = the prompt files' order.
    shuffle: bool = True
    shard_size: int = 256  # prompt x sample items per shard
    top_logprobs: int = 0  # 0 = off, else keep the target's n most likely tokens at each completion position
    # "vllm": vLLM's offline engine in its own environment (`make vllm-env`), batch_size sequences at a time;
    # "auto": vllm where that environment exists, else transformers
    backend: str = "transformers"
    vllm_python: str | None = None  # vLLM's Python; default $SPECDEC_VLLM_PYTHON, then .venv-vllm/bin/python
    vllm_args: dict[str, Any] | None = None  # more keyword arguments of vllm.LLM, e.g. {enforce_eager: true}
    # backend=vllm with record_features: "extract" takes the states from vLLM's own forwards (its
    # extract_hidden_states method), "prefill" from a transformers prefill after decoding, "auto" extracts unless
    # sampling on a CPU
    vllm_states: str = "auto"
    output_dir: str = "runs/data"
    device: str = "auto"
    dtype: str = "auto"
    limit: int | None = None  # use only the first N prompts
    # prompts=self:N: the target writes N user requests itself (train/self_prompts.py)
    self_prompt_temperature: float = 0.8
    self_prompt_top_p: float = 1.0
    self_prompt_max_tokens: int = 64
    overwrite: bool = False  # replace an existing output_dir made with different settings
    # Start no shard that would end past this many minutes of this run (self-written prompts included) at the
    # last shard's pace, one at least: the folder is left incomplete, usable, and a rerun continues it.
    max_minutes: float | None = None
    # Keep the target's states at every fed position, as an EAGLE-3 draft reads them (train: draft=eagle3 with the
    # same eagle_aux_layer_ids): its final hidden state (the online teacher's input), then the residual stream
    # after each of `eagle_aux_layer_ids` (vLLM's numbering, e.g. [2, 15, 27] of 30 layers). Computed by the
    # decoding anyway, they spare training a target forward per sample: 4.6 KB a token for SmolLM2 with 3 layers.
    record_features: bool = False
    eagle_aux_layer_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        choices = {"spec_bench_turns": ("first", "all"), "too_long": ("skip", "error"),
                   "backend": BACKENDS, "responses": RESPONSES, "vllm_states": VLLM_STATES}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        positive = ("max_prompt_tokens", "num_samples", "max_new_tokens", "batch_size", "shard_size")
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0 (0 = off), got {self.top_logprobs}")
        if self.responses == "dataset" and self.num_samples != 1:
            raise ValueError(f"responses=dataset keeps each conversation's own answers, the same tokens for every "
                             f"sample: set num_samples=1 (got {self.num_samples})")
        check_minutes(self.max_minutes)
        if bool(self.eagle_aux_layer_ids) != self.record_features:
            raise ValueError("record_features=true keeps the target's states after the layers eagle_aux_layer_ids "
                             "names (those its EAGLE-3 draft reads, e.g. [2, 15, 27] for a 30-layer target): set "
                             "both, or neither")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 (or unset for all prompts), got {self.limit}")
        if self.vllm_args is not None and not isinstance(self.vllm_args, dict):
            raise ValueError(f"vllm_args must be a mapping of vllm.LLM arguments such as {{enforce_eager: true}}, "
                             f"got {self.vllm_args!r}")
        if self.column_map is not None and not isinstance(self.column_map, dict):
            raise ValueError(f"column_map must be a mapping such as {{instruction: prompt}}, got {self.column_map!r}")
        if not self.prompts:
            raise ValueError("prompts is empty: give a .jsonl/.json/.parquet/.csv file, a Hub dataset name or "
                             "embedded:train")
        self.sampling()  # validates temperature / top_k / top_p

        dtype = str(resolve_dtype(self.dtype)).removeprefix("torch.")  # raises with the valid names, before any load
        if self.backend == "vllm" and dtype not in _VLLM_DTYPES:
            raise ValueError(f"backend=vllm computes in {', '.join(_VLLM_DTYPES)}, not {dtype}; use dtype=float32 "
                             f"or backend=transformers")

    def sampling(self):
        """The decoder's SamplingConfig for these settings."""

        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


# --------------------------------------------------------------------------------------------------------
# Prompts


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


def _self_prompt_file(cfg: DataConfig, n: int, procs: _Processes | None) -> Path:
    """The file of n target-written prompts (self:N), written first by the main process if needed."""

    if procs is None or procs.is_main:
        self_prompts.generate(cfg, n, Path(cfg.output_dir), procs.device if procs else None)
    if procs is not None:
        procs.barrier()
    return self_prompts.path_for(cfg, Path(cfg.output_dir))


def load_prompt_set(cfg: DataConfig, procs: _Processes | None = None) -> list[Prompt]:
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


def conversation(prompt: Prompt, turns: str) -> tuple[list[dict], list[str]]:
    """Split a prompt into (fixed history, user turns the target answers in order).

    A list of user turns with no assistant messages (Spec-Bench, MT-Bench) is a multi-turn conversation:
    the target answers turn 1, then turn 2 after its own answer, and so on (`turns="first"` keeps turn 1).
    Any other chat is one example: the target answers its last user message, after the history given.
    """
    msgs = prompt.messages
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    if len(users) > 1 and not any(m["role"] == "assistant" for m in msgs):
        history = [m for m in msgs if m["role"] == "system"]
        user_turns = [msgs[i]["content"] for i in users]
        return history, user_turns[:1] if turns == "first" else user_turns
    last = users[-1]
    return msgs[:last], [msgs[last]["content"]]


def dataset_turns(prompt: Prompt) -> list[tuple[list[dict], str]]:
    """responses=dataset: (the messages before it, its text) for each assistant answer that follows a user message."""
    msgs = prompt.messages
    return [(msgs[:i], m["content"]) for i, m in enumerate(msgs)
            if m["role"] == "assistant" and any(x["role"] == "user" for x in msgs[:i])]


@dataclass
class Item:
    """One unit of work: a prompt, which of its samples, and the token count of its first turn.

    responses=dataset: `history` is the whole conversation and `user_turns` the user message each answer follows
    (one row each)."""

    prompt: Prompt
    sample_index: int
    history: list[dict]
    user_turns: list[str]
    first_length: int


def plan_items(prompts: list[Prompt], tokenizer, cfg: DataConfig, context_limit: int | None) -> tuple[list[Item], list[str], str]:
    """Work list (prompt x sample, shuffled when `shuffle`), ids skipped as too long, and its fingerprint."""
    dataset = cfg.responses == "dataset"
    limit = cfg.max_prompt_tokens
    if context_limit is not None:
        # responses=dataset generates nothing: a prompt need only leave room for its answer's first token
        limit = min(limit, context_limit - (1 if dataset else cfg.max_new_tokens))
        if limit < 1:
            raise ValueError(f"max_new_tokens={cfg.max_new_tokens} leaves no room for a prompt in the target's "
                             f"context of {context_limit} tokens; lower max_new_tokens")
    items, skipped, unanswered = [], [], []
    digest = hashlib.sha256()
    for p in prompts:
        if dataset:
            turns = dataset_turns(p)
            if not turns:
                unanswered.append(p.prompt_id)
                continue
            history = p.messages
            user_turns = [next(m["content"] for m in reversed(before) if m["role"] == "user") for before, _ in turns]
            ids = encode_prompt(tokenizer, turns[0][0], cfg.use_chat_template)
        else:
            history, user_turns = conversation(p, cfg.spec_bench_turns)
            ids = encode_prompt(tokenizer, history + [{"role": "user", "content": user_turns[0]}],
                                cfg.use_chat_template)
        if len(ids) > limit:
            if cfg.too_long == "error":
                raise ValueError(f"prompt {p.prompt_id!r} has {len(ids)} tokens, over the limit of {limit} "
                                 f"(max_prompt_tokens, and the context minus max_new_tokens); raise "
                                 f"max_prompt_tokens or set too_long=skip")
            skipped.append(p.prompt_id)
            continue
        digest.update(json.dumps([p.prompt_id, ids, p.messages if dataset else user_turns[1:]]).encode())
        items += [Item(p, s, history, user_turns, len(ids)) for s in range(cfg.num_samples)]
    if unanswered:
        if len(unanswered) == len(prompts):
            raise ValueError(f"responses=dataset keeps the conversations' own assistant answers, but none of the "
                             f"{len(prompts)} records has one (`messages` with assistant turns, or ShareGPT "
                             f"`conversations`); use responses=target to have the target answer them")
        log.warning("responses=dataset: %d conversation(s) without an assistant answer left out: %s%s",
                    len(unanswered), ", ".join(unanswered[:5]), " ..." if len(unanswered) > 5 else "")
    if cfg.shuffle and items:
        random.Random(cfg.seed).shuffle(items)
        # The longest item first: a memory problem shows in the first batch, not hours in.
        longest = max(range(len(items)), key=lambda i: items[i].first_length)
        items.insert(0, items.pop(longest))
    return items, skipped, digest.hexdigest()


# --------------------------------------------------------------------------------------------------------
# Backends: generate completions for a list of prompt token lists


@dataclass
class Completion:
    tokens: list[int]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # record_features: [prompt + len(tokens) - 1, W] bf16, the positions fed to the target; or a function that
    # loads them (a backend that holds a whole request's completions computes them as they are taken)
    features: Any = None

    def take_features(self) -> torch.Tensor:
        """The features, handed over: this completion holds them no longer."""
        features, self.features = self.features, None
        return features() if callable(features) else features


class TransformersBackend:
    """Batched, left-padded decoding with specdec's target_generate, which also keeps the top-n log-probs."""

    def __init__(self, cfg: DataConfig, tokenizer, device=None):

        self.cfg, self.sampling = cfg, cfg.sampling()
        self.model = load_model(cfg.target, dtype=cfg.dtype, device=device if device is not None else cfg.device)
        self.device = next(self.model.parameters()).device
        log.info("target %s in %s on %s", cfg.target, self.model.dtype, self.device)
        self.eos = eos_ids(self.model, tokenizer)
        self.pad = pad_id(tokenizer.pad_token_id, self.eos)

    def generator(self, seed: int):

        return torch.Generator(device=self.device).manual_seed(seed)

    def generate(self, prompts: list[list[int]], generator) -> list[Completion]:
        """Completions of one batch of prompts (token lists of any lengths)."""


        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        recording = HiddenStateRecorder(self.model, self.cfg.eagle_aux_layer_ids, final=True, history=True) \
            if self.cfg.record_features else contextlib.nullcontext()
        with recording as recorder:
            out = target_generate(self.model, ids, mask, sampling=self.sampling,
                                  max_new_tokens=self.cfg.max_new_tokens, eos_token_id=self.eos or None,
                                  generator=generator, pad_token_id=self.pad, top_logprobs=self.cfg.top_logprobs)
        new = out.sequences[:, width:].tolist()
        completions = [Completion(cut_at_eos(row, self.eos)) for row in new]
        if recorder is not None:
            # history: the prefill [B, width, W], then one [B, 1, W] per step (the step feeding completion token j).
            prefill, steps = recorder.history[0], torch.cat(recorder.history[1:] or [recorder.history[0][:, :0]], 1)
            for row, (p, comp) in enumerate(zip(prompts, completions)):
                comp.features = torch.cat([prefill[row, width - len(p):], steps[row, : len(comp.tokens) - 1]])
        if self.cfg.top_logprobs:
            # Taken from the decoding logits: a second forward over the sequences would nearly double the cost.
            top_ids, top_lp = out.top_ids.tolist(), out.top_logprobs.tolist()
            for row, comp in enumerate(completions):
                c = len(comp.tokens)
                comp.top_ids, comp.top_logprobs = top_ids[row][:c], top_lp[row][:c]
        return completions


class _VLLMWorker:
    """train/vllm_worker.py under vLLM's own Python: one engine, spoken to in JSON lines over stdin/stdout.

    Its stderr (vLLM's log) goes to `log_path`, whose tail every error quotes. It runs in a session of its own, so
    that closing it also ends any engine process vLLM started, and it dies with this process (see the worker)."""

    def __init__(self, python: Path, engine_args: dict, env: dict, log_path: Path, what: str):
        self.log_path, self.what = log_path, what
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([str(python), str(_VLLM_WORKER), json.dumps(engine_args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env, text=True,
                                     start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.version = self._receive(_VLLM_START_TIMEOUT_S, "start").get("vllm", "?")
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # the worker closed its stdout: it has exited

    def tail(self, chars: int = 3000) -> str:
        """The end of vLLM's log (where its own error message is)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        if len(text) > chars:
            text = text[-chars:].partition("\n")[2]  # whole lines only
        return text.strip()

    def _fail(self, message: str) -> ValueError:
        self.close()  # first: a stopped worker has written all of its log
        return ValueError(f"{message}\n--- the end of vLLM's log ({self.log_path}) ---\n{self.tail()}")

    def _receive(self, timeout_s: float, doing: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise self._fail(f"vLLM did not {doing} within {timeout_s:.0f} s ({self.what}); it is stopped. "
                                     f"See its log below; use backend=transformers to do without it") from None
                continue
            if line is None:
                try:
                    code = self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    code = "unknown"
                raise self._fail(f"vLLM exited (code {code}) before it could {doing} ({self.what}); its message is "
                                 f"below. Fix what it names (target=, dtype=, memory: VLLM_CPU_KVCACHE_SPACE in GiB "
                                 f"on a CPU), or use backend=transformers")
            message = json.loads(line)
            if "error" in message:
                raise self._fail(f"vLLM could not {doing} ({self.what}): {message['error']}. Fix what it names "
                                 f"(target=, dtype=, memory: VLLM_CPU_KVCACHE_SPACE in GiB on a CPU), or use "
                                 f"backend=transformers")
            return message

    def request(self, message: dict, timeout_s: float) -> dict:
        """Send one request and wait (at most timeout_s) for its answer."""
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: _receive reports why
        return self._receive(timeout_s, "generate")

    def close(self) -> None:
        """Let an idle worker exit (it does once its stdin closes); else (a run interrupted mid-request) end its
        whole session."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()


class VLLMBackend:
    """The same interface on vLLM's offline engine, which runs in vLLM's own environment (train/vllm_worker.py):
    one engine start per run, kept across shards, at most batch_size sequences decoded together (max_num_seqs).
    Under `accelerate launch` each process starts its own engine on its own device (its GPU; on a CPU machine its
    share of the cores).

    With record_features the states come from vLLM's own forwards where `states_mode` is "extract": its
    extract_hidden_states method keeps the residual stream after each of eagle_aux_layer_ids and after the last
    layer at every fed position, and this process applies the target's final norm to the last (one norm module,
    read from the checkpoint). Else ("prefill") from one batched transformers prefill over each prompt + completion
    afterwards. Either way the same positions, layout and dtype as the transformers backend records while it
    decodes."""

    def __init__(self, cfg: DataConfig, tokenizer, device=None, procs: _Processes | None = None):

        self.cfg = cfg
        self.procs = procs or _Processes()
        python = vllm_python(cfg.vllm_python)
        device = device if device is not None else self.procs.device if self.procs.device is not None \
            else resolve_device(cfg.device)
        dtype = str(resolve_dtype(cfg.dtype, device)).removeprefix("torch.")  # vLLM spells dtypes as torch does
        self.eos = eos_ids(_GenerationConfigOf(resolve_path(cfg.target)), tokenizer)
        self.pad = pad_id(tokenizer.pad_token_id, self.eos)
        self.states_mode = states_mode(cfg, device)
        self.features_model, self.final_norm, self.states_dir = None, None, None
        self.states_seconds = 0.0  # the prefill's share of generate(), for the log line
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.states_mode == "extract":
            try:
                self.final_norm = final_norm(cfg.target).to(getattr(torch, dtype))  # computes as transformers would
            except ValueError as err:
                if cfg.vllm_states != "auto":
                    raise
                log.warning("vllm_states=auto: %s; computing the states by a prefill instead", err)
                self.states_mode = "prefill"
        if self.states_mode == "prefill":  # before the engine, which on a GPU sizes its cache to the free memory
            self.features_model = load_model(cfg.target, dtype=dtype, device=device)
        elif self.states_mode == "extract":
            self.states_dir = out / f".vllm-states-{self.procs.index}"  # vLLM writes one file per request here
            shutil.rmtree(self.states_dir, ignore_errors=True)  # an interrupted run's
            self.states_dir.mkdir()
        args, env = _engine_settings(cfg, device, dtype, self.features_model is not None, self.procs,
                                     self.states_dir, self._extracted_layers())
        log_path = out / (_VLLM_LOG if self.procs.count == 1 else f"vllm-worker-{self.procs.index}.log")
        log.info("starting vLLM (%s) for target %s in %s on %s (states: %s); its log: %s", python, cfg.target, dtype,
                 env.get("CUDA_VISIBLE_DEVICES", device.type) if device.type == "cuda" else "cpu",
                 self.states_mode or "none", log_path)
        self.worker = _VLLMWorker(python, args, env, log_path, what=f"target {cfg.target}, {python}")
        log.info("vLLM %s is up", self.worker.version)

    def _extracted_layers(self) -> list[int] | None:
        """The layers vLLM keeps in extract mode: eagle_aux_layer_ids, then the last (for the final norm's output)."""
        if self.states_mode != "extract":
            return None
        num_layers = AutoConfig.from_pretrained(resolve_path(self.cfg.target)).get_text_config().num_hidden_layers
        return sorted(self.cfg.eagle_aux_layer_ids) + [num_layers]

    def generator(self, seed: int) -> int:
        return seed

    def generate(self, prompts: list[list[int]], generator: int) -> list[Completion]:
        """All prompts in one request (vLLM schedules its own batches); one seed per prompt. Features, when
        recorded, are loaded as each completion's are taken (`Completion.take_features`), so that a request of a
        whole shard holds at most one prefill batch of them (or, extracted, one row's) in memory."""
        cfg = self.cfg
        request = {"prompts": prompts, "seeds": [generator * 1_000_003 + i for i in range(len(prompts))],
                   "temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p,
                   "max_tokens": cfg.max_new_tokens, "top_logprobs": cfg.top_logprobs, "stop_token_ids": self.eos,
                   "states": self.states_mode == "extract"}
        timeout = _VLLM_REQUEST_TIMEOUT_S + len(prompts) * cfg.max_new_tokens / _VLLM_SLOWEST_TOKENS_PER_S
        answers = self.worker.request(request, timeout)["completions"]
        completions = []
        for answer in answers:
            comp = Completion(cut_at_eos(answer["tokens"], self.eos))
            if cfg.top_logprobs:
                comp.top_ids = answer["top_ids"][: len(comp.tokens)]
                comp.top_logprobs = answer["top_logprobs"][: len(comp.tokens)]
            completions.append(comp)
        if self.states_mode == "extract":
            for p, comp, answer in zip(prompts, completions, answers):
                comp.features = functools.partial(self._extracted, answer["states"], p + comp.tokens)
        elif self.states_mode == "prefill":
            chunks = _PrefillChunks(self._prefill, [p + c.tokens for p, c in zip(prompts, completions)],
                                    cfg.batch_size)
            for i, comp in enumerate(completions):
                comp.features = functools.partial(chunks.take, i)
        return completions

    def _prefill(self, sequences: list[list[int]]) -> list[Any]:
        started = time.perf_counter()
        features = prefill_features(self.features_model, sequences, self.cfg.eagle_aux_layer_ids,
                                    self.cfg.batch_size, self.pad)
        self.states_seconds += time.perf_counter() - started
        return features

    def _extracted(self, path: str, sequence: list[int]) -> torch.Tensor:
        """One request's states from vLLM's file (then deleted): [len(sequence) - 1, W] as recorded."""
        fed = len(sequence) - 1
        try:
            with safe_open(path, "pt") as f:
                states, ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")  # [T, layers, H], [T]
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if ids[:fed].tolist() != sequence[:fed] or len(states) < fed:
            raise ValueError(f"vLLM's hidden states ({path}) are of other tokens than its completion: "
                             f"{ids[:8].tolist()}... vs {sequence[:8]}...; use vllm_states=prefill")
        states = states[:fed]
        with torch.inference_mode():
            final = self.final_norm(states[:, -1].to(self.final_norm.weight.dtype))
        parts = [final.to(states.dtype)] + [states[:, i] for i in range(states.shape[1] - 1)]
        return torch.cat(parts, dim=-1).to(RECORDED_STATES_DTYPE)

    def close(self) -> None:
        self.worker.close()
        if self.states_dir is not None:
            shutil.rmtree(self.states_dir, ignore_errors=True)


class _PrefillChunks:
    """Prefill features of a request's sequences, batch_size of them at a time, in the order they are taken: each
    chunk is computed when its first row is asked for, and a row's features are dropped once taken."""

    def __init__(self, compute, sequences: list[list[int]], batch_size: int):
        self.compute, self.sequences, self.batch_size = compute, sequences, batch_size
        self.ready: dict[int, Any] = {}

    def take(self, i: int):
        if i not in self.ready:
            start = i - i % self.batch_size
            chunk = range(start, min(start + self.batch_size, len(self.sequences)))
            self.ready = dict(zip(chunk, self.compute([self.sequences[j] for j in chunk])))
        return self.ready.pop(i)


def states_mode(cfg: DataConfig, device) -> str | None:
    """How backend=vllm gets the target's states: None (not recorded), "extract" or "prefill"."""
    if not cfg.record_features:
        return None
    # vLLM extracts through its speculative-decoding path (a one-token "draft" each step): greedy output stays the
    # target's own (tested), but sampled verification on vLLM's CPU build is not known exact: a CPU samples plainly.
    exact = cfg.temperature == 0 or device.type == "cuda"
    if cfg.vllm_states == "extract" and not exact:
        raise ValueError("vllm_states=extract with temperature > 0 on a CPU: vLLM's speculative-decoding path, which "
                         "the extraction runs, is not known to sample exactly there; use vllm_states=prefill (or "
                         "auto), or greedy data")
    if cfg.vllm_states == "auto":
        return "extract" if exact else "prefill"
    return cfg.vllm_states


def final_norm(target: str) -> torch.nn.Module:
    """The target's final norm alone (the module transformers applies before the head), its weights read from the
    checkpoint: what turns vLLM's residual stream after the last layer into the recorded final state."""

    path = resolve_path(target)
    if not Path(path).is_dir():  # a Hub id: vLLM has downloaded it by now

        from huggingface_hub import snapshot_download

        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"])
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    norm = model.get_decoder().norm
    prefix = next(name for name, module in model.named_modules() if module is norm)
    wanted = {f"{prefix}.{key}": key for key in norm.state_dict()}
    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in wanted.keys() & set(f.keys()):
                found[wanted[key]] = f.get_tensor(key)
    if set(found) != set(wanted.values()):
        raise ValueError(f"could not find the final norm's weights ({', '.join(wanted)}) in {path}'s safetensors "
                         f"files (needed to extract the states from vLLM); use vllm_states=prefill")
    norm.to_empty(device="cpu")
    norm.load_state_dict(found)
    return norm.eval().requires_grad_(False)


_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                 "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _engine_settings(cfg: DataConfig, device, dtype: str, prefill_model_loaded: bool, procs: _Processes | None = None,
                     states_dir: Path | None = None, extracted_layers: list[int] | None = None) -> tuple[dict, dict]:
    """vllm.LLM's keyword arguments and the worker's environment for this run (this process's engine)."""

    procs = procs or _Processes()
    args = {"model": resolve_path(cfg.target), "dtype": dtype, "seed": cfg.seed, "max_num_seqs": cfg.batch_size}
    # vLLM's own packages; and not the launcher's rank variables: each process's engine is a world of its own
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME") + _LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
    env["SPECDEC_VLLM_PARENT"] = str(os.getpid())
    if device.type == "cpu":
        # One process (it starts faster than with vLLM's default engine process) and a KV cache of a
        # set size: vLLM's CPU default is a share of the machine's memory.
        args["distributed_executor_backend"] = "uni"
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", _VLLM_CPU_KVCACHE_GIB)
        if procs.count > 1:
            cpus = _cpu_share(procs.index, procs.count, os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
            # The in-process engine runs on the cores the worker pins itself to, with one OpenMP thread each;
            # VLLM_CPU_OMP_THREADS_BIND is the same list for vLLM's own engine processes (vllm_args may ask for them).
            env.update(SPECDEC_VLLM_CPUS=",".join(map(str, cpus)), OMP_NUM_THREADS=str(len(cpus)),
                       VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)))
    elif device.type == "cuda":
        if procs.count > 1:  # this process's GPU only, as the engine's cuda:0
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            index = device.index if device.index is not None else torch.cuda.current_device()
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
        if prefill_model_loaded or torch.cuda.is_initialized():
            # Leave the prefill model (and this process's CUDA context, under a launch) their room.
            free, total = torch.cuda.mem_get_info(device)
            args["gpu_memory_utilization"] = round(0.9 * free / total, 3)
    if extracted_layers is not None:
        args["speculative_config"] = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                      "draft_model_config": {"hf_config": {
                                          "eagle_aux_hidden_state_layer_ids": extracted_layers}}}
        args["kv_transfer_config"] = {"kv_connector": "SpecdecHiddenStatesConnector",
                                      "kv_connector_module_path": "vllm_worker", "kv_role": "kv_producer",
                                      "kv_connector_extra_config": {"shared_storage_path": str(states_dir),
                                                                    "use_synchronization_lock": False}}
    args.update(cfg.vllm_args or {})
    return args, env


def _cpu_share(index: int, count: int, bind: str | None) -> list[int]:
    """Process `index`'s CPUs of `count` processes on this machine: its part of a '|'-separated
    VLLM_CPU_OMP_THREADS_BIND (e.g. "0-15|16-31"), else an even split of the CPUs this process may use."""
    if bind and bind not in ("auto", "nobind") and len(bind.split("|")) == count:
        cpus = []
        for part in bind.split("|")[index].split(","):
            first, _, last = part.partition("-")
            cpus += list(range(int(first), int(last or first) + 1))
        return cpus
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    if len(allowed) < count:
        return [allowed[index % len(allowed)]]
    return allowed[index * len(allowed) // count: (index + 1) * len(allowed) // count]


class _GenerationConfigOf:
    """Stands in for a model in eos_ids: the checkpoint's generation config, read without loading its weights."""

    def __init__(self, path: str):

        try:
            self.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: transformers derives one from config.json, as here
            self.generation_config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))


def prefill_features(model, sequences: list[list[int]], layer_ids: list[int], batch_size: int,
                     pad: int) -> list[Any]:
    """The target's features at each sequence's fed positions (all but its last token), [len - 1, W] bf16 on the
    CPU, as the transformers backend records them while decoding; from batched, right-padded prefills."""
    return [f for f, _, _ in prefill(model, sequences, layer_ids, batch_size, pad)]


def prefill(model, sequences: list[list[int]], layer_ids: list[int] | None, batch_size: int, pad: int,
            top_n: int = 0, prompt_lengths: list[int] | None = None) -> list[tuple[Any, Any, Any]]:
    """Per sequence, from batched, right-padded prefills of its fed positions (all but its last token): its
    features ([len - 1, W] bf16 on the CPU, as the transformers backend records them while decoding; None when
    `layer_ids` is None) and, with top_n, the n most likely ids and their log-probs (log_softmax of the raw
    logits) at each position from prompt_lengths[i] - 1 on, the ones that predict its completion tokens."""

    device = next(model.parameters()).device
    fed = [seq[:-1] for seq in sequences]
    order = sorted(range(len(fed)), key=lambda i: -len(fed[i]))  # similar lengths together: less padding
    out: list[tuple[Any, Any, Any]] = [(None, None, None)] * len(fed)
    hidden = model.config.get_text_config().hidden_size
    head = model.get_output_embeddings()
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    with HiddenStateRecorder(model, layer_ids or [], final=True) as recorder, torch.inference_mode():
        for start in range(0, len(order), batch_size):
            chunk = order[start: start + batch_size]
            width = max(len(fed[i]) for i in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):
                # Right padding keeps each row's positions 0..n-1, and causal attention keeps pads out of real rows.
                ids[row, : len(fed[i])] = torch.tensor(fed[i], dtype=torch.long)
                mask[row, : len(fed[i])] = 1
            model.get_decoder()(input_ids=ids.to(device), attention_mask=mask.to(device))
            latest = recorder.latest  # [b, width, W]; the final norm's output first
            for row, i in enumerate(chunk):
                features = top_ids = top_lp = None
                if layer_ids is not None:
                    features = latest[row, : len(fed[i])].to("cpu", RECORDED_STATES_DTYPE)
                if top_n:
                    logits = head(latest[row, prompt_lengths[i] - 1: len(fed[i]), :hidden]).float()  # [c, V]
                    if softcap:
                        logits = torch.tanh(logits / softcap) * softcap
                    best = torch.log_softmax(logits, dim=-1).topk(top_n, dim=-1)
                    top_ids, top_lp = best.indices.tolist(), best.values.tolist()
                out[i] = (features, top_ids, top_lp)
    return out


class DatasetBackend:
    """responses=dataset: nothing generated. The target is loaded only to prefill each row (prompt + the dataset's
    answer) once, for its features and top log-probs, when either is asked for."""

    def __init__(self, cfg: DataConfig, tokenizer, device=None):

        self.cfg = cfg
        self.model = None
        if cfg.record_features or cfg.top_logprobs:
            self.model = load_model(cfg.target, dtype=cfg.dtype, device=device if device is not None else cfg.device)
            log.info("target %s in %s on %s (a prefill of the dataset's answers)", cfg.target, self.model.dtype,
                     next(self.model.parameters()).device)
        self.eos = eos_ids(self.model if self.model is not None else _GenerationConfigOf(resolve_path(cfg.target)),
                           tokenizer)
        self.pad = pad_id(tokenizer.pad_token_id, self.eos)

    def score(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[tuple[Any, Any, Any]]:
        """(features, top_ids, top_logprobs) per row, each None where not asked for."""
        if self.model is None:
            return [(None, None, None)] * len(sequences)
        layers = self.cfg.eagle_aux_layer_ids if self.cfg.record_features else None
        return prefill(self.model, sequences, layers, self.cfg.batch_size, self.pad, self.cfg.top_logprobs,
                       prompt_lengths)


def answer_ids(tokenizer, before: list[dict], answer: str, prompt: list[int], use_chat_template: bool,
               eos: list[int]) -> list[int]:
    """The tokens of a dataset's `answer` to the conversation `before` (whose encoded prompt is `prompt`), up to and
    including the end of its turn (its first EOS), as the target's own completion would be."""
    if not use_chat_template:
        return tokenizer("\n\n" + answer, add_special_tokens=False)["input_ids"] + eos[:1]
    full = tokenizer.apply_chat_template(before + [{"role": "assistant", "content": answer}],
                                         add_generation_prompt=False, tokenize=True, return_dict=False)
    if full and isinstance(full[0], list):
        full = full[0]
    full = [int(t) for t in full]
    if full[: len(prompt)] != prompt:
        raise ValueError("responses=dataset: the chat template renders a conversation with its answer differently "
                         "from its prompt followed by the answer (it rewrites earlier turns, e.g. dropping "
                         "reasoning), so the answer's tokens cannot be marked; use use_chat_template=false or "
                         "responses=target")
    return cut_at_eos(full[len(prompt):], eos)


def dataset_shard(items: list[Item], backend: DatasetBackend, tokenizer, cfg: DataConfig,
                  context_limit: int | None, progress=None, features=None) -> tuple[list[dict], dict]:
    """responses=dataset: a row per answer of each item's conversation (the dataset's own tokens), in the items'
    order; features and top log-probs from one prefill of each row, batch_size rows at a time."""
    rows: list[dict] = []
    counts = {"examples": 0, "generated_tokens": 0, "dropped_turns": 0}
    for it in items:
        turns = dataset_turns(it.prompt)
        for turn, (before, answer) in enumerate(turns):
            prompt = encode_prompt(tokenizer, before, cfg.use_chat_template)
            completion = answer_ids(tokenizer, before, answer, prompt, cfg.use_chat_template, backend.eos)
            if context_limit is not None and len(prompt) + len(completion) > context_limit:
                counts["dropped_turns"] += len(turns) - turn
                break  # the conversation outgrew the context: its later turns are dropped
            rows.append({"prompt_id": it.prompt.prompt_id, "category": it.prompt.category or "",
                         "sample_index": it.sample_index, "turn": turn, "input_ids": prompt + completion,
                         "prompt_length": len(prompt)})
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]["input_ids"])) if cfg.sort_by_length \
        else list(range(len(rows)))
    for start in range(0, len(order), cfg.batch_size):
        chunk = [rows[i] for i in order[start: start + cfg.batch_size]]
        scored = backend.score([r["input_ids"] for r in chunk], [r["prompt_length"] for r in chunk])
        for row, (feats, top_ids, top_lp) in zip(chunk, scored):
            if cfg.top_logprobs:
                row["top_ids"], row["top_logprobs"] = top_ids, top_lp
            if cfg.record_features:
                _keep_features(row, feats, features)
            counts["examples"] += 1
            counts["generated_tokens"] += len(row["input_ids"]) - row["prompt_length"]
            if progress is not None:
                progress(1, len(row["input_ids"]) - row["prompt_length"])
        del scored
    return rows, counts


def _keep_features(row: dict, tensor, spool: FeatureSpool | None) -> None:
    """A row's features: into the shard's spool (then dropped from memory), or kept on the row without one."""
    if spool is None:
        row["features"] = tensor
    else:
        spool.add(_row_key(row), tensor)


def _row_key(row: dict) -> tuple:
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


def resolve_backend(cfg: DataConfig) -> str:
    """backend=auto: vllm where vLLM's environment exists (and the dtype is one vLLM computes in), else transformers."""
    if cfg.backend != "auto":
        return cfg.backend

    dtype = str(resolve_dtype(cfg.dtype)).removeprefix("torch.")
    chosen = "vllm" if dtype in _VLLM_DTYPES and find_vllm_python(cfg.vllm_python) is not None else "transformers"
    log.info("backend=auto: %s", chosen if chosen == "transformers" else f"vllm ({find_vllm_python(cfg.vllm_python)})")
    return chosen


def make_backend(cfg: DataConfig, tokenizer, procs: _Processes | None = None):
    """The configured backend (on this process's device, under `accelerate launch`)."""
    device = procs.device if procs is not None else None
    if cfg.responses == "dataset":
        return DatasetBackend(cfg, tokenizer, device)
    if resolve_backend(cfg) == "vllm":
        return VLLMBackend(cfg, tokenizer, device, procs)
    return TransformersBackend(cfg, tokenizer, device)


# --------------------------------------------------------------------------------------------------------
# One shard


def generate_shard(items: list[Item], backend, tokenizer, cfg: DataConfig, seed: int, context_limit: int | None,
                   progress=None, features: FeatureSpool | None = None) -> tuple[list[dict], dict]:
    """Rows for a shard's items, turn by turn (each turn sees the target's own earlier answers); and counts.
    With record_features each row's features go to `features` as its batch is done (kept on the rows without)."""
    generator = backend.generator(seed)
    histories = [list(it.history) for it in items]
    active = list(range(len(items)))
    rows: list[dict] = []
    counts = {"examples": 0, "generated_tokens": 0, "dropped_turns": 0}
    turn = 0
    while active:
        prompts: dict[int, list[int]] = {}
        for i in active:
            histories[i].append({"role": "user", "content": items[i].user_turns[turn]})
            ids = encode_prompt(tokenizer, histories[i], cfg.use_chat_template)
            if turn > 0 and context_limit is not None and len(ids) + cfg.max_new_tokens > context_limit:
                counts["dropped_turns"] += len(items[i].user_turns) - turn
                continue  # the conversation outgrew the context: its later turns are dropped
            prompts[i] = ids
        order = sorted(prompts, key=lambda i: -len(prompts[i])) if cfg.sort_by_length else list(prompts)
        step = len(order) if isinstance(backend, VLLMBackend) else cfg.batch_size
        for start in range(0, len(order), step):
            chunk = order[start: start + step]
            for i, comp in zip(chunk, backend.generate([prompts[i] for i in chunk], generator)):
                it = items[i]
                row = {"prompt_id": it.prompt.prompt_id, "category": it.prompt.category or "",
                       "sample_index": it.sample_index, "turn": turn, "input_ids": prompts[i] + comp.tokens,
                       "prompt_length": len(prompts[i])}
                if cfg.top_logprobs:
                    row["top_ids"], row["top_logprobs"] = comp.top_ids, comp.top_logprobs
                if cfg.record_features:  # beside the shard, not in it
                    _keep_features(row, comp.take_features(), features)
                rows.append(row)
                counts["examples"] += 1
                counts["generated_tokens"] += len(comp.tokens)
                text = tokenizer.decode(comp.tokens, skip_special_tokens=True)
                histories[i].append({"role": "assistant", "content": text})
                if progress is not None:
                    progress(1, len(comp.tokens))
        turn += 1
        active = [i for i in prompts if turn < len(items[i].user_turns)]
    # Deterministic row order inside a shard, whatever the batching was.
    order_of = {id(it): n for n, it in enumerate(items)}
    key = {(it.prompt.prompt_id, it.sample_index): order_of[id(it)] for it in items}
    rows.sort(key=lambda r: (key[(r["prompt_id"], r["sample_index"])], r["turn"]))
    return rows, counts


def _schema(top_logprobs: bool):

    fields = [("prompt_id", pa.string()), ("category", pa.string()), ("sample_index", pa.int64()),
              ("turn", pa.int64()), ("input_ids", pa.list_(pa.int64())), ("prompt_length", pa.int64())]
    if top_logprobs:
        fields += [("top_ids", pa.list_(pa.list_(pa.int64()))), ("top_logprobs", pa.list_(pa.list_(pa.float32())))]
    return pa.schema(fields)


def write_shard(rows: list[dict], path: Path, top_logprobs: bool) -> None:
    """Write rows as one parquet file, atomically (temporary file, then rename)."""

    table = pa.Table.from_pylist([{k: v for k, v in r.items() if k != "features"} for r in rows],
                                 schema=_schema(top_logprobs))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


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


# --------------------------------------------------------------------------------------------------------
# Manifest and output folder


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


def _settings(cfg: DataConfig) -> dict:
    return {k: v for k, v in to_dict(cfg).items()
            if k not in _RESUMABLE_KEYS and not (k in _LATER_DEFAULTS and v == _LATER_DEFAULTS[k])}


def _prepare_output(cfg: DataConfig, settings: dict, fingerprint: str, base: dict) -> dict:
    """Create the output folder and manifest, or check that an existing one holds this very run."""
    out = Path(cfg.output_dir)
    manifest_path = out / MANIFEST
    if manifest_path.is_file():
        old = json.loads(manifest_path.read_text())
        if old.get("fingerprint") == fingerprint:
            log.info("resuming %s: %d of %d shards done", out, len(old.get("shards", [])), old.get("num_shards", 0))
            for stray in (out / SHARD_DIR).glob(".*.tmp-*"):  # half-written by an interrupted run
                stray.unlink()
            return old
        if not cfg.overwrite:
            changed = sorted(k for k in set(settings) | set(old.get("settings", {}))
                             if settings.get(k) != old.get("settings", {}).get(k))
            what = f"settings {', '.join(changed)} differ" if changed else "the prompts (or their tokenization) differ"
            raise ValueError(f"{out} already holds data generated with other settings ({what}); use another "
                             f"output_dir, or overwrite=true to replace it")
        log.warning("overwrite=true: replacing the data in %s", out)
    elif out.exists() and (out / SHARD_DIR).exists() and not cfg.overwrite:
        raise ValueError(f"{out} has a {SHARD_DIR}/ folder but no {MANIFEST}; use another output_dir or "
                         f"overwrite=true")
    shutil.rmtree(out / SHARD_DIR, ignore_errors=True)
    (out / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    manifest = dict(base, shards=[], complete=False)
    _write_json(manifest_path, manifest)
    return manifest


def _record_shard(out: Path, entry: dict) -> dict:
    with _locked(out):
        manifest = json.loads((out / MANIFEST).read_text())
        manifest["shards"] = sorted([s for s in manifest["shards"] if s["index"] != entry["index"]] + [entry],
                                    key=lambda s: s["index"])
        _write_json(out / MANIFEST, manifest)
    return manifest


def _finalise(out: Path) -> dict:
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


# --------------------------------------------------------------------------------------------------------
# The run


@dataclass
class _Processes:
    index: int = 0
    count: int = 1
    is_main: bool = True
    device: Any = None

    def barrier(self) -> None:
        if self.count > 1:

            PartialState().wait_for_everyone()


def _processes(cfg: DataConfig) -> _Processes:
    """This process's place in an `accelerate launch` (or a single plain process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return _Processes()

    # On CPU, accelerate only joins the process group when told cpu=True.
    state = PartialState(cpu=cfg.device == "cpu" or not torch.cuda.is_available())
    # device=cuda (no index) means each process's own GPU, as auto does
    device = state.device if cfg.device in ("auto", "", None) or cfg.device == state.device.type else None
    return _Processes(state.process_index, state.num_processes, state.is_main_process, device)


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


def _manifest_base(cfg: DataConfig, settings: dict, fingerprint: str, num_prompts: int, skipped: list[str],
                   num_items: int, num_shards: int) -> dict:
    """The manifest of a run before any shard: its settings, what it read and how it splits the work."""
    return {
        "format": FORMAT,
        "target": cfg.target,
        "settings": settings,
        "generation": {**{k: settings[k] for k in ("temperature", "top_k", "top_p", "max_new_tokens", "num_samples",
                                                     "seed", "top_logprobs", "use_chat_template", "backend", "dtype")},
                       "responses": cfg.responses},
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


def run(cfg: DataConfig) -> dict:
    """Generate (or finish generating) the dataset; returns the manifest."""

    deadline = time.perf_counter() + cfg.max_minutes * 60 if cfg.max_minutes else math.inf
    procs = _processes(cfg)
    cfg = dataclasses.replace(cfg, backend=resolve_backend(cfg))  # the manifest records the backend used
    if cfg.backend == "vllm" and cfg.responses == "target":

        vllm_python(cfg.vllm_python)  # raises with how to make it, before minutes of prompt loading, not after
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
    settings = _settings(cfg)
    fingerprint = hashlib.sha256(json.dumps([settings, prompt_digest], sort_keys=True).encode()).hexdigest()
    num_shards = math.ceil(len(items) / cfg.shard_size)
    base = _manifest_base(cfg, settings, fingerprint, len(prompts), skipped, len(items), num_shards)
    out = Path(cfg.output_dir)
    if procs.is_main:
        manifest = _prepare_output(cfg, settings, fingerprint, base)
    procs.barrier()
    manifest = read_manifest(out)
    done = {s["index"] for s in manifest["shards"] if (out / s["file"]).is_file()}
    mine = [s for s in range(num_shards) if s % procs.count == procs.index]
    todo = [s for s in mine if s not in done]
    turns_of = lambda s: sum(len(it.user_turns) for it in items[s * cfg.shard_size: (s + 1) * cfg.shard_size])  # noqa: E731
    if todo:
        backend = make_backend(cfg, tokenizer, procs)
        progress = _Progress(sum(turns_of(s) for s in mine), sum(turns_of(s) for s in mine if s in done),
                             enabled=procs.index == 0)
        pause = float(os.environ.get(_PAUSE_ENV, "0") or 0)
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
                shard_items = items[s * cfg.shard_size: (s + 1) * cfg.shard_size]
                started, states_before = time.perf_counter(), getattr(backend, "states_seconds", 0.0)
                name = f"{SHARD_DIR}/shard-{s:05d}.parquet"
                spool = FeatureSpool(out / features_file(name)) if cfg.record_features else None
                try:
                    if cfg.responses == "dataset":
                        rows, counts = dataset_shard(shard_items, backend, tokenizer, cfg, context_limit, progress,
                                                     spool)
                    else:
                        rows, counts = generate_shard(shard_items, backend, tokenizer, cfg,
                                                      seed=cfg.seed * 1_000_003 + s, context_limit=context_limit,
                                                      progress=progress, features=spool)
                    if spool is not None:  # before the shard: a listed shard always has its features
                        spool.write([_row_key(r) for r in rows], out / features_file(name))
                finally:
                    if spool is not None:
                        spool.discard()
                write_shard(rows, out / name, cfg.top_logprobs > 0)
                counts["seconds"] = round(time.perf_counter() - started, 3)  # generation only, for tokens/s
                if getattr(backend, "states_mode", None) == "prefill":  # its share of the seconds
                    counts["states_seconds"] = round(backend.states_seconds - states_before, 3)
                generation_s += counts["seconds"]
                _record_shard(out, {"index": s, "file": name, **counts})
                log.info("process %d/%d wrote %s (%d examples)", procs.index, procs.count, name, counts["examples"])
                if pause:
                    time.sleep(pause)
                last_shard_s = time.perf_counter() - shard_started
        finally:
            progress.close()
            if hasattr(backend, "close"):
                backend.close()
        if getattr(backend, "states_mode", None) == "prefill":
            log.info("prefill of states: %.1f s of %.1f s (process %d's shards, engine start excluded)",
                     backend.states_seconds, generation_s, procs.index)
    procs.barrier()
    manifest = _finalise(out) if procs.is_main else read_manifest(out)
    return manifest


_HELP = """usage: specdec data [--config recipes/X.yaml] [key=value ...] [--key value ...]

Generate the target's own completions for a prompt set (resumable; rerun the same command to continue).

prompts: a local .jsonl/.json/.parquet/.csv file, a Hub dataset, embedded:train, embedded:heldout, or self:N
(N requests the target writes itself, as in Magpie), or several of these joined by commas.

options (recipe section `data:`; defaults in brackets):
""" + "\n".join(f"  {f.name:<18} [{f.default!r}]" for f in dataclasses.fields(DataConfig))


def main(argv: list[str] | None = None) -> int:
    """`specdec data` / `python -m specdec.train.data` / `accelerate launch -m specdec.train.data`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(_HELP)
        return 0
    cfg = config_from_cli(DataConfig, argv, section="data")
    manifest = run(cfg)
    if os.environ.get("RANK", "0") != "0":
        return 0  # one summary line per launch, from the main process
    counts = manifest["counts"]
    state = "complete" if manifest["complete"] else f"{len(manifest['shards'])}/{manifest['num_shards']} shards"
    print(f"specdec data: {counts['examples']} examples, {counts['generated_tokens']} generated tokens, "
          f"{counts['skipped_too_long']} prompt(s) skipped as too long -> {cfg.output_dir} ({state})")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sys.exit(main())
    except ValueError as err:
        print(f"specdec.train.data: error: {err}", file=sys.stderr)
        sys.exit(2)
