"""eval/intervals.py: the bootstrap intervals of a run's acceptance rate and speedup over its prompt batches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdec.eval import intervals


def _calls(per_batch: list[tuple[float, float, float, float]]):
    """Target-only and speculative calls, one batch of one prompt each: (accepted, proposed, target s, spec s)."""
    base = [SimpleNamespace(rows=[i], seconds=b) for i, (_, _, b, _) in enumerate(per_batch)]
    spec = [SimpleNamespace(rows=[i], seconds=s, stats=SimpleNamespace(accepted=a, proposed=p))
            for i, (a, p, _, s) in enumerate(per_batch)]
    return base, spec


def test_the_intervals_hold_the_runs_figures_and_narrow_with_more_prompts():
    rates = [0.2, 0.7, 0.4, 0.55, 0.3, 0.65]
    few = [(r * 50, 50, 2.0, 2.0 / (1 + r)) for r in rates]
    acceptance = sum(a for a, *_ in few) / sum(p for _, p, *_ in few)
    speedup = sum(b for *_, b, _ in few) / sum(s for *_, s in few)
    small = intervals.bootstrap(*_calls(few))
    assert small["batches"] == 6 and small["level"] == 0.95
    low, high = small["acceptance_rate"]
    assert low < acceptance < high and 0.2 < low and high < 0.7  # inside the batches' own range
    assert small["speedup"][0] < speedup < small["speedup"][1]
    # Four times the prompts of the same kinds: an interval about half as wide.
    large = intervals.bootstrap(*_calls(few * 4))
    assert large["acceptance_rate"][1] - large["acceptance_rate"][0] < 0.7 * (high - low)
    # Seeded: the report's figures repeat.
    assert intervals.bootstrap(*_calls(few)) == small


def test_equal_batches_give_a_point_and_one_batch_gives_none():
    same = intervals.bootstrap(*_calls([(20, 40, 3.0, 2.0)] * 5))
    assert same["acceptance_rate"] == pytest.approx([0.5, 0.5]) and same["speedup"] == pytest.approx([1.5, 1.5])
    assert intervals.bootstrap(*_calls([(20, 40, 3.0, 2.0)])) is None
    assert intervals.markdown_line(None, 1) == [] and intervals.summary_text(None, "speedup") == ""


def test_the_pairs_stay_together():
    """A batch's speculative time is only ever divided into its own target-only time: with every batch 2x faster
    but the batches' lengths wildly unequal, every resample still reads 2x."""
    calls = _calls([(1, 2, t, t / 2) for t in (0.1, 5.0, 1.0, 30.0)])
    assert intervals.bootstrap(*calls)["speedup"] == pytest.approx([2.0, 2.0])
    line = intervals.markdown_line(intervals.bootstrap(*calls), 4)[0]
    assert line.startswith("95% intervals over the 4 prompts") and "speedup 2.000x-2.000x" in line


def test_the_demos_summary_prints_both_intervals(capsys, tmp_path):
    from specdec.demo import _print_summary

    report = {"config": {"target": "t", "num_draft_tokens": 1, "temperature": 0},
              "speculative": {"acceptance_rate": 0.47, "mean_accepted_tokens": 1.47}, "speedup": 1.27,
              "equivalence": {"passed": True}, "decision": {"verdict": "keep-target-only", "reasons": []},
              "intervals": {"level": 0.95, "acceptance_rate": [0.4234, 0.5121], "speedup": [1.214, 1.333]}}
    _print_summary(report, tmp_path, tmp_path, {"eval_s": 60.0})
    out = capsys.readouterr().out
    assert "acceptance rate   0.470 (greedy), 95% interval 0.423-0.512 over the prompts" in out
    assert "(same run, same prompts), 95% interval 1.21x-1.33x over the prompts" in out
    _print_summary({**report, "intervals": None}, tmp_path, tmp_path, {"eval_s": 60.0})
    assert "interval" not in capsys.readouterr().out
