"""Drafts in vLLM's server beside specdec's own decoder, on the embedded SmolLM2 target (or any pair).

    python bench/engine.py --draft outputs/demo-quick/draft    # a trained draft (the quick demo's)
    python bench/engine.py --draft derived:0,1,2,3,4,29        # a plain draft derived from the target, untrained
    python bench/engine.py --draft D --concurrency 1,4,16 --num-prompts 16 --max-new-tokens 64 --k 2

Runs `specdec eval engine=specdec,vllm vllm_ngram=true`: target-only, the draft as vLLM's `draft_model` and
vLLM's n-gram lookup at each concurrency level, and the draft in specdec's decoder at batch 1, greedy float32.
Prints the sweep and writes it, with the report's folder, to docs/results/<date>-engine.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import results  # bench/results.py (this script runs with bench/ on its path)

from specdec.eval.engine import EngineError
from specdec.eval.runner import EvalConfig, run
from specdec.models import EMBEDDED_TARGET, load_model, load_tokenizer, save_model


def derived_draft(target: str, layers: str, folder: Path) -> str:
    """A plain draft made of some of the target's layers (train.draft.derive_draft), saved for vLLM to load."""
    from specdec.train.draft import derive_draft

    model = load_model(target, "float32", "cpu")
    return str(save_model(derive_draft(model, [int(i) for i in layers.split(",")]), load_tokenizer(target), folder))


def table(report: dict) -> str:
    """The sweep in pairs (target-only / speculative), then specdec's decoder for the same draft."""
    e = report["engine"]
    lines = ["| concurrency | method | speedup | tokens/s | TTFT p50 ms | TPOT p50 ms | acceptance | tau |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]

    def ms(x):
        return "n/a" if x is None else f"{1e3 * x:.1f}"

    def f(x, spec=".3f"):
        return "n/a" if x is None else format(x, spec)

    for r in e["sweep"]:
        lines.append(f"| {r['concurrency']} | {r['method']} | {f(r['speedup'])} | "
                     f"{f(r['baseline_tokens_per_s'], '.1f')} / {f(r['speculative_tokens_per_s'], '.1f')} | "
                     f"{ms(r['baseline_ttft_p50_s'])} / {ms(r['speculative_ttft_p50_s'])} | "
                     f"{ms(r['baseline_tpot_p50_s'])} / {ms(r['speculative_tpot_p50_s'])} | "
                     f"{f(r['acceptance_rate'])} | {f(r['mean_accepted_tokens'])} |")
    s, b = report["speculative"], report["baseline"]
    lines += ["", f"specdec's decoder, same draft, batch {report['config']['batch_size']}, k = "
              f"{report['config']['num_draft_tokens']}: speedup {report['speedup']:.3f}, tokens/s "
              f"{b['tokens_per_s']:.1f} / {s['tokens_per_s']:.1f}, acceptance {s['acceptance_rate']:.3f}, tau "
              f"{s['mean_accepted_tokens']:.3f}.",
              f"Greedy identity in vLLM: {e['equivalence']['mismatches']} mismatches of {e['equivalence']['checked']} "
              f"(vs specdec's decoder: {(e['equivalence'].get('vs_specdec') or {}).get('mismatches')}); "
              f"vLLM {e['version']} ({e['distribution']}); servers' start "
              + ", ".join(f"{m} {s['ready_s']:.0f} s" for m, s in e["servers"].items() if s.get("ready_s")) + "."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=EMBEDDED_TARGET)
    parser.add_argument("--draft", required=True, help="a checkpoint folder, or derived:LAYER,LAYER,...")
    parser.add_argument("--prompts", default="embedded:heldout")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=2, help="draft tokens per round, in both engines")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--out", default=None, help="the report's folder (default: a temporary one)")
    parser.add_argument("--vllm-args", default="", help="extra `vllm serve` arguments, comma-separated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        draft = args.draft
        if draft.startswith("derived:"):
            draft = derived_draft(args.target, draft.removeprefix("derived:"), Path(tmp) / "draft")
        out = args.out or str(Path(tmp) / "report")
        cfg = EvalConfig(target=args.target, draft=draft, prompts=args.prompts, num_prompts=args.num_prompts,
                         max_new_tokens=args.max_new_tokens, num_draft_tokens=[args.k], dtype="float32", out=out,
                         engine=["specdec", "vllm"], vllm_ngram=True,
                         concurrency=[int(c) for c in args.concurrency.split(",")],
                         vllm_args=[a for a in args.vllm_args.split(",") if a])
        try:
            report = run(cfg)
        except EngineError as err:
            print(f"engine run incomplete: {err}")
            raise SystemExit(2) from err
        body = (f"Target {args.target}, draft {args.draft}, {report['config']['num_prompts']} prompts of "
                f"{args.prompts}, {args.max_new_tokens} new tokens, greedy float32, k = {args.k}. Pairs read "
                f"target-only / speculative.\n\n" + table(report))
        print(body)
        print(f"\nwritten to {results.write('engine', 'Drafts in vLLM beside specdec decoder', body)}")


if __name__ == "__main__":
    main()
