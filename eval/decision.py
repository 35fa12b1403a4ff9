"""The enable / keep-target-only decision: thresholds fixed in the config before the run, all must hold."""

from __future__ import annotations

from dataclasses import dataclass

ENABLE = "enable"
KEEP = "keep-target-only"


@dataclass(frozen=True)
class Thresholds:
    """Decision thresholds; memory overhead is allowed up to the draft's weights times (1 + max_memory_overhead)."""

    min_acceptance_rate: float = 0.5
    min_speedup: float = 1.1
    max_memory_overhead: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError(f"min_acceptance_rate must be within [0, 1], got {self.min_acceptance_rate}")
        if self.min_speedup <= 0:
            raise ValueError(f"min_speedup must be > 0, got {self.min_speedup}")
        if self.max_memory_overhead < 0:
            raise ValueError(f"max_memory_overhead must be >= 0 (a fraction of the draft's size), got {self.max_memory_overhead}")


def decide(
    acceptance_rate: float,
    speedup: float,
    equivalence_passed: bool | None,
    memory_overhead_mb: float,
    draft_weights_mb: float,
    thresholds: Thresholds = Thresholds(),
    fallback: bool = False,
) -> dict:
    """{"verdict": "enable" | "keep-target-only", "reasons": [...], "checks": {...}}; one reason per check."""
    memory_limit = draft_weights_mb * (1.0 + thresholds.max_memory_overhead)
    checks = {
        "acceptance_rate": acceptance_rate >= thresholds.min_acceptance_rate,
        "speedup": speedup >= thresholds.min_speedup,
        "equivalence": equivalence_passed is True,
        "memory": memory_overhead_mb <= memory_limit,
        "no_fallback": not fallback,
    }
    ok = {True: "ok", False: "FAILS"}
    reasons = [
        f"acceptance rate {acceptance_rate:.3f} {'>=' if checks['acceptance_rate'] else '<'} "
        f"{thresholds.min_acceptance_rate:.3f} ({ok[checks['acceptance_rate']]})",
        f"speedup {speedup:.3f}x {'>=' if checks['speedup'] else '<'} {thresholds.min_speedup:.3f}x "
        f"({ok[checks['speedup']]})",
        "equivalence " + ("passed (ok)" if equivalence_passed else
                          "not checked (FAILS: it must pass)" if equivalence_passed is None else "failed (FAILS)"),
        f"memory overhead {memory_overhead_mb:.1f} MB {'<=' if checks['memory'] else '>'} {memory_limit:.1f} MB "
        f"= draft memory {draft_weights_mb:.1f} MB + {thresholds.max_memory_overhead:.0%} ({ok[checks['memory']]})",
    ]
    if fallback:
        reasons.append("the draft failed during decoding and the decoder fell back to target-only (FAILS)")
    verdict = ENABLE if all(checks.values()) else KEEP
    return {"verdict": verdict, "reasons": reasons, "checks": checks}
