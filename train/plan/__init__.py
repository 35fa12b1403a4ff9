"""A training run's memory and disk plan, from the configs alone (no weights loaded), and the check that refuses
a run that cannot fit before it starts.

    specdec train --plan --config recipes/llama3.1-8b-eagle3.yaml plan_device_gb=80 plan_devices=8
    specdec train --plan --config recipes/X.yaml --target-config target.json      # a config.json, or inline JSON
    specdec train --plan --config recipes/X.yaml plan_samples=8000 plan_mean_length=1500

Every run logs the same plan first and stops with the fix when its total exceeds the device's memory (CUDA: the
device's total memory; CPU: the RAM available now, shared by the processes on this machine). `plan_device_gb`
(GiB) replaces the device's figure, to plan for another machine or to pass a check known to be wrong.

Per device, the plan adds to what a run holds throughout (`resident`) the largest of its phases (`phases`), since
a phase's tensors are freed before the next phase starts:

    resident        draft weights (trainable float32; frozen: its embedding copy, float32, and the online
                    teacher's head rows in the target's dtype), AdamW state (2 x float32 per trainable parameter),
                    DDP's gradient buckets (float32 per trainable parameter, with more than one process), the
                    target's weights where the trainer puts it on the device (with recorded states only its
                    embedding, final norm and head: train/target_parts.py), the runtime (CUDA context, libraries),
                    on a CPU under half autocast oneDNN's cached kernels (memory.py: ONEDNN_SHAPE_BYTES)
    train step      gradients (float32 per trainable parameter), autocast's half copies of the matmul weights
                    (kept for backward), the micro-batch's inputs (an EAGLE-3 draft's target states, float32),
                    activations (`activations.py`, or the kind's own formula)
    the kind's      a kind's own phases, e.g. EAGLE-3's target forward over a micro-batch for its states online

    held-out        the held-out replay over `eval_batch_size` rows of `max_length`
    optimizer step  gradients and one float32 temporary per trainable parameter (AdamW's foreach update)

Sizes are upper bounds where the data decides: every row `max_length` long, every position scored. Parameter
counts come from the draft (and target) modules built on the meta device, so they follow the code exactly.
The activation formulas count what autograd keeps per position (docstrings below); tests/test_plan.py checks them
against measured peaks of real training steps. The recorded states' read rate and the data stage's disk size
(token ids, top-n log-probs, recorded states) are reported beside, not added to memory.

    target.py       the target's config without weights, widths, parameter counts on the meta device
    activations.py  the activation formulas of a causal-LM draft and of a target forward
    kind.py         what a draft kind adds: `PlanContext` in, `KindPlan` out (the kind's `plan`, train/kinds/)
    memory.py       the run's terms: `plan_run`, the common ones and the kind's
    report.py       `Plan` and `Term`: the plan as data and text, the check against the device's memory
    check.py        this machine's plan: `plan_for`, `specdec train --plan` (`show`), every run's `check_run`
"""

from specdec.train.plan.activations import plain_activations, target_forward_bytes
from specdec.train.plan.check import (
    PlanOptions,
    check_run,
    device_memory,
    help_lines,
    plan_for,
    recipe_data_config,
    show,
    split_plan_args,
)
from specdec.train.plan.kind import KindPlan, PlanContext
from specdec.train.plan.memory import plan_run
from specdec.train.plan.report import GiB, Plan, Term
from specdec.train.plan.target import Widths, config_from_dict, target_config, target_parameters

__all__ = [
    "GiB", "KindPlan", "Plan", "PlanContext", "PlanOptions", "Term", "Widths", "check_run", "config_from_dict",
    "device_memory", "help_lines", "plain_activations", "plan_for", "plan_run", "recipe_data_config", "show",
    "split_plan_args", "target_config", "target_forward_bytes", "target_parameters",
]
