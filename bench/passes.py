"""How many passes over its data still pay for the demo's draft: held-out tau against passes, at two or three
data sizes, the demo recipe's training settings (the basis of `specdec demo`'s `train_passes`).

    python bench/passes.py --data runs/d1 runs/d2 --heldout runs/dh      # folders written by `specdec data`
    python bench/passes.py --data runs/d1 --heldout runs/dh --passes 4 --per-pass 1    # smaller

Each `--data` folder is one data size: specdec's trainer (`specdec.train.distill.run`) trains the recipe's draft
on it for `--passes` passes (steps = passes x examples / rows per step; the recipe's schedule, warm-up and
settings, no time budget), evaluating `--per-pass` times a pass on the same `--heldout` folder: the target's
answers to other *training* prompts (never the evaluation's held-out prompts: this number tunes the demo).
One run per size, so the learning rate is still decaying when each later evaluation is taken: a pass count
reads "what this many passes of a run that ends at --passes gives". Prints and writes, per size, tau(3) and the
first-proposal agreement at each evaluation, the gain per pass, and the first pass count after which a further
pass adds less than `--pays` to tau(3); then, from a model fitted to the sizes, the passes that give the most
held-out tau in a fixed time at several ratios of training's rate to the data stage's:
docs/results/<date>-<name>.md.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-eagle3.yaml"
RATIOS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # training samples/min over data examples/min, for the modelled best passes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="+", required=True, help="training folders, one per data size")
    parser.add_argument("--heldout", required=True, help="a folder of answers to training prompts none of --data holds")
    parser.add_argument("--recipe", default=str(RECIPE))
    parser.add_argument("--passes", type=float, default=8.0, help="passes over each size's data")
    parser.add_argument("--per-pass", type=int, default=2, help="held-out evaluations per pass")
    parser.add_argument("--pays", type=float, default=0.01, help="tau(3) gain per pass that still pays")
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--name", default="passes", help="docs/results/<date>-<name>.md")
    parser.add_argument("--keep", default="", help="keep the runs in this folder (default: a temporary one)")
    parser.add_argument("--report-only", action="store_true",
                        help="write the page from --keep's passes.json (a finished run's), training nothing")
    return parser.parse_args()


def examples_in(folder: str) -> int:
    return json.loads((Path(folder) / "manifest.json").read_text())["counts"]["examples"]


def train_size(args, folder: str, out: Path) -> dict:
    """One size: the recipe's draft trained for args.passes passes, its held-out curve."""
    from specdec.config import load_config
    from specdec.train.distill import TrainConfig
    from specdec.train.distill import run as run_train

    examples = examples_in(folder)
    probe = load_config(TrainConfig, Path(args.recipe), [], section="train")
    rows = probe.per_device_batch_size * probe.grad_accum_steps
    steps = math.ceil(args.passes * examples / rows)
    every = max(1, round(examples / rows / args.per_pass))
    cfg = load_config(TrainConfig, Path(args.recipe), [
        f"train_data={folder}", f"heldout_data={args.heldout}", f"output_dir={out}", f"max_steps={steps}",
        f"eval_every={every}", f"eval_samples={args.eval_samples}", "max_minutes=null", "save_every=0",
        "stop_after_flat_evals=0", "overwrite=true", "report_to=none"], section="train")
    started = time.perf_counter()
    run_train(cfg)
    curve = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    points = [{"passes": e["step"] * rows / examples, "tau3": e["tau"]["3"], "agreement": e["agreement"],
               "step": e["step"]} for e in curve]
    return {"folder": folder, "examples": examples, "steps": steps, "rows": rows, "points": points,
            "minutes": (time.perf_counter() - started) / 60}


def paying_passes(points: list[dict], pays: float) -> float | None:
    """The first evaluated pass count after which the next evaluation's tau(3) gain per pass is below `pays`
    (and stays below it: a later rise above would mean it still paid), None when every step still paid."""
    later = [p for p in points if p["step"] > 0]
    for i in range(len(later) - 1):
        gains = [(b["tau3"] - a["tau3"]) / (b["passes"] - a["passes"]) for a, b in zip(later[i:], later[i + 1:])]
        if all(g < pays for g in gains):
            return later[i]["passes"]
    return None


