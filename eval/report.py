"""report.json and report.md: the same figures, for machines and for people."""

from __future__ import annotations

import json
from pathlib import Path

from specdec import fast_linear
from specdec.eval import intervals
from specdec.eval.engine import markdown as engine_markdown
from specdec.outputs import NOT_REACHED, position_rates
from specdec.proposal import Proposal

FORMULA = (
    "Analytical speedup (Leviathan et al. 2022, with per-position acceptance and a measured verify cost):\n\n"
    "    tau_hat = 1 + sum_{i=1..k} prod_{j<=i} a_j        (expected tokens per round)\n"
    "    speedup = tau_hat / (k * c + v)\n\n"
    "a_j = measured per-position acceptance, c = draft step / target step and v = target forward of k+1 tokens / "
    "target step, both from cached forwards timed in this run. With a_j = alpha and v = 1 this is the paper's "
    "(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))."
)


def _f(x, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _ms(x) -> str:
    return "n/a" if x is None else f"{1e3 * x:.1f}"


def _proposal(value) -> str:
    """A proposal's JSON value (k, or a tree's shape) as prose: "k = 2", "tree 3x1x1"."""
    return str(Proposal.of(value))


def _label(value) -> str:
    return Proposal.of(value).label


def _gates_text(failed: list[str]) -> str:
    return ", ".join(failed) if failed else "none"


def _choice_text(ck: dict) -> str:
    """Whether the chosen proposal passes the thresholds, and the fastest beside it when that one fails."""
    chosen, fastest, failed = ck["chosen"], ck["fastest"], ck["failed_gates"]
    if failed[_label(chosen)]:
        return (f"No proposal passes every threshold fixed before the run on these figures: the fastest, "
                f"{_proposal(fastest)}, was measured, and the verdict below judges it.")
    if chosen != fastest:
        return (f"The fastest predicted, {_proposal(fastest)}, fails {_gates_text(failed[_label(fastest)])}: "
                f"{_proposal(chosen)} is the fastest that passes every threshold fixed before the run.")
    return "It is also the fastest predicted, and passes every threshold fixed before the run on these figures."


def _choose_k_lines(ck: dict | None) -> list[str]:
    """How k (or a tree) was chosen (choose_k, choose_tree): the calibration table, before any timed run."""
    if not ck:
        return []
    rows = []
    for p in ck["candidates"]:
        key = _label(p)
        rows.append(f"| {_proposal(p)} | {ck['tau'][key]:.3f} | {ck['acceptance_rate'][key]:.3f} | "
                    f"{ck['v'][str(Proposal.of(p).verified_nodes)]:.3f} | {ck['predicted_speedup'][key]:.3f} | "
                    f"{ck['memory_overhead_mb'][key]:.1f} / {ck['memory_limit_mb'][key]:.1f} | "
                    f"{_gates_text(ck['failed_gates'][key])} |")
    lines = [f"{_proposal(ck['chosen'])} was chosen before the timed runs by predicted speedup tau / (d c + v(n+1)) "
             f"(d draft forwards and n verified tokens per round): tau from the draft teacher-forced on the "
             f"target's outputs for the first {ck['prompts']} prompt(s), c = {ck['c']:.3f} and v timed then. "
             "Each proposal is held to the decision's thresholds: its acceptance rate (tau - 1) / d, its predicted "
             "speedup and its accounted memory; equivalence is judged on the timed run.",
             _choice_text(ck)]
    best_chain = ck.get("best_chain")
    if Proposal.of(ck["chosen"]).is_tree and best_chain is not None:
        predicted = ck["predicted_speedup"]
        gain = predicted[_label(ck["chosen"])] / predicted[_label(best_chain)]
        lines.append(f"The tree is predicted {gain:.3f}x the best chain's speed (k = {best_chain}).")
    return [*lines, "", "| proposal | tau | acceptance | v(n+1) | predicted speedup | memory / limit (MB) | fails |",
            "|---|---:|---:|---:|---:|---:|---|", *rows, ""]


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.1f}"


