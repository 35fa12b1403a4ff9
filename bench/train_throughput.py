"""EAGLE-3 trained tokens per second at two commits (and packed rows at this one), in one run.

    git worktree add /tmp/before <commit>
    python bench/train_throughput.py --before /tmp/before                 # SmolLM2-135M shapes, ttt_steps 3
    python bench/train_throughput.py --before /tmp/before --bf16 --rounds 5
    python bench/train_throughput.py --before /tmp/before --bf16 --ttt 1 --supervise-prompt   # the demo recipe's
    python bench/train_throughput.py --before /tmp/before --data outputs/demo/data --steps 80   # the whole trainer

Each child process builds an EAGLE-3 draft with the embedded target's shapes (random weights: the cost depends on
the shapes), a fixed list of micro-batches of 16 samples whose lengths follow the demo recipe's data (a prompt of
40-230 tokens, then up to 96 completion tokens; seeded), and times `--steps` optimizer steps (loss, backward,
AdamW) after one warm-up step, with the tree's own loss and collation. It prints the positions trained per second
(the completions', or with `--supervise-prompt` every position's). With `--data` each child runs the whole trainer
instead (`specdec train`, the recipe's settings) on that recorded folder and prints the trainer's own pace:
trained tokens/s and samples/s. Rounds alternate the children's order, so a machine that drifts slows each alike;
the figures are medians over rounds, with each round's after / before ratio.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import results  # bench/results.py (this script runs with bench/ on its path)
from checkouts import last_figure, run_child

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import contextlib, json, random, sys, time
import torch
from transformers import LlamaConfig
from specdec.eagle3 import Eagle3Draft, draft_config
from specdec.train import batches
from specdec.train.distill import TrainConfig
from specdec.train.eagle3_train import eagle3_loss, teacher_head

args = json.loads(sys.argv[1])
torch.manual_seed(0)
SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5, max_position_embeddings=8192,
                      rope_theta=100000.0)
draft = Eagle3Draft(draft_config(SMOLLM2, [2, 15, 27], args["vocab"]))
draft.set_vocabulary(torch.randperm(SMOLLM2.vocab_size)[: args["vocab"]])
draft.embed_tokens.weight.requires_grad_(False)
inv = torch.full((SMOLLM2.vocab_size,), -1, dtype=torch.long)
inv[draft.draft_to_target] = torch.arange(args["vocab"])
head = teacher_head(torch.nn.Linear(576, SMOLLM2.vocab_size, bias=False), draft.kept_ids())
cfg = TrainConfig(draft="eagle3", teacher="online", ttt_steps=args["ttt"], eagle_aux_layer_ids=[2, 15, 27])
rng = random.Random(1)
micro = []
for _ in range(args["steps"] + 1):
    prompts = [rng.randint(40, 230) for _ in range(16)]
    seqs = [[int(draft.draft_to_target[rng.randrange(args["vocab"])]) for _ in range(p + rng.randint(16, 96))]
            for p in prompts]
    batch = batches.collate({"input_ids": seqs, "prompt_length": prompts}, pad_id=0, max_length=512,
                            prompt_positions=args["prompt"])
    states = torch.randn(*batch["input_ids"].shape, 4 * 576)
    if args["pack"]:
        packed = batches.pack(batch, 512)
        batch, states = packed, batches.place(states, packed)
    micro.append((batch, states))
optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-5)
autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args["bf16"] else contextlib.nullcontext()
tokens, seconds = 0, 0.0
with autocast:
    for i, (batch, states) in enumerate(micro):
        start = time.perf_counter()
        loss = eagle3_loss(cfg, draft, batch, states, head, inv)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:  # the first step warms up
            seconds += time.perf_counter() - start
            tokens += int(batch["loss_mask"].sum())
print("TOKENS_PER_S", tokens / seconds)
"""


# `--data`: the whole trainer (`specdec train`, the recipe's settings) on a recorded data folder, for `steps` steps;
# the figure is its own pace (trained tokens/s over its timed steps, evaluations and saves excluded).
TRAINER_CHILD = r"""
import json, shutil, sys, tempfile
from specdec.cli import main
args = json.loads(sys.argv[1])
out = tempfile.mkdtemp(prefix="train-throughput-")
main(["train", "--config", args["recipe"], "train_data=" + args["data"], "output_dir=" + out, "heldout_data=",
      f"max_steps={args['steps']}", "max_minutes=null", "eval_every=100000", "save_every=100000", "overwrite=true"])
with open(out + "/train_summary.json") as f:
    pace = json.load(f)["pace"]
shutil.rmtree(out, ignore_errors=True)  # its checkpoint and draft: nothing this bench reads again
print("TOKENS_PER_S", pace["tokens_per_second"])
print("SAMPLES_PER_S", pace["samples_per_second"])
"""


def tokens_per_s(tree: Path, settings: dict) -> float:
    return last_figure(run_child(tree, CHILD, settings), "TOKENS_PER_S")


