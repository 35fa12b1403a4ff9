"""A training run's memory terms per device (resident, and each phase's) and its disk, from the configs and the
draft built on the meta device (the package's docstring lists the terms)."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch

from specdec.eagle3 import (
    RECORDED_STATES_DTYPE,
    Eagle3Draft,
    check_layer_ids,
    default_layer_ids,
    draft_config,
)
from specdec.models import resolve_dtype
from specdec.train.batches import data_folders
from specdec.train.draft import (
    DERIVED,
    EAGLE3,
    SCRATCH,
    _resolve_layers,
    _subset_layer_config,
    kept_vocab_size,
)
from specdec.train.eagle3_states import recorded_layer_ids
from specdec.train.eagle3_train import LOSS_CHUNK_VALUES
from specdec.train.plan.activations import eagle3_activations, plain_activations, target_forward_bytes
from specdec.train.plan.report import GiB, Plan, Term, gib, short_count
from specdec.train.plan.target import Widths, meta_counts, on_meta, target_parameters, text_config

CUDA_RUNTIME = 1 * GiB  # the CUDA context, cuBLAS workspaces and the caching allocator's slack (about)
CPU_RUNTIME = GiB // 2  # a trainer process's libraries (torch, transformers, accelerate): its RSS before any model
HALF = ("bf16", "fp16")
# Under half-precision autocast on a CPU, torch runs each matmul through oneDNN, which compiles kernels for every
# new shape and keeps them in two caches (ideep's, LRU_CACHE_CAPACITY, and oneDNN's,
# ONEDNN_PRIMITIVE_CACHE_CAPACITY; 1024 entries each by default). Where bf16 is native (AVX512-BF16, AMX) one
# shape's kernels hold about 576 KiB whatever its size; elsewhere a few KiB (torch 2.13, tests/test_plan.py).
# Batches are padded to their own width, and each new width makes new shapes (28 in a 2-step EAGLE-3 step), so
# a run fills the caches early: the first step at a width adds them, later steps at it do not. CUDA has no such cache.
ONEDNN_SHAPE_BYTES = 576 * 1024
ONEDNN_CACHE_CAPACITY = {"LRU_CACHE_CAPACITY": 1024, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": 1024}


def _draft_module(cfg, target_cfg, draft_vocab: int):
    """The draft as the trainer builds it, on the meta device (its parameters' shapes and requires_grad)."""

    if cfg.draft == EAGLE3:
        layers = text_config(target_cfg).num_hidden_layers
        ids = check_layer_ids(cfg.eagle_aux_layer_ids or default_layer_ids(layers), layers)
        config = draft_config(target_cfg, ids, draft_vocab)
        model = on_meta(lambda: Eagle3Draft(config))
        model.embed_tokens.weight.requires_grad_(False)
        if cfg.freeze_head:
            model.lm_head.requires_grad_(False)
        return model, len(ids), Widths.of(config), 1
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.draft == DERIVED:
        chosen = _resolve_layers(cfg.draft_layers, text_config(target_cfg).num_hidden_layers)
        config = _subset_layer_config(target_cfg, chosen)
    elif cfg.draft == SCRATCH:
        config = copy.deepcopy(target_cfg)
        for key, value in cfg.draft_config.items():
            setattr(config, key, value)
    else:
        config = AutoConfig.from_pretrained(cfg.draft)
    model = on_meta(lambda: AutoModelForCausalLM.from_config(config))
    if kept_vocab_size(cfg, draft_vocab):
        head = model.get_output_embeddings()
        model.set_output_embeddings(on_meta(lambda: torch.nn.Linear(head.in_features, draft_vocab,
                                                                    bias=head.bias is not None)))
    if cfg.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    if cfg.freeze_head:
        model.get_output_embeddings().requires_grad_(False)
    if cfg.lora:
        trainable = _lora_parameters(model, cfg.lora_r, cfg.lora_target_modules)
        if kept_vocab_size(cfg, draft_vocab):
            trainable += model.get_output_embeddings().weight.numel()
        model.requires_grad_(False)
        model.lora_trainable = trainable
    return model, 0, Widths.of(config), text_config(config).num_hidden_layers


def _lora_parameters(model, r: int, modules) -> int:
    return sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in modules)


def _states_online(cfg) -> tuple[bool, str]:
    """Whether an EAGLE-3 run computes the target's states online, and why."""
    if cfg.states != "auto":
        return cfg.states == "online", f"states={cfg.states}"
    try:
        folders, _ = data_folders(cfg)
        recorded = all(recorded_layer_ids(f) is not None for f in folders)
    except (ValueError, OSError, KeyError):
        return True, "states=auto and no training data yet: planned as online"
    return (not recorded), ("states=auto: the data recorded them" if recorded else "states=auto: not recorded")


