"""Draft trees against chains: one `specdec eval` run, the same baseline calls for every configuration.

    python bench/tree.py                                   # the demo's draft (outputs/demo/draft), as the demo evaluates
    python bench/tree.py --draft D --prompts 24 --max-new-tokens 96 --chains 1,2,3,4 --trees 3x1x1,dyn8
    python bench/tree.py --plain                           # then the same sweep with PyTorch's F.linear everywhere

Greedy, batch 1, the demo's held-out prompts (embedded:heldout) and token budget; every chain k and every tree
shape is decoded prompt by prompt in turn with the target alone (specdec/eval/measure.py: A/B order alternating),
so each speedup is against the baseline measured in this run. Prints, and writes to docs/results/, each
configuration's speedup, tau, acceptance, nodes per round and equivalence, then the best tree over the best chain;
then what `choose_k` predicts for the static shapes from the draft's teacher-forced ranks (first 4 prompts), and
the draft's top-n agreement per round position there.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import results  # bench/results.py (this script runs with bench/ on its path)
import torch

from specdec import fast_linear
from specdec.eval import proposals
from specdec.eval.choose import choose_num_draft_tokens
from specdec.eval.config import EvalConfig
from specdec.eval.runner import run
from specdec.eval.verify import first_turn, resolve_prompts_path
from specdec.models import load_model, load_tokenizer, resolve_device
from specdec.prompts import encode_prompt, read_prompts
from specdec.proposal import Proposal
from specdec.tokens import tokenizer_pad_id

DEFAULT_TREES = "2x1,3x1,4x1,3x1x1,4x1x1,2x2x1,3x2x1,4x2x1x1,dyn6-d3-w3,dyn10-d4-w3"


def sweep_table(report: dict) -> tuple[str, dict, dict]:
    rows = report["sweep"]
    lines = ["| proposal | speedup | tokens/s target / speculative | tau | acceptance | per depth | nodes per round "
             "| v(n+1) | identical |", "|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["tree"] is not None, r["num_draft_tokens"] or r["tree_depth"], r["proposal"])):
        nodes = r.get("nodes_per_round")
        lines.append(f"| {r['proposal']} | {r['speedup']:.3f} | {r['baseline_tokens_per_s']:.2f} / "
                     f"{r['speculative_tokens_per_s']:.2f} | {r['mean_accepted_tokens']:.3f} | "
                     f"{r['acceptance_rate']:.3f} | {[a if a is None else round(a, 3) for a in r['per_position_acceptance']]} | "
                     f"{'' if nodes is None else f'{nodes:.1f}'} | {r['v']:.3f} | "
                     f"{'yes' if r['equivalence_passed'] else 'NO'} ({r['mismatches']} mismatches) |")
    chains = [r for r in rows if r["tree"] is None]
    trees = [r for r in rows if r["tree"] is not None]
    return "\n".join(lines), max(chains, key=lambda r: r["speedup"]), max(trees, key=lambda r: r["speedup"])


def predicted_section(cfg: EvalConfig, candidates: list[Proposal]) -> str:
    """choose_k's prediction for chains and static trees (no timed decoding)."""
    device = resolve_device(cfg.device)
    tokenizer = load_tokenizer(cfg.target)
    target, draft = load_model(cfg.target, cfg.dtype, device), load_model(cfg.draft, cfg.dtype, device)
    prompts = read_prompts(resolve_prompts_path(cfg.prompts), limit=4)
    encoded = [encode_prompt(tokenizer, first_turn(p.messages), cfg.use_chat_template) for p in prompts]
    ck = choose_num_draft_tokens(target, draft, encoded, candidates, cfg, tokenizer.eos_token_id,
                                 tokenizer_pad_id(tokenizer), device)
    lines = ["| proposal | replayed tau | v(n+1) | predicted speedup |", "|---|---:|---:|---:|"]
    for p in candidates:
        key = p.label
        lines.append(f"| {key} | {ck['tau'][key]:.3f} | {ck['v'][str(p.verified_nodes)]:.3f} | "
                     f"{ck['predicted_speedup'][key]:.3f} |")
    top = ck["top_n_agreement"]
    lines += ["", f"choose_k would pick {proposals.label(ck['chosen'])} (c = {ck['c']:.3f}). Teacher-forced top-n "
              "agreement per round position (share of positions where the target's token is within the draft's "
              "top n):", "", "| position | " + " | ".join(f"top {n}" for n in top[0]) + " |",
              "|---:|" + "---:|" * len(top[0])]
    lines += [f"| {j + 1} | " + " | ".join(f"{v:.3f}" for v in row.values()) + " |" for j, row in enumerate(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--draft", default="outputs/demo/draft")
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts (the demo evaluates 24)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--chains", default="1,2,3,4")
    parser.add_argument("--trees", default=DEFAULT_TREES)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default="outputs/bench-tree")
    parser.add_argument("--plain", action="store_true",
                        help="then the same sweep again with the CPU linear fast path off (PyTorch's F.linear)")
    parser.add_argument("--results-name", default="trees", help="docs/results/<date>-<name>.md")
    args = parser.parse_args()
    if not Path(args.draft).exists():
        raise SystemExit(f"no draft at {args.draft}: run `specdec demo` first, or pass --draft")
    provenance = results.header("Draft trees against chains (greedy, batch 1)")
    chains = [int(k) for k in args.chains.split(",")]
    trees = proposals.normalise_trees(args.trees.split(","))
    cfg = EvalConfig(target=args.target, draft=args.draft, prompts="embedded:heldout", num_prompts=args.prompts,
                     max_new_tokens=args.max_new_tokens, num_draft_tokens=chains, tree=[t.value for t in trees], dtype=args.dtype,
                     out=args.out, threads=torch.get_num_threads())
    body = [f"Draft `{args.draft}`, target `{args.target}` ({args.dtype}), the first "
            f"{args.prompts} held-out prompts, {args.max_new_tokens} new tokens, greedy, batch 1; one run, every row "
            "against the same target-only calls.", ""]
    report = run(cfg)
    body += sweep_section(report)
    if args.plain:
        fast_linear.ENABLED = False
        try:
            plain = run(dataclasses.replace(cfg, out=f"{args.out}-plain"))
        finally:
            fast_linear.ENABLED = True
        body += ["## The same sweep with the CPU linear fast path off", "",
                 "A second eval run in the same process, every layer on PyTorch's F.linear (baseline included). "
                 "Ratios are within each run; tokens/s across the two runs are minutes apart.", "",
                 *sweep_section(plain, kernels=False)]
        best = {name: max(r["sweep"], key=lambda row: row["speculative_tokens_per_s"])
                for name, r in (("measured kernels", report), ("F.linear", plain))}
        body += ["Fastest configuration of each run: " + "; ".join(
            f"{name}: {row['proposal']} at {row['speculative_tokens_per_s']:.2f} tokens/s (target alone "
            f"{row['baseline_tokens_per_s']:.2f})" for name, row in best.items()) + ".", ""]
    body += ["## What choose_k predicts (first 4 prompts, teacher-forced ranks, costs timed)", "",
             predicted_section(cfg, [*map(Proposal.chain, chains), *(t for t in trees if not t.tree.dynamic)])]
    text = "\n".join(body)
    print(text)
    print(f"\nwritten to {results.write(args.results_name, '', text, provenance)}")


def sweep_section(report: dict, kernels: bool = True) -> list[str]:
    table, chain, tree = sweep_table(report)
    lines = [table, "",
             f"Best chain: {chain['proposal']} at {chain['speedup']:.3f}x; best tree: {tree['proposal']} at "
             f"{tree['speedup']:.3f}x: the tree is **{tree['speedup'] / chain['speedup']:.3f}x** the best chain "
             f"(tau {tree['mean_accepted_tokens']:.3f} vs {chain['mean_accepted_tokens']:.3f}).", ""]
    if kernels:
        kept = fast_linear.summary(report["cpu_linear_kernels"], report.get("cpu_linear_unpacked_for_memory"))
        lines += [kept + " (this process, specdec/fast_linear.py).", ""]
    return lines


if __name__ == "__main__":
    main()
