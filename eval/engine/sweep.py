"""The sweep: every (mode, concurrency level) phase of one workload across an engine's servers, never losing a
finished phase when a server fails.

Side by side (`Plan.side_by_side`), all servers run at once, idle but one, and the order of the modes alternates
from level to level, as the decoder eval alternates target-only and speculative calls; otherwise one server at a
time (on a GPU each server claims most of the device's memory).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from specdec.eval.engine.client import Request
from specdec.eval.engine.metrics import settled_delta
from specdec.eval.engine.probe import FirstTwo, draw_first_two
from specdec.eval.engine.server import EngineError, Server, ServerDied, running

log = logging.getLogger(__name__)

TARGET_ONLY = "target-only"


@dataclass
class Plan:
    """What an engine settled before anything is measured (ServingEngine.prepare)."""

    methods: list[str]  # the speculative methods, the primary (the draft's) first
    dtype: str  # as the engine spells it
    version: str
    distribution: str
    python: str  # the engine's interpreter
    side_by_side: bool  # servers at once, alternating, or one at a time
    startup_timeout: float  # seconds for a server to become healthy
    request_timeout: float  # seconds for one streamed completion
    details: object = None  # the engine's own (vLLM: its Install)


@dataclass
class ServedWorkload:
    """What every server is asked, identically."""

    prompts: list[list[int]]  # token ids, encoded as specdec's own eval encodes them
    body: dict  # the request's sampling fields (client.request_body)
    seeds: list[int] | None  # one per prompt when sampling
    levels: list[int]  # concurrency levels, ascending
    warmup: int  # untimed passes per server
    k: int  # draft tokens per round
    seed: int  # the run's seed (the sampling check's seeds derive from it)


@dataclass
class Phase:
    """One measured (mode, concurrency level): every prompt sent by `concurrency` closed-loop clients."""

    mode: str
    concurrency: int
    requests: list[Request]
    seconds: float
    counters: dict | None = None  # differenced server counters

    @property
    def failed(self) -> list[Request]:
        return [r for r in self.requests if r.error]


def _died(server: Server, what: str, phase: Phase) -> ServerDied:
    err = ServerDied(server.failure(f"{what} (exit code {server.proc.returncode})"))
    err.phase = phase
    return err


def measure_phase(server: Server, concurrency: int, work: ServedWorkload, timeout: float, progress=None) -> Phase:
    """One measured phase of the server's mode; ServerDied when the server went away during it (the requests so
    far are attached)."""
    mode = server.label
    try:
        before = server.counters(work.k)
    except OSError as err:
        if server.alive():
            raise EngineError(f"{server.engine} {mode} server does not answer /metrics: {err}") from err
        raise _died(server, f"died before its {mode} phase at concurrency {concurrency}",
                    Phase(mode, concurrency, [], 0.0)) from err
    requests, seconds = server.generate(work.prompts, work.body, concurrency, timeout, work.seeds, progress)
    phase = Phase(mode, concurrency, requests, seconds)
    if phase.failed and not server.alive():
        raise _died(server, f"died during the {mode} phase at concurrency {concurrency}", phase)
    if server.alive():
        phase.counters = settled_delta(server, before, work.k, sum(len(r.tokens) for r in requests))
    return phase


def warm_up(server: Server, prompts: Sequence[list[int]], body: dict, concurrency: int, passes: int,
            timeout: float) -> None:
    """Untimed passes before the measured ones (their counters are differenced away)."""
    for _ in range(passes):
        reqs, _ = server.generate(prompts, body, concurrency, timeout)
        bad = [r.error for r in reqs if r.error]
        if bad:
            if not server.alive():
                raise EngineError(server.failure("died during warm-up"))
            # An engine that crashed inside keeps its API process up: its log says why.
            raise EngineError(server.failure(f"failed {len(bad)} warm-up request(s) ({bad[0]})"))


def _order(modes: list[str], levels: list[int]):
    """(mode, level) in measuring order: the modes' order reversed at every other level."""
    for li, c in enumerate(levels):
        for mode in (modes if li % 2 == 0 else modes[::-1]):
            yield mode, c


def _measure_one(server: Server, c: int, work: ServedWorkload, timeout: float, result: dict, dead: set[str],
                 bar) -> None:
    """One phase into `result`: its figures, or what is missing and why (a dead server stays dead)."""
    mode = server.label
    if mode in dead:
        result["missing"].append(f"{mode} at concurrency {c}")
        return
    try:
        phase = measure_phase(server, c, work, timeout, bar)
    except ServerDied as err:
        dead.add(mode)
        result["errors"].append({"mode": mode, "concurrency": c, "error": str(err)})
        result["missing"].append(f"{mode} at concurrency {c}")
        phase = err.phase
        log.error("%s", err)
    if phase.failed:
        result["errors"].append({"mode": mode, "concurrency": c,
                                 "error": f"{len(phase.failed)} of {len(phase.requests)} requests failed: "
                                          f"{phase.failed[0].error}"})
        if mode not in dead:
            result["missing"].append(f"{mode} at concurrency {c} (in part)")
    if phase.requests:
        result["phases"].append(phase)


def _measure_group(group: dict[str, Server], plan: Plan, work: ServedWorkload, result: dict, bar,
                   probe: FirstTwo | None, sampling) -> None:
    """Start these servers together, warm each up, measure every (mode, level), draw the sampling check, stop."""
    dead: set[str] = set()
    top = max(work.levels)
    warm = work.prompts[: max(1, min(len(work.prompts), top))]
    with running(list(group.values()), plan.startup_timeout):
        for server in group.values():
            warm_up(server, warm, work.body, top, work.warmup, plan.request_timeout)
        for mode, c in _order(list(group), work.levels):
            _measure_one(group[mode], c, work, plan.request_timeout, result, dead, bar)
        for mode, server in group.items():
            if probe is not None and mode not in dead:
                result["draws"][mode] = draw_first_two(server, probe, sampling, top, plan.request_timeout,
                                                       work.seed, work.k)
        for mode, server in group.items():
            result["servers"][mode] = server.summary()


def run_sweep(servers: dict[str, Server], plan: Plan, work: ServedWorkload, probe: FirstTwo | None = None,
              sampling=None) -> dict:
    """Every (mode, level) phase over `servers` (mode -> not yet started); returns {"phases", "servers",
    "errors", "missing", "draws", "side_by_side"} and, after a start-up failure, "fatal". With a probe
    (sampling), each server then draws the probe's first two tokens for the sampling check."""
    result: dict = {"phases": [], "servers": {}, "errors": [], "missing": [], "draws": {},
                    "side_by_side": plan.side_by_side}
    modes = list(servers)
    groups = [modes] if plan.side_by_side else [[m] for m in modes]
    name = next(iter(servers.values())).key_prefix.rstrip("_") if servers else "engine"
    bar = tqdm(total=len(modes) * len(work.levels) * len(work.prompts), desc=name or "engine", unit="request")
    try:
        for group in groups:
            _measure_group({m: servers[m] for m in group}, plan, work, result, bar, probe, sampling)
    except EngineError as err:
        # A start-up failure (or warm-up) before any phase of these servers: what finished so far stays.
        result["errors"].append({"mode": None, "concurrency": None, "error": str(err)})
        done = {(p.mode, p.concurrency) for p in result["phases"]}
        result["missing"] += [f"{m} at concurrency {c}" for m in modes for c in work.levels if (m, c) not in done
                              and f"{m} at concurrency {c}" not in result["missing"]]
        result["fatal"] = err
    finally:
        bar.close()
    return result
