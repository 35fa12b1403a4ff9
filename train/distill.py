"""Distil a draft on target-generated data: the trainer, as one recipe object (accelerate; one process or many).

    specdec train --config recipes/smollm2-135m.yaml [key=value ...]
    python -m specdec.train --config recipes/smollm2-135m.yaml [key=value ...]
    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml -m specdec.train --config recipes/X.yaml
    specdec train --config recipes/X.yaml resume_from=latest        # continue a stopped run

`Distiller.run` reads top to bottom: set up the data, the models and the optimiser, resume, then per optimizer
step take the step's micro-batches from a deterministic schedule (train/batches.py), backward the kind's loss,
clip, step, schedule; every `eval_every` steps score the held-out split (alpha, greedy agreement, tau(k) replayed
as the decoder proposes: specdec/replay.py) and keep the best tau at `best_k` in `best/`; checkpoints
(accelerator.save_state) go to output_dir/checkpoints/step-N (train/checkpoints.py); the final draft to
output_dir/final/. `.item()` happens only at log and eval steps.

Each kind of draft owns its construction, teacher signal, loss and held-out figures, through its training side
(train/kinds/: `TrainingKind.start`, registered by name): token-only drafts in train/plain_train.py (online, offline
or on-policy teacher), EAGLE-3 drafts (they read the target's hidden states, read per batch from the data stage's
recording or computed per batch, and train on unrolled proposals) in train/eagle3_train.py. The loop never asks
which kind it holds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object, set_seed
from tqdm.auto import tqdm

from specdec.cli import command_help
from specdec.config import config_from_cli, wants_help
from specdec.models import load_model, load_tokenizer, resolve_mixed_precision
from specdec.tokens import tokenizer_pad_id
from specdec.train import checkpoints, host_memory, kinds, optim, plan, target_parts
from specdec.train import draft as draft_lib
from specdec.train.batches import (
    CountFrom,
    MicroBatches,
    Schedule,
    as_is,
    collate,
    data_folders,
    load_data,
    row_lengths,
    shared_prefixes,
    to_device,
)
from specdec.train.budget import TimeBudget
from specdec.train.checkpoints import ConsumedLog, export_draft, save_checkpoint
from specdec.train.data import read_manifest
from specdec.train.draft import DERIVED, SCRATCH
from specdec.train.slices import slices
from specdec.train.train_config import TEACHERS, TrainConfig  # noqa: F401  (its home for callers)

log = logging.getLogger(__name__)

def _wandb_run(cfg: TrainConfig):
    try:
        import wandb
    except ImportError as err:
        raise ValueError("report_to=wandb needs the wandb package: pip install specdec[wandb]") from err
    return wandb.init(project=cfg.wandb_project, name=cfg.run_name or None, config=cfg.settings(),
                      dir=cfg.output_dir)


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


class Distiller:
    """`specdec train`, in torchtune's recipe shape: each stage a method, `run` the whole of it in order."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.budget = TimeBudget(cfg.max_minutes or math.inf, cfg.max_steps)  # loading counts as training time
        self.accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum_steps,
                                       mixed_precision=resolve_mixed_precision(cfg.mixed_precision, cfg.device),
                                       cpu=cfg.device == "cpu")
        acc = self.accelerator
        self.main, self.rank, self.world, self.device = (acc.is_main_process, acc.process_index,
                                                         acc.num_processes, acc.device)
        log.info("device %s, %d process(es), mixed precision %s", self.device, self.world, acc.mixed_precision)
        sharded = acc.distributed_type.value in ("FSDP", "DEEPSPEED")
        if cfg.lora and sharded:
            raise ValueError("lora=true is supported with single-process or DDP launches (recipes/accelerate/"
                             "single_gpu.yaml, multi_gpu.yaml); use a full fine-tune with FSDP / DeepSpeed")
        if sharded and kinds.for_recipe(cfg.draft).facts.replicated:
            raise ValueError(f"draft={cfg.draft} trains with DDP (accelerate launch --config_file recipes/accelerate/"
                             "multi_gpu.yaml), not FSDP or DeepSpeed: the draft is small enough to be replicated")
        set_seed(cfg.seed)
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.ckpt_root = self.out / "checkpoints"
        self.best: dict[str, Any] = {"tau": -1.0, "step": None}
        self.start_step = 0
        self.vocab_ids: list[int] | None = None  # the reduced draft head's target ids (None: every id)
        self.flat_evals = 0  # evaluations in a row that did not raise the best tau by min_tau_gain
        self.evaluated_at: int | None = None
        self.stopped_by = "max_steps"
        # This run's pace (summary): its steps after the first, summed (this process's samples, tokens as the
        # log's tokens/s counts them, and positions computed, padding included), and each evaluation's and
        # checkpoint's wall time (a new best's export included): what a run spends besides its steps.
        self.timed = {"steps": -1, "seconds": 0.0, "samples": 0, "tokens": 0, "positions": 0}
        self.eval_seconds: list[float] = []
        self.save_seconds: list[float] = []
        self.vocab_coverage: float | None = None  # held-out completion tokens the reduced head can propose

    def setup_data(self) -> None:
        """The training and held-out splits, the tokenizer and the batch schedule."""
        cfg = self.cfg
        self.train_ds, heldout_ds = load_data(cfg)
        self.tokenizer = load_tokenizer(cfg.target)
        tok = self.tokenizer
        self.pad_id = tokenizer_pad_id(tok)
        # Scored eval_batch_size rows at a time, rows of like length together: a chunk is then not padded to the
        # length of one long row among short ones. The figures pool every scored position, so order leaves them be.
        self.heldout = sorted((heldout_ds[i] for i in range(min(cfg.eval_samples, len(heldout_ds)))),
                              key=lambda row: len(row["input_ids"]))
        lengths = row_lengths(self.train_ds, cfg.max_length)
        self.shared = None
        if cfg.supervise_prompt:  # positions another row scores already are left to it
            self.shared = shared_prefixes(self.train_ds, cfg.max_length)
            log.info("prompt positions: %d of the rows' %d repeat an earlier row's (the opening all rows share, a "
                     "later answer's prompt, a later turn's earlier turns) and are scored in that row only",
                     int((self.shared.astype("int64") - 1).clip(min=0).sum()), sum(lengths))
        self.schedule = Schedule(lengths, cfg.per_device_batch_size * self.world, cfg.seed, cfg.bucket_by_length)

    def draft_vocabulary(self, vocab_size: int, size: int) -> torch.Tensor:
        """The reduced draft head's target ids (`vocabulary_ids`), and how much of the held-out completions they can
        propose at all: on held-out topics that can be well under the training completions' share, and it caps the
        draft's first-proposal agreement."""
        self.vocab_ids = self.vocabulary_ids(vocab_size, size)
        if self.main:
            self.vocab_coverage = draft_lib.completion_coverage(self.heldout, self.vocab_ids, vocab_size)
        if self.vocab_coverage is not None:
            log.info("reduced draft head: its %d ids cover %.1f%% of the held-out completion tokens (the most its "
                     "first proposal can agree)", len(self.vocab_ids), 100 * self.vocab_coverage)
        return torch.tensor(self.vocab_ids, dtype=torch.long)

    def vocabulary_ids(self, vocab_size: int, size: int) -> list[int]:
        """The ids: those a resumed checkpoint was trained with, else counted once, by the main process, and kept
        in output_dir/draft_vocab.json for every process and every resume on the same data."""
        cfg, path = self.cfg, self.out / "draft_vocab.json"
        trained = checkpoints.trained_vocabulary(self.resume_ckpt) if self.resume_ckpt is not None else None
        if trained is not None:
            if len(trained) != size:
                raise ValueError(f"resume_from: {self.resume_ckpt} was trained with a draft head over {len(trained)} "
                                 f"target ids, and draft_vocab_size asks for {size}: resume with "
                                 f"draft_vocab_size={len(trained)}, or start afresh")
            log.info("resuming: the draft keeps the %d-id vocabulary its checkpoint was trained with", len(trained))
            return trained
        train_paths, heldout_path = data_folders(cfg)
        key = {"size": size, "vocab": vocab_size, "heldout": str(heldout_path or cfg.heldout_fraction),
               "data": [[str(p), read_manifest(p).get("fingerprint"), len(read_manifest(p)["shards"])]
                        for p in train_paths]}
        if self.main and (not path.is_file() or json.loads(path.read_text()).get("key") != key):
            tok = self.tokenizer
            keep = draft_lib.frequent_ids(self.train_ds, size, vocab_size,
                                          [tok.eos_token_id, tok.bos_token_id, self.pad_id])
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps({"key": key, "ids": keep.tolist()}))
            os.replace(tmp, path)
        self.accelerator.wait_for_everyone()
        return json.loads(path.read_text())["ids"]

    def setup_models(self) -> None:
        """The target (where the draft is built from it or the loop reads it: whole, or only the parts a run with
        recorded states reads, train/target_parts.py) and the draft's kind."""
        cfg = self.cfg
        train_paths, heldout_path = data_folders(cfg)
        folders = train_paths + ([heldout_path] if heldout_path else [])
        parts_only = target_parts.loads_parts_only(cfg)
        self.kind = self.start_kind(self.load_target(parts_only), folders)
        if parts_only and target_parts.recordings_differ(cfg, folders, self.kind.model):
            log.warning("states=auto: some data folder recorded other layers than the draft reads, so their states "
                        "are computed online: loading the whole target")
            self.kind = self.start_kind(self.load_target(False), folders)
        self.model = self.kind.model
        self.model.train()

    def load_target(self, parts_only: bool):
        """The frozen target: its parts alone, or whole (on the device where the loop reads it, else the CPU, to
        build the draft from); None where neither needs it."""
        cfg = self.cfg
        if parts_only:
            target = target_parts.load_target_parts(cfg.target, cfg.dtype, self.device,
                                                    last_layer=target_parts.reads_last_layer(cfg))
            log.info("target: only its embedding, final norm and head%s loaded (%s parameters): the states are "
                     "recorded", " and last layer" if target_parts.reads_last_layer(cfg) else "",
                     f"{target_parts.parameter_count(target):,}")
            return target
        if not (cfg.needs_target or cfg.draft in (DERIVED, SCRATCH)):
            return None
        target = load_model(cfg.target, dtype=cfg.dtype, device=self.device if cfg.needs_target else "cpu")
        return target.requires_grad_(False)

    def start_kind(self, target, folders):
        """The draft kind's training side (train/kinds/base.py: TrainingKind.start), which builds the draft."""
        return kinds.for_recipe(self.cfg.draft).start(self.cfg, target, self.tokenizer, self.draft_vocabulary,
                                                      self.device, autocast=self.accelerator.autocast, folders=folders)

    def setup_optim(self) -> None:
        """The recipe's optimizer over the trainable parameters and its schedule (train/optim.py), prepared by
        accelerate."""
        optimizer, self.scheduler = optim.build(self.cfg, self.model)
        self.model, self.optimizer = self.accelerator.prepare(self.model, optimizer)
        # Not prepared (accelerate would step it once per process; it is stepped once per optimizer step) and not
        # registered for checkpointing (accelerate would pickle it): its state is JSON in trainer_state.json.

    def claim_output_dir(self) -> None:
        """Before anything loads: the checkpoint to resume (checked), or a fresh start where no other run's
        results are (overwrite=true: what specdec wrote there removed first); the run id every checkpoint and
        the output_dir's marker carry, so that pruning and `latest` see this run's steps only."""
        cfg, acc = self.cfg, self.accelerator
        removals = []
        if cfg.resume_from:
            unsafe = checkpoints.unsafe_resume_loader(acc)
            if unsafe and not cfg.trust_checkpoint:
                raise ValueError(f"resume_from={cfg.resume_from} refused: {unsafe}, so resuming could run code a "
                                 "checkpoint holds; resume under DDP or FSDP with fsdp_state_dict_type: "
                                 "FULL_STATE_DICT (recipes/accelerate/multi_gpu.yaml, fsdp.yaml), or pass "
                                 "trust_checkpoint=true for a checkpoint you wrote yourself")
            if unsafe:
                log.warning("trust_checkpoint=true: resuming %s with a loader that unpickles (%s)", cfg.resume_from,
                            unsafe)
            self.resume_ckpt = checkpoints.find_resume_checkpoint(self.out, cfg.resume_from)
            self.run_id = checkpoints.read_state(self.resume_ckpt)["run_id"]
        else:
            self.resume_ckpt = None
            removals = checkpoints.fresh_start_removals(self.out, cfg.overwrite)
            self.run_id = broadcast_object_list([checkpoints.new_run_id()])[0]
        acc.wait_for_everyone()  # every process has looked before the main one removes anything
        if self.main:
            if removals:
                log.info("starting afresh in %s: removing what earlier runs of specdec train wrote there", self.out)
            checkpoints.remove_outputs(self.out, removals)
            checkpoints.write_marker(self.out, self.run_id)
        acc.wait_for_everyone()

    def resume(self) -> None:
        """Continue from `resume_from` (the training state, the best so far and the time spent), if asked."""
        cfg = self.cfg
        ckpt = self.resume_ckpt
        if ckpt is not None:
            state = checkpoints.load_checkpoint(self.accelerator, ckpt, self.scheduler)
            self.start_step, self.best = state["step"], state["best"]
            self.flat_evals = state.get("flat_evals", 0)
            self.budget.resume(state.get("train_seconds", 0.0))
            log.info("resumed from %s at step %d", ckpt, self.start_step)
        self.schedule_end = self.scheduler.lr_lambdas[0]
        # Under a time budget the end reached so far came back with the checkpoint; otherwise max_steps sets it
        # (and a resume with a larger max_steps trains on).
        end = self.schedule_end
        end.end = min(end.end, cfg.max_steps) if cfg.max_minutes else cfg.max_steps

    def micro_batches(self):
        """This process's micro-batches from the run's first one on, collated (and read ahead) by `data_workers`
        loader processes while the steps run."""
        cfg = self.cfg
        data = MicroBatches(self.train_ds, self.schedule, self.rank, cfg.per_device_batch_size, self.pad_id,
                            cfg.max_length, self.kind.prefetch, cfg.pack, cfg.supervise_prompt, cfg.pad_to_multiple_of,
                            self.shared)
        workers = cfg.data_workers
        loader = torch.utils.data.DataLoader(data, batch_size=None, sampler=CountFrom(self.start_step * cfg.grad_accum_steps),
                                             collate_fn=as_is, num_workers=workers,
                                             prefetch_factor=2 if workers else None)
        return iter(loader)

    def denominators(self, batches: list[dict]) -> torch.Tensor | None:
        """What the kind divides its summed loss by so that the step's gradient is the mean over every scored
        position of every process and micro-batch (one sync a step); None: each micro-batch's own mean."""
        counts = [self.kind.counts(batch) for batch in batches]
        if counts[0] is None:
            return None
        total = self.accelerator.reduce(torch.stack(counts).sum(0), reduction="sum")
        # accelerate divides each micro-batch's loss by the accumulation steps and DDP averages over processes
        return total.clamp(min=1).float() / (self.world * self.cfg.grad_accum_steps)

    def train_step(self, step: int, micro_batches) -> tuple[torch.Tensor, int, list[str]]:
        """One optimizer step: its micro-batches' losses backward, clipped, stepped. -> (loss, tokens, sample ids)"""
        cfg, acc = self.cfg, self.accelerator
        loss_sum, tokens, step_ids = torch.zeros((), device=self.device), 0, []
        taken = [next(micro_batches) for _ in range(cfg.grad_accum_steps)]
        taken = [(ids, to_device(batch, self.device), ahead) for ids, batch, ahead in taken]
        denominators = self.denominators([batch for _, batch, _ in taken])
        for micro, (micro_ids, batch, ahead) in enumerate(taken):
            m = (step - 1) * cfg.grad_accum_steps + micro
            step_ids += micro_ids
            with acc.accumulate(self.model):
                parts = slices(batch, ahead, cfg.slice_tokens)
                for i, (part, part_ahead) in enumerate(parts):
                    # the processes' gradients meet once, after the micro-batch's last slice
                    with acc.no_sync(self.model) if i < len(parts) - 1 else contextlib.nullcontext():
                        loss = self.kind.loss(self.model, part, m, self.rank, part_ahead, denominators)
                        acc.backward(loss)
                    loss_sum += loss.detach() / cfg.grad_accum_steps
                if acc.sync_gradients and cfg.max_grad_norm > 0:
                    acc.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            tokens += batch["n_tokens"]
        self.last_positions = sum(batch["input_ids"].numel() for _, batch, _ in taken)
        self.scheduler.step()
        return loss_sum, tokens, step_ids

    def heldout_chunks(self):
        """This process's share of the held-out rows (every world-th chunk) as (rows, collated batch on the
        device), eval_batch_size at a time."""
        cfg = self.cfg
        starts = range(self.rank * cfg.eval_batch_size, len(self.heldout), cfg.eval_batch_size * self.world)
        for s in starts:
            chunk = self.heldout[s:s + cfg.eval_batch_size]
            rows = {k: [r.get(k) for r in chunk] for k in chunk[0]}
            batch = {k: v.to(self.device) if torch.is_tensor(v) else v
                     for k, v in collate(rows, self.pad_id, cfg.max_length, multiple=cfg.pad_to_multiple_of).items()}
            yield rows, batch

    def evaluate(self, step: int) -> None:
        """Held-out figures at `step`, logged and appended to eval.jsonl; a new best tau(best_k) goes to best/."""
        if not self.heldout:
            return
        cfg, started = self.cfg, time.perf_counter()
        metrics = self.kind.evaluate(self.model, self.heldout_chunks(), gather_object)
        tau = metrics["tau"][cfg.best_k]
        if self.main:
            # agreement: the first proposal's, at every completion position; tau(1) - 1: the acceptance of k = 1
            # rounds, which start only after a correction or bonus (fewer easy positions), so it reads lower.
            top_n = metrics.get("top_n_agreement") or [{}]
            log.info("step %d held-out: alpha %.3f  greedy agreement %.3f  tau(k=%d) %.3f  tau %s  top-n at the "
                     "first position %s", step, metrics["alpha"], metrics["agreement"], cfg.best_k, tau,
                     {k: round(v, 3) for k, v in metrics["tau"].items()},
                     {n: round(v, 3) for n, v in top_n[0].items()})
            with (self.out / "eval.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
            if self.tracker is not None:
                self.tracker.log({"eval/alpha": metrics["alpha"], "eval/agreement": metrics["agreement"],
                                  **{f"eval/tau@{k}": v for k, v in metrics["tau"].items()},
                                  **{f"eval/top{n}@1": v for n, v in top_n[0].items()}}, step=step)
        if step > 0:
            self.flat_evals = 0 if tau >= self.best["tau"] + cfg.min_tau_gain else self.flat_evals + 1
        self.evaluated_at = step
        if step > 0 and tau > self.best["tau"]:
            self.best.update(tau=tau, step=step, metrics=metrics)
            export_draft(self.accelerator, self.model, self.tokenizer, self.out / "best")
            if self.main:
                (self.out / "best" / "specdec_best.json").write_text(json.dumps({"step": step, **metrics}, indent=1))
        self.budget.note_eval(time.perf_counter() - started)
        self.eval_seconds.append(time.perf_counter() - started)

    def save(self, step: int) -> None:
        state = {"step": step, "best": _jsonable(self.best), "train_seconds": self.budget.spent(),
                 "flat_evals": self.flat_evals, "run_id": self.run_id, "scheduler": self.scheduler.state_dict(),
                 "draft_vocab": self.vocab_ids}
        started = time.perf_counter()
        save_checkpoint(self.accelerator, self.ckpt_root, step, state, self.cfg.keep_checkpoints)
        self.save_seconds.append(time.perf_counter() - started)

    def aim_end(self, step: int, end: int) -> int:
        """Under max_minutes, the step the measured pace reaches in time (every process takes the earliest)."""
        if not self.cfg.max_minutes:
            return end
        wanted = torch.tensor([self.budget.end_step(step)], device=self.device)
        aimed = int(self.accelerator.gather(wanted).min())
        self.schedule_end.end = aimed
        return aimed

    def export(self, step: int, end: int) -> Path:
        """The final draft in output_dir/final and the run's summary."""
        cfg = self.cfg
        final = export_draft(self.accelerator, self.model, self.tokenizer, self.out / "final")
        if self.main:
            summary = {"final": str(final), "steps": step, "best": _jsonable(self.best), "device": str(self.device),
                       "processes": self.world, "mixed_precision": self.accelerator.mixed_precision,
                       "stopped_by": self.stopped_by, "heldout_vocab_coverage": self.vocab_coverage,
                       "train_minutes": self.budget.spent() / 60, "pace": self.pace(), "config": cfg.settings()}
            (self.out / "train_summary.json").write_text(json.dumps(summary, indent=1))
            log.info("final draft: %s (best tau(k=%d) %.3f at step %s -> %s)", final, cfg.best_k, self.best["tau"],
                     self.best["step"], self.out / "best")
        return final

    def prepare(self) -> None:
        """Everything before the first step: the output folder claimed, data, models and optimiser set up, and the
        run resumed where `resume_from` says."""
        self.claim_output_dir()
        self.setup_data()
        self.setup_models()
        self.setup_optim()
        self.resume()

    def run(self) -> Path:
        """Train per the config; returns output_dir/final."""
        cfg = self.cfg
        # Before anything loads: a run that cannot fit stops here, with the fix (train/plan/).
        plan.check_run(cfg, self.device, self.accelerator.mixed_precision, self.world, self.main)
        self.prepare()
        self.tracker = _wandb_run(cfg) if cfg.report_to == "wandb" and self.main else None
        consumed = ConsumedLog(self.out / "consumed", self.rank, self.start_step if cfg.resume_from else None) \
            if cfg.record_consumed else None
        if self.start_step == 0:
            self.evaluate(0)
        step, end = self.start_step, self.schedule_end.end
        micro_batches = self.micro_batches()
        bar = tqdm(total=end, initial=step, disable=not self.main, desc="train", dynamic_ncols=True)
        window = {"loss": torch.zeros((), device=self.device), "tokens": 0, "steps": 0, "start": time.perf_counter()}
        self.budget.start_loop(step)
        while step < end:
            step += 1
            started = time.perf_counter()
            loss, tokens, step_ids = self.train_step(step, micro_batches)
            self.release_host_memory(step)
            self.time_step(time.perf_counter() - started, len(step_ids), tokens)
            window["loss"] += loss
            window["tokens"] += tokens
            window["steps"] += 1
            bar.update(1)
            if consumed is not None:
                consumed.write(step, step_ids)
            if step % cfg.log_every == 0 or step == end:
                end = self.aim_end(step, end)
                bar.total = end
                self.log_window(step, window, bar)
            if cfg.eval_every and step % cfg.eval_every == 0 and step != end:
                self.evaluate(step)
                if cfg.stop_after_flat_evals and self.flat_evals >= cfg.stop_after_flat_evals:
                    self.stopped_by = "held-out plateau"
                    log.info("stopped at step %d: held-out tau(k=%d) rose less than %g over the last %d "
                             "evaluations (stop_after_flat_evals)", step, cfg.best_k, cfg.min_tau_gain,
                             self.flat_evals)
                    break
            if cfg.save_every and step % cfg.save_every == 0 and step != end:
                self.save(step)
        bar.close()
        if end < cfg.max_steps and self.stopped_by == "max_steps":
            self.stopped_by = "max_minutes"
            log.info("stopped at step %d of %d: max_minutes=%s reached (%.1f min)", step, cfg.max_steps,
                     cfg.max_minutes, self.budget.spent() / 60)
        if (step > self.start_step or self.start_step == end) and self.evaluated_at != step:
            self.evaluate(step)
        self.save(step)
        final = self.export(step, end)
        if self.tracker is not None:
            self.tracker.finish()
        if consumed is not None:
            consumed.file.close()
        self.accelerator.end_training()
        return final

    def release_host_memory(self, step: int) -> None:
        """Every release_host_memory_every steps of a CPU run, the heap's freed pages back to the system (inside the
        timed step: the page faults of taking them again are the step's cost)."""
        every = self.cfg.release_host_memory_every
        if every and step % every == 0 and self.device.type == "cpu" and (trim := host_memory.heap_trim()):
            trim()

    def time_step(self, seconds: float, samples: int, tokens: int) -> None:
        """Add a step to the pace, all but the run's first (it also warms the kernels up and caches batches)."""
        timed = self.timed
        timed["steps"] += 1
        if timed["steps"]:
            for key, value in (("seconds", seconds), ("samples", samples), ("tokens", tokens),
                               ("positions", self.last_positions)):
                timed[key] += value

    def pace(self) -> dict:
        """Training's pace over this run's steps after its first (which also warms the kernels up and caches the
        first batches), without evaluations or saves, all processes together: samples and tokens per second of
        the steps taken, and `epoch_samples_per_second`, the whole training set's samples over what one epoch
        would take at the seconds per computed position measured (a few steps' rows may be shorter or longer
        than the epoch's: bucketed batches of long rows cost several short ones). `specdec demo` splits its
        budget by that one. None before two steps."""
        timed = self.timed
        seconds, positions = timed["seconds"], timed["positions"]
        samples, tokens = timed["samples"] * self.world, timed["tokens"] * self.world
        epoch = None
        if seconds > 0 and positions and not self.cfg.pack:  # packed rows: no per-epoch positions to scale by
            epoch_seconds = self.schedule.padded_positions(self.cfg.per_device_batch_size,
                                                            multiple=self.cfg.pad_to_multiple_of,
                                                            max_length=self.cfg.max_length) * seconds / positions
            epoch = self.schedule.per_epoch * self.schedule.global_batch / epoch_seconds
        return {"steps_timed": max(0, timed["steps"]), "seconds": seconds,
                "samples_per_second": samples / seconds if seconds > 0 else None,
                "tokens_per_second": tokens / seconds if seconds > 0 else None,
                "epoch_samples_per_second": epoch, "samples_per_step": self.schedule.global_batch * self.cfg.grad_accum_steps,
                "eval_seconds": _mean(self.eval_seconds), "save_seconds": _mean(self.save_seconds)}

    def log_window(self, step: int, window: dict, bar) -> None:
        """Mean loss (a sync), learning rate and tokens/s since the last log step; the window then restarts."""
        mean_loss = self.accelerator.reduce(window["loss"], reduction="mean").item() / window["steps"]
        lr = self.scheduler.get_last_lr()[0]
        tok_s = window["tokens"] * self.world / max(time.perf_counter() - window["start"], 1e-9)
        bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}")
        if self.main:
            log.info("step %d loss %.4f lr %.2e tokens/s %.0f", step, mean_loss, lr, tok_s)
            if self.tracker is not None:
                self.tracker.log({"train/loss": mean_loss, "train/lr": lr, "train/tokens_per_s": tok_s}, step=step)
        window.update(loss=torch.zeros((), device=self.device), tokens=0, steps=0, start=time.perf_counter())


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run(cfg: TrainConfig) -> Path:
    """Train a draft per `cfg`; returns output_dir/final."""
    return Distiller(cfg).run()


def main(argv: list[str]) -> int:
    """`specdec train` / `python -m specdec.train` / `accelerate launch -m specdec.train`."""
    if wants_help(argv):
        print(command_help("train"))
        return 0
    options, argv = plan.split_plan_args(argv)
    cfg = config_from_cli(TrainConfig, argv, section="train")
    if options.plan:  # print the memory and disk plan, train nothing
        return plan.show(cfg, options, argv)
    run(cfg)
    return 0
