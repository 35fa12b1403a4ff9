"""`specdec eval` end to end on tiny saved checkpoints, and its bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_llama, tiny_tokenizer

from specdec.cli import main
from specdec.eval import proposals
from specdec.proposal import Proposal

BASELINE_KEYS = {"tokens_per_s", "latency_s", "ttft_s", "itl_s", "peak_memory_mb"}
SPEC_KEYS = BASELINE_KEYS | {"acceptance_rate", "mean_accepted_tokens", "per_position_acceptance", "rounds",
                             "proposed", "accepted", "corrections", "bonus"}


def _eval(ckpt, out, *extra):
    return main(["eval", "--target", ckpt["target"], "--draft", ckpt["draft"], "--prompts", ckpt["prompts"],
                 "--max-new-tokens", "8", "--out", str(out), "dtype=float64", "cost_repeats=2", "threads=1", *extra])


def test_eval_greedy_sweep_writes_a_complete_report(tiny_checkpoints, tmp_path):
    assert _eval(tiny_checkpoints, tmp_path, "--num-draft-tokens", "1,3", "--batch-size", "1,2",
                 "--temperature", "0", "--min-speedup", "100") == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert {"target", "draft", "num_draft_tokens", "temperature", "top_k", "top_p", "max_new_tokens", "batch_size",
            "seed", "num_prompts", "warmup"} <= set(report["config"])
    assert {"python", "torch", "transformers", "device", "threads"} <= set(report["environment"])
    assert BASELINE_KEYS <= set(report["baseline"]) and SPEC_KEYS <= set(report["speculative"])
    assert set(report["baseline"]["latency_s"]) == {"p50", "p95", "p99"}
    assert set(report["speculative"]["ttft_s"]) == {"p50", "p95"} == set(report["speculative"]["itl_s"])
    k = report["config"]["num_draft_tokens"]
    assert k in (1, 3) and report["config"]["batch_size"] in (1, 2) and report["config"]["num_prompts"] == 4
    assert len(report["speculative"]["per_position_acceptance"]) == k
    assert report["speedup"] > 0 and report["analytical_speedup"] > 0
    spec = report["speculative"]
    assert spec["proposed"] >= spec["accepted"] and spec["rounds"] > 0
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["proposed"])

    # Greedy: the exact decoder must reproduce the baseline token for token, in every configuration.
    eq = report["equivalence"]
    assert eq == {**eq, "mode": "greedy", "passed": True, "checked": 4, "mismatches": 0}
    assert len(report["sweep"]) == 4 and all(r["equivalence_passed"] for r in report["sweep"])
    assert {(r["num_draft_tokens"], r["batch_size"]) for r in report["sweep"]} == {(1, 1), (3, 1), (1, 2), (3, 2)}
    # A 100x speedup threshold cannot hold: the verdict keeps the target, and says why.
    assert report["decision"]["verdict"] == "keep-target-only"
    assert any("speedup" in r and "FAILS" in r for r in report["decision"]["reasons"])
    assert set(report["categories"]) == {"writing", "math"}
    # How close the verdict's call was: bootstrap intervals over the recommended row's prompt batches.
    ivs = report["intervals"]
    assert ivs["level"] == 0.95 and ivs["batches"] == 4 // report["config"]["batch_size"]
    assert ivs["acceptance_rate"][0] <= spec["acceptance_rate"] <= ivs["acceptance_rate"][1]
    assert ivs["speedup"][0] <= report["speedup"] <= ivs["speedup"][1]

    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [x["prompt_id"] for x in lines] == ["1", "2", "3", "4"]
    assert all(set(x) == {"prompt_id", "category", "baseline_tokens", "speculative_tokens"} for x in lines)
    assert all(x["baseline_tokens"] == x["speculative_tokens"] and 0 < len(x["baseline_tokens"]) <= 8 for x in lines)

    for name in ("per_position_acceptance", "latency_cdf", "speedup_vs_k"):
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report.md").read_text()
    assert "keep-target-only" in md and "## Sweep" in md and "tau_hat / (k * c + v)" in md
    assert "95% intervals over the 4 prompts" in md
    assert "](latency_cdf.png)" in md and "## By category" in md
    # The CPU linear kernels the run measured and kept (specdec/fast_linear.py), for the rows it decoded.
    kernels = report["cpu_linear_kernels"]
    assert {1, 4} <= {entry["rows"] for entry in kernels}  # one-token steps and k = 3 verifications
    assert {entry["kernel"] for entry in kernels} <= {"F.linear", "W@x^T", "W@x^T padded", "oneDNN packed"}
    assert "CPU linear kernels kept per (layer shape, rows)" in md


def test_eval_enables_when_every_threshold_holds(tiny_checkpoints, tmp_path):
    assert _eval(tiny_checkpoints, tmp_path, "--num-draft-tokens", "2", "min_acceptance_rate=0", "min_speedup=0.01",
                 "max_memory_overhead=1000", "warmup=0", "num_prompts=2") == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["decision"]["verdict"] == "enable", report["decision"]["reasons"]
    assert "sweep" not in report and report["config"]["num_prompts"] == 2


def test_eval_sampling_points_to_verify(tiny_checkpoints, tmp_path):
    assert _eval(tiny_checkpoints, tmp_path, "--num-draft-tokens", "2", "--temperature", "1.0", "--top-k", "20",
                 "num_prompts=2", "equivalence_samples=64", "warmup=0") == 0
    report = json.loads((tmp_path / "report.json").read_text())
    eq = report["equivalence"]
    assert eq["mode"] == "sampling" and "specdec verify" in eq["note"] and eq["checked"] == 64
    assert isinstance(eq["passed"], bool) and eq["tests"]
    assert "specdec verify" in (tmp_path / "report.md").read_text()


def test_eval_from_a_recipe_section(tiny_checkpoints, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {tiny_checkpoints['target']}\ndraft: {tiny_checkpoints['draft']}\n"
                      f"eval:\n  prompts: {tiny_checkpoints['prompts']}\n  num_draft_tokens: [2]\n"
                      f"  max_new_tokens: 4\n  num_prompts: 1\n  warmup: 0\n  dtype: float64\n")
    assert main(["eval", "--config", str(recipe), f"out={tmp_path / 'o'}", "cost_repeats=1"]) == 0
    assert json.loads((tmp_path / "o" / "report.json").read_text())["config"]["max_new_tokens"] == 4


@pytest.fixture(scope="module")
def foreign_draft(tmp_path_factory):
    """A draft whose tokenizer names a different EOS token: incompatible with the tiny target."""
    from specdec.models import save_model

    tok = tiny_tokenizer()
    tok.eos_token = "<s>"
    return str(save_model(tiny_llama(seed=1, layers=1), tok, tmp_path_factory.mktemp("foreign") / "draft"))


def _bad_prompts(tmp_path: Path, text: str) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-draft-tokens", "0"], "num_draft_tokens must be integers >= 1"),
        (["--num-draft-tokens", "2,-1"], "num_draft_tokens must be integers >= 1"),
        (["recommend_by=accuracy"], "unknown recommend_by metric"),
        (["plot_format=gif"], "unknown plot_format"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["no_such_key=1"], "unknown config key"),
        (["--batch-size", "0"], "batch_size must be integers >= 1"),
    ],
)
def test_eval_bad_options_exit_2_with_the_fix(tiny_checkpoints, tmp_path, capsys, args, message):
    assert _eval(tiny_checkpoints, tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "is empty"), ('{"prompt": "the day"}\nnot json\n', "line 2 is not valid JSON"),
     ('{"text": "the day"}\n', "none of which holds a prompt")],
)
def test_eval_bad_prompt_files_exit_2(tiny_checkpoints, tmp_path, capsys, text, message):
    ckpt = {**tiny_checkpoints, "prompts": _bad_prompts(tmp_path, text)}
    assert _eval(ckpt, tmp_path / "out") == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "report.json").exists()


def test_eval_incompatible_draft_exits_2(tiny_checkpoints, foreign_draft, tmp_path, capsys):
    assert _eval({**tiny_checkpoints, "draft": foreign_draft}, tmp_path) == 2
    err = capsys.readouterr().err
    assert "tokenizer differs from the target's" in err and "eos_token" in err


def test_eval_missing_draft_and_out(tiny_checkpoints, tmp_path, capsys):
    assert main(["eval", "--target", tiny_checkpoints["target"], "--prompts", tiny_checkpoints["prompts"]]) == 2
    assert "pass --draft" in capsys.readouterr().err
    assert main(["eval", "--target", tiny_checkpoints["target"], "--draft", tiny_checkpoints["draft"],
                 "--prompts", tiny_checkpoints["prompts"]]) == 2
    assert "--out DIR" in capsys.readouterr().err
    assert main(["eval", "--help"]) == 0


def test_embedded_heldout_prompt_set_resolves():
    from specdec.eval.verify import resolve_prompts_path

    path = resolve_prompts_path("embedded:heldout")
    assert path.name == "prompts_heldout.jsonl" and path.is_file()
    assert resolve_prompts_path("mine.jsonl") == Path("mine.jsonl")


@pytest.mark.slow
def test_eval_on_the_embedded_target_with_a_derived_draft(tmp_path):
    """The real SmolLM2 target and a 2-layer draft derived from it: greedy outputs must match token for token."""
    from specdec.models import EMBEDDED_TARGET, load_model, load_tokenizer, save_model
    from specdec.train.draft import derive_draft

    target = load_model(EMBEDDED_TARGET, dtype="float32", device="cpu")
    draft_dir = save_model(derive_draft(target, [0, 1]), load_tokenizer(EMBEDDED_TARGET), tmp_path / "draft")
    del target
    assert main(["eval", "--target", EMBEDDED_TARGET, "--draft", str(draft_dir), "--prompts", "embedded:heldout",
                 "num_prompts=2", "--max-new-tokens", "12", "--num-draft-tokens", "2", "warmup=0", "threads=1",
                 "cost_repeats=2", "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["equivalence"]["passed"] and report["equivalence"]["checked"] == 2
    # Its embeddings (and the head tied to them) are the target's: 49,152 x 576 floats, shared, counted once.
    assert report["memory"]["shared_with_target_mb"] == pytest.approx(49152 * 576 * 4 / 2**20)
    assert 25 < report["memory"]["draft_weights_mb"] < 30  # its own: 2 layers of 3.54M parameters, a norm


def test_eval_report_to_wandb(tiny_checkpoints, tmp_path, capsys, monkeypatch):
    """Offline wandb logging when wandb is installed; otherwise a clean error saying how to install it."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        assert _eval(tiny_checkpoints, tmp_path, "report_to=wandb") == 2
        assert "pip install" in capsys.readouterr().err
        return
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, value)
    assert _eval(tiny_checkpoints, tmp_path / "out", "report_to=wandb", "run_name=t", "num_prompts=1",
                 "warmup=0") == 0
    assert list((tmp_path / "out" / "wandb").glob("offline-run-*"))  # beside the report, whatever ran before


