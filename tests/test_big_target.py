"""Targets too large for one device (issue 38): with recorded states the trainer loads only the target's
embedding, final norm and head (train/target_parts.py) and trains exactly as with the whole target; the plan counts
only those parts, and refuses online states for a target that cannot fit, naming `states: recorded`; the 70B
recipe (recipes/llama3.3-70b-eagle3.yaml) plans within 8 x 80 GB."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_world, tiny_llama
from draft_checks import run_logging_losses
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.models import load_model
from specdec.train import distill, plan, target_parts
from specdec.train.distill import TrainConfig
from specdec.train.target_parts import load_target_parts, parameter_count, parts_parameters

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "llama3.3-70b-eagle3.yaml"
LAYERS = [1, 2, 3]  # of a 4-layer target
# Llama-3.3-70B-Instruct's config.json, as far as the plan reads it
LLAMA33_70B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192,
               "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
               "intermediate_size": 28672, "vocab_size": 128256, "rope_theta": 500000.0,
               "max_position_embeddings": 131072, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama saved whole, sharded (with its index) and a tied-head one."""
    root = tmp_path_factory.mktemp("big_target")
    model = tiny_llama(seed=0, layers=4, dtype=torch.float32)
    model.save_pretrained(root / "one")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    torch.manual_seed(1)
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    tied.save_pretrained(root / "tied")
    return {"one": root / "one", "sharded": root / "sharded", "tied": root / "tied"}


@pytest.mark.parametrize("layout", ["one", "sharded"])
def test_parts_hold_the_targets_embedding_norm_and_head_and_far_fewer_parameters(checkpoints, layout):
    folder = checkpoints[layout]
    if layout == "sharded":
        assert (folder / target_parts.INDEX).is_file() and len(list(folder.glob("*.safetensors"))) > 3
    full = load_model(str(folder), dtype="float32", device="cpu")
    parts = load_target_parts(str(folder), "float32", "cpu")
    for mine, theirs in ((parts.get_input_embeddings(), full.get_input_embeddings()),
                         (parts.get_output_embeddings(), full.get_output_embeddings()),
                         (parts.get_decoder().norm, full.get_decoder().norm)):
        assert torch.equal(mine.weight, theirs.weight)
    assert len(parts.get_decoder().layers) == len(full.get_decoder().layers) == 4
    assert not any(p.requires_grad for p in parts.parameters())
    held, whole = parameter_count(parts), parameter_count(full)
    assert held == 2 * 128 * 32 + 32 == parts_parameters(full.config)
    assert held * 5 < whole, (held, whole)
    with pytest.raises(ValueError, match="states=online"):  # it never runs: the states are recorded
        parts(torch.tensor([[1, 2, 3]]))
    with pytest.raises(AttributeError, match="layer 0 is not loaded"):
        _ = parts.get_decoder().layers[0].self_attn


def test_a_tied_head_is_the_embedding_and_the_dtype_is_the_runs(checkpoints):
    parts = load_target_parts(str(checkpoints["tied"]), "bfloat16", "cpu")
    full = load_model(str(checkpoints["tied"]), dtype="bfloat16", device="cpu")
    assert parts.lm_head.weight is parts.get_input_embeddings().weight
    assert parts.lm_head.weight.dtype == torch.bfloat16 and torch.equal(parts.lm_head.weight, full.lm_head.weight)
    assert parameter_count(parts) == 128 * 32 + 32 == parts_parameters(full.config)


def test_layer_init_target_loads_the_last_layer_and_builds_the_same_draft(checkpoints):
    from specdec.eagle3 import Eagle3Draft

    folder = str(checkpoints["sharded"])
    full = load_model(folder, dtype="float32", device="cpu")
    parts = load_target_parts(folder, "float32", "cpu", last_layer=True)
    assert parameter_count(parts) == parts_parameters(full.config, last_layer=True) < parameter_count(full)
    drafts = [Eagle3Draft.from_target(t, LAYERS, torch.arange(0, 128, 2), seed=3, layer_init="target")
              for t in (full, parts)]
    theirs, mine = (d.state_dict() for d in drafts)
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in theirs)


