"""The 8B EAGLE-3 recipes (llama3.1-8b-eagle3.yaml, qwen3-8b-eagle3.yaml) end to end at tiny scale.

Each recipe runs through the real CLI entry points (`specdec data`, `train`, `eval`, `publish`) with every
setting as written except the tiny overrides of `run_recipe`: its target is a seeded random model of the
recipe's architecture, saved as a local checkpoint with the tiny word tokenizer. The Llama-3.1 stand-in
carries its rope scaling (`rope_type: llama3`); the Qwen3 stand-in has Qwen3's q/k norms and a head_dim
unequal to hidden / heads. Four target layers leave the engines' default layer ids (2, N // 2, N - 3)
undefined, so every stage must carry the ids the recipe names.

The `vllm`-marked test serves each published tiny draft in vLLM as `eagle3` (`specdec eval
engine=specdec,vllm`, float32, greedy): output identical to vLLM target-only and to specdec's decoder, and
vLLM's acceptance counters equal to specdec's own greedy counts, so vLLM computes the draft as specdec does
(Qwen3's head_dim, Llama-3.1's rope scaling, the layer ids).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import TINY_EVAL_PROMPTS, tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from specdec.cli import main
from specdec.config import read_recipe

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
LAYER_IDS = [1, 2, 3]  # all a 4-layer target has
DRAFT_VOCAB = 64  # of the tiny tokenizer's 128 ids
TINY_LR = 3e-3
# Llama-3.1-8B-Instruct's rope parameters (its config.json), which the draft layer must carry.
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
WORDS = "the a of to and is explain write sum number city water food book list simple clear short story poem".split()
FAST_SERVER = "vllm_args=[--enforce-eager,--distributed-executor-backend,uni]"


def tiny_llama31() -> LlamaForCausalLM:
    """Llama-3.1's architecture at tiny widths: GQA, rope_type llama3 (head_dim 32, which vLLM's CPU build runs)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072,
                         rope_parameters=dict(LLAMA31_ROPE), rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def tiny_qwen3() -> Qwen3ForCausalLM:
    """Qwen3's architecture at tiny widths: q/k norms, GQA, head_dim 32 with hidden 64 and 4 heads (not 64 / 4)."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=40960,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config)


TARGETS = {"llama3.1-8b-eagle3.yaml": tiny_llama31, "qwen3-8b-eagle3.yaml": tiny_qwen3}


def _save_target(build, folder: Path) -> Path:
    model = build().float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # spread the logits: greedy decoding is then no coin toss
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _write_prompts(root: Path) -> dict[str, Path]:
    rng = random.Random(0)
    train = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))} for _ in range(24)]
    files = {"train": root / "train.jsonl", "heldout": root / "heldout.jsonl"}
    files["train"].write_text("".join(json.dumps(r) + "\n" for r in train))
    files["heldout"].write_text("".join(json.dumps(r) + "\n" for r in TINY_EVAL_PROMPTS))
    return files


def _reset_accelerate() -> None:
    """Each in-process training run builds its own Accelerator (its state is a process-wide singleton)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


def _cli(*args: str) -> None:
    assert main([str(a) for a in args]) == 0, args


