"""Target-generated distillation data: prompts -> the target's own completions (+ its top-n log-probs).

    specdec data --config recipes/smollm2-135m.yaml                      # one process
    python -m train.data prompts=my.jsonl target=HuggingFaceTB/SmolLM2-1.7B-Instruct output_dir=runs/data
    accelerate launch --multi_gpu --num_processes 4 -m train.data --config recipes/X.yaml   # shards split over processes

Prompts come from a local .jsonl/.json/.parquet/.csv file, a Hub dataset name, the embedded prompt set
(`embedded:train`, `embedded:heldout`), or `self:N`: N requests the target writes itself (train/self_prompts.py).
Every row goes through `specdec.prompts.normalise_record`.

Output, resumable (rerun the same command after a crash; finished shards are kept):

    <output_dir>/manifest.json                 settings, prompt source, counts, shard list, complete flag
    <output_dir>/shards/shard-00000.parquet     prompt_id, category, sample_index, turn, input_ids (prompt +
                                                completion), prompt_length [, top_ids, top_logprobs]
    <output_dir>/shards/shard-00000.features.safetensors   with record_features=true: the target's features
                                                (specdec/feature_draft.py) at each row's fed positions, tensor
                                                "<row index>" [prompt + completion - 1, W] float16, so a feature
                                                draft trains with no target forward (train/feature_train.py)

The work list (prompt x sample, shuffled) is cut into shards of `shard_size` items; shard s belongs to
process s % num_processes. A shard is written to a temporary file and renamed, then recorded in the manifest,
so a shard is either complete and listed or absent/ignored: a rerun redoes exactly the missing ones.
Each shard samples from its own generator seeded by (seed, shard), so for a given batch_size the result does
not depend on where a run was interrupted or on the number of processes (greedy data does not depend on
batch_size either, up to floating-point near-ties).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.config import config_from_cli, to_dict
from specdec.models import EMBEDDED_TARGET
from specdec.prompts import Prompt, encode_prompt, normalise_record
from train.budget import check_minutes

log = logging.getLogger(__name__)

FORMAT = "specdec-data/1"
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
EMBEDDED_PROMPT_SETS = ("embedded:train", "embedded:heldout")
_LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Settings that do not change what is generated; a resumed run may change them.
_RESUMABLE_KEYS = ("batch_size", "device", "output_dir", "overwrite", "max_minutes")
# A knob for the interruption test only: seconds to sleep after each shard is recorded.
_PAUSE_ENV = "_SPECDEC_DATA_SHARD_PAUSE"
_VLLM_MISSING = "backend=vllm needs the vllm package: pip install specdec[vllm] (or use backend=transformers)"


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
    backend: str = "transformers"  # or "vllm"
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
    # Keep the target's features (its final hidden state, then the outputs of `feature_aux_layers`) at every fed
    # position, as a feature draft reads them (train: draft=feature with the same feature_aux_layers): computed by
    # the decoding anyway, they spare training a target forward per sample. 4.6 KB a token for SmolLM2 with 3
    # auxiliary layers.
    record_features: bool = False
    feature_aux_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        choices = {"spec_bench_turns": ("first", "all"), "too_long": ("skip", "error"),
                   "backend": ("transformers", "vllm")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        positive = ("max_prompt_tokens", "num_samples", "max_new_tokens", "batch_size", "shard_size")
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0 (0 = off), got {self.top_logprobs}")
        check_minutes(self.max_minutes)
        if self.feature_aux_layers and not self.record_features:
            raise ValueError("feature_aux_layers names the layers that record_features=true keeps; set both")
        if self.record_features and self.backend != "transformers":
            raise ValueError("record_features=true needs backend=transformers (vLLM does not expose hidden states)")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 (or unset for all prompts), got {self.limit}")
        if self.column_map is not None and not isinstance(self.column_map, dict):
            raise ValueError(f"column_map must be a mapping such as {{instruction: prompt}}, got {self.column_map!r}")
        if not self.prompts:
            raise ValueError("prompts is empty: give a .jsonl/.json/.parquet/.csv file, a Hub dataset name or "
                             "embedded:train")
        self.sampling()  # validates temperature / top_k / top_p
        from specdec.models import resolve_dtype

        resolve_dtype(self.dtype)  # raises with the valid names, before any model is loaded

    def sampling(self):
        """The decoder's SamplingConfig for these settings."""
        from specdec.sampling import SamplingConfig

        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


# --------------------------------------------------------------------------------------------------------
# Prompts


def _drop_nulls(row: dict) -> dict:
    # Arrow gives every row every column of the file; a row's unused formats come back as None.
    return {k: v for k, v in row.items() if v is not None}


