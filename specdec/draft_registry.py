"""The registry of draft kinds (specdec/draft_kind.py's interface), by name, with plain and EAGLE-3 registered.

    register(kind)              add a kind (its name must be new); unregister(name) removes it again
    get(name) / names()         a kind by its registered name; every name
    of_config(config)           the kind of a checkpoint's config.json (plain when no other kind recognises it)
    of_checkpoint(path)         the same for a local folder (plain when it has no config.json)
    of_model(model)             the kind of a loaded draft (plain when no other kind owns it)
    for_recipe(draft)           the kind a recipe's `draft:` value trains (a registered name, else plain)
    make_drafter(draft, ...)    the decoder's side of a draft, from its kind
    check_fits(draft, target)   ValueError when a loaded draft cannot read this target (a kind's optional
                                `check_target`: EAGLE-3's vocabulary, width and layers), before any forward

The plain kind is the fallback and is asked last; the others in the order they were registered. Layouts of earlier
specdec versions that no kind reads any more get an error that says what to do instead (`RETIRED`).
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.dflash.kind import DFlashKind
from specdec.draft_kind import DraftKind
from specdec.eagle3.kind import Eagle3Kind, PEagleKind
from specdec.parallel_draft import ParallelKind
from specdec.plain_draft import PlainKind
from specdec.sampling import SamplingConfig

_KINDS: dict[str, DraftKind] = {}
PLAIN = PlainKind()

# Retired layouts: the config.json key that marks one, the recipe's `draft:` value that built one, and the fix.
RETIRED = {
    "specdec_feature_draft": (
        "feature",
        "a feature draft in specdec's earlier layout (draft: feature), which no engine serves and this version no "
        "longer decodes or trains. Its one layer read other inputs, so it cannot be converted exactly: it is "
        "replaced by draft: eagle3; retrain it as an EAGLE-3 draft, e.g. `specdec train --config "
        "recipes/smollm2-135m-eagle3.yaml` (the data stage's recorded features are reused)"),
}


def register(kind: DraftKind) -> DraftKind:
    """Add `kind` under `kind.name`; returns it."""
    if kind.name in _KINDS:
        raise ValueError(f"a draft kind named {kind.name!r} is registered already")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    if name == PLAIN.name:
        raise ValueError("the plain kind is the registry's fallback and stays registered")
    _KINDS.pop(name, None)


def names() -> list[str]:
    return list(_KINDS)


def get(name: str) -> DraftKind:
    if name not in _KINDS:
        raise ValueError(f"no draft kind named {name!r}; registered: {', '.join(_KINDS)}")
    return _KINDS[name]


def _others() -> list[DraftKind]:
    return [kind for kind in _KINDS.values() if kind is not PLAIN]


def check_not_retired(config: dict, where: str) -> None:
    """ValueError with the fix when `config` is a retired specdec layout."""
    for key, (_, fix) in RETIRED.items():
        if config.get(key):
            raise ValueError(f"{where} is {fix}")


def of_config(config: dict, where: str = "this checkpoint") -> DraftKind:
    check_not_retired(config, where)
    return next((kind for kind in _others() if kind.recognises(config)), PLAIN)


def of_checkpoint(path: str | Path) -> DraftKind:
    file = Path(path) / "config.json"
    return of_config(json.loads(file.read_text()), str(path)) if file.is_file() else PLAIN


def of_model(model) -> DraftKind:
    return next((kind for kind in _others() if kind.owns(model)), PLAIN)


def for_recipe(draft: str) -> DraftKind:
    """The kind `draft: VALUE` trains: a registered kind's name, else plain (derived, scratch, a model id or path)."""
    for _, (value, fix) in RETIRED.items():
        if draft == value:
            raise ValueError(f"draft: {draft} is {fix}")
    return _KINDS[draft] if draft in _KINDS else PLAIN


def check_fits(draft, target, name: str = "the draft", target_name: str = "the target") -> None:
    """ValueError naming both sizes when `draft` cannot read `target`; kinds without a `check_target` (plain) rely on
    specdec/compat.py's tokenizer check alone."""
    check = getattr(of_model(draft), "check_target", None)
    if check is not None:
        check(draft, target, name, target_name)


def make_drafter(draft, target, sampling: SamplingConfig):
    """The drafter of `draft` (specdec/drafter.py's interface), from its kind."""
    return of_model(draft).drafter(draft, target, sampling)


register(PLAIN)
register(Eagle3Kind())
register(DFlashKind())
register(PEagleKind())
register(ParallelKind())