def _memory_lines(m: dict, share: float) -> list[str]:
    """The accounted memory the gate reads (eval/memory.py), then the measured figures beside it."""
    a, t = m["accounted"], m["target_only"]
    shared = (f" (besides {m['shared_with_target_mb']:.1f} MB of input embeddings equal to the target's, which it "
              "shares)" if m.get("shared_with_target_mb") else "")
    return [
        f"Memory, accounted (the gate's figure, the same in every run of this draft at these settings): draft "
        f"weights {_mb(a['weights'])} MB{shared}, reordered weight copies the CPU fast path may make "
        f"{_mb(a['copies'])} MB, KV cache {_mb(a['kv_cache'])} MB ({a['positions']} positions x batch "
        f"{a['batch_size']}), target hidden states held {_mb(a['states'])} MB: {m['overhead_mb']:.1f} MB, against "
        f"a limit of {m['limit_mb']:.1f} MB, {share:.0%} of target-only's {m['target_only_mb']:.1f} MB (weights "
        f"{_mb(t['weights'])} MB, KV cache {_mb(t['kv_cache'])} MB).",
        "",
        f"Memory, measured (informational; it moves between runs): the largest peak difference between the two "
        f"modes on the same prompts plus the draft's weights and the copies made, {m['rss_overhead_mb']:.1f} MB; "
        f"reordered copies made in this run: {m.get('draft_packed_mb', 0.0):.1f} MB of the draft's, "
        f"{m.get('target_packed_mb', 0.0):.1f} MB of the target's (held by target-only decoding too).",
        "",
    ]


def _recommended_lines(r: dict) -> list[str]:
    """The sweep's fastest configuration, when it is not the one reported (it fails a threshold)."""
    rec = r.get("recommended") or {}
    fastest = rec.get("fastest")
    if not fastest or fastest["proposal"] == rec["proposal"] and fastest["batch_size"] == rec["batch_size"]:
        return []
    return [f"The fastest configuration by {rec['by']}, {fastest['proposal']} at batch size {fastest['batch_size']}, "
            f"fails {_gates_text(fastest['failed_gates'])}: the report gives the fastest one whose verdict is "
            f"enable, {rec['proposal']} at batch size {rec['batch_size']}.", ""]


def _results_lines(r: dict) -> list[str]:
    """The figures of both modes, the speculative counters and the costs of the run."""
    b, s = r["baseline"], r["speculative"]
    return [
        "## Results",
        "",
        "| metric | target-only | speculative |",
        "|---|---:|---:|",
        f"| tokens/s | {b['tokens_per_s']:.2f} | {s['tokens_per_s']:.2f} |",
        *[f"| latency {p} (ms) | {_ms(b['latency_s'][p])} | {_ms(s['latency_s'][p])} |" for p in ("p50", "p95", "p99")],
        *[f"| TTFT {p} (ms) | {_ms(b['ttft_s'][p])} | {_ms(s['ttft_s'][p])} |" for p in ("p50", "p95")],
        *[f"| ITL {p} (ms) | {_ms(b['itl_s'][p])} | {_ms(s['itl_s'][p])} |" for p in ("p50", "p95")],
        f"| peak memory (MB) | {b['peak_memory_mb']:.1f} | {s['peak_memory_mb']:.1f} |",
        f"| generated tokens | {b['tokens']} | {s['tokens']} |",
        f"| decoder time (s) | {b['seconds']:.2f} | {s['seconds']:.2f} |",
        "",
        "Speculative counters: "
        f"acceptance rate {s['acceptance_rate']:.3f} (accepted / proposed draft tokens), "
        f"mean accepted tokens (tau) {s['mean_accepted_tokens']:.3f} per round (correction or bonus included), "
        f"{s['rounds']} rounds, {s['proposed']} proposed, {s['accepted']} accepted, {s['corrections']} corrections, "
        f"{s['bonus']} bonus tokens.",
        "",
        "Per-position acceptance P(i accepted | < i accepted): " + position_rates(s["per_position_acceptance"])
        + (f" ({NOT_REACHED}: no round reached that position)" if None in s["per_position_acceptance"] else ""),
        "",
        f"Costs measured in this run: target step {r['cost']['target_step_ms']:.2f} ms, draft step "
        f"{r['cost']['draft_step_ms']:.2f} ms, c = {r['cost']['c']:.3f}, v(n+1) = {r['cost']['v']:.3f} (n verified draft tokens); "
        f"expected tokens per round from the per-position acceptance {r['expected_tokens_per_round']:.3f}.",
        "",
    ]


