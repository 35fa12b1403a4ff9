"""Equivalence of speculative and target-only output on the eval workload.

Greedy (temperature 0): every prompt's speculative tokens must equal the baseline's, token for token.
Sampling: two independent samples differ by design, so a token match means nothing; the report says so and
points to `specdec verify`, and carries the result of a short distribution check on the user's pair.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.eval.metrics import first_mismatch

SAMPLING_NOTE = (
    "Under sampling a token-by-token match is meaningless (two samples of one distribution differ). "
    "The check here is a short chi-square test of the first two generated tokens against the target's exact "
    "distribution; run `specdec verify` (tiny pair, many samples) or `specdec verify --target T --draft D "
    "--prompts FILE` for the thorough distribution check."
)


def greedy_equivalence(
    prompt_ids: Sequence[str], baseline: Sequence[Sequence[int]], speculative: Sequence[Sequence[int]], limit: int = 20
) -> dict:
    """Token-identity of each prompt's outputs; mismatches listed with their first differing position."""
    if not (len(prompt_ids) == len(baseline) == len(speculative)):
        raise ValueError("prompt_ids, baseline and speculative must have one entry per prompt")
    details = []
    for pid, base, spec in zip(prompt_ids, baseline, speculative):
        pos = first_mismatch(base, spec)
        if pos is not None:
            details.append({
                "prompt_id": pid,
                "position": pos,
                "baseline_token": base[pos] if pos < len(base) else None,
                "speculative_token": spec[pos] if pos < len(spec) else None,
            })
    return {
        "mode": "greedy",
        "passed": not details,
        "checked": len(prompt_ids),
        "mismatches": len(details),
        "mismatched_prompts": details[:limit],
    }


def sampling_equivalence(check: dict | None) -> dict:
    """The report's equivalence entry under sampling, from a `specdec.eval.verify` result (None when not run)."""
    if check is None:
        return {"mode": "sampling", "passed": None, "checked": 0, "mismatches": 0, "note": SAMPLING_NOTE}
    failed = [t for t in check["tests"] if not t["passed"]]
    return {
        "mode": "sampling",
        "passed": bool(check["passed"]),
        "checked": int(sum(t["samples"] for t in check["tests"])),
        "mismatches": len(failed),
        "tests": check["tests"],
        "note": SAMPLING_NOTE,
    }
