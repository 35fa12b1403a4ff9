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

import ast
import dataclasses
import importlib.resources
import inspect
import io
import math
import os
import textwrap
import tokenize
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


# Keys (the last part of a dotted key) that hold a file or folder path, and the endings that mark one. There `~` is
# the home folder, as in a shell, and not YAML's null: `--out ~` writes to the home folder, `prompts: ~/p.jsonl`
# reads from it. (In a recipe a bare `~` is still YAML's null: YAML reads it before any key is known.)
PATH_KEYS = frozenset({"out", "prompts", "eval_prompts", "target", "draft", "recipe", "report", "train_data",
                       "heldout_data", "resume_from"})
PATH_SUFFIXES = ("_dir", "_path", "_file")


def _is_path_key(key: str) -> bool:
    name = key.rsplit(".", 1)[-1]
    return name in PATH_KEYS or name.endswith(PATH_SUFFIXES)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """Where and what a YAML parse error is, in one line: "line 3, column 4: expected ',' or ']'"."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def _override_yaml(text: str, key: str) -> Any:
    """An override's value as YAML, or a ValueError naming the override and how to write it."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        problem = _yaml_problem(err).split(": ", 1)[-1]
        raise ValueError(f"override {key}={text} is not valid YAML ({problem}); write a list as 1,2,4 or [1, 2, 4] "
                         f"(brackets closed), and quote text that holds YAML punctuation") from None


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Turn a YAML/CLI value into the field's declared type, or raise a ValueError naming the key."""
    tp = _unwrap_optional(tp)
    if isinstance(value, _CliText):
        text = str(value)
        path = _is_path_key(key)
        if tp is str and text.strip() not in (("null",) if path else ("null", "~")):  # a path's `~` is home
            return os.path.expanduser(text.strip()) if path else text
        value = _override_yaml(text, key) if text.strip() else ""
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
            value = _override_yaml(value, key) if value.strip().startswith("[") else value.split(",")
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
        except (TypeError, ValueError, OverflowError):  # int(inf): OverflowError
            number = None
        if number is None or isinstance(value, bool) or (tp is int and isinstance(value, float) and value != number):
            raise ValueError(f"{key}: expected {tp.__name__}, got {value!r}")
        if not math.isfinite(number):  # nan passes every comparison a later check would make, and inf most
            raise ValueError(f"{key}: expected a finite number, got {value!r}; give a real value (e.g. {key}=1.0)")
        return number
    if tp is str:
        if isinstance(value, bool):
            raise ValueError(f"{key}: expected text, got the YAML boolean {str(value).lower()}; quote the value in "
                             f"the recipe (e.g. {key.rsplit('.', 1)[-1]}: \"no\")")
        return os.path.expanduser(str(value)) if _is_path_key(key) else str(value)
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
    if path.is_dir():
        raise ValueError(f"config file {name} is a folder; pass a recipe's .yaml file (or a shipped recipe's name)")
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
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"config file {path} is not valid YAML at {_yaml_problem(err)}; fix that line (each key "
                         f"is `key: value`, nested under its section by two spaces)") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"config file {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                         f"{err.start}); save it as UTF-8") from None
    except OSError as err:
        raise ValueError(f"could not read config file {path}: {err.strerror or err}") from None
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


HELP_FLAGS = ("-h", "--help")
_HELP_WIDTH = 110  # the help's lines wrap here (the repository's line length)


def wants_help(argv: list[str]) -> bool:
    """Whether a command line asks for its help: -h or --help anywhere on it (`specdec demo --quick --help`).
    Every command checks this before any other parsing, so that a line which would not parse still gets help."""
    return any(arg in HELP_FLAGS for arg in argv)


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's meaning, read from the comments in its class's own source: the comment on the field's line(s),
    else the comment lines just above it. A comment line that starts with `---` heads a group of keys, and so does
    a single comment line above a field that does not end in a full stop ("# optimisation"): neither is a meaning."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    meanings: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        inline = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        above, n = [], node.lineno - 1
        while n in comments and lines[n - 1].lstrip().startswith("#") and not comments[n].startswith("---"):
            above.insert(0, comments[n])
            n -= 1
        if len(above) == 1 and not above[0].endswith("."):
            above = []
        meanings[node.target.id] = " ".join(inline or above)
    return meanings


def _yaml_text(value: Any) -> str:
    """A default as a user writes it in a recipe or a key=value override (null, true, [0, 1], "")."""
    if isinstance(value, tuple):
        value = list(value)
    try:
        text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20, sort_keys=False).strip()
    except yaml.YAMLError:
        return repr(value)
    return text.removesuffix("\n...").strip()


def _key_lines(cls: type, names: list[str], prefix: str = "") -> list[str]:
    """`  key = default` and the key's meaning below it, for `names` of dataclass `cls`; a field that holds a
    dataclass lists that class's keys as `field.key`."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    types_, comments = _field_types(cls), {}
    for base in reversed(cls.__mro__):  # a subclass's comment wins over its base's
        comments.update(_field_comments(base) if dataclasses.is_dataclass(base) else {})
    lines: list[str] = []
    for name in names:
        f, tp = fields[name], _unwrap_optional(types_[name])
        if dataclasses.is_dataclass(tp):  # its keys, with that class's defaults
            lines += _key_lines(tp, [g.name for g in dataclasses.fields(tp)], f"{prefix}{name}.")
            continue
        if f.default is not dataclasses.MISSING:
            default = _yaml_text(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = _yaml_text(f.default_factory())
        else:
            default = "(required)"
        lines.append(f"  {prefix}{name} = {default}")
        if comments.get(name):
            lines += textwrap.wrap(comments[name], _HELP_WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6,
                                   break_long_words=False, break_on_hyphens=False)
    return lines


def _sections(cls: type, title: str) -> list[tuple[str, list[str]]]:
    """(heading, field names) of `cls`: its own fields under `title`, then each dataclass base's under the first
    line of that base's docstring (EvalConfig takes the serving engines' option classes as bases)."""
    owner = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            owner.update({name: base for name in inspect.get_annotations(base)})
    sections = []
    for base in cls.__mro__:
        names = [f.name for f in dataclasses.fields(cls) if owner.get(f.name) is base]
        if names:
            heading = title if base is cls else (inspect.getdoc(base) or base.__name__).splitlines()[0].rstrip(".")
            sections.append((heading, names))
    return sections


def help_text(cls: type, usage: str, title: str, intro: str = "", more: tuple[tuple[str, type], ...] = ()) -> str:
    """A command's `--help`, generated from its config dataclass(es): the usage line, the command's own prose
    (`intro`), then under `title` each key of `cls` with its default and its meaning (the field's comment), then the
    keys of its dataclass bases and of the `(title, class)` pairs in `more`."""
    lines = [f"usage: {usage}", ""] + ([intro.strip("\n"), ""] if intro.strip() else [])
    for index, (heading, klass) in enumerate([(title, cls), *more]):
        for part, (part_heading, names) in enumerate(_sections(klass, heading)):
            lines += ([""] if index or part else []) + [f"{part_heading}:", *_key_lines(klass, names)]
    lines += ["", "Set any of them as key=value, --key value (--flag for true), or in the recipe's section."]
    return "\n".join(lines)
