"""`specdec demo`: the embedded default end to end, on a CPU, with no download.

    specdec demo            # the shipped recipe smollm2-135m-eagle3  (full: tens of minutes on 2 cores)
    specdec demo --quick    # the shipped recipe smollm2-135m-quick   (a few minutes: proves the pipeline)
    specdec demo recipe=smollm2-135m     # a plain draft, loadable by transformers / vLLM / SGLang
    specdec demo --quick --plan          # print the recipe, the assets each stage reads and its folders; run nothing

`recipe` is a path (recipes/smollm2-135m.yaml in a checkout) or a shipped recipe's name: the recipes ship inside
the package (recipes/ installed as `specdec.recipes`), so an installed specdec runs the demo from any folder.

The full demo's draft is an EAGLE-3 draft (one layer reading three of the target's hidden states), which vLLM
and SGLang serve unchanged; on a CPU a one-layer draft is also what speculation can afford (docs/results/).

Stages: target-generated data from the shipped prompt set -> a draft derived from the target and distilled on
it -> evaluation against the target alone on the held-out prompts -> a published checkpoint with its model
card. Everything lands in `output_dir` (default outputs/demo/, or outputs/demo-quick/ with --quick, so that the two
never take each other's stages for their own); each stage resumes or is skipped when its output
is complete, so an interrupted demo continues where it stopped when run again.

The demo keeps to a time budget (`minutes`: 45, or 5 with --quick) on any machine, as far as its work allows.
The evaluation's share is estimated first (its decode work at the target's step time, measured). Data and
training split the rest by rates measured here (specdec/demo_split.py): after the first data shard, a few
training steps time the trainer, and data generation goes on only as long as training can still see all of
it `train_passes` times; training then stops by the budget with its schedule fitted (train/budget.py). A slower
machine gets a draft trained on fewer examples and steps; the summary says what each stage took and the split.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import multiprocessing
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.config import config_from_cli, load_config, recipe_file, shipped_recipes
from specdec.demo_split import Split, data_rate

log = logging.getLogger(__name__)

FULL_RECIPE, QUICK_RECIPE = "smollm2-135m-eagle3.yaml", "smollm2-135m-quick.yaml"  # shipped recipes


@dataclass
class DemoConfig:
    """Options of `specdec demo` (section `demo:` of the recipe it runs)."""

    quick: bool = False  # the few-minute run (recipe smollm2-135m-quick, 5-minute budget): proves the pipeline
    recipe: str = ""  # a path or a shipped recipe's name; default: smollm2-135m-eagle3, or smollm2-135m-quick with --quick
    output_dir: str = ""  # default: outputs/demo, or outputs/demo-quick with --quick
    eval_prompts: str = "embedded:heldout"  # the evaluation's prompt file (.jsonl/.json) or embedded:heldout
    eval_num_prompts: int | None = None  # prompts evaluated (the first N); default: 8 with --quick, else 24
    fresh: bool = False  # ignore completed stages and redo everything
    minutes: float = 0.0  # time budget of the whole demo; 0 = 45, or 5 with --quick
    # Passes over its data training should make: data generation stops where the minutes left give training this
    # many, at the rates measured in the run (the basis: bench/passes.py, docs/results/2026-12-05-passes.md).
    train_passes: float = 5.0
    probe_steps: int = 12  # training steps timed on the first data shard to measure training's pace (first excluded)
    plan: bool = False  # print the recipe, the assets each stage reads and where it writes; run nothing
    # After the greedy evaluation, acceptance measured at this temperature too (eval's sampled_acceptance_temperature:
    # one untimed speculative pass, seeded, with the k or tree eval chose); 0 = greedy only.
    sampled_temperature: float = 0.7

    def __post_init__(self) -> None:
        if self.minutes < 0 or self.train_passes <= 0 or self.probe_steps < 2:
            raise ValueError(f"minutes must be >= 0 (0 = the default budget), train_passes > 0 and probe_steps >= 2 "
                             f"(the first step is not timed), got {self.minutes}, {self.train_passes} and "
                             f"{self.probe_steps}")
        if self.sampled_temperature < 0:
            raise ValueError(f"sampled_temperature must be > 0 (the temperature acceptance is also measured at) or 0 "
                             f"(greedy only), got {self.sampled_temperature}")

    def out_dir(self) -> Path:
        return Path(self.output_dir or ("outputs/demo-quick" if self.quick else "outputs/demo"))

    def budget_minutes(self) -> float:
        return self.minutes or (5.0 if self.quick else 45.0)

    def recipe_path(self) -> Path:
        if self.recipe:
            return recipe_file(self.recipe)
        return shipped_recipes() / (QUICK_RECIPE if self.quick else FULL_RECIPE)


@dataclass
class Stages:
    """The four stages' configs: the recipe's sections with the demo's folders and budget. Evaluation and
    publication name the final draft; `run` swaps in the best checkpoint once training has written it."""

    recipe: Path
    data: Any  # DataConfig
    train: Any  # TrainConfig
    eval: Any  # EvalConfig
    publish: Any  # PublishConfig


def stage_configs(cfg: DemoConfig) -> Stages:
    """Each stage's config from the recipe (a missing recipe or an invalid key fails here, before any work)."""
    from specdec.eval.config import EvalConfig
    from specdec.train.checkpoints import latest_checkpoint
    from specdec.train.data import DataConfig
    from specdec.train.distill import TrainConfig
    from specdec.train.publish import PublishConfig

    recipe, out = cfg.recipe_path(), cfg.out_dir()
    data_dir, train_dir, eval_dir, draft_dir = out / "data", out / "train", out / "eval", out / "draft"
    data = load_config(DataConfig, recipe, [f"output_dir={data_dir}", f"overwrite={cfg.fresh}"], section="data")
    # The trainer picks its best checkpoint on a slice of the training prompts split off by prompt id, so the
    # held-out prompts used by the evaluation are seen by neither training nor checkpoint selection.
    resume = "latest" if latest_checkpoint(train_dir / "checkpoints") and not cfg.fresh else ""
    train = load_config(TrainConfig, recipe,
                        [f"output_dir={train_dir}", f"train_data={data_dir}", f"resume_from={resume}",
                         f"overwrite={cfg.fresh}"], section="train")
    final = train_dir / "final"
    evaluation = load_config(
        EvalConfig, recipe,
        [f"draft={final}", f"out={eval_dir}", f"prompts={cfg.eval_prompts}",
         f"num_prompts={cfg.eval_num_prompts or (8 if cfg.quick else 24)}",
         f"sampled_acceptance_temperature={cfg.sampled_temperature}"],
        section="eval",
    )
    publish = load_config(
        PublishConfig, recipe,
        [f"draft={final}", f"out={draft_dir}", f"report={eval_dir / 'report.json'}", f"recipe={recipe}",
         "overwrite=true"],
        section="publish",
    )
    return Stages(recipe, data, train, evaluation, publish)