def _embedded_path(name: str) -> Path:
    from train.prompt_set import EMBEDDED_HELDOUT_PROMPTS, EMBEDDED_TRAIN_PROMPTS

    return EMBEDDED_TRAIN_PROMPTS if name == "embedded:train" else EMBEDDED_HELDOUT_PROMPTS


def _load_rows(source: str, split: str) -> list[dict]:
    """Rows of a local file or Hub dataset, via `datasets` (ValueError with the cause otherwise)."""
    import datasets

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
                from specdec.prompts import read_prompts

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
    from train import self_prompts

    if procs is None or procs.is_main:
        self_prompts.generate(cfg, n, Path(cfg.output_dir), procs.device if procs else None)
    if procs is not None:
        procs.barrier()
    return self_prompts.path_for(cfg, Path(cfg.output_dir))


def load_prompt_set(cfg: DataConfig, procs: _Processes | None = None) -> list[Prompt]:
    """The configured prompts as Prompt objects (the first `limit` rows of all sources), with unique ids."""
    from train import self_prompts

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


@dataclass
class Item:
    """One unit of work: a prompt, which of its samples, and the token count of its first turn."""

    prompt: Prompt
    sample_index: int
    history: list[dict]
    user_turns: list[str]
    first_length: int


def plan_items(prompts: list[Prompt], tokenizer, cfg: DataConfig, context_limit: int | None) -> tuple[list[Item], list[str], str]:
    """Work list (prompt x sample, shuffled when `shuffle`), ids skipped as too long, and its fingerprint."""
    limit = cfg.max_prompt_tokens
    if context_limit is not None:
        limit = min(limit, context_limit - cfg.max_new_tokens)
        if limit < 1:
            raise ValueError(f"max_new_tokens={cfg.max_new_tokens} leaves no room for a prompt in the target's "
                             f"context of {context_limit} tokens; lower max_new_tokens")
    items, skipped = [], []
    digest = hashlib.sha256()
    for p in prompts:
        history, user_turns = conversation(p, cfg.spec_bench_turns)
        ids = encode_prompt(tokenizer, history + [{"role": "user", "content": user_turns[0]}], cfg.use_chat_template)
        if len(ids) > limit:
            if cfg.too_long == "error":
                raise ValueError(f"prompt {p.prompt_id!r} has {len(ids)} tokens, over the limit of {limit} "
                                 f"(max_prompt_tokens, and the context minus max_new_tokens); raise "
                                 f"max_prompt_tokens or set too_long=skip")
            skipped.append(p.prompt_id)
            continue
        digest.update(json.dumps([p.prompt_id, ids, user_turns[1:]]).encode())
        items += [Item(p, s, history, user_turns, len(ids)) for s in range(cfg.num_samples)]
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
    features: Any = None  # record_features: [prompt + len(tokens) - 1, W] float16, the positions fed to the target


