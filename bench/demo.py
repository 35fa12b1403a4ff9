"""The full demo's figures, then its published draft in vLLM's server on the same held-out prompts.

    python bench/demo.py                        # runs `specdec demo` (45 min) into outputs/demo, then vLLM
    python bench/demo.py --skip-demo            # reads a finished outputs/demo instead
    python bench/demo.py --vllm-prompts 0       # specdec's decoder only

Writes docs/results/<date>-demo.md: the demo's summary as it printed it, what each stage spent and produced,
and the evaluation's figures; then `specdec eval engine=specdec,vllm vllm_ngram=true concurrency=1,4,16` on the
demo's published draft (float32, greedy, k as the demo chose): vLLM's speedup against vLLM target-only at each
level, vLLM's n-gram lookup as the no-training reference, and specdec's decoder on the same prompts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import results  # bench/results.py (this script runs with bench/ on its path)

from specdec.demo import _print_summary
from specdec.eval.config import EvalConfig
from specdec.eval.runner import run


def demo_section(out: Path) -> str:
    summary = json.loads((out / "demo_summary.json").read_text())
    report, timings = summary["report"], summary["timings"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _print_summary(report, out / "eval", out / "draft", timings, summary.get("split"))
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    trained = json.loads((out / "train" / "train_summary.json").read_text())
    s, b = report["speculative"], report["baseline"]
    lines = ["## specdec demo", "", "```", printed.getvalue().strip("\n"), "```", "",
             f"- data: {manifest['counts']['examples']} examples in {len(manifest['shards'])} of "
             f"{manifest['num_shards']} shards ({timings['data_s'] / 60:.1f} min)",
             f"- split: {json.dumps(summary.get('split'))}",
             f"- training: {trained.get('steps', trained.get('global_step'))} steps "
             f"({timings['train_s'] / 60:.1f} min), pace {json.dumps(trained.get('pace'))}; best held-out: "
             + json.dumps(trained.get("best", {}), default=str)[:300],
             f"- eval ({timings['eval_s'] / 60:.1f} min): {report['recommended']['proposal']}, tokens/s "
             f"{b['tokens_per_s']:.2f} target alone / {s['tokens_per_s']:.2f} speculative, speedup "
             f"{report['speedup']:.3f}, acceptance {s['acceptance_rate']:.3f}, tau {s['mean_accepted_tokens']:.3f},"
             f" per position {[x if x is None else round(x, 3) for x in s['per_position_acceptance']]}",
             f"- memory: {json.dumps(report.get('memory', {}))}"]
    calib = report.get("choose_k")
    if calib:
        lines.append(f"- choose_k: {json.dumps(calib, default=str)[:600]}")
    return "\n".join(lines)


def checkout_relative(configs: dict) -> str:
    """vLLM's speculative configs as JSON, the draft's folder named relative to the checkout (no machine paths)."""
    return json.dumps(configs).replace(str(Path.cwd().resolve()) + "/", "")


def vllm_section(out: Path, prompts: int, max_new_tokens: int) -> str:
    """`specdec eval engine=specdec,vllm` on the demo's published draft: one report, both engines."""
    report = json.loads((out / "eval" / "report.json").read_text())
    k = report["config"]["num_draft_tokens"] or report["config"]["tree_depth"]  # a tree: vLLM's chain of its depth
    cfg = EvalConfig(target=report["config"]["target"], draft=str(out / "draft"), prompts="embedded:heldout",
                     num_prompts=prompts, max_new_tokens=max_new_tokens, num_draft_tokens=[k], dtype="float32",
                     engine=["specdec", "vllm"], concurrency=[1, 4, 16], vllm_ngram=True,
                     out=str(out / "eval_vllm"), vllm_args=["--enforce-eager", "--distributed-executor-backend", "uni"])
    both = run(cfg)
    engine, s, b = both["engine"], both["speculative"], both["baseline"]
    lines = ["## The published draft in vLLM", "",
             f"vLLM {engine['version']} ({engine['distribution']}), `{checkout_relative(engine['speculative_configs'])}`, "
             f"the first {prompts} held-out prompts, {max_new_tokens} new tokens, greedy, float32; each level "
             "that many clients in a closed loop (continuous batching), pairs target-only / speculative:", "",
             "| concurrency | method | speedup | tokens/s | TTFT p50 ms | TPOT p50 ms | acceptance | tau | mismatches |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]

    def ms(x):
        return "n/a" if x is None else f"{1e3 * x:.1f}"

    for r in engine["sweep"]:
        acc = "n/a" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        tau = "n/a" if r["mean_accepted_tokens"] is None else f"{r['mean_accepted_tokens']:.3f}"
        lines.append(f"| {r['concurrency']} | {r['method']} | {r['speedup']:.3f} | {r['baseline_tokens_per_s']:.2f}"
                     f" / {r['speculative_tokens_per_s']:.2f} | {ms(r['baseline_ttft_p50_s'])} / "
                     f"{ms(r['speculative_ttft_p50_s'])} | {ms(r['baseline_tpot_p50_s'])} / "
                     f"{ms(r['speculative_tpot_p50_s'])} | {acc} | {tau} | {r['mismatches']} |")
    lines += ["", f"specdec's decoder in the same report (batch 1, k = {k}): speedup {both['speedup']:.3f}, tokens/s "
              f"{b['tokens_per_s']:.2f} / {s['tokens_per_s']:.2f}, acceptance {s['acceptance_rate']:.3f}, tau "
              f"{s['mean_accepted_tokens']:.3f}; greedy identity vLLM vs specdec: "
              f"{(engine['equivalence'].get('vs_specdec') or {}).get('mismatches')} mismatches."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/demo")
    parser.add_argument("--skip-demo", action="store_true", help="read a finished demo in --out")
    parser.add_argument("--vllm-prompts", type=int, default=16, help="held-out prompts in vLLM (0: skip vLLM)")
    parser.add_argument("--vllm-new-tokens", type=int, default=64)
    parser.add_argument("--results-name", default="demo", help="docs/results/<date>-<name>.md")
    parser.add_argument("demo_args", nargs="*", help="passed to `specdec demo` (e.g. minutes=45)")
    args = parser.parse_args()
    out = Path(args.out)
    provenance = results.header("specdec demo, then its draft in vLLM")  # the tree the run starts from
    if not args.skip_demo:
        subprocess.run([sys.executable, "-m", "specdec", "demo", f"output_dir={out}", *args.demo_args], check=True)
    body = demo_section(out)
    if args.vllm_prompts:
        body += "\n\n" + vllm_section(out, args.vllm_prompts, args.vllm_new_tokens)
    print(body)
    print(f"\nwritten to {results.write(args.results_name, '', body, provenance)}")


if __name__ == "__main__":
    main()