@contextmanager
def _stage(name: str, index: int, timings: dict[str, float], key: str) -> Iterator[None]:
    print(f"\n=== [{index}/4] {name} ===", flush=True)
    start = time.perf_counter()
    yield
    timings[key] = time.perf_counter() - start


def run(cfg: DemoConfig) -> dict:
    """Run the four stages and return the evaluation report."""
    from specdec.train.publish import publish

    stages, demo_start, timings = stage_configs(cfg), time.perf_counter(), {}
    eval_minutes = _EvalEstimate(stages.eval)
    with _stage("target-generated data", 1, timings, "data_s"):
        split = _generate_data(cfg, stages, demo_start, eval_minutes)
    with _stage("distil the draft", 2, timings, "train_s"):
        draft = _train_draft(cfg, stages, demo_start, eval_minutes)
    with _stage("evaluate against the target alone", 3, timings, "eval_s"):
        report = evaluate_in_own_process(dataclasses.replace(stages.eval, draft=str(draft)))
    with _stage("publish", 4, timings, "publish_s"):
        publish(dataclasses.replace(stages.publish, draft=str(draft)))
    out = cfg.out_dir()
    summary = {"acceptance": acceptance_summary(report), "split": split.summary() if split else None,
               "report": report, "timings": timings}
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    _print_summary(report, Path(stages.eval.out), Path(stages.publish.out), timings, summary["split"])
    return report


def evaluate_in_own_process(eval_cfg) -> dict:
    """The evaluation stage in a fresh interpreter (multiprocessing's spawn); its report read back from report.json.

    The evaluation times two decoders against each other, and the CPU linear kernels they use are chosen by timing
    them once per process (specdec/fast_linear.py). In the process that had just generated the data and trained
    the draft, the same draft measured a clearly lower speedup than in a process of its own, as `specdec eval`
    runs it (docs/results/2026-12-07-demo-eval-process.md): the stage now measures what a user's `specdec eval`
    would, and its memory gate reads a process that holds no training heap."""
    process = multiprocessing.get_context("spawn").Process(target=_evaluate, args=(eval_cfg,), name="specdec-eval")
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"the evaluation stage stopped (exit code {process.exitcode}); its error is printed above. "
                           "Run `specdec demo` again: the data and the trained draft are kept, and it resumes at "
                           "the evaluation")
    return json.loads((eval_cfg.out_dir() / "report.json").read_text())


