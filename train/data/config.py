"""`specdec data` settings (DataConfig) and which of them a data folder's fingerprint covers."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from specdec.config import to_dict
from specdec.models import EMBEDDED_TARGET, resolve_dtype
from specdec.sampling import SamplingConfig
from specdec.train.budget import check_minutes

BACKENDS = ("transformers", "vllm", "auto")
RESPONSES = ("target", "dataset")
VLLM_STATES = ("auto", "extract", "prefill")
VLLM_DTYPES = ("float32", "bfloat16", "float16")  # vLLM has no float64
# Settings that do not change what is generated; a resumed run may change them.
_RESUMABLE_KEYS = ("batch_size", "batch_tokens", "grouped_prefill", "drop_finished_rows", "device", "output_dir",
                   "overwrite", "max_minutes", "vllm_python", "vllm_states")
# Settings added later, left out of the fingerprint at their defaults: folders made before they existed still resume.
_LATER_DEFAULTS = {"responses": "target", "chat_template_kwargs": None, "temperatures": None, "top_ps": None,
                   "sampling_mix": "cycle", "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
SAMPLING_MIXES = ("cycle", "draw")


@dataclass
class DataConfig:
    """`specdec data` settings (recipe section `data:` plus the shared keys)."""

    target: str = EMBEDDED_TARGET  # the model that answers: Hub id, local checkpoint folder or the embedded default
    # A .jsonl/.json/.parquet/.csv file, a Hub dataset name, embedded:train / embedded:heldout (the shipped sets), or
    # self:N (N requests the target writes itself); several joined by commas.
    prompts: str = "embedded:train"
    split: str = "train"  # the split read from a Hub dataset (Hub datasets only)
    column_map: dict[str, str] | None = None  # rename a data set's columns, e.g. {instruction: prompt}
    spec_bench_turns: str = "all"  # multi-turn prompts: "all" turns (each after the target's own answers) or "first"
    use_chat_template: bool = True  # wrap prompts in the target's chat template; false = the raw text
    # More arguments of the chat template, as the server passes them, e.g. {enable_thinking: false} for Qwen3
    # (whose template thinks by default) or {reasoning_effort: low} for gpt-oss
    chat_template_kwargs: dict[str, Any] | None = None
    # Prompts longer than this many tokens (or than the target's context minus max_new_tokens) are too long.
    max_prompt_tokens: int = 1024
    too_long: str = "skip"  # what a too-long prompt does: "skip" (counted in the manifest) or "error" (stop the run)
    temperature: float = 0.0  # the target's sampling temperature; 0 = greedy
    top_k: int = 0  # sample from the k most likely tokens only; 0 = no limit
    top_p: float = 1.0  # sample from the smallest set of tokens holding this probability; 1 = no limit
    # Sampled traffic: each work item (prompt x sample) its own temperature (and top_p) from these lists, e.g.
    # [0, 0.7, 1.0], as a server sees a mix of them; recorded per row. None: `temperature` / `top_p` for all.
    temperatures: list[float] | None = None
    top_ps: list[float] | None = None  # the same for top_p, e.g. [1.0, 0.95]; None: `top_p` for all
    sampling_mix: str = "cycle"  # "cycle": item k takes entry k mod len; "draw": a seeded draw per item
    num_samples: int = 1  # completions per prompt
    # "target": the target answers each user turn (generation); "dataset": keep the conversations' own assistant
    # answers (`messages` or ShareGPT `conversations` with assistant turns), one row per answer, nothing generated;
    # record_features / top_logprobs then come from one prefill of each row
    responses: str = "target"
    seed: int = 0  # seeds the work list's order (shuffle), the sampling and the self:N requests
    max_new_tokens: int = 256  # the most tokens the target writes per answer (each user turn)
    batch_size: int = 16  # prompts decoded together (backend=vllm: the most sequences vLLM runs at once)
    # backend=transformers: also at most this many padded positions (rows x (longest prompt + max_new_tokens)) a
    # batch, so that a few long prompts neither pad a whole batch to their length nor outgrow memory; 0 = no limit
    batch_tokens: int = 16384
    sort_by_length: bool = True  # batches of similar lengths inside each shard (less padding)
    # backend=transformers: a batch's prefill as one forward per group of prompts of similar lengths (a long one
    # alone), each padded only to its own longest, then decoded together (specdec.kv.prefill_groups); false = one
    # forward padded to the batch's longest prompt
    grouped_prefill: bool = True
    # backend=transformers: a row whose answer ended leaves the decoding batch (in bunches), so later steps compute
    # only the rows still writing; false = every row runs until the batch's longest answer ends
    drop_finished_rows: bool = True
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
    # backend=vllm: GPUs one engine shards the target over (a 70B-class target needs 4-8), by tensor and by
    # pipeline parallelism; each `accelerate launch` process runs one engine over that many GPUs of its own
    tensor_parallel_size: int = 1  # backend=vllm: GPUs the target's layers are split across (1 = no split)
    pipeline_parallel_size: int = 1  # backend=vllm: pipeline stages, each on its own tensor-parallel group
    # backend=vllm with record_features: "extract" takes the states from vLLM's own forwards (its
    # extract_hidden_states method), "prefill" from a transformers prefill after decoding, "auto" extracts unless
    # sampling on a CPU
    vllm_states: str = "auto"
    # The data folder: parquet shards, manifest.json and, for self:N, self_prompts.jsonl; rerunning the same
    # command continues it.
    output_dir: str = "runs/data"
    device: str = "auto"  # auto (each process's GPU where there is one, else the CPU), cpu, cuda or cuda:N
    # The target's dtype: auto (bfloat16 on CUDA, float32 on a CPU), float32, bfloat16, float16 or bf16-if-native
    # (bfloat16 where the device computes it natively).
    dtype: str = "auto"
    limit: int | None = None  # use only the first N prompts
    # --- prompts=self:N: the target writes N user requests itself (train/self_prompts.py)
    self_prompt_temperature: float = 0.8  # self:N: the target's sampling temperature for its requests
    self_prompt_top_p: float = 1.0  # self:N: the nucleus (top-p) of that sampling; 1 = no limit
    self_prompt_max_tokens: int = 64  # self:N: the most tokens per request
    overwrite: bool = False  # replace an existing output_dir made with different settings
    # Start no shard that would end past this many minutes of this run (self-written prompts included) at the
    # last shard's pace, one at least: the folder is left incomplete, usable, and a rerun continues it.
    max_minutes: float | None = None
    # Keep the target's states at every fed position, as an EAGLE-3 draft reads them (train: draft=eagle3 with the
    # same eagle_aux_layer_ids): its final hidden state (the online teacher's input), then the residual stream
    # after each of `eagle_aux_layer_ids` (vLLM's numbering, e.g. [2, 15, 27] of 30 layers). Computed by the
    # decoding anyway, they spare training a target forward per sample: 4.6 KB a token for SmolLM2 with 3 layers.
    record_features: bool = False
    # record_features=true: the target layers whose residual streams are kept (vLLM's numbering: after i layers),
    # those the EAGLE-3 draft reads; [] with record_features=false.
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
        if self.batch_tokens < 0:
            raise ValueError(f"batch_tokens must be >= 0 (0 = only batch_size bounds a batch), got {self.batch_tokens}")
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
        self._check_sampling_mix()
        self._check_parallel()

        dtype = str(resolve_dtype(self.dtype)).removeprefix("torch.")  # raises with the valid names, before any load
        if self.backend == "vllm" and dtype not in VLLM_DTYPES:
            raise ValueError(f"backend=vllm computes in {', '.join(VLLM_DTYPES)}, not {dtype}; use dtype=float32 "
                             f"or backend=transformers")

    def _check_sampling_mix(self) -> None:
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a mapping such as {{enable_thinking: false}}, "
                             f"got {self.chat_template_kwargs!r}")
        if self.sampling_mix not in SAMPLING_MIXES:
            raise ValueError(f"sampling_mix must be one of {', '.join(SAMPLING_MIXES)}, got {self.sampling_mix!r}")
        for key in ("temperatures", "top_ps"):
            values = getattr(self, key)
            if values is not None and (not isinstance(values, list) or not values
                                       or not all(isinstance(v, (int, float)) for v in values)):
                raise ValueError(f"{key} must be a non-empty list of numbers such as [0, 0.7, 1.0], got {values!r}")
        for temperature in self.temperatures or [self.temperature]:
            for top_p in self.top_ps or [self.top_p]:
                SamplingConfig(temperature=temperature, top_k=self.top_k, top_p=top_p)  # raises on a bad one
        if (self.temperatures or self.top_ps) and self.responses == "dataset":
            raise ValueError("temperatures / top_ps sample the target's answers; responses=dataset generates none: "
                             "unset them or use responses=target")

    def _check_parallel(self) -> None:
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1) and self.backend != "vllm":
            raise ValueError("tensor_parallel_size / pipeline_parallel_size shard the target over GPUs in vLLM's "
                             "engine: set backend=vllm (the transformers backend runs one device per process)")
        if self.record_features and self.pipeline_parallel_size > 1:
            raise ValueError("record_features with pipeline_parallel_size > 1: vLLM's extract_hidden_states reads "
                             "every kept layer on one pipeline stage; shard with tensor_parallel_size instead")
        if self.record_features and self.tensor_parallel_size > 1 and self.vllm_states == "prefill":
            raise ValueError("record_features with tensor_parallel_size > 1 and vllm_states=prefill: the prefill "
                             "loads the whole target in one process; use vllm_states=extract (or auto on a GPU)")

    def sampling(self):
        """The decoder's SamplingConfig for these settings."""
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @property
    def mixes_sampling(self) -> bool:
        """Whether items sample with settings of their own (temperatures / top_ps), recorded per row."""
        return bool(self.temperatures or self.top_ps)

    def item_sampling(self, position: int, prompt_id: str, sample_index: int) -> tuple[float, float]:
        """(temperature, top_p) of the work item at `position` of the unshuffled work list: cycled through the
        lists, or drawn with a seed of (seed, prompt, sample), so that a resumed run gives every item the same."""
        temperatures, top_ps = self.temperatures or [self.temperature], self.top_ps or [self.top_p]
        if self.sampling_mix == "cycle":
            return float(temperatures[position % len(temperatures)]), float(top_ps[position % len(top_ps)])
        rng = random.Random(f"{self.seed}/{prompt_id}/{sample_index}")
        return float(rng.choice(temperatures)), float(rng.choice(top_ps))


def fingerprinted_settings(cfg: DataConfig) -> dict:
    """The settings that decide what is generated: a data folder resumes only under the same ones."""
    settings = {k: v for k, v in to_dict(cfg).items()
                if k not in _RESUMABLE_KEYS and not (k in _LATER_DEFAULTS and v == _LATER_DEFAULTS[k])}
    if cfg.num_samples > 1 and cfg.shuffle:
        # The work list's order (planning.plan_items): every prompt's first answer before any second. A folder
        # dealt in the older order (all samples mixed) names another order and does not resume into this one.
        settings["work_order"] = "first answers first"
    return settings
