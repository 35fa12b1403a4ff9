"""Sampled traffic measured where users serve it: held-out alpha at the serving temperatures (`heldout_temperatures`),
eval's untimed sampled-acceptance pass (`sampled_acceptance_temperature`), and where both show (report, card, demo)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_world

from specdec.cli import main
from specdec.train import losses
from specdec.train.train_config import TrainConfig

# ---- alpha at a temperature --------------------------------------------------------------------------------


def _softmax(values: list[float], temperature: float) -> list[float]:
    weights = [math.exp(v / temperature) for v in values]
    return [w / sum(weights) for w in weights]


def test_alpha_at_a_temperature_is_the_overlap_of_both_warped_distributions():
    draft, target = [2.0, 1.0, -1.0], [1.0, 2.5, 0.0]
    for t in (0.7, 1.0, 1.6):
        by_hand = sum(min(p, q) for p, q in zip(_softmax(target, t), _softmax(draft, t)))
        alpha = losses.acceptance_alpha(torch.tensor([draft]), torch.tensor([target]), temperature=t)
        assert float(alpha[0]) == pytest.approx(by_hand, abs=1e-6)
    # the warp changes the figure: this pair overlaps more at 1.6 than at 0.7
    assert losses.acceptance_alpha(torch.tensor([draft]), torch.tensor([target]), temperature=1.6) > \
        losses.acceptance_alpha(torch.tensor([draft]), torch.tensor([target]), temperature=0.7)


def test_alpha_at_a_small_temperature_approaches_greedy_agreement():
    gen = torch.Generator().manual_seed(0)
    draft, target = torch.randn(400, 50, generator=gen) * 3, torch.randn(400, 50, generator=gen) * 3
    target[:150] = draft[:150] + 0.1 * torch.randn(150, 50, generator=gen)  # agreement well above chance
    agreement = losses.greedy_agreement(draft, target).float().mean()
    assert 0.3 < float(agreement) < 0.9
    assert float(losses.acceptance_alpha(draft, target, temperature=1e-3).mean()) == pytest.approx(
        float(agreement), abs=0.01)
    assert abs(float(losses.acceptance_alpha(draft, target).mean()) - float(agreement)) > 0.05  # T = 1 is not


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.0, 1.3, 2.0])
def test_alpha_from_a_stored_top_n_stays_a_lower_bound_at_any_temperature(temperature):
    gen = torch.Generator().manual_seed(1)
    draft, target = torch.randn(300, 64, generator=gen) * 4, torch.randn(300, 64, generator=gen) * 4
    target[:100] = draft[:100]
    exact = losses.acceptance_alpha(draft, target, temperature=temperature)
    top_lp, top_ids = torch.log_softmax(target, -1).topk(8, dim=-1)
    bound = losses.acceptance_alpha_topn(draft, top_ids, top_lp, temperature=temperature, target_vocab=64)
    assert bool((bound <= exact + 1e-6).all())
    if temperature <= 1.0:  # at most 1: the unseen mass only shrinks, and the bound stays close
        assert float((exact - bound).mean()) < 0.03
    # the whole vocabulary stored: nothing is unseen, and the bound is the figure itself
    full_lp, full_ids = torch.log_softmax(target, -1).topk(64, dim=-1)
    assert torch.allclose(losses.acceptance_alpha_topn(draft, full_ids, full_lp, temperature=temperature,
                                                       target_vocab=64), exact, atol=1e-5)


def test_heldout_temperatures_must_be_finite_and_positive():
    assert TrainConfig().heldout_temperatures == [0.7, 1.0]
    for bad in ([0.0], [0.7, -1.0], [float("inf")], [float("nan")]):
        with pytest.raises(ValueError, match="heldout_temperatures must list finite temperatures > 0"):
            TrainConfig(heldout_temperatures=bad)


# ---- held-out alpha in a short run -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return save_tiny_world(tmp_path_factory.mktemp("sampled"), target_layers=4, small_seed=7, n_train=8, n_heldout=4)


def _short_run(ws: Path, out: Path, **kw) -> list[dict]:
    from specdec.train import distill

    cfg = TrainConfig(**{**dict(target=str(ws / "target"), train_data=str(ws / "data"),
                                heldout_data=str(ws / "heldout"), output_dir=str(out), device="cpu", draft_layers=[0],
                                max_steps=1, per_device_batch_size=4, warmup_steps=0, eval_every=0, save_every=0,
                                eval_samples=4, eval_batch_size=2, heldout_temperatures=[0.7, 1.0]), **kw})
    distill.run(cfg)
    return [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("kind", [dict(teacher="online"), dict(teacher="offline", loss="fkl"),
                                  dict(draft="eagle3", teacher="online", eagle_aux_layer_ids=[1, 2, 3],
                                       draft_vocab_size=40)], ids=["plain-online", "plain-topn", "eagle3-topn"])
def test_a_short_run_reports_alpha_at_each_heldout_temperature(workspace, tmp_path, kind):
    history = _short_run(workspace, tmp_path / "run", **kind)
    assert [h["step"] for h in history] == [0, 1]
    for record in history:
        assert set(record["alpha_at"]) == {"0.7", "1.0"}
        assert all(0.0 <= a <= 1.0 for a in record["alpha_at"].values())
        assert record["alpha_at"]["1.0"] == pytest.approx(record["alpha"], abs=1e-6)  # the same figure at T = 1
        assert record["alpha_at"]["0.7"] != pytest.approx(record["alpha"], abs=1e-6)
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert set(summary["best"]["metrics"]["alpha_at"]) == {"0.7", "1.0"}
    # a stored top-n gives a lower bound, said as before; the online plain teacher's is exact
    assert history[0]["alpha_is_lower_bound"] == (kind != dict(teacher="online"))


# ---- eval, card and demo ------------------------------------------------------------------------------------


def _eval(ckpt, out, *extra):
    return main(["eval", "--target", ckpt["target"], "--draft", ckpt["draft"], "--prompts", ckpt["prompts"],
                 "--max-new-tokens", "8", "--out", str(out), "dtype=float64", "cost_repeats=2", "threads=1",
                 "--num-draft-tokens", "2", "warmup=0", *extra])


def test_eval_measures_sampled_acceptance_beside_the_unchanged_greedy_run(tiny_checkpoints, tmp_path):
    from test_publish import _info

    from specdec.train.model_card import render_card

    assert _eval(tiny_checkpoints, tmp_path / "greedy") == 0
    assert _eval(tiny_checkpoints, tmp_path / "both", "sampled_acceptance_temperature=0.7") == 0
    greedy, both = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("greedy", "both"))
    assert "sampled" not in greedy
    for key in ("acceptance_rate", "mean_accepted_tokens", "per_position_acceptance", "rounds", "accepted"):
        assert both["speculative"][key] == greedy["speculative"][key]  # the timed greedy run is untouched
    assert both["equivalence"] == {**both["equivalence"], "mode": "greedy", "passed": True}
    sampled = both["sampled"]
    assert sampled["temperature"] == 0.7 and sampled["num_draft_tokens"] == 2 and sampled["num_prompts"] == 4
    assert 0.0 <= sampled["acceptance_rate"] <= 1.0 and sampled["rounds"] > 0
    assert sampled["acceptance_rate"] == pytest.approx(sampled["accepted"] / sampled["proposed"])
    md = (tmp_path / "both" / "report.md").read_text()
    assert "## Sampled at T=0.7" in md and f"**{sampled['acceptance_rate']:.3f}**" in md
    assert "## Sampled" not in (tmp_path / "greedy" / "report.md").read_text()
    card = render_card(_info(), both)
    assert f"| acceptance rate sampled at T=0.7 (same proposal and prompts, untimed) | " \
           f"{sampled['acceptance_rate']:.3f} |" in card
    assert "measured at: 0 (greedy) and 0.7 (acceptance only, untimed)" in card
    assert "sampled at T=" not in render_card(_info(), greedy)


def test_a_negative_sampled_acceptance_temperature_is_refused(tiny_checkpoints, tmp_path, capsys):
    assert _eval(tiny_checkpoints, tmp_path, "sampled_acceptance_temperature=-1") == 2
    assert "sampled_acceptance_temperature must be > 0" in capsys.readouterr().err


def test_the_demo_measures_at_0_7_beside_greedy_and_counts_it_in_its_budget(monkeypatch):
    from specdec import demo

    stages = demo.stage_configs(demo.DemoConfig(quick=True, output_dir="out"))
    assert stages.eval.sampled_acceptance_temperature == 0.7
    off = demo.stage_configs(demo.DemoConfig(quick=True, output_dir="out", sampled_temperature=0))
    assert off.eval.sampled_acceptance_temperature == 0
    with pytest.raises(ValueError, match="sampled_temperature"):
        demo.DemoConfig(sampled_temperature=-0.5)
    assert ", acceptance also at T=0.7 -> out/eval" in "\n".join(demo.plan_lines(demo.DemoConfig(quick=True), stages))

    report = {"config": {"temperature": 0.0}, "speculative": {"acceptance_rate": 0.61, "mean_accepted_tokens": 2.2},
              "sampled": {"temperature": 0.7, "acceptance_rate": 0.42, "mean_accepted_tokens": 1.8}}
    assert demo.acceptance_summary(report) == {
        "timed": {"temperature": 0.0, "acceptance_rate": 0.61, "mean_accepted_tokens": 2.2},
        "sampled": {"temperature": 0.7, "acceptance_rate": 0.42, "mean_accepted_tokens": 1.8}}
    assert "sampled T=0.7   acceptance rate 0.420" in demo._sampled_lines(report)[0]

    # the budget's estimate counts the sampled pass as one more decode of every prompt
    class _Target:
        device = "cpu"

    clock = iter([0.0, 1.0, 2.0, 2.0 + 16 * 0.01 + 1.0])  # prefill 1 s, then 16 steps of 10 ms each
    monkeypatch.setattr("specdec.models.load_model", lambda *a, **k: _Target())
    monkeypatch.setattr("specdec.decode.target_generate", lambda *a, **k: None)
    monkeypatch.setattr(demo.time, "perf_counter", lambda: next(clock))
    minutes = demo.estimate_eval_minutes(stages.eval)
    clock = iter([0.0, 1.0, 2.0, 2.0 + 16 * 0.01 + 1.0])
    without = demo.estimate_eval_minutes(off.eval)
    assert minutes - without == pytest.approx(8 * stages.eval.max_new_tokens * 0.01 / 60)
