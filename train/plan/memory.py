"""A training run's memory terms per device (resident, and each phase's) and its disk, from the configs and the
draft built on the meta device (the package's docstring lists the terms). The terms every run has are here; the
draft kind adds its own (its `plan`, train/plan/kind.py)."""

from __future__ import annotations

import os

import torch

from specdec.models import resolve_dtype
from specdec.train.draft import kept_vocab_size
from specdec.train.plan.kind import KindPlan, PlanContext
from specdec.train.plan.report import GiB, Plan, Term, short_count
from specdec.train.plan.target import Widths, meta_counts, target_parameters
from specdec.train.target_parts import loads_parts_only, parts_parameters, reads_last_layer

CUDA_RUNTIME = 1 * GiB  # the CUDA context, cuBLAS workspaces and the caching allocator's slack (about)
CPU_RUNTIME = GiB // 2  # a trainer process's libraries (torch, transformers, accelerate): its RSS before any model
HALF = ("bf16", "fp16")
# The fix when a whole target does not fit where a draft reads its states: record them, and train on its parts
RECORDED_FIX = ("states: recorded (record them first: `specdec data` with record_features: true, backend: vllm and "
                "tensor_parallel_size: N GPUs; training then loads only the target's embedding, final norm and head)")
# Under half-precision autocast on a CPU, torch runs each matmul through oneDNN, which compiles kernels for every
# new shape and keeps them in two caches (ideep's, LRU_CACHE_CAPACITY, and oneDNN's,
# ONEDNN_PRIMITIVE_CACHE_CAPACITY; 1024 entries each by default). Where bf16 is native (AVX512-BF16, AMX) one
# shape's kernels hold about 576 KiB whatever its size; elsewhere a few KiB (torch 2.13, tests/test_plan.py).
# Batches are padded to their own width, and each new width makes new shapes (28 in a 2-step EAGLE-3 step), so
# a run fills the caches early: the first step at a width adds them, later steps at it do not. CUDA has no such cache.
ONEDNN_SHAPE_BYTES = 576 * 1024
ONEDNN_CACHE_CAPACITY = {"LRU_CACHE_CAPACITY": 1024, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": 1024}


def plan_run(cfg, target_cfg, *, device_type: str, mixed_precision: str, devices: int = 1, memory: int = 0,
             memory_source: str = "", data=None, samples: int = 0, mean_length: int = 0) -> Plan:
    """The plan of `cfg` (a TrainConfig) over a target of config `target_cfg`, on `devices` devices of
    `device_type` ("cuda" or "cpu") under `mixed_precision` ("no", "bf16", "fp16"). `data` (a DataConfig) and
    `samples`/`mean_length` size the data stage's disk."""
    tw = Widths.of(target_cfg)
    ctx = PlanContext(cfg, target_cfg, tw, kept_vocab_size(cfg, tw.vocab) or tw.vocab, mixed_precision in HALF,
                      resolve_dtype(cfg.dtype, torch.device(device_type)),
                      (data.top_logprobs if data is not None else 0) or 20, data is not None and data.top_logprobs > 0,
                      devices, data)
    kind = cfg.kind.plan(ctx)  # the draft kind's own terms (train/kinds/base.py: TrainingKind.plan)
    trainable, frozen = meta_counts(kind.model)
    trainable = trainable if kind.trainable is None else kind.trainable
    phases = {"train step": _train_step_terms(ctx, kind, trainable), **kind.phases,
              "held-out": [Term("held-out replay", kind.heldout, f"eval_batch_size={cfg.eval_batch_size} x "
                                f"S={cfg.max_length}", f"lower eval_batch_size (now {cfg.eval_batch_size}) or "
                                f"max_length (now {cfg.max_length})")],
              "optimizer step": [Term("gradients + update temporaries", 8 * trainable, "AdamW's foreach update")]}
    title = (f"plan: draft {cfg.draft} over {cfg.target} (hidden {tw.hidden}, {tw.layers} layers, vocab {tw.vocab}), "
             f"{device_type}, {'mixed precision ' + mixed_precision if ctx.half else 'float32'}, {devices} device(s), "
             "per device")
    plan = Plan(title, devices, _resident_terms(ctx, kind, trainable, frozen, device_type), phases, memory=memory,
                memory_source=memory_source)
    plan.reads, plan.disk = kind.reads, _disk(cfg, ctx, kind, data, samples, mean_length)
    if cfg.needs_target and cfg.kind.facts.reads_target_states and not loads_parts_only(cfg):
        plan.freeable = "target weights"  # recorded states spare it: the refusal names that fix first
    plan.notes.append("upper bounds where the data decides: every row max_length long, every position scored")
    return plan


def _resident_terms(ctx: PlanContext, kind: KindPlan, trainable: int, frozen: int, device_type: str) -> list[Term]:
    """What the run holds throughout: the draft, AdamW's state, the kind's own, DDP's buckets, the target, the
    runtime."""
    cfg, draft_vocab = ctx.cfg, ctx.draft_vocab
    resident = [
        Term("draft trainable weights", 4 * trainable, f"{short_count(trainable)} float32",
             f"a smaller head: draft_vocab_size (now {draft_vocab})"),
        Term("draft frozen parts", 4 * frozen, f"{short_count(frozen)} float32" + kind.frozen_note,
             "the frozen embedding copy is the target's whole table: a device with more memory"),
        Term("AdamW state", 8 * trainable, "2 x float32 per trainable parameter",
             f"a smaller head: draft_vocab_size (now {draft_vocab})"),
        *kind.resident,
    ]
    if ctx.devices > 1:
        resident.append(Term("DDP gradient buckets", 4 * trainable, "float32 per trainable parameter",
                             "fewer trainable parameters (draft_vocab_size)"))
    if cfg.needs_target:
        resident.append(_target_term(ctx, kind))
    if device_type == "cpu" and ctx.half:
        shapes = onednn_cached_shapes()
        resident.append(Term("oneDNN kernel caches", ONEDNN_SHAPE_BYTES * shapes,
                             f"up to {shapes} matmul shapes' half-precision kernels, "
                             f"{ONEDNN_SHAPE_BYTES // 1024} KiB each where bf16 is native",
                             "mixed_precision=no, or lower LRU_CACHE_CAPACITY and ONEDNN_PRIMITIVE_CACHE_CAPACITY "
                             "(kernels are then rebuilt more often)"))
    resident.append(Term("runtime", CUDA_RUNTIME if device_type == "cuda" else CPU_RUNTIME,
                         "CUDA context and workspaces" if device_type == "cuda" else "the process's libraries"))
    return resident


def _target_term(ctx: PlanContext, kind: KindPlan) -> Term:
    """The target's weights on the device: whole, or only the parts a run with recorded states reads
    (train/target_parts.py). A kind that reads the target's states names recording them as the fix."""
    cfg, dtype = ctx.cfg, str(ctx.target_dtype)[6:]
    last = reads_last_layer(cfg)
    if loads_parts_only(cfg):
        return Term("target weights", ctx.tbytes * parts_parameters(ctx.target_cfg, last),
                    f"{dtype}; only its embedding, final norm and head{' and last layer' if last else ''}: the "
                    "states are recorded", f"a smaller head: draft_vocab_size (now {ctx.draft_vocab})")
    fix = ("dtype=bfloat16" if ctx.tbytes > 2 else "a device with more memory") + kind.target_fix
    if cfg.kind.facts.reads_target_states:
        fix += f", or {RECORDED_FIX}"
    return Term("target weights", ctx.tbytes * target_parameters(ctx.target_cfg), f"{dtype}; {kind.target_why}", fix)


def onednn_cached_shapes() -> int:
    """The most matmul shapes whose kernels oneDNN's caches keep: the larger of the two capacities (an upper bound:
    with one cache off, a shape costs about half), read from the environment as the libraries read it."""
    values = [os.environ.get(name, "").strip() for name in ONEDNN_CACHE_CAPACITY]
    return max(int(v) if v.isdigit() else default for v, default in zip(values, ONEDNN_CACHE_CAPACITY.values()))


def _train_step_terms(ctx: PlanContext, kind: KindPlan, trainable: int) -> list[Term]:
    """A training step's peak: gradients, autocast's weight copies, the stored top-n, and the kind's terms (its
    inputs, activations, a teacher's forward)."""
    cfg, b, s = ctx.cfg, ctx.cfg.per_device_batch_size, ctx.cfg.max_length
    step = [Term("gradients", 4 * trainable, "float32 per trainable parameter",
                 f"a smaller head: draft_vocab_size (now {ctx.draft_vocab})")]
    if ctx.half:  # every linear layer's weight, frozen ones (LoRA's base) included: backward needs them all
        matmul = sum(m.weight.numel() for m in kind.model.modules() if isinstance(m, torch.nn.Linear))
        step.append(Term("autocast weight copies", 2 * matmul, "half copies kept for backward", kind.activation_fix))
    if cfg.teacher == "offline":
        step.append(Term("stored top-n (input)", 12 * b * s * ctx.top_n,
                         f"int64 ids + float32 log-probs, n={ctx.top_n}", kind.activation_fix))
    return step + kind.step


def _disk(cfg, ctx: PlanContext, kind: KindPlan, data, samples: int, mean_length: int) -> list[Term]:
    """The data stage's disk when its size is known (`samples`, or the data config's limit x num_samples)."""
    if data is not None and not samples:
        samples = (data.limit or 0) * data.num_samples
    if not samples:
        return []
    assumed = "" if mean_length else " (assumed: half of max_length; set plan_mean_length)"
    mean_length = mean_length or cfg.max_length // 2
    tokens = samples * mean_length
    disk = [Term("token ids", 8 * tokens, f"{samples} samples x {mean_length} tokens{assumed}, int64")]
    top_n = data.top_logprobs if data is not None else 0
    if top_n:
        disk.append(Term(f"top-{top_n} log-probs", 12 * top_n * tokens, "int64 id + float32 log-prob per entry"))
    disk += [Term(t.name, t.bytes * tokens, t.detail, t.fix) for t in kind.disk_per_token]
    total = sum(t.bytes for t in disk if "not set" not in t.detail)
    disk.append(Term("total", total, "uncompressed parquet and safetensors: an upper bound"))
    return disk
