"""`specdec eval engine=vllm` (or `engine=specdec,vllm`): plan, measure in a serving engine, assemble and render.

The engine section of report.json (`engine`) holds every measured phase, the sweep table (target-only and
speculative in pairs per concurrency level), the equivalence in the engine, the sampling check where it runs,
the engine's own verdict, and what is missing when a server failed. With engine=specdec,vllm the decoder's
report keeps its keys and gains that section; with engine=vllm alone the top-level keys of the contract
(baseline, speculative, speedup, equivalence, decision) come from the engine at the lowest concurrency level.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from specdec.eval import equivalence, metrics, plots, report
from specdec.eval.decision import failed_gates
from specdec.eval.engine.client import request_body
from specdec.eval.engine.markdown import _has_specdec
from specdec.eval.engine.metrics import acceptance, phase_metrics
from specdec.eval.engine.probe import exact_first_two, judge_first_two
from specdec.eval.engine.server import EngineError
from specdec.eval.engine.sweep import TARGET_ONLY, Plan, ServedWorkload, run_sweep
from specdec.eval.plots import _plt
from specdec.eval.verify import first_turn, resolve_prompts_path
from specdec.models import checkpoint_context, load_tokenizer, resolve_device
from specdec.prompts import check_prompt_lengths, encode_prompt, read_prompts

log = logging.getLogger(__name__)

# Said only when measured: the control passed and a speculative server failed the sampling check.
ENGINE_FAULT = ("The target-only control passed and a speculative server failed: an exact rejection sampler keeps "
                "the target's law whatever the draft, so the failure is the engine's, not the draft's "
                "(docs/usage.md lists the engine faults known so far).")


def _workload(cfg):
    """The prompts and their token ids, exactly as specdec's own eval encodes them, each checked to fit the models'
    contexts (read from their configs) before any server starts."""

    path = resolve_prompts_path(cfg.prompts)
    prompts = read_prompts(path, limit=cfg.num_prompts)
    tokenizer = load_tokenizer(cfg.target)
    encoded = [encode_prompt(tokenizer, first_turn(p.messages), cfg.use_chat_template, cfg.chat_template_kwargs,
                             p.tools) for p in prompts]
    if any(len(e) == 0 for e in encoded):
        raise ValueError("a prompt encodes to zero tokens; remove empty prompts from the file")
    contexts = {"the target": checkpoint_context(cfg.target)}
    if cfg.draft:
        contexts["the draft"] = checkpoint_context(cfg.draft)
    check_prompt_lengths(prompts, encoded, cfg.max_new_tokens, contexts, path)
    return prompts, encoded


def _sweep(engine, cfg, plan: Plan, k: int, encoded: list[list[int]], out_dir: Path):
    """The sampling check's exact law (when sampling), then every phase in the engine's servers."""
    sampling = cfg.sampling()
    probe = None
    if not sampling.greedy and cfg.equivalence_samples:
        probe = exact_first_two(cfg.target, plan.dtype, encoded[0], sampling, cfg.equivalence_samples)
    seeds = [cfg.seed + i for i in range(len(encoded))] if not sampling.greedy else None
    work = ServedWorkload(encoded, request_body(sampling, cfg.max_new_tokens), seeds, cfg.concurrency, cfg.warmup, k,
                    cfg.seed)
    servers = engine.servers(cfg, plan, [TARGET_ONLY, *plan.methods], k, out_dir)
    return run_sweep(servers, plan, work, probe, sampling), probe


def run(engine, cfg, specdec_run=None) -> dict:
    """The evaluation in serving engine `engine` (eval/engine: ServingEngine), after specdec's decoder when
    `specdec_run` is given; writes the report."""
    prompts, encoded = _workload(cfg)  # first: a prompt that cannot fit fails before any model or server starts
    plan = engine.prepare(cfg)
    out_dir = cfg.out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    result = specdec_run(cfg) if specdec_run is not None else None
    # a tree recommended by specdec: vLLM measures the chain of its depth
    k = (result["config"]["num_draft_tokens"] or result["config"]["tree_depth"]) if result is not None else (
        cfg.num_draft_tokens[0])
    sweep, probe = _sweep(engine, cfg, plan, k, encoded, out_dir)
    fatal = sweep.pop("fatal", None)
    if fatal is not None and not sweep["phases"] and result is None:
        raise fatal  # nothing measured: the error (with the engine's own message) is the whole story
    specdec_tokens = _specdec_baseline(out_dir) if result is not None else None
    section = assemble(engine, cfg, plan, k, prompts, sweep, probe, specdec_tokens)
    _write_engine_samples(out_dir / "engine_samples.jsonl", prompts, sweep["phases"])
    if result is None:
        result = engine_only_result(cfg, plan, prompts, section)
        _write_samples(out_dir / "samples.jsonl", prompts, sweep["phases"], section["primary_method"],
                       min(cfg.concurrency))
    else:
        result["config"]["engine"] = cfg.engine
        result["engine"] = section
        _merge_decision(result["decision"], section)
    section["plots"] = make_plots(result, out_dir, cfg.plot_format)
    report.write(result, out_dir)
    if not section["complete"]:
        raise EngineError(f"the engine run is incomplete; the report in {out_dir} keeps what finished and lists "
                          f"what is missing ({'; '.join(section['missing'][:6]) or 'see errors'}). First error: "
                          f"{section['errors'][0]['error'] if section['errors'] else 'none'}")
    return result


def _specdec_baseline(out_dir: Path) -> dict[str, list[int]] | None:
    """specdec's target-only tokens per prompt id, from the samples.jsonl its run just wrote."""
    path = out_dir / "samples.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {str(r["prompt_id"]): r["baseline_tokens"] for r in rows}


