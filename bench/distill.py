"""Distillation choices at one budget: losses, teacher signal and draft shapes, measured on held-out data.

    python bench/distill.py --train-data runs/smollm2-135m/data \\
        --heldout embedded=runs/smollm2-135m/data_heldout --heldout spec-bench=runs/specbench/data \\
        --steps 150 --parallel 2 --variants fkl tvd jsd online on_policy depth6 vocab4096

Every variant trains with `specdec train --config RECIPE` plus the base overrides plus its own, for the same
number of optimizer steps on the same data; two run side by side with one thread each by default (the
machine's two cores), so their wall-clock minutes compare with each other but not with a two-thread run.
Each final draft is then scored teacher-forced on every held-out folder (all rows): greedy top-1 agreement
with the target and the simulated mean accepted tokens tau(k) for k = 1..8 (exact for greedy decoding: the
draft sees the target's own prefix at every position), and the share of the folder's completion tokens the draft's
head can propose at all (a reduced head's ceiling on agreement). Prints a markdown table and writes results.jsonl, and with
`--name N` docs/results/<date>-N.md.
`--base recipe` trains every variant on the recipe's own settings instead of BASE, e.g. the EAGLE-3 draft:

    python bench/distill.py --recipe recipes/smollm2-135m-eagle3.yaml --base recipe \
        --train-data runs/smollm2-135m-eagle3/data --heldout embedded=runs/smollm2-135m-eagle3/data_heldout \
        --steps 400 --variants ttt1 ttt3 ttt5 --set max_minutes=null save_every=0

`--score NAME=DIR ...` scores drafts already trained (plain or EAGLE-3) instead:

    python bench/distill.py --score demo=outputs/demo/draft --heldout embedded=runs/heldout/data \\
        --heldout spec-bench=runs/specbench/data
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import results  # bench/results.py (this script runs with bench/ on its path)

# name -> overrides on top of BASE: an offline forward-KL draft from target layers 0, 1, 29, 8192-id head.
VARIANTS = {
    "fkl": [],
    "tvd": ["loss=tvd"],
    "jsd": ["loss=jsd", "beta=0.5"],
    "rkl": ["loss=rkl"],
    "ce": ["loss=ce"],
    "fkl_ce": ["ce_weight=1.0"],
    "t05": ["temperature=0.5"],  # the target's and the draft's logits sharpened alike: the loss weighs the top tokens
    "online": ["teacher=online"],
    "offline": ["teacher=offline"],
    "on_policy": ["teacher=on_policy", "on_policy_fraction=0.5"],
    "depth2": ["draft_layers=0,29"],
    "depth4": ["draft_layers=0,1,2,29"],
    "depth6": ["draft_layers=0,1,2,3,4,29"],
    "vocab4096": ["draft_vocab_size=4096"],
    "vocab8192": ["draft_vocab_size=8192"],
    "vocab16384": ["draft_vocab_size=16384"],
    "full_head": ["draft_vocab_size=0"],
    # EAGLE-3 drafts (--recipe recipes/smollm2-135m-eagle3.yaml --base recipe): training-time test depth
    "ttt1": ["ttt_steps=1"],
    "ttt3": ["ttt_steps=3"],
    "ttt5": ["ttt_steps=5"],
    # --base recipe: the recipe as it is, and with Muon on the layers' matrices (train/optim.py)
    "recipe": [],
    "muon": ["optimizer=muon"],
}
BASE = ["draft_layers=0,1,29", "draft_vocab_size=8192", "teacher=offline", "loss=fkl", "learning_rate=1e-3",
        "warmup_steps=15", "freeze_embeddings=true", "per_device_batch_size=16", "save_every=0", "eval_every=0"]


def train(name: str, args, out_root: Path) -> dict:
    out = out_root / name
    cmd = [sys.executable, "-m", "specdec.cli", "train", "--config", args.recipe, f"train_data={args.train_data}",
           f"output_dir={out}", f"max_steps={args.steps}", f"heldout_data={args.heldout[0].split('=', 1)[1]}",
           *(BASE if args.base == "plain" else []), *VARIANTS[name], *args.set]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    start = time.perf_counter()
    with open(out_root / f"{name}.log", "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return {"name": name, "overrides": VARIANTS[name], "train_minutes": (time.perf_counter() - start) / 60,
            "draft": str(out / "final")}


def score(result: dict, heldouts: list[str], target: str) -> dict:
    """Teacher-forced agreement and simulated tau of the final draft on each held-out folder (all rows), replayed
    as the decoder proposes for its kind (specdec/replay.py); an EAGLE-3 draft reads the target's states there."""
    import torch

    from specdec import draft_registry, replay
    from specdec.models import load_model
    from specdec.train import kinds
    from specdec.train.batches import collate, load_split
    from specdec.train.distill import TrainConfig
    from specdec.train.draft import completion_coverage
    from specdec.vocab import draft_to_target_map

    model = load_model(result["draft"], dtype="float32", device="cpu").eval()
    reads_target = kinds.get(draft_registry.of_model(model).name).facts.reads_target_states
    target_model = load_model(target, dtype="float32", device="cpu") if reads_target else None
    cfg = TrainConfig(eval_batch_size=16)
    ks = cfg.eval_k
    for spec in heldouts:
        label, folder = spec.split("=", 1)
        ds = load_split(folder)
        kept = draft_to_target_map(model)  # None: a full head, which can propose every token
        rows = ds.select_columns(["input_ids", "prompt_length"])
        coverage = 1.0 if kept is None else completion_coverage(rows, kept, model.get_input_embeddings().num_embeddings)
        runs = []
        with torch.no_grad():
            for s in range(0, len(ds), cfg.eval_batch_size):
                batch = collate(ds[s:s + cfg.eval_batch_size], 0, cfg.max_length)
                ids, mask, scored = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
                states = replay.target_states(model, target_model, ids, mask)
                runs += replay.replay_runs(model, ids, mask, scored, max(ks), states)
        flat = [r for row in runs for r in row]
        result[label] = {"agreement": sum(r >= 1 for r in flat) / max(len(flat), 1),
                         "tau": replay.tau_from_runs(runs, ks), "positions": len(flat),
                         "head_covers": coverage}
    return result


