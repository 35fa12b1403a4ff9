"""The EAGLE-3 trainer's levers, one at a time, on bench/peer.py's data and budget: which settings raise held-out
acceptance?

    python bench/levers.py                                    # every lever: 160 steps x 4 rows each
    python bench/levers.py --levers baseline muon decay-1     # some of them
    python bench/levers.py --minutes 4 --levers ttt-1 ttt-3 ttt-5 --name ttt-budget    # one wall-clock budget
    python bench/levers.py --data D --heldout H --batch 16 --max-length 1024 --base supervise_prompt=true \
        --minutes 20 --levers ttt-1 ttt-3 --name ttt-demo-scale     # on recorded `specdec data` folders instead

Every run is specdec's trainer (`specdec.train.distill.run`) at the demo recipe's train settings
(recipes/smollm2-135m-eagle3.yaml) with one change (the lever), on the same recorded data (bench/peer.py's: the
embedded target's answers to the shipped training prompts, held-out answers to the held-out prompts), the same
rows in the same order, for the same optimizer steps, or with `--minutes`, the same wall-clock minutes
(`max_minutes`, the schedule fitted to the steps that fit). One process each, one thread, two at a time.
`baseline-seed1` is the baseline with another seed (draft init and data order): the spread between the two
baselines is the noise a lever must beat.

Scored by the trainer's own held-out replay of the saved draft (bench/peer.py's `heldout_figures`): greedy
agreement of the first proposal, top-1 agreement at round positions 2 and 3, tau(1..4). Writes
docs/results/<date>-<name>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import peer  # bench/peer.py (this script runs with bench/ on its path)

ROOT = Path(__file__).resolve().parents[1]
KS = peer.KS

# Each lever: the TrainConfig keys it changes from the recipe's settings.
LEVERS: dict[str, dict] = {
    "baseline": {},
    "baseline-seed1": {"seed": 1},
    "decay-1": {"ttt_decay": 1.0},  # every unrolled step weighs the same (speculators' default)
    "norm-before-residual": {"norm_before_residual": True},
    "muon": {"optimizer": "muon"},
    "linear": {"lr_schedule": "linear"},
    "layer-from-target": {"layer_init": "target"},
    "layer-from-target-seed1": {"layer_init": "target", "seed": 1},
    "fc-last-state": {"fc_init": "last_state"},
    "lr-1e-3": {"learning_rate": 1e-3},
    "lr-4e-3": {"learning_rate": 4e-3},
    "ce": {"loss": "ce"},  # cross-entropy on the target's token instead of forward KL on its top-n
    "ttt-1": {"ttt_steps": 1},
    "ttt-3": {"ttt_steps": 3},
    "ttt-5": {"ttt_steps": 5},
    # the prompts' positions scored too, the teacher the target's distribution there (issue 40)
    "supervise-prompt": {"supervise_prompt": True},
}
# Run only when named: the TTT table wants one wall-clock budget (--minutes), the second seed is a noise check.
NAMED_ONLY = {"ttt-1", "ttt-3", "ttt-5", "layer-from-target-seed1", "supervise-prompt"}
DEFAULT_LEVERS = [name for name in LEVERS if name not in NAMED_ONLY]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "peer", help="bench/peer.py's data and runs")
    parser.add_argument("--levers", nargs="+", default=DEFAULT_LEVERS, choices=list(LEVERS))
    parser.add_argument("--also", nargs="*", default=[], metavar="KEY=VALUE",
                        help="a combined run: these TrainConfig keys at once, e.g. optimizer=muon ttt_decay=1.0")
    parser.add_argument("--data", type=Path, help="a recorded `specdec data` folder to train on instead of "
                        "bench/peer.py's (the recipe's layers recorded)")
    parser.add_argument("--heldout", type=Path, help="with --data: a recorded folder of answers to other prompts")
    parser.add_argument("--base", nargs="*", default=[], metavar="KEY=VALUE",
                        help="settings of every run, the levers' baseline included")
    parser.add_argument("--steps", type=int, default=160, help="optimizer steps of every run")
    parser.add_argument("--minutes", type=float, default=0.0, help="instead: every run trains this many minutes")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--train-prompts", type=int, default=192)
    parser.add_argument("--heldout-prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--name", default="levers", help="results page name")
    return parser.parse_args()


def as_value(text: str):
    """A command-line value: JSON where it parses (numbers, true, lists), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def peer_examples(folder: Path) -> int:
    """The examples a `specdec data` folder's manifest counts."""
    return json.loads((folder / "manifest.json").read_text())["counts"]["examples"]


def child(spec: dict) -> None:
    import resource

    import torch

    torch.set_num_threads(1)
    out = peer.child_specdec(spec)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("LEVER_RESULT " + json.dumps(out), flush=True)


