"""The plan as data and as text: its terms (bytes, what they are, the fix when they are the largest), the check
against the device's memory, and the GiB figures it prints."""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 2**30


@dataclass
class Term:
    """One line of the plan: bytes, what they are, and what to change when they are the largest."""

    name: str
    bytes: float
    detail: str = ""
    fix: str = ""


@dataclass
class Plan:
    """Per device: `resident` terms for the whole run plus the largest phase; reads and disk beside."""

    title: str
    devices: int
    resident: list[Term]
    phases: dict[str, list[Term]]
    reads: list[Term] = field(default_factory=list)
    disk: list[Term] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    memory: int = 0  # the device's bytes the plan is checked against (0: unknown)
    memory_source: str = ""
    # A resident term that another setting removes whole (its fix): a plan that does not fit names it before the
    # largest term when removing it would make the plan fit
    freeable: str = ""

    def phase_total(self, name: str) -> float:
        return sum(t.bytes for t in self.phases[name])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @property
    def total(self) -> float:
        """Bytes per device at the peak."""
        return sum(t.bytes for t in self.resident) + (self.phase_total(self.peak_phase) if self.phases else 0)

    def term(self, name: str) -> Term:
        """A term of the resident set or of any phase, by name."""
        for t in [*self.resident, *(t for terms in self.phases.values() for t in terms)]:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def largest(self) -> Term:
        """The largest term of the peak (resident terms and the peak phase's)."""
        return max([*self.resident, *self.phases.get(self.peak_phase, [])], key=lambda t: t.bytes)

    @property
    def culprit(self) -> Term:
        """The term a refusal names: the freeable one where dropping it would fit, else the largest."""
        if self.freeable and self.memory:
            term = self.term(self.freeable)
            if term.bytes >= self.total - self.memory:
                return term
        return self.largest

    def naming(self, term: Term) -> str:
        """How a refusal introduces `term`."""
        return f"the largest term is {term.name}" if term is self.largest else f"without {term.name} it would fit"

    def fits(self) -> bool:
        return not self.memory or self.total <= self.memory

    def render(self) -> str:
        """The plan as text: one line per term, GiB."""
        lines = [self.title, "  resident (whole run)"]
        lines += [_line(t) for t in self.resident]
        for name in self.phases:
            mark = "  <- peak" if name == self.peak_phase else ""
            lines.append(f"  phase {name}: {gib(self.phase_total(name))}{mark}")
            lines += [_line(t) for t in self.phases[name]]
        verdict = ""
        if self.memory:
            share = self.total / self.memory
            verdict = (f" of {gib(self.memory)} ({self.memory_source}): "
                       f"{'fits' if self.fits() else 'DOES NOT FIT'}, {share:.0%}")
        lines.append(f"  total per device: {gib(self.total)}{verdict}; largest term: {self.largest.name}")
        if self.reads:
            lines.append("  reads")
            lines += [_line(t, unit="rate") for t in self.reads]
        if self.disk:
            lines.append("  disk (data stage)")
            lines += [_line(t) for t in self.disk]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def check(self) -> None:
        """Refuse a plan whose total exceeds the device's memory, naming the term to change (`culprit`) and its fix."""
        if self.fits():
            return
        big = self.culprit
        raise ValueError(
            f"this run needs about {gib(self.total)} per device but {self.memory_source} has {gib(self.memory)}: "
            f"{self.naming(big)} ({gib(big.bytes)}{', ' + big.detail if big.detail else ''}). "
            f"{big.fix or 'Use a device with more memory.'} (`specdec train --plan --config ...` prints the plan; "
            f"plan_device_gb=N checks against N GiB instead.)")


def gib(n: float) -> str:
    """Bytes as GiB (MiB below one GiB, so small runs read too)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def short_count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


def _line(t: Term, unit: str = "bytes") -> str:
    value = t.detail if unit == "rate" else gib(t.bytes)
    extra = f"  ({t.detail})" if t.detail and unit != "rate" else ""
    return f"    {t.name:<34} {value}{extra}"
