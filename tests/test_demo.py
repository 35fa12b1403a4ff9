"""`specdec demo`'s time budget (the demo itself runs end to end in CI: `make demo-quick`)."""

import pytest

from specdec.config import shipped_recipes
from specdec.demo import DemoConfig, main, stage_configs, train_minutes


def test_training_gets_what_the_budget_leaves_after_the_evaluation():
    assert train_minutes(45.0, spent=20.0, eval_minutes=5.0, recipe_cap=None) == 20.0
    assert train_minutes(45.0, spent=20.0, eval_minutes=5.0, recipe_cap=12.0) == 12.0  # the recipe's own cap
    assert train_minutes(45.0, spent=44.0, eval_minutes=5.0, recipe_cap=None) == 1.0  # some training, always


def test_the_default_budget_follows_the_demo_kind():
    assert DemoConfig().budget_minutes() == 45.0 and DemoConfig(quick=True).budget_minutes() == 5.0
    assert DemoConfig(minutes=90).budget_minutes() == 90.0
    with pytest.raises(ValueError, match="data_share"):
        DemoConfig(data_share=0.0)


def test_the_demo_plan_reads_the_recipe_and_prompt_sets_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """`specdec demo --plan` from a folder without a checkout: the shipped recipe, each stage's config, the prompt
    sets the stages read (tests/test_wheel.py runs it from an installed wheel)."""
    monkeypatch.chdir(tmp_path)
    assert main(["--quick", "--plan"]) == 0
    shown = capsys.readouterr().out
    assert f"recipe            {shipped_recipes() / 'smollm2-135m-quick.yaml'}" in shown
    assert "48 prompts from embedded:train" in shown and "8 prompts from " in shown
    assert not (tmp_path / "outputs").exists()
    stages = stage_configs(DemoConfig(recipe="smollm2-135m", output_dir="out"))  # a shipped recipe's bare name
    assert stages.recipe == shipped_recipes() / "smollm2-135m.yaml"
    assert (stages.data.output_dir, stages.train.train_data, stages.eval.out) == ("out/data", "out/data", "out/eval")
    assert stages.publish.draft == stages.eval.draft == "out/train/final" and stages.publish.out == "out/draft"
