"""The distillation trainer: schedule, batching, in-process runs of each teacher mode, the real entry points
(`python -m specdec.train`, `accelerate launch --num_processes 2 --cpu -m specdec.train`), and
kill-and-resume."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import save_tiny_world, tiny_llama

from specdec.models import load_model
from specdec.train import checkpoints, distill, plain_train
from specdec.train import draft as draft_lib
from specdec.train.batches import Schedule, collate, epoch_batches, load_data
from specdec.train.distill import TrainConfig
from specdec.vocab import draft_to_target_map

ROOT = Path(__file__).resolve().parents[1]



@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny target + tokenizer saved as a checkpoint, a pretrained tiny draft, train and held-out data."""
    return save_tiny_world(tmp_path_factory.mktemp("train"), target_layers=2, small_seed=7, n_train=24, n_heldout=6)


def _cfg(ws: Path, out: Path, **kw) -> TrainConfig:
    base = dict(target=str(ws / "target"), train_data=str(ws / "data"), heldout_data=str(ws / "heldout"),
                output_dir=str(out), device="cpu", draft_layers=[0], max_steps=3, per_device_batch_size=4,
                warmup_steps=1, log_every=1, eval_every=2, save_every=2, eval_samples=6, eval_batch_size=3,
                learning_rate=1e-2)
    base.update(kw)
    return TrainConfig(**base)


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


# ---- pure parts ------------------------------------------------------------------------------------------


def test_schedule_is_deterministic_and_covers_each_epoch_once():
    lengths = [5 + (i * 7) % 23 for i in range(50)]
    s1, s2 = Schedule(lengths, 8, seed=3, bucket=True), Schedule(lengths, 8, seed=3, bucket=True)
    per_epoch = 50 // 8
    epoch0 = [i for m in range(per_epoch) for i in s1(m)]
    assert len(epoch0) == len(set(epoch0)) == per_epoch * 8
    assert [s2(m) for m in reversed(range(2 * per_epoch))] == [s1(m) for m in reversed(range(2 * per_epoch))]
    assert s1(per_epoch) != s1(0)  # a new epoch is a new permutation
    # Bucketing: batches are far more uniform in length than random batches.
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in epoch_batches(lengths, 8, 0, 0, True))
    plain = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in epoch_batches(lengths, 8, 0, 0, False))
    assert spread < plain
    with pytest.raises(ValueError, match="global batch"):
        Schedule(lengths[:3], 8, seed=0, bucket=True)


