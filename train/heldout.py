"""The held-out figures both draft kinds report (train/plain_train.py, train/eagle3_train.py): one set of keys,
pooled over every process's share of the held-out positions.

`alpha` is the expected acceptance at temperature 1; `alpha_at` gives it at each of the run's
`heldout_temperatures` (keys "0.7", "1.0", ...), the draft's and the target's logits both divided by T as the
decoder's sampling does: what a draft served at that temperature can expect per proposal."""

from __future__ import annotations

import math
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


def check_temperatures(temperatures: list[float]) -> None:
    """The `heldout_temperatures` key: each a finite number > 0 (0, greedy, is the agreement figure already)."""
    for t in temperatures:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"heldout_temperatures must list finite temperatures > 0 (e.g. [0.7, 1.0]; greedy is "
                             f"the agreement figure), got {temperatures}")


def temperature_key(temperature: float) -> str:
    """How `alpha_at` names a temperature: "0.7", "1.0"."""
    return str(float(temperature))


def collect_alphas(alpha_at, temperatures, alphas: list, alphas_at: dict[str, list]) -> None:
    """Append one chunk's per-position alphas: temperature 1's to `alphas`, each held-out temperature's to
    `alphas_at` (temperature 1's reused, not recomputed). `alpha_at(temperature=T)` -> [N] tensor."""
    at_one = alpha_at(temperature=1.0).cpu().tolist()
    alphas += at_one
    for t in temperatures:
        alphas_at[temperature_key(t)] += at_one if t == 1.0 else alpha_at(temperature=float(t)).cpu().tolist()


def pooled_at(parts: list[dict], key: str = "alphas_at") -> dict[str, list]:
    """Every process's per-temperature lists (`evaluate_part`'s `alphas_at`), joined in process order."""
    out: dict[str, list] = {}
    for part in parts:
        for name, values in part.get(key, {}).items():
            out.setdefault(name, []).extend(values)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def heldout_figures(alphas: list[float], agreements: list[bool], tau: dict, ranks: list,
                    alpha_is_lower_bound: bool, alphas_at: dict[str, list] | None = None) -> dict[str, Any]:
    """The trainer's held-out figures: mean alpha, greedy agreement over `agreements` (one per position), tau(k),
    the positions counted, top-n agreement per round position from `ranks` (what a tree would find), and the mean
    alpha at each held-out temperature (`alphas_at`: temperature_key -> per-position alphas)."""
    return {"alpha": _mean(alphas), "alpha_at": {name: _mean(values) for name, values in (alphas_at or {}).items()},
            "agreement": sum(agreements) / max(len(agreements), 1), "tau": tau, "positions": len(agreements),
            "top_n_agreement": top_n_agreement(ranks), "alpha_is_lower_bound": alpha_is_lower_bound}