# ---------------------------------------------------------------- assembling the engine section


def _tokens(phase) -> dict[int, list[int]]:
    return {r.index: r.tokens for r in phase.requests if not r.error}


def _compare(prompts, a: dict[int, list[int]], b: dict[int, list[int]]) -> dict:
    common = sorted(set(a) & set(b))
    return equivalence.greedy_equivalence([prompts[i].prompt_id for i in common], [a[i] for i in common],
                                          [b[i] for i in common])


def _greedy(cfg, prompts, phases: dict, methods: list[str], specdec_tokens) -> dict:
    """vLLM-speculative against vLLM-target-only per method and level, and target-only against specdec's decoder."""
    by_method: dict = {}
    listed, checked, mismatches = [], 0, 0
    for m in methods:
        for c in cfg.concurrency:
            if (TARGET_ONLY, c) not in phases or (m, c) not in phases:
                continue
            eq = _compare(prompts, _tokens(phases[(TARGET_ONLY, c)]), _tokens(phases[(m, c)]))
            by_method.setdefault(m, {})[str(c)] = {k: eq[k] for k in ("passed", "checked", "mismatches")}
            checked, mismatches = checked + eq["checked"], mismatches + eq["mismatches"]
            listed += [{**x, "method": m, "concurrency": c} for x in eq["mismatched_prompts"]]
    out = {"mode": "greedy", "checked": checked, "mismatches": mismatches, "mismatched_prompts": listed[:20],
           "by_method": by_method, "vs_specdec": None}
    base = [(c, phases[(TARGET_ONLY, c)]) for c in cfg.concurrency if (TARGET_ONLY, c) in phases]
    if len(base) > 1:  # the engine against itself across levels (batch composition may change rounding)
        eq = _compare(prompts, _tokens(base[0][1]), _tokens(base[-1][1]))
        out["target_only_across_levels"] = {"levels": [base[0][0], base[-1][0]],
                                            **{k: eq[k] for k in ("passed", "checked", "mismatches")}}
    if specdec_tokens is not None and base:
        ids = {p.prompt_id: i for i, p in enumerate(prompts)}
        ours = {ids[pid]: toks for pid, toks in specdec_tokens.items() if pid in ids}
        eq = _compare(prompts, ours, _tokens(base[0][1]))
        out["vs_specdec"] = {"concurrency": base[0][0], **eq}
        mismatches += eq["mismatches"]
    out["passed"] = checked > 0 and mismatches == 0
    return out


