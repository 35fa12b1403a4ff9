"""The trainer's optimizer and learning-rate schedule, from the recipe (`optimizer`, `lr_schedule`).

- `adamw`: AdamW over every trainable parameter.
- `muon`: torch's Muon over the 2-D weight matrices of the layers (it orthogonalises each update; Keller Jordan's
  Muon, as speculators' trainer offers it), AdamW over the rest (norms, and the embedding and head matrices, which
  Muon's authors leave to AdamW). Both step together as one optimizer, so accelerate, gradient clipping, the
  schedule and the checkpoints see one object.

The schedule (train/budget.py) is one multiplier of every group's initial learning rate, its end movable by a
time budget.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specdec.train.budget import SCHEDULES

OPTIMIZERS = ("adamw", "muon")
# Matrices Muon leaves to AdamW: the vocabulary's rows (input embeddings, the head).
NOT_MUON = ("embed_tokens", "lm_head", "embed_out", "wte", "output")


class MuonAndAdamW(torch.optim.Optimizer):
    """Muon over `matrices`, AdamW over `others`, stepped as one optimizer. Its param_groups are the two inner
    optimizers' own group dicts, so a scheduler's change of a group's lr reaches the optimizer that uses it."""

    def __init__(self, matrices: list[nn.Parameter], others: list[nn.Parameter], lr: float, weight_decay: float,
                 ):
        self.inner = [torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay,
                                       adjust_lr_fn="match_rms_adamw")] if matrices else []
        if others:
            self.inner.append(torch.optim.AdamW(others, lr=lr, weight_decay=weight_decay))
        # Not Optimizer.__init__: the groups and state live in the inner optimizers.
        self.defaults = {"lr": lr, "weight_decay": weight_decay}
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._optimizer_state_dict_pre_hooks: dict = {}
        self._optimizer_state_dict_post_hooks: dict = {}
        self._optimizer_load_state_dict_pre_hooks: dict = {}
        self._optimizer_load_state_dict_post_hooks: dict = {}
        self._zero_grad_profile_name = "Optimizer.zero_grad#MuonAndAdamW.zero_grad"

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.inner for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self.inner for p, s in optimizer.state.items()}

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for optimizer in self.inner:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.inner:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": [optimizer.state_dict() for optimizer in self.inner]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["inner"]
        if len(saved) != len(self.inner):
            raise ValueError(f"the checkpoint holds {len(saved)} optimizer(s), this run builds {len(self.inner)}: "
                             f"was it trained with another `optimizer` setting?")
        for optimizer, state in zip(self.inner, saved):
            optimizer.load_state_dict(state)


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The trainable parameters: (2-D layer matrices for Muon, the rest for AdamW)."""
    matrices, others = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        vocabulary_rows = any(part in NOT_MUON for part in name.split("."))
        (matrices if param.ndim == 2 and min(param.shape) > 1 and not vocabulary_rows else others).append(param)
    return matrices, others


def build(cfg, model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer over `model`'s trainable parameters and its schedule (warm-up, decay to zero at max_steps)."""
    if cfg.optimizer == "muon":
        optimizer = MuonAndAdamW(*muon_split(model), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    schedule = SCHEDULES[cfg.lr_schedule](cfg.warmup_steps, cfg.max_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
