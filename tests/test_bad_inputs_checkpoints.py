"""Bad checkpoints and run folders given to `specdec train`: each is refused with one line and exit code 2, and
nothing in a checkpoint runs code.

- a crafted pickle where accelerate or specdec would read one (the schedule's old custom_checkpoint_0.pkl, the RNG
  state, the optimizer state) is refused, and its payload never runs;
- a damaged checkpoint (truncated weights or optimizer state, unreadable trainer_state.json) names the checkpoint
  before it, and resuming that one works;
- a fresh run into a folder that holds another run is refused; overwrite=true replaces only what specdec wrote, and
  only where its run marker says specdec wrote it; pruning keeps other runs' steps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_world

from specdec import cli
from specdec.train import checkpoints, distill
from specdec.train.distill import TrainConfig

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _settings(ws: Path, out: Path, **kw) -> dict:
    base = dict(target=ws / "target", train_data=ws / "data", heldout_data=ws / "heldout", output_dir=out,
                device="cpu", draft_layers="[0]", max_steps=3, per_device_batch_size=4, warmup_steps=1,
                log_every=1, eval_every=0, save_every=1, keep_checkpoints=3, eval_samples=2, eval_batch_size=2,
                data_workers=0)
    base.update(kw)
    return base


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny world and a 3-step run in it with a checkpoint at every step (step-1, step-2, step-3)."""
    root = tmp_path_factory.mktemp("ckpt")
    ws = save_tiny_world(root / "ws", target_layers=2, small_seed=7, n_train=16, n_heldout=4)
    try:
        settings = _settings(ws, root / "run", draft_layers=[0])
        distill.run(TrainConfig(**{k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}))
    finally:
        _reset_accelerate()
    return ws, root / "run"


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the trained run to damage: (workspace, output_dir)."""
    ws, src = trained
    shutil.copytree(src, tmp_path / "run")
    return ws, tmp_path / "run"


def _train(ws: Path, out: Path, capsys, **kw) -> tuple[int, str]:
    """`specdec train key=value ...` in process -> (exit code, stderr)."""
    capsys.readouterr()
    code = cli.main(["train", *(f"{k}={v}" for k, v in _settings(ws, out, **kw).items())])
    return code, capsys.readouterr().err


def _error_line(err: str) -> str:
    """The CLI's error: one line, no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("specdec train: error:")]
    assert len(lines) == 1, err
    return lines[0]


class _Payload:
    """Unpickling this runs code: it creates `canary`."""

    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return exec, (f"open({str(self.canary)!r}, 'w').close()",)


@pytest.mark.parametrize("name", ["custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin"])
def test_a_crafted_pickle_in_a_checkpoint_runs_nothing(run, tmp_path, capsys, name):
    ws, out = run
    canary = tmp_path / "payload-ran"
    torch.save({"state": _Payload(canary)}, out / "checkpoints" / "step-3" / name)
    code, err = _train(ws, out, capsys, resume_from="latest")
    assert not canary.exists()  # the payload never ran
    line = _error_line(err)
    assert code == 2 and "step-3 cannot be resumed" in line
    assert "could run code" in line  # said as such, not as a damaged file
    assert f"resume_from={out / 'checkpoints' / 'step-2'}" in line


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", ["model.safetensors", "optimizer.bin", "trainer_state.json"])
def test_a_damaged_checkpoint_names_the_one_before_and_that_one_resumes(run, capsys, damage):
    ws, out = run
    step3 = out / "checkpoints" / "step-3"
    if damage == "trainer_state.json":
        (step3 / damage).write_text('{"step": 3, "be')
    else:
        _truncate(step3 / damage)
    code, err = _train(ws, out, capsys, resume_from="latest")
    line = _error_line(err)
    assert code == 2 and f"checkpoint {step3} cannot be resumed" in line
    before = out / "checkpoints" / "step-2"
    assert line.endswith(f"resume from the one before it: resume_from={before}")
    # The advice works: the run continues from step-2 and writes a new, whole step-3.
    code, err = _train(ws, out, capsys, resume_from=str(before))
    assert code == 0, err
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 3
    assert checkpoints.checkpoint_problem(step3) is None


