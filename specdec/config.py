"""Config = plain dataclasses, loaded from a recipe YAML plus `key=value` overrides.

A recipe holds one target/draft pair. Its top level has shared keys (`target`, `draft`, `seed`, ...) and
one section per subcommand (`data:`, `train:`, `eval:`, `publish:`, `demo:`). A subcommand's dataclass
takes the shared keys it declares, then its own section; unknown keys are an error that lists the valid ones.

Command lines accept three spellings of the same override:
    specdec eval --config recipes/x.yaml num_draft_tokens=4 --max-new-tokens 64 --greedy

`--config` takes a path, or a shipped recipe's name (`smollm2-135m`, `smollm2-135m.yaml`, or `recipes/NAME.yaml`
where no such file is here): the recipes ship inside the package, so an installed specdec runs them from any folder.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

SECTIONS = ("data", "train", "eval", "publish", "demo")
# Top-level recipe keys that every subcommand may read (each takes those its dataclass declares).
SHARED_KEYS = ("target", "draft", "seed", "output_dir", "device", "dtype", "report_to", "run_name")


def _field_types(cls: type) -> dict[str, Any]:
    """A config dataclass's keys and their types: its fields, and the keys it takes beyond them where it declares
    `extra_config_keys()` (TrainConfig: the draft kinds' options, train/kinds/options.py)."""
    hints = typing.get_type_hints(cls)
    extra = getattr(cls, "extra_config_keys", None)
    return {**(extra() if extra else {}), **{f.name: hints[f.name] for f in dataclasses.fields(cls)}}


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


class _CliText(str):
    """A `key=value` override's text, parsed once the field's type is known: a text field keeps it as typed
    (`mixed_precision=no` stays "no" instead of becoming YAML's boolean false)."""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Turn a YAML/CLI value into the field's declared type, or raise a ValueError naming the key."""
    tp = _unwrap_optional(tp)
    if isinstance(value, _CliText):
        text = str(value)
        if tp is str and text.strip() not in ("null", "~"):
            return text
        value = yaml.safe_load(text) if text.strip() else ""
    if value is None:
        return None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected a mapping for {tp.__name__}, got {value!r}")
        return _build(tp, value, prefix=f"{key}.")
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):  # CLI: "1,2,4" or "[1, 2, 4]"
            value = yaml.safe_load(value) if value.strip().startswith("[") else value.split(",")
        if not isinstance(value, (list, tuple)):
            value = [value]
        items = [_coerce(v, item_tp, key) for v in value]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ValueError(f"{key}: expected true or false, got {value!r}")
    if tp in (int, float):
        try:
            number = float(value) if tp is float else int(value)
        except (TypeError, ValueError):
            number = None
        if number is None or isinstance(value, bool) or (tp is int and isinstance(value, float) and value != number):
            raise ValueError(f"{key}: expected {tp.__name__}, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, bool):
            raise ValueError(f"{key}: expected text, got the YAML boolean {str(value).lower()}; quote the value in "
                             f"the recipe (e.g. {key.rsplit('.', 1)[-1]}: \"no\")")
        return str(value)
    return value


def _build(cls: type[T], values: dict[str, Any], prefix: str = "") -> T:
    types_ = _field_types(cls)
    unknown = sorted(set(values) - set(types_))
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(prefix + u for u in unknown)} for {cls.__name__}; "
            f"valid keys: {', '.join(sorted(types_))}"
        )
    kwargs = {k: _coerce(v, types_[k], prefix + k) for k, v in values.items()}
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted}: {p} is not a mapping")
    node[leaf] = value


def shipped_recipes() -> Path:
    """The folder of the shipped recipes: the checkout's recipes/, installed as package data `specdec.recipes`."""
    return Path(str(importlib.resources.files("specdec.recipes")))


def recipe_file(name: str | Path) -> Path:
    """A recipe's file: `name` itself when it is a file, else the shipped recipe it names (a bare name, with or
    without .yaml, or `recipes/NAME.yaml`: the README's commands then work outside a checkout too)."""
    path = Path(name)
    if path.is_file():
        return path
    if path.parent in (Path("."), Path("recipes")):
        shipped = shipped_recipes() / (path.name if path.suffix else f"{path.name}.yaml")
        if shipped.is_file():
            return shipped
    names = ", ".join(sorted(p.stem for p in shipped_recipes().glob("*.yaml")))
    raise ValueError(f"config file {name} does not exist; pass --config PATH or a shipped recipe's name: {names}")