def eos_ids(model, tokenizer) -> list[int]:
    """Every id that ends a turn: the generation config's eos ids and the tokenizer's."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if value is None:
            continue
        ids += value if isinstance(value, (list, tuple)) else [value]
    return sorted({int(i) for i in ids})


class TransformersBackend:
    """Batched, left-padded decoding with specdec's target_generate, which also keeps the top-n log-probs."""

    def __init__(self, cfg: DataConfig, tokenizer, device=None):
        from specdec.models import load_model

        self.cfg, self.sampling = cfg, cfg.sampling()
        self.model = load_model(cfg.target, dtype=cfg.dtype, device=device if device is not None else cfg.device)
        self.device = next(self.model.parameters()).device
        log.info("target %s in %s on %s", cfg.target, self.model.dtype, self.device)
        self.eos = eos_ids(self.model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad = int(pad if pad is not None else (self.eos[0] if self.eos else 0))

    def generator(self, seed: int):
        import torch

        return torch.Generator(device=self.device).manual_seed(seed)

    def generate(self, prompts: list[list[int]], generator) -> list[Completion]:
        """Completions of one batch of prompts (token lists of any lengths)."""
        import torch

        from specdec.decode import target_generate
        from specdec.feature_draft import FeatureRecorder

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        recording = FeatureRecorder(self.model, self.cfg.feature_aux_layers, history=True) \
            if self.cfg.record_features else contextlib.nullcontext()
        with recording as recorder:
            out = target_generate(self.model, ids, mask, sampling=self.sampling,
                                  max_new_tokens=self.cfg.max_new_tokens, eos_token_id=self.eos or None,
                                  generator=generator, pad_token_id=self.pad, top_logprobs=self.cfg.top_logprobs)
        new = out.sequences[:, width:].tolist()
        completions = [Completion(_cut_at_eos(row, self.eos)) for row in new]
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


def _cut_at_eos(tokens: list[int], eos: list[int]) -> list[int]:
    """Tokens up to and including the first EOS (the rest is padding)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


class VLLMBackend:
    """The same interface on vLLM's offline engine (`LLM.generate` with `SamplingParams(logprobs=n)`)."""

    def __init__(self, cfg: DataConfig, tokenizer, device=None):
        try:
            import vllm
        except ImportError as err:
            raise ValueError(_VLLM_MISSING) from err
        import torch

        from specdec.models import resolve_dtype, resolve_path

        self.vllm, self.cfg = vllm, cfg
        # vLLM spells dtypes as torch does ("bfloat16", "float32"); ours also accepts bf16/fp32 aliases.
        dtype = ("auto" if cfg.dtype in ("auto", "", None)
                 else str(resolve_dtype(cfg.dtype, torch.device("cuda"))).removeprefix("torch."))
        self.llm = vllm.LLM(model=resolve_path(cfg.target), dtype=dtype, seed=cfg.seed)

    def generator(self, seed: int) -> int:
        return seed

    def generate(self, prompts: list[list[int]], generator: int) -> list[Completion]:
        """All prompts in one call (vLLM schedules its own batches); one seed per request."""
        cfg = self.cfg
        params = [self.vllm.SamplingParams(
            n=1, temperature=cfg.temperature, top_k=cfg.top_k if cfg.top_k > 0 else -1, top_p=cfg.top_p,
            max_tokens=cfg.max_new_tokens, seed=generator * 1_000_003 + i,
            logprobs=cfg.top_logprobs or None) for i in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params, use_tqdm=False)
        completions = []
        for out in outputs:
            seq = out.outputs[0]
            comp = Completion([int(t) for t in seq.token_ids])
            if cfg.top_logprobs:
                comp.top_ids, comp.top_logprobs = [], []
                # Each position's dict holds the top n plus the sampled token when it ranks lower.
                for position in seq.logprobs:
                    best = sorted(position.items(), key=lambda kv: -kv[1].logprob)[: cfg.top_logprobs]
                    comp.top_ids.append([int(t) for t, _ in best])
                    comp.top_logprobs.append([float(lp.logprob) for _, lp in best])
            completions.append(comp)
        return completions


def make_backend(cfg: DataConfig, tokenizer, device=None):
    """The configured generation backend."""
    cls = VLLMBackend if cfg.backend == "vllm" else TransformersBackend
    return cls(cfg, tokenizer, device)


# --------------------------------------------------------------------------------------------------------
# One shard


def generate_shard(items: list[Item], backend, tokenizer, cfg: DataConfig, seed: int, context_limit: int | None,
                   progress=None) -> tuple[list[dict], dict]:
    """Rows for a shard's items, turn by turn (each turn sees the target's own earlier answers); and counts."""
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
                if cfg.record_features:
                    row["features"] = comp.features  # written beside the shard (write_features), not in it
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
    import pyarrow as pa

    fields = [("prompt_id", pa.string()), ("category", pa.string()), ("sample_index", pa.int64()),
              ("turn", pa.int64()), ("input_ids", pa.list_(pa.int64())), ("prompt_length", pa.int64())]
    if top_logprobs:
        fields += [("top_ids", pa.list_(pa.list_(pa.int64()))), ("top_logprobs", pa.list_(pa.list_(pa.float32())))]
    return pa.schema(fields)


def write_shard(rows: list[dict], path: Path, top_logprobs: bool) -> None:
    """Write rows as one parquet file, atomically (temporary file, then rename)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{k: v for k, v in r.items() if k != "features"} for r in rows],
                                 schema=_schema(top_logprobs))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def features_file(shard_file: str) -> str:
    """The features file beside a shard: shards/shard-00000.parquet -> shards/shard-00000.features.safetensors"""
    return shard_file.removesuffix(".parquet") + ".features.safetensors"


def write_features(rows: list[dict], path: Path) -> None:
    """The rows' recorded features as tensors "0", "1", ... (the rows' order in the shard), atomically."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({str(i): r["features"].contiguous() for i, r in enumerate(rows)}, str(tmp))
    os.replace(tmp, path)


def recorded_features(folder: str | Path):
    """Per shard of a folder written with record_features=true: (its rows' prompt_id, sample_index, turn and
    input_ids as columns, its rows' features in order); nothing for a folder without them."""
    import pyarrow.parquet as pq
    from safetensors import safe_open

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
    return {k: v for k, v in to_dict(cfg).items() if k not in _RESUMABLE_KEYS}


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
    import datasets

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
    return datasets.Dataset.from_parquet(files, keep_in_memory=True)


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
            from accelerate import PartialState

            PartialState().wait_for_everyone()