def test_a_damaged_first_checkpoint_says_to_start_afresh(run, capsys):
    ws, out = run
    step1 = out / "checkpoints" / "step-1"
    _truncate(step1 / "model.safetensors")
    code, err = _train(ws, out, capsys, resume_from=str(step1))
    line = _error_line(err)
    assert code == 2 and f"checkpoint {step1} cannot be resumed: model.safetensors is damaged or truncated" in line
    assert "no earlier checkpoint of its run is usable: start afresh with overwrite=true" in line


def _tree(out: Path) -> dict[str, int]:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in sorted(out.rglob("*"))}


def test_a_fresh_run_refuses_a_folder_that_holds_another_run(run, capsys):
    ws, out = run
    before = _tree(out)
    code, err = _train(ws, out, capsys)
    line = _error_line(err)
    assert code == 2 and f"output_dir {out} holds another training run" in line
    assert "resume_from=latest to continue it, overwrite=true to replace it, or choose another output_dir" in line
    assert _tree(out) == before  # nothing touched


def test_overwrite_replaces_only_what_specdec_wrote(run, capsys):
    ws, out = run
    old_id = checkpoints.marker_run_id(out)
    (out / "notes.txt").write_text("mine")
    (out / "checkpoints" / "README.md").write_text("mine too")
    (out / "checkpoints" / "step-9-by-hand").mkdir()  # not a name specdec writes
    code, err = _train(ws, out, capsys, overwrite="true", max_steps=2)
    assert code == 0, err
    new_id = checkpoints.marker_run_id(out)
    assert new_id and new_id != old_id
    assert (out / "notes.txt").read_text() == "mine" and (out / "checkpoints" / "README.md").is_file()
    assert (out / "checkpoints" / "step-9-by-hand").is_dir()
    steps = sorted(p.name for p in (out / "checkpoints").glob("step-?"))
    assert steps == ["step-1", "step-2"]  # the old run's step-3 is gone; the new run's steps carry its id
    assert {checkpoints.read_state(out / "checkpoints" / s)["run_id"] for s in steps} == {new_id}
    assert [json.loads(line)["step"] for line in (out / "eval.jsonl").read_text().splitlines()] == [0, 2]


def test_overwrite_refuses_a_folder_without_the_run_marker(run, capsys):
    ws, out = run
    (out / checkpoints.RUN_MARKER).unlink()
    before = _tree(out)
    code, err = _train(ws, out, capsys, overwrite="true")
    line = _error_line(err)
    assert code == 2 and f"output_dir {out} holds checkpoints or drafts without specdec's run marker" in line
    assert _tree(out) == before
    with pytest.raises(ValueError, match="pass one of them"):
        TrainConfig(overwrite=True, resume_from="latest")


def _fake_step(root: Path, step: int, run_id: str) -> None:
    (root / f"step-{step}").mkdir(parents=True)
    (root / f"step-{step}" / "trainer_state.json").write_text(json.dumps({"step": step, "run_id": run_id}))


def test_pruning_and_latest_see_only_the_current_runs_steps(tmp_path):
    root = tmp_path / "checkpoints"
    for step, run_id in ((800, "old"), (840, "old"), (2, "new"), (4, "new"), (6, "new")):
        _fake_step(root, step, run_id)
    checkpoints.prune(root, "new", keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-6", "step-800", "step-840"]
    assert checkpoints.latest_checkpoint(root, "new") == root / "step-6"
    assert checkpoints.latest_checkpoint(root, "old") == root / "step-840"


def test_resuming_under_a_loader_that_unpickles_is_refused():
    """DeepSpeed and FSDP's sharded state dicts load pickles (weights_only=False, torch.distributed.checkpoint's
    metadata): a resume there could run code, so it is refused before anything loads."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    def launch(kind, state_dict_type="FULL_STATE_DICT"):
        plugin = SimpleNamespace(state_dict_type=state_dict_type)
        return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=plugin))

    assert "weights_only=False" in checkpoints.unsafe_resume_loader(launch(DistributedType.DEEPSPEED))
    assert "SHARDED_STATE_DICT" in checkpoints.unsafe_resume_loader(launch(DistributedType.FSDP, "SHARDED_STATE_DICT"))
    assert checkpoints.unsafe_resume_loader(launch(DistributedType.FSDP)) is None
    assert checkpoints.unsafe_resume_loader(launch(DistributedType.MULTI_GPU)) is None
    assert checkpoints.unsafe_resume_loader(launch(DistributedType.NO)) is None