def _evaluate(eval_cfg) -> None:
    """The evaluation stage's own process: logging as the `specdec` command sets it, then `specdec eval`'s run."""
    from specdec.cli import configure_logging
    from specdec.eval.runner import run as run_eval

    configure_logging()
    run_eval(eval_cfg)


class _EvalEstimate:
    """The evaluation stage's estimated minutes, measured once when first asked (it loads the target)."""

    def __init__(self, eval_cfg):
        self.eval_cfg, self.minutes = eval_cfg, None

    def __call__(self) -> float:
        if self.minutes is None:
            self.minutes = estimate_eval_minutes(self.eval_cfg)
        return self.minutes


# A data run always makes one shard and starts no further one past its max_minutes: this makes exactly one.
ONE_SHARD_MINUTES = 1e-6


def _generate_data(cfg: DemoConfig, stages: Stages, demo_start: float, eval_minutes) -> Split | None:
    """Stage 1: the target's outputs (skipped when complete): one shard, then as many more as the measured split
    gives (specdec/demo_split.py). -> the split, None where no split was needed."""
    from specdec.train.data import read_manifest
    from specdec.train.data import run as run_data

    data_cfg = stages.data
    data_dir = Path(data_cfg.output_dir)
    manifest = read_manifest(data_dir) if (data_dir / "manifest.json").is_file() else {}
    if manifest.get("complete") and not cfg.fresh:
        print(f"data already complete in {data_dir}")
        return None
    cap = data_cfg.max_minutes  # the recipe's own limit on the data stage, if any
    if cfg.fresh or not manifest.get("shards"):
        manifest = run_data(dataclasses.replace(data_cfg, max_minutes=ONE_SHARD_MINUTES))
    if manifest["complete"]:
        return None
    try:
        split = _measure_split(cfg, stages, manifest, demo_start, eval_minutes())
        print(split.line(), flush=True)
        more = split.more_data_minutes()
    except ValueError as err:  # e.g. a first shard smaller than one training batch: no pace to measure
        split = None
        spent = (time.perf_counter() - demo_start) / 60
        more = (cfg.budget_minutes() - spent - eval_minutes()) / 2
        print(f"split: the training probe could not run ({err}); data gets half of the {2 * more:.1f} minutes "
              "left", flush=True)
    if cap:
        more = min(more, cap - sum(s["seconds"] for s in manifest["shards"]) / 60)
    if more >= manifest["shards"][-1]["seconds"] / 60:  # another shard fits
        manifest = run_data(dataclasses.replace(data_cfg, max_minutes=more, overwrite=False))
    if not manifest["complete"]:
        print(f"data: {len(manifest['shards'])} of {manifest['num_shards']} shards "
              f"({manifest['counts']['examples']} examples) fill training's {cfg.train_passes:g} passes in this "
              "budget; training uses those (a larger `minutes` generates more)")
    return split


def _measure_split(cfg: DemoConfig, stages: Stages, manifest: dict, demo_start: float, eval_minutes: float) -> Split:
    """The data stage's rate from its manifest, training's from a probe of a few steps on the data so far."""
    print(f"timing {cfg.probe_steps} training steps on the {manifest['counts']['examples']} examples so far, to split "
          "the budget", flush=True)
    train_rate = probe_train_rate(stages.train, cfg.out_dir() / "probe", cfg.probe_steps)
    spent = (time.perf_counter() - demo_start) / 60
    return Split(data_rate(manifest), train_rate, manifest["counts"]["examples"],
                 cfg.budget_minutes() - spent - eval_minutes, cfg.train_passes)


def probe_train_rate(train_cfg, probe_dir: Path, steps: int) -> float:
    """Training's samples per minute on the data so far, from `steps` training steps of `train_cfg` in `probe_dir`
    (removed after): the trainer's own pace, its first step (warm-up) left out, scaled to a whole epoch's padded
    positions (a dozen steps may all draw short rows), plus the evaluations and checkpoints the run will make
    every eval_every and save_every steps, at the probe's own (one at its start, one at its end)."""
    from specdec.train.distill import run as run_train

    probe = dataclasses.replace(
        train_cfg, output_dir=str(probe_dir), max_steps=steps, warmup_steps=min(train_cfg.warmup_steps, steps),
        eval_every=0, save_every=0, max_minutes=None, resume_from="", overwrite=True, report_to="none",
        stop_after_flat_evals=0)
    try:
        run_train(probe)
        pace = json.loads((probe_dir / "train_summary.json").read_text())["pace"]
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    rate = pace.get("epoch_samples_per_second") or pace.get("samples_per_second")  # the first: scaled to an epoch
    if not rate:
        raise RuntimeError(f"the training probe timed no step ({steps} steps): raise the demo's probe_steps")
    seconds_per_sample = 1 / rate
    for every, seconds in ((train_cfg.eval_every, pace.get("eval_seconds")),
                           (train_cfg.save_every, pace.get("save_seconds"))):
        if every and seconds:
            seconds_per_sample += seconds / (every * pace["samples_per_step"])
    return 60 / seconds_per_sample