# ---- the trainer ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A tiny target and `specdec data record_features=true` folders (train, held-out) of its states."""
    from specdec.train.data import DataConfig
    from specdec.train.data import run as run_data

    root = tmp_path_factory.mktemp("recorded")
    save_tiny_world(root / "ws", target_layers=4, small_seed=7, n_train=2, n_heldout=2)
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"explain the sum of {w} and water"}) + "\n"
                               for w in "a city book list food number simple clear water the".split()))
    for folder, limit in (("data", None), ("heldout", 4)):
        run_data(DataConfig(target=str(root / "ws" / "target"), prompts=str(prompts), output_dir=str(root / folder),
                            max_new_tokens=8, batch_size=4, dtype="float32", device="cpu", limit=limit,
                            top_logprobs=3, record_features=True, eagle_aux_layer_ids=LAYERS))
    return root


KIND_OPTIONS = {"eagle3": {"ttt_steps": 2, "eagle_aux_layer_ids": LAYERS},
                "dflash": {"dflash_layer_ids": LAYERS, "dflash_layers": 1, "block_size": 4, "num_anchors": 4}}


def _recorded_cfg(root: Path, out: Path, draft: str = "eagle3", **kw) -> TrainConfig:
    return TrainConfig(target=str(root / "ws" / "target"), train_data=str(root / "data"),
                       heldout_data=str(root / "heldout"), output_dir=str(out), device="cpu", dtype="float32",
                       draft=draft, teacher="online", draft_vocab_size=64, states="recorded", max_steps=4,
                       per_device_batch_size=4, warmup_steps=0, eval_every=2, save_every=0, eval_samples=4,
                       log_every=1, learning_rate=3e-3, mixed_precision="no", **KIND_OPTIONS[draft], **kw)


