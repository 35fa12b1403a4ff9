"""The engine section of report.md: a serving engine's sweep table, the side-by-side view with specdec's decoder, and the
engine's equivalence (eval/engine/report.py measures and assembles what this writes)."""

from __future__ import annotations

from specdec.outputs import position_rates


def _has_specdec(r: dict) -> bool:
    """Whether specdec's own decoder was measured in this report too (engine=specdec,vllm)."""
    return "specdec" in r["config"].get("engine", ["specdec"])


def _ms(x) -> str:
    return "n/a" if x is None else f"{1e3 * x:.1f}"


def _x(x, fmt=".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def markdown_lines(r: dict) -> list[str]:
    """The engine section of report.md (both layouts)."""
    e = r["engine"]
    labels = {m: f"{m} (reference, no training)" if m == "ngram" else m for m in e["methods"]}
    lines = ["", f"## In the serving engine: {e['label']} {e['version']} ({e['distribution']})", "",
             f"**Engine verdict: `{e['decision']['verdict']}`** — {'; '.join(e['decision']['reasons'])}.", "",
             f"Target-only and speculative servers ({e['label']}, {e['dtype']}, k = {e['num_draft_tokens']}) got "
             f"the same {e['num_prompts']} prompts as token ids, max_tokens {e['max_new_tokens']}, at concurrency "
             f"{', '.join(map(str, e['concurrency']))} (that many clients in a closed loop: continuous batching), "
             f"after {e['warmup']} warm-up pass(es) per server. Methods: "
             + ", ".join(f"`{labels[m]}`" for m in e["methods"]) + ".", "",
             "| concurrency | method | speedup | tokens/s target-only / speculative | TTFT p50 (ms) | TPOT p50 (ms) "
             "| latency p50 (ms) | acceptance | tau | equivalent |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in e["sweep"]:
        eq = {True: "yes", False: "**NO**", None: "n/a"}[row["equivalence_passed"]]
        lines.append(
            f"| {row['concurrency']} | {labels[row['method']]} | {_x(row['speedup'])} | "
            f"{_x(row['baseline_tokens_per_s'], '.1f')} / {_x(row['speculative_tokens_per_s'], '.1f')} | "
            f"{_ms(row['baseline_ttft_p50_s'])} / {_ms(row['speculative_ttft_p50_s'])} | "
            f"{_ms(row['baseline_tpot_p50_s'])} / {_ms(row['speculative_tpot_p50_s'])} | "
            f"{_ms(row['baseline_latency_p50_s'])} / {_ms(row['speculative_latency_p50_s'])} | "
            f"{_x(row['acceptance_rate'])} | {_x(row['mean_accepted_tokens'])} | {eq} |")
    lines += ["", "Pairs read target-only / speculative. Per-position acceptance P(i accepted | < i accepted):", ""]
    for row in e["sweep"]:
        if row["per_position_acceptance"]:
            lines.append(f"- {labels[row['method']]}, concurrency {row['concurrency']}: "
                         + position_rates(row["per_position_acceptance"]))
    if _has_specdec(r):
        lines += _side_by_side(r)
    lines += ["", "### Equivalence in the engine", ""] + _equivalence_lines(e["equivalence"], e["label"])
    if e["missing"] or e["errors"]:
        lines += ["", "### Missing", "", "The run is incomplete; the phases above are the ones that finished.", ""]
        lines += [f"- missing: {m}" for m in e["missing"]]
        lines += ["", *[f"- error ({x['mode'] or 'start-up'}): " + x["error"].splitlines()[0] for x in e["errors"]]]
    lines += ["", "### How the engine was measured", "",
              f"Each mode is a real {e['label']} server on 127.0.0.1 (its log beside this report: "
              + ", ".join(f"`{s['log']}`" for s in e["servers"].values()) + "). Timings are the client's: latency "
              "from sending a request to its last token, TTFT to its first, TPOT = (latency - TTFT) / (tokens - 1) per "
              "request, ITL per token (a chunk of n tokens counts n gaps of a nth); tokens/s = generated tokens over the "
              "phase's wall time; speedup = target-only phase time / speculative phase time on the same prompts. "
              "Acceptance comes from the server's speculative counters (Prometheus, `/metrics`), differenced "
              "around each phase: acceptance rate = accepted / proposed, tau = 1 + accepted / drafts (the correction "
              "or bonus token included), per position = accepted at i / accepted at i - 1 (which assumes full drafts "
              "of k tokens; n-gram lookup may propose fewer). "
              + ("Servers ran side by side, idle but the measured one, the modes' order alternating per level."
                 if e["side_by_side"] else "Servers ran one at a time.")]
    if e.get("plots"):
        lines += [""] + [f"![{name}]({file})" for name, file in e["plots"].items()]
    return lines


def _side_by_side(r: dict) -> list[str]:
    """specdec's decoder (its recommended row) beside the engine (primary method, concurrency 1 or the lowest level)."""
    e = r["engine"]
    c = min(e["concurrency"])
    row = next((x for x in e["sweep"] if x["method"] == e["primary_method"] and x["concurrency"] == c), None)
    if row is None:
        return []
    s, b = r["speculative"], r["baseline"]
    pos = position_rates(s["per_position_acceptance"], 2, numbered=False)
    epos = position_rates(row["per_position_acceptance"] or [], 2, numbered=False)
    return ["", f"### specdec's decoder beside {e['label']} ({_proposal(r['config'])})", "",
            f"| metric | specdec decoder (batch {r['config']['batch_size']}) | {e['label']} {e['primary_method']} "
            f"(concurrency {c}) |", "|---|---:|---:|",
            f"| speedup | {_x(r['speedup'])} | {_x(row['speedup'])} |",
            f"| tokens/s target-only | {b['tokens_per_s']:.1f} | {_x(row['baseline_tokens_per_s'], '.1f')} |",
            f"| tokens/s speculative | {s['tokens_per_s']:.1f} | {_x(row['speculative_tokens_per_s'], '.1f')} |",
            f"| acceptance rate | {s['acceptance_rate']:.3f} | {_x(row['acceptance_rate'])} |",
            f"| mean accepted tokens (tau) | {s['mean_accepted_tokens']:.3f} | {_x(row['mean_accepted_tokens'])} |",
            f"| per-position acceptance | {pos} | {epos} |",
            f"| TTFT p50 (ms) | {_ms(s['ttft_s']['p50'])} | {_ms(row['speculative_ttft_p50_s'])} |"]


def _equivalence_lines(eq: dict, label: str) -> list[str]:
    if eq["mode"] == "sampling":
        out = [f"Sampling: {eq['note']}", ""]
        if eq.get("tests"):
            out += ["| test | N | chi2 | dof | p | TV | TV max | rounds | ok |",
                    "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
            out += [f"| {t['test']} | {t['samples']} | {t['chi2']:.1f} | {t['dof']} | {t['p_value']:.4f} | "
                    f"{t['tv']:.4f} | {t['tv_tolerance']:.4f} | {t['speculative_rounds']} | "
                    f"{'pass' if t['passed'] else 'FAIL'} |" for t in eq["tests"]]
        return out
    out = [f"Greedy: {label}-speculative equals {label}-target-only on {eq['checked'] - _pairs_mismatched(eq)} of "
           f"{eq['checked']} (prompt, method, level) pairs ({'passed' if eq['passed'] else 'FAILED'})."]
    if eq.get("target_only_across_levels"):
        x = eq["target_only_across_levels"]
        out.append(f"{label} target-only at concurrency {x['levels'][0]} and {x['levels'][1]}: {x['mismatches']} of "
                   f"{x['checked']} prompts differ (batch composition can change rounding; informative only).")
    if eq.get("vs_specdec"):
        x = eq["vs_specdec"]
        out.append(f"{label} target-only (concurrency {x['concurrency']}) against specdec's decoder: {x['mismatches']} "
                   f"of {x['checked']} prompts differ.")
    if eq.get("mismatched_prompts"):
        out += ["", "| prompt | method | concurrency | first differing position | target-only | speculative |",
                "|---|---|---:|---:|---:|---:|"]
        out += [f"| {m['prompt_id']} | {m['method']} | {m['concurrency']} | {m['position']} | {m['baseline_token']} | "
                f"{m['speculative_token']} |" for m in eq["mismatched_prompts"]]
    return out


def _pairs_mismatched(eq: dict) -> int:
    return eq["mismatches"] - ((eq.get("vs_specdec") or {}).get("mismatches") or 0)


def to_markdown(r: dict) -> str:
    """report.md for engine=vllm alone."""
    cfg, d = r["config"], r["decision"]
    lines = ["# Speculative decoding report (serving engine)", "",
             f"**Verdict: `{d['verdict']}`** — target `{cfg['target']}`, draft `{cfg['draft']}`, temperature "
             f"{cfg['temperature']}, top_k {cfg['top_k']}, top_p {cfg['top_p']}, seed {cfg['seed']}, prompts "
             f"`{cfg['prompts']}`.", "", "## Decision", "", "Thresholds were fixed in the config before the run.", "",
             *[f"- {reason}" for reason in d["reasons"]]]
    lines += markdown_lines(r)
    lines += ["", "## Environment", "", ", ".join(f"{k} {v}" for k, v in r["environment"].items())]
    return "\n".join(lines).rstrip() + "\n"


def _proposal(config: dict) -> str:
    """The decoder's chosen proposal in words: a chain's k, or a tree's shape."""
    return f"tree {config['tree']}" if config.get("tree") else f"k = {config['num_draft_tokens']}"