def trainer_pace(tree: Path, settings: dict) -> tuple[float, float]:
    """(trained tokens/s, samples/s) of the whole trainer's timed steps."""
    out = run_child(tree, TRAINER_CHILD, settings)
    return last_figure(out, "TOKENS_PER_S"), last_figure(out, "SAMPLES_PER_S")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="a checkout (git worktree) of the earlier commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ttt", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=4096, help="draft vocabulary (the demo recipe's)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (what the trainer uses where native)")
    parser.add_argument("--supervise-prompt", action="store_true",
                        help="score the prompts' positions too (the demo recipe's supervise_prompt)")
    parser.add_argument("--data", default="", help="a recorded data folder: time the whole trainer on it instead "
                        "(the recipe's settings, --steps steps; synthetic batches otherwise)")
    parser.add_argument("--recipe", default="recipes/smollm2-135m-eagle3.yaml", help="with --data: the recipe")
    parser.add_argument("--name", default="", help="docs/results/<date>-<name>.md (default train-throughput, "
                        "train-throughput-real with --data)")
    args = parser.parse_args()
    if args.data:
        return trainer(args)
    base = {"steps": args.steps, "ttt": args.ttt, "vocab": args.vocab, "bf16": args.bf16,
            "prompt": args.supervise_prompt}
    children = {"before": (args.before.resolve(), False), "after": (ROOT, False), "after, packed": (ROOT, True)}
    figures: dict[str, list[float]] = {name: [] for name in children}
    names = list(children)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            tree, packed = children[name]
            figures[name].append(tokens_per_s(tree, {**base, "pack": packed}))
        print(f"round {r + 1}: " + ", ".join(f"{n} {figures[n][-1]:.0f}" for n in names), flush=True)
    median = {n: statistics.median(v) for n, v in figures.items()}
    rows = ["| code | trained tokens/s (median) | / before | per round |", "|---|---:|---:|---|"]
    rows += [f"| {n} | {median[n]:.0f} | {median[n] / median['before']:.3f} | "
             f"{', '.join(f'{x:.0f}' for x in figures[n])} |" for n in names]
    ratios = [a / b for a, b in zip(figures["after"], figures["before"])]
    body = "\n".join([
        f"EAGLE-3 training steps (loss, backward, AdamW), ttt_steps {args.ttt}, SmolLM2-135M shapes, draft "
        f"vocabulary {args.vocab}, micro-batches of 16 samples of demo-like lengths (prompt 40-230 + completion "
        f"16-96 tokens), {'every position scored, prompts too' if args.supervise_prompt else 'completions scored'}, "
        f"{'bf16 autocast' if args.bf16 else 'float32'}, CPU; {args.steps} timed steps per child, "
        f"{args.rounds} rounds in alternating order. before = {args.before.name} "
        f"({results.commit_of(args.before)}).", "", *rows, "",
        f"after / before per round: {', '.join(f'{x:.3f}' for x in ratios)}", ""])
    print(body)
    print(f"written to {results.write(args.name or 'train-throughput', 'EAGLE-3 trained tokens per second, before and after', body)}")


def trainer(args) -> None:
    """Before and after, the whole trainer on a real data folder, in alternating order: its trained tokens/s and
    its samples/s (which tell apart where a change scores fewer positions per sample)."""
    settings = {"recipe": args.recipe, "data": str(Path(args.data).resolve()), "steps": args.steps}
    children = {"before": args.before.resolve(), "after": ROOT}
    names = list(children)
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % 2:] + names[: r % 2]:
            figures[name].append(trainer_pace(children[name], settings))
        print(f"round {r + 1}: " + ", ".join(f"{n} {figures[n][-1][0]:.0f} tokens/s, {figures[n][-1][1]:.2f} samples/s"
                                           for n in names), flush=True)
    rows = ["| code | trained tokens/s (median) | / before | samples/s (median) | / before | samples/s per round |",
            "|---|---:|---:|---:|---:|---|"]
    median = {n: [statistics.median(x[i] for x in figures[n]) for i in (0, 1)] for n in names}
    rows += [f"| {n} | {median[n][0]:.0f} | {median[n][0] / median['before'][0]:.3f} | {median[n][1]:.2f} | "
             f"{median[n][1] / median['before'][1]:.3f} | {', '.join(f'{x[1]:.2f}' for x in figures[n])} |"
             for n in names]
    ratios = [a[1] / b[1] for a, b in zip(figures["after"], figures["before"])]
    body = "\n".join([
        f"`specdec train` with {args.recipe}'s settings on {args.data} ({args.steps} steps a run, the trainer's own "
        f"pace over its timed steps: trained tokens/s, the positions its loss scores, and samples/s), one run per "
        f"checkout a round, {args.rounds} rounds in alternating order. before = {args.before.name} "
        f"({results.commit_of(args.before)}).", "", *rows, "",
        f"samples/s after / before per round: {', '.join(f'{x:.3f}' for x in ratios)}; median "
        f"{statistics.median(ratios):.3f}", ""])
    print(body)
    print(f"written to {results.write(args.name or 'train-throughput-real', 'specdec train, trained tokens and samples per second, before and after', body)}")


if __name__ == "__main__":
    main()