def read_recipe(path: str | Path | None) -> dict[str, Any]:
    """Read a recipe YAML (a path or a shipped recipe's name, `recipe_file`) into a dict (empty for no path)."""
    if path is None:
        return {}
    path = recipe_file(path)
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path} must hold a YAML mapping at its top level")
    unknown = sorted(k for k in raw if k not in SECTIONS and k not in SHARED_KEYS)
    if unknown:
        raise ValueError(
            f"{path}: unknown top-level key(s) {', '.join(unknown)}; top-level keys are the sections "
            f"{', '.join(SECTIONS)} and the shared keys {', '.join(SHARED_KEYS)}"
        )
    return raw


def load_config(
    cls: type[T], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), section: str | None = None
) -> T:
    """Build dataclass `cls` from the recipe at `path` (its shared keys and `section`) plus `key=value` overrides."""
    raw = read_recipe(path)
    fields = _field_types(cls)
    values: dict[str, Any] = {k: raw[k] for k in SHARED_KEYS if k in raw and k in fields}
    if section is not None:
        body = raw.get(section) or {}
        if not isinstance(body, dict):
            raise ValueError(f"{path}: section {section!r} must be a mapping")
        values.update(body)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value (e.g. max_new_tokens=64)")
        key = key.strip().replace("-", "_")
        # `eval.num_draft_tokens=4` addresses this section explicitly; other sections' overrides are skipped.
        head, dot, rest = key.partition(".")
        if dot and head in SECTIONS:
            if head != section:
                continue
            key = rest
        _set_dotted(values, key, _CliText(text))
    return _build(cls, values)


def split_cli(argv: list[str], cls: type | None = None) -> tuple[str | None, list[str]]:
    """Split `--config PATH`, `key=value` and `--some-key value` / `--flag` arguments into (config, overrides).

    A `--flag` with no value is `flag=true`; it is only allowed for boolean fields of `cls`.
    """
    config: str | None = None
    overrides: list[str] = []
    bools = set()
    if cls is not None:
        bools = {n for n, t in _field_types(cls).items() if _unwrap_optional(t) is bool}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config", "-c"):
            if i + 1 >= len(argv):
                raise ValueError("--config needs a path, e.g. --config recipes/smollm2-135m.yaml")
            config, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            config, i = arg.split("=", 1)[1], i + 1
            continue
        if arg.startswith("--"):
            name = arg[2:]
            if "=" in name:
                key, _, value = name.partition("=")  # hyphens in the key only: values may be paths
                overrides.append(f"{key.replace('-', '_')}={value}")
                i += 1
                continue
            key = name.replace("-", "_")
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--") and "=" not in argv[i + 1]
            if key in bools and not has_value:
                overrides.append(f"{key}=true")
                i += 1
                continue
            if key.startswith("no_") and key[3:] in bools:
                overrides.append(f"{key[3:]}=false")
                i += 1
                continue
            if not has_value:
                raise ValueError(f"{arg} needs a value (e.g. {arg} 4) or use {key}=VALUE")
            overrides.append(f"{key}={argv[i + 1]}")
            i += 2
            continue
        if "=" in arg:
            overrides.append(arg)
            i += 1
            continue
        raise ValueError(f"unexpected argument {arg!r}: use --config PATH, key=value or --key value")
    return config, overrides


def config_from_cli(cls: type[T], argv: list[str], section: str | None) -> T:
    """Parse a subcommand's argv into its config dataclass."""
    path, overrides = split_cli(argv, cls)
    return load_config(cls, path, overrides, section=section)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as a plain dict (for logs, reports and checkpoints)."""
    return dataclasses.asdict(cfg)


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the class source: the one after it on its line, else the lines just above it."""
    import inspect
    import re

    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments, above = {}, []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").rstrip())
            continue
        match = re.match(r"\s+(\w+)\s*:[^=]*(=.*)?$", line)
        if match:
            inline = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            # A one-line comment above a field without a full stop heads a group of keys ("# optimisation").
            block = " ".join(above) if len(above) > 1 or (above and above[-1].endswith(".")) else ""
            comments[match.group(1)] = inline or block
        above = []
    return comments


def help_text(cls: type, usage: str, title: str) -> str:
    """A subcommand's `--help`, generated from its config dataclass: each key, its default and its comment."""
    comments = _field_comments(cls)
    lines = [f"usage: {usage}", "", f"{title}:"]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = repr(f.default_factory())  # type: ignore[misc]
        else:
            default = "(required)"
        note = comments.get(f.name, "")
        lines.append(f"  {f.name} = {default}" + (f"    # {note}" if note else ""))
    lines += ["", "Set any of them as key=value, --key value (--flag for true), or in the recipe's section."]
    return "\n".join(lines)
