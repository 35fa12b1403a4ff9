"""The `train:` section of a recipe: every setting of `specdec train`, its default and its check; each draft kind's
own keys are its options block (train/kinds/options.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from specdec.models import EMBEDDED_TARGET
from specdec.train import kinds, losses
from specdec.train.budget import SCHEDULES, check_minutes
from specdec.train.draft import DEFAULT_LORA_MODULES, DERIVED, SCRATCH
from specdec.train.heldout import check_temperatures
from specdec.train.kinds.options import takes_kind_options
from specdec.train.optim import OPTIMIZERS

log = logging.getLogger(__name__)

TEACHERS = ("online", "offline", "on_policy")


@takes_kind_options
@dataclass
class TrainConfig:
    """The `train:` section of a recipe (plus the shared keys). See recipes/*.yaml for worked examples. The keys
    only one kind of draft reads are in that kind's options block (train/kinds/: `cfg.options`)."""

    # --- shared keys
    target: str = EMBEDDED_TARGET  # the target: Hub id, local checkpoint folder or embedded:smollm2-135m-instruct
    # The draft to train: derived (a few of the target's layers, draft_layers), scratch (the target's config with draft_config, random layers), the Hub id / local path
    # of a pretrained small model with the target's tokenizer, or a registered kind (eagle3: its options below).
    draft: str = DERIVED
    seed: int = 0  # seeds the new weights, the batch order and on-policy sampling
    # The run's folder: checkpoints/, best/ (the best held-out tau), final/ (the draft), eval.jsonl,
    # train_summary.json; the data folders default to <output_dir>/data and <output_dir>/data_heldout.
    output_dir: str = "runs/smollm2-135m"
    device: str = "auto"  # auto: accelerate's device (the launch's GPU, else the CPU); cpu: the CPU even with a GPU
    # The target's dtype: auto (bfloat16 on CUDA, float32 on a CPU), float32, bfloat16, float16 or bf16-if-native.
    # The draft trains in float32 under mixed_precision.
    dtype: str = "auto"
    # none | wandb: log loss, learning rate, tokens/s and held-out figures to wandb (pip install specdec[wandb]).
    report_to: str = "none"
    run_name: str = ""  # the wandb run's name (report_to=wandb); "" = wandb's own
    # --- data (folders written by `specdec data`; "" = <output_dir>/data and <output_dir>/data_heldout)
    train_data: str = ""  # `specdec data` folder(s), comma-separated; default <output_dir>/data
    # `specdec data` folder scored every eval_every steps; default <output_dir>/data_heldout where it exists, else
    # a heldout_fraction split of the training data.
    heldout_data: str = ""
    heldout_fraction: float = 0.05  # share of prompts (hashed prompt_id) held out when there is no held-out folder
    max_length: int = 1024  # tokens per sample (prompt + completion) the draft reads; longer samples are cut
    # --- draft construction (a kind's own construction keys are in its options block)
    # draft=derived: the target's layers the draft keeps, in order (negatives count from the end), with the
    # target's embeddings, final norm and head.
    draft_layers: list[int] = field(default_factory=lambda: [0, 1, -1])
    # draft=scratch: overrides of the target's config, e.g. {num_hidden_layers: 2} (hidden_size stays the target's).
    draft_config: dict = field(default_factory=dict)
    # N = keep the N most frequent completion tokens in the head; 0 = the full vocabulary; -1 = auto (the draft
    # kind's default over a larger vocabulary: an EAGLE-3 draft keeps 32,000, as the peers do; a plain draft the
    # full one)
    draft_vocab_size: int = -1
    # Keep the input embeddings (the target's) fixed: tokens absent from the training data keep embeddings
    # that match the trained layers. With a tied full head this freezes the head too.
    freeze_embeddings: bool = False
    # Keep the head (the target's rows) fixed: the draft learns to land in the target's final hidden space,
    # so ids rare in the training data keep the target's own output directions.
    freeze_head: bool = False
    # --- teacher signal and loss
    # The teacher signal: online (the target's logits, computed on each batch), offline (the top-n log-probs the
    # data stage stored with top_logprobs=N; loss=ce needs none), or on_policy (online, and on_policy_fraction of
    # the micro-batches are continuations the draft samples).
    teacher: str = "online"
    # fkl (forward KL(p || q)), rkl (reverse KL(q || p)), jsd (generalized JSD, beta), tvd (total variation) or ce
    # (cross-entropy on the target's tokens, no teacher logits needed).
    loss: str = "fkl"
    beta: float = 0.5  # loss=jsd: generalized JSD interpolation (0 = forward KL, 1 = reverse KL)
    # Distillation temperature: the target's and the draft's logits are divided by it in fkl, rkl, jsd and tvd
    # (1 = the distributions as they are).
    temperature: float = 1.0
    ce_weight: float = 0.0  # adds weight * cross-entropy on the target's tokens
    # Score the prompts' positions too, not only the completions': the target's distribution there is what the
    # online teacher reads from the same states (recorded or computed), so each sample gives its whole length of
    # supervision for the forward already paid. The held-out figures stay over completions (what is served).
    supervise_prompt: bool = False
    on_policy_fraction: float = 0.5  # teacher=on_policy: lambda, the share of micro-batches generated by the draft
    on_policy_max_new_tokens: int = 16  # teacher=on_policy: tokens the draft samples per continuation
    on_policy_temperature: float = 1.0  # teacher=on_policy: the draft's sampling temperature for them
    # --- optimisation
    lora: bool = False  # train LoRA adapters (peft) instead of every weight; merged into the exported draft
    lora_r: int = 16  # lora=true: the adapters' rank
    lora_alpha: int = 32  # lora=true: the adapters' scale (alpha / r multiplies their update)
    lora_dropout: float = 0.05  # lora=true: dropout on the adapters' input
    # lora=true: the module names that get adapters (names absent from the draft are skipped).
    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_MODULES))
    optimizer: str = "adamw"  # adamw | muon (Muon on the layers' matrices, AdamW on the rest: train/optim.py)
    learning_rate: float = 3e-4  # the peak learning rate, reached after warmup_steps
    lr_schedule: str = "cosine"  # cosine | linear: warm-up, then down to zero at the last step (train/budget.py)
    weight_decay: float = 0.0  # the optimizer's decoupled weight decay (AdamW's; Muon's on its matrices)
    warmup_steps: int = 20  # optimizer steps of linear warm-up from zero to learning_rate
    # Optimizer steps to train; each takes per_device_batch_size x processes x grad_accum_steps samples.
    max_steps: int = 500
    # Stop by this much wall time (minutes, summed over resumes; the final evaluation comes after), with the
    # cosine schedule re-aimed at the step the measured pace reaches (train/budget.py). None = max_steps only.
    max_minutes: float | None = None
    per_device_batch_size: int = 8  # samples per micro-batch on each process
    grad_accum_steps: int = 1  # micro-batches whose gradients add up to one optimizer step
    max_grad_norm: float = 1.0  # clip the gradient's global norm to this (0 = no clipping)
    # auto (bf16 on a GPU that has it or a CPU with native bf16, else no; $ACCELERATE_MIXED_PRECISION first), no,
    # bf16 or fp16.
    mixed_precision: str = "auto"
    bucket_by_length: bool = True  # batch samples of similar length together (less padding); false = random batches
    # Each micro-batch's samples packed into rows of at most max_length tokens, every attention, position and loss
    # kept within its sample (no padding computed; the same loss as unpacked); for kinds whose facts allow packing
    pack: bool = False
    # Each micro-batch's forward and backward run in slices of whole rows of at most this many padded positions
    # (rows x the batch's width), so the memory peak follows this bound rather than the widest micro-batch the
    # data draws; the same gradient (train/slices.py). For kinds whose loss divides by the step's scored positions.
    # 0 = the whole micro-batch at once.
    slice_tokens: int = 0
    # Each batch padded to a multiple of this many positions (at most max_length): a run then meets a few batch
    # widths instead of one per longest row, and on a CPU the allocator's freed blocks and oneDNN's per-shape
    # kernels are reused rather than grown step after step; the padding is never scored. 1 = to the longest row.
    pad_to_multiple_of: int = 1
    # On a CPU (glibc): every N optimizer steps, give the heap's freed pages back to the system (malloc_trim). The
    # trainer's anonymous memory otherwise grows with the steps, as the allocator keeps the freed blocks that varying
    # batch widths leave (train/host_memory.py). 0 = never.
    release_host_memory_every: int = 25
    # Loader processes that collate micro-batches (and read recorded states) ahead of the step; 0 = the training
    # process does it.
    data_workers: int = 1
    # --- logging, evaluation, checkpoints
    log_every: int = 10  # optimizer steps between log lines (mean loss, learning rate, tokens/s)
    eval_every: int = 100  # steps between held-out evaluations; 0 = only at the start and the end
    eval_samples: int = 64  # held-out samples scored at each evaluation (the first N of the held-out split)
    eval_batch_size: int = 8  # held-out rows per forward at each evaluation (memory, not the figures)
    # The k values held-out tau(k) is reported for at each evaluation (must include best_k).
    eval_k: list[int] = field(default_factory=lambda: list(range(1, 9)))
    best_k: int = 4  # the k whose held-out tau(k) picks the checkpoint kept in output_dir/best (one of eval_k)
    # Temperatures held-out alpha is also reported at (eval.jsonl's alpha_at), both models' logits divided by T as
    # served; alpha itself stays at temperature 1.
    heldout_temperatures: list[float] = field(default_factory=lambda: [0.7, 1.0])
    # Stop once this many evaluations in a row raised the best held-out tau(best_k) by less than min_tau_gain
    # (0 = never: only max_steps or max_minutes stop training)
    stop_after_flat_evals: int = 0
    min_tau_gain: float = 0.01  # stop_after_flat_evals: the least rise of the best held-out tau(best_k) that counts
    save_every: int = 100  # steps between checkpoints (output_dir/checkpoints/step-N); 0 = only at the end
    keep_checkpoints: int = 2  # this run's newest N checkpoints kept; older ones are removed
    resume_from: str = ""  # "" | latest | a checkpoint folder
    # Start afresh in an output_dir that holds an earlier run (its checkpoints, final/, best/): remove what specdec
    # wrote there first (never other files; never a folder without specdec's run marker). false: such a folder is
    # refused, naming resume_from=latest, overwrite=true or another output_dir.
    overwrite: bool = False
    # Resume under DeepSpeed or FSDP's SHARDED_STATE_DICT, whose checkpoint loaders unpickle (and so could run code
    # a crafted checkpoint holds): only for checkpoints this run's own user wrote. false: such a resume is refused.
    trust_checkpoint: bool = False
    record_consumed: bool = False  # write each step's sample ids to output_dir/consumed/rank-R.jsonl
    wandb_project: str = "specdec"  # the wandb project (report_to=wandb)
    # --- the memory plan (train/plan/), which every run checks before it starts
    plan_device_gb: float = 0.0  # memory per device (GiB) to plan and check against; 0 = this device's
    plan_devices: int = 0  # processes to plan for (`specdec train --plan`); 0 = this launch's
    # Every registered draft kind's options block (train/kinds/options.py), set through the keys listed under the
    # kinds below: flat in `train:` (KEY: VALUE) or in a block named after the kind (NAME: {KEY: VALUE}).
    kind_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.teacher not in TEACHERS:
            raise ValueError(f"teacher must be one of {', '.join(TEACHERS)}, got {self.teacher!r}")
        if self.loss not in losses.LOSSES:
            raise ValueError(f"loss must be one of {', '.join(losses.LOSSES)}, got {self.loss!r}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {self.beta}")
        if self.temperature <= 0 or self.on_policy_temperature <= 0:
            raise ValueError("temperature and on_policy_temperature must be > 0")
        if not 0.0 <= self.on_policy_fraction <= 1.0:
            raise ValueError(f"on_policy_fraction (lambda) must be in [0, 1], got {self.on_policy_fraction}")
        if self.report_to not in ("none", "wandb"):
            raise ValueError(f"report_to must be none or wandb, got {self.report_to!r}")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be auto, no, bf16 or fp16, got {self.mixed_precision!r}")
        for name in ("max_steps", "per_device_batch_size", "grad_accum_steps", "max_length", "eval_batch_size",
                     "log_every", "keep_checkpoints", "on_policy_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_minutes(self.max_minutes)
        if self.overwrite and self.resume_from:
            raise ValueError("overwrite=true starts afresh and resume_from continues a run: pass one of them")
        if self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1 (1 = pad to the longest row), got "
                             f"{self.pad_to_multiple_of}")
        if self.slice_tokens < 0:
            raise ValueError(f"slice_tokens must be >= 0 (0 = whole micro-batches), got {self.slice_tokens}")
        if min(self.warmup_steps, self.eval_every, self.save_every, self.data_workers, self.stop_after_flat_evals,
               self.min_tau_gain, self.release_host_memory_every) < 0:
            raise ValueError("warmup_steps, eval_every, save_every, data_workers, stop_after_flat_evals, "
                             "min_tau_gain and release_host_memory_every must be >= 0")
        if self.stop_after_flat_evals and not self.eval_every:
            raise ValueError("stop_after_flat_evals needs evaluations during training: set eval_every (e.g. 100)")
        if self.draft_vocab_size < -1:
            raise ValueError(f"draft_vocab_size must be N >= 1, 0 (the full vocabulary) or -1 (auto), got "
                             f"{self.draft_vocab_size}")
        if not self.eval_k or min(self.eval_k) < 1 or self.best_k not in self.eval_k:
            raise ValueError(f"eval_k must list k >= 1 and include best_k={self.best_k}, got {self.eval_k}")
        check_temperatures(self.heldout_temperatures)
        for name, allowed in (("optimizer", OPTIMIZERS), ("lr_schedule", tuple(SCHEDULES))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.supervise_prompt and self.teacher == "offline" and losses.reads_teacher(self):
            raise ValueError("supervise_prompt=true needs the target's distribution at the prompts' positions, which "
                             "teacher=offline lacks (the data stage stores top-n at completions only): set "
                             "teacher=online, or loss=ce")
        if self.supervise_prompt and self.teacher == "on_policy":
            raise ValueError("supervise_prompt=true with teacher=on_policy: the draft's continuations start where the "
                             "prompt ends, which the prompt's scored positions would hide; use teacher=online")
        kinds.check(self)
        if self.lora and self.draft in (DERIVED, SCRATCH):
            log.warning("lora=true on a %s draft: usually a full fine-tune is better for new layer stacks", self.draft)

    @property
    def needs_target(self) -> bool:
        """The target runs in the loop: for its logits (online teacher) or its hidden states (a kind that reads
        them: train/kinds/base.py, TrainingFacts)."""
        return self.teacher in ("online", "on_policy") or kinds.for_recipe(self.draft).facts.reads_target_states
