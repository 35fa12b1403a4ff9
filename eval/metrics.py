"""Pure metric functions over measured numbers: percentiles, TTFT/ITL, throughput, speedup, the analytic model.

Nothing here touches a model or a clock, so every function is unit-tested with known values.

The analytic speedup follows Leviathan et al. (2022), generalised to position-dependent acceptance and a
verification cost that is not one target step:

    tau_hat   = 1 + sum_{i=1..k} prod_{j<=i} a_j      expected tokens per round (a_j = per-position acceptance)
    speedup   = tau_hat / (k * c + v)                  c = draft step / target step, v = verify(k+1) / target step

With a_j = alpha for all j and v = 1 this is the paper's (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)).
"""

from __future__ import annotations

import math
import os
import platform
import sys
from collections.abc import Sequence

import torch
import transformers

from specdec.tokens import generated_length


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics; None when empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    data = sorted(float(v) for v in values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 95, 99)) -> dict[str, float | None]:
    """{"p50": ..., "p95": ...} for the given percentiles."""
    return {f"p{q}": percentile(values, q) for q in qs}


def ttft_and_itl(timings: Sequence[tuple[float, int]]) -> tuple[float | None, list[float]]:
    """Time to first token and inter-token latencies from a decoder's (seconds, tokens appended) marks.

    A step that appends n tokens after a gap of dt contributes n latencies of dt / n: a speculative round that
    emits three tokens at once counts as three tokens each dt / 3 apart, which makes ITL comparable between
    modes (its percentiles are over tokens, not steps).
    """
    if not timings:
        return None, []
    ttft = float(timings[0][0])
    itl: list[float] = []
    for (t_prev, _), (t_now, n) in zip(timings, timings[1:]):
        if n > 0:
            itl.extend([(t_now - t_prev) / n] * n)
    return ttft, itl


def tokens_per_second(tokens: int, seconds: float) -> float:
    """Generated tokens over wall time (0.0 for no time)."""
    return tokens / seconds if seconds > 0 else 0.0


def speedup(baseline_seconds: float, speculative_seconds: float) -> float:
    """Baseline wall time over speculative wall time on the same workload (>1 means faster)."""
    if speculative_seconds <= 0:
        raise ValueError("speculative wall time must be positive")
    return baseline_seconds / speculative_seconds


def expected_tokens_per_round(per_position_acceptance: Sequence[float]) -> float:
    """tau_hat = 1 + sum_i prod_{j<=i} a_j: accepted draft tokens plus the correction or bonus token."""
    total, run = 1.0, 1.0
    for a in per_position_acceptance:
        run *= float(a)
        total += run
    return total


def analytical_speedup(per_position_acceptance: Sequence[float], draft_cost: float, verify_cost: float = 1.0) -> float:
    """tau_hat / (k * c + v): c = draft step over target step, v = verifying k+1 tokens over a target step."""
    k = len(per_position_acceptance)
    if k == 0:
        raise ValueError("per_position_acceptance must have k >= 1 entries")
    if draft_cost < 0 or verify_cost <= 0:
        raise ValueError("draft_cost must be >= 0 and verify_cost > 0")
    return expected_tokens_per_round(per_position_acceptance) / (k * draft_cost + verify_cost)


def leviathan_speedup(alpha: float, k: int, c: float) -> float:
    """The paper's closed form for constant acceptance alpha and verify cost 1: (1-a^(k+1)) / ((1-a)(kc+1))."""
    if alpha >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted values and their empirical cumulative probabilities i/n, for plotting."""
    data = sorted(float(v) for v in values)
    n = len(data)
    return data, [(i + 1) / n for i in range(n)]


def memory_overhead_mb(baseline_peaks_mb: Sequence[float], speculative_peaks_mb: Sequence[float],
                       draft_weights_mb: float) -> float:
    """Memory that speculative decoding adds over target-only serving, from the peaks of paired calls (the two
    modes on the same prompts): the largest difference, plus the draft's weights.

    Comparing the two modes' overall peaks instead would hide what speculation adds on short prompts whenever
    a long prompt set the baseline's peak; the largest paired difference never reads lower. Both modes run in
    one process with the draft loaded, so the baseline peak already holds the draft's weights; target-only
    serving would not, hence they are added back.
    """
    if len(baseline_peaks_mb) != len(speculative_peaks_mb) or not baseline_peaks_mb:
        raise ValueError("memory_overhead_mb needs one speculative peak per baseline peak, at least one pair")
    largest = max(s - b for b, s in zip(baseline_peaks_mb, speculative_peaks_mb))
    return max(0.0, largest) + draft_weights_mb


def generated_lengths(rows: Sequence[Sequence[int]], eos_token_id: int | Sequence[int] | None) -> list[int]:
    """Real generated tokens per row: up to and including the first EOS (the rest is padding)."""
    return [generated_length(row, eos_token_id) for row in rows]


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two token lists differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def environment(device: torch.device) -> dict:
    """What a report's figures were measured on: versions, device, threads, platform."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "device": f"{device.type} ({name})", "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "platform": platform.platform()}
