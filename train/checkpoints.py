"""Checkpoints (accelerate's full training state, written atomically), the exported draft, the run folder's
ownership, and the log of the samples each step consumed (proof that resuming neither repeats nor skips data).

A checkpoint holds tensors and JSON only: the weights (safetensors), the optimizer and RNG states (torch files that
accelerate reads with `weights_only=True`) and trainer_state.json (step, best, time spent, the learning-rate
schedule, the run id). Nothing in it is unpickled as code: drafts and checkpoints are shared between people, and
resuming one must not run anything it holds. Each checkpoint and the output_dir's run marker carry the run's id,
so that pruning and `resume_from=latest` touch only the current run's steps.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import uuid
import zipfile
from pathlib import Path

from accelerate.utils import DistributedType
from accelerate.utils import load as weights_only_load
from safetensors import SafetensorError, safe_open

from specdec.models import save_model
from specdec.train.draft import merged

CHECKPOINTS = "checkpoints"  # output_dir/checkpoints/step-N
RUN_MARKER = "train_run.json"  # output_dir/train_run.json: {"run_id": ...}, the run that specdec trains there
RESULTS = ("final", "best", "train_summary.json")  # a finished or checkpointed run's outputs, beside its steps
# What else the trainer writes into output_dir (removed with overwrite=true, with checkpoints/step-N and
# consumed/rank-R.jsonl). Not the data folders, nor draft_vocab.json: a cache keyed by the data, right for any run.
WRITTEN = RESULTS + ("final.tmp", "best.tmp", "eval.jsonl", RUN_MARKER)
_STEP = re.compile(r"step-(\d+)(\.tmp)?")
# Errors that reading a damaged or crafted checkpoint raises (a truncated file, a refused pickle, a missing key).
LOAD_ERRORS = (pickle.UnpicklingError, RuntimeError, OSError, EOFError, KeyError, SafetensorError, zipfile.BadZipFile)


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def step_of(folder: Path) -> int | None:
    """N for a complete-looking step-N folder name, else None."""
    m = _STEP.fullmatch(folder.name)
    return int(m[1]) if m and not m[2] else None


def read_state(ckpt: Path) -> dict | None:
    """A checkpoint's trainer_state.json, or None when it is missing or unreadable."""
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def trained_vocabulary(ckpt: Path) -> list[int] | None:
    """The target ids of the draft's head when `ckpt` was saved: trainer_state.json's `draft_vocab`, else (a
    checkpoint written before the state kept it) the d2t offsets in its weights; None for a head over every id.

    A resume must keep them: counted again on data that has grown or a held-out setting that changed, the ids
    would differ from those the trained head rows were learned for, and nothing would say so."""
    state = read_state(ckpt) or {}
    if state.get("draft_vocab") is not None:
        return [int(i) for i in state["draft_vocab"]]
    weights = ckpt / "model.safetensors"
    if not weights.is_file():
        return None
    with safe_open(weights, "pt") as f:
        key = next((k for k in f.keys() if k == "d2t" or k.endswith(".d2t")), None)
        if key is None:
            return None
        d2t = f.get_tensor(key)
    return [row + int(offset) for row, offset in enumerate(d2t.tolist())]