def best_passes(results: list[dict], ratios: tuple[float, ...]) -> list[str]:
    """The passes that give the highest held-out tau(3) in a fixed number of minutes, per rate ratio (training's
    samples per minute over the data stage's examples per minute): a model fitted to the runs, said as such.

    In M minutes at P passes the data holds N = M / (1 / data_rate + P / train_rate) examples. The gain over the
    untrained draft is modelled as g(N) x f(P): f = the smallest size's gain at P passes over its final gain
    (read off its curve), g(N) ~ N^a with a from the final gains of the smallest and largest sizes."""
    small, large = results[0], results[-1]
    if len(results) < 2 or small["examples"] == large["examples"]:
        return ["(one data size: no fit of the gain against the data's size)"]

    def final_gain(r):
        return r["points"][-1]["tau3"] - r["points"][0]["tau3"]
    a = math.log(final_gain(large) / final_gain(small)) / math.log(large["examples"] / small["examples"])
    curve = [(p["passes"], (p["tau3"] - small["points"][0]["tau3"]) / final_gain(small))
             for p in small["points"] if p["step"] > 0]
    lines = [f"Fitted: the final gain grows as N^{a:.2f} ({small['examples']} -> {large['examples']} examples: "
             f"{final_gain(small):+.3f} -> {final_gain(large):+.3f} tau(3)); f(P) from the {small['examples']}-example "
             "curve.", "", "| training samples/min over data examples/min | best passes | modelled gain there, "
             "relative to 5 passes |", "|---:|---:|---:|"]
    def modelled(passes: float, share: float, ratio: float) -> float:
        return (1 / (1 + passes / ratio)) ** a * share

    at_five = min(curve, key=lambda c: abs(c[0] - 5.0))
    for ratio in ratios:
        best = max(curve, key=lambda c: modelled(*c, ratio))
        lines.append(f"| {ratio:g} | {best[0]:.1f} | {modelled(*best, ratio) / modelled(*at_five, ratio):.3f} |")
    return lines + [""]


def table(result: dict, pays: float) -> str:
    lines = [f"### {result['examples']} examples ({result['folder']}): {result['steps']} steps x {result['rows']} "
             f"rows, {result['minutes']:.1f} min", "",
             "| step | passes | held-out tau(3) | gain per pass | first-proposal agreement |",
             "|---:|---:|---:|---:|---:|"]
    previous = None
    for p in result["points"]:
        gain = "" if previous is None or p["passes"] == previous["passes"] else \
            f"{(p['tau3'] - previous['tau3']) / (p['passes'] - previous['passes']):+.3f}"
        lines.append(f"| {p['step']} | {p['passes']:.2f} | {p['tau3']:.3f} | {gain} | {p['agreement']:.3f} |")
        previous = p
    enough = paying_passes(result["points"], pays)
    lines += ["", f"Passes after which a further pass adds less than {pays} to tau(3): "
              + (f"**{enough:.2f}**" if enough is not None else "none within this run (every pass still paid)"), ""]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import write

    keep = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="specdec-passes-"))
    if args.report_only:
        results = json.loads((keep / "passes.json").read_text())
    else:
        results = []
        for n, folder in enumerate(args.data):
            result = train_size(args, folder, keep / f"size-{n}")
            print(table(result, args.pays), flush=True)
            results.append(result)
    body = "\n".join([
        f"- recipe {Path(args.recipe).name} (its train settings), one process; held-out: {args.heldout} "
        f"({examples_in(args.heldout)} examples, answers to training prompts none of the sizes holds), "
        f"{args.eval_samples} samples scored", "",
        *[table(r, args.pays) for r in results],
        "## Passes for the most held-out tau in a fixed time", "", *best_passes(results, RATIOS)])
    (keep / "passes.json").write_text(json.dumps(results, indent=1))
    print("\n".join(best_passes(results, RATIOS)))
    print(f"wrote {write(args.name, 'Held-out tau against passes over the data (the demo recipe)', body)}")
    if not args.keep:
        shutil.rmtree(keep, ignore_errors=True)


if __name__ == "__main__":
    main()
