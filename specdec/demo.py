"""`specdec demo`: the embedded default end to end, on a CPU, with no download.

    specdec demo            # recipes/smollm2-135m-eagle3.yaml  (full: tens of minutes on 2 cores)
    specdec demo --quick    # recipes/smollm2-135m-quick.yaml    (a few minutes: proves the pipeline)
    specdec demo recipe=recipes/smollm2-135m.yaml   # a plain draft, loadable by transformers / vLLM / SGLang

The full demo's draft is an EAGLE-3 draft (one layer reading three of the target's hidden states), which vLLM
and SGLang serve unchanged; on a CPU a one-layer draft is also what speculation can afford (docs/results/).

Stages: target-generated data from the shipped prompt set -> a draft derived from the target and distilled on
it -> evaluation against the target alone on the held-out prompts -> a published checkpoint with its model
card. Everything lands in `output_dir` (default outputs/demo/, or outputs/demo-quick/ with --quick, so that the two
never take each other's stages for their own); each stage resumes or is skipped when its output
is complete, so an interrupted demo continues where it stopped when run again.

The demo keeps to a time budget (`minutes`: 45, or 5 with --quick) on any machine, as far as its work allows:
data generation starts no shard that would end past `data_share` of it, and training gets what is left after
an estimate of the evaluation (its decode work at the target's step time, measured first), stopping early with
its schedule fitted (train/budget.py) where the recipe's steps would not fit. A slower machine gets a draft
trained on fewer examples and steps; the summary says what each stage took.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.config import config_from_cli, load_config

log = logging.getLogger(__name__)

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@dataclass
class DemoConfig:
    """Options of `specdec demo` (section `demo:` of the recipe it runs)."""

    quick: bool = False
    recipe: str = ""  # default: recipes/smollm2-135m-eagle3.yaml, or smollm2-135m-quick.yaml with --quick
    output_dir: str = ""  # default: outputs/demo, or outputs/demo-quick with --quick
    eval_prompts: str = "embedded:heldout"
    eval_num_prompts: int | None = None  # default: 8 with --quick, else 24
    fresh: bool = False  # ignore completed stages and redo everything
    minutes: float = 0.0  # time budget of the whole demo; 0 = 45, or 5 with --quick
    # Data generation starts no shard that would end past this share of the budget. Data is the scarcer: an
    # EAGLE-3 draft on recorded states trains faster than the target decodes its data.
    data_share: float = 0.6

    def __post_init__(self) -> None:
        if self.minutes < 0 or not 0.0 < self.data_share <= 1.0:
            raise ValueError(f"minutes must be >= 0 (0 = the default budget) and data_share in (0, 1], got "
                             f"{self.minutes} and {self.data_share}")

    def out_dir(self) -> Path:
        return Path(self.output_dir or ("outputs/demo-quick" if self.quick else "outputs/demo"))

    def budget_minutes(self) -> float:
        return self.minutes or (5.0 if self.quick else 45.0)

    def recipe_path(self) -> Path:
        if self.recipe:
            return Path(self.recipe)
        return RECIPES / ("smollm2-135m-quick.yaml" if self.quick else "smollm2-135m-eagle3.yaml")


def _stage(name: str, index: int, total: int = 4) -> float:
    print(f"\n=== [{index}/{total}] {name} ===", flush=True)
    return time.perf_counter()


def run(cfg: DemoConfig) -> dict:
    """Run the four stages and return the evaluation report."""
    from specdec.eval.config import EvalConfig
    from specdec.eval.runner import run as run_eval
    from specdec.train.checkpoints import latest_checkpoint
    from specdec.train.data import DataConfig, read_manifest
    from specdec.train.data import run as run_data
    from specdec.train.distill import TrainConfig
    from specdec.train.distill import run as run_train
    from specdec.train.publish import PublishConfig, publish

    recipe = cfg.recipe_path()
    if not recipe.is_file():
        raise ValueError(f"demo recipe {recipe} not found; run the demo from a checkout of specdec (make demo)")
    out = cfg.out_dir()
    data_dir, train_dir, eval_dir, draft_dir = out / "data", out / "train", out / "eval", out / "draft"
    timings: dict[str, float] = {}
    demo_start, budget = time.perf_counter(), cfg.budget_minutes()

    start = _stage("target-generated data", 1)
    data_cfg = load_config(DataConfig, recipe, [f"output_dir={data_dir}", f"overwrite={cfg.fresh}"], section="data")
    data_cfg.max_minutes = min(data_cfg.max_minutes or math.inf, cfg.data_share * budget)
    manifest = read_manifest(data_dir) if (data_dir / "manifest.json").is_file() else {}
    if manifest.get("complete") and not cfg.fresh:
        print(f"data already complete in {data_dir}")
    else:
        manifest = run_data(data_cfg)
        if not manifest["complete"]:
            print(f"data: its {data_cfg.max_minutes:.1f} min of the budget gave {len(manifest['shards'])} of "
                  f"{manifest['num_shards']} shards ({manifest['counts']['examples']} examples); training uses "
                  "those (run the demo again to generate the rest)")
    timings["data_s"] = time.perf_counter() - start

    start = _stage("distil the draft", 2)
    # The trainer picks its best checkpoint on a slice of the training prompts split off by prompt id, so the
    # held-out prompts used by the evaluation below are seen by neither training nor checkpoint selection.
    resume = "latest" if latest_checkpoint(train_dir / "checkpoints") and not cfg.fresh else ""
    train_cfg = load_config(
        TrainConfig, recipe, [f"output_dir={train_dir}", f"train_data={data_dir}", f"resume_from={resume}"],
        section="train",
    )
    final = train_dir / "final"
    eval_cfg = load_config(
        EvalConfig, recipe,
        [f"draft={final}", f"out={eval_dir}", f"prompts={cfg.eval_prompts}",
         f"num_prompts={cfg.eval_num_prompts or (8 if cfg.quick else 24)}"],
        section="eval",
    )
    if (final / "config.json").is_file() and not cfg.fresh:
        print(f"draft already trained: {final}")
    else:
        eval_minutes = estimate_eval_minutes(eval_cfg)
        spent = (time.perf_counter() - demo_start) / 60
        train_cfg.max_minutes = train_minutes(budget, spent, eval_minutes, train_cfg.max_minutes)
        print(f"training budget {train_cfg.max_minutes:.1f} min (demo budget {budget:.0f} min, {spent:.1f} spent, "
              f"evaluation estimated at {eval_minutes:.1f})", flush=True)
        final = run_train(train_cfg)
    best = train_dir / "best"
    draft = best if (best / "config.json").is_file() else final
    timings["train_s"] = time.perf_counter() - start

    start = _stage("evaluate against the target alone", 3)
    report = run_eval(dataclasses.replace(eval_cfg, draft=str(draft)))
    timings["eval_s"] = time.perf_counter() - start

    start = _stage("publish", 4)
    publish(load_config(
        PublishConfig, recipe,
        [f"draft={draft}", f"out={draft_dir}", f"report={eval_dir / 'report.json'}", f"recipe={recipe}",
         "overwrite=true"],
        section="publish",
    ))
    timings["publish_s"] = time.perf_counter() - start
    (out / "demo_summary.json").write_text(json.dumps({"report": report, "timings": timings}, indent=2, default=str))
    _print_summary(report, eval_dir, draft_dir, timings)
    return report


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
    prompts = eval_cfg.num_prompts or 24
    return prompts * eval_cfg.max_new_tokens * step_s * (1 + timed_ks + 0.5) / 60


def _choice_lines(report: dict) -> list[str]:
    """choose_k's pick beside the fastest predicted proposal, when the fastest failed a threshold."""
    from specdec.eval.proposals import label

    ck = report.get("choose_k")
    if not ck or ck.get("fastest") in (None, ck["chosen"]):
        return []
    failed = ", ".join(ck["failed_gates"][label(ck["fastest"])])
    return [f"chosen            {label(ck['chosen'])}, the fastest predicted to pass every threshold "
            f"(fastest: {label(ck['fastest'])}, fails {failed})"]


def _print_summary(report: dict, eval_dir: Path, draft_dir: Path, timings: dict[str, float]) -> None:
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
        f"acceptance rate   {spec.get('acceptance_rate', float('nan')):.3f}",
        f"mean accepted     {spec.get('mean_accepted_tokens', float('nan')):.2f} tokens per round",
        f"speedup           {report.get('speedup', float('nan')):.2f}x vs the target alone (same run, same prompts)",
        f"equivalence       {'passed' if report.get('equivalence', {}).get('passed') else 'FAILED'}",
        f"verdict           {decision.get('verdict')}",
        *[f"  - {reason}" for reason in decision.get("reasons", [])],
        f"report            {eval_dir / 'report.md'}",
        f"checkpoint        {draft_dir}",
        "time              " + ", ".join(f"{k[:-2]} {v / 60:.1f} min" for k, v in timings.items()),
    ]
    print("\n".join(lines), flush=True)


def main(argv: list[str]) -> int:
    """Entry point of `specdec demo`."""
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cfg = config_from_cli(DemoConfig, argv, section="demo")
    report = run(cfg)
    return 0 if report.get("equivalence", {}).get("passed", False) else 1
