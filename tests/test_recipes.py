"""Every recipe parses, its train section loads into TrainConfig, and each one smoke-runs (tiny stand-ins for
the models and data, every other train setting as written) through the trainer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from conftest import save_tiny_world

from specdec.config import SECTIONS, SHARED_KEYS, load_config, read_recipe
from specdec.train import distill
from specdec.train.distill import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
LAUNCH_CONFIGS = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))



def test_the_expected_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"smollm2-135m.yaml", "smollm2-135m-quick.yaml", "smollm2-135m-eagle3.yaml", "llama3.1-8b__llama3.2-1b.yaml",
            "qwen2.5-7b__qwen2.5-0.5b.yaml"} <= names
    assert {p.stem for p in LAUNCH_CONFIGS} >= {"single_gpu", "multi_gpu", "fsdp", "deepspeed_zero2", "cpu"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_and_train_section_loads(path):
    text = path.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert header and text.startswith("#"), "a recipe starts with a comment giving the exact commands"
    assert any(f"--config recipes/{path.name}" in line and ("specdec train" in line or "-m specdec.train" in line)
               for line in header)
    raw = read_recipe(path)
    assert set(raw) <= set(SECTIONS) | set(SHARED_KEYS)
    assert isinstance(raw.get("train"), dict) and isinstance(raw.get("data"), dict)
    cfg = load_config(TrainConfig, path, section="train")
    assert cfg.target == raw["target"] and cfg.output_dir == raw["output_dir"]
    if "draft_layers" in raw["train"]:
        assert cfg.draft == "derived"


def test_embedded_recipes_use_the_shared_prompt_keywords():
    for name in ("smollm2-135m.yaml", "smollm2-135m-quick.yaml", "smollm2-135m-eagle3.yaml"):
        raw = yaml.safe_load((ROOT / "recipes" / name).read_text())
        assert raw["target"] == "embedded:smollm2-135m-instruct"
        assert raw["data"]["prompts"].split(",")[0] == "embedded:train"
        assert "prompts=embedded:heldout" in (ROOT / "recipes" / name).read_text()
        # The trainer's default data folders are the ones the data section writes.
        assert raw["data"]["output_dir"] == f"{raw['output_dir']}/data"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recorded_features_are_the_ones_the_draft_reads(path):
    """A data section that records the target's states records the layers its EAGLE-3 draft reads (else training
    would compute them again, with a warning)."""
    from specdec.train.data import DataConfig

    raw, data = read_recipe(path), load_config(DataConfig, path, section="data")
    if data.record_features:
        assert raw["draft"] == "eagle3"
        assert data.eagle_aux_layer_ids == raw["train"]["eagle_aux_layer_ids"]


@pytest.mark.parametrize("path", LAUNCH_CONFIGS, ids=lambda p: p.name)
def test_accelerate_launch_configs_load(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.num_processes >= 1 and path.read_text().startswith("#")


@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory):
    return save_tiny_world(tmp_path_factory.mktemp("recipes"), target_layers=3, small_seed=4, n_train=12, n_heldout=4)


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_smoke_runs_two_steps(path, tiny_world, tmp_path):
    cfg = load_config(TrainConfig, path, section="train")
    tiny = {"target": str(tiny_world / "target"), "train_data": str(tiny_world / "data"),
            "heldout_data": str(tiny_world / "heldout"), "output_dir": str(tmp_path / "out"), "device": "cpu",
            "dtype": "float32", "max_steps": 2, "per_device_batch_size": 2, "eval_samples": 2, "eval_every": 1,
            "save_every": 1, "warmup_steps": 1}
    if cfg.draft == "derived":
        tiny["draft_layers"] = [0, -1]
    elif cfg.draft not in ("scratch", "eagle3", "dflash"):
        tiny["draft"] = str(tiny_world / "small")
    if cfg.draft == "eagle3":  # the tiny target has 3 layers: ids 1 and 2 are all it has
        tiny["eagle_aux_layer_ids"] = [1, 2]
    if cfg.draft == "dflash":
        cfg.options.dflash_layer_ids = [1, 2]
    if getattr(cfg.options, "states", "") == "recorded":  # the tiny data records none (test_big_target.py does)
        tiny["states"] = "auto"
    if cfg.draft_vocab_size > 0:
        tiny["draft_vocab_size"] = 32
    if cfg.lora:
        tiny["lora_r"] = 2
    cfg = dataclasses.replace(cfg, **tiny)
    final = distill.run(cfg)
    assert (final / "config.json").is_file() and (Path(cfg.output_dir) / "best" / "config.json").is_file()


def test_lora_variant_of_a_gpu_recipe_smoke_runs(tiny_world, tmp_path):
    """The documented `lora=true` override of the pretrained-draft recipes."""
    path = ROOT / "recipes" / "qwen2.5-7b__qwen2.5-0.5b.yaml"
    cfg = load_config(TrainConfig, path, ["lora=true", "learning_rate=2e-4"], section="train")
    cfg = dataclasses.replace(cfg, target=str(tiny_world / "target"), draft=str(tiny_world / "small"),
                              train_data=str(tiny_world / "data"), heldout_data=str(tiny_world / "heldout"),
                              output_dir=str(tmp_path / "out"), device="cpu", dtype="float32", max_steps=2,
                              per_device_batch_size=2, eval_samples=2, save_every=0, eval_every=0, lora_r=2)
    assert cfg.lora and (distill.run(cfg) / "config.json").is_file()