@dataclass
class _Run:
    """What the plan's terms read: the config, the two models' widths, the draft on the meta device."""

    cfg: Any  # TrainConfig
    tw: Widths  # the target's
    dw: Widths  # the draft's
    draft: torch.nn.Module
    draft_vocab: int
    aux: int  # target layers an EAGLE-3 draft reads
    draft_layers: int
    trainable: int
    frozen: int
    half: bool
    target_dtype: torch.dtype
    top_n: int  # an offline teacher's stored n
    online: bool  # EAGLE-3: the target's states computed online
    states_why: str

    @property
    def eagle(self) -> bool:
        return self.cfg.draft == EAGLE3

    @property
    def tbytes(self) -> int:
        return torch.finfo(self.target_dtype).bits // 8

    @property
    def shrink_activations(self) -> str:
        cfg = self.cfg
        return (f"lower per_device_batch_size (now {cfg.per_device_batch_size}; raise grad_accum_steps to keep the "
                f"global batch), max_length (now {cfg.max_length})"
                + (f" or ttt_steps (now {cfg.ttt_steps})" if self.eagle else "")
                + f"; the loss's logits grow with draft_vocab_size (now {self.draft_vocab})")


def plan_run(cfg, target_cfg, *, device_type: str, mixed_precision: str, devices: int = 1, memory: int = 0,
             memory_source: str = "", data=None, samples: int = 0, mean_length: int = 0) -> Plan:
    """The plan of `cfg` (a TrainConfig) over a target of config `target_cfg`, on `devices` devices of
    `device_type` ("cuda" or "cpu") under `mixed_precision` ("no", "bf16", "fp16"). `data` (a DataConfig) and
    `samples`/`mean_length` size the data stage's disk."""
    tw = Widths.of(target_cfg)
    draft_vocab = kept_vocab_size(cfg, tw.vocab) or tw.vocab
    draft, aux, dw, draft_layers = _draft_module(cfg, target_cfg, draft_vocab)
    trainable, frozen = meta_counts(draft)
    if cfg.lora and hasattr(draft, "lora_trainable"):
        trainable = draft.lora_trainable
    online, states_why = _states_online(cfg) if cfg.draft == EAGLE3 else (False, "")
    run = _Run(cfg, tw, dw, draft, draft_vocab, aux, draft_layers, trainable, frozen, mixed_precision in HALF,
               resolve_dtype(cfg.dtype, torch.device(device_type)),
               (data.top_logprobs if data is not None else 0) or 20, online, states_why)
    phases = {"train step": _train_step_terms(run)}
    phases.update(_other_phases(run, data is not None and data.top_logprobs > 0))
    title = (f"plan: draft {cfg.draft} over {cfg.target} (hidden {tw.hidden}, {tw.layers} layers, vocab {tw.vocab}), "
             f"{device_type}, {'mixed precision ' + mixed_precision if run.half else 'float32'}, {devices} device(s), "
             "per device")
    plan = Plan(title, devices, _resident_terms(run, target_cfg, device_type, devices), phases, memory=memory,
                memory_source=memory_source)
    plan.reads, plan.disk, plan.notes = _reads_and_disk(cfg, tw, aux, devices, online, data, samples, mean_length)
    plan.notes.append("upper bounds where the data decides: every row max_length long, every position scored")
    return plan


