"""bench/kinds.py, the one-budget comparison of draft kinds (issues 36 and 37), at its tiny size: `--quick --no-vllm`
with two kinds trains each for its minutes on data it makes, scores, publishes and evaluates both, and writes a page
with one row per kind whose figures are all numbers (acceptance past the first proposal may be n/a: a barely trained
draft's rounds may never reach it), and the ratios against EAGLE-3 of the same run.

Also, without a model: the per-position acceptance of the held-out ranks, and a data folder recorded at other
layers refused with the fix."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import kinds  # noqa: E402  (bench/kinds.py)
import kinds_runs  # noqa: E402  (bench/kinds_runs.py)


def test_per_position_acceptance_follows_the_greedy_rounds():
    # one completion of 6 positions; rank 0 = the draft's first choice is the target's token
    ranks = [[[0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 9, 9], [0, 9, 9, 9], [9, 9, 9, 9]]]
    # the round at 0 accepts 2 of 4 and fails its 3rd; the next starts at 3 (after the correction) and fails its 3rd
    # (past the end); nothing reaches the 4th proposal
    acceptance = kinds_runs.per_position(ranks, 4)
    assert acceptance[:3] == [1.0, 1.0, 0.0] and math.isnan(acceptance[3])
    assert kinds_runs.per_position([[[1, 0, 0, 0]]], 4)[0] == 0.0


def test_a_data_folder_recorded_at_other_layers_is_refused_with_the_fix(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"features": {"layer_ids": [1, 2]}}))
    with pytest.raises(ValueError, match=r"records the target's states at layers \[1, 2\].*eagle_aux_layer_ids"):
        kinds.check_recorded(tmp_path, [2, 15, 27], "--data")


@pytest.mark.slow
def test_quick_bench_writes_a_row_of_finite_figures_per_kind(tmp_path):
    page = tmp_path / "kinds.md"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kinds.py"), "--quick", "--no-vllm", "--kinds",
                           "eagle3", "dflash-b4", "--work", str(tmp_path / "work"), "--out", str(page)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = page.read_text()
    assert "- commit:" in text and "- machine:" in text and "--quick" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert {"eagle3", "dflash-b4"} <= rows.keys()
    for kind in ("eagle3", "dflash-b4"):
        cells = [c.strip() for c in rows[kind].strip("|").split("|")]
        acceptance, taus = cells[2].split(" / "), cells[3].split(" / ")
        assert len(acceptance) == 4 and math.isfinite(float(acceptance[0]))
        assert all(float(t) >= 1.0 for t in taus)  # every round emits at least its correction or bonus token
        steps, k, *figures = cells[1:2] + cells[4:10]
        assert int(steps) > 0 and 1 <= int(k) <= kinds_runs.max_k(kind)
        assert all(math.isfinite(float(x)) and float(x) > 0 for x in figures), figures
        ratios = cells[10].split(", ")
        assert len(ratios) == 4 and all(r.startswith("x") and math.isfinite(float(r[1:])) for r in ratios)
    assert rows["eagle3"].rstrip(" |").endswith("x1.00, x1.00, x1.00, x1.00")
    assert "dflash-b4" in text.split("issue 37")[1].split("\n")[0]  # its round cost at k = 4 against k = 1