def _processes(cfg: DataConfig) -> _Processes:
    """This process's place in an `accelerate launch` (or a single plain process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return _Processes()
    import torch
    from accelerate import PartialState

    # On CPU, accelerate only joins the process group when told cpu=True.
    state = PartialState(cpu=cfg.device == "cpu" or not torch.cuda.is_available())
    device = state.device if cfg.device in ("auto", "", None) else None
    return _Processes(state.process_index, state.num_processes, state.is_main_process, device)


def _context_limit(target: str) -> int | None:
    from transformers import AutoConfig

    from specdec.models import resolve_path

    try:
        config = AutoConfig.from_pretrained(resolve_path(target))
    except OSError as err:
        raise ValueError(f"could not read the config of target {target!r}: {err}") from err
    return getattr(config, "max_position_embeddings", None)


class _Progress:
    """A tqdm bar over examples with the generated tokens per second in its postfix."""

    def __init__(self, total: int, initial: int, enabled: bool):
        from tqdm.auto import tqdm

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


def run(cfg: DataConfig) -> dict:
    """Generate (or finish generating) the dataset; returns the manifest."""
    from specdec.models import load_tokenizer

    deadline = time.perf_counter() + cfg.max_minutes * 60 if cfg.max_minutes else math.inf
    procs = _processes(cfg)
    if cfg.backend == "vllm" and not _importable("vllm"):
        raise ValueError(_VLLM_MISSING)  # before minutes of prompt loading, not after
    if cfg.backend == "vllm" and procs.count > 1:
        raise ValueError("backend=vllm runs as one process (vLLM spreads a model over GPUs itself); launch it "
                         "with plain `specdec data`, not accelerate launch")
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
    base = {
        "format": FORMAT,
        "target": cfg.target,
        "settings": settings,
        "generation": {k: settings[k] for k in ("temperature", "top_k", "top_p", "max_new_tokens", "num_samples",
                                                  "seed", "top_logprobs", "use_chat_template", "backend", "dtype")},
        "top_logprobs_of": "log_softmax of the target's raw logits (temperature 1, no top-k/top-p)",
        "features": {"aux_layers": cfg.feature_aux_layers, "dtype": "float16",
                     "of": "the final norm's output, then each auxiliary layer's, at the positions fed to the target"}
        if cfg.record_features else None,
        "prompt_source": {"prompts": cfg.prompts, "split": cfg.split, "column_map": cfg.column_map,
                          "spec_bench_turns": cfg.spec_bench_turns, "limit": cfg.limit},
        "counts": {"prompts": len(prompts), "skipped_too_long": len(skipped), "work_items": len(items),
                   "examples": 0, "generated_tokens": 0, "dropped_turns": 0},
        "skipped_prompt_ids": skipped,
        "num_shards": num_shards,
        "shard_size": cfg.shard_size,
        "fingerprint": fingerprint,
    }
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
        backend = make_backend(cfg, tokenizer, procs.device)
        progress = _Progress(sum(turns_of(s) for s in mine), sum(turns_of(s) for s in mine if s in done),
                             enabled=procs.index == 0)
        pause = float(os.environ.get(_PAUSE_ENV, "0") or 0)
        last_shard_s = 0.0
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
                started = time.perf_counter()
                rows, counts = generate_shard(shard_items, backend, tokenizer, cfg, seed=cfg.seed * 1_000_003 + s,
                                              context_limit=context_limit, progress=progress)
                name = f"{SHARD_DIR}/shard-{s:05d}.parquet"
                if cfg.record_features:  # before the shard: a listed shard always has its features
                    write_features(rows, out / features_file(name))
                write_shard(rows, out / name, cfg.top_logprobs > 0)
                counts["seconds"] = round(time.perf_counter() - started, 3)  # generation only, for tokens/s
                _record_shard(out, {"index": s, "file": name, **counts})
                log.info("process %d/%d wrote %s (%d examples)", procs.index, procs.count, name, counts["examples"])
                if pause:
                    time.sleep(pause)
                last_shard_s = time.perf_counter() - shard_started
        finally:
            progress.close()
    procs.barrier()
    manifest = _finalise(out) if procs.is_main else read_manifest(out)
    return manifest


def _importable(name: str) -> bool:
    """True when module `name` can be imported (without importing it)."""
    import importlib.util

    return importlib.util.find_spec(name) is not None


_HELP = """usage: specdec data [--config recipes/X.yaml] [key=value ...] [--key value ...]

Generate the target's own completions for a prompt set (resumable; rerun the same command to continue).

prompts: a local .jsonl/.json/.parquet/.csv file, a Hub dataset, embedded:train, embedded:heldout, or self:N
(N requests the target writes itself, as in Magpie), or several of these joined by commas.

options (recipe section `data:`; defaults in brackets):
""" + "\n".join(f"  {f.name:<18} [{f.default!r}]" for f in dataclasses.fields(DataConfig))


def main(argv: list[str] | None = None) -> int:
    """`specdec data` / `python -m train.data` / `accelerate launch -m train.data`."""
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
        print(f"train.data: error: {err}", file=sys.stderr)
        sys.exit(2)