def _train_draft(cfg: DemoConfig, stages: Stages, demo_start: float, eval_minutes) -> Path:
    """Stage 2: the draft, trained in what the budget leaves after the evaluation's estimate (skipped when
    trained). -> the best checkpoint, else the final one."""
    from specdec.train.distill import run as run_train

    train_dir = Path(stages.train.output_dir)
    final = train_dir / "final"
    if (final / "config.json").is_file() and not cfg.fresh:
        print(f"draft already trained: {final}")
    else:
        budget, estimate = cfg.budget_minutes(), eval_minutes()
        spent = (time.perf_counter() - demo_start) / 60
        stages.train.max_minutes = train_minutes(budget, spent, estimate, stages.train.max_minutes)
        print(f"training budget {stages.train.max_minutes:.1f} min (demo budget {budget:.0f} min, {spent:.1f} spent, "
              f"evaluation estimated at {estimate:.1f})", flush=True)
        final = run_train(stages.train)
    best = train_dir / "best"
    return best if (best / "config.json").is_file() else final


def plan_lines(cfg: DemoConfig, stages: Stages) -> list[str]:
    """`specdec demo --plan`: the recipe, the prompt sets each stage reads (loaded, so a missing asset fails
    here), the budget and the folders, without loading a model."""
    from specdec.eval.verify import resolve_prompts_path
    from specdec.prompts import read_prompts
    from specdec.train.data import load_prompt_set
    from specdec.train.data.sources import prompt_sources
    from specdec.train.self_prompts import count_from

    data = stages.data
    read = [s for s in prompt_sources(data) if count_from(s) is None]
    written = [s for s in prompt_sources(data) if count_from(s) is not None]
    loaded = len(load_prompt_set(dataclasses.replace(data, prompts=",".join(read)))) if read else 0
    heldout = resolve_prompts_path(stages.eval.prompts)
    evaluated = read_prompts(heldout, limit=stages.eval.num_prompts)
    return [
        f"specdec demo{' --quick' if cfg.quick else ''}: the plan (nothing runs)",
        f"recipe            {stages.recipe}",
        f"target            {stages.eval.target}",
        f"budget            {cfg.budget_minutes():g} min; data and training split it by rates measured in the run, for "
        f"{cfg.train_passes:g} passes over the data",
        f"[1/4] data        {loaded} prompts from {', '.join(read) or '-'}"
        + (f" + {', '.join(written)} (written by the target)" if written else "") + f" -> {data.output_dir}",
        f"[2/4] train       {stages.train.draft} draft, up to {stages.train.max_steps} steps -> {stages.train.output_dir}",
        f"[3/4] eval        {len(evaluated)} prompts from {heldout}"
        + (f", acceptance also at T={stages.eval.sampled_acceptance_temperature:g}"
           if stages.eval.sampled_acceptance_temperature else "") + f" -> {stages.eval.out}",
        f"[4/4] publish     -> {stages.publish.out}",
    ]


def train_minutes(budget: float, spent: float, eval_minutes: float, recipe_cap: float | None) -> float:
    """Training's share of the demo budget: what is left after the stages so far and the evaluation's estimate,
    within the recipe's own max_minutes, and at least one minute (a draft needs some training)."""
    return max(1.0, min(recipe_cap or math.inf, budget - spent - eval_minutes))


