"""The draft kinds' options blocks inside TrainConfig (train/train_config.py).

Each kind declares its own keys as a dataclass (its `options`, train/kinds/base.py: KindOptions). TrainConfig keeps
one of each registered kind's in `kind_options` (kind name -> options), and takes their keys as a recipe gives them:

    train:                          train:
      ttt_steps: 5          or        eagle3:
                                        ttt_steps: 5

(and `ttt_steps=5` / `eagle3.ttt_steps=5` on the command line, `TrainConfig(ttt_steps=5)` in Python). A flat key
sets every kind's option of that name. A key or block that the recipe's kind does not read is an error naming the
kind that does. `cfg.kind` is the recipe's kind (its training side), `cfg.options` its options; `cfg.ttt_steps` reads that kind's key, else another's.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

from specdec.config import _build
from specdec.train import kinds


@functools.cache
def _fields(options_cls) -> dict[str, Any]:
    """An options dataclass's keys and their types."""
    hints = typing.get_type_hints(options_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(options_cls)}


def extra_config_keys() -> dict[str, Any]:
    """The keys TrainConfig takes beyond its fields, with their types (specdec/config.py reads them): every kind's
    block (a mapping, checked by `merged`) and every kind's keys flat."""
    keys: dict[str, Any] = {}
    for name in kinds.names():
        for key, tp in _fields(kinds.get(name).options).items():
            keys.setdefault(key, tp)
    return {**keys, **{name: dict for name in kinds.names()}}


def _block(name: str, value) -> dict[str, Any]:
    """The keys a kind's block sets: a mapping (a recipe's, coerced and checked against the kind's options) or an
    options object (all of its keys)."""
    options_cls = kinds.get(name).options
    if isinstance(value, options_cls):
        return dataclasses.asdict(value)
    if not isinstance(value, dict):
        raise ValueError(f"train.{name} must be a mapping of {name}'s options, got {value!r}")
    built = _build(options_cls, value, prefix=f"{name}.")
    return {key: getattr(built, key) for key in value}


def merged(existing: dict, given: dict[str, Any], draft: str) -> dict[str, kinds.KindOptions]:
    """Every registered kind's options: `existing` (or the defaults) with the `given` keys (flat or blocks) set."""
    options = {name: existing.get(name) or kinds.get(name).options() for name in kinds.names()}
    changes: dict[str, dict[str, Any]] = {name: {} for name in options}
    blocks = [key for key in given if key in options]
    for name in blocks:
        changes[name].update(_block(name, given[name]))
    for key, value in given.items():
        if key in options:
            continue
        owners = [name for name in options if key in _fields(type(options[name]))]
        if not owners:
            raise TypeError(f"TrainConfig got an unexpected keyword argument {key!r}")
        for name in owners:
            if key in changes[name] and changes[name][key] != value:
                raise ValueError(f"{key} is set both flat and in the train.{name} block; keep one")
            changes[name][key] = value
    options = {name: dataclasses.replace(o, **changes[name]) if changes[name] else o for name, o in options.items()}
    if any(changes.values()):
        _check_owner(options, changes, blocks, draft)
    return options


def _check_owner(options: dict, changes: dict, blocks: list[str], draft: str) -> None:
    """A block, or a key, that the recipe's kind does not read is an error naming the kind that does."""
    own = kinds.for_recipe(draft).name
    for name in blocks:
        if name != own:
            raise ValueError(f"train.{name} is for draft={name}, not draft={draft}; drop it")
    own_keys = _fields(type(options[own]))
    for keys in changes.values():
        for key in keys:
            if key not in own_keys:
                owners = [n for n in options if key in _fields(type(options[n]))]
                raise ValueError(f"{key} is for draft={' or '.join(owners)}, not draft={draft}; drop it")


def takes_kind_options(cls):
    """Class decorator for TrainConfig (a dataclass with `draft` and `kind_options` fields): its constructor takes
    the kinds' keys flat or as blocks (`merged`), `cfg.kind` is its kind's training side and `cfg.options` its options, `cfg.KEY` reads an option."""
    generated, own = cls.__init__, {f.name for f in dataclasses.fields(cls)}
    default_draft = cls.__dataclass_fields__["draft"].default

    @functools.wraps(generated)
    def __init__(self, **values):
        given = {key: values.pop(key) for key in list(values) if key not in own}
        values["kind_options"] = merged(values.get("kind_options") or {}, given, values.get("draft", default_draft))
        generated(self, **values)

    def kind(self):
        """The training side of this config's draft kind (train/kinds/base.py: TrainingKind)."""
        return kinds.for_recipe(self.draft)

    def options(self):
        """The options of this config's draft kind."""
        name = self.kind.name
        return self.kind_options.get(name) or self.kind.options()

    def __getattr__(self, key: str):  # only called for what is not a field: an option key
        if key.startswith("_") or key == "kind_options" or "kind_options" not in self.__dict__:
            raise AttributeError(key)
        for opts in (self.options, *self.kind_options.values()):
            if key in _fields(type(opts)):
                return getattr(opts, key)
        raise AttributeError(f"{cls.__name__!r} object has no attribute {key!r}")

    def __setattr__(self, key: str, value) -> None:
        if key in own or "kind_options" not in self.__dict__ or key not in extra_config_keys():
            object.__setattr__(self, key, value)
            return
        self.kind_options = merged(self.kind_options, {key: value}, self.draft)

    def settings(self) -> dict[str, Any]:
        """The config as a recipe's `train:` section spells it: the shared keys and its kind's options, flat."""
        shared = {key: value for key, value in dataclasses.asdict(self).items() if key != "kind_options"}
        return {**shared, **dataclasses.asdict(self.options)}

    cls.__init__, cls.__getattr__, cls.__setattr__ = __init__, __getattr__, __setattr__
    cls.kind, cls.options, cls.settings = property(kind), property(options), settings
    cls.extra_config_keys = staticmethod(extra_config_keys)
    return cls


def help_sections() -> list[tuple[str, type]]:
    """`specdec train --help`'s sections for every kind's options block (those that have keys)."""
    return [(f"draft={name}'s options (flat in `train:`, or in a block `train.{name}:`)", kinds.get(name).options)
            for name in kinds.names() if dataclasses.fields(kinds.get(name).options)]