def table(scored: list[dict], labels: list[str]) -> str:
    head = "| variant | overrides | train min | " + " | ".join(
        f"{lab} head covers | {lab} agreement | {lab} tau(1) | {lab} tau(4) | {lab} tau(8)" for lab in labels) + " |"
    lines = [head, "|" + "---|" * (3 + 5 * len(labels))]
    for r in scored:
        cells = [r["name"], " ".join(r["overrides"]) or "(base)", f"{r['train_minutes']:.1f}"]
        for lab in labels:
            m = r[lab]
            cells += [f"{m['head_covers']:.3f}", f"{m['agreement']:.3f}", f"{m['tau'][1]:.2f}", f"{m['tau'][4]:.2f}", f"{m['tau'][8]:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/smollm2-135m.yaml")
    parser.add_argument("--train-data", help="a folder written by `specdec data` (needed unless --score)")
    parser.add_argument("--score", nargs="+", metavar="NAME=DIR",
                        help="score these trained drafts instead of training variants")
    parser.add_argument("--target", default="embedded:smollm2-135m-instruct",
                        help="the target whose hidden states an EAGLE-3 draft reads")
    parser.add_argument("--heldout", action="append", required=True,
                        help="LABEL=FOLDER of held-out generated data; repeatable (the first is also the "
                             "trainer's own held-out split)")
    parser.add_argument("--variants", nargs="+", default=["fkl", "tvd", "jsd"], choices=sorted(VARIANTS))
    parser.add_argument("--base", choices=["plain", "recipe"], default="plain",
                        help="plain: BASE's overrides under every variant (an offline forward-KL draft from target "
                             "layers 0, 1, 29); recipe: the recipe's own train settings")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--parallel", type=int, default=2, help="variants trained at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per variant")
    parser.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every variant")
    parser.add_argument("--out", default="runs/bench-distill")
    parser.add_argument("--name", help="also write the table to docs/results/<date>-<name>.md")
    args = parser.parse_args()
    provenance = results.header("Drafts scored teacher-forced on held-out data") if args.name else None
    if not args.score and not args.train_data:
        parser.error("give --train-data to train variants, or --score NAME=DIR to score trained drafts")
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    if args.score:
        trained = [{"name": n, "overrides": [d], "train_minutes": float("nan"), "draft": d}
                   for n, d in (spec.split("=", 1) for spec in args.score)]
    else:
        with ThreadPoolExecutor(args.parallel) as pool:
            trained = list(pool.map(lambda n: train(n, args, out_root), args.variants))
    import torch

    torch.set_num_threads(min(args.threads * args.parallel, os.cpu_count() or 1))  # scoring runs alone
    scored = [score(r, args.heldout, args.target) for r in trained]
    with open(out_root / "results.jsonl", "a") as f:
        for r in scored:
            f.write(json.dumps({**r, "steps": None if args.score else args.steps, "recipe": args.recipe,
                                "base": BASE if args.base == "plain" else "recipe", "set": args.set}) + "\n")
    labels = [h.split("=", 1)[0] for h in args.heldout]
    if not args.score:
        print(f"{args.steps} optimizer steps per variant, {args.parallel} at once x {args.threads} thread(s)")
    print(table(scored, labels))
    if args.name:
        what = "trained drafts scored" if args.score else f"{args.steps} optimizer steps per variant"
        body = "\n".join([f"{what}; held-out folders: " + ", ".join(args.heldout) + ".", "", table(scored, labels)])
        print(f"written to {results.write(args.name, 'Drafts scored teacher-forced on held-out data', body, provenance)}")


if __name__ == "__main__":
    main()
