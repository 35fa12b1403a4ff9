"""Checkpoints (accelerate's full training state, written atomically), the exported draft, and the log of the
samples each step consumed (proof that resuming neither repeats nor skips data)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from accelerate.utils import DistributedType

from specdec.models import save_model
from specdec.train.draft import merged


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step under `root` (a trainer_state.json marks it complete)."""
    done = [p for p in root.glob("step-*") if p.is_dir() and (p / "trainer_state.json").is_file()
            and p.name.split("-", 1)[1].isdigit()]
    return max(done, key=lambda p: int(p.name.split("-", 1)[1]), default=None)


def save_checkpoint(accelerator, root: Path, step: int, state: dict, keep: int) -> Path:
    """accelerator.save_state into step-N (written as step-N.tmp and renamed, so a kill never leaves half)."""
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
        steps = sorted((p for p in root.glob("step-*") if p.name.split("-", 1)[1].isdigit()),
                       key=lambda p: int(p.name.split("-", 1)[1]))
        for old in steps[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


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