def train(args, name: str, changes: dict, base: dict) -> dict:
    out_dir = args.work / f"lever-{name}"
    shutil.rmtree(out_dir, ignore_errors=True)
    config = {**base, **changes, "output_dir": str(out_dir)}
    if args.minutes:
        config.update(max_minutes=args.minutes, max_steps=100_000)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    print(f"== {name}: {json.dumps(changes)}", flush=True)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                           json.dumps({"config": config})], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-4000:]}")
    result = json.loads([x for x in proc.stdout.splitlines() if x.startswith("LEVER_RESULT ")][-1][13:])
    result["steps"] = json.loads((out_dir / "train_summary.json").read_text())["steps"]
    return result


def shown(folder: Path) -> str:
    """A data folder as the page names it: relative to the repository where it lies inside it (no path of the
    machine that ran the bench)."""
    root = Path(__file__).resolve().parents[1]
    folder = Path(folder).resolve()
    return str(folder.relative_to(root)) if folder.is_relative_to(root) else folder.name


def main() -> None:
    args = parse_args()
    if args.child:
        return child(json.loads(args.child))
    import results  # bench/results.py

    from specdec.models import load_tokenizer

    provenance = results.header("EAGLE-3 training levers")
    train_section = peer.recipe_train()
    layer_ids = list(train_section["eagle_aux_layer_ids"])
    args.work = args.work.resolve()
    data, heldout = args.work / "data", args.work / "data_heldout"
    started = time.perf_counter()
    if args.data:
        if not args.heldout:
            raise SystemExit("--data needs --heldout (a folder of answers to prompts --data does not hold)")
        data, heldout = args.data.resolve(), args.heldout.resolve()
    else:
        peer.make_data(data, "embedded:train", args.train_prompts, args.max_new_tokens, layer_ids)
        peer.make_data(heldout, "embedded:heldout", args.heldout_prompts, args.max_new_tokens, layer_ids)
    data_minutes = (time.perf_counter() - started) / 60
    args.threads, args.seed = 1, 0
    base, _ = peer.run_settings(args, train_section, data, heldout)
    base["weight_decay"] = 0.0
    base.update({k: as_value(v) for k, v in (item.split("=", 1) for item in args.base)})
    runs = {name: LEVERS[name] for name in args.levers}
    if args.also:
        runs["combined"] = {k: as_value(v) for k, v in (item.split("=", 1) for item in args.also)}
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        outcome = dict(zip(runs, pool.map(lambda n: train(args, n, runs[n], base), runs)))
    tokenizer = load_tokenizer(peer.TARGET)
    rows = []
    for name, out in outcome.items():
        figures = peer.heldout_figures(Path(out["final"]), heldout, tokenizer, args.max_length)
        top1 = [p.get("1", float("nan")) for p in figures["top_n_agreement"]]
        rows.append(f"| {name} | `{json.dumps(runs[name])}` | {out['steps']} | {figures['agreement']:.3f} | "
                    f"{top1[1]:.3f} | {top1[2]:.3f} | " + " | ".join(f"{figures['tau'][k]:.3f}" for k in KS)
                    + f" | {out['tokens'] / out['seconds']:.0f} | {out['peak_rss_mb']:.0f} |")
        print(rows[-1], flush=True)
    budget = f"{args.minutes:g} minutes of training each" if args.minutes else f"{args.steps} optimizer steps each"
    body = "\n".join([
        f"Every run: specdec's EAGLE-3 trainer at {peer.RECIPE.name}'s train settings with the change shown, "
        f"{budget}, {args.batch} samples a step, one thread, {args.parallel} runs at a time, max_length "
        f"{args.max_length}" + (f", every run with {json.dumps(args.base)}" if args.base else "") + "; "
        + (f"data: {shown(data)} ({peer_examples(data)} examples), held-out: {shown(heldout)} "
           f"({peer_examples(heldout)} "
           "examples), both recorded by `specdec data`" if args.data else
           f"float32 target states recorded once (bench/peer.py's data: {args.train_prompts} shipped training "
           f"prompts, {args.heldout_prompts} held-out prompts, {args.max_new_tokens} new tokens; made in "
           f"{data_minutes:.1f} min this run, 0 = reused)") + ". Held-out figures by the trainer's replay of the saved draft: agreement = greedy "
        "agreement of the first proposal; top-1 @2, @3 = at the round's 2nd and 3rd proposal; tau(k) = mean "
        "accepted tokens per round, chain of k. Tokens/s = scored positions per second of the training loop.", "",
        "| run | change | steps | agreement | top-1 @2 | top-1 @3 | " + " | ".join(f"tau({k})" for k in KS)
        + " | tokens/s | peak RSS MB |", "|---|---|" + "---:|" * (6 + len(KS)), *rows, ""])
    print(body)
    print(f"\nwritten to {results.write(args.name, 'EAGLE-3 training levers', body, provenance)}")


if __name__ == "__main__":
    main()
