"""specdec.train.data's vLLM backend against the real engine, which runs from vLLM's own environment (`make vllm-env`).

Skipped only where no Python with vLLM is found. Each engine start costs tens of seconds on 2 CPU cores, so the
tests start the engine eagerly (no torch.compile; the compiled default is what bench/data.py --backend vllm runs,
and checks for identical float32 completions too), and the tiny-model tests share one reference run: 4 starts, 2
more (in parallel) for the data-parallel launch, and one for the embedded SmolLM2 target (also marked slow).

The reference records its features as greedy runs do by default (vllm_states=auto: extracted from vLLM's own
forwards); the data-parallel launch computes them by the transformers prefill, so the two ways meet there too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import kill_data_run_after, tiny_llama, tiny_tokenizer
from test_data import full_features

from specdec.train import data as gen
from specdec.train.data import DataConfig, load_generated, run, run_loop
from specdec.train.data.backend_vllm import VLLM_LOG

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[1]
WORDS = "the a of to and is explain write sum number city water food book list simple clear".split()
EAGER = {"enforce_eager": True}  # starts in ~20 s instead of ~90 s (this vLLM build recompiles at every start)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    from specdec.vllm_env import find_vllm_python

    found = find_vllm_python()
    if found is None:
        pytest.skip("no Python with vLLM found: make vllm-env (or set $SPECDEC_VLLM_PYTHON)")
    return found


@pytest.fixture(scope="session")
def tiny_vllm_target(tmp_path_factory) -> Path:
    """A tiny random Llama that vLLM's CPU attention runs (head size 32), in float32, with the word tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-vllm-target")
    tiny_llama(seed=0, hidden=128, dtype=torch.float32).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _write_prompts(path: Path, n: int = 12) -> Path:
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for i in range(n):
            k = int(torch.randint(2, 14, (1,), generator=g))
            words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (k,), generator=g)]
            f.write(json.dumps({"prompt": " ".join(words), "category": f"c{i % 3}"}) + "\n")
        f.write(json.dumps({"question_id": 900, "category": "mt", "turns": ["explain the sum", "write a list"]}) + "\n")
    return path


def _settings(**kw) -> dict:
    base = dict(backend="vllm", max_new_tokens=6, batch_size=3, shard_size=4, dtype="float32", device="cpu",
                spec_bench_turns="all", top_logprobs=3, record_features=True, eagle_aux_layer_ids=[1])
    return {**base, **kw}


def _rows(out: Path) -> list[dict]:
    return sorted(load_generated(out).to_list(), key=lambda r: (r["prompt_id"], r["sample_index"], r["turn"]))


def _features(out: Path) -> dict[tuple, torch.Tensor]:
    found = {}
    for columns, feats in gen.recorded_features(out):
        for pid, sample, turn, f in zip(columns["prompt_id"], columns["sample_index"], columns["turn"], feats):
            found[(pid, sample, turn)] = f
    return found


@pytest.fixture(scope="module")
def reference(vllm_python, tiny_vllm_target, tmp_path_factory) -> tuple[Path, Path]:
    """One uninterrupted backend=vllm run (top log-probs and features recorded): (prompts, output folder)."""
    tmp = tmp_path_factory.mktemp("vllm-reference")
    prompts, out = _write_prompts(tmp / "p.jsonl"), tmp / "out"
    manifest = run(DataConfig(target=str(tiny_vllm_target), prompts=str(prompts), output_dir=str(out),
                              vllm_args=EAGER, **_settings()))
    assert manifest["complete"] and manifest["settings"]["backend"] == "vllm"
    return prompts, out


