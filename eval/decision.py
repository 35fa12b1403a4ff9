"""The enable / keep-target-only decision: thresholds fixed in the config before the run, all must hold.

The same thresholds pick among candidates (choose_k's proposals, the sweep's configurations): the fastest one that
passes every gate its figures can be held to, and the fastest overall only when none passes (`prefer_passing`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

ENABLE = "enable"
KEEP = "keep-target-only"

T = TypeVar("T", bound=Hashable)


@dataclass(frozen=True)
class Thresholds:
    """Decision thresholds; the draft's accounted memory may add up to max_memory_overhead of target-only's."""

    min_acceptance_rate: float = 0.5
    min_speedup: float = 1.1
    max_memory_overhead: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError(f"min_acceptance_rate must be within [0, 1], got {self.min_acceptance_rate}")
        if self.min_speedup <= 0:
            raise ValueError(f"min_speedup must be > 0, got {self.min_speedup}")
        if self.max_memory_overhead < 0:
            raise ValueError(f"max_memory_overhead must be >= 0 (a fraction of target-only memory, e.g. 0.2), "
                             f"got {self.max_memory_overhead}")

    def memory_limit_mb(self, target_only_mb: float) -> float:
        """The memory the draft may add: a fraction of what target-only decoding holds (eval/memory.py)."""
        return target_only_mb * self.max_memory_overhead


def threshold_checks(acceptance_rate: float, speedup: float, memory_overhead_mb: float, target_only_mb: float,
                     thresholds: Thresholds) -> dict[str, bool]:
    """The gates a figure can be held to, measured or predicted: {"acceptance_rate", "speedup", "memory": ok}."""
    return {"acceptance_rate": acceptance_rate >= thresholds.min_acceptance_rate,
            "speedup": speedup >= thresholds.min_speedup,
            "memory": memory_overhead_mb <= thresholds.memory_limit_mb(target_only_mb)}


def failed_gates(checks: dict[str, bool]) -> list[str]:
    """The names of the checks that fail, in the checks' order."""
    return [name for name, ok in checks.items() if not ok]


def prefer_passing(candidates: Sequence[T], rank: Callable[[T], object], failed: dict[T, list[str]]) -> tuple[T, T]:
    """(chosen, fastest): the candidate of lowest `rank` among those that fail no gate, and the lowest overall.

    The fastest overall is chosen only when no candidate passes; the verdict then keeps the target."""
    fastest = min(candidates, key=rank)
    passing = [c for c in candidates if not failed[c]]
    return (min(passing, key=rank) if passing else fastest), fastest


def decide(
    acceptance_rate: float,
    speedup: float,
    equivalence_passed: bool | None,
    memory_overhead_mb: float,
    target_only_mb: float,
    thresholds: Thresholds = Thresholds(),
    fallback: bool = False,
) -> dict:
    """{"verdict", "reasons", "checks", "failed_gates"}; one reason per check, the fallback's only when it happened.

    memory_overhead_mb is the draft's accounted memory, target_only_mb what target-only decoding holds
    (eval/memory.py): the draft passes when it adds at most thresholds.max_memory_overhead of it."""
    gates = threshold_checks(acceptance_rate, speedup, memory_overhead_mb, target_only_mb, thresholds)
    checks = {"acceptance_rate": gates["acceptance_rate"], "speedup": gates["speedup"],
              "equivalence": equivalence_passed is True, "memory": gates["memory"], "no_fallback": not fallback}
    ok = {True: "ok", False: "FAILS"}
    limit = thresholds.memory_limit_mb(target_only_mb)
    reasons = [
        f"acceptance rate {acceptance_rate:.3f} {'>=' if checks['acceptance_rate'] else '<'} "
        f"{thresholds.min_acceptance_rate:.3f} ({ok[checks['acceptance_rate']]})",
        f"speedup {speedup:.3f}x {'>=' if checks['speedup'] else '<'} {thresholds.min_speedup:.3f}x "
        f"({ok[checks['speedup']]})",
        "equivalence " + ("passed (ok)" if equivalence_passed else
                          "not checked (FAILS: it must pass)" if equivalence_passed is None else "failed (FAILS)"),
        f"memory overhead {memory_overhead_mb:.1f} MB {'<=' if checks['memory'] else '>'} {limit:.1f} MB "
        f"= {thresholds.max_memory_overhead:.0%} of target-only {target_only_mb:.1f} MB, both accounted "
        f"({ok[checks['memory']]})",
    ]
    if fallback:
        reasons.append("the draft failed during decoding and the decoder fell back to target-only (FAILS)")
    verdict = ENABLE if all(checks.values()) else KEEP
    return {"verdict": verdict, "reasons": reasons, "checks": checks, "failed_gates": failed_gates(checks)}
