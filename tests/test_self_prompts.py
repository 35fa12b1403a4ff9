"""prompts=self:N: the target writes its own prompts (train/self_prompts.py), resumably, and the data stage and
the trainer take them (several data folders at once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_tokenizer

from specdec.train import data as data_stage
from specdec.train import self_prompts
from specdec.train.data import DataConfig


def _cfg(ckpt: dict, out: Path, **kw) -> DataConfig:
    base = dict(target=ckpt["target"], prompts="self:9", output_dir=str(out), batch_size=16, max_new_tokens=4,
                self_prompt_max_tokens=12, self_prompt_temperature=1.0, device="cpu", dtype="float32")
    base.update(kw)
    return DataConfig(**base)


def test_prompt_source_parsing_and_filters():
    assert self_prompts.count_from("self:1500") == 1500
    assert self_prompts.count_from("embedded:train") is None
    for bad in ("self:", "self:0", "self:ten"):
        with pytest.raises(ValueError, match="self:N"):
            self_prompts.count_from(bad)
    assert self_prompts.usable("Can you plan a trip to Japan for me?")
    assert not self_prompts.usable("Hi there")  # too short
    assert not self_prompts.usable("Make a plan. Your ENTIRE ENTIRE ENTIRE ENTIRE answer")


def test_the_user_turn_prefix_is_the_template_up_to_the_message():
    tok = tiny_tokenizer()
    assert self_prompts.user_turn_prefix(tok) == [tok.convert_tokens_to_ids("<|user|>")]
    with pytest.raises(ValueError, match="chat template"):
        self_prompts.user_turn_prefix(tiny_tokenizer(chat_template=False))


def test_generation_is_unique_and_resumes_where_it_stopped(tiny_checkpoints, tmp_path, monkeypatch):
    whole = self_prompts.generate(_cfg(tiny_checkpoints, tmp_path / "a"), 9, tmp_path / "a")
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    texts = [r["turns"][0] for r in rows]
    assert len(rows) == 9 and len(set(texts)) == 9 and all(self_prompts.usable(t) for t in texts)
    assert len({r["batch"] for r in rows}) > 1  # several batches, so the resume below is a real one

    write, calls = self_prompts._write, {"n": 0}

    def write_then_die(path, rows):
        write(path, rows)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(self_prompts, "_write", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        self_prompts.generate(_cfg(tiny_checkpoints, tmp_path / "b"), 9, tmp_path / "b")
    monkeypatch.setattr(self_prompts, "_write", write)
    resumed = self_prompts.generate(_cfg(tiny_checkpoints, tmp_path / "b"), 9, tmp_path / "b")
    assert resumed.name == whole.name and resumed.read_text() == whole.read_text()
    # Other sampling settings write another file instead of mixing with this one.
    assert self_prompts.path_for(_cfg(tiny_checkpoints, tmp_path, seed=1), tmp_path).name != whole.name


def test_data_stage_answers_self_written_prompts(tiny_checkpoints, tmp_path):
    manifest = data_stage.run(_cfg(tiny_checkpoints, tmp_path / "data", prompts="self:5"))
    assert manifest["complete"] and manifest["counts"]["prompts"] == 5
    assert manifest["prompt_source"]["prompts"] == "self:5"
    ds = data_stage.load_generated(tmp_path / "data")
    assert len(ds) == 5 and set(ds["category"]) == {"self"}
    assert all(len(ids) > n for ids, n in zip(ds["input_ids"], ds["prompt_length"]))


def test_a_prompt_file_and_self_written_prompts_in_one_run(tiny_checkpoints, tmp_path):
    source = f"{tiny_checkpoints['prompts']}, self:3"
    manifest = data_stage.run(_cfg(tiny_checkpoints, tmp_path / "data", prompts=source, spec_bench_turns="first"))
    assert manifest["counts"]["prompts"] == 4 + 3
    categories = data_stage.load_generated(tmp_path / "data")["category"]
    assert categories.count("self") == 3 and len(categories) == 7
    with pytest.raises(ValueError, match="prompts is empty"):
        data_stage.run(_cfg(tiny_checkpoints, tmp_path / "empty", prompts=" , "))


def test_trainer_reads_several_data_folders(tiny_checkpoints, tmp_path):
    from specdec.train.batches import load_data
    from specdec.train.distill import TrainConfig

    for seed, (name, source) in enumerate((("one", "self:5"), ("two", "self:4"))):
        data_stage.run(_cfg(tiny_checkpoints, tmp_path / name, prompts=source, seed=seed))
    cfg = TrainConfig(target=tiny_checkpoints["target"], output_dir=str(tmp_path / "run"),
                      train_data=f"{tmp_path / 'one'}, {tmp_path / 'two'}", heldout_fraction=0.0)
    train, _ = load_data(cfg)
    assert len(train) == 9
    with pytest.raises(ValueError, match="not found"):
        load_data(TrainConfig(target=tiny_checkpoints["target"], train_data=f"{tmp_path / 'one'},{tmp_path / 'x'}"))