def _resident_terms(run: _Run, target_cfg, device_type: str, devices: int) -> list[Term]:
    """What the run holds throughout: the draft, AdamW's state, DDP's buckets, the target, the runtime."""
    cfg, trainable, draft_vocab, tw, eagle = run.cfg, run.trainable, run.draft_vocab, run.tw, run.eagle
    resident = [
        Term("draft trainable weights", 4 * trainable, f"{short_count(trainable)} float32",
             f"a smaller head: draft_vocab_size (now {draft_vocab})"),
        Term("draft frozen parts", 4 * run.frozen, f"{short_count(run.frozen)} float32"
             + (": the target's embedding table" if eagle or cfg.freeze_embeddings else ""),
             "the frozen embedding copy is the target's whole table: a device with more memory"),
        Term("AdamW state", 8 * trainable, "2 x float32 per trainable parameter",
             f"a smaller head: draft_vocab_size (now {draft_vocab})"),
    ]
    if cfg.teacher == "online" and eagle:
        resident.append(Term("online teacher head rows", run.tbytes * draft_vocab * tw.hidden,
                             f"[{draft_vocab}, {tw.hidden}] {str(run.target_dtype)[6:]}",
                             f"draft_vocab_size (now {draft_vocab})"))
    if devices > 1:
        resident.append(Term("DDP gradient buckets", 4 * trainable, "float32 per trainable parameter",
                             "fewer trainable parameters (draft_vocab_size)"))
    if cfg.needs_target:
        why = ("the trainer loads it for every EAGLE-3 run (draft construction, online states)" if eagle
               else f"teacher={cfg.teacher}")
        fix = ("dtype=bfloat16" if run.tbytes > 2 else "a device with more memory") + (
            "" if eagle else "; teacher=offline (the data's stored top-n) needs no target on the device")
        resident.append(Term("target weights", run.tbytes * target_parameters(target_cfg),
                             f"{str(run.target_dtype)[6:]}; {why}", fix))
    if device_type == "cpu" and run.half:
        shapes = onednn_cached_shapes()
        resident.append(Term("oneDNN kernel caches", ONEDNN_SHAPE_BYTES * shapes,
                             f"up to {shapes} matmul shapes' half-precision kernels, "
                             f"{ONEDNN_SHAPE_BYTES // 1024} KiB each where bf16 is native",
                             "mixed_precision=no, or lower LRU_CACHE_CAPACITY and ONEDNN_PRIMITIVE_CACHE_CAPACITY "
                             "(kernels are then rebuilt more often)"))
    resident.append(Term("runtime", CUDA_RUNTIME if device_type == "cuda" else CPU_RUNTIME,
                         "CUDA context and workspaces" if device_type == "cuda" else "the process's libraries"))
    return resident


def onednn_cached_shapes() -> int:
    """The most matmul shapes whose kernels oneDNN's caches keep: the larger of the two capacities (an upper bound:
    with one cache off, a shape costs about half), read from the environment as the libraries read it."""
    values = [os.environ.get(name, "").strip() for name in ONEDNN_CACHE_CAPACITY]
    return max(int(v) if v.isdigit() else default for v, default in zip(values, ONEDNN_CACHE_CAPACITY.values()))


def _train_step_terms(run: _Run) -> list[Term]:
    """A training step's peak: gradients, autocast's weight copies, the micro-batch's inputs, activations."""
    cfg, tw, b, s = run.cfg, run.tw, run.cfg.per_device_batch_size, run.cfg.max_length
    fix_acts = run.shrink_activations
    step = [Term("gradients", 4 * run.trainable, "float32 per trainable parameter",
                 f"a smaller head: draft_vocab_size (now {run.draft_vocab})")]
    if run.half:  # every linear layer's weight, frozen ones (LoRA's base) included: backward needs them all
        matmul = sum(m.weight.numel() for m in run.draft.modules() if isinstance(m, torch.nn.Linear))
        step.append(Term("autocast weight copies", 2 * matmul, "half copies kept for backward", fix_acts))
    if run.eagle:
        width = (1 + run.aux) * tw.hidden
        step.append(Term("target states (input)", 4 * b * s * width, f"float32 [B, S, {width}]", fix_acts))
        acts = eagle3_activations(b, s, cfg.ttt_steps, run.dw, run.draft_vocab, run.aux, run.half, cfg.teacher,
                                  cfg.loss, run.top_n)
    else:
        acts = plain_activations(b, s, run.dw, run.draft_layers, run.draft_vocab, run.half, cfg.loss)
    if cfg.teacher == "offline":
        step.append(Term("stored top-n (input)", 12 * b * s * run.top_n,
                         f"int64 ids + float32 log-probs, n={run.top_n}", fix_acts))
    shape = (f"B={b}, S={s}" + (f", ttt_steps={cfg.ttt_steps}" if run.eagle else "")
             + f", draft vocab {run.draft_vocab}")
    step.append(Term("activations", acts["peak"], shape, fix_acts))
    if not run.eagle and cfg.teacher in ("online", "on_policy"):
        teacher = target_forward_bytes(b, s, tw, run.tbytes) + b * s * (run.tbytes * tw.vocab + 4 * run.draft_vocab)
        step.append(Term("online teacher logits", teacher, "the target's forward and head, without grad",
                         "teacher=offline (stored top-n) or a lower per_device_batch_size / max_length"))
    return step


