"""Sampled traffic: a data run mixing temperatures (and top-p) per work item, recorded per row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_llama, tiny_tokenizer
from test_reasoning import ScriptedTarget

from specdec.prompts import Prompt
from specdec.train.data import load_generated, run
from specdec.train.data.backend import generate_shard
from specdec.train.data.config import DataConfig, fingerprinted_settings
from specdec.train.data.planning import plan_items


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-target")
    tiny_llama(seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _prompts(path: Path, n: int = 4) -> Path:
    words = ["explain the sum", "write a list of numbers", "what is the city water", "tell a short story"]
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": words[i % len(words)]}) + "\n" for i in range(n)))
    return path


def _cfg(target: Path, prompts: Path, out: Path, **kw) -> DataConfig:
    base = dict(target=str(target), prompts=str(prompts), output_dir=str(out), max_new_tokens=6, batch_size=4,
                shard_size=4, dtype="float64", device="cpu")
    return DataConfig(**{**base, **kw})


def test_item_sampling_cycles_or_draws_by_seed():
    cfg = DataConfig(temperatures=[0, 0.7, 1.0], top_ps=[1.0, 0.9])
    assert [cfg.item_sampling(k, "p", 0) for k in range(4)] == [(0.0, 1.0), (0.7, 0.9), (1.0, 1.0), (0.0, 0.9)]
    draw = DataConfig(temperatures=[0, 0.7, 1.0], sampling_mix="draw", seed=3)
    drawn = [draw.item_sampling(0, f"p{i}", 0) for i in range(30)]
    assert drawn == [draw.item_sampling(99, f"p{i}", 0) for i in range(30)]  # by (seed, prompt, sample), not place
    assert {t for t, _ in drawn} == {0.0, 0.7, 1.0}
    other = DataConfig(temperatures=[0, 0.7, 1.0], sampling_mix="draw", seed=4)
    assert drawn != [other.item_sampling(0, f"p{i}", 0) for i in range(30)]


def test_each_generate_call_samples_with_its_items_setting():
    tok = tiny_tokenizer()
    cfg = DataConfig(target="unused", prompts="unused", temperatures=[0, 0.5], top_ps=[1.0, 1.0, 0.8],
                     num_samples=3)
    prompts = [Prompt(f"p{i}", None, [{"role": "user", "content": "explain the sum"}]) for i in range(2)]
    items, _, _ = plan_items(prompts, tok, cfg, None)
    backend = ScriptedTarget(cfg, tok, lambda p: "the answer", "</s>")
    rows, _ = generate_shard(items, backend, tok, cfg, seed=0, context_limit=None)
    settings = {(r["prompt_id"], r["sample_index"]): (r["temperature"], r["top_p"]) for r in rows}
    for item in items:
        assert settings[(item.prompt.prompt_id, item.sample_index)] == (item.temperature, item.top_p)
    assert sum(n for n, _ in backend.calls) == len(items)
    per_call = {(s.temperature, s.top_p) for _, s in backend.calls}
    assert per_call == set(settings.values()) and len(per_call) > 1


def test_a_mixed_run_records_each_rows_temperature_and_its_greedy_rows_are_the_targets(tiny_target, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl")
    mixed = _cfg(tiny_target, prompts, tmp_path / "mixed", temperatures=[0, 1.0], num_samples=2)
    manifest = run(mixed)
    assert manifest["generation"]["temperatures"] == [0, 1.0] and manifest["generation"]["sampling_mix"] == "cycle"
    rows = load_generated(tmp_path / "mixed").to_list()
    assert len(rows) == 8
    assert {r["sample_index"]: r["temperature"] for r in rows} == {0: 0.0, 1: 1.0}  # cycled over the work list
    run(_cfg(tiny_target, prompts, tmp_path / "greedy"))
    greedy = {r["prompt_id"]: r["input_ids"] for r in load_generated(tmp_path / "greedy").to_list()}
    assert {r["prompt_id"]: r["input_ids"] for r in rows if r["temperature"] == 0} == greedy
    assert run(mixed)["fingerprint"] == manifest["fingerprint"]  # a rerun resumes the same folder
    assert "temperature" not in load_generated(tmp_path / "greedy").column_names  # unmixed: columns as before


@pytest.mark.parametrize("kw, error", [
    (dict(temperatures=[]), "temperatures must be a non-empty list"),
    (dict(temperatures="0.7"), "temperatures must be a non-empty list"),
    (dict(temperatures=[0, -1]), "temperature"),
    (dict(top_ps=[0.0]), "top_p"),
    (dict(sampling_mix="random"), "sampling_mix must be one of cycle, draw"),
    (dict(temperatures=[0.7], responses="dataset"), "responses=dataset generates none"),
])
def test_bad_sampling_mixes_are_refused(kw, error):
    with pytest.raises(ValueError, match=error):
        DataConfig(**kw)


def test_the_work_list_holds_every_prompts_first_answer_before_any_second():
    import random

    tok = tiny_tokenizer()
    words = ["explain the sum", "write a list of numbers and more numbers", "what is the city water", "tell a story"]
    prompts = [Prompt(f"p{i}", None, [{"role": "user", "content": words[i % 4] * (1 + i % 3)}]) for i in range(12)]
    cfg = DataConfig(target="unused", prompts="unused", temperatures=[0, 0.8], num_samples=2, seed=5)
    items, _, _ = plan_items(prompts, tok, cfg, None)
    assert [i.sample_index for i in items] == [0] * 12 + [1] * 12  # a run cut at half holds all 12 prompts once
    assert {i.prompt.prompt_id for i in items[:12]} == {p.prompt_id for p in prompts}
    assert all(i.temperature == 0.0 for i in items[:12]) and all(i.temperature == 0.8 for i in items[12:])
    assert [i.prompt.prompt_id for i in items[12:]] != [i.prompt.prompt_id for i in items[:12]]  # each shuffled
    # One answer per prompt: the order of the folders made before (one seeded shuffle, the longest item first).
    one, _, _ = plan_items(prompts, tok, DataConfig(target="unused", prompts="unused", seed=5), None)
    before, _, _ = plan_items(prompts, tok, DataConfig(target="unused", prompts="unused", shuffle=False), None)
    random.Random(5).shuffle(before)
    longest = max(range(len(before)), key=lambda i: before[i].first_length)
    before.insert(0, before.pop(longest))
    assert [i.prompt.prompt_id for i in one] == [i.prompt.prompt_id for i in before]
    assert fingerprinted_settings(cfg)["work_order"] == "first answers first"
    assert "work_order" not in fingerprinted_settings(DataConfig())


def test_sampling_lists_change_the_fingerprint_only_when_set():
    assert "temperatures" not in fingerprinted_settings(DataConfig())
    assert fingerprinted_settings(DataConfig(temperatures=[0, 0.7]))["temperatures"] == [0, 0.7]


def test_the_card_says_which_temperatures_the_draft_was_trained_and_measured_at():
    import dataclasses

    from test_publish import REPORT, _info

    from specdec.train.model_card import render_card, traffic_facts

    facts = traffic_facts({"temperatures": [0, 0.7, 1.0], "chat_template_kwargs": {"enable_thinking": False}})
    card = render_card(dataclasses.replace(_info(), traffic=facts), {**REPORT, "config": {
        **REPORT["config"], "temperature": 0.7}})
    assert "- temperature(s) of the training answers: 0, 0.7, 1; measured at: 0.7" in card
    assert "chat template options of the training prompts: enable_thinking=False" in card
    plain = render_card(dataclasses.replace(_info(), traffic=traffic_facts({"temperature": 0.0})), None)
    assert "training answers: 0; measured at: not measured" in plain
