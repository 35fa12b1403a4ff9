"""What the memory plan gives a draft kind (`PlanContext`) and what the kind answers (`KindPlan`): the plan's common
terms (weights, AdamW, DDP, the target, the runtime) come from train/plan/memory.py, the kind's own from its `plan`
(train/kinds/base.py: TrainingKind)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.train.plan.report import Term
from specdec.train.plan.target import Widths


@dataclass
class PlanContext:
    """The run as the plan sees it, before anything loads."""

    cfg: Any  # TrainConfig (its kind's options: cfg.options)
    target_cfg: Any  # the target's transformers config
    tw: Widths  # the target's widths
    draft_vocab: int  # the draft head's ids (the kept ones, or the whole vocabulary)
    half: bool  # mixed precision bf16 / fp16
    target_dtype: torch.dtype
    top_n: int  # an offline teacher's stored n
    stored_topn: bool  # the data stage stored top-n log-probs
    devices: int
    data: Any = None  # the recipe's data section (a DataConfig), when known

    @property
    def tbytes(self) -> int:
        return torch.finfo(self.target_dtype).bits // 8

    @property
    def forward_rows(self) -> int:
        """Rows one forward and backward holds: the micro-batch's, or as many max_length rows as slice_tokens
        allows (train/slices.py)."""
        cfg = self.cfg
        if cfg.slice_tokens:
            return min(cfg.per_device_batch_size, max(1, cfg.slice_tokens // cfg.max_length))
        return cfg.per_device_batch_size

    def activation_fix(self, more: str = "") -> str:
        """The fix named when activations are the largest term; `more`: the kind's own lever (", ttt_steps ...")."""
        cfg = self.cfg
        return (f"lower per_device_batch_size (now {cfg.per_device_batch_size}; raise grad_accum_steps to keep the "
                f"global batch), max_length (now {cfg.max_length}){more}; the loss's logits grow with "
                f"draft_vocab_size (now {self.draft_vocab})")


@dataclass
class KindPlan:
    """A kind's part of the plan (train/plan/__init__.py lists the terms)."""

    model: torch.nn.Module  # the draft as the trainer builds it, on the meta device (shapes, requires_grad)
    activation_fix: str  # `PlanContext.activation_fix` with the kind's levers
    heldout: int  # the held-out replay's peak bytes
    step: list[Term] = field(default_factory=list)  # its train-step terms: its inputs, "activations", a teacher's
    resident: list[Term] = field(default_factory=list)  # what it holds throughout beyond the draft and AdamW
    phases: dict[str, list[Term]] = field(default_factory=dict)  # its own phases (a target forward)
    reads: list[Term] = field(default_factory=list)  # what it reads from disk per step, beside memory
    disk_per_token: list[Term] = field(default_factory=list)  # data-stage disk per token (scaled by the plan)
    trainable: int | None = None  # trainable parameters when the meta draft's flags do not say (LoRA)
    frozen_note: str = ""  # what the frozen parameters are
    target_why: str = ""  # why the target is on the device (when cfg.needs_target)
    target_fix: str = ""  # the fix beyond a smaller dtype when the target's weights are the largest term
