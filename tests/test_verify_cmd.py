"""`specdec verify`: passes for the real sampler, fails for a deliberately wrong one, and checks a user's pair."""

from __future__ import annotations

import json

import specdec.verify
from specdec.cli import main

FAST = ["--temperature", "1.0", "--top-k", "0", "--top-p", "1.0", "--batch-size", "1000,1", "--samples", "2000",
        "--samples-batch1", "30"]
WRONG = [*FAST, "--batch-size", "1000", "--samples", "1000"]


def test_verify_passes_for_the_exact_sampler(tmp_path, capsys):
    assert main(["verify", *FAST, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "speculative vs exact" in out
    result = json.loads((tmp_path / "verify.json").read_text())
    assert result["passed"] and len(result["tests"]) == 4  # 3 at batch 1000, 1 at batch 1
    assert {t["batch_size"] for t in result["tests"]} == {1000, 1}
    assert all(t["p_value"] >= 1e-3 and t["tv"] <= t["tv_tolerance"] for t in result["tests"])


def test_verify_fails_when_the_residual_is_wrong(monkeypatch, tmp_path, capsys):
    # Sampling the correction from p instead of norm(max(p - q, 0)) over-weights tokens the draft likes.
    monkeypatch.setattr(specdec.verify, "residual_distribution", lambda p, q: p)
    assert main(["verify", *WRONG, "--out", str(tmp_path)]) == 1
    result = json.loads((tmp_path / "verify.json").read_text())
    failed = {t["test"] for t in result["tests"] if not t["passed"]}
    assert "speculative vs exact" in failed and "target-only vs exact" not in failed
    assert "FAIL" in capsys.readouterr().out


def test_verify_fails_when_acceptance_ignores_q(monkeypatch, tmp_path):
    # Accepting every draft token (min(1, p/q) replaced by 1) makes the output distributed as q, not p.
    monkeypatch.setattr(specdec.verify, "acceptance_probability", lambda p_x, q_x: (q_x > 0).to(q_x.dtype))
    assert main(["verify", *WRONG, "--out", str(tmp_path)]) == 1


def test_verify_on_a_user_pair(tiny_checkpoints, tmp_path, capsys):
    assert main(["verify", "--target", tiny_checkpoints["target"], "--draft", tiny_checkpoints["draft"],
                 "--prompts", tiny_checkpoints["prompts"], "--num-prompts", "2", "--temperature", "1.0",
                 "--top-k", "0", "--top-p", "1.0", "--samples", "400", "--batch-size", "200",
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "verify.json").read_text())
    assert result["passed"] and len(result["tests"]) == 2 and result["num_tokens"] == 2


def test_verify_bad_input_exits_2(capsys):
    assert main(["verify", "--temperature", "0"]) == 2
    assert "temperature > 0" in capsys.readouterr().err
    assert main(["verify", "--target", "x"]) == 2
    assert "both --target and --draft" in capsys.readouterr().err
    assert main(["verify", "--temperature", "1,0.5", "--top-k", "0,1,2"]) == 2
    assert "one length" in capsys.readouterr().err
    assert main(["verify", "--help"]) == 0
