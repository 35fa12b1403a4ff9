"""How far the run's acceptance rate and speedup could move on other prompts drawn like these: percentile bootstrap
intervals over the run's prompt batches (Efron and Tibshirani, "An Introduction to the Bootstrap", 1993, ch. 13).

The verdict reads the run's own figures against thresholds fixed before it; these intervals say how close that call
was. A run of 24 prompts whose acceptance rate reads 0.47 against a threshold of 0.5 may hold the threshold inside
its interval: another draw of prompts of the same kinds could fall on either side of it.

The resampled unit is the batch of prompts (one prompt at batch size 1): its target-only and speculative calls
decode the same prompts, so a resample keeps each batch's pair together, and both figures are recomputed as the run
computes them, ratios of sums (accepted / proposed draft tokens; target-only seconds / speculative seconds).
"""

from __future__ import annotations

import torch

LEVEL = 0.95  # the intervals' coverage
RESAMPLES = 2000  # resamples of the batches: over 10 seeds of a synthetic 24-prompt run the ends moved by about 0.01 at most


def bootstrap(base_calls: list, spec_calls: list, level: float = LEVEL, resamples: int = RESAMPLES,
              seed: int = 0) -> dict | None:
    """{"level", "resamples", "batches", "acceptance_rate": [low, high], "speedup": [low, high]} from the timed
    calls of one configuration (eval/measure.py: Call), or None with fewer than two batches (nothing to resample)."""
    batches = sorted({tuple(c.rows) for c in spec_calls} & {tuple(c.rows) for c in base_calls})
    if len(batches) < 2:
        return None
    index = {rows: i for i, rows in enumerate(batches)}
    sums = torch.zeros(4, len(batches), dtype=torch.float64)  # accepted, proposed, target-only s, speculative s
    for call in spec_calls:
        i = index.get(tuple(call.rows))
        if i is not None:
            sums[0, i] += call.stats.accepted
            sums[1, i] += call.stats.proposed
            sums[3, i] += call.seconds
    for call in base_calls:
        i = index.get(tuple(call.rows))
        if i is not None:
            sums[2, i] += call.seconds
    draws = torch.randint(len(batches), (resamples, len(batches)), generator=torch.Generator().manual_seed(seed))
    totals = sums[:, draws].sum(-1)  # [4, resamples]
    acceptance = totals[0] / totals[1].clamp(min=1e-12)
    speedup = totals[2] / totals[3].clamp(min=1e-12)
    tails = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    return {"level": level, "resamples": resamples, "batches": len(batches),
            "acceptance_rate": torch.quantile(acceptance, tails).tolist(),
            "speedup": torch.quantile(speedup, tails).tolist()}


def markdown_line(intervals: dict | None, prompts: int) -> list[str]:
    """The report's line under the decision (none without intervals)."""
    if not intervals:
        return []
    acc, speed = intervals["acceptance_rate"], intervals["speedup"]
    return [f"{intervals['level']:.0%} intervals over the {prompts} prompts ({intervals['resamples']} bootstrap "
            f"resamples of their {intervals['batches']} batches, specdec.eval.intervals): acceptance rate "
            f"{acc[0]:.3f}-{acc[1]:.3f}, speedup {speed[0]:.3f}x-{speed[1]:.3f}x. The thresholds are judged on the "
            "run's own figures; a threshold inside an interval means that other prompts of the same kinds could "
            "fall on either side of it.", ""]


def summary_text(intervals: dict | None, key: str, unit: str = "") -> str:
    """', 95% interval a-b over the prompts' for the demo's summary lines, '' without intervals."""
    if not intervals:
        return ""
    low, high = intervals[key]
    digits = 3 if key == "acceptance_rate" else 2
    return f", {intervals['level']:.0%} interval {low:.{digits}f}{unit}-{high:.{digits}f}{unit} over the prompts"
