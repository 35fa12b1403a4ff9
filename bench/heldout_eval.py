"""The trainer's held-out evaluation (`specdec train`'s `evaluate`, every eval_every steps): seconds per
evaluation at two checkouts, and at this one with settings changed, on a recorded data folder, in one run.

    git worktree add /tmp/before <commit>
    python bench/heldout_eval.py --before /tmp/before --data outputs/demo/data \\
        --weights outputs/demo/train/checkpoints/step-874/model.safetensors --variant 'eval_k=[1,2,3,4]'

Each child builds the trainer as `specdec train` does (the recipe's settings, `train_data=` the folder, its own
held-out split), loads `--weights` into the draft when given (a trained draft's figures: a fresh one's are near
zero), evaluates once to warm up, then times `--repeats` evaluations and prints their median seconds and the
figures. Rounds alternate the children's order, so a machine that drifts slows each alike. The page gives the
medians, each one's ratio to `before`, and whether its figures (greedy agreement, tau(k), alpha) are before's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import results  # bench/results.py (this script runs with bench/ on its path)
from checkouts import last_figure, run_child

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, statistics, sys, time
import torch
from safetensors.torch import load_file
from specdec.config import config_from_cli
from specdec.train.distill import Distiller, TrainConfig

args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
cfg = config_from_cli(TrainConfig, ["--config", args["recipe"], f"train_data={args['data']}",
                                    f"output_dir={args['out']}", *args["set"]], section="train")
trainer = Distiller(cfg)
trainer.prepare()
trainer.tracker = None
if args["weights"]:
    model = getattr(trainer.model, "module", trainer.model)
    missing, unexpected = model.load_state_dict(load_file(args["weights"]), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
trainer.evaluate(1)  # warm-up
seconds = []
for _ in range(args["repeats"]):
    started = time.perf_counter()
    trainer.evaluate(1)
    seconds.append(time.perf_counter() - started)
last = [json.loads(line) for line in (trainer.out / "eval.jsonl").read_text().splitlines()][-1]
figures = {"agreement": last["agreement"], "tau": last["tau"], "alpha": last["alpha"]}
print("FIGURES " + json.dumps(figures))
print(f"SECONDS {statistics.median(seconds)}")
"""


def evaluate(tree: Path, settings: dict) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as out:
        stdout = run_child(tree, CHILD, {**settings, "out": out})
    figures = [line.split(" ", 1)[1] for line in stdout.splitlines() if line.startswith("FIGURES ")][-1]
    return last_figure(stdout, "SECONDS"), json.loads(figures)


def same_figures(a: dict, b: dict, k: list[str]) -> bool:
    """Agreement and tau(k) equal, alpha within float32 summation order."""
    return (a["agreement"] == b["agreement"] and all(a["tau"][x] == b["tau"][x] for x in k)
            and abs(a["alpha"] - b["alpha"]) < 1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="a checkout (git worktree) of the earlier commit")
    parser.add_argument("--data", required=True, help="a recorded data folder (specdec data with record_features)")
    parser.add_argument("--recipe", default="recipes/smollm2-135m-eagle3.yaml")
    parser.add_argument("--weights", default="", help="a checkpoint's model.safetensors to load into the draft")
    parser.add_argument("--variant", action="append", default=[],
                        help="key=value settings for a further child of this checkout (space-separated; repeatable)")
    parser.add_argument("--repeats", type=int, default=2, help="timed evaluations per child")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="heldout-eval")
    args = parser.parse_args()

    base = {"recipe": args.recipe, "data": str(Path(args.data).resolve()), "repeats": args.repeats,
            "threads": args.threads, "weights": str(Path(args.weights).resolve()) if args.weights else ""}
    children = {"before": (args.before.resolve(), []), "after": (ROOT, [])}
    children.update({f"after, {v}": (ROOT, v.split()) for v in args.variant})
    names = list(children)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    figures: dict[str, dict] = {}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            tree, overrides = children[name]
            s, f = evaluate(tree, {**base, "set": overrides})
            seconds[name].append(s)
            figures[name] = f
        print(f"round {r + 1}: " + ", ".join(f"{n} {seconds[n][-1]:.2f} s" for n in names), flush=True)
    median = {n: statistics.median(v) for n, v in seconds.items()}
    rows = ["| code | seconds per evaluation (median) | / before | per round | greedy agreement | tau(3) | "
            "figures as before's |", "|---|---:|---:|---|---:|---:|---|"]
    for n in names:
        common = [k for k in figures[n]["tau"] if k in figures["before"]["tau"]]
        rows.append(f"| {n} | {median[n]:.2f} | {median[n] / median['before']:.3f} | "
                    f"{', '.join(f'{x:.2f}' for x in seconds[n])} | {figures[n]['agreement']:.4f} | "
                    f"{figures[n]['tau'].get('3', float('nan')):.4f} | "
                    f"{'yes' if same_figures(figures[n], figures['before'], common) else 'no'} (k {', '.join(common)}) |")
    body = "\n".join([
        f"`specdec train`'s held-out evaluation with {args.recipe}'s settings on {args.data} (its own held-out split), "
        f"draft weights {args.weights or 'as initialised'}; {args.repeats} timed evaluations per child after one "
        f"warm-up, {args.threads} threads, {args.rounds} rounds in alternating order. before = {args.before.name} "
        f"({results.commit_of(args.before)}).", "", *rows, ""])
    print(body)
    print(f"written to {results.write(args.name, 'The trainer held-out evaluation, seconds before and after', body)}")


if __name__ == "__main__":
    main()
