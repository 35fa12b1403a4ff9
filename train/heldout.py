"""The held-out figures both draft kinds report (train/plain_train.py, train/eagle3_train.py): one set of keys,
pooled over every process's share of the held-out positions."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from specdec.replay import top_n_agreement


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` in eval mode for the block, then back in the mode it was in (even when the block raises)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def pooled(parts: list[dict[str, list]], key: str) -> list:
    """Every process's `key` list (`evaluate_part`'s output), joined in process order."""
    return [item for part in parts for item in part[key]]


def heldout_figures(alphas: list[float], agreements: list[bool], tau: dict, ranks: list,
                    alpha_is_lower_bound: bool) -> dict[str, Any]:
    """The trainer's held-out figures: mean alpha, greedy agreement over `agreements` (one per position), tau(k),
    the positions counted, top-n agreement per round position from `ranks` (what a tree would find)."""
    return {"alpha": sum(alphas) / len(alphas) if alphas else float("nan"),
            "agreement": sum(agreements) / max(len(agreements), 1), "tau": tau, "positions": len(agreements),
            "top_n_agreement": top_n_agreement(ranks), "alpha_is_lower_bound": alpha_is_lower_bound}
