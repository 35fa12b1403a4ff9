"""Figures from a serving engine: its Prometheus counters, differenced around a phase, in docs/design.md's
terms, and the client-side timings of a phase's requests."""

from __future__ import annotations

import logging
import re
import time

from specdec.eval import metrics

log = logging.getLogger(__name__)

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text exposition -> {(name, ((label, value), ...)): value}; comments skipped."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


def counters_delta(before: dict, after: dict) -> dict:
    """after - before, per counter (per position for the vector)."""
    return {key: ([a - b for a, b in zip(after[key], before[key])] if isinstance(after[key], list)
                  else after[key] - before[key]) for key in after}


def settled_delta(server, before: dict, k: int, tokens: int, wait: float = 5.0) -> dict:
    """A server's counters after a phase minus before, once they count every token the clients received (an
    engine may update them just after streaming the last chunk)."""
    deadline = time.perf_counter() + wait
    while True:
        delta = counters_delta(before, server.counters(k))
        if delta["generation_tokens"] >= tokens or time.perf_counter() > deadline:
            if delta["generation_tokens"] < tokens:
                log.warning("%s %s: counters saw %d generated tokens, the clients %d", server.engine, server.label,
                            delta["generation_tokens"], tokens)
            return delta
        time.sleep(0.1)


def acceptance(delta: dict, k: int) -> dict:
    """docs/design.md's figures from the differenced counters.

    acceptance rate = accepted / proposed; mean accepted tokens tau = 1 + accepted / drafts (the correction or
    bonus token included); per-position acceptance P(i accepted | < i accepted) = accepted at i / accepted at
    i - 1 (drafts at i = 1). An engine counts a draft's proposals but not per position, so the per-position figure
    (and bonus = drafts with all k accepted) assumes full drafts of k tokens: true for draft models, not always
    for n-gram lookup, which may propose fewer (`full_drafts` says which)."""
    drafts, proposed, accepted = (int(round(delta[n])) for n in ("drafts", "draft_tokens", "accepted"))
    per_pos = [int(round(x)) for x in delta["accepted_per_pos"]]
    previous = [drafts, *per_pos[:-1]]
    full = proposed == k * drafts
    return {
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_tokens": 1.0 + accepted / drafts if drafts else 0.0,
        "per_position_acceptance": [a / p if p else None for a, p in zip(per_pos, previous)],  # None: not reached
        "rounds": drafts, "proposed": proposed, "accepted": accepted,
        "accepted_per_position": per_pos,
        "bonus": per_pos[-1] if full and per_pos else None,
        "corrections": drafts - per_pos[-1] if full and per_pos else None,
        "full_drafts": full,
    }


def phase_metrics(phase) -> dict:
    """Client-side figures of one phase (eval/engine/sweep.py's Phase): what users see."""
    ok = [r for r in phase.requests if not r.error]
    ttfts, itls, tpots = [], [], []
    for r in ok:
        ttft, itl = metrics.ttft_and_itl(r.marks)
        if ttft is not None:
            ttfts.append(ttft)
            if len(r.tokens) > 1:
                tpots.append((r.latency - ttft) / (len(r.tokens) - 1))
        itls += itl
    tokens = sum(len(r.tokens) for r in ok)
    return {
        "mode": phase.mode, "concurrency": phase.concurrency, "requests": len(phase.requests),
        "completed": len(ok), "failed": len(phase.requests) - len(ok),
        "errors": sorted({r.error for r in phase.requests if r.error})[:5],
        "seconds": phase.seconds, "tokens": tokens,
        "tokens_per_s": metrics.tokens_per_second(tokens, phase.seconds),
        "requests_per_s": len(ok) / phase.seconds if phase.seconds > 0 else 0.0,
        "latency_s": metrics.percentiles([r.latency for r in ok], (50, 95, 99)),
        "ttft_s": metrics.percentiles(ttfts, (50, 95)),
        "itl_s": metrics.percentiles(itls, (50, 95)),
        "tpot_s": metrics.percentiles(tpots, (50, 95)),
    }