def test_killed_vllm_run_resumes_to_the_uninterrupted_result(reference, tiny_vllm_target, tmp_path):
    """Kill `specdec data backend=vllm` after a shard: its worker dies with it, and a rerun finishes the folder
    exactly as an uninterrupted run made it (top log-probs and features included)."""
    prompts, ref = reference
    out = tmp_path / "out"
    args = [f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in _settings().items()]
    args += [f"target={tiny_vllm_target}", f"prompts={prompts}", f"output_dir={out}", "vllm_args={enforce_eager: true}"]
    env = dict(os.environ, **{run_loop.PAUSE_ENV: "3"})
    kill_data_run_after(args, env, out, shards=1, timeout=300, poll=0.1)
    pid = int(re.search(r"specdec vllm worker pid (\d+)", (out / VLLM_LOG).read_text()).group(1))
    deadline = time.time() + 20
    while time.time() < deadline and Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), "the vLLM worker outlived its parent"
    partial = json.loads((out / "manifest.json").read_text())
    assert not partial["complete"] and 1 <= len(partial["shards"]) < partial["num_shards"] == 4
    cfg = DataConfig(target=str(tiny_vllm_target), prompts=str(prompts), output_dir=str(out), vllm_args=EAGER,
                     **_settings())
    assert run(cfg)["complete"]
    assert _rows(out) == _rows(ref)
    mine, theirs = _features(out), _features(ref)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][:1]
    except (OSError, IndexError):
        return "Z"


def test_vllm_features_equal_the_targets_own(reference, tiny_vllm_target, tmp_path):
    """Features by prefill after vLLM's decoding: per row, what a full forward over the row gives at every fed
    position (multi-turn rows too); and equal, to bf16 rounding, to what backend=transformers records while it
    decodes, on the rows whose tokens are the same (a tiny random model's near-ties may flip a few)."""
    from specdec.models import load_model

    prompts, ref = reference
    model = load_model(str(tiny_vllm_target), dtype="float32", device="cpu")
    feats = _features(ref)
    rows = _rows(ref)
    assert len(rows) == len(feats) == 14
    for r in rows:
        f = feats[(r["prompt_id"], r["sample_index"], r["turn"])]
        ids = r["input_ids"]
        assert f.dtype == torch.bfloat16 and f.shape == (len(ids) - 1, 2 * model.config.hidden_size)
        full = full_features(model, ids, [1])
        torch.testing.assert_close(f.float(), full[:-1].bfloat16().float(), atol=2e-3, rtol=8e-3)
    out = tmp_path / "transformers"
    run(DataConfig(target=str(tiny_vllm_target), prompts=str(prompts), output_dir=str(out),
                   **_settings(backend="transformers")))
    theirs, same = _features(out), 0
    for mine, other in zip(rows, _rows(out)):
        if mine["input_ids"] == other["input_ids"]:
            key = (mine["prompt_id"], mine["sample_index"], mine["turn"])
            torch.testing.assert_close(feats[key].float(), theirs[key].float(), atol=2e-3, rtol=8e-3)
            # The extraction decodes through vLLM's speculative path: its top log-probs are still the target's.
            assert [t[0] for t in mine["top_ids"]] == [t[0] for t in other["top_ids"]]
            torch.testing.assert_close(torch.tensor(mine["top_logprobs"])[:, 0],
                                       torch.tensor(other["top_logprobs"])[:, 0], atol=1e-4, rtol=0)
            same += 1
    assert same >= len(rows) // 2, f"only {same} of {len(rows)} rows agree with backend=transformers"


def test_vllm_data_parallel_launch_makes_the_rows_of_one_process(reference, tiny_vllm_target, tmp_path):
    """`accelerate launch` with two gloo processes (CPU), backend=vllm: each process starts its own engine, pinned to
    its own core, on its own shards (s % 2), and the manifest lists every shard once: the same rows as the
    one-process reference (greedy), and the same features to bf16 rounding (here by the transformers prefill,
    whose share of the time each process logs)."""
    prompts, ref = reference
    out = tmp_path / "out"
    args = [f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}"
            for k, v in _settings(vllm_states="prefill").items()]
    args += [f"target={tiny_vllm_target}", f"prompts={prompts}", f"output_dir={out}", "vllm_args={enforce_eager: true}"]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=path,
               CUDA_VISIBLE_DEVICES="")  # two gloo processes on the CPU (torchrun via --multi_gpu), as test_train's
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           "-m", "specdec.train.data", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and [s["index"] for s in manifest["shards"]] == [0, 1, 2, 3]
    for index in (0, 1):
        assert re.search(rf"process {index}/2 wrote shards/shard-0000{index}", proc.stderr)
        assert re.search(rf"prefill of states: [\d.]+ s of [\d.]+ s \(process {index}'s", proc.stderr)
    starts = [re.search(r"specdec vllm worker pid (\d+) on cpus (\[.*?\])", (out / f"vllm-worker-{i}.log").read_text())
              for i in (0, 1)]
    assert starts[0].group(1) != starts[1].group(1)  # one engine per process
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(json.loads(starts[0].group(2))) & set(json.loads(starts[1].group(2)))  # on their own cores
    mine, theirs = _rows(out), _rows(ref)
    assert [(r["prompt_id"], r["turn"], r["input_ids"], r["prompt_length"]) for r in mine] == \
        [(r["prompt_id"], r["turn"], r["input_ids"], r["prompt_length"]) for r in theirs]
    for a, b in zip(mine, theirs):
        assert a["top_ids"] == b["top_ids"]
        torch.testing.assert_close(torch.tensor(a["top_logprobs"]), torch.tensor(b["top_logprobs"]), atol=1e-4,
                                   rtol=0)
    f_mine, f_theirs = _features(out), _features(ref)
    assert f_mine.keys() == f_theirs.keys()
    for key in f_mine:
        torch.testing.assert_close(f_mine[key].float(), f_theirs[key].float(), atol=2e-3, rtol=8e-3)
    assert not list(out.glob(".vllm-states-*"))


