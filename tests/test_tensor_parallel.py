"""70B-class targets in the data stage: tensor_parallel_size / pipeline_parallel_size through the vLLM backend's
engine settings (each process's engine over its own block of GPUs; on a CPU, a worker per shard on its own cores),
the settings that cannot work refused, and a real tensor-parallel engine on two CPU processes (vLLM's
environment needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer

from specdec.train.data import DataConfig, load_generated, run
from specdec.train.data.processes import Processes
from specdec.train.data.vllm_client import engine_settings


def _settings(device: str, procs: Processes | None = None, **kw):
    cfg = DataConfig(target=".", backend="vllm", dtype="float32", **kw)
    return engine_settings(cfg, torch.device(device), "float32", False, procs)


def test_one_engine_over_two_cpu_workers_each_on_its_own_cores(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    args, env = _settings("cpu", tensor_parallel_size=2)
    assert args["tensor_parallel_size"] == 2 and args["pipeline_parallel_size"] == 1
    assert args["distributed_executor_backend"] == "mp"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,2|1,3" and env["OMP_NUM_THREADS"] == "2"
    plain, _ = _settings("cpu")
    assert "tensor_parallel_size" not in plain and plain["distributed_executor_backend"] == "uni"


def test_a_launched_process_without_shards_keeps_its_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    args, env = _settings("cpu", Processes(index=1, count=2, is_main=False))
    assert args["distributed_executor_backend"] == "uni"
    assert env["SPECDEC_VLLM_CPUS"] == env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3" and env["OMP_NUM_THREADS"] == "2"


def test_too_few_cores_for_the_shards_is_refused(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    with pytest.raises(ValueError, match="2 CPU workers need a core each, but this process has 1"):
        _settings("cpu", tensor_parallel_size=2)


def test_each_launched_process_gets_its_own_block_of_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    second = Processes(index=1, count=2, is_main=False, device=torch.device("cuda", 1))
    args, env = _settings("cuda:1", second, tensor_parallel_size=4)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and args["tensor_parallel_size"] == 4
    _, single = _settings("cuda:0", tensor_parallel_size=2, pipeline_parallel_size=4)
    assert single["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    with pytest.raises(ValueError, match="2 process\\(es\\) x tensor_parallel_size x pipeline_parallel_size = 16 "
                                         "GPUs, but 8 are visible; launch 1 process"):
        _settings("cuda:1", second, tensor_parallel_size=8)


@pytest.mark.parametrize("kw, error", [
    (dict(tensor_parallel_size=2), "set backend=vllm"),
    (dict(backend="vllm", tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (dict(backend="vllm", pipeline_parallel_size=2, record_features=True, eagle_aux_layer_ids=[0]),
     "shard with tensor_parallel_size instead"),
    (dict(backend="vllm", tensor_parallel_size=2, record_features=True, eagle_aux_layer_ids=[0],
          vllm_states="prefill"), "use vllm_states=extract"),
])
def test_parallel_settings_that_cannot_work_are_refused(kw, error):
    with pytest.raises(ValueError, match=error):
        DataConfig(dtype="float32", **kw)


@pytest.mark.vllm
def test_a_tensor_parallel_cpu_engine_writes_the_single_engines_rows_and_states(tmp_path):
    """Two tensor-parallel CPU workers (vLLM's mp executor) against one engine: the same greedy float32 rows, and
    the states extracted from the sharded engine are the target's own (a full forward over each row)."""
    from test_data import full_features

    from specdec.models import load_model
    from specdec.train import data as gen
    from specdec.vllm_env import find_vllm_python

    if find_vllm_python() is None:
        pytest.skip("no Python with vLLM found: make vllm-env (or set $SPECDEC_VLLM_PYTHON)")
    target = tmp_path / "target"
    tiny_llama(seed=0, hidden=128, dtype=torch.float32).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in
                               enumerate(["explain the sum", "write a list of numbers", "what is the city water"])))
    base = dict(target=str(target), prompts=str(prompts), backend="vllm", dtype="float32", device="cpu",
                max_new_tokens=6, vllm_args={"enforce_eager": True})
    run(DataConfig(output_dir=str(tmp_path / "one"), **base))
    run(DataConfig(output_dir=str(tmp_path / "tp"), tensor_parallel_size=2, record_features=True,
                   eagle_aux_layer_ids=[1], **base))
    rows = {name: {r["prompt_id"]: r["input_ids"] for r in load_generated(Path(tmp_path / name)).to_list()}
            for name in ("one", "tp")}
    assert rows["tp"] == rows["one"] and len(rows["tp"]) == 3
    model = load_model(str(target), dtype="float32", device="cpu")
    checked = 0
    for columns, feats in gen.recorded_features(tmp_path / "tp"):
        for pid, f in zip(columns["prompt_id"], feats):
            full = full_features(model, rows["tp"][pid], [1])
            torch.testing.assert_close(f.float(), full[:-1].bfloat16().float(), atol=2e-3, rtol=8e-3)
            checked += 1
    assert checked == 3
