"""Bad inputs get one clean line and exit code 2, before any model runs (issue 41, items 3 and 4).

Each case is (the command line after `specdec`, the exit code, a fragment of the message); the files they name are
made here from the tiny models of conftest.py: corrupt checkpoints, an EAGLE-3 draft of another target, prompt files
that are too long, not UTF-8 or a folder, a recipe that is not YAML. Never-reached draft positions are reported as
null (None), not as a rate of 0.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_EVAL_PROMPTS, tiny_llama, tiny_tokenizer

from specdec import speculative_generate
from specdec.cli import main
from specdec.eagle3.model import Eagle3Draft
from specdec.eval import workload
from specdec.outputs import DecodeStats, position_rates
from specdec.proposal import Proposal

LONG_WORDS = 300  # words of the tiny tokenizer: one token each, over the tiny models' 256 positions


def _truncated(src: Path, dst: Path, name: str) -> str:
    """A copy of checkpoint `src` whose file `name` is cut short, as an interrupted download leaves it."""
    shutil.copytree(src, dst)
    data = (src / name).read_bytes()
    (dst / name).write_bytes(data[: min(len(data) // 2, 100)])
    return str(dst)


@pytest.fixture(scope="module")
def bad(tiny_checkpoints, tmp_path_factory) -> dict[str, str]:
    """Broken inputs beside the good tiny checkpoints: every path a case names."""
    root = tmp_path_factory.mktemp("bad_inputs")
    target, draft = Path(tiny_checkpoints["target"]), Path(tiny_checkpoints["draft"])
    paths = {
        "draft_config": _truncated(draft, root / "draft_config", "config.json"),
        "draft_weights": _truncated(draft, root / "draft_weights", "model.safetensors"),
        "target_config": _truncated(target, root / "target_config", "config.json"),
        "target_weights": _truncated(target, root / "target_weights", "model.safetensors"),
    }
    # A plain draft whose config.json was edited to another vocabulary than its weights hold.
    shutil.copytree(draft, root / "draft_edited")
    config = json.loads((draft / "config.json").read_text())
    (root / "draft_edited" / "config.json").write_text(json.dumps({**config, "vocab_size": 160}))
    paths["draft_edited"] = str(root / "draft_edited")
    # An EAGLE-3 draft trained for another target (160 ids, 4 layers) than the tiny one (128 ids, 2 layers).
    Eagle3Draft.from_target(tiny_llama(seed=0, layers=4, vocab_size=160), [1, 2, 3], seed=3).save_pretrained(
        root / "eagle3_other")
    paths["eagle3_other"] = str(root / "eagle3_other")
    # An EAGLE-3 draft whose config.json was edited to another vocabulary than its weights hold.
    Eagle3Draft.from_target(tiny_llama(seed=0, layers=4), [1, 2, 3], seed=3).save_pretrained(root / "eagle3_edited")
    config = json.loads((root / "eagle3_edited" / "config.json").read_text())
    (root / "eagle3_edited" / "config.json").write_text(json.dumps({**config, "vocab_size": 160,
                                                                      "draft_vocab_size": 160}))
    paths["eagle3_edited"] = str(root / "eagle3_edited")
    long_prompt = {"question_id": "long", "turns": [" ".join(["the"] * LONG_WORDS)]}
    (root / "long.jsonl").write_text(json.dumps(TINY_EVAL_PROMPTS[0]) + "\n" + json.dumps(long_prompt) + "\n")
    (root / "latin1.jsonl").write_bytes(b'{"prompt": "the day"}\n{"prompt": "caf\xe9"}\n')
    (root / "folder.jsonl").mkdir()
    (root / "recipe.yaml").write_text("eval:\n  num_draft_tokens: [1, 2\n  max_new_tokens: 8\n")
    paths.update({name.split(".")[0]: str(root / name)
                  for name in ("long.jsonl", "latin1.jsonl", "folder.jsonl", "recipe.yaml")})
    paths["missing"] = str(root / "no-such-draft")
    return paths


def _eval(ckpt: dict, bad: dict, out: Path, *extra: str, target=None, draft=None, prompts=None) -> list[str]:
    """An eval command line on the tiny checkpoints; `target`/`draft`/`prompts` name a key of `bad` instead."""
    pick = {"target": target, "draft": draft, "prompts": prompts}
    paths = {k: bad[v] if v else ckpt[k] for k, v in pick.items()}
    return ["eval", "--target", paths["target"], "--draft", paths["draft"], "--prompts", paths["prompts"],
            "--max-new-tokens", "8", "--out", str(out), "dtype=float64", "cost_repeats=1", "warmup=0", *extra]


# (case name, how to build the command line from (tiny checkpoints, bad inputs, out folder), exit code, fragment)
CASES = [
    ("over-long prompt", lambda c, b, o: _eval(c, b, o, prompts="long"), 2,
     f"prompt long (line 2 of {{long}}) has {LONG_WORDS + 3} tokens: with max_new_tokens=8"),
    ("over-long prompt, context named", lambda c, b, o: _eval(c, b, o, prompts="long"), 2,
     "the target's context of 256; drop it from the file, shorten it to at most 248 tokens"),
    ("over-long prompt in the engine path", lambda c, b, o: _eval(
        c, b, o, "engine=vllm", "vllm_python=/nonexistent/python", prompts="long"), 2, "line 2 of"),
    ("over-long prompt in verify", lambda c, b, o: [
        "verify", "--target", c["target"], "--draft", c["draft"], "--prompts", b["long"]], 2,
     "with max_new_tokens=2 it needs"),
    ("k beyond max_new_tokens", lambda c, b, o: _eval(c, b, o, "num_draft_tokens=1000"), 2,
     "num_draft_tokens lists 1000, but with max_new_tokens=8 a round can propose at most 6 draft token(s)"),
    ("choose_k beyond max_new_tokens", lambda c, b, o: _eval(c, b, o, "choose_k=2,7"), 2,
     "choose_k lists 7, but with max_new_tokens=8 a round can propose at most 6"),
    ("tree deeper than max_new_tokens", lambda c, b, o: _eval(c, b, o, "tree=2x1x1x1x1x1x1"), 2,
     "tree=2x1x1x1x1x1x1 is 7 deep"),
    ("temperature nan", lambda c, b, o: _eval(c, b, o, "temperature=nan"), 2,
     "temperature: expected a finite number, got 'nan'"),
    ("top_p inf", lambda c, b, o: _eval(c, b, o, "top_p=.inf"), 2, "top_p: expected a finite number"),
    ("override that is not YAML", lambda c, b, o: _eval(c, b, o, "num_draft_tokens=[1,2"), 2,
     "override num_draft_tokens=[1,2 is not valid YAML"),
    ("recipe that is not YAML", lambda c, b, o: ["eval", "--config", b["recipe"], "--out", str(o)], 2,
     "config file {recipe} is not valid YAML at line 3, column"),
    ("prompt file not UTF-8", lambda c, b, o: _eval(c, b, o, prompts="latin1"), 2,
     "prompt file {latin1} is not UTF-8 text (byte 0xe9 on line 2)"),
    ("prompt file is a folder", lambda c, b, o: _eval(c, b, o, prompts="folder"), 2,
     "prompt file {folder} is a folder"),
    ("draft config.json truncated", lambda c, b, o: _eval(c, b, o, draft="draft_config"), 2,
     "{draft_config}/config.json is not valid JSON"),
    ("draft safetensors truncated", lambda c, b, o: _eval(c, b, o, draft="draft_weights"), 2,
     "{draft_weights}/model.safetensors is not a readable safetensors file"),
    ("target config.json truncated", lambda c, b, o: _eval(c, b, o, target="target_config"), 2,
     "{target_config}/config.json is not valid JSON"),
    ("target safetensors truncated", lambda c, b, o: _eval(c, b, o, target="target_weights"), 2,
     "truncated or corrupt; download or export the checkpoint again"),
    ("plain weights unlike its config", lambda c, b, o: _eval(c, b, o, draft="draft_edited"), 2,
     "{draft_edited}: the weights do not match its config.json"),
    ("EAGLE-3 draft of another target", lambda c, b, o: _eval(c, b, o, draft="eagle3_other"), 2,
     "vocabulary mismatch: the draft {eagle3_other} (EAGLE-3) embeds 160 token ids"),
    ("EAGLE-3 draft of another target, the fix", lambda c, b, o: _eval(c, b, o, draft="eagle3_other"), 2,
     "(LlamaForCausalLM) has 128; an EAGLE-3 draft serves only the target it was trained for"),
    ("EAGLE-3 weights unlike its config", lambda c, b, o: _eval(c, b, o, draft="eagle3_edited"), 2,
     "{eagle3_edited}/model.safetensors does not match its config.json (size mismatch"),
    ("missing draft path", lambda c, b, o: _eval(c, b, o, draft="missing"), 2,
     "model {missing} does not exist locally, and is not a Hub id either (a Hub id is `org/name`"),
    ("missing target path", lambda c, b, o: _eval(c, b, o, target="missing"), 2, "{missing} does not exist locally"),
    ("sampled acceptance at a negative temperature", lambda c, b, o: _eval(c, b, o, "sampled_acceptance_temperature=-1"),
     2, "sampled_acceptance_temperature"),
    ("prompt supervision without the prompts' teacher", lambda c, b, o: [
        "train", "--target", c["target"], f"output_dir={o}", "supervise_prompt=true", "teacher=offline"], 2,
     "supervise_prompt=true needs the target's distribution at the prompts' positions, which teacher=offline lacks"),
    ("held-out temperature zero", lambda c, b, o: [
        "train", "--target", c["target"], f"output_dir={o}", "heldout_temperatures=[0.7,0]"], 2,
     "heldout_temperatures must list finite temperatures > 0"),
    ("DFlash norm start unknown", lambda c, b, o: [
        "train", "--target", c["target"], f"output_dir={o}", "draft=dflash", "norm_init=zeros"], 2,
     "norm_init must be target or ones, got 'zeros'"),
    ("slices for a plain draft", lambda c, b, o: [
        "train", "--target", c["target"], f"output_dir={o}", "draft=derived", "slice_tokens=4096"], 2,
     "slice_tokens is for draft=eagle3 or peagle or dflash"),
    ("negative slice bound", lambda c, b, o: [
        "train", "--target", c["target"], f"output_dir={o}", "draft=eagle3", "slice_tokens=-1"], 2,
     "slice_tokens must be >= 0"),
    ("padding to a multiple of zero", lambda c, b, o: [
        "train", "--target", c["target"], f"output_dir={o}", "pad_to_multiple_of=0"], 2,
     "pad_to_multiple_of must be >= 1"),
    ("negative heap release period", lambda c, b, o: [
        "train", "--target", c["target"], f"output_dir={o}", "release_host_memory_every=-1"], 2,
     "release_host_memory_every must be >= 0"),
    ("dropping finished rows, not a boolean", lambda c, b, o: [
        "data", f"target={c['target']}", f"prompts={c['prompts']}", f"output_dir={o}", "drop_finished_rows=maybe"], 2,
     "drop_finished_rows: expected true or false, got 'maybe'"),
    ("demo passes zero", lambda c, b, o: ["demo", "--plan", "train_passes=0"], 2, "train_passes > 0"),
    ("demo probe of one step", lambda c, b, o: ["demo", "--plan", "probe_steps=1"], 2,
     "probe_steps >= 2 (the first step is not timed)"),
]


@pytest.mark.parametrize(("argv", "code", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_clean_line(tiny_checkpoints, bad, tmp_path, capsys, argv, code, fragment):
    assert main(argv(tiny_checkpoints, bad, tmp_path / "out")) == code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert fragment.format(**bad) in lines[0]
    assert not (tmp_path / "out" / "report.json").exists()


def test_an_over_long_prompt_fails_before_any_forward(tiny_checkpoints, bad, tmp_path, capsys, monkeypatch):
    """The length check runs before the first forward: a 49k-token prompt used to run for minutes first."""
    loaded, forwards = [], []
    real = workload.load_model

    def counted(*args, **kwargs):
        model = real(*args, **kwargs)
        model.register_forward_pre_hook(lambda *_: forwards.append(1))
        loaded.append(model)
        return model

    monkeypatch.setattr(workload, "load_model", counted)
    assert main(_eval(tiny_checkpoints, bad, tmp_path, prompts="long")) == 2
    assert "prompt long (line 2" in capsys.readouterr().err
    assert len(loaded) == 2 and forwards == []  # both models were loaded, and neither ran


def test_home_is_a_path_for_path_keys_and_null_elsewhere():
    from specdec.config import config_from_cli
    from specdec.eval.config import EvalConfig

    cfg = config_from_cli(EvalConfig, ["--out", "~", "prompts=~/p.jsonl", "draft=d", "run_name=~"], section="eval")
    assert cfg.out == str(Path.home()) and cfg.prompts == str(Path.home() / "p.jsonl") and cfg.run_name is None


def test_never_reached_positions_are_null_not_zero():
    stats = DecodeStats.for_proposal(Proposal.chain(4))
    stats.observe_round([1], 4)  # position 1 accepted, 2 rejected: 3 and 4 never tried
    assert stats.per_position_acceptance == [1.0, 0.0, None, None]
    assert stats.as_dict()["per_position_acceptance"] == [1.0, 0.0, None, None]
    merged = DecodeStats.merged([stats, DecodeStats.for_proposal(Proposal.chain(4))])
    assert merged.per_position_acceptance == [1.0, 0.0, None, None]


def test_the_decoder_reports_positions_beyond_max_new_tokens_as_null(target, draft):
    # k = 10 with max_new_tokens = 5: a round proposes at most 3 (decode.max_draft_depth), 4..10 are never tried
    ids = torch.tensor([[5, 6, 7, 8]])
    out = speculative_generate(target, target, ids, num_draft_tokens=10, max_new_tokens=5)  # the target agrees
    rates = out.stats.per_position_acceptance
    assert len(rates) == 10 and rates[:3] == [1.0, 1.0, 1.0] and rates[3:] == [None] * 7


def test_reports_show_a_dash_and_plots_no_bar_for_never_reached(tmp_path):
    from specdec.eval import plots
    from specdec.eval.rows import _reached

    assert position_rates([0.5, None]) == "1: 0.500, 2: \u2014"
    assert position_rates([0.5, None], 2, numbered=False) == "0.50, \u2014"
    assert _reached([0.5, None]) == [0.5, 0.0]  # the analytic model: an unreached position adds no token
    plots.acceptance_bars([("k=2", [0.5, None])], tmp_path / "bars.png")
    assert (tmp_path / "bars.png").read_bytes()[:4] == b"\x89PNG"


def test_engine_counters_leave_unreached_positions_null():
    from specdec.eval.engine.metrics import acceptance

    got = acceptance({"drafts": 4, "draft_tokens": 12, "accepted": 2, "accepted_per_pos": [2, 0, 0]}, 3)
    assert got["per_position_acceptance"] == [0.5, 0.0, None]


def test_sampling_settings_refuse_nan_and_inf():
    from specdec.sampling import SamplingConfig

    for bad_value in (math.nan, math.inf):
        with pytest.raises(ValueError, match="temperature must be a finite number"):
            SamplingConfig(temperature=bad_value)
    with pytest.raises(ValueError, match="top_p must be a finite number"):
        SamplingConfig(temperature=1.0, top_p=math.nan)


def test_the_tiny_tokenizer_reads_one_token_per_word():
    """The over-long prompt's length above is LONG_WORDS words plus the chat template's three tokens."""
    tok = tiny_tokenizer()
    messages = [{"role": "user", "content": " ".join(["the"] * LONG_WORDS)}]
    assert len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)) == LONG_WORDS + 3