def test_eval_catches_a_decoder_that_is_not_exact(tiny_checkpoints, tmp_path, monkeypatch):
    """A verifier that accepts every draft token breaks greedy identity: the report lists it and keeps the target."""
    import specdec.decode
    from specdec.verify import Verdict

    def accept_all(draft_tokens, target_logits):
        k = draft_tokens.shape[1]
        return Verdict(draft_tokens.new_full((draft_tokens.shape[0],), k), target_logits[:, k].argmax(-1))

    monkeypatch.setattr(specdec.decode, "greedy_verify", accept_all)
    assert _eval(tiny_checkpoints, tmp_path, "--num-draft-tokens", "2", "min_acceptance_rate=0", "min_speedup=0.01",
                 "max_memory_overhead=1000", "warmup=0") == 0
    report = json.loads((tmp_path / "report.json").read_text())
    eq = report["equivalence"]
    assert not eq["passed"] and eq["mismatches"] >= 1 and eq["mismatched_prompts"][0]["position"] >= 1
    assert report["decision"]["verdict"] == "keep-target-only"
    assert "equivalence failed (FAILS)" in report["decision"]["reasons"]
    assert "| first differing position |" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("recipe", sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_eval_section_builds_a_config(recipe):
    from specdec.config import load_config
    from specdec.eval.config import EvalConfig

    cfg = load_config(EvalConfig, recipe, [], section="eval")
    assert cfg.draft and cfg.num_draft_tokens and cfg.out_dir().name == "eval"


def _check_choice(ck: dict) -> None:
    """choose_k's choice: the fastest predicted among the candidates that fail no gate (the fastest overall when
    none passes), with the fastest overall and each candidate's failed gates beside it."""
    label = proposals.label
    speed = {p: (ck["predicted_speedup"][label(p)], -Proposal.of(p).verified_nodes) for p in ck["candidates"]}
    passing = [p for p in ck["candidates"] if not ck["failed_gates"][label(p)]]
    assert ck["fastest"] == max(ck["candidates"], key=speed.get)
    assert ck["chosen"] == (max(passing, key=speed.get) if passing else ck["fastest"])
    assert set(ck["failed_gates"]) == {label(p) for p in ck["candidates"]}
    assert all(set(f) <= {"acceptance_rate", "speedup", "memory"} for f in ck["failed_gates"].values())


def test_choose_k_predicts_tau_exactly_and_measures_only_the_chosen_k(tiny_checkpoints, tmp_path):
    assert _eval(tiny_checkpoints, tmp_path, "choose_k=1,2,3", "choose_k_prompts=4", "num_prompts=4",
                 "--temperature", "0", "warmup=0") == 0
    report = json.loads((tmp_path / "report.json").read_text())
    ck = report["choose_k"]
    assert ck["candidates"] == [1, 2, 3] and ck["prompts"] == 4
    _check_choice(ck)
    assert report["config"]["num_draft_tokens"] == ck["chosen"] and "sweep" not in report
    # Greedy on the same prompts: the teacher-forced replay is the decoder's own tokens per round.
    assert ck["tau"][f"k={ck['chosen']}"] == pytest.approx(report["speculative"]["mean_accepted_tokens"])
    assert "was chosen before the timed runs" in (tmp_path / "report.md").read_text()
    # The target as its own draft accepts everything: tau well above 1, and still replayed exactly.
    perfect = {**tiny_checkpoints, "draft": tiny_checkpoints["target"]}
    assert _eval(perfect, tmp_path / "p", "choose_k=2,3", "num_prompts=4", "choose_k_prompts=4", "warmup=0") == 0
    report = json.loads((tmp_path / "p" / "report.json").read_text())
    ck = report["choose_k"]
    assert ck["tau"]["k=3"] > 2.5 and ck["tau"]["k=2"] > 2.0
    assert ck["tau"][f"k={ck['chosen']}"] == pytest.approx(report["speculative"]["mean_accepted_tokens"])


def test_trees_join_the_sweep_at_batch_one_and_stay_exact(tiny_checkpoints, tmp_path):
    assert _eval(tiny_checkpoints, tmp_path, "--num-draft-tokens", "1,3", "--batch-size", "1,2",
                 "tree=3x1x1,dyn4-d2-w2", "warmup=0") == 0
    report = json.loads((tmp_path / "report.json").read_text())
    rows = {(r["proposal"], r["batch_size"]): r for r in report["sweep"]}
    assert set(rows) == {("k=1", 1), ("k=3", 1), ("k=1", 2), ("k=3", 2), ("tree=3x1x1", 1),
                         ("tree=dyn4-d2-w2", 1)}
    assert all(r["equivalence_passed"] for r in report["sweep"])
    tree = rows[("tree=3x1x1", 1)]
    # a tree's depth under its own key; num_draft_tokens is a chain's length only
    assert tree["tree"] == "3x1x1" and tree["tree_depth"] == 3 and tree["num_draft_tokens"] is None
    assert len(tree["per_position_acceptance"]) == 3 and rows[("k=3", 1)]["tree_depth"] is None
    assert tree["v"] > 0 and rows[("tree=dyn4-d2-w2", 1)]["tree_depth"] == 2
    assert report["config"]["sweep_tree"] == ["3x1x1", "dyn4-d2-w2"]
    md = (tmp_path / "report.md").read_text()
    assert "| tree=3x1x1 | 1 |" in md or "| tree=3x1x1 **(recommended)** | 1 |" in md


def test_choose_k_weighs_static_trees_by_their_replayed_tau(tiny_checkpoints, tmp_path):
    perfect = {**tiny_checkpoints, "draft": tiny_checkpoints["target"]}
    assert _eval(perfect, tmp_path, "choose_k=1,2", "choose_tree=3x1x1,2x2,2", "num_prompts=4",
                 "choose_k_prompts=4", "warmup=0") == 0
    report = json.loads((tmp_path / "report.json").read_text())
    ck = report["choose_k"]
    assert ck["candidates"] == [1, 2, "3x1x1", "2x2", "2"] and ck["best_chain"] in (1, 2)
    label = proposals.label
    _check_choice(ck)
    # the target as its own draft: every first choice is right, so a tree of depth 3 accepts as a chain of 3, and
    # the one-level tree "2" (keyed apart from the chain k = 2, whose shape text it shares) as a chain of 1
    tau = ck["tau"]
    assert len(tau) == len(ck["predicted_speedup"]) == 5
    assert tau["tree=3x1x1"] > tau["tree=2x2"] > tau["tree=2"] > 1.5
    assert tau["tree=2x2"] == pytest.approx(tau["k=2"]) and tau["tree=2"] == pytest.approx(tau["k=1"])
    assert tau[label(ck["chosen"])] == pytest.approx(report["speculative"]["mean_accepted_tokens"])
    md = (tmp_path / "report.md").read_text()
    assert "| k = 2 |" in md and "| tree 2 |" in md
    assert len(ck["top_n_agreement"]) == 3 and ck["top_n_agreement"][0]["1"] == 1.0


def test_choose_k_takes_the_fastest_proposal_that_passes_the_thresholds(tiny_checkpoints, tmp_path, monkeypatch):
    """Forced figures: k = 3 is predicted fastest but accepts under min_acceptance_rate; k = 2, slower, passes and
    is measured; the report names both and what each candidate fails."""
    from specdec.eval import choose

    tau = {1: 1.9, 2: 2.2, 3: 2.4}  # acceptance rates (tau - 1) / k: 0.9, 0.6, 0.467

    def costs(target, draft, ids, ks, repeats, clock=None):  # c = 0, v = 1: the predicted speedup is tau
        return {"target_step_ms": 1.0, "draft_step_ms": 0.0, "c": 0.0, "verify_ms": {str(k): 1.0 for k in ks},
                "v": {str(k): 1.0 for k in ks}}

    monkeypatch.setattr(choose, "measure_costs", costs)
    monkeypatch.setattr(proposals, "replayed_tau", lambda ranks, p: tau[p.k])
    assert _eval(tiny_checkpoints, tmp_path, "choose_k=1,2,3", "choose_k_prompts=2", "num_prompts=2", "warmup=0",
                 "min_acceptance_rate=0.5", "min_speedup=1.1", "max_memory_overhead=1000") == 0
    report = json.loads((tmp_path / "report.json").read_text())
    ck = report["choose_k"]
    assert (ck["chosen"], ck["fastest"]) == (2, 3)
    assert ck["failed_gates"] == {"k=1": [], "k=2": [], "k=3": ["acceptance_rate"]}
    assert ck["acceptance_rate"]["k=3"] == pytest.approx(1.4 / 3) and ck["gates_checked"] == [
        "acceptance_rate", "speedup", "memory"]
    assert report["config"]["num_draft_tokens"] == 2  # the passing proposal was the one measured
    md = (tmp_path / "report.md").read_text()
    assert "| proposal | tau | acceptance | v(n+1) | predicted speedup | memory / limit (MB) | fails |" in md
    assert "The fastest predicted, k = 3, fails acceptance_rate: k = 2 is the fastest that passes" in md
    assert "| k = 3 | 2.400 | 0.467 |" in md and md.count("| none |") == 2
    # thresholds no candidate meets: the fastest overall is measured, and the report says so
    assert _eval(tiny_checkpoints, tmp_path / "none", "choose_k=1,2,3", "choose_k_prompts=2", "num_prompts=2",
                 "warmup=0", "min_acceptance_rate=0.95") == 0
    report = json.loads((tmp_path / "none" / "report.json").read_text())
    ck = report["choose_k"]
    assert ck["chosen"] == ck["fastest"] == 3 and all(ck["failed_gates"].values())
    assert report["decision"]["verdict"] == "keep-target-only"
    assert "No proposal passes every threshold" in (tmp_path / "none" / "report.md").read_text()


def test_the_sweep_reports_its_fastest_configuration_and_what_each_fails(tiny_checkpoints, tmp_path):
    assert _eval(tiny_checkpoints, tmp_path, "--num-draft-tokens", "1,2", "num_prompts=2", "warmup=0",
                 "min_speedup=100") == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert all("speedup" in r["failed_gates"] for r in report["sweep"])
    fastest = report["recommended"]["fastest"]
    assert fastest["verdict"] == "keep-target-only" and "speedup" in fastest["failed_gates"]
    # no configuration passes: the fastest is the one reported
    assert fastest["proposal"] == report["recommended"]["proposal"]
    assert report["decision"]["failed_gates"] == fastest["failed_gates"]
    assert "| verdict (failing) |" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["tree=1x1"], "list it in num_draft_tokens"),
    (["tree=3x1", "--batch-size", "2"], "add batch size 1"),
    (["choose_tree=3x1"], "give choose_k too"),
    (["choose_k=1", "choose_tree=dyn8"], "dynamic tree cannot be predicted"),
    (["tree=3;1"], "not a tree shape"),
])
def test_bad_tree_settings_say_what_to_do(tiny_checkpoints, tmp_path, capsys, args, message):
    assert _eval(tiny_checkpoints, tmp_path, *args) != 0
    assert message in capsys.readouterr().err


def test_the_demo_summary_names_the_fastest_beside_the_choice():
    from specdec.demo import _choice_lines

    ck = {"chosen": 1, "fastest": "2x1", "failed_gates": {"k=1": [], "tree=2x1": ["acceptance_rate"]}}
    assert _choice_lines({"choose_k": ck}) == [
        "chosen            k=1, the fastest predicted to pass every threshold (fastest: tree=2x1, fails acceptance_rate)"]
    assert _choice_lines({"choose_k": {**ck, "fastest": 1}}) == [] and _choice_lines({}) == []