def test_an_epochs_padded_positions_count_each_process_slices_longest_row():
    lengths = [3, 10, 4, 4, 9, 2, 8, 1]
    one, two = Schedule(lengths, 4, seed=0, bucket=False), Schedule(lengths, 4, seed=0, bucket=False)
    batches = epoch_batches(lengths, 4, 0, 0, False)
    assert one.padded_positions(per_device=4) == sum(4 * max(lengths[i] for i in b) for b in batches)
    # two processes of 2 rows: each step waits for the slower slice
    assert two.padded_positions(per_device=2) == sum(
        max(2 * max(lengths[i] for i in b[:2]), 2 * max(lengths[i] for i in b[2:])) for b in batches)
    assert two.padded_positions(per_device=2) <= one.padded_positions(per_device=4)
    # pad_to_multiple_of: each micro-batch's width rounded up, never past max_length
    assert one.padded_positions(per_device=4, multiple=4, max_length=12) == sum(
        4 * min(-(-max(lengths[i] for i in b) // 4) * 4, 12) for b in batches)
    assert one.padded_positions(per_device=4, multiple=8, max_length=10) == sum(
        4 * (8 if max(lengths[i] for i in b) <= 8 else 10) for b in batches)  # 16 would pass max_length


def test_collate_masks_completion_positions_and_aligns_topn():
    rows = {"input_ids": [[10, 11, 12, 13, 14], [20, 21, 22]], "prompt_length": [2, 2],
            "top_ids": [[[12, 1], [13, 1], [14, 1]], [[22, 3]]],
            "top_logprobs": [[[-0.1, -3.0], [-0.2, -3.0], [-0.3, -3.0]], [[-0.4, -2.0]]]}
    b = collate(rows, pad_id=0, max_length=64)
    assert b["input_ids"].tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, 0, 0]]
    # logits position t predicts token t + 1: completion tokens 12 13 14 are predicted at 1 2 3.
    assert b["loss_mask"].tolist() == [[False, True, True, True, False], [False, True, False, False, False]]
    assert b["labels"][0, 1:4].tolist() == [12, 13, 14] and b["labels"][1, 1] == 22
    assert b["top_ids"][0, 1:4, 0].tolist() == [12, 13, 14] and b["top_ids"][1, 1, 0] == 22
    assert b["n_tokens"] == 4
    cut = collate(rows, pad_id=0, max_length=4)  # truncation drops the completion's tail
    assert cut["loss_mask"][0].tolist() == [False, True, True, False]


def test_teacher_head_on_loss_positions_equals_the_full_forward():
    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)
    rows = {"input_ids": [[5, 6, 7, 8, 9, 10], [11, 12, 13]], "prompt_length": [3, 1]}
    batch = collate(rows, pad_id=0, max_length=64)
    full = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.allclose(plain_train.target_logits_at(target, batch), full[batch["loss_mask"]], atol=1e-5)


def test_on_policy_batch_samples_continuations_in_target_ids():
    draft = tiny_llama(seed=1, layers=1, dtype=torch.float32)
    rows = {"input_ids": [[5, 6, 7, 8, 9, 10], [11, 12, 13]], "prompt_length": [3, 1]}
    batch = collate(rows, pad_id=0, max_length=64)
    id_map = torch.arange(3, 128, 5)  # a reduced head: draft index i is target id 3 + 5 i
    from specdec.vocab import apply_reduced_head

    apply_reduced_head(draft, id_map)
    out = plain_train.on_policy_batch(draft, batch, max_new=4, temperature=1.0, id_map=id_map, pad_id=0, eos_id=None,
                                  generator=torch.Generator().manual_seed(0))
    # Prompts [5 6 7] and [11], left-padded to width 3, then 4 sampled tokens each.
    assert out["input_ids"][:, :3].tolist() == [[5, 6, 7], [0, 0, 11]]
    assert out["attention_mask"].tolist() == [[1] * 7, [0, 0, 1, 1, 1, 1, 1]]
    assert set(out["input_ids"][:, 3:].flatten().tolist()) <= set(id_map.tolist())
    assert out["loss_mask"].tolist() == [[False, False, True, True, True, True, False]] * 2
    assert out["n_tokens"] == 8
    eos = plain_train.on_policy_batch(draft, batch, max_new=4, temperature=1.0, id_map=id_map, pad_id=0,
                                  eos_id=int(out["input_ids"][0, 3]), generator=torch.Generator().manual_seed(0))
    # The first sampled token of row 0 is now EOS: nothing after it is trained on.
    assert eos["loss_mask"][0].tolist() == [False, False, True, False, False, False, False]

    # The KV-cached sampler draws exactly what re-reading the whole sequence each step would draw.
    gen, ids, mask = torch.Generator().manual_seed(0), out["input_ids"].clone(), out["attention_mask"]
    with torch.no_grad():
        for cur in range(3, 7):
            logits = draft(input_ids=ids[:, :cur], attention_mask=mask[:, :cur],
                           position_ids=plain_train._positions(mask[:, :cur])).logits[:, -1].float()
            ids[:, cur] = id_map[torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)]
    assert torch.equal(ids, out["input_ids"])

def test_config_validation_is_actionable():
    with pytest.raises(ValueError, match="teacher must be one of"):
        TrainConfig(teacher="sometimes")
    with pytest.raises(ValueError, match="best_k"):
        TrainConfig(eval_k=[1, 2], best_k=4)
    with pytest.raises(ValueError, match="beta"):
        TrainConfig(beta=2.0)


