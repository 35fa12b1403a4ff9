"""The registry of draft kinds' training sides (train/kinds/base.py: `TrainingKind`), by the core kind's name, with
plain and EAGLE-3 registered.

    register(kind)          add a kind (its name must be new); unregister(name) removes it again
    get(name) / names()     a kind by its registered name; every name
    for_recipe(draft)       the kind a recipe's `draft:` value trains (specdec/draft_registry.py: for_recipe)
    check(cfg)              a TrainConfig against its kind's `TrainingFacts`

The core kind (specdec/draft_registry.py) decodes, loads and saves a draft; this side trains, plans and describes it.
A kind that trains registers both, under one name. The core package never imports this one.

    base.py                 the interface: TrainingKind, TrainingFacts, KindOptions, KindRun
    options.py              the kinds' options blocks inside TrainConfig (flat keys or a block named after the kind)
    plain.py, plain_plan.py the plain kind (train/plain_train.py trains it)
    eagle3.py, eagle3_plan.py  EAGLE-3 (train/eagle3_train.py trains it)
"""

from __future__ import annotations

from specdec import draft_registry
from specdec.train.kinds.base import KindOptions, KindRun, TrainingFacts, TrainingKind
from specdec.train.kinds.dflash import DFlashTrainingKind
from specdec.train.kinds.eagle3 import Eagle3TrainingKind, PEagleTrainingKind
from specdec.train.kinds.parallel import ParallelTrainingKind
from specdec.train.kinds.plain import PlainTrainingKind

__all__ = ["KindOptions", "KindRun", "TrainingFacts", "TrainingKind", "check", "for_recipe", "get", "names",
           "register", "unregister"]

_KINDS: dict[str, TrainingKind] = {}
PLAIN = PlainTrainingKind()


def register(kind: TrainingKind) -> TrainingKind:
    """Add `kind` under `kind.name` (the core kind's name); returns it."""
    if kind.name in _KINDS:
        raise ValueError(f"a training kind named {kind.name!r} is registered already")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    if name == PLAIN.name:
        raise ValueError("the plain kind trains every draft no other kind claims and stays registered")
    _KINDS.pop(name, None)


def names() -> list[str]:
    return list(_KINDS)


def get(name: str) -> TrainingKind:
    if name not in _KINDS:
        raise ValueError(f"`specdec train` has no training side for {name} drafts: register one with "
                         f"specdec.train.kinds.register (registered: {', '.join(_KINDS)})")
    return _KINDS[name]


def for_recipe(draft: str) -> TrainingKind:
    """The kind `draft: VALUE` trains: a registered kind's name, else plain (derived, scratch, a model id or path);
    a retired value says what replaced it."""
    return get(draft_registry.for_recipe(draft).name)


def check(cfg) -> None:
    """A TrainConfig against its draft kind's training facts."""
    facts, name = for_recipe(cfg.draft).facts, f"draft={cfg.draft}"

    def kinds_with(fact: str) -> str:
        return "draft=" + " or ".join(n for n in _KINDS if getattr(_KINDS[n].facts, fact))

    if cfg.teacher not in facts.teachers:
        raise ValueError(f"{name} trains with teacher={' or '.join(facts.teachers)}, not {cfg.teacher}")
    if cfg.lora and not facts.lora:
        raise ValueError(f"{name} is a new small module: train it fully (lora=false)")
    if cfg.pack and not facts.packing:
        raise ValueError(f"pack=true is for {kinds_with('packing')} ({name}'s attention would cross the packed "
                         "samples' boundaries)")
    if cfg.slice_tokens and not facts.row_slices:
        raise ValueError(f"slice_tokens is for {kinds_with('row_slices')} ({name}'s loss is each micro-batch's own "
                         "mean, which slices would change): set slice_tokens=0 and bound memory with "
                         "per_device_batch_size and grad_accum_steps")


register(PLAIN)
register(Eagle3TrainingKind())
register(PEagleTrainingKind())
register(ParallelTrainingKind())
register(DFlashTrainingKind())