def _sampled_lines(r: dict) -> list[str]:
    """Acceptance measured at a sampling temperature beside the timed run (eval/sampled.py), when asked for."""
    sampled = r.get("sampled")
    if not sampled:
        return []
    t = sampled["temperature"]
    return [
        f"## Sampled at T={t:g}", "",
        f"One more speculative pass, untimed, at temperature {t:g} alone (no top-k / top-p): "
        f"{_proposal(sampled['tree'] or sampled['num_draft_tokens'])}, batch size {sampled['batch_size']}, the "
        f"same {sampled['num_prompts']} prompts, seed {sampled['seed']}. Acceptance rate "
        f"**{sampled['acceptance_rate']:.3f}**, mean accepted tokens (tau) {sampled['mean_accepted_tokens']:.3f} "
        f"per round over {sampled['rounds']} rounds; per-position acceptance "
        + position_rates(sampled["per_position_acceptance"])
        + ". No speed or gate reads it: the verdict above is the timed run's.", "",
    ]


def _method_lines(r: dict) -> list[str]:
    """How the figures were measured, on what, and the plots."""
    lines = [
        "", "## Method", "",
        "Both modes decode the same prompts with the same settings in one process; for each batch the order "
        "(target-only first or speculative first) alternates. Timings are device-synchronised; only decoder calls "
        "are timed. Latency is per request (a batch's requests all wait for the batch); TTFT is the time to the "
        "first generated token; ITL spreads each step's time over the tokens it appended (a round that emits 3 "
        "tokens counts 3 intervals of a third). Peak memory is CUDA peak allocated on GPUs and the process's peak "
        "RSS on CPU. speedup = target-only wall time / speculative wall time.",
        "", FORMULA, "",
        "## Environment", "",
        ", ".join(f"{k} {v}" for k, v in r["environment"].items()),
    ]
    if r.get("cpu_linear_kernels"):
        lines += ["", fast_linear.summary(r["cpu_linear_kernels"], r.get("cpu_linear_unpacked_for_memory"))
                       + " (specdec/fast_linear.py; report.json lists them)."]
    if r.get("plots"):
        lines += ["", "## Plots", ""]
        titles = {"per_position_acceptance": "Per-position acceptance", "latency_cdf": "Latency CDF",
                  "speedup_vs_k": "Speedup vs k (measured and analytical)"}
        for name, file in r["plots"].items():
            lines += [f"![{titles.get(name, name)}]({file})", ""]
    return lines


def to_markdown(r: dict) -> str:
    """report.md: verdict first, then the figures, the equivalence, the sweep, categories, method and plots."""
    cfg, s = r["config"], r["speculative"]
    d, eq = r["decision"], r["equivalence"]
    lines = [
        "# Speculative decoding report",
        "",
        f"**Verdict: `{d['verdict']}`** — speedup **{r['speedup']:.2f}x** (analytical {r['analytical_speedup']:.2f}x), "
        f"acceptance rate **{s['acceptance_rate']:.3f}**, equivalence **{_eq_word(eq)}**.",
        "",
        f"Target `{cfg['target']}`, draft `{cfg['draft']}`; "
        f"{_proposal(cfg.get('tree') or cfg['num_draft_tokens'])}, batch size "
        f"{cfg['batch_size']} (recommended by {cfg['recommend_by']}); {cfg['num_prompts']} prompts from "
        f"`{cfg['prompts']}`, max_new_tokens {cfg['max_new_tokens']}, temperature {cfg['temperature']}, top_k "
        f"{cfg['top_k']}, top_p {cfg['top_p']}, seed {cfg['seed']}, {cfg['warmup']} warm-up pass(es) excluded.",
        "",
        "## Decision",
        "",
        "Thresholds were fixed in the config before the run; all must hold for `enable`.",
        "",
        *[f"- {reason}" for reason in d["reasons"]],
        "",
        *intervals.markdown_line(r.get("intervals"), cfg["num_prompts"]),
        *_recommended_lines(r),
        *_results_lines(r),
        *_sampled_lines(r),
        *_choose_k_lines(r.get("choose_k")),
        *_memory_lines(r["memory"], cfg["thresholds"]["max_memory_overhead"]),
        f"Harness: {r['harness']['decoder_s']:.2f} s inside the decoders of {r['harness']['loop_s']:.2f} s of "
        f"measurement loop ({100 * r['harness']['overhead_fraction']:.1f}% outside the decoders, untimed).",
        "",
        "## Equivalence",
        "",
    ]
    lines += _equivalence_md(eq)
    lines += _sweep_lines(r) + _category_lines(r)
    if r.get("engine"):  # engine=specdec,vllm: the serving engine's figures beside the decoder's
        lines += engine_markdown.markdown_lines(r)
    lines += _method_lines(r)
    return "\n".join(lines).rstrip() + "\n"