def _sampling(engine, probe, sweep: dict, sampling, concurrency: int) -> dict:
    """The sampling check's verdict; its note says what the engine lets it see, and whose fault a failure is when
    the run shows it."""
    note = engine.sampling_note
    if probe is None:
        return {"mode": "sampling", "passed": None, "checked": 0, "mismatches": 0,
                "note": note + " (skipped: equivalence_samples=0)"}
    if not sweep["draws"]:
        return {"mode": "sampling", "passed": None, "checked": 0, "mismatches": 0, "note": note}
    check = judge_first_two(probe, sweep["draws"], sampling, concurrency, engine.label)
    control = [t["passed"] for t in check["tests"] if t["test"].endswith(f" {TARGET_ONLY} vs exact")]
    if control == [True] and not check["passed"]:
        note += " " + ENGINE_FAULT
    return {"mode": "sampling", "passed": check["passed"], "checked": sum(t["samples"] for t in check["tests"]),
            "mismatches": sum(not t["passed"] for t in check["tests"]), "tests": check["tests"], "note": note}


def assemble(engine, cfg, plan: Plan, k: int, prompts, sweep: dict, probe, specdec_tokens) -> dict:
    """The report's `engine` section."""
    phases = {(p.mode, p.concurrency): p for p in sweep["phases"]}
    figures = {}
    for key, phase in phases.items():
        figures[key] = phase_metrics(phase)
        if key[0] != TARGET_ONLY and phase.counters is not None:
            figures[key].update(acceptance(phase.counters, k))
        rss = sweep["servers"].get(key[0], {}).get("peak_rss_mb")
        figures[key]["peak_memory_mb"] = rss
    sampling = cfg.sampling()
    eq = _greedy(cfg, prompts, phases, plan.methods, specdec_tokens) if sampling.greedy else \
        _sampling(engine, probe, sweep, sampling, max(cfg.concurrency))
    rows = [_row(c, m, figures, eq) for c in cfg.concurrency for m in plan.methods if (m, c) in figures]
    complete = not sweep["missing"] and not sweep["errors"]
    primary = plan.methods[0]
    section = {
        "name": engine.name, "label": engine.label, "version": plan.version, "distribution": plan.distribution,
        "python": plan.python, "methods": plan.methods, "primary_method": primary,
        "num_draft_tokens": k, "concurrency": cfg.concurrency, "dtype": plan.dtype,
        "max_new_tokens": cfg.max_new_tokens, "num_prompts": len(prompts), "warmup": cfg.warmup,
        "side_by_side": sweep["side_by_side"], **engine.report_fields(cfg, plan, k), "servers": sweep["servers"],
        "phases": [figures[(p.mode, p.concurrency)] for p in sweep["phases"]],
        "sweep": rows, "equivalence": eq,
        "complete": complete, "missing": sweep["missing"], "errors": sweep["errors"],
    }
    section["decision"] = engine_decision(cfg, section)
    return section


def _row(c: int, method: str, figures: dict, eq: dict) -> dict:
    """One line of the sweep table: target-only and `method` at concurrency c, in pairs."""
    b, s = figures.get((TARGET_ONLY, c)), figures[(method, c)]
    # The same workload on both sides only when every request finished on both.
    paired = b is not None and not b["failed"] and not s["failed"] and s["seconds"] > 0
    by = (eq.get("by_method") or {}).get(method, {}).get(str(c), {})

    def pair(name, pct):
        return {f"baseline_{name}_{pct}_s": b[f"{name}_s"][pct] if b else None,
                f"speculative_{name}_{pct}_s": s[f"{name}_s"][pct]}

    return {
        "concurrency": c, "method": method,
        "speedup": b["seconds"] / s["seconds"] if paired else None,
        "baseline_tokens_per_s": b["tokens_per_s"] if b else None, "speculative_tokens_per_s": s["tokens_per_s"],
        **pair("ttft", "p50"), **pair("ttft", "p95"), **pair("tpot", "p50"), **pair("tpot", "p95"),
        **pair("latency", "p50"), **pair("latency", "p95"),
        "acceptance_rate": s.get("acceptance_rate"), "mean_accepted_tokens": s.get("mean_accepted_tokens"),
        "per_position_acceptance": s.get("per_position_acceptance"),
        "equivalence_passed": by.get("passed"), "mismatches": by.get("mismatches"),
    }


