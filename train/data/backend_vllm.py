"""backend=vllm: vLLM's offline engine in its own environment (`make vllm-env`), reached through
train/vllm_worker.py (vllm_client.py); with record_features, the states from vLLM's own forwards ("extract") or
from a transformers prefill afterwards ("prefill")."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from specdec.eagle3 import RECORDED_STATES_DTYPE
from specdec.models import load_model, resolve_device, resolve_dtype, resolve_path
from specdec.sampling import SamplingConfig
from specdec.tokens import cut_at_eos, eos_ids, pad_id
from specdec.train.data.backend import CheckpointGenerationConfig, Completion, GenerationBackend
from specdec.train.data.config import DataConfig
from specdec.train.data.processes import Processes
from specdec.train.data.target_states import prefill_features
from specdec.train.data.vllm_client import VLLMWorker, engine_settings
from specdec.vllm_env import vllm_python

log = logging.getLogger(__name__)

VLLM_LOG = "vllm-worker.log"  # vLLM's own log, beside the data
_REQUEST_TIMEOUT_S = 600.0  # plus the request's tokens at the slowest rate an engine plausibly decodes
_SLOWEST_TOKENS_PER_S = 5.0


class VLLMBackend(GenerationBackend):
    """The generation interface on vLLM's offline engine, which runs in vLLM's own environment: one engine start
    per run, kept across shards, at most batch_size sequences decoded together (max_num_seqs). Under `accelerate
    launch` each process starts its own engine on its own device (its GPU; on a CPU machine its share of the cores).

    With record_features the states come from vLLM's own forwards where `states_mode` is "extract": its
    extract_hidden_states method keeps the residual stream after each of eagle_aux_layer_ids and after the last
    layer at every fed position, and this process applies the target's final norm to the last (one norm module,
    read from the checkpoint). Else ("prefill") from one batched transformers prefill over each prompt + completion
    afterwards. Either way the same positions, layout and dtype as the transformers backend records while it
    decodes."""

    prompts_per_call = None  # a turn's prompts in one request: vLLM schedules its own batches

    def __init__(self, cfg: DataConfig, tokenizer, device=None, procs: Processes | None = None):
        self.cfg = cfg
        self.procs = procs or Processes()
        python = vllm_python(cfg.vllm_python)
        device = device if device is not None else self.procs.device if self.procs.device is not None \
            else resolve_device(cfg.device)
        dtype = str(resolve_dtype(cfg.dtype, device)).removeprefix("torch.")  # vLLM spells dtypes as torch does
        self.eos = eos_ids(CheckpointGenerationConfig(resolve_path(cfg.target)), tokenizer)
        self.pad = pad_id(tokenizer.pad_token_id, self.eos)
        self.features_model, self.final_norm, self.states_dir = None, None, None
        self._prefill_seconds = 0.0  # the prefill's share of generate(), for the log line
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._prepare_states(states_mode(cfg, device), device, dtype, out)
        args, env = engine_settings(cfg, device, dtype, self.features_model is not None, self.procs,
                                    self.states_dir, self._extracted_layers())
        log_path = out / (VLLM_LOG if self.procs.count == 1 else f"vllm-worker-{self.procs.index}.log")
        log.info("starting vLLM (%s) for target %s in %s on %s (states: %s); its log: %s", python, cfg.target, dtype,
                 env.get("CUDA_VISIBLE_DEVICES", device.type) if device.type == "cuda" else "cpu",
                 self.states_mode or "none", log_path)
        self.worker = VLLMWorker(python, args, env, log_path, what=f"target {cfg.target}, {python}")
        log.info("vLLM %s is up", self.worker.version)

    def _prepare_states(self, mode: str | None, device, dtype: str, out: Path) -> None:
        """Settle `states_mode` and load what it needs, before the engine (which on a GPU sizes its cache to the
        free memory): the final norm (extract), or the target itself (prefill)."""
        self.states_mode = mode
        if mode == "extract":
            try:
                self.final_norm = final_norm(self.cfg.target).to(getattr(torch, dtype))  # computes as transformers
            except ValueError as err:
                if self.cfg.vllm_states != "auto":
                    raise
                log.warning("vllm_states=auto: %s; computing the states by a prefill instead", err)
                self.states_mode = "prefill"
        if self.states_mode == "prefill":
            self.features_model = load_model(self.cfg.target, dtype=dtype, device=device)
        elif self.states_mode == "extract":
            self.states_dir = out / f".vllm-states-{self.procs.index}"  # vLLM writes one file per request here
            shutil.rmtree(self.states_dir, ignore_errors=True)  # an interrupted run's
            self.states_dir.mkdir()

    @property
    def states_seconds(self) -> float | None:
        return self._prefill_seconds if self.states_mode == "prefill" else None

    def _extracted_layers(self) -> list[int] | None:
        """The layers vLLM keeps in extract mode: eagle_aux_layer_ids, then the last (for the final norm's output)."""
        if self.states_mode != "extract":
            return None
        num_layers = AutoConfig.from_pretrained(resolve_path(self.cfg.target)).get_text_config().num_hidden_layers
        return sorted(self.cfg.eagle_aux_layer_ids) + [num_layers]

    def generate(self, prompts: list[list[int]], generator: torch.Generator,
                 sampling: SamplingConfig | None = None) -> list[Completion]:
        """All prompts in one request (vLLM schedules its own batches); each prompt samples with its own seed,
        derived from the generator's seed (vLLM draws its own random numbers). Features, when recorded, are loaded
        as each completion's are taken (`Completion.take_features`), so that a request of a whole shard holds at
        most one prefill batch of them (or, extracted, one row's) in memory."""
        cfg, seed = self.cfg, generator.initial_seed()
        sampling = sampling or cfg.sampling()
        seed = seed - (1 << 64) if seed >= 1 << 63 else seed  # torch keeps a negative seed as its unsigned 64 bits
        request = {"prompts": prompts, "seeds": [seed * 1_000_003 + i for i in range(len(prompts))],
                   "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                   "max_tokens": cfg.max_new_tokens, "top_logprobs": cfg.top_logprobs, "stop_token_ids": self.eos,
                   "states": self.states_mode == "extract"}
        timeout = _REQUEST_TIMEOUT_S + len(prompts) * cfg.max_new_tokens / _SLOWEST_TOKENS_PER_S
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
        self._prefill_seconds += time.perf_counter() - started
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
    exact = max(cfg.temperatures or [cfg.temperature]) == 0 or device.type == "cuda"
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
        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"])
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