def test_vllm_start_failure_shows_vllms_own_message(vllm_python, tiny_vllm_target, tmp_path):
    """A target that transformers can read but vLLM cannot load (no weights): vLLM's own error, and the fix."""
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for name in os.listdir(tiny_vllm_target):
        if not name.endswith(".safetensors"):
            (broken / name).write_bytes((tiny_vllm_target / name).read_bytes())
    prompts = _write_prompts(tmp_path / "p.jsonl", n=2)
    with pytest.raises(ValueError) as err:
        run(DataConfig(target=str(broken), prompts=str(prompts), output_dir=str(tmp_path / "out"), vllm_args=EAGER,
                       **_settings(record_features=False, eagle_aux_layer_ids=[])))
    message = str(err.value)
    assert "backend=transformers" in message and "the end of vLLM's log" in message
    assert re.search(r"(?i)weights", message), message[-2000:]  # vLLM names what is missing
    pid = int(re.search(r"specdec vllm worker pid (\d+)", (tmp_path / "out" / VLLM_LOG).read_text()).group(1))
    assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"


@pytest.mark.slow
def test_vllm_float32_greedy_equals_the_transformers_backend(vllm_python, tmp_path):
    """The embedded SmolLM2 target, float32, greedy: vLLM's completions equal the transformers backend's token for
    token, with the same top log-probs (to float32 rounding) and the same features (to bf16 rounding)."""
    from specdec.models import EMBEDDED_TARGET, embedded_checkpoint
    from specdec.train.prompt_templates import EMBEDDED_HELDOUT_PROMPTS

    embedded_checkpoint()
    records = [json.loads(line) for line in EMBEDDED_HELDOUT_PROMPTS.read_text().splitlines()[:4]]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    kw = dict(target=EMBEDDED_TARGET, prompts=str(prompts), max_new_tokens=32, batch_size=4, dtype="float32",
              device="cpu", top_logprobs=2, spec_bench_turns="first", record_features=True,
              eagle_aux_layer_ids=[2, 15, 27])
    run(DataConfig(backend="vllm", output_dir=str(tmp_path / "vllm"), vllm_args=EAGER, **kw))
    run(DataConfig(backend="transformers", output_dir=str(tmp_path / "hf"), **kw))
    mine, theirs = _rows(tmp_path / "vllm"), _rows(tmp_path / "hf")
    assert [r["input_ids"] for r in mine] == [r["input_ids"] for r in theirs]
    for a, b in zip(mine, theirs):
        assert [t[0] for t in a["top_ids"]] == [t[0] for t in b["top_ids"]]
        torch.testing.assert_close(torch.tensor(a["top_logprobs"]), torch.tensor(b["top_logprobs"]), atol=2e-3,
                                   rtol=0)
    f_mine, f_theirs = _features(tmp_path / "vllm"), _features(tmp_path / "hf")
    assert f_mine.keys() == f_theirs.keys()
    for key in f_mine:
        assert f_mine[key].shape == f_theirs[key].shape
        torch.testing.assert_close(f_mine[key].float(), f_theirs[key].float(), atol=2e-2, rtol=1e-2)