def engine_decision(cfg, engine: dict) -> dict:
    """The engine's verdict for its primary method at the lowest concurrency: the decoder's thresholds, the
    equivalence in the engine, and a complete run (memory is not part of it: the servers are separate processes)."""
    t = cfg.thresholds()
    c = min(cfg.concurrency)
    row = next((r for r in engine["sweep"] if r["method"] == engine["primary_method"] and r["concurrency"] == c), None)
    acc = row["acceptance_rate"] if row and row["acceptance_rate"] is not None else None
    speedup = row["speedup"] if row else None
    eq = engine["equivalence"]["passed"]
    checks = {"acceptance_rate": acc is not None and acc >= t.min_acceptance_rate,
              "speedup": speedup is not None and speedup >= t.min_speedup,
              "equivalence": eq is True, "complete": engine["complete"]}
    ok = {True: "ok", False: "FAILS"}
    reasons = [
        f"{engine['primary_method']} at concurrency {c}: acceptance rate "
        + (f"{acc:.3f} {'>=' if checks['acceptance_rate'] else '<'} {t.min_acceptance_rate:.3f}" if acc is not None
           else "not measured") + f" ({ok[checks['acceptance_rate']]})",
        "speedup " + (f"{speedup:.3f}x {'>=' if checks['speedup'] else '<'} {t.min_speedup:.3f}x" if speedup is not None
                      else "not measured (a phase is missing or had failed requests)") + f" ({ok[checks['speedup']]})",
        "equivalence in the engine " + ("passed (ok)" if eq else "not checked (FAILS: it must pass)" if eq is None
                                         else "failed (FAILS)"),
        "every phase measured (ok)" if checks["complete"] else
        f"incomplete: {len(engine['missing'])} phase(s) missing, {len(engine['errors'])} error(s) (FAILS)",
    ]
    return {"verdict": "enable" if all(checks.values()) else "keep-target-only", "reasons": reasons, "checks": checks,
            "failed_gates": failed_gates(checks)}


def _merge_decision(decision: dict, engine: dict) -> None:
    """engine=specdec,vllm: the decoder's verdict also needs the engine's output to be the target's."""
    passed = engine["equivalence"]["passed"]
    decision.setdefault("checks", {})["engine_equivalence"] = passed is True
    decision["reasons"].append(f"equivalence in {engine['label']} " + ("passed (ok)" if passed else "not checked (FAILS: it must pass)"
                                                         if passed is None else "failed (FAILS)"))
    if passed is not True:
        decision["verdict"] = "keep-target-only"
    decision["failed_gates"] = failed_gates(decision["checks"])


def engine_only_result(cfg, plan: Plan, prompts, engine: dict) -> dict:
    """engine=vllm alone: the contract's top-level keys from the engine at the lowest concurrency level."""


    c = min(cfg.concurrency)
    by_key = {(p["mode"], p["concurrency"]): p for p in engine["phases"]}
    base = by_key.get((TARGET_ONLY, c), {})
    spec = by_key.get((engine["primary_method"], c), {})
    row = next((r for r in engine["sweep"] if r["method"] == engine["primary_method"] and r["concurrency"] == c), {})
    env = metrics.environment(resolve_device(cfg.device)) | {engine["name"]: f"{plan.version} ({plan.distribution})"}
    config = {
        "target": cfg.target, "draft": cfg.draft, "num_draft_tokens": engine["num_draft_tokens"],
        "temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens,
        "batch_size": c, "seed": cfg.seed, "num_prompts": len(prompts), "warmup": cfg.warmup, "prompts": cfg.prompts,
        "use_chat_template": cfg.use_chat_template, "dtype": plan.dtype, "engine": cfg.engine,
        "concurrency": cfg.concurrency, "thresholds": dataclasses.asdict(cfg.thresholds()),
    }
    eq = engine["equivalence"]
    return {"config": config, "environment": env, "baseline": base, "speculative": spec,
            "speedup": row.get("speedup"), "equivalence": {k: v for k, v in eq.items() if k != "by_method"},
            "decision": engine["decision"], "engine": engine}