def run_recipe(recipe: Path, target: Path, prompts: dict[str, Path], out: Path) -> Path:
    """data -> held-out data -> train -> eval -> publish, the recipe's settings with tiny overrides; returns out."""
    config = ["--config", str(recipe)]
    shared = [f"target={target}", "device=cpu", "dtype=float32"]
    # The recipe's Hub prompt set and vLLM engine are swapped for local prompts and specdec's own decoder.
    data = [*shared, "column_map=null", "backend=transformers", "max_new_tokens=24", "batch_size=8"]
    _cli("data", *config, *data, f"prompts={prompts['train']}", f"output_dir={out / 'data'}")
    _cli("data", *config, *data, f"prompts={prompts['heldout']}", f"output_dir={out / 'data_heldout'}")
    try:
        # The recipe's learning rate is an 8B draft's: a tiny one needs a larger one to agree with its target at
        # all in 40 steps (the vLLM test compares acceptance counts, which must not be trivially zero).
        _cli("train", *config, *shared, f"output_dir={out}", "max_steps=40", f"learning_rate={TINY_LR}",
             "warmup_steps=2", "eval_every=20", "save_every=20", "eval_samples=4", "per_device_batch_size=4",
             "max_length=64", f"draft_vocab_size={DRAFT_VOCAB}", f"eagle_aux_layer_ids={LAYER_IDS}")
    finally:
        _reset_accelerate()
    _cli("eval", *config, *shared, f"output_dir={out}", f"draft={out / 'final'}", f"prompts={prompts['heldout']}",
         "engine=specdec", "vllm_ngram=false", "max_new_tokens=16", "cost_repeats=2", "warmup=0")
    _cli("publish", *config, f"target={target}", "dtype=float32", f"draft={out / 'final'}", f"out={out / 'publish'}",
         f"report={out / 'eval' / 'report.json'}")
    return out


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> Callable[[str], dict[str, Path]]:
    """Each recipe run once end to end: {recipe name: {"target", "out", "train_prompts"}} (runs on first use)."""
    root = tmp_path_factory.mktemp("recipes_8b")
    prompts = _write_prompts(root)
    done: dict[str, dict[str, Path]] = {}

    def get(name: str) -> dict[str, Path]:
        if name not in done:
            stem = Path(name).stem
            target = _save_target(TARGETS[name], root / stem / "target")
            out = run_recipe(ROOT / "recipes" / name, target, prompts, root / stem / "run")
            done[name] = {"target": target, "out": out, "train_prompts": prompts["train"]}
        return done[name]

    return get


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_recipe_runs_end_to_end_on_a_tiny_target_of_its_architecture(name, pipelines):
    run = pipelines(name)
    out, recipe = run["out"], read_recipe(ROOT / "recipes" / name)
    target_config = _json(run["target"] / "config.json")
    for folder in ("data", "data_heldout"):
        assert _json(out / folder / "manifest.json")["complete"]

    # Training ran the recipe's EAGLE-3 settings (only the tiny overrides differ).
    trained = _json(out / "train_summary.json")["config"]
    assert trained["draft"] == recipe["draft"] == "eagle3"
    for key in ("ttt_steps", "ttt_decay", "teacher", "loss", "weight_decay", "max_grad_norm", "grad_accum_steps"):
        assert trained[key] == recipe["train"][key], key
    assert trained["ttt_steps"] == 7 and trained["draft_vocab_size"] == DRAFT_VOCAB
    assert trained["learning_rate"] == TINY_LR and trained["eagle_aux_layer_ids"] == LAYER_IDS

    report = _json(out / "eval" / "report.json")
    assert report["equivalence"]["mode"] == "greedy" and report["equivalence"]["passed"]
    assert [report["config"]["num_draft_tokens"]] == recipe["eval"]["num_draft_tokens"]

    # The published draft: the engines' EAGLE-3 layout over this target's widths, rope and layer ids.
    published = _json(out / "publish" / "config.json")
    assert published["architectures"] == ["LlamaForCausalLMEagle3"] and published["num_hidden_layers"] == 1
    assert published["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    assert published["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in LAYER_IDS]
    assert published["draft_vocab_size"] == DRAFT_VOCAB and published["vocab_size"] == 128
    assert published["target_architectures"] == target_config["architectures"]
    assert published["target_hidden_size"] == target_config["hidden_size"]
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps"):
        assert published[key] == target_config[key], key
    assert published["rope_theta"] == target_config["rope_parameters"]["rope_theta"]
    if target_config["rope_parameters"]["rope_type"] == "llama3":
        assert published["rope_scaling"] == LLAMA31_ROPE == published["rope_parameters"]
    else:
        assert published["rope_scaling"] is None
    card = (out / "publish" / "README.md").read_text()
    assert f"license: {recipe['publish']['license']}" in card and '"method": "eagle3"' in card


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_tiny_draft_in_vllm_is_exact_and_counted_as_specdec_counts(name, pipelines, tmp_path):
    """The published draft served by vLLM as `eagle3` beside vLLM target-only and specdec's decoder."""
    # specdec_counts counts at that module's k and output length: the eval below uses the same.
    from test_engine_eagle3 import NEW, K, specdec_counts

    from specdec.models import load_model
    from specdec.prompts import encode_prompt
    from specdec.vllm_env import find_vllm_python

    if find_vllm_python() is None:
        pytest.skip("no vLLM Python found (make vllm-env creates .venv-vllm; or set SPECDEC_VLLM_PYTHON)")
    run = pipelines(name)
    # Requests the draft was trained on (the target's answers to them): its proposals are then accepted at times.
    requests = [json.loads(line)["prompt"] for line in run["train_prompts"].read_text().splitlines()[:4]]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in requests))
    out = tmp_path / "out"
    _cli("eval", "--config", ROOT / "recipes" / name, f"target={run['target']}", f"draft={run['out'] / 'publish'}",
         f"prompts={prompts}", f"out={out}", "device=cpu", "dtype=float32", "engine=specdec,vllm", "concurrency=1",
         "vllm_ngram=false", "vllm_method=auto", f"num_draft_tokens={K}", f"max_new_tokens={NEW}", "cost_repeats=2",
         "warmup=0", "vllm_startup_timeout=900", "vllm_request_timeout=600", FAST_SERVER)
    report = _json(out / "report.json")
    engine = report["engine"]
    assert engine["complete"] and engine["methods"] == ["eagle3"]
    assert report["equivalence"]["passed"] and engine["equivalence"]["passed"]
    assert engine["equivalence"]["checked"] == 4 and engine["equivalence"]["mismatches"] == 0
    assert engine["equivalence"]["vs_specdec"]["checked"] == 4 and engine["equivalence"]["vs_specdec"]["mismatches"] == 0
    phase = next(p for p in engine["phases"] if p["mode"] == "eagle3")
    served = {"rounds": phase["rounds"], "proposed": phase["proposed"], "accepted": phase["accepted"],
              "per_position": phase["accepted_per_position"]}
    tok = tiny_tokenizer()
    world = {"target": load_model(str(run["target"]), dtype="float32", device="cpu"), "tok": tok,
             "prompts": [encode_prompt(tok, [{"role": "user", "content": text}]) for text in requests]}
    ours = specdec_counts(world, run["out"] / "publish")
    assert served == ours, (served, ours)
    assert ours["accepted"] > 0  # the counts compared are not trivially zero