def marker_run_id(out: Path) -> str | None:
    """The run id the output_dir's marker names (None: no marker, or an unreadable one)."""
    try:
        return json.loads((out / RUN_MARKER).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def write_marker(out: Path, run_id: str) -> None:
    tmp = out / f".{RUN_MARKER}.tmp"
    tmp.write_text(json.dumps({"run_id": run_id, "writer": "specdec train"}) + "\n")
    os.replace(tmp, out / RUN_MARKER)


def _complete_steps(root: Path, run_id: str | None = None) -> list[Path]:
    """step-N folders with a trainer_state.json, by step; with `run_id`, those of that run (and those whose state
    cannot be read, which may be its own, damaged: resuming one says so)."""
    found = [p for p in root.glob("step-*") if p.is_dir() and step_of(p) is not None
             and (p / "trainer_state.json").is_file()]
    if run_id is not None:
        found = [p for p in found if (read_state(p) or {"run_id": run_id}).get("run_id") == run_id]
    return sorted(found, key=step_of)


def latest_checkpoint(root: Path, run_id: str | None = None) -> Path | None:
    """The complete checkpoint with the highest step under `root` (of run `run_id` when given)."""
    steps = _complete_steps(root, run_id)
    return steps[-1] if steps else None


def prune(root: Path, run_id: str, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints of run `run_id`; other runs' steps are not this run's to remove."""
    own = [p for p in _complete_steps(root) if (read_state(p) or {}).get("run_id") == run_id]
    for old in own[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(accelerator, root: Path, step: int, state: dict, keep: int) -> Path:
    """accelerator.save_state into step-N (written as step-N.tmp and renamed, so a kill never leaves half), then
    trainer_state.json (the JSON `state`, which names the run) and the pruning of the run's older steps."""
    tmp, final = root / f"step-{step}.tmp", root / f"step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        prune(root, state["run_id"], keep)
    accelerator.wait_for_everyone()
    return final


# ---- reading a checkpoint back -------------------------------------------------------------------------------


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why `ckpt` cannot be resumed, found without loading its tensors (None: it looks whole)."""
    state = read_state(ckpt)
    if state is None:
        return "its trainer_state.json is missing or not valid JSON"
    if not (isinstance(state.get("step"), int) and isinstance(state.get("scheduler"), dict) and state.get("run_id")):
        return "its trainer_state.json lacks the step, the schedule's state or the run id (an older specdec's?)"
    pickles = sorted(p.name for p in ckpt.glob("custom_checkpoint_*.pkl"))
    if pickles:
        return (f"it holds {pickles[0]}, a pickle that could run code when loaded; specdec's checkpoints hold "
                "tensors and JSON only")
    for path in sorted(ckpt.iterdir()):
        problem = _file_problem(path)
        if problem:
            return problem
    return None


def _file_problem(path: Path) -> str | None:
    """A cheap check of one file: a safetensors header that covers the file, a torch file's zip directory, and an
    RNG state that loads as plain data (accelerate would skip a bad one silently: the resume would not be exact)."""
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                f.keys()
        elif path.suffix in (".bin", ".pkl", ".pt"):
            zipfile.ZipFile(path).close()  # torch.save writes a zip; a cut file has no directory at its end
            if path.name.startswith("random_states_"):
                weights_only_load(path)  # torch.load(weights_only=True), numpy's RNG types allowed
    except LOAD_ERRORS as err:
        return f"{path.name} {_describe(err)}"
    return None


REFUSED_PICKLE = "holds objects other than tensors and plain data (refused: loading them could run code)"


def _describe(err: BaseException) -> str:
    """A file's load error in a few words: a refused pickle as such, a cut file as such, else its first line."""
    if isinstance(err, pickle.UnpicklingError):  # torch's weights_only loader refused a global
        return REFUSED_PICKLE
    if isinstance(err, zipfile.BadZipFile):
        return "is truncated or not a torch file"
    return f"is damaged or truncated ({_first_line(err)})"


def _first_line(err: BaseException) -> str:
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return line if len(line) <= 160 else line[:157] + "..."


def previous_good(ckpt: Path) -> Path | None:
    """The newest checkpoint of the same run before `ckpt`, beside it, that looks whole."""
    step, run_id = step_of(ckpt), (read_state(ckpt) or {}).get("run_id")
    if step is None:
        return None
    earlier = [p for p in _complete_steps(ckpt.parent, run_id) if step_of(p) < step]
    return next((p for p in reversed(earlier) if checkpoint_problem(p) is None), None)


def unusable(ckpt: Path, problem: str) -> ValueError:
    """The one-line error for a checkpoint that cannot be resumed, naming the one to resume from instead."""
    before = previous_good(ckpt)
    fix = (f"resume from the one before it: resume_from={before}" if before else
           "no earlier checkpoint of its run is usable: start afresh with overwrite=true or another output_dir")
    return ValueError(f"checkpoint {ckpt} cannot be resumed: {problem}; {fix}")


def find_resume_checkpoint(out: Path, resume_from: str) -> Path:
    """The checkpoint `resume_from` names (`latest`: the current run's newest under out/checkpoints), checked."""
    root = out / CHECKPOINTS
    if resume_from == "latest":
        ckpt = latest_checkpoint(root, marker_run_id(out))
        if ckpt is None:
            raise ValueError(f"no complete checkpoint to resume from (resume_from=latest under {root}); drop "
                             "resume_from to start afresh")
    else:
        ckpt = Path(resume_from)
        if not ckpt.is_dir():
            raise ValueError(f"no complete checkpoint to resume from (resume_from={resume_from} is not a folder); "
                             f"name a step-N folder under {root}, or latest")
    problem = checkpoint_problem(ckpt)
    if problem:
        raise unusable(ckpt, problem)
    return ckpt


def unsafe_resume_loader(accelerator) -> str | None:
    """Why this launch's checkpoint loader would unpickle arbitrary objects (None: it reads tensors and plain data
    only, as DDP, one process and FSDP's FULL_STATE_DICT do through accelerate's weights_only loads)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return "DeepSpeed loads its checkpoint files with weights_only=False"
    if accelerator.distributed_type == DistributedType.FSDP:
        kind = accelerator.state.fsdp_plugin.state_dict_type
        if "SHARDED" in str(getattr(kind, "name", kind)):
            return "FSDP's SHARDED_STATE_DICT reads torch.distributed.checkpoint's metadata, a pickle"
    return None


def load_checkpoint(accelerator, ckpt: Path, scheduler) -> dict:
    """Restore the training state from `ckpt` (checked by find_resume_checkpoint) -> its trainer_state."""
    try:
        accelerator.load_state(str(ckpt))
    except pickle.UnpicklingError as err:
        raise unusable(ckpt, f"a file {REFUSED_PICKLE}") from err
    except LOAD_ERRORS as err:  # damaged past what the cheap checks see, or another run's shapes
        raise unusable(ckpt, f"its state could not be loaded ({_first_line(err)})") from err
    state = read_state(ckpt)
    scheduler.load_state_dict(state["scheduler"])
    return state


# ---- whose output_dir ----------------------------------------------------------------------------------------


def fresh_start_removals(out: Path, overwrite: bool) -> list[Path]:
    """What a fresh run (no resume_from) must remove from `out` first: nothing where no other run left results;
    with overwrite=true, what specdec's trainer wrote there. Refuses (ValueError) to mix with another run, and to
    remove anything from a folder whose results the run marker does not claim as specdec's."""
    root = out / CHECKPOINTS
    steps = [p for p in root.glob("step-*") if p.is_dir() and _STEP.fullmatch(p.name)] if root.is_dir() else []
    results = [p for p in steps if step_of(p) is not None] + [out / n for n in RESULTS if (out / n).exists()]
    if results and not overwrite:
        names = ", ".join(str(p.relative_to(out)) for p in sorted(results)[:3])
        raise ValueError(f"output_dir {out} holds another training run ({names}); pass resume_from=latest to "
                         "continue it, overwrite=true to replace it, or choose another output_dir")
    if not (out / RUN_MARKER).is_file():
        if results:
            raise ValueError(f"output_dir {out} holds checkpoints or drafts without specdec's run marker "
                             f"({RUN_MARKER}), so overwrite=true removes nothing there; move them away or choose "
                             "another output_dir")
        return []
    consumed = sorted((out / "consumed").glob("rank-*.jsonl"))
    return steps + consumed + [out / n for n in WRITTEN if (out / n).exists()]


def remove_outputs(out: Path, paths: list[Path]) -> None:
    """Remove `paths` (from fresh_start_removals), then the checkpoints/ and consumed/ folders if left empty."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    for folder in (out / CHECKPOINTS, out / "consumed"):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


# ---- the exported draft and the consumed samples -------------------------------------------------------------


def export_draft(accelerator, model, tokenizer, out: Path) -> Path:
    """The draft as a plain transformers checkpoint (LoRA merged; id map when reduced); main process writes."""
    unwrapped = accelerator.unwrap_model(model)
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    # FSDP / DeepSpeed hold shards: gather a full state dict (a collective: every rank must call it).
    state = accelerator.get_state_dict(model) if sharded else None
    if accelerator.is_main_process:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        # the gathered state of the sharded model, or the model itself (LoRA merged), saved by its kind
        save_model(unwrapped if sharded else merged(unwrapped), tokenizer, tmp, state_dict=state)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    accelerator.wait_for_everyone()
    return out


class ConsumedLog:
    """Each step's sample ids per rank (proof that resuming neither repeats nor skips data)."""

    def __init__(self, folder: Path, rank: int, resume_step: int | None):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank-{rank}.jsonl"
        kept = []
        if resume_step is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill
                    continue
                if rec["step"] <= resume_step:
                    kept.append(line)
        self.path.write_text("".join(k + "\n" for k in kept))
        self.file = self.path.open("a")

    def write(self, step: int, ids: list[str]) -> None:
        self.file.write(json.dumps({"step": step, "ids": ids}) + "\n")
        self.file.flush()
