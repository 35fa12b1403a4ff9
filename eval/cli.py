"""Command-line entry points: `specdec eval` and `specdec verify`."""

from __future__ import annotations

import logging

from specdec.config import config_from_cli
from specdec.eval.config import EvalConfig
from specdec.eval.runner import run
from specdec.eval.verify import VerifyConfig, format_result, run_verify

log = logging.getLogger(__name__)

# The prose above the keys of `specdec eval --help` / `specdec verify --help` (specdec/cli.py builds the help).
EVAL_INTRO = """Decodes the prompts target-only and speculatively (alternating, one process) and writes DIR/report.json,
DIR/report.md, plots and DIR/samples.jsonl. Lists sweep k and the batch size; the report keeps the recommended
configuration at the top level and adds a `sweep` table. The verdict is `enable` only when every decision
threshold below holds.
choose_k=1,2,3,4 picks k before the timed runs by predicted speedup (a teacher-forced replay of the draft on the
target's outputs for the first choose_k_prompts prompts, plus timed costs) and measures only that k.
tree=3x1x1,dyn8 adds draft trees to the sweep at batch size 1 (3x1x1: the draft's top 3, then its top 1 below
each; dyn8: EAGLE-2's dynamic tree of 8 nodes, dyn8-d4-w3 names depth and width); choose_tree=3x1x1,2x2x1 lets
choose_k weigh static trees beside its chains.
Prompts: .jsonl/.json with {"prompt"}, {"messages"}, ShareGPT or Spec-Bench records; default embedded:heldout
(the shipped held-out set). The report goes to --out, else to output_dir/eval from the recipe.

In the serving engine: engine=vllm (or engine=specdec,vllm, both side by side) starts `vllm serve` from vLLM's
own venv (`make vllm-env`; vllm_python= to point elsewhere) for target-only and speculative, sends the same prompt
token ids at each concurrency level and reads acceptance from its /metrics. Server logs are kept beside the
report (vllm-<mode>.log)."""

VERIFY_INTRO = """Checks that speculative sampling is distributed exactly as the target. Without --target/--draft it builds a
seeded tiny pair (vocab 16) and compares the joint law of the first 4 generated tokens (k = 2) in both modes
with the exact one (chi-square with pooling, and TV distance, thresholds fixed before sampling). With a pair
it tests the first two generated tokens per prompt. Exits 1 when a test fails."""


def main_eval(argv: list[str]) -> int:
    """`specdec eval`: baseline vs speculative report."""
    cfg = config_from_cli(EvalConfig, argv, section="eval")
    result = run(cfg)
    s = result["speculative"]
    if "specdec" in cfg.engine:
        print(f"speedup {result['speedup']:.3f}x (analytical {result['analytical_speedup']:.3f}x), acceptance rate "
              f"{s['acceptance_rate']:.3f}, tau {s['mean_accepted_tokens']:.3f}, "
              f"{'tree=' + result['config']['tree'] if result['config'].get('tree') else 'k=' + str(result['config']['num_draft_tokens'])} "
              f"batch={result['config']['batch_size']}; equivalence {result['equivalence']['mode']}: "
              f"{result['equivalence']['passed']}; verdict {result['decision']['verdict']}")
    if result.get("engine"):
        e = result["engine"]
        for row in e["sweep"]:
            speedup = "n/a" if row["speedup"] is None else f"{row['speedup']:.3f}x"
            print(f"vLLM {row['method']} at concurrency {row['concurrency']}: speedup {speedup}, tokens/s "
                  f"{row['baseline_tokens_per_s'] or 0:.1f} -> {row['speculative_tokens_per_s']:.1f}, acceptance rate "
                  f"{row['acceptance_rate'] or 0:.3f}, tau {row['mean_accepted_tokens'] or 0:.3f}")
        print(f"vLLM equivalence {e['equivalence']['mode']}: {e['equivalence']['passed']}; engine verdict "
              f"{e['decision']['verdict']}")
    print(f"report: {cfg.out_dir() / 'report.md'}")
    return 0


def main_verify(argv: list[str]) -> int:
    """`specdec verify`: distribution equivalence under sampling; 0 on pass, 1 on failure."""
    cfg = config_from_cli(VerifyConfig, argv, section=None)
    result = run_verify(cfg)
    print(format_result(result, result.get("seconds")))
    return 0 if result["passed"] else 1
