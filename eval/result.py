"""report.json's dict from the measured rows, and samples.jsonl (report.py renders report.md from the dict)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from specdec import fast_linear
from specdec.eval import metrics

# The keys that name a row's proposal (eval/rows.py: proposal_keys); a row adds its batch_size.
NAME_KEYS = ("num_draft_tokens", "tree", "tree_depth", "proposal")


def _public(mode: dict) -> dict:
    return {k: v for k, v in mode.items() if k not in ("latencies", "fallback")} | (
        {"fallback": mode["fallback"]} if "fallback" in mode else {})


def _row_name(row: dict) -> dict:
    return {key: row[key] for key in (*NAME_KEYS, "batch_size")}


def assemble(cfg, prompts, rows, best, fastest, costs, device, timing) -> dict:
    """report.json from the rows: the recommended row's figures at the top, every row in `sweep`."""
    config = {
        "target": cfg.target, "draft": cfg.draft, **{key: best[key] for key in NAME_KEYS if key != "proposal"},
        "temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens, "batch_size": best["batch_size"], "seed": cfg.seed,
        "num_prompts": len(prompts), "warmup": cfg.warmup, "prompts": cfg.prompts,
        "use_chat_template": cfg.use_chat_template, "chat_template_kwargs": cfg.chat_template_kwargs,
        "dtype": cfg.dtype,
        "sweep_num_draft_tokens": cfg.num_draft_tokens, "sweep_tree": cfg.tree, "sweep_batch_size": cfg.batch_size,
        "recommend_by": cfg.recommend_by,
        "thresholds": dataclasses.asdict(cfg.thresholds()),
    }
    result = {
        "config": config,
        "environment": metrics.environment(device),
        "cpu_linear_kernels": fast_linear.choices(),  # what specdec/fast_linear.py measured and kept in this run
        "cpu_linear_unpacked_for_memory": fast_linear.skipped_for_memory(),  # shapes given no reordered copy
        "baseline": _public(best["baseline"]),
        "speculative": _public(best["speculative"]),
        "speedup": best["speedup"],
        "analytical_speedup": best["analytical_speedup"],
        "expected_tokens_per_round": best["expected_tokens_per_round"],
        "cost": {**best["cost"], **{k: v for k, v in costs[best["batch_size"]].items() if k not in ("c", "v")}},
        "memory": best["memory"],
        "equivalence": best["equivalence"],
        "decision": best["decision"],
        # the best configuration whose verdict is enable (the best overall when none is), and the best overall
        "recommended": {**_row_name(best), "by": cfg.recommend_by,
                        "fastest": {**_row_name(fastest), "verdict": fastest["decision"]["verdict"],
                                    "failed_gates": fastest["decision"]["failed_gates"]}},
        # The measurement loop's wall time vs the time inside decoder calls (cost timing and warm-up excluded).
        "harness": {**timing, "overhead_fraction": max(0.0, 1 - timing["decoder_s"] / timing["loop_s"])
                    if timing["loop_s"] else 0.0},
    }
    if best.get("intervals"):  # how close the verdict's call was: eval/intervals.py
        result["intervals"] = best["intervals"]
    if best["categories"]:
        result["categories"] = best["categories"]
    if len(rows) > 1:
        result["sweep"] = [_sweep_entry(r) for r in rows]
    return result


def write_samples(path: Path, prompts, best: dict) -> None:
    with path.open("w") as f:
        for pid, cat, base, spec in best["samples"]:
            f.write(json.dumps({"prompt_id": pid, "category": cat, "baseline_tokens": base,
                                "speculative_tokens": spec}) + "\n")


def _sweep_entry(r: dict) -> dict:
    return {
        **{key: r[key] for key in NAME_KEYS}, "batch_size": r["batch_size"], "speedup": r["speedup"],
        "analytical_speedup": r["analytical_speedup"],
        "baseline_tokens_per_s": r["baseline"]["tokens_per_s"],
        "speculative_tokens_per_s": r["speculative"]["tokens_per_s"],
        "acceptance_rate": r["speculative"]["acceptance_rate"],
        "mean_accepted_tokens": r["speculative"]["mean_accepted_tokens"],
        "per_position_acceptance": r["speculative"]["per_position_acceptance"],
        "nodes_per_round": r["speculative"]["nodes_per_round"],
        "baseline_latency_p50_s": r["baseline"]["latency_s"]["p50"],
        "speculative_latency_p50_s": r["speculative"]["latency_s"]["p50"],
        "c": r["cost"]["c"], "v": r["cost"]["v"],
        "equivalence_passed": r["equivalence"]["passed"], "mismatches": r["equivalence"]["mismatches"],
        "verdict": r["decision"]["verdict"], "failed_gates": r["decision"]["failed_gates"],
    }
