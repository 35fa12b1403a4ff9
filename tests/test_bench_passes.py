"""bench/passes.py's reading of its curves (the basis of `specdec demo`'s train_passes), without training: where a
further pass stops paying, and the fitted best passes in a fixed time."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import passes  # noqa: E402  (bench/passes.py)


def _curve(examples: int, taus: list[float], rows: int = 16, every: int = 8) -> dict:
    points = [{"step": i * every, "passes": i * every * rows / examples, "tau3": t, "agreement": 0.0}
              for i, t in enumerate(taus)]
    return {"folder": "f", "examples": examples, "steps": points[-1]["step"], "rows": rows, "points": points,
            "minutes": 1.0}


def test_a_pass_stops_paying_only_when_every_later_one_does_too():
    curve = _curve(128, [1.0, 1.2, 1.3, 1.305, 1.4, 1.402, 1.403])["points"]  # 1 pass per evaluation
    # the 3rd pass adds little, but the 4th pays again: the answer is 4 (none after it pays), not 2
    assert passes.paying_passes(curve, pays=0.01) == 4.0
    assert passes.paying_passes(_curve(128, [1.0, 1.2, 1.4, 1.6])["points"], pays=0.01) is None


def test_more_data_worth_more_moves_the_best_passes_down():
    taus = [1.0, 1.2, 1.3, 1.35, 1.38, 1.39, 1.395, 1.4, 1.4]  # gains flatten after ~6 passes
    flat = passes.best_passes([_curve(128, taus), _curve(256, [1.0, 1.4])], ratios=(2.0,))
    steep = passes.best_passes([_curve(128, taus), _curve(256, [1.0, 1.8])], ratios=(2.0,))
    best = [float(line.split("|")[2]) for line in (flat[-2], steep[-2])]
    assert best[1] < best[0]  # the larger data's gain grows faster with N: fewer passes, more data
    assert "N^0.00" in flat[0] and "N^1.00" in steep[0]
    assert passes.best_passes([_curve(128, taus)], ratios=(2.0,)) == [
        "(one data size: no fit of the gain against the data's size)"]