# ---- in-process runs -------------------------------------------------------------------------------------


def test_online_derived_run_writes_final_best_and_checkpoints(workspace, tmp_path):
    cfg = _cfg(workspace, tmp_path / "run", record_consumed=True)
    final = distill.run(cfg)
    out = Path(cfg.output_dir)
    assert final == out / "final" and (final / "config.json").is_file() and (final / "tokenizer.json").is_file()
    draft = load_model(str(final), dtype="float32", device="cpu")
    assert draft.config.num_hidden_layers == 1
    history = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [0, 2, 3]
    assert all(0.0 <= h["alpha"] <= 1.0 and 1.0 <= h["tau"]["4"] <= 5.0 for h in history)
    assert (out / "best" / "config.json").is_file()
    best = json.loads((out / "best" / "specdec_best.json").read_text())
    assert best["tau"]["4"] == max(h["tau"]["4"] for h in history if h["step"] > 0)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-3"]
    steps = [json.loads(line)["step"] for line in (out / "consumed" / "rank-0.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_training_stops_when_held_out_tau_stops_rising(workspace, tmp_path):
    """stop_after_flat_evals: two evaluations in a row without the (here unreachable) gain end the run there, with
    no second evaluation of the last step; with min_tau_gain 0 a 6-step run is not stopped."""
    cfg = _cfg(workspace, tmp_path / "flat", max_steps=20, eval_every=2, save_every=0, stop_after_flat_evals=2,
               min_tau_gain=100.0)
    distill.run(cfg)
    summary = json.loads((tmp_path / "flat" / "train_summary.json").read_text())
    assert summary["stopped_by"] == "held-out plateau" and summary["steps"] == 4
    steps = [json.loads(line)["step"] for line in (tmp_path / "flat" / "eval.jsonl").read_text().splitlines()]
    assert steps == [0, 2, 4]
    distill.run(dataclasses.replace(cfg, output_dir=str(tmp_path / "on"), max_steps=6, min_tau_gain=0.0))
    summary = json.loads((tmp_path / "on" / "train_summary.json").read_text())
    assert summary["stopped_by"] == "max_steps" and summary["steps"] == 6
    with pytest.raises(ValueError, match="set eval_every"):
        _cfg(workspace, tmp_path / "x", eval_every=0, stop_after_flat_evals=2)


def test_max_minutes_stops_early_with_the_schedule_ending_there(workspace, tmp_path, monkeypatch):
    """A clock that advances one second a reading: the budget binds long before max_steps, and the learning
    rate reaches zero at the step training stopped (the schedule was re-aimed, not cut)."""
    import functools

    from specdec.train.budget import TimeBudget

    ticks = iter(range(10**6))
    monkeypatch.setattr(distill, "TimeBudget", functools.partial(TimeBudget, clock=lambda: float(next(ticks))))
    cfg = _cfg(workspace, tmp_path / "run", max_steps=200, max_minutes=0.5, eval_every=0, save_every=0)
    distill.run(cfg)
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["stopped_by"] == "max_minutes" and 1 <= summary["steps"] < 200
    assert summary["train_minutes"] < 0.6  # 30 ticks, plus the few readings of the final evaluation and save
    checkpoint = tmp_path / "run" / "checkpoints" / f"step-{summary['steps']}"
    scheduler = json.loads((checkpoint / "trainer_state.json").read_text())["scheduler"]  # JSON, never a pickle
    assert scheduler["lr_lambdas"][0]["end"] == summary["steps"] and scheduler["_last_lr"] == [0.0]
    # A resume counts the earlier run's time (train_seconds in the checkpoint) and keeps the end it reached.
    distill.run(dataclasses.replace(cfg, resume_from="latest"))
    again = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert again["steps"] == summary["steps"] and again["train_minutes"] > summary["train_minutes"]


def test_a_resumed_run_ends_exactly_where_the_uninterrupted_one_does(workspace, tmp_path):
    """Resumed from its step-2 checkpoint, whose schedule is JSON in trainer_state.json (no pickle of specdec's), a
    run ends with the uninterrupted run's weights, schedule and samples consumed."""
    cfg = _cfg(workspace, tmp_path / "whole", max_steps=4, save_every=2, eval_every=0, record_consumed=True)
    whole = distill.run(cfg)
    step2 = tmp_path / "whole" / "checkpoints" / "step-2"
    assert not list(step2.glob("custom_checkpoint_*")) and checkpoints.checkpoint_problem(step2) is None
    resumed = distill.run(dataclasses.replace(cfg, output_dir=str(tmp_path / "resumed"), resume_from=str(step2)))
    a, b = (load_model(str(p), dtype="float32", device="cpu").state_dict() for p in (whole, resumed))
    for name, value in a.items():
        assert torch.equal(value, b[name]), name
    states = [checkpoints.read_state(tmp_path / run / "checkpoints" / "step-4") for run in ("whole", "resumed")]
    assert states[0]["scheduler"] == states[1]["scheduler"] and states[0]["run_id"] == states[1]["run_id"]
    assert _consumed(tmp_path / "resumed") == _consumed(tmp_path / "whole")[2:]  # steps 3 and 4, the same samples


def test_offline_topn_reduced_vocab_jsd(workspace, tmp_path):
    cfg = _cfg(workspace, tmp_path / "run", teacher="offline", loss="jsd", beta=0.5, draft_vocab_size=40,
               grad_accum_steps=2, save_every=0, eval_every=0)
    final = distill.run(cfg)
    draft = load_model(str(final), dtype="float32", device="cpu")
    id_map = draft_to_target_map(draft)
    assert id_map is not None and id_map.numel() == 40 and 2 in id_map.tolist()  # eos is always kept
    # Rows whose stored top-n all fall outside the 40 kept ids have no teacher: dropped, not nan weights.
    assert all(torch.isfinite(p).all() for p in draft.parameters())
    history = [json.loads(line) for line in (Path(cfg.output_dir) / "eval.jsonl").read_text().splitlines()]
    assert history[-1]["alpha_is_lower_bound"] is True
    # The summary says how much of the held-out completions the 40 ids can propose at all: the rows it scores.
    _, heldout = load_data(cfg)
    rows = [heldout[i] for i in range(min(cfg.eval_samples, len(heldout)))]
    coverage = json.loads((Path(cfg.output_dir) / "train_summary.json").read_text())["heldout_vocab_coverage"]
    assert coverage == pytest.approx(draft_lib.completion_coverage(rows, id_map, draft.config.vocab_size))
    assert 0 < coverage < 1


def test_on_policy_tvd_with_lambda_one(workspace, tmp_path):
    cfg = _cfg(workspace, tmp_path / "run", teacher="on_policy", on_policy_fraction=1.0, on_policy_max_new_tokens=4,
               loss="tvd", max_steps=2, save_every=0, eval_every=0)
    assert (distill.run(cfg) / "config.json").is_file()


def test_lora_on_pretrained_draft_with_ce(workspace, tmp_path):
    cfg = _cfg(workspace, tmp_path / "run", draft=str(workspace / "small"), lora=True, lora_r=4, loss="ce",
               teacher="offline", max_steps=2, save_every=0, eval_every=0)
    final = distill.run(cfg)
    assert not (final / "adapter_config.json").exists()  # merged: a plain checkpoint
    assert load_model(str(final), dtype="float32", device="cpu").config.num_hidden_layers == 1


def test_training_moves_the_draft_towards_the_target(workspace, tmp_path):
    """Forward KL on one repeated batch must go down (the loop really optimises)."""
    cfg = _cfg(workspace, tmp_path / "run", max_steps=12, eval_every=0, save_every=0, eval_samples=0,
               draft="scratch", draft_config={"num_hidden_layers": 1}, learning_rate=1e-2, warmup_steps=0,
               per_device_batch_size=24, log_every=1)
    records = []

    class Grab:
        def emit(self, record):
            records.append(record.getMessage())

    import logging

    handler = logging.Handler()
    handler.emit = Grab().emit
    logging.getLogger("specdec.train.distill").addHandler(handler)
    logging.getLogger("specdec.train.distill").setLevel(logging.INFO)
    try:
        distill.run(cfg)
    finally:
        logging.getLogger("specdec.train.distill").removeHandler(handler)
    losses_ = [float(r.split("loss ")[1].split()[0]) for r in records if r.startswith("step ") and " loss " in r]
    assert len(losses_) == 12 and losses_[-1] < 0.7 * losses_[0]


def test_missing_data_and_wandb_errors(workspace, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="specdec data"):
        distill.run(_cfg(workspace, tmp_path / "a", train_data=str(tmp_path / "none")))
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ValueError, match=r"pip install specdec\[wandb\]"):
        distill._wandb_run(_cfg(workspace, tmp_path / "b", report_to="wandb"))


def test_wandb_offline(workspace, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(workspace, tmp_path / "run", report_to="wandb", max_steps=2, save_every=0, eval_every=0)
    distill.run(cfg)
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


# ---- the real entry points (subprocesses) ----------------------------------------------------------------


def _recipe(ws: Path, path: Path, out: Path, **train) -> Path:
    body = {"target": str(ws / "target"), "draft": "derived", "seed": 0, "output_dir": str(out), "device": "cpu",
            "data": {"prompts": "embedded:train"},
            "train": {"train_data": str(ws / "data"), "heldout_data": str(ws / "heldout"), "draft_layers": [0],
                      "per_device_batch_size": 2, "warmup_steps": 1, "log_every": 1, "eval_samples": 4,
                      "eval_batch_size": 2, "record_consumed": True, **train}}
    path.write_text(yaml.safe_dump(body))
    return path


def _env() -> dict:
    # The checkout first, then whatever the caller had on PYTHONPATH (packages installed outside site-packages).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=path)
    env.pop("WANDB_MODE", None)
    return env


def _consumed(out: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (out / "consumed" / f"rank-{rank}.jsonl").read_text().splitlines()]


def test_python_dash_m_train_two_steps(workspace, tmp_path):
    recipe = _recipe(workspace, tmp_path / "r.yaml", tmp_path / "out", max_steps=5, eval_every=0, save_every=0)
    proc = subprocess.run([sys.executable, "-m", "specdec.train", "--config", str(recipe), "max_steps=2",
                           "--learning-rate", "0.001"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["config"]["learning_rate"] == 0.001
    with pytest.raises(ValueError, match="teacher must be one of"):
        distill.main(["--config", str(recipe), "teacher=nope"])
    assert distill.main(["--help"]) == 0

def test_accelerate_launch_two_cpu_processes(workspace, tmp_path):
    recipe = _recipe(workspace, tmp_path / "r.yaml", tmp_path / "out", max_steps=2, eval_every=0, save_every=0)
    # accelerate 1.x runs `--cpu --num_processes 2` as ONE process unless MPI is set up; torchrun (`--multi_gpu`)
    # with device=cpu gives two gloo processes (accelerate's MULTI_CPU), which is what this test needs.
    # The venv's own accelerate (the venv need not be on PATH).
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no",
                           "-m", "specdec.train", "--config", str(recipe)],
                          cwd=ROOT, env=dict(_env(), CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                          timeout=600)  # CPU only, on a GPU machine too: torchrun would give rank 1 a missing cuda:1
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "out"
    assert (out / "final" / "config.json").is_file()
    r0, r1 = _consumed(out, 0), _consumed(out, 1)
    assert [r["step"] for r in r0] == [r["step"] for r in r1] == [1, 2]
    ids0 = {i for r in r0 for i in r["ids"]}
    ids1 = {i for r in r1 for i in r["ids"]}
    assert len(ids0) == len(ids1) == 4 and not ids0 & ids1  # the ranks see disjoint halves of each batch


def test_kill_and_resume_continues_the_data_order(workspace, tmp_path):
    """A run SIGKILLed after a checkpoint resumes after it and consumes exactly what an uninterrupted run does."""
    out = tmp_path / "run"
    # Every checkpoint is kept so the kill can land at any moment after step-4 (the run trains ~100 steps/s).
    recipe = _recipe(workspace, tmp_path / "run.yaml", out, max_steps=100_000, save_every=2, eval_every=0,
                     eval_samples=0, keep_checkpoints=100_000)
    proc = subprocess.Popen([sys.executable, "-m", "specdec.train", "--config", str(recipe)], cwd=ROOT,
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        marker = out / "checkpoints" / "step-4" / "trainer_state.json"
        deadline = time.monotonic() + 240
        while not marker.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.is_file(), proc.stderr.read().decode()[-3000:] if proc.poll() is not None else "no step-4"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    latest = checkpoints.latest_checkpoint(out / "checkpoints")
    checkpoint_step = int(latest.name.split("-")[1])
    assert checkpoint_step >= 4 and max(r["step"] for r in _consumed(out)) >= checkpoint_step
    end = checkpoint_step + 6

    # The same run, continued; only max_steps shrinks so it ends (the data order does not depend on it).
    done = subprocess.run([sys.executable, "-m", "specdec.train", "--config", str(recipe), "resume_from=latest",
                           f"max_steps={end}"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = done.stdout + done.stderr
    assert "resumed from" in logged and "at step " in logged
    assert int(logged.split("resumed from")[1].split("at step ")[1].split()[0]) == checkpoint_step
    assert (out / "checkpoints" / f"step-{end}" / "trainer_state.json").is_file()

    ref_recipe = _recipe(workspace, tmp_path / "ref.yaml", tmp_path / "ref", max_steps=end, save_every=0,
                         eval_every=0, eval_samples=0)
    assert distill.main(["--config", str(ref_recipe)]) == 0  # in-process: the data order does not depend on it
    reference = [(r["step"], r["ids"]) for r in _consumed(tmp_path / "ref")]
    got = [(r["step"], r["ids"]) for r in _consumed(out)]
    assert [step for step, _ in got] == list(range(1, end + 1))
    assert got == reference  # every step once, each with the same samples as the uninterrupted run


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _logged_losses(text: str) -> list[float]:
    return [float(line.split(" loss ")[1].split()[0]) for line in text.splitlines() if " loss " in line and "step " in line]


def two_processes_train_as_one(workspace: Path, tmp_path: Path, caplog, train: dict, two_only: dict | None = None):
    """The `train` keys (3 steps, float32) under `accelerate launch` with two gloo processes (tmp_path/two) and in
    one process at the same global batch (tmp_path/one): the same per-step losses and final weights. `two_only`:
    keys of the two-process run alone. Returns (the two-process run's final weights, both runs' eval.jsonl
    records)."""
    recipe = _recipe(workspace, tmp_path / "two.yaml", tmp_path / "two", **train, **(two_only or {}))
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           "-m", "specdec.train", "--config", str(recipe)],
                          cwd=ROOT, env=dict(_env(), CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one = _cfg(workspace, tmp_path / "one", per_device_batch_size=4, warmup_steps=1, eval_samples=4,
               eval_batch_size=2, **train)
    with caplog.at_level("INFO", logger="specdec.train.distill"):
        distill.run(one)
    two_losses, one_losses = _logged_losses(proc.stdout + proc.stderr), _logged_losses(caplog.text)
    assert len(two_losses) == len(one_losses) == 3
    assert two_losses == pytest.approx(one_losses, abs=2e-4)
    two, single = _weights(tmp_path / "two" / "final"), _weights(tmp_path / "one" / "final")
    assert two.keys() == single.keys()
    for name in two:
        torch.testing.assert_close(two[name], single[name], atol=2e-5, rtol=1e-4, msg=name)
    evals = [[json.loads(line) for line in (tmp_path / run / "eval.jsonl").read_text().splitlines()]
             for run in ("two", "one")]
    return two, evals


def test_eagle3_in_two_processes_trains_exactly_as_one(workspace, tmp_path, caplog):
    """draft=eagle3 under `accelerate launch` with two gloo processes equals one process at the same global batch:
    per-step losses, final weights and the held-out figures (each process scores half, merged). Both run in
    float32 (mixed_precision=no): the claim is equality up to the order of float32 sums (two processes each sum
    half the batch, then all-reduce), and mixed_precision=auto would pick bf16 on a CPU with native bf16 in the
    single process only (accelerate launch's flag reaches the two), adding bf16's rounding to one side."""
    train = dict(draft="eagle3", eagle_aux_layer_ids=[1], draft_vocab_size=40, teacher="online", ttt_steps=2,
                 max_steps=3, eval_every=0, save_every=0, learning_rate=1e-2, max_grad_norm=0.5,
                 mixed_precision="no")
    _, evals = two_processes_train_as_one(workspace, tmp_path, caplog, train)
    for got, want in zip(*evals):
        assert got["positions"] == want["positions"] > 0 and got["tau"] == pytest.approx(want["tau"])
        assert got["agreement"] == pytest.approx(want["agreement"])
    # The reduced vocabulary was counted once and kept beside the run, for every process and every resume.
    assert json.loads((tmp_path / "two" / "draft_vocab.json").read_text())["ids"] == \
        json.loads((tmp_path / "one" / "draft_vocab.json").read_text())["ids"]


@pytest.mark.parametrize("kind", [
    {},  # the plain derived draft
    dict(draft="eagle3", eagle_aux_layer_ids=[1], draft_vocab_size=40, teacher="online", ttt_steps=2),
    dict(draft="dflash", dflash_layer_ids=[1], dflash_layers=1, block_size=4, num_anchors=5, draft_vocab_size=40,
         teacher="online", states="online"),
    dict(draft="parallel", parallel_tokens=3),
], ids=["plain", "eagle3", "dflash", "parallel"])
def test_padding_to_a_multiple_trains_the_same_draft(workspace, tmp_path, caplog, monkeypatch, kind):
    """pad_to_multiple_of=16 widens the batches and changes no step's loss and no final weight, for every kind: the
    padding is neither attended to nor scored."""
    from specdec.train import batches

    widths, width_of = [], batches.padded_width
    monkeypatch.setattr(batches, "padded_width", lambda *a: widths.append((a[0], width_of(*a))) or widths[-1][1])
    runs = {}
    for multiple in (1, 16):
        caplog.clear()
        cfg = _cfg(workspace, tmp_path / f"pad{multiple}", eval_every=0, save_every=0, max_grad_norm=0.5,
                   mixed_precision="no", pad_to_multiple_of=multiple, data_workers=0, **kind)
        with caplog.at_level("INFO", logger="specdec.train.distill"):
            distill.run(cfg)
        runs[multiple] = _logged_losses(caplog.text), _weights(tmp_path / f"pad{multiple}" / "final")
    assert any(padded > longest for longest, padded in widths)  # the padded run's batches were wider
    (losses, weights), (padded_losses, padded_weights) = runs[1], runs[16]
    assert len(losses) == 3 and padded_losses == pytest.approx(losses, abs=2e-5)
    assert weights.keys() == padded_weights.keys()
    for name in weights:
        torch.testing.assert_close(padded_weights[name], weights[name], atol=2e-5, rtol=1e-4, msg=name)
