"""bench/gpu_check.py, the prepared GPU check (issue 39): its page holds every step's figures or that step's error (a
step that raises or runs out of time costs only its own section, and the page is rewritten after each step), it
selects the tests that skip without CUDA, it reads pytest's outcome from a finished or a stopped run, and (slow) the
whole check runs at tiny shapes on this CPU, each step with its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402  (bench/gpu_check.py)

COSTS = {"context": 8, "repeats": 2, "target_step_ms": 2.0, "draft_step_ms": 1.0, "c": 0.5,
         "v": {"1": 1.0, "2": 1.25}, "target-only_tokens_per_s": 10.0, "speculative_tokens_per_s": 12.5,
         "new_tokens": 4, "acceptance_rate": 0.25, "mean_accepted_tokens": 1.75, "fallback": False, "identical": True}


def test_a_failing_step_keeps_the_others_figures_and_the_page_follows_each_step(tmp_path):
    page = tmp_path / "page.md"
    seen = []

    def fails(_cap):
        raise RuntimeError("no device here")

    def measures(cap):
        seen.append(page.read_text())  # what the page held once the failing step was over
        assert cap > 0
        return {"figures": COSTS}

    results = gpu_check.run_check({"trainer": fails, "costs": measures}, page, ["# check", ""], 1.0, tiny=True)
    assert "RuntimeError: no device here" in seen[0] and "c = 0.500" not in seen[0]
    text = page.read_text()
    assert text.index("## b. ") < text.index("## d. ")
    trainer = text[text.index("## b. "):text.index("## d. ")]
    assert "FAILED" in trainer and "RuntimeError: no device here" in trainer
    costs = text[text.index("## d. "):text.index("## Figures")]
    assert costs.splitlines()[2].startswith("ok") and "c = 0.500" in costs and "| v(n) | 1.00 | 1.25 |" in costs
    assert "output identical to target-only" in costs
    assert json.loads(text.split("```json", 1)[1].split("```", 1)[0]) == {"trainer": None, "costs": COSTS}
    assert set(results) == {"trainer", "costs"} and results["costs"]["minutes"] >= 0


def test_a_step_out_of_time_is_stopped_with_its_log(tmp_path):
    log = tmp_path / "step.log"
    rc, stopped = gpu_check.run_logged([sys.executable, "-c", "import time; print('started', flush=True); "
                                        "time.sleep(120)"], log, timeout_s=3)
    assert stopped and rc != 0 and "started" in log.read_text()


def test_the_selected_tests_are_those_that_skip_without_cuda():
    nodes = gpu_check.cuda_tests()
    assert "tests/test_cuda.py" in nodes  # its module-level skipif: the whole file
    assert "tests/test_eagle3_attention.py::test_on_cuda_chunked_equals_dense_and_keeps_no_quadratic_memory" in nodes
    assert not any(n.startswith("tests/test_cuda.py::") for n in nodes)


def test_pytest_outcomes_of_a_finished_and_of_a_stopped_run():
    finished = "\n".join([
        "tests/test_cuda.py::test_a PASSED [ 50%]", "tests/test_cuda.py::test_b FAILED [100%]",
        "============================= slowest 5 durations ==============================",
        "12.50s call     tests/test_cuda.py::test_b", "",
        "FAILED tests/test_cuda.py::test_b - AssertionError: assert 1 == 2",
        "==================== 1 failed, 1 passed in 13.10s ===================="])
    figures = gpu_check.pytest_figures(finished)
    assert (figures["passed"], figures["failed"], figures["skipped"]) == (1, 1, 0)
    assert figures["summary"] == "1 failed, 1 passed in 13.10s"
    assert figures["failures"] == ["FAILED tests/test_cuda.py::test_b - AssertionError: assert 1 == 2"]
    assert figures["slowest"] == ["12.50s call     tests/test_cuda.py::test_b"]
    stopped = gpu_check.pytest_figures("tests/test_cuda.py::test_a[x] PASSED [ 5%]\ntests/test_cuda.py::test_b ")
    assert stopped["passed"] == 1 and stopped["summary"].startswith("(no summary")


@pytest.mark.slow
def test_the_whole_check_at_tiny_shapes_writes_every_steps_figures(tmp_path):
    pytest.importorskip("speculators.models.eagle3", reason="speculators 0.9.0 is not installed (scripts/setup.sh)")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--tiny", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (page,) = tmp_path.glob("*-gpu-check-tiny.md")
    text = page.read_text()
    for title in gpu_check.TITLES.values():
        section = text.split(f"## {title}", 1)[1]
        assert section.split("\n", 3)[2].startswith("ok"), section[:3000]
    figures = json.loads(text.split("```json", 1)[1].split("```", 1)[0])
    tests = figures["tests"]
    assert tests["failed"] == tests["error"] == 0 and tests["skipped"] + tests["passed"] >= 20
    trainer = figures["trainer"]
    assert trainer["tokens_per_s"] > 0 and trainer["ttt_steps"] == 7 and trainer["mixed_precision"] in ("bf16", "no")
    assert trainer["peak_gib"] > 0 and trainer["plan_compared_gib"] > 0 and trainer["ratio"] > 0
    assert figures["peer"]["tokens_per_s"] > 0 and figures["peer"]["peak_gib"] > 0
    assert sorted(map(int, figures["costs"]["v"])) == list(range(1, 17)) and figures["costs"]["c"] > 0
    assert "| specdec (train/distill.py) |" in text and "| speculators Eagle3DraftModel" in text