def _numbers(record, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of an eval.jsonl record (wall times left out)."""
    if isinstance(record, dict):
        out = {}
        for key, value in record.items():
            if "second" not in key and "time" not in key:
                out.update(_numbers(value, f"{prefix}{key}."))
        return out
    if isinstance(record, list):
        return {k: v for i, item in enumerate(record) for k, v in _numbers(item, f"{prefix}{i}.").items()}
    return {prefix: float(record)} if isinstance(record, (int, float)) and not isinstance(record, bool) else {}


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("draft", sorted(KIND_OPTIONS))
def test_a_run_on_recorded_states_trains_as_with_the_whole_target(recorded, tmp_path, monkeypatch, draft):
    """The same short run with only the target's parts and with the whole target: the same losses, held-out
    figures and draft (to float tolerance), and the parts run never loads the whole target."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    def no_whole_target(*_args, **_kw):
        raise AssertionError("the whole target was loaded")

    with monkeypatch.context() as patch:
        patch.setattr(distill, "load_model", no_whole_target)
        parts_final, parts_history, parts_loss = run_logging_losses(_recorded_cfg(recorded, tmp_path / "parts", draft),
                                                                    tmp_path / "parts")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()
    with monkeypatch.context() as patch:
        patch.setattr(target_parts, "loads_parts_only", lambda cfg: False)
        whole_final, whole_history, whole_loss = run_logging_losses(_recorded_cfg(recorded, tmp_path / "whole", draft),
                                                                    tmp_path / "whole")
    assert len(parts_loss) == len(whole_loss) == 4 and all(math.isfinite(x) for x in parts_loss)
    assert parts_loss == pytest.approx(whole_loss, rel=1e-4, abs=1e-6)
    assert [h["step"] for h in parts_history] == [h["step"] for h in whole_history] == [0, 2, 4]
    for mine, theirs in zip(parts_history, whole_history):
        numbers = _numbers(mine)
        # alpha too, from the data's top-n (a DFlash run reports none: nan in both)
        assert numbers and all(math.isfinite(v) for k, v in numbers.items() if draft == "eagle3" or "alpha" not in k)
        assert numbers == pytest.approx(_numbers(theirs), rel=1e-4, abs=1e-6, nan_ok=True)
    drafts = [load_model(str(final), dtype="float32", device="cpu").state_dict() for final in (parts_final,
                                                                                               whole_final)]
    for key in drafts[1]:
        torch.testing.assert_close(drafts[0][key], drafts[1][key], rtol=1e-4, atol=1e-5)


def test_which_runs_load_only_the_parts(recorded, tmp_path):
    base = _recorded_cfg(recorded, tmp_path / "out")
    assert target_parts.loads_parts_only(base)
    assert target_parts.loads_parts_only(dataclasses.replace(base, states="auto"))  # every folder recorded
    assert not target_parts.loads_parts_only(dataclasses.replace(base, states="online"))
    unrecorded = dataclasses.replace(base, states="auto", train_data=str(recorded / "ws" / "data"))
    assert not target_parts.loads_parts_only(unrecorded)  # a folder without states: computed by the whole target
    plain = TrainConfig(target=base.target, draft_layers=[0, -1], teacher="online")
    assert not target_parts.loads_parts_only(plain)  # an online teacher of a token-only draft runs the target
    assert not target_parts.loads_parts_only(dataclasses.replace(base, target="embedded:smollm2-135m-instruct"))


# ---- the plan ------------------------------------------------------------------------------------------------
def _plan(cfg: TrainConfig, config: dict, **kw) -> plan.Plan:
    return plan.plan_for(cfg, plan.PlanOptions(target_config=json.dumps(config)), **kw)


def _tiny_config(vocab: int = 512) -> dict:
    return {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": vocab,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}


def test_the_plan_counts_only_the_parts_with_recorded_states():
    from transformers import AutoModelForCausalLM

    target = plan.config_from_dict(_tiny_config())
    whole = sum(p.numel() for p in AutoModelForCausalLM.from_config(target).parameters())
    cfg = TrainConfig(draft="eagle3", target="tiny", device="cpu", eagle_aux_layer_ids=[2, 4, 5], max_length=64,
                      draft_vocab_size=100, states="recorded", mixed_precision="no")
    counted = {}
    for states, layer_init in (("recorded", "random"), ("recorded", "target"), ("online", "random")):
        p = plan.plan_run(dataclasses.replace(cfg, states=states, layer_init=layer_init), target, device_type="cpu",
                          mixed_precision="no")
        counted[states, layer_init] = p.term("target weights").bytes // 4  # float32 on a CPU
    assert counted["recorded", "random"] == 2 * 512 * 64 + 64 == parts_parameters(target)
    assert counted["recorded", "target"] == parts_parameters(target, last_layer=True) > counted["recorded", "random"]
    assert counted["online", "random"] == whole > 5 * counted["recorded", "random"]


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_online_states_for_a_target_that_cannot_fit_are_refused_before_loading(tmp_path):
    """A 70B target whole on an 80 GB device: refused by every run's check, naming states: recorded; states=auto
    without recordings too. The folder holds a config only: nothing is loaded before the refusal."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(LLAMA33_70B))
    for states in ("online", "auto"):
        cfg = TrainConfig(draft="eagle3", target=str(tmp_path / "target"), output_dir=str(tmp_path / states),
                          states=states, draft_vocab_size=32000, per_device_batch_size=1, max_length=2048,
                          dtype="bfloat16", device="cpu", mixed_precision="bf16", plan_device_gb=80)
        with pytest.raises(ValueError, match="largest term is target weights.*states: recorded.*record_features"
                                             ".*tensor_parallel_size"):
            distill.run(cfg)


def test_the_refusal_names_the_whole_target_where_dropping_it_would_fit():
    """Not the largest term, but the one whose removal fits the run: the target's weights, with states: recorded."""
    cfg = TrainConfig(draft="eagle3", target="tiny", device="cpu", eagle_aux_layer_ids=[2, 4, 5], max_length=1024,
                      per_device_batch_size=8, ttt_steps=4, draft_vocab_size=256, states="online",
                      mixed_precision="no")
    target = plan.config_from_dict(_tiny_config(vocab=65536))
    probe = plan.plan_run(cfg, target, device_type="cpu", mixed_precision="no")
    weights = probe.term("target weights").bytes
    memory = int(probe.total - weights / 2)  # short by half the target's weights
    p = plan.plan_run(cfg, target, device_type="cpu", mixed_precision="no", memory=memory, memory_source="test")
    assert not p.fits() and p.largest.name != "target weights" and p.culprit.name == "target weights"
    with pytest.raises(ValueError, match="without target weights it would fit.*states: recorded"):
        p.check()
    short = plan.plan_run(cfg, target, device_type="cpu", mixed_precision="no", memory=int(probe.total - 2 * weights),
                          memory_source="test")
    assert short.culprit is short.largest  # freeing the target's weights would not be enough: the largest term


# ---- the 70B recipe ------------------------------------------------------------------------------------------
def test_the_70b_recipe_plans_within_eight_80_gb_gpus(capsys):
    code = distill.main(["--plan", "--config", str(RECIPE), "plan_devices=8", "plan_device_gb=80",
                         "--target-config", json.dumps(LLAMA33_70B)])
    text = capsys.readouterr().out
    assert code == 0 and "fits" in text and "DOES NOT FIT" not in text, text
    assert "8 device(s)" in text and "only its embedding, final norm and head" in text
    for line in ("disk (data stage)", "recorded states", "top-20 log-probs"):
        assert line in text
    from specdec.config import load_config

    cfg = load_config(TrainConfig, str(RECIPE), ["plan_devices=8", "plan_device_gb=80"], section="train")
    p = _plan(cfg, LLAMA33_70B, data=plan.recipe_data_config(str(RECIPE)))
    assert p.fits() and p.term("target weights").bytes < 5 * 2**30  # embedding + head in bf16, 3.9 GiB
    assert p.total < 80 * 2**30


def test_the_70b_recipe_records_its_states_with_vllm_over_eight_gpus():
    from specdec.config import load_config, read_recipe
    from specdec.train.data import DataConfig

    raw, data = read_recipe(RECIPE), load_config(DataConfig, str(RECIPE), section="data")
    assert raw["target"] == "meta-llama/Llama-3.3-70B-Instruct" and raw["draft"] == "eagle3"
    assert data.backend == "vllm" and data.tensor_parallel_size == 8 and data.record_features
    assert data.eagle_aux_layer_ids == raw["train"]["eagle_aux_layer_ids"] == [2, 40, 77]
    assert raw["train"]["states"] == "recorded"


def test_the_70b_recipe_with_online_states_is_refused_naming_the_fix(capsys):
    code = distill.main(["--plan", "--config", str(RECIPE), "states=online", "plan_devices=8", "plan_device_gb=80",
                         "--target-config", json.dumps(LLAMA33_70B)])
    out = capsys.readouterr().out
    assert code == 1 and "DOES NOT FIT" in out
    refusal = out.strip().splitlines()[-1]
    assert refusal.startswith("does not fit: the largest term is target weights")
    assert "states: recorded" in refusal and "tensor_parallel_size" in refusal


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_70b_recipe_trains_on_recorded_states_without_the_whole_target(recorded, tmp_path, monkeypatch):
    """The recipe's train settings as written (tiny sizes aside) on a tiny target's recorded states."""
    from specdec.config import load_config

    def no_whole_target(*_args, **_kw):
        raise AssertionError("the whole target was loaded")

    monkeypatch.setattr(distill, "load_model", no_whole_target)
    cfg = load_config(TrainConfig, str(RECIPE), section="train")
    assert cfg.options.states == "recorded" and cfg.teacher == "online"
    cfg = dataclasses.replace(cfg, target=str(recorded / "ws" / "target"), train_data=str(recorded / "data"),
                              heldout_data=str(recorded / "heldout"), output_dir=str(tmp_path / "out"),
                              device="cpu", dtype="float32", max_steps=2, per_device_batch_size=2, eval_samples=2,
                              eval_every=1, save_every=1, warmup_steps=1, max_length=64, draft_vocab_size=64,
                              eagle_aux_layer_ids=LAYERS)
    final = distill.run(cfg)
    assert (final / "config.json").is_file() and json.loads((final / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"] == LAYERS
