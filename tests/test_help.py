"""`specdec <command> --help`: generated from the command's config classes, every key with its real default and a
meaning, asked for anywhere on the command line."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from specdec.cli import COMMANDS, HELP, main
from specdec.config import _field_comments, help_text, wants_help
from specdec.demo import DemoConfig
from specdec.eval.config import EvalConfig
from specdec.eval.engine.vllm import VllmOptions
from specdec.eval.verify import VerifyConfig
from specdec.train.data.config import DataConfig
from specdec.train.kinds.eagle3 import Eagle3Options
from specdec.train.plan.check import PlanOptions
from specdec.train.publish import PublishConfig
from specdec.train.train_config import TrainConfig

# Every config class each command reads, listed here apart from specdec/cli.py's table so that a class the help
# leaves out fails the test (EvalConfig takes the engines' option classes as bases).
CONFIGS = {
    "data": [DataConfig],
    "train": [TrainConfig, Eagle3Options, PlanOptions],  # and every other kind's options block
    "eval": [EvalConfig, VllmOptions],
    "verify": [VerifyConfig],
    "publish": [PublishConfig],
    "demo": [DemoConfig],
}


def _keys(text: str) -> dict[str, tuple[str, str]]:
    """key -> (default, meaning), read from a help's key list: `  key = default`, its meaning indented below."""
    keys: dict[str, tuple[str, str]] = {}
    current = None
    for line in text.splitlines():
        if match := re.match(r"  (\w[\w.]*) = (.*)$", line):
            current = match[1]
            keys[current] = (match[2], "")
        elif current and line.startswith("      "):
            default, meaning = keys[current]
            keys[current] = (default, f"{meaning} {line.strip()}".strip())
        else:
            current = None
    return keys


def _default(f: dataclasses.Field):
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    return list(value) if isinstance(value, tuple) else value


def test_every_command_has_generated_help():
    assert set(HELP) == set(COMMANDS) == set(CONFIGS)


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_help_lists_every_key_with_its_default_and_a_meaning(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: specdec {command}")
    for bad in ("_MISSING_TYPE", "<function", "object at 0x"):
        assert bad not in out
    keys = _keys(out)
    for cls in CONFIGS[command]:
        for f in dataclasses.fields(cls):
            assert f.name in keys, f"{command} --help does not list {cls.__name__}.{f.name}"
            default, meaning = keys[f.name]
            assert meaning, (f"{cls.__name__}.{f.name} has no meaning: give the field a comment (inline, or the "
                             f"lines above it)")
            assert yaml.safe_load(default) == _default(f), f"{f.name}: shown {default}, real {_default(f)!r}"


@pytest.mark.parametrize("argv", [
    ["demo", "--quick", "--help"],
    ["eval", "num_draft_tokens=2", "--help"],
    ["eval", "--config", "no-such-recipe.yaml", "--help"],  # help comes before the recipe is read
    ["train", "no_such_key=v", "-h"],
    ["publish", "--draft", "-h"],  # help even where --draft would miss its value
])
def test_help_is_accepted_anywhere_on_the_line(argv, capsys):
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"usage: specdec {argv[0]}") and "error" not in captured.err


def test_module_entry_points_print_the_same_help(capsys):
    from specdec.train.data.cli import main as data_main
    from specdec.train.distill import main as train_main

    for name, entry in (("train", train_main), ("data", data_main)):
        assert main([name, "--help"]) == 0
        expected = capsys.readouterr().out
        assert entry(["max_steps=3", "--help"]) == 0
        assert capsys.readouterr().out == expected


def test_wants_help():
    assert wants_help(["--quick", "--help"]) and wants_help(["x=1", "-h"])
    assert not wants_help(["run_name=--help", "--helpful", "x=1"])


@dataclasses.dataclass
class _Inner:
    depth: int = 2  # how deep


@dataclasses.dataclass
class _Sample:
    required: str
    # --- a group heading, never a meaning
    # A meaning over
    # two lines.
    above: int = 1
    inline: list[int] = dataclasses.field(default_factory=lambda: [1, 2])  # an inline meaning
    # a heading without a full stop
    bare: bool = False
    factory: dict = dataclasses.field(  # a statement over
        default_factory=dict)  # two lines
    inner: _Inner = dataclasses.field(default_factory=_Inner)


def test_field_comments_follow_the_rules():
    comments = _field_comments(_Sample)
    assert comments == {"required": "", "above": "A meaning over two lines.", "inline": "an inline meaning",
                        "bare": "", "factory": "a statement over two lines", "inner": ""}


def test_help_text_shows_real_defaults_and_nested_keys():
    text = help_text(_Sample, "sample", "options", intro="Some prose.")
    assert text.splitlines()[:5] == ["usage: sample", "", "Some prose.", "", "options:"]
    keys = _keys(text)
    assert keys["required"] == ("(required)", "")
    assert keys["inline"] == ("[1, 2]", "an inline meaning") and keys["factory"] == ("{}", "a statement over two lines")
    assert keys["inner.depth"] == ("2", "how deep") and "inner" not in keys