def _other_phases(run: _Run, stored_topn: bool) -> dict[str, list[Term]]:
    """The phases beside the training step: the online states' target forward, the held-out replay, AdamW."""
    cfg, tw, b, s = run.cfg, run.tw, run.cfg.per_device_batch_size, run.cfg.max_length
    phases = {}
    if run.online:
        width = (1 + run.aux) * tw.hidden
        phases["target forward (online states)"] = [Term(
            "target forward", target_forward_bytes(b, s, tw, run.tbytes, width) + b * s * width * (run.tbytes + 4),
            f"{run.states_why}; without grad, its states cast to float32",
            "record the states in the data stage (record_features=true, then states=recorded) or lower "
            f"per_device_batch_size (now {b}) / max_length (now {s})")]
    phases["held-out"] = [Term("held-out replay", _heldout_bytes(cfg, tw, run.dw, run.draft_vocab, run.aux,
                                                                  run.online, stored_topn, run.tbytes),
                               f"eval_batch_size={cfg.eval_batch_size} x S={s}",
                               f"lower eval_batch_size (now {cfg.eval_batch_size}) or max_length (now {s})")]
    phases["optimizer step"] = [Term("gradients + update temporaries", 8 * run.trainable, "AdamW's foreach update")]
    return phases


def _heldout_bytes(cfg, tw: Widths, dw: Widths, draft_vocab: int, aux: int, online: bool, topn: bool,
                   tbytes: int) -> int:
    """The held-out replay's peak: an EAGLE-3 draft unrolled max(eval_k) deep over eval_batch_size rows
    (float32, no grad: each step's output, keys and values kept; one step's logits and their comparison at a
    time) and, where the data stored top-n log-probs, the first proposal's q at those ids, a chunk of positions
    at a time; a plain draft's logits and (online) the target's, with alpha's
    [rows, target vocabulary] blocks."""

    b, s, v, e = cfg.eval_batch_size, cfg.max_length, draft_vocab, tw.vocab
    positions = b * s
    if cfg.draft == EAGLE3:
        width = (1 + aux) * tw.hidden
        states = 4 * positions * width
        replay = max(cfg.eval_k) * positions * (4 * dw.hidden + 8 * dw.kv) + positions * 5 * v
        # alpha reads q at the stored top-n ids only, over chunks of positions (train/eagle3_train.py)
        chunk = min(positions, max(1, LOSS_CHUNK_VALUES // v))
        alpha = positions * 8 * dw.hidden + chunk * 12 * v if topn else 0
        forward = target_forward_bytes(b, s, tw, tbytes, width) + positions * width * (tbytes + 4) if online else 0
        return max(states + max(replay, alpha), forward)
    logits = positions * 8 * v
    alpha = positions * (16 * e + 12 * v) if cfg.needs_target else positions * (4 * e + 12 * v) if topn else 0
    forward = target_forward_bytes(b, s, tw, tbytes) if cfg.needs_target else 0
    return logits + max(alpha, forward)


def _reads_and_disk(cfg, tw: Widths, aux: int, devices: int, online: bool, data, samples: int,
                    mean_length: int) -> tuple[list[Term], list[Term], list[str]]:
    """The recorded states' read rate, and the data stage's disk when its size is known (`samples`, or the data
    config's limit x num_samples)."""
    reads, disk, notes = [], [], []
    state_bytes = torch.finfo(RECORDED_STATES_DTYPE).bits // 8
    per_token = (1 + aux) * tw.hidden * state_bytes if cfg.draft == EAGLE3 else 0
    if per_token:
        step_tokens = cfg.per_device_batch_size * cfg.max_length
        read_note = " (this config computes them online: none read)" if online else ""
        per_step = per_token * step_tokens * devices * cfg.grad_accum_steps
        reads.append(Term("recorded states", per_token,
                          f"{per_token / 1024:.1f} KiB per trained token ((1 + {aux}) x {tw.hidden} x "
                          f"{state_bytes} bytes); {gib(per_token * step_tokens)} per device and micro-batch, "
                          f"{gib(per_step)} per optimizer step over {devices} device(s){read_note}"))
    if data is not None and not samples:
        samples = (data.limit or 0) * data.num_samples
    if not samples:
        return reads, disk, notes
    assumed = "" if mean_length else " (assumed: half of max_length; set plan_mean_length)"
    mean_length = mean_length or cfg.max_length // 2
    tokens = samples * mean_length
    disk.append(Term("token ids", 8 * tokens, f"{samples} samples x {mean_length} tokens{assumed}, int64"))
    top_n = data.top_logprobs if data is not None else 0
    if top_n:
        disk.append(Term(f"top-{top_n} log-probs", 12 * top_n * tokens, "int64 id + float32 log-prob per entry"))
    if per_token:
        recorded = data is not None and data.record_features
        disk.append(Term("recorded states", per_token * tokens,
                         "record_features=true" if recorded else "only with record_features=true (not set)"))
    total = sum(t.bytes for t in disk if "not set" not in t.detail)
    disk.append(Term("total", total, "uncompressed parquet and safetensors: an upper bound"))
    return reads, disk, notes


# ---- the device ---------------------------------------------------------------------------------------
