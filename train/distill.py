"""Distil a draft on target-generated data: the training loop (accelerate; one process or many).

    specdec train --config recipes/smollm2-135m.yaml [key=value ...]
    python -m train --config recipes/smollm2-135m.yaml [key=value ...]
    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml -m train --config recipes/X.yaml
    specdec train --config recipes/X.yaml resume_from=latest        # continue a stopped run

The loop, per optimizer step: take the step's micro-batches from a deterministic schedule (a pure function of
seed, epoch and micro-batch index, so a resumed run continues the data order exactly); get the teacher
signal (online: the target's logits; offline: stored top-n log-probs; on_policy: with probability lambda the
draft samples a short continuation and the target scores it); backward the divergence over completion
tokens; clip, step, schedule. Every `eval_every` steps the held-out split gives expected acceptance alpha,
greedy agreement and simulated tau(k) (train/simulate.py); the best tau at `best_k` is kept in `best/`.
A feature draft (draft=feature) also reads the target's hidden states, computed once per sample, and trains and
is scored on unrolled proposals (train/feature_train.py).
Checkpoints (accelerator.save_state) go to output_dir/checkpoints/step-N; the final draft is a plain
transformers checkpoint in output_dir/final/. `.item()` happens only at log and eval steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.config import config_from_cli, to_dict
from specdec.models import EMBEDDED_TARGET, cpu_has_native_bf16
from train import feature_train, losses
from train.budget import CosineToEnd, TimeBudget, check_minutes
from train.draft import DEFAULT_LORA_MODULES, DERIVED, FEATURE, SCRATCH
from train.simulate import simulated_tau

log = logging.getLogger(__name__)

TEACHERS = ("online", "offline", "on_policy")


@dataclass
class TrainConfig:
    """The `train:` section of a recipe (plus the shared keys). See recipes/*.yaml for worked examples."""

    # shared keys
    target: str = EMBEDDED_TARGET
    draft: str = DERIVED  # derived | feature | scratch | Hub id / local path of a pretrained small model
    seed: int = 0
    output_dir: str = "runs/smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"  # the target's dtype (the draft trains in float32 + mixed precision)
    report_to: str = "none"  # none | wandb
    run_name: str = ""
    # data (folders written by `specdec data`; "" = <output_dir>/data and <output_dir>/data_heldout)
    train_data: str = ""  # `specdec data` folder(s), comma-separated; default <output_dir>/data
    heldout_data: str = ""
    heldout_fraction: float = 0.05  # split off by prompt_id when there is no held-out folder
    max_length: int = 1024
    # draft construction
    draft_layers: list[int] = field(default_factory=lambda: [0, 1, -1])
    draft_config: dict = field(default_factory=dict)  # overrides of the target config for draft=scratch
    draft_vocab_size: int = 0  # 0 = full vocabulary; N = keep the N most frequent completion tokens
    # Keep the input embeddings (the target's) fixed: tokens absent from the training data keep embeddings
    # that match the trained layers. With a tied full head this freezes the head too.
    freeze_embeddings: bool = False
    # Keep the head (the target's rows) fixed: the draft learns to land in the target's final hidden space,
    # so ids rare in the training data keep the target's own output directions.
    freeze_head: bool = False
    # draft=feature (EAGLE-style, specdec/feature_draft.py): draft_layers picks the target layers it starts from
    feature_steps: int = 2  # proposals unrolled per position in training (train/feature_train.py); 1 = true f only
    feature_regression_weight: float = 0.1  # smooth-L1 between predicted and true next features
    # Target layers whose outputs the draft reads besides the final feature (EAGLE-3's fused low/middle/high
    # features), e.g. [1, 14, 26] of a 30-layer target; [] = the final feature only.
    feature_aux_layers: list[int] = field(default_factory=list)
    # Also distil at the prompt's positions, weighted so (draft=feature, teacher=online): the target's
    # distribution there comes from the same features at no extra target forward. 0 = completion positions
    # only; on the embedded default 1 gave no clear held-out gain (README), so the recipes keep 0.
    prompt_loss_weight: float = 0.0
    # teacher signal and loss
    teacher: str = "online"  # online | offline | on_policy
    loss: str = "fkl"  # fkl | rkl | jsd | tvd | ce
    beta: float = 0.5  # generalized JSD interpolation (0 = forward KL, 1 = reverse KL)
    temperature: float = 1.0
    ce_weight: float = 0.0  # adds weight * cross-entropy on the target's tokens
    on_policy_fraction: float = 0.5  # lambda: share of micro-batches generated by the draft
    on_policy_max_new_tokens: int = 16
    on_policy_temperature: float = 1.0
    # optimisation
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_MODULES))
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_steps: int = 500
    # Stop by this much wall time (minutes, summed over resumes; the final evaluation comes after), with the
    # cosine schedule re-aimed at the step the measured pace reaches (train/budget.py). None = max_steps only.
    max_minutes: float | None = None
    per_device_batch_size: int = 8
    grad_accum_steps: int = 1
    max_grad_norm: float = 1.0
    mixed_precision: str = "auto"  # auto | no | bf16 | fp16
    bucket_by_length: bool = True
    # logging, evaluation, checkpoints
    log_every: int = 10
    eval_every: int = 100  # 0 = only at the start and the end
    eval_samples: int = 64
    eval_batch_size: int = 8
    eval_k: list[int] = field(default_factory=lambda: list(range(1, 9)))
    best_k: int = 4
    save_every: int = 100  # 0 = only at the end
    keep_checkpoints: int = 2
    resume_from: str = ""  # "" | latest | a checkpoint folder
    record_consumed: bool = False  # write each step's sample ids to output_dir/consumed/rank-R.jsonl
    wandb_project: str = "specdec"

    def __post_init__(self) -> None:
        if self.teacher not in TEACHERS:
            raise ValueError(f"teacher must be one of {', '.join(TEACHERS)}, got {self.teacher!r}")
        if self.loss not in losses.LOSSES:
            raise ValueError(f"loss must be one of {', '.join(losses.LOSSES)}, got {self.loss!r}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {self.beta}")
        if self.temperature <= 0 or self.on_policy_temperature <= 0:
            raise ValueError("temperature and on_policy_temperature must be > 0")
        if not 0.0 <= self.on_policy_fraction <= 1.0:
            raise ValueError(f"on_policy_fraction (lambda) must be in [0, 1], got {self.on_policy_fraction}")
        if self.report_to not in ("none", "wandb"):
            raise ValueError(f"report_to must be none or wandb, got {self.report_to!r}")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be auto, no, bf16 or fp16, got {self.mixed_precision!r}")
        for name in ("max_steps", "per_device_batch_size", "grad_accum_steps", "max_length", "eval_batch_size",
                     "log_every", "keep_checkpoints", "on_policy_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_minutes(self.max_minutes)
        if self.warmup_steps < 0 or self.eval_every < 0 or self.save_every < 0 or self.draft_vocab_size < 0:
            raise ValueError("warmup_steps, eval_every, save_every and draft_vocab_size must be >= 0")
        if not self.eval_k or min(self.eval_k) < 1 or self.best_k not in self.eval_k:
            raise ValueError(f"eval_k must list k >= 1 and include best_k={self.best_k}, got {self.eval_k}")
        if self.draft == FEATURE:
            if self.teacher == "on_policy":
                raise ValueError("draft=feature trains with teacher=offline or online (its unrolled steps already "
                                 "show it its own proposals); on_policy is for token-only drafts")
            if self.lora:
                raise ValueError("draft=feature is a new small module: train it fully (lora=false)")
            if self.feature_steps < 1 or self.feature_regression_weight < 0:
                raise ValueError("feature_steps must be >= 1 and feature_regression_weight >= 0")
        elif self.feature_aux_layers:
            raise ValueError("feature_aux_layers is for draft=feature (a token-only draft reads no target features)")
        if self.prompt_loss_weight < 0:
            raise ValueError(f"prompt_loss_weight must be >= 0, got {self.prompt_loss_weight}")
        if self.prompt_loss_weight and (self.draft != FEATURE or self.teacher != "online" or self.loss == "ce"):
            raise ValueError("prompt_loss_weight needs draft=feature, teacher=online and a divergence loss: only "
                             "then is the target's distribution at prompt positions at hand (its features give it); "
                             "set prompt_loss_weight=0 otherwise")
        if self.lora and self.draft in (DERIVED, SCRATCH):
            log.warning("lora=true on a %s draft: usually a full fine-tune is better for new layer stacks", self.draft)

    @property
    def needs_target(self) -> bool:
        """The target runs in the loop: for its logits (online teacher) or its features (a feature draft)."""
        return self.teacher in ("online", "on_policy") or self.draft == FEATURE


# ---- data ------------------------------------------------------------------------------------------------


def load_split(path: str | Path):
    """A generated-data folder (manifest.json + shards/*.parquet) as a datasets.Dataset."""
    try:
        from train.data import load_generated
    except ModuleNotFoundError as err:
        if err.name not in ("train.data",):
            raise
        load_generated = None
    if load_generated is not None:
        return load_generated(path)
    from datasets import Dataset

    files = sorted(Path(path, "shards").glob("*.parquet"))
    if not files:
        raise ValueError(f"{path} holds no shards/*.parquet; generate the data first: specdec data --config ...")
    return Dataset.from_parquet([str(f) for f in files])


def _in_heldout(prompt_id: str, fraction: float) -> bool:
    # A hash, not an RNG: the split is the same on every rank, every run and every resume.
    return int(hashlib.sha1(prompt_id.encode()).hexdigest()[:8], 16) % 10_000 < fraction * 10_000


def data_folders(cfg: TrainConfig) -> tuple[list[Path], Path | None]:
    """The training data folders and the held-out folder (None: a hash split of the training data)."""
    out = Path(cfg.output_dir)
    train_paths = [Path(p.strip()) for p in cfg.train_data.split(",") if p.strip()] or [out / "data"]
    for path in train_paths:
        if not path.is_dir():
            raise ValueError(f"training data {path} not found; run `specdec data --config ...` first or set "
                             "train_data=<folder>[,<folder>...]")
    heldout_path = Path(cfg.heldout_data) if cfg.heldout_data else out / "data_heldout"
    if heldout_path.is_dir():
        return train_paths, heldout_path
    if cfg.heldout_data:
        raise ValueError(f"heldout_data {heldout_path} not found")
    return train_paths, None


def load_data(cfg: TrainConfig):
    """(train, heldout) datasets; held-out is its own folder or a hash split of prompt ids."""
    train_paths, heldout_path = data_folders(cfg)
    train = load_split(train_paths[0])
    if len(train_paths) > 1:  # several `specdec data` folders, e.g. a prompt set and self-written prompts
        import datasets

        train = datasets.concatenate_datasets([train, *(load_split(p) for p in train_paths[1:])])
    if heldout_path is not None:
        return train, load_split(heldout_path)
    flags = [_in_heldout(str(p), cfg.heldout_fraction) for p in train["prompt_id"]]
    held = [i for i, f in enumerate(flags) if f]
    kept = [i for i, f in enumerate(flags) if not f]
    return train.select(kept), train.select(held)


def sample_id(rows: dict, i: int) -> str:
    """A sample's identity: prompt_id/sample_index/turn."""
    return f"{rows['prompt_id'][i]}/{rows['sample_index'][i]}/{rows['turn'][i]}"


def preload_folder(cache, folder: str | Path, aux_layers: list[int], max_length: int) -> int:
    """Read into a feature draft's `FeatureCache` the target features the data stage recorded in `folder`
    (`record_features=true` with the same aux_layers), so that they cost no target forward. Returns how many
    samples it read (0 when the folder has none, or other layers: they are then computed in the loop)."""
    from train.data import read_manifest, recorded_features

    recorded = read_manifest(folder).get("features")
    if not recorded:
        log.info("%s has no recorded target features: computing them in the loop (specdec data "
                 "record_features=true would spare that)", folder)
        return 0
    if list(recorded["aux_layers"]) != list(aux_layers):
        log.warning("%s recorded features with feature_aux_layers=%s, the draft reads %s: computing them in "
                    "the loop", folder, recorded["aux_layers"], list(aux_layers))
        return 0
    kept = sum(cache.preload(((sample_id(cols, i), cols["input_ids"][i], f) for i, f in enumerate(feats)),
                             max_length) for cols, feats in recorded_features(folder))
    log.info("read the target's recorded features of %d samples from %s", kept, folder)
    return kept


def preload_features(cache, cfg: TrainConfig) -> None:
    """`preload_folder` for every training and held-out folder of the run."""
    train_paths, heldout_path = data_folders(cfg)
    for folder in train_paths + ([heldout_path] if heldout_path else []):
        preload_folder(cache, folder, cfg.feature_aux_layers, cfg.max_length)


def epoch_batches(lengths: list[int], global_batch: int, seed: int, epoch: int, bucket: bool) -> list[list[int]]:
    """One epoch of global batches (lists of row indices): shuffled, length-bucketed, full batches only."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if bucket:
        # Sort within windows of 32 batches so rows of similar length share a batch (less padding), then
        # shuffle the batches so lengths do not trend through the epoch.
        window = global_batch * 32
        order = [i for s in range(0, len(order), window) for i in sorted(order[s:s + window], key=lengths.__getitem__)]
    batches = [order[s:s + global_batch] for s in range(0, len(order) - global_batch + 1, global_batch)]
    if bucket:
        rng.shuffle(batches)
    return batches


class Schedule:
    """Micro-batch m -> global batch indices, over endless epochs; a pure function of (seed, m)."""

    def __init__(self, lengths: list[int], global_batch: int, seed: int, bucket: bool):
        if len(lengths) < global_batch:
            raise ValueError(f"{len(lengths)} training samples are fewer than one global batch ({global_batch} = "
                             "per_device_batch_size x processes); lower per_device_batch_size or generate more data")
        self.lengths, self.global_batch, self.seed, self.bucket = lengths, global_batch, seed, bucket
        self.per_epoch = len(lengths) // global_batch
        self._epoch, self._batches = -1, []

    def __call__(self, m: int) -> list[int]:
        epoch = m // self.per_epoch
        if epoch != self._epoch:
            self._epoch = epoch
            self._batches = epoch_batches(self.lengths, self.global_batch, self.seed, epoch, self.bucket)
        return self._batches[m % self.per_epoch]


def collate(rows: dict, pad_id: int, max_length: int) -> dict[str, Any]:
    """Right-padded tensors; `loss_mask[b, t]` marks logits positions t that predict a completion token."""
    seqs = [list(ids)[:max_length] for ids in rows["input_ids"]]
    batch, width = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(batch, width, dtype=torch.long)
    loss_mask = torch.zeros(batch, width, dtype=torch.bool)
    has_topn = rows.get("top_ids") is not None and all(t is not None for t in rows["top_ids"])
    if has_topn:
        n = max((len(t[0]) for t in rows["top_ids"] if len(t)), default=1)
        top_ids = torch.zeros(batch, width, n, dtype=torch.long)
        top_logprobs = torch.zeros(batch, width, n, dtype=torch.float32)
    for b, seq in enumerate(seqs):
        length, prompt = len(seq), max(int(rows["prompt_length"][b]), 1)
        input_ids[b, :length] = torch.tensor(seq)
        attention_mask[b, :length] = 1
        stop = length - 1
        if has_topn:
            comp = rows["top_ids"][b][: max(length - prompt, 0)]
            stop = min(stop, prompt - 1 + len(comp))
            if comp:
                top_ids[b, prompt - 1: prompt - 1 + len(comp)] = torch.tensor(comp)
                top_logprobs[b, prompt - 1: prompt - 1 + len(comp)] = torch.tensor(rows["top_logprobs"][b][: len(comp)])
        loss_mask[b, prompt - 1: stop] = True
    labels = torch.roll(input_ids, -1, dims=1)  # labels[:, t] = input_ids[:, t + 1]
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask, "labels": labels,
           "n_tokens": int(loss_mask.sum())}
    if has_topn:
        out["top_ids"], out["top_logprobs"] = top_ids, top_logprobs
    return out


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def on_policy_batch(model, batch: dict, max_new: int, temperature: float, id_map: torch.Tensor | None,
                    pad_id: int, eos_id: int | None, generator: torch.Generator) -> dict[str, Any]:
    """Replace completions by short continuations sampled from the draft (left-padded prompts), with a KV cache."""
    from transformers import DynamicCache

    from specdec.decode import cache_kwarg

    ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    prompt_lens = [int(m.nonzero()[0]) + 1 if m.any() else int(a.sum()) for m, a in zip(loss_mask, mask)]
    width = max(prompt_lens)
    new_ids = torch.full((ids.shape[0], width + max_new), pad_id, dtype=torch.long, device=ids.device)
    new_mask = torch.zeros_like(new_ids)
    for b, n in enumerate(prompt_lens):
        new_ids[b, width - n: width] = ids[b, :n]
        new_mask[b, width - n: width] = 1
    new_mask[:, width:] = 1
    positions = _positions(new_mask)
    # The wrapped model's forward (DDP) hides the signature: ask the plain module which cache kwarg it takes.
    inner = getattr(model, "module", model)
    cache = DynamicCache(config=inner.config)
    start = 0
    for cur in range(width, width + max_new):
        logits = model(input_ids=new_ids[:, start:cur], attention_mask=new_mask[:, :cur],
                       position_ids=positions[:, start:cur], use_cache=True, logits_to_keep=1,
                       **{cache_kwarg(inner): cache}).logits[:, -1].float()
        token = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator).squeeze(-1)
        new_ids[:, cur] = token if id_map is None else id_map[token]
        start = cur
    gen = new_ids[:, width:]
    # Tokens after the draft's first EOS are not a continuation the target would ever see: no loss there.
    after_eos = (gen == eos_id).long().cumsum(-1) - (gen == eos_id).long() > 0 if eos_id is not None else None
    new_loss = torch.zeros_like(new_ids, dtype=torch.bool)
    new_loss[:, width - 1: width + max_new - 1] = True if after_eos is None else ~after_eos
    return {"input_ids": new_ids, "attention_mask": new_mask, "loss_mask": new_loss,
            "labels": torch.roll(new_ids, -1, dims=1), "n_tokens": int(new_loss.sum())}


# ---- teacher signal and loss ------------------------------------------------------------------------------


def _forward(model, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 position_ids=_positions(batch["attention_mask"])).logits


@torch.no_grad()
def target_logits_at(target, batch: dict) -> torch.Tensor:
    """The target's logits at the loss positions only.  -> [N, V_target]

    The head runs on the selected hidden states: a [B, T, V] teacher tensor is most of the memory otherwise.
    """
    mask = batch["loss_mask"].bool()
    decoder, head = target.get_decoder(), target.get_output_embeddings()
    # Models that post-process logits (soft-capping) need their own forward.
    if decoder is None or head is None or getattr(target.config, "final_logit_softcapping", None):
        return _forward(target, batch)[mask]
    hidden = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=_positions(batch["attention_mask"])).last_hidden_state
    return head(hidden[mask])


def teacher_logits(target, batch: dict, student_vocab: int, id_map, inv_map) -> torch.Tensor:
    """Teacher logits over the draft's vocabulary at the loss positions: online from the target, else dense
    from the stored top-n log-probs.  -> [N, V_draft]"""
    if target is not None:
        logits = target_logits_at(target, batch)
        return losses.restrict_teacher(logits, id_map) if id_map is not None else logits[:, :student_vocab]
    if "top_ids" not in batch:
        raise ValueError("teacher=offline with a divergence loss needs stored top-n log-probs (top_ids, top_logprobs)"
                         " in the data: regenerate with `specdec data ... top_logprobs=20`, or use loss=ce")
    mask = batch["loss_mask"].bool()
    return losses.dense_teacher_logits(batch["top_ids"][mask], batch["top_logprobs"][mask], student_vocab, inv_map)


def compute_loss(cfg: TrainConfig, student_logits, teacher, batch: dict, inv_map) -> torch.Tensor:
    """The configured divergence (+ ce_weight x cross-entropy) over completion positions."""
    mask = batch["loss_mask"].bool()
    student = student_logits[mask]  # [N, V_draft]
    width = min(student.shape[-1], teacher.shape[-1]) if teacher is not None else student.shape[-1]
    student = student[:, :width]
    total = None
    if cfg.loss != "ce":
        total = losses.distill_loss(cfg.loss, *losses.with_teacher_mass(student, teacher[:, :width]), None, cfg.beta,
                                    cfg.temperature)
    if cfg.loss == "ce" or cfg.ce_weight > 0:
        labels = batch["labels"][mask]
        labels = labels if inv_map is None else inv_map[labels]
        valid = (labels >= 0) & (labels < width)  # a reduced head cannot predict ids it lacks
        ce = losses.cross_entropy(student, labels.clamp(min=0), valid)
        total = ce if total is None else total + cfg.ce_weight * ce
    return total


# ---- held-out metrics ------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, target, items: list[dict], cfg: TrainConfig, pad_id: int, id_map, device) -> dict[str, Any]:
    """alpha, greedy agreement and simulated tau(k) on held-out completions (teacher-forced)."""
    was_training = model.training
    model.eval()
    alphas, agreements = [], []
    for s in range(0, len(items), cfg.eval_batch_size):
        chunk = items[s:s + cfg.eval_batch_size]
        rows = {k: [r.get(k) for r in chunk] for k in chunk[0]}
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collate(rows, pad_id, cfg.max_length).items()}
        mask = batch["loss_mask"].bool()
        student = _forward(model, batch)[mask].float()  # [N, V_draft]
        if target is not None:
            t_logits = target_logits_at(target, batch).float()  # [N, V_target]
            alpha = losses.acceptance_alpha(student, t_logits, None, id_map)
            agree = losses.greedy_agreement(student, t_logits, None, id_map)
        else:
            # The target's greedy token is the stored top-1 (else the data's next token: exact for greedy data).
            has_topn = "top_ids" in batch
            target_top = batch["top_ids"][..., 0] if has_topn else batch["labels"]
            agree = losses.draft_argmax_in_target_ids(student, id_map) == target_top[mask]
            alpha = (losses.acceptance_alpha_topn(student, batch["top_ids"][mask], batch["top_logprobs"][mask],
                                                  None, id_map)
                     if has_topn else torch.full(agree.shape, float("nan")))
        counts = mask.sum(-1).tolist()
        alphas.append(alpha.cpu())
        agreements += [a.tolist() for a in agree.cpu().split(counts)]
    if was_training:
        model.train()
    alpha_all = torch.cat(alphas) if alphas else torch.zeros(0)
    taus = simulated_tau(agreements, cfg.eval_k)
    flat = [x for a in agreements for x in a]
    return {"alpha": float(alpha_all.mean()) if alpha_all.numel() else float("nan"),
            "agreement": sum(flat) / max(len(flat), 1), "tau": taus, "positions": len(flat),
            "alpha_is_lower_bound": target is None}


# ---- checkpoints -----------------------------------------------------------------------------------------


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step under `root` (a trainer_state.json marks it complete)."""
    done = [p for p in root.glob("step-*") if p.is_dir() and (p / "trainer_state.json").is_file()
            and p.name.split("-", 1)[1].isdigit()]
    return max(done, key=lambda p: int(p.name.split("-", 1)[1]), default=None)


def save_checkpoint(accelerator, root: Path, step: int, state: dict, keep: int) -> Path:
    """accelerator.save_state into step-N (written as step-N.tmp and renamed, so a kill never leaves half)."""
    tmp, final = root / f"step-{step}.tmp", root / f"step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        steps = sorted((p for p in root.glob("step-*") if p.name.split("-", 1)[1].isdigit()),
                       key=lambda p: int(p.name.split("-", 1)[1]))
        for old in steps[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def export_draft(accelerator, model, tokenizer, out: Path) -> Path:
    """The draft as a plain transformers checkpoint (LoRA merged; id map when reduced); main process writes."""
    from accelerate.utils import DistributedType

    from specdec import vocab as vocab_lib
    from specdec.models import save_model
    from train.draft import merged

    unwrapped = accelerator.unwrap_model(model)
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    # FSDP / DeepSpeed hold shards: gather a full state dict (a collective: every rank must call it).
    state = accelerator.get_state_dict(model) if sharded else None
    if accelerator.is_main_process:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if sharded:
            unwrapped.save_pretrained(tmp, state_dict=state)
            vocab_lib.save_vocab_map(unwrapped, tmp)
            tokenizer.save_pretrained(tmp)
        else:
            save_model(merged(unwrapped), tokenizer, tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    accelerator.wait_for_everyone()
    return out


class ConsumedLog:
    """Each step's sample ids per rank (proof that resuming neither repeats nor skips data)."""

    def __init__(self, folder: Path, rank: int, resume_step: int | None):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank-{rank}.jsonl"
        kept = []
        if resume_step is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill
                    continue
                if rec["step"] <= resume_step:
                    kept.append(line)
        self.path.write_text("".join(k + "\n" for k in kept))
        self.file = self.path.open("a")

    def write(self, step: int, ids: list[str]) -> None:
        self.file.write(json.dumps({"step": step, "ids": ids}) + "\n")
        self.file.flush()


# ---- the run ---------------------------------------------------------------------------------------------


def _mixed_precision(cfg: TrainConfig) -> str:
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return os.environ["ACCELERATE_MIXED_PRECISION"]
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if cuda:
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    # CPUs with native bf16 dot products (AVX512-BF16, AMX) train about 1.7x faster under bf16 autocast
    # (measured on a 2-core Zen 4); elsewhere bf16 is emulated and slower than float32.
    return "bf16" if cpu_has_native_bf16() else "no"


def _wandb_run(cfg: TrainConfig):
    try:
        import wandb
    except ImportError as err:
        raise ValueError("report_to=wandb needs the wandb package: pip install specdec[wandb]") from err
    return wandb.init(project=cfg.wandb_project, name=cfg.run_name or None, config=to_dict(cfg),
                      dir=cfg.output_dir)


def run(cfg: TrainConfig) -> Path:
    """Train a draft per `cfg`; returns output_dir/final (a plain transformers checkpoint)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from specdec.compat import check_compatible
    from specdec.feature_draft import FeatureDraft
    from specdec.models import load_model, load_tokenizer
    from train import draft as draft_lib

    budget = TimeBudget(cfg.max_minutes or math.inf, cfg.max_steps)  # counts from here: loading is training time
    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum_steps,
                              mixed_precision=_mixed_precision(cfg), cpu=cfg.device == "cpu")
    main_proc, rank, world, device = (accelerator.is_main_process, accelerator.process_index,
                                      accelerator.num_processes, accelerator.device)
    log.info("device %s, %d process(es), mixed precision %s", device, world, accelerator.mixed_precision)
    if cfg.lora and accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
        raise ValueError("lora=true is supported with single-process or DDP launches (recipes/accelerate/"
                         "single_gpu.yaml, multi_gpu.yaml); use a full fine-tune with FSDP / DeepSpeed")
    set_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    # 1. data, tokenizer, target, draft
    train_ds, heldout_ds = load_data(cfg)
    tokenizer = load_tokenizer(cfg.target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    target = None
    if cfg.needs_target or cfg.draft in (DERIVED, SCRATCH):
        target = load_model(cfg.target, dtype=cfg.dtype, device=device if cfg.needs_target else "cpu")
        target.requires_grad_(False)
    feature = cfg.draft == FEATURE

    def reduced_vocab(vocab_size: int) -> torch.Tensor:
        counts = draft_lib.completion_token_counts(train_ds.select_columns(["input_ids", "prompt_length"]), vocab_size)
        keep = draft_lib.select_vocab(counts, cfg.draft_vocab_size,
                                      [tokenizer.eos_token_id, tokenizer.bos_token_id, pad_id])
        log.info("reduced draft head: %d ids cover %.1f%% of completion tokens", keep.numel(),
                 100 * float(counts[keep].sum()) / max(float(counts.sum()), 1.0))
        return keep

    if feature:
        keep = reduced_vocab(target.get_input_embeddings().num_embeddings) if cfg.draft_vocab_size else None
        model = FeatureDraft.from_target(target, cfg.draft_layers, keep, cfg.feature_aux_layers).float().to(device)
    else:
        model = draft_lib.build_draft(cfg.draft, target, cfg.draft_layers, cfg.draft_config, cfg.seed, device)
    draft_tok = tokenizer if cfg.draft in (DERIVED, SCRATCH, FEATURE) else load_tokenizer(cfg.draft)
    check_compatible(tokenizer, draft_tok, target, model)
    if not cfg.needs_target:
        target = None  # derived from it; the offline teacher needs nothing more
    if cfg.draft_vocab_size and not feature:
        draft_lib.reduce_vocab(model, reduced_vocab(model.get_input_embeddings().num_embeddings).to(device))
    id_map = draft_lib.vocab_lib.draft_to_target_map(model)
    target_vocab = target.get_output_embeddings().out_features if target is not None else len(tokenizer)
    inv_map = losses.target_to_draft_map(id_map, max(target_vocab, len(tokenizer)))
    if cfg.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    if cfg.freeze_head:
        model.get_output_embeddings().requires_grad_(False)
    if cfg.lora:
        model = draft_lib.add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
    student_vocab = model.get_output_embeddings().out_features if not cfg.lora else \
        model.get_base_model().get_output_embeddings().out_features
    model.train()

    # 2. optimiser, schedule, accelerate
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, CosineToEnd(cfg.warmup_steps, cfg.max_steps))
    model, optimizer = accelerator.prepare(model, optimizer)
    # Not prepared: accelerate would step it once per process; it is stepped once per optimizer step below.
    accelerator.register_for_checkpointing(scheduler)

    ckpt_root = out / "checkpoints"
    start_step, best = 0, {"tau": -1.0, "step": None}
    if cfg.resume_from:
        ckpt = latest_checkpoint(ckpt_root) if cfg.resume_from == "latest" else Path(cfg.resume_from)
        if ckpt is None or not (ckpt / "trainer_state.json").is_file():
            raise ValueError(f"no complete checkpoint to resume from ({cfg.resume_from!r} under {ckpt_root}); "
                             "drop resume_from to start afresh")
        accelerator.load_state(str(ckpt))
        state = json.loads((ckpt / "trainer_state.json").read_text())
        start_step, best = state["step"], state["best"]
        budget.resume(state.get("train_seconds", 0.0))
        log.info("resumed from %s at step %d", ckpt, start_step)
    schedule_end = scheduler.lr_lambdas[0]
    # Under a time budget the end reached so far came back with the checkpoint; otherwise max_steps sets it (and
    # a resume with a larger max_steps trains on).
    schedule_end.end = min(schedule_end.end, cfg.max_steps) if cfg.max_minutes else cfg.max_steps

    lengths = [min(len(x), cfg.max_length) for x in train_ds["input_ids"]]
    schedule = Schedule(lengths, cfg.per_device_batch_size * world, cfg.seed, cfg.bucket_by_length)
    heldout = [heldout_ds[i] for i in range(min(cfg.eval_samples, len(heldout_ds)))]
    consumed = ConsumedLog(out / "consumed", rank, start_step if cfg.resume_from else None) \
        if cfg.record_consumed else None
    tracker = _wandb_run(cfg) if cfg.report_to == "wandb" and main_proc else None
    history_file = out / "eval.jsonl"
    if feature:
        head = accelerator.unwrap_model(model).get_output_embeddings()
        target_head = feature_train.teacher_head(target.get_output_embeddings(), id_map) \
            if cfg.teacher == "online" else None
        features_of = feature_train.FeatureCache(target, accelerator.autocast, cfg.feature_aux_layers)
        preload_features(features_of, cfg)

    def eval_chunks():
        for s in range(0, len(heldout), cfg.eval_batch_size):
            chunk = heldout[s:s + cfg.eval_batch_size]
            rows = {k: [r.get(k) for r in chunk] for k in chunk[0]}
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collate(rows, pad_id, cfg.max_length).items()}
            yield [sample_id(rows, i) for i in range(len(chunk))], batch

    def do_eval(step: int) -> None:
        if not heldout:
            return
        started = time.perf_counter()
        if feature:
            model.eval()
            metrics = feature_train.evaluate_feature_draft(model, head, features_of, eval_chunks(), cfg.eval_k, id_map)
            model.train()
        else:
            metrics = evaluate(model, target, heldout, cfg, pad_id, id_map, device)
        tau = metrics["tau"][cfg.best_k]
        if main_proc:
            log.info("step %d held-out: alpha %.3f  greedy agreement %.3f  tau(k=%d) %.3f  tau %s", step,
                     metrics["alpha"], metrics["agreement"], cfg.best_k, tau,
                     {k: round(v, 3) for k, v in metrics["tau"].items()})
            with history_file.open("a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
            if tracker is not None:
                tracker.log({"eval/alpha": metrics["alpha"], "eval/agreement": metrics["agreement"],
                             **{f"eval/tau@{k}": v for k, v in metrics["tau"].items()}}, step=step)
        if step > 0 and tau > best["tau"]:
            best.update(tau=tau, step=step, metrics=metrics)
            export_draft(accelerator, model, tokenizer, out / "best")
            if main_proc:
                (out / "best" / "specdec_best.json").write_text(json.dumps({"step": step, **metrics}, indent=1))
        budget.note_eval(time.perf_counter() - started)

    def trainer_state(step: int) -> dict:
        return {"step": step, "best": _jsonable(best), "train_seconds": budget.spent()}

    if start_step == 0:
        do_eval(0)

    # 3. the loop
    end = schedule_end.end
    bar = tqdm(total=end, initial=start_step, disable=not main_proc, desc="train", dynamic_ncols=True)
    loss_sum = torch.zeros((), device=device)
    tokens, window_start, window_steps = 0, time.perf_counter(), 0
    step = start_step
    budget.start_loop(start_step)
    while step < end:
        step += 1
        step_ids: list[str] = []
        for micro in range(cfg.grad_accum_steps):
            m = (step - 1) * cfg.grad_accum_steps + micro
            indices = schedule(m)[rank * cfg.per_device_batch_size:(rank + 1) * cfg.per_device_batch_size]
            rows = train_ds[indices]
            micro_ids = [sample_id(rows, i) for i in range(len(indices))]
            step_ids += micro_ids
            batch = {k: v.to(device) if torch.is_tensor(v) else v
                     for k, v in collate(rows, pad_id, cfg.max_length).items()}
            # Same draw on every rank and on resume: seeded by (seed, micro-batch index).
            if cfg.teacher == "on_policy" and random.Random(cfg.seed * 7919 + m).random() < cfg.on_policy_fraction:
                gen = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + m * 131 + rank)
                batch = on_policy_batch(model, batch, cfg.on_policy_max_new_tokens, cfg.on_policy_temperature,
                                        id_map, pad_id, tokenizer.eos_token_id, gen)
            with accelerator.accumulate(model):
                if feature:
                    student = teacher = None
                    loss = feature_train.feature_loss(cfg, model, head, batch, features_of(micro_ids, batch),
                                                      target_head, inv_map)
                else:
                    student = _forward(model, batch)
                    teacher = teacher_logits(target, batch, student_vocab, id_map, inv_map) if cfg.loss != "ce" else None
                    loss = compute_loss(cfg, student, teacher, batch, inv_map)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach() / cfg.grad_accum_steps
            tokens += batch["n_tokens"]
            del student, teacher, loss
        scheduler.step()
        window_steps += 1
        bar.update(1)
        if consumed is not None:
            consumed.write(step, step_ids)

        if step % cfg.log_every == 0 or step == end:
            mean_loss = accelerator.reduce(loss_sum, reduction="mean").item() / window_steps  # a sync
            if cfg.max_minutes:  # every process stops at the earliest end any of them computes
                wanted = torch.tensor([budget.end_step(step)], device=device)
                aimed = int(accelerator.gather(wanted).min())
                if aimed != end:
                    end = schedule_end.end = aimed
                    bar.total = end
                    bar.refresh()
            elapsed = time.perf_counter() - window_start
            lr = scheduler.get_last_lr()[0]
            tok_s = tokens * world / max(elapsed, 1e-9)
            bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}")
            if main_proc:
                log.info("step %d loss %.4f lr %.2e tokens/s %.0f", step, mean_loss, lr, tok_s)
                if tracker is not None:
                    tracker.log({"train/loss": mean_loss, "train/lr": lr, "train/tokens_per_s": tok_s}, step=step)
            loss_sum.zero_()
            tokens, window_start, window_steps = 0, time.perf_counter(), 0
        if cfg.eval_every and step % cfg.eval_every == 0 and step != end:
            do_eval(step)
        if cfg.save_every and step % cfg.save_every == 0 and step != end:
            save_checkpoint(accelerator, ckpt_root, step, trainer_state(step), cfg.keep_checkpoints)
    bar.close()
    if end < cfg.max_steps:
        log.info("stopped at step %d of %d: max_minutes=%s reached (%.1f min)", step, cfg.max_steps,
                 cfg.max_minutes, budget.spent() / 60)

    # 4. last evaluation, checkpoint and the final draft
    if step > start_step or start_step == end:
        do_eval(step)
    save_checkpoint(accelerator, ckpt_root, step, trainer_state(step), cfg.keep_checkpoints)
    final = export_draft(accelerator, model, tokenizer, out / "final")
    if main_proc:
        summary = {"final": str(final), "steps": step, "best": _jsonable(best), "device": str(device),
                   "processes": world, "mixed_precision": accelerator.mixed_precision,
                   "stopped_by": "max_minutes" if end < cfg.max_steps else "max_steps",
                   "train_minutes": budget.spent() / 60, "config": to_dict(cfg)}
        (out / "train_summary.json").write_text(json.dumps(summary, indent=1))
        log.info("final draft: %s (best tau(k=%d) %.3f at step %s -> %s)", final, cfg.best_k, best["tau"],
                 best["step"], out / "best")
    if tracker is not None:
        tracker.finish()
    if consumed is not None:
        consumed.file.close()
    accelerator.end_training()
    return final


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def _help() -> str:
    lines = ["usage: specdec train --config recipes/X.yaml [key=value ...] [--key value ...]", "",
             "train: options (recipe section `train:` plus the shared keys):"]
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"  {f.name} = {default!r}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`specdec train` / `python -m train` / `accelerate launch -m train`."""
    if any(a in ("-h", "--help") for a in argv):
        print(_help())
        return 0
    cfg = config_from_cli(TrainConfig, argv, section="train")
    run(cfg)
    return 0
