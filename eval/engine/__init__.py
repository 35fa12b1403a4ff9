"""Serving engines: where a draft is measured beside (or instead of) specdec's own decoder, across a process
boundary, through the engine's real server.

    specdec eval --target T --draft D engine=vllm concurrency=1,4,16 vllm_ngram=true --out DIR
    specdec eval --target T --draft D engine=specdec,vllm --out DIR        # both, side by side

An engine implements `ServingEngine` in its own module and is listed in `ENGINES` below; `specdec eval` finds it
by the name in `engine=`. Its keys (`vllm_*` for vLLM) live in its `options` dataclass, which EvalConfig takes as
its own fields, so recipes and the command line write them flat (`vllm_ngram=true`). The rest is shared: the
server process (server.py), the HTTP client (client.py), counters and timings (metrics.py), the sweep over modes
and concurrency levels (sweep.py), the sampling check (probe.py), the report's engine section (report.py,
markdown.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from specdec.eval.engine import vllm
from specdec.eval.engine.client import Request
from specdec.eval.engine.server import EngineError, ServerDied
from specdec.eval.engine.sweep import TARGET_ONLY, Plan

DECODER = "specdec"  # specdec's own decoder, in this process: `engine=specdec`


class EngineServer(Protocol):
    """One server of an engine in one mode (target-only or a speculative method); server.Server is the base."""

    label: str  # the mode
    engine: str  # the engine's name in messages

    def start(self) -> None: ...
    def poll_ready(self, timeout: float) -> bool: ...
    def alive(self) -> bool: ...
    def generate(self, prompts: Sequence[list[int]], body: dict, concurrency: int, timeout: float,
                 seeds: Sequence[int | None] | None = None, progress=None) -> tuple[list[Request], float]: ...
    def counters(self, k: int) -> dict: ...
    def failure(self, what: str) -> str: ...
    def summary(self) -> dict: ...
    def stop(self) -> None: ...


class ServingEngine(Protocol):
    """What `specdec eval engine=NAME` needs of an engine."""

    name: str  # its name in `engine=`
    label: str  # its name in reports
    options: type  # a dataclass of its keys with defaults; EvalConfig inherits them
    sampling_note: str  # what its API lets the sampling check see (the report quotes it)

    def check(self, cfg) -> None:
        """ValueError naming the fix for a bad key of its own; changes nothing."""

    def needs_draft(self, cfg) -> bool:
        """Whether its run needs --draft (an engine-only reference method may not)."""

    def prepare(self, cfg) -> Plan:
        """Everything checked before anything starts: install, methods, draft compatibility, ports, dtype."""

    def servers(self, cfg, plan: Plan, modes: list[str], k: int, out_dir: Path) -> dict[str, EngineServer]:
        """One server per mode, not started."""

    def report_fields(self, cfg, plan: Plan, k: int) -> dict:
        """Its own settings for the report's engine section."""


# The registry: a new engine is its module plus one entry here.
ENGINES: dict[str, ServingEngine] = {e.name: e for e in (vllm.ENGINE,)}


def option_classes() -> tuple[type, ...]:
    """Every engine's options dataclass (EvalConfig's bases)."""
    return tuple(e.options for e in ENGINES.values())


def get(name: str) -> ServingEngine:
    if name not in ENGINES:
        raise ValueError(f"unknown serving engine {name!r}; registered: {', '.join(ENGINES)}")
    return ENGINES[name]


@dataclass(frozen=True)
class Settings:
    """The engine keys of an EvalConfig, checked and put in order."""

    engine: list[str]  # specdec first, then the serving engine
    concurrency: list[int]  # ascending, distinct


def check_settings(cfg) -> Settings:
    """Check the engine keys of an EvalConfig (each engine's own, whether or not it runs); returns them in order
    and leaves `cfg` as it was."""
    names = (DECODER, *ENGINES)
    unknown = [e for e in cfg.engine if e not in names]
    if not cfg.engine or unknown:
        raise ValueError(f"engine must list {DECODER} and/or {' / '.join(ENGINES)} (e.g. engine={DECODER},"
                         f"{next(iter(ENGINES))}), got {cfg.engine}")
    served = [e for e in ENGINES if e in cfg.engine]
    if len(served) > 1:
        raise ValueError(f"one serving engine per run, got {served}")
    if not cfg.concurrency or min(cfg.concurrency) < 1:
        raise ValueError(f"concurrency must be integers >= 1 (e.g. concurrency=1,4,16), got {cfg.concurrency}")
    for engine in ENGINES.values():
        engine.check(cfg)
    if served and DECODER not in cfg.engine:
        if len(cfg.num_draft_tokens) > 1:
            raise ValueError(f"engine={served[0]} measures one k (a server per speculative config): pass one "
                             f"num_draft_tokens, got {cfg.num_draft_tokens}; or add {DECODER} to engine, whose "
                             "recommended k the engine then uses")
        if cfg.choose_k:
            raise ValueError(f"choose_k picks k with specdec's decoder: use engine={DECODER},{served[0]} with it")
    return Settings([e for e in names if e in cfg.engine], sorted(set(cfg.concurrency)))


def serving(cfg) -> ServingEngine | None:
    """The serving engine `cfg.engine` names, or None (specdec's decoder alone)."""
    return next((ENGINES[e] for e in cfg.engine if e in ENGINES), None)


def needs_draft(cfg) -> bool:
    """Whether the run needs --draft: always for specdec's decoder, else as its serving engine says."""
    engine = serving(cfg)
    return DECODER in cfg.engine or engine is None or engine.needs_draft(cfg)


__all__ = ["DECODER", "ENGINES", "TARGET_ONLY", "EngineError", "EngineServer", "Plan", "ServerDied",
           "ServingEngine", "Settings", "check_settings", "get", "needs_draft", "option_classes", "serving"]
