"""The demo's evaluation stage in a process of its own, against the evaluation run in the process that trained.

    python bench/demo_eval_process.py --draft outputs/demo/train/best --data outputs/demo/data
    python bench/demo_eval_process.py --draft D --data D --train-steps 60 --rounds 2 --name demo-eval-process

Both variants evaluate the same trained draft with the demo recipe's eval settings (24 held-out prompts, greedy):
`own process` is the stage as `specdec demo` runs it now (specdec/demo.py: evaluate_in_own_process, a spawned
interpreter); `after training` is a fresh interpreter that first trains `--train-steps` steps of the demo recipe on
`--data` (thrown away) and then runs the evaluation in that same process, as the demo did before. The variants
alternate within each round (the first goes first in even rounds). Each prints the evaluation's own figures:
target-only and speculative tokens/s, the measured speedup, the analytical one from its measured costs (c, v), and
the CPU linear kernels the process chose (specdec/fast_linear.py) where the two differ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import results  # bench/results.py (this script runs with bench/ on its path)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/smollm2-135m-eagle3.yaml"

# Both variants take the evaluation stage's config from the demo itself (specdec/demo.py: stage_configs), greedy.
DEMO_EVAL = r"""
import dataclasses, json, sys
from specdec.demo import DemoConfig, stage_configs
spec = json.loads(sys.argv[1])
stages = stage_configs(DemoConfig(recipe=spec["recipe"], output_dir=spec["work"], eval_num_prompts=spec["prompts"],
                                  sampled_temperature=0))
eval_cfg = dataclasses.replace(stages.eval, draft=spec["draft"], out=spec["out"])
"""

AFTER_TRAINING = DEMO_EVAL + r"""
from specdec.config import load_config
from specdec.eval.runner import run as run_eval
from specdec.train import distill
from specdec.train.train_config import TrainConfig
distill.run(load_config(TrainConfig, spec["recipe"], spec["train"], section="train"))
run_eval(eval_cfg)
"""

OWN_PROCESS = DEMO_EVAL + r"""
from specdec.demo import evaluate_in_own_process
evaluate_in_own_process(eval_cfg)
"""


def run_variant(name: str, args, out: Path) -> dict:
    spec = {"recipe": args.recipe, "work": str(out), "prompts": args.prompts, "draft": args.draft,
            "out": str(out / "eval"),
            "train": [f"train_data={args.data}", f"output_dir={out / 'train'}", "overwrite=true",
                      f"max_steps={args.train_steps}", "max_minutes=null", "eval_every=0", "stop_after_flat_evals=0",
                      "save_every=0", f"log_every={args.train_steps}"]}
    code = OWN_PROCESS if name == "own process" else AFTER_TRAINING
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run([sys.executable, "-c", code, json.dumps(spec)], cwd=ROOT, stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    report = json.loads((out / "eval" / "report.json").read_text())
    cost = report["cost"]
    kernels = {(k["out_features"], k["in_features"], k["rows"]): k["kernel"] for k in report["cpu_linear_kernels"]}
    return {"variant": name, "baseline": report["baseline"]["tokens_per_s"],
            "speculative": report["speculative"]["tokens_per_s"], "speedup": report["speedup"],
            "analytical": report["analytical_speedup"], "c": cost["c"], "v": cost["v"],
            "acceptance": report["speculative"]["acceptance_rate"], "kernels": kernels}


def kernel_differences(rows: list[dict], max_rows: int) -> list[str]:
    """Per (layer shape, rows up to max_rows): the kernels the runs chose, where they did not all choose the same."""
    keys = sorted({k for r in rows for k in r["kernels"] if k[2] <= max_rows})
    lines = []
    for key in keys:
        chosen = [r["kernels"].get(key, "-") for r in rows]
        if len(set(chosen)) > 1:
            lines.append(f"| {key[0]} x {key[1]}, {key[2]} rows | " + " | ".join(chosen) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True, help="a trained draft (the demo's train/best)")
    parser.add_argument("--data", required=True, help="a `specdec data` folder the `after training` variant trains on")
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts evaluated (the demo's 24)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--kernel-rows", type=int, default=2,
                        help="list the kernel choices up to this many rows (2: what a round at k = 1 runs)")
    parser.add_argument("--work", default="runs/bench-demo-eval-process")
    parser.add_argument("--name", default="demo-eval-process", help="docs/results/<date>-<name>.md")
    args = parser.parse_args()
    # the variants run from the checkout's root: the paths they read are made absolute (the page shows them as given)
    given = argparse.Namespace(**vars(args))
    args.draft, args.data = str(Path(args.draft).resolve()), str(Path(args.data).resolve())
    args.recipe = str(Path(args.recipe).resolve()) if Path(args.recipe).exists() else args.recipe
    args.work = Path(args.work).resolve()
    provenance = results.header("The demo's evaluation in a process of its own")
    rows = []
    for r in range(args.rounds):
        order = ["own process", "after training"] if r % 2 == 0 else ["after training", "own process"]
        for name in order:
            out = args.work / f"round{r}-{name.replace(' ', '-')}"
            row = {"round": r, **run_variant(name, args, out)}
            rows.append(row)
            print(f"round {r} {name}: speedup {row['speedup']:.3f} (analytical {row['analytical']:.3f}), "
                  f"{row['baseline']:.2f} / {row['speculative']:.2f} tokens/s", flush=True)
    table = ["| round | variant | target alone tokens/s | speculative tokens/s | speedup | analytical | c | v | "
             "acceptance |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    table += [f"| {x['round']} | {x['variant']} | {x['baseline']:.2f} | {x['speculative']:.2f} | {x['speedup']:.3f} | "
              f"{x['analytical']:.3f} | {x['c']:.3f} | {x['v']:.3f} | {x['acceptance']:.3f} |" for x in rows]
    ratios = []
    for r in range(args.rounds):
        own, after = (next(x for x in rows if x["round"] == r and x["variant"] == v)
                      for v in ("own process", "after training"))
        ratios.append(f"- round {r}: measured speedup, own process / after training: "
                      f"**{own['speedup'] / after['speedup']:.2f}x** ({own['speedup']:.3f} against {after['speedup']:.3f})")
    differing = kernel_differences(rows, args.kernel_rows)
    kernels = (["", f"CPU linear kernels chosen where the runs differ, up to {args.kernel_rows} rows (layer out x in "
                "features, rows):", "",
                "| layer, rows | " + " | ".join(f"{x['round']} {x['variant']}" for x in rows) + " |",
                "|---|" + "---|" * len(rows), *differing] if differing else ["", "Every run chose the same kernels."])
    body = "\n".join([
        f"draft `{given.draft}`; eval settings of `{given.recipe}` with {args.prompts} held-out prompts, greedy; "
        f"`after training` trains {args.train_steps} steps on `{given.data}` first, in the process that then evaluates.",
        "", *table, "", *ratios, *kernels])
    print(body)
    print(f"written to {results.write(args.name, '', body, provenance)}")


if __name__ == "__main__":
    main()
