"""`specdec demo`'s time budget, its split between data and training, and its evaluation in a process of its own
(the demo itself runs end to end in CI: `make wheel-demo`)."""

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from conftest import tiny_llama, tiny_tokenizer

from specdec import demo
from specdec.config import shipped_recipes
from specdec.demo import DemoConfig, main, stage_configs, train_minutes
from specdec.demo_split import Split


def test_training_gets_what_the_budget_leaves_after_the_evaluation():
    assert train_minutes(45.0, spent=20.0, eval_minutes=5.0, recipe_cap=None) == 20.0
    assert train_minutes(45.0, spent=20.0, eval_minutes=5.0, recipe_cap=12.0) == 12.0  # the recipe's own cap
    assert train_minutes(45.0, spent=44.0, eval_minutes=5.0, recipe_cap=None) == 1.0  # some training, always


def test_the_default_budget_follows_the_demo_kind():
    assert DemoConfig().budget_minutes() == 45.0 and DemoConfig(quick=True).budget_minutes() == 5.0
    assert DemoConfig(minutes=90).budget_minutes() == 90.0
    with pytest.raises(ValueError, match="train_passes"):
        DemoConfig(train_passes=0.0)
    with pytest.raises(ValueError, match="probe_steps"):
        DemoConfig(probe_steps=1)


def test_the_split_gives_training_its_passes_over_all_the_data():
    split = Split(data_rate=100.0, train_rate=500.0, examples=250, remaining=40.0, passes=5.0)
    more = split.more_data_minutes()
    # (R - d) * train_rate == P * (N + d * data_rate): training's samples are P times the data's examples
    assert (40.0 - more) * 500.0 == pytest.approx(5.0 * (250 + more * 100.0))
    assert split.expected_examples() == round(250 + more * 100.0)
    faster_data = Split(data_rate=200.0, train_rate=500.0, examples=250, remaining=40.0, passes=5.0)
    assert faster_data.more_data_minutes() < more  # each minute of data then needs more minutes of training
    assert Split(100.0, 500.0, examples=5000, remaining=40.0, passes=5.0).more_data_minutes() == 0.0  # enough already
    assert Split(100.0, 1e9, examples=0, remaining=40.0, passes=5.0).more_data_minutes() <= 40.0
    summary = split.summary()
    assert summary["more_data_minutes"] == round(more, 2) and summary["passes"] == 5.0


def _tiny_demo_recipe(root: Path, batch: int = 2) -> Path:
    """A recipe on a saved tiny target: 12 prompts in shards of 2, a one-layer plain draft derived from it."""
    tiny_llama(seed=0).save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    words = "the a of to and is explain write sum number city water food".split()
    (root / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": " ".join(words[(i + j) % len(words)] for j in range(3 + i % 4)), "category": "c"}) + "\n"
        for i in range(12)))
    recipe = {
        "target": str(root / "target"), "draft": "derived", "device": "cpu", "dtype": "float32",
        "data": {"prompts": str(root / "prompts.jsonl"), "max_new_tokens": 4, "shard_size": 2, "batch_size": 2,
                 "top_logprobs": 4},
        "train": {"draft_layers": [0], "teacher": "offline", "per_device_batch_size": batch, "max_steps": 4,
                  "eval_every": 0, "save_every": 0, "heldout_fraction": 0.2, "eval_samples": 2},
        "eval": {"num_draft_tokens": 2, "max_new_tokens": 4}, "publish": {}}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("passes, shards", [(1e6, 1), (0.01, 6)])
def test_the_demo_generates_as_much_data_as_training_can_pass_over(tmp_path, passes, shards, fresh_accelerate_state):
    """The real data stage and training probe on a tiny target: one shard, the rates measured, then as many more
    shards as the split gives: none when training could not pass over more `passes` times, all when it could."""
    cfg = DemoConfig(recipe=str(_tiny_demo_recipe(tmp_path)), output_dir=str(tmp_path / "out"), minutes=30,
                     train_passes=passes, probe_steps=3)
    stages = stage_configs(cfg)
    split = demo._generate_data(cfg, stages, demo_start=__import__("time").perf_counter(), eval_minutes=lambda: 1.0)
    manifest = json.loads((tmp_path / "out" / "data" / "manifest.json").read_text())
    assert len(manifest["shards"]) == shards and manifest["complete"] == (shards == 6)
    assert split.data_rate > 0 and split.train_rate > 0 and split.examples == 2 and split.passes == passes
    assert split.remaining < 30 - 1.0  # the evaluation's estimate and the minutes spent are set aside
    assert not (tmp_path / "out" / "probe").exists()  # the probe leaves nothing behind


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


def test_a_first_shard_too_small_to_time_training_falls_back_to_half_the_minutes(tmp_path, fresh_accelerate_state,
                                                                                 capsys):
    """A batch larger than the first shard leaves the probe nothing to time: the demo says so and generates for
    half the minutes left (here: every shard), instead of failing."""
    cfg = DemoConfig(recipe=str(_tiny_demo_recipe(tmp_path, batch=8)), output_dir=str(tmp_path / "out"), minutes=30,
                     probe_steps=3)
    split = demo._generate_data(cfg, stage_configs(cfg), demo_start=__import__("time").perf_counter(),
                                eval_minutes=lambda: 1.0)
    assert split is None and "the training probe could not run" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "data" / "manifest.json").read_text())["complete"]


def test_the_demo_evaluates_in_a_process_of_its_own(tiny_checkpoints, tmp_path, monkeypatch):
    """The evaluation stage times its decoders in a fresh interpreter (the kernels it measures and the heap it
    allocates from are not those the data stage and training left behind): here the parent's `specdec eval` run
    is broken, and the stage still returns the report its own process wrote."""
    from specdec.eval import runner
    from specdec.eval.config import EvalConfig

    def in_this_process(cfg):
        raise AssertionError("the evaluation ran in the demo's own process")

    monkeypatch.setattr(runner, "run", in_this_process)
    cfg = EvalConfig(target=tiny_checkpoints["target"], draft=tiny_checkpoints["draft"],
                     prompts=tiny_checkpoints["prompts"], out=str(tmp_path / "eval"), max_new_tokens=6,
                     num_draft_tokens=[2], dtype="float64", cost_repeats=1, warmup=0, threads=1)
    report = demo.evaluate_in_own_process(cfg)
    assert report == json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["equivalence"]["passed"] and report["config"]["num_draft_tokens"] == 2

    broken = dataclasses.replace(cfg, draft=str(tmp_path / "no-draft"), out=str(tmp_path / "eval-broken"))
    with pytest.raises(RuntimeError, match="the evaluation stage stopped .* Run `specdec demo` again"):
        demo.evaluate_in_own_process(broken)