def _write_engine_samples(path: Path, prompts, phases) -> None:
    with path.open("w") as f:
        for p in phases:
            for r in p.requests:
                f.write(json.dumps({"prompt_id": prompts[r.index].prompt_id, "mode": p.mode, "concurrency":
                                    p.concurrency, "tokens": r.tokens, "finish_reason": r.finish_reason,
                                    "error": r.error}) + "\n")


def _write_samples(path: Path, prompts, phases, method: str, c: int) -> None:
    """samples.jsonl of the contract, from the engine's target-only and primary method at concurrency c."""
    got = {p.mode: {r.index: r.tokens for r in p.requests if not r.error} for p in phases if p.concurrency == c}
    base, spec = got.get(TARGET_ONLY, {}), got.get(method, {})
    with path.open("w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"prompt_id": p.prompt_id, "category": p.category, "baseline_tokens": base.get(i),
                                "speculative_tokens": spec.get(i)}) + "\n")


# ---------------------------------------------------------------- report.md and plots


def make_plots(r: dict, out_dir: Path, fmt: str = "png") -> dict[str, str]:
    """Throughput, speedup, TTFT and TPOT against concurrency, and per-position acceptance (specdec beside vLLM)."""

    e = r["engine"]
    if not e["phases"]:
        return {}
    plt = _plt()
    files = {"engine_sweep": f"engine_sweep.{fmt}", "engine_per_position": f"engine_per_position.{fmt}"}
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    modes = [TARGET_ONLY, *e["methods"]]
    color = {mode: f"C{i}" for i, mode in enumerate(modes)}
    for mode in modes:
        pts = sorted(((p["concurrency"], p) for p in e["phases"] if p["mode"] == mode), key=lambda x: x[0])
        if not pts:
            continue
        cs = [c for c, _ in pts]
        for ax, values in ((axes[0, 0], [p["tokens_per_s"] for _, p in pts]),
                           (axes[1, 0], [1e3 * (p["ttft_s"]["p50"] or 0) for _, p in pts]),
                           (axes[1, 1], [1e3 * (p["tpot_s"]["p50"] or 0) for _, p in pts])):
            ax.plot(cs, values, marker="o", label=mode, color=color[mode])
    for m in e["methods"]:
        pts = sorted((x["concurrency"], x["speedup"]) for x in e["sweep"] if x["method"] == m and x["speedup"])
        if pts:
            axes[0, 1].plot([c for c, _ in pts], [s for _, s in pts], marker="o", label=f"{e['label']} {m}",
                            color=color[m])
    if _has_specdec(r):
        axes[0, 1].axhline(r["speedup"], color="black", linestyle="--", linewidth=1,
                           label=f"specdec decoder (batch {r['config']['batch_size']})")
    axes[0, 1].axhline(1.0, color="grey", linewidth=0.8)
    for ax, title in zip(axes.flat, ("tokens/s", "speedup over target-only", "TTFT p50 (ms)", "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(e["concurrency"], [str(c) for c in e["concurrency"]])
        ax.set_xlabel("concurrency")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"{e['label']} {e['version']}, k = {e['num_draft_tokens']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / files["engine_sweep"], dpi=110)
    plt.close(fig)

    bars = [(f"{e['label']} {x['method']}, c={x['concurrency']}", x["per_position_acceptance"]) for x in e["sweep"]
            if x["per_position_acceptance"] and x["concurrency"] == min(e["concurrency"])]
    if _has_specdec(r):
        bars.insert(0, ("specdec decoder", r["speculative"]["per_position_acceptance"]))
    plots.acceptance_bars(bars, out_dir / files["engine_per_position"])
    return files