def estimate_eval_minutes(eval_cfg) -> float:
    """The evaluation stage's expected minutes: a target-only decode of every prompt at the target's step time
    (measured now: 16 cached steps after a 64-token prompt) for the baseline and for each k it times, plus half
    a baseline more for the rest (cost calibration, choose_k, warm-up). A rough figure, on the generous side for
    a full demo and short for a quick one (docs/results/history.md); the demo's summary prints what eval took."""
    import torch

    from specdec.decode import target_generate
    from specdec.models import load_model, resolve_device

    target = load_model(eval_cfg.target, eval_cfg.dtype, resolve_device(eval_cfg.device))
    ids = torch.randint(100, 1000, (1, 64), generator=torch.Generator().manual_seed(0)).to(target.device)
    target_generate(target, ids, max_new_tokens=4)  # warm-up
    seconds = []
    for new_tokens in (1, 17):  # the prefill alone, then with 16 steps
        started = time.perf_counter()
        target_generate(target, ids, max_new_tokens=new_tokens)
        seconds.append(time.perf_counter() - started)
    step_s = max(seconds[1] - seconds[0], 0.0) / 16
    timed_ks = 1 if eval_cfg.choose_k else len(eval_cfg.num_draft_tokens)
    sampled = 1 if eval_cfg.sampled_acceptance_temperature else 0  # one untimed speculative pass, no baseline
    prompts = eval_cfg.num_prompts or 24
    return prompts * eval_cfg.max_new_tokens * step_s * (1 + timed_ks + sampled + 0.5) / 60


def _choice_lines(report: dict) -> list[str]:
    """choose_k's pick beside the fastest predicted proposal, when the fastest failed a threshold."""
    from specdec.eval.proposals import label

    ck = report.get("choose_k")
    if not ck or ck.get("fastest") in (None, ck["chosen"]):
        return []
    failed = ", ".join(ck["failed_gates"][label(ck["fastest"])])
    return [f"chosen            {label(ck['chosen'])}, the fastest predicted to pass every threshold "
            f"(fastest: {label(ck['fastest'])}, fails {failed})"]


def acceptance_summary(report: dict) -> dict[str, dict]:
    """The acceptance of the timed run (at its temperature, greedy for the demo) and of the sampled pass, if any."""
    spec, config = report.get("speculative", {}), report.get("config", {})
    out = {"timed": {"temperature": config.get("temperature"), "acceptance_rate": spec.get("acceptance_rate"),
                     "mean_accepted_tokens": spec.get("mean_accepted_tokens")}}
    sampled = report.get("sampled")
    if sampled:
        out["sampled"] = {key: sampled[key] for key in ("temperature", "acceptance_rate", "mean_accepted_tokens")}
    return out


def _sampled_lines(report: dict) -> list[str]:
    sampled = report.get("sampled")
    if not sampled:
        return []
    return [f"sampled T={sampled['temperature']:<5g} acceptance rate {sampled['acceptance_rate']:.3f}, mean accepted "
            f"{sampled['mean_accepted_tokens']:.2f} tokens per round (untimed; same proposal and prompts)"]


def _print_summary(report: dict, eval_dir: Path, draft_dir: Path, timings: dict[str, float],
                   split: dict | None = None) -> None:
    """The demo's closing lines; `split`: demo_summary.json's (None where no split was measured)."""
    from specdec.eval import intervals
    spec = report.get("speculative", {})
    config = report.get("config", {})
    decision = report.get("decision", {})
    lines = [
        "",
        "=== specdec demo: summary ===",
        f"target            {config.get('target')}",
        f"draft             {draft_dir}",
        (f"tree              {config['tree']} (depth {config.get('tree_depth')})" if config.get("tree")
         else f"k                 {config.get('num_draft_tokens')}"),
        *_choice_lines(report),
        f"acceptance rate   {spec.get('acceptance_rate', float('nan')):.3f}"
        + (" (greedy)" if config.get("temperature") == 0 else f" (T={config.get('temperature')})")
        + intervals.summary_text(report.get("intervals"), "acceptance_rate"),
        f"mean accepted     {spec.get('mean_accepted_tokens', float('nan')):.2f} tokens per round",
        *_sampled_lines(report),
        f"speedup           {report.get('speedup', float('nan')):.2f}x vs the target alone (same run, same prompts)"
        + intervals.summary_text(report.get("intervals"), "speedup", "x"),
        f"equivalence       {'passed' if report.get('equivalence', {}).get('passed') else 'FAILED'}",
        f"verdict           {decision.get('verdict')}",
        *[f"  - {reason}" for reason in decision.get("reasons", [])],
        f"report            {eval_dir / 'report.md'}",
        f"checkpoint        {draft_dir}",
        "time              " + ", ".join(f"{k[:-2]} {v / 60:.1f} min" for k, v in timings.items()),
        *([f"                  {split['line']}"] if split else []),
    ]
    print("\n".join(lines), flush=True)


def main(argv: list[str]) -> int:
    """Entry point of `specdec demo` (its --help: specdec/cli.py)."""
    cfg = config_from_cli(DemoConfig, argv, section="demo")
    if cfg.plan:
        print("\n".join(plan_lines(cfg, stage_configs(cfg))))
        return 0
    report = run(cfg)
    return 0 if report.get("equivalence", {}).get("passed", False) else 1
