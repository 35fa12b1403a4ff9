"""The chain decoder's speed at two commits: does a change leave it where it was?

    git worktree add /tmp/before <commit>
    python bench/before_after.py --before /tmp/before             # this tree is "after"
    python bench/before_after.py --before /tmp/before --draft outputs/demo/draft --k 1 --rounds 4

Each round runs one child process per tree (its sources first on sys.path), the order alternating from round to
round; a child times the target alone and the speculative chain decoder prompt by prompt in turn (greedy, batch 1,
one warm-up prompt) and prints its tokens/s. The figure compared is each child's own ratio speculative / target
alone, so a machine that drifts between children slows both sides of a ratio alike. Writes the medians, every
round's ratios and both commits to docs/results/<date>-before-after.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import results  # bench/results.py (this script runs with bench/ on its path)

ROOT = Path(__file__).resolve().parents[1]
SPEC_BENCH = ROOT.parent / "shared" / "data" / "specbench_mtbench.jsonl"

CHILD = r"""
import json, sys, time, torch
from specdec import speculative_generate, target_generate
from specdec.models import load_model, load_tokenizer
from specdec.prompts import encode_prompt, read_prompts
args = json.loads(sys.argv[1])
torch.manual_seed(0)
tok = load_tokenizer(args["target"])
target = load_model(args["target"], dtype="float32", device="cpu")
if args["draft"]:
    draft = load_model(args["draft"], dtype="float32", device="cpu")
else:
    try:
        from specdec.train.draft import derive_draft
    except ImportError:  # trees from before train/ shipped as specdec.train
        from train.draft import derive_draft
    draft = derive_draft(target, [0, 1]).float().eval()
prompts = read_prompts(args["prompts_file"], limit=args["prompts"] + 1)
encoded = [torch.tensor([encode_prompt(tok, p.messages[:1])]) for p in prompts]
seconds, tokens = {"target": 0.0, "chain": 0.0}, {"target": 0, "chain": 0}
with torch.inference_mode():
    for i, ids in enumerate(encoded):
        for name in (["target", "chain"] if i % 2 == 0 else ["chain", "target"]):
            start = time.perf_counter()
            if name == "target":
                seq = target_generate(target, ids, max_new_tokens=args["new"], eos_token_id=tok.eos_token_id).sequences
            else:
                seq = speculative_generate(target, draft, ids, num_draft_tokens=args["k"], max_new_tokens=args["new"],
                                           eos_token_id=tok.eos_token_id).sequences
            if i > 0:
                seconds[name] += time.perf_counter() - start
                tokens[name] += seq.shape[1] - ids.shape[1]
rate = {n: tokens[n] / seconds[n] for n in seconds}
print("RESULT " + json.dumps({"target_tok_s": rate["target"], "chain_tok_s": rate["chain"],
                              "ratio": rate["chain"] / rate["target"]}))
"""


def run_child(tree: Path, settings: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(settings)], cwd=tree, env=env,
                         capture_output=True, text=True, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode or line is None:
        raise SystemExit(f"the child in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def commit_of(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                          text=True).stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a checkout (git worktree) of the earlier commit")
    parser.add_argument("--target", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="default: layers 0,1 of the target (bench/decode.py's)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts-file", default=str(SPEC_BENCH))
    args = parser.parse_args()
    provenance = results.header("The chain decoder before and after a change")
    trees = {"before": Path(args.before).resolve(), "after": ROOT}
    settings = {"target": args.target, "draft": str(Path(args.draft).resolve()) if args.draft else None,
                "k": args.k, "prompts": args.prompts, "new": args.new, "prompts_file": args.prompts_file}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for side in (["before", "after"] if r % 2 == 0 else ["after", "before"]):
            runs[side].append(run_child(trees[side], settings))
            print(side, runs[side][-1], flush=True)
    med = {side: statistics.median(x["ratio"] for x in runs[side]) for side in runs}
    lines = [f"before = {commit_of(trees['before'])}, after = {commit_of(ROOT)}; draft "
             f"{args.draft or 'layers 0,1 of the target'}, k = {args.k}, greedy, batch 1, float32, {args.prompts} "
             f"prompts x {args.new} new tokens (+1 warm-up) per child, {args.rounds} children per side, alternating.",
             "", "| side | speculative / target alone, per child | median | target tokens/s (median) |",
             "|---|---|---:|---:|"]
    for side in runs:
        ratios = ", ".join(format(x["ratio"], ".3f") for x in runs[side])
        lines.append(f"| {side} | {ratios} | {med[side]:.3f} | "
                     f"{statistics.median(x['target_tok_s'] for x in runs[side]):.2f} |")
    lines += ["", f"after / before (medians of the ratios): **{med['after'] / med['before']:.3f}**"]
    body = "\n".join(lines)
    print(body)
    print(f"\nwritten to {results.write('before-after', '', body, provenance)}")


if __name__ == "__main__":
    main()
