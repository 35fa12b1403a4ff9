"""Command-line entry points: `specdec eval` and `specdec verify`."""

from __future__ import annotations

import logging

from specdec.config import config_from_cli
from specdec.eval.config import EvalConfig
from specdec.eval.runner import run
from specdec.eval.verify import VerifyConfig, format_result, run_verify

log = logging.getLogger(__name__)

EVAL_HELP = """usage: specdec eval --target T --draft D [--prompts FILE] [--num-draft-tokens 1,2,4] [--batch-size 1,4]
                    [--max-new-tokens N] [--temperature X] [--top-k K] [--top-p P] --out DIR
                    [--config recipes/X.yaml] [key=value ...]

Decodes the prompts target-only and speculatively (alternating, one process) and writes DIR/report.json,
DIR/report.md, PNG plots and DIR/samples.jsonl. Lists sweep k and the batch size; the report keeps the
recommended configuration at the top level and adds a `sweep` table. Decision thresholds (all must hold for
`enable`): min_acceptance_rate=0.5 min_speedup=1.1 max_memory_overhead=0.2 (beyond the draft's weights).
Other keys: seed, warmup, num_prompts, use_chat_template, device, dtype, threads, recommend_by
(speedup|tokens_per_s|latency_p50|latency_p95), plot_format, cost_repeats, equivalence_samples, report_to.
choose_k=1,2,3,4 picks k before the timed runs by predicted speedup (a teacher-forced replay of the draft on the
target's outputs for the first choose_k_prompts prompts, plus timed costs) and measures only that k.
tree=3x1x1,dyn8 adds draft trees to the sweep at batch size 1 (3x1x1: the draft's top 3, then its top 1 below
each; dyn8: EAGLE-2's dynamic tree of 8 nodes, dyn8-d4-w3 names depth and width); choose_tree=3x1x1,2x2x1 lets
choose_k weigh static trees beside its chains.
Prompts: .jsonl/.json with {"prompt"}, {"messages"}, ShareGPT or Spec-Bench records; default embedded:heldout
(the shipped held-out set). The report goes to --out, else to output_dir/eval from the recipe.

In the serving engine: engine=vllm (or engine=specdec,vllm, both side by side) starts `vllm serve` from vLLM's
own venv (`make vllm-env`; vllm_python= to point elsewhere) for target-only and speculative, sends the same prompt
token ids at concurrency=1,4,16 and reads acceptance from its /metrics. vllm_method=auto|draft_model|eagle3|ngram
(auto reads the draft's config.json), vllm_ngram=true adds an n-gram reference row, vllm_args=[...] passes extra
server arguments (e.g. --enforce-eager), vllm_speculative_config={...} extra speculative-config keys; also
vllm_port, vllm_prefix_caching, vllm_side_by_side, vllm_startup_timeout, vllm_request_timeout, vllm_stop_timeout.
Server logs are kept beside the report (vllm-<mode>.log).
"""

VERIFY_HELP = """usage: specdec verify [--temperature 1.0,0.8 --top-k 0,6 --top-p 1.0,0.9] [--batch-size 2000,1]
                      [--samples 16000] [--samples-batch1 300] [--alpha 0.001] [--out DIR]
       specdec verify --target T --draft D --prompts FILE [--num-prompts 2] [--samples 512] [--batch-size 64]

Checks that speculative sampling is distributed exactly as the target. Without --target/--draft it builds a
seeded tiny pair (vocab 16) and compares the joint law of the first 4 generated tokens (k = 2) in both modes
with the exact one (chi-square with pooling, and TV distance, thresholds fixed before sampling). With a pair
it tests the first two generated tokens per prompt. Exits 1 when a test fails.
"""


def main_eval(argv: list[str]) -> int:
    """`specdec eval`: baseline vs speculative report."""
    if any(a in ("-h", "--help") for a in argv):
        print(EVAL_HELP)
        return 0

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
    if any(a in ("-h", "--help") for a in argv):
        print(VERIFY_HELP)
        return 0

    cfg = config_from_cli(VerifyConfig, argv, section=None)
    result = run_verify(cfg)
    print(format_result(result, result.get("seconds")))
    return 0 if result["passed"] else 1