def _sweep_lines(r: dict) -> list[str]:
    """Every configuration measured, the recommended one marked."""
    if not r.get("sweep"):
        return []
    cfg = r["config"]
    lines = ["", "## Sweep", "",
             "| proposal | batch | speedup | analytical | tokens/s target-only | tokens/s speculative | acceptance | tau "
             "| c | v | equivalent | verdict (failing) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for row in r["sweep"]:
        mark = " **(recommended)**" if (row["num_draft_tokens"], row.get("tree"), row["batch_size"]) == (
            cfg["num_draft_tokens"], cfg.get("tree"), cfg["batch_size"]) else ""
        lines.append(
            f"| {row.get('proposal', row['num_draft_tokens'])}{mark} | {row['batch_size']} | {row['speedup']:.3f} | "
            f"{row['analytical_speedup']:.3f} | {row['baseline_tokens_per_s']:.2f} | "
            f"{row['speculative_tokens_per_s']:.2f} | {row['acceptance_rate']:.3f} | "
            f"{row['mean_accepted_tokens']:.3f} | {row['c']:.3f} | {row['v']:.3f} | "
            f"{_eq_word({'passed': row['equivalence_passed']})} | {row['verdict']}"
            + (f" ({_gates_text(row['failed_gates'])})" if row.get("failed_gates") else "") + " |")
    return lines


def _category_lines(r: dict) -> list[str]:
    """The figures per prompt category, when the prompts have categories."""
    if not r.get("categories"):
        return []
    lines = ["", "## By category", "",
             "| category | prompts | tokens/s target-only | tokens/s speculative | speedup | acceptance | tau |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for cat, c in r["categories"].items():
        lines.append(f"| {cat} | {c['prompts']} | {c['baseline_tokens_per_s']:.2f} | "
                     f"{c['speculative_tokens_per_s']:.2f} | {c['speedup']:.3f} | {c['acceptance_rate']:.3f} | "
                     f"{c['mean_accepted_tokens']:.3f} |")
    return [*lines, "", "For batch sizes above 1 a batch's time and counters are shared equally among its prompts."]


def _eq_word(eq: dict) -> str:
    passed = eq.get("passed")
    return "not checked" if passed is None else "passed" if passed else "FAILED"


def _equivalence_md(eq: dict) -> list[str]:
    if eq["mode"] == "greedy":
        out = [f"Greedy: speculative tokens equal target-only tokens on {eq['checked'] - eq['mismatches']} of "
               f"{eq['checked']} prompts ({_eq_word(eq)})."]
        if eq.get("mismatched_prompts"):
            out += ["", "| prompt | first differing position | target-only token | speculative token |",
                    "|---|---:|---:|---:|"]
            out += [f"| {m['prompt_id']} | {m['position']} | {_f(m['baseline_token'])} | {_f(m['speculative_token'])} |"
                    for m in eq["mismatched_prompts"]]
        return out
    out = [f"Sampling: {eq['note']}", ""]
    if eq.get("tests"):
        out += ["| test | N | chi2 | dof | p | TV | TV max | ok |", "|---|---:|---:|---:|---:|---:|---:|---|"]
        out += [f"| {t['test']} | {t['samples']} | {t['chi2']:.1f} | {t['dof']} | {t['p_value']:.4f} | "
                f"{t['tv']:.4f} | {t['tv_tolerance']:.4f} | {'pass' if t['passed'] else 'FAIL'} |" for t in eq["tests"]]
    else:
        out.append("The short check was skipped (equivalence_samples=0).")
    return out


def write(result: dict, out_dir: Path) -> None:
    """Write report.json and report.md into out_dir."""
    out_dir = Path(out_dir)
    (out_dir / "report.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    if "specdec" in result["config"].get("engine", ["specdec"]):
        (out_dir / "report.md").write_text(to_markdown(result))
    else:  # engine=vllm alone: the engine's own layout
        (out_dir / "report.md").write_text(engine_markdown.to_markdown(result))
