"""Recipe YAML + overrides -> dataclass configs; unknown keys are errors."""

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from specdec.config import config_from_cli, load_config, recipe_file, shipped_recipes, split_cli

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Inner:
    rank: int = 8


@dataclass
class Cfg:
    target: str = "t"
    seed: int = 0
    num_draft_tokens: list[int] = field(default_factory=lambda: [4])
    temperature: float = 0.0
    quick: bool = False
    lora: Inner = field(default_factory=Inner)
    note: str | None = None


def write(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_shared_keys_section_and_overrides_in_order(tmp_path):
    path = write(tmp_path, "target: big\nseed: 3\neval:\n  temperature: 0.5\n  lora: {rank: 4}\ntrain:\n  other: 1\n")
    cfg = load_config(Cfg, path, ["seed=5", "eval.quick=true", "train.ignored=1", "lora.rank=16"], section="eval")
    assert (cfg.target, cfg.seed, cfg.temperature, cfg.quick, cfg.lora.rank) == ("big", 5, 0.5, True, 16)


def test_unknown_keys_are_errors_that_list_valid_keys(tmp_path):
    with pytest.raises(ValueError, match="unknown config key.*temprature.*valid keys"):
        load_config(Cfg, write(tmp_path, "eval:\n  temprature: 1\n"), section="eval")
    with pytest.raises(ValueError, match="unknown top-level key"):
        load_config(Cfg, write(tmp_path, "evall: {}\n"), section="eval")
    with pytest.raises(ValueError, match="lora.alpha"):
        load_config(Cfg, None, ["lora.alpha=3"])


def test_types_are_checked():
    with pytest.raises(ValueError, match="seed: expected int"):
        load_config(Cfg, None, ["seed=abc"])
    with pytest.raises(ValueError, match="quick: expected true or false"):
        load_config(Cfg, None, ["quick=maybe"])
    with pytest.raises(ValueError, match="does not exist"):
        load_config(Cfg, "/nonexistent/recipe.yaml")


def test_cli_flags_lists_and_booleans(tmp_path):
    path = write(tmp_path, "seed: 1\n")
    cfg = config_from_cli(Cfg, ["--config", str(path), "--num-draft-tokens", "1,2,4", "--quick",
                                "temperature=0.7", "--note=hello"], section="eval")
    assert cfg.num_draft_tokens == [1, 2, 4] and cfg.quick and cfg.temperature == 0.7 and cfg.note == "hello"
    assert split_cli(["--no-quick"], Cfg) == (None, ["quick=false"])
    with pytest.raises(ValueError, match="needs a value"):
        split_cli(["--seed"], Cfg)
    with pytest.raises(ValueError, match="unexpected argument"):
        split_cli(["stray"], Cfg)


def test_text_fields_keep_yaml_keywords_as_typed(tmp_path):
    # YAML reads `no`, `on`, `null` as keywords; a text field on the command line keeps what was typed.
    cfg = load_config(Cfg, None, ["target=no", "note=on", "seed=7"])
    assert (cfg.target, cfg.note, cfg.seed) == ("no", "on", 7)
    assert load_config(Cfg, None, ["note=null"]).note is None
    with pytest.raises(ValueError, match='quote the value in the recipe.*target: "no"'):
        load_config(Cfg, write(tmp_path, "target: no\n"))


def test_a_recipe_is_a_path_or_a_shipped_recipes_name(tmp_path, monkeypatch):
    """The recipes ship as package data (`specdec.recipes`); `--config` names one from any folder."""
    assert sorted(p.name for p in shipped_recipes().glob("*.yaml")) == sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
    monkeypatch.chdir(tmp_path)
    shipped = shipped_recipes() / "smollm2-135m.yaml"
    assert recipe_file("smollm2-135m") == recipe_file("smollm2-135m.yaml") == recipe_file("recipes/smollm2-135m.yaml") == shipped
    (tmp_path / "smollm2-135m.yaml").write_text("seed: 1\n")
    assert recipe_file("smollm2-135m.yaml") == Path("smollm2-135m.yaml")  # a file here comes first
    for missing in ("no-such-recipe", "elsewhere/smollm2-135m.yaml"):
        with pytest.raises(ValueError, match="smollm2-135m-quick"):  # the error lists the shipped names
            recipe_file(missing)
    assert load_config(Cfg, "smollm2-135m-quick").target == "embedded:smollm2-135m-instruct"


@dataclass
class Paths:
    out: str | None = None
    output_dir: str | None = None
    note: str | None = None
    rate: float = 0.5


def test_home_in_a_path_key_is_a_folder_and_nan_is_refused(tmp_path):
    home = str(Path.home())
    cfg = load_config(Paths, write(tmp_path, "eval:\n  out: ~/reports\n"), ["output_dir=~", "note=~"], "eval")
    assert (cfg.out, cfg.output_dir, cfg.note) == (f"{home}/reports", home, None)  # note is no path: ~ is null
    for text in ("rate=nan", "rate=.inf", "rate=-.inf"):
        with pytest.raises(ValueError, match="rate: expected a finite number"):
            load_config(Paths, None, [text])
    with pytest.raises(ValueError, match=r"recipe.yaml is not valid YAML at line 2, column \d+"):
        load_config(Paths, write(tmp_path, "seed: 1\neval: {rate: [1, 2}\n"))
    with pytest.raises(ValueError, match="is a folder"):
        load_config(Paths, tmp_path)
