"""One row of the report per (proposal, batch size): the timed calls' figures for both modes, the decoder's counters
merged (specdec/outputs.py: DecodeStats), the memory gate's figures, the equivalence, the decision and the choice
among the rows."""

from __future__ import annotations

import logging

from specdec.eval import decision as decision_mod
from specdec.eval import equivalence, intervals, memory, metrics
from specdec.eval.config import EvalConfig
from specdec.eval.measure import Call
from specdec.eval.verify import check_pair
from specdec.outputs import DecodeStats
from specdec.proposal import Proposal

log = logging.getLogger(__name__)


def accounted(cfg: EvalConfig, target, draft, longest_prompt: int, proposal: Proposal, batch: int | None = None) -> dict:
    """The memory gate's figures for one proposal: the draft's accounted overhead and target-only's, in bytes per
    item (eval/memory.py), their totals in MB and the limit fixed by the config. `batch` defaults to the run's
    largest (a tree decodes one prompt at a time)."""
    batch = batch or (1 if proposal.is_tree else max(cfg.batch_size))
    draft_side = memory.draft_overhead(draft, target, longest_prompt, cfg.max_new_tokens, proposal.verified_nodes,
                                       batch)
    target_side = memory.target_only(target, longest_prompt, cfg.max_new_tokens, batch)
    target_mb = target_side["total"] / memory.MB
    return {"accounted": draft_side, "target_only": target_side, "overhead_mb": draft_side["total"] / memory.MB,
            "target_only_mb": target_mb, "limit_mb": cfg.thresholds().memory_limit_mb(target_mb)}


def proposal_keys(p: Proposal) -> dict:
    """How report.json names a proposal: `num_draft_tokens` the chain's length (None for a tree), `tree` the
    tree's shape and `tree_depth` its depth (None for a chain), `proposal` the label ("k=2", "tree=3x1x1")."""
    return {"num_draft_tokens": None if p.is_tree else p.k, "tree": p.value if p.is_tree else None,
            "tree_depth": p.depth if p.is_tree else None, "proposal": p.label}


def config_row(cfg, prompts, calls: list[Call], p: Proposal, b: int, cost: dict, mem: dict) -> dict:
    """Every figure of one (proposal, batch size) configuration, from all the calls of the run."""
    base = [c for c in calls if c.batch_size == b and c.proposal is None]
    spec = [c for c in calls if c.batch_size == b and c.proposal == p]
    bm, sm = _mode_metrics(base), _mode_metrics(spec)
    st = spec_summary(DecodeStats.merged([c.stats for c in spec]))
    sm.update(st)
    by_row_base = {r: t for c in base for r, t in zip(c.rows, c.tokens)}
    by_row_spec = {r: t for c in spec for r, t in zip(c.rows, c.tokens)}
    # Peak memory per batch of prompts, to pair each speculative call with the baseline call on the same batch.
    by_group_base, by_group_spec = ({tuple(c.rows): c.peak_mb for c in mode} for mode in (base, spec))
    groups = sorted(by_group_base)
    order = sorted(by_row_base)
    eq = equivalence.greedy_equivalence([prompts[i].prompt_id for i in order], [by_row_base[i] for i in order],
                                        [by_row_spec[i] for i in order])
    v = cost["v"][str(p.verified_nodes)]
    return {
        **proposal_keys(p), "batch_size": b,
        "baseline": bm, "speculative": sm,
        "speedup": metrics.speedup(bm["seconds"], sm["seconds"]),
        "analytical_speedup": metrics.analytical_speedup(_reached(st["per_position_acceptance"]), cost["c"], v),
        "expected_tokens_per_round": metrics.expected_tokens_per_round(_reached(st["per_position_acceptance"])),
        "cost": {"c": cost["c"], "v": v},
        # the gate reads the accounted overhead_mb; the measured peaks' figure is informational (it moves between runs)
        "memory": {**mem, "rss_overhead_mb": metrics.memory_overhead_mb(
            [by_group_base[g] for g in groups], [by_group_spec[g] for g in groups],
            mem["draft_weights_mb"] + mem["draft_packed_mb"])},
        "equivalence": eq,
        "categories": _categories(prompts, base, spec),
        "intervals": intervals.bootstrap(base, spec, seed=cfg.seed),
        "samples": [(prompts[i].prompt_id, prompts[i].category, by_row_base[i], by_row_spec[i]) for i in order],
    }


def _reached(rates: list[float | None]) -> list[float]:
    """Per-position rates for the analytic model. A position no round reached (None: every round stopped before
    it) adds no expected token, so it counts as 0 there; the report keeps it None."""
    return [0.0 if a is None else a for a in rates]


def _mode_metrics(calls: list[Call]) -> dict:
    latencies, ttfts, itls = [], [], []
    for c in calls:
        ttft, itl = metrics.ttft_and_itl(c.timings)
        latencies += [c.seconds] * len(c.rows)  # every request of a batch waits for the whole batch
        if ttft is not None:
            ttfts += [ttft] * len(c.rows)
        itls += itl
    seconds = sum(c.seconds for c in calls)
    tokens = sum(len(t) for c in calls for t in c.tokens)
    return {
        "tokens_per_s": metrics.tokens_per_second(tokens, seconds),
        "latency_s": metrics.percentiles(latencies, (50, 95, 99)),
        "ttft_s": metrics.percentiles(ttfts, (50, 95)),
        "itl_s": metrics.percentiles(itls, (50, 95)),
        "peak_memory_mb": max(c.peak_mb for c in calls),
        "seconds": seconds,
        "tokens": tokens,
        "latencies": latencies,  # dropped from the report; kept for the CDF plot
    }


def spec_summary(stats: DecodeStats) -> dict:
    """The report's speculative counters: DecodeStats' rates, and its (possibly weighted) counts rounded."""
    return {
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_tokens": stats.mean_accepted_tokens,
        "per_position_acceptance": stats.per_position_acceptance,
        **{n: int(round(getattr(stats, n))) for n in ("rounds", "proposed", "accepted", "corrections", "bonus")},
        "nodes_per_round": stats.nodes_per_round,
        "fallback": stats.fallback,
    }


def _categories(prompts, base: list[Call], spec: list[Call]) -> dict:
    """Per-category figures; a batch's time and counters are shared equally among its rows."""
    cats = {i: p.category for i, p in enumerate(prompts)}
    if all(c is None for c in cats.values()):
        return {}
    out = {}
    for cat in sorted({c for c in cats.values() if c is not None}):
        def share(calls, cat=cat):
            secs, toks, weights = 0.0, 0, []
            for c in calls:
                mine = [j for j, r in enumerate(c.rows) if cats[r] == cat]
                secs += c.seconds * len(mine) / len(c.rows)
                toks += sum(len(c.tokens[j]) for j in mine)
                weights.append(len(mine) / len(c.rows))
            return secs, toks, weights

        b_s, b_t, _ = share(base)
        s_s, s_t, w = share(spec)
        st = DecodeStats.merged([c.stats for c in spec], w)
        out[cat] = {
            "prompts": sum(1 for c in cats.values() if c == cat),
            "baseline_tokens_per_s": metrics.tokens_per_second(b_t, b_s),
            "speculative_tokens_per_s": metrics.tokens_per_second(s_t, s_s),
            "speedup": metrics.speedup(b_s, s_s) if s_s > 0 else 0.0,
            "acceptance_rate": st.acceptance_rate,
            "mean_accepted_tokens": st.mean_accepted_tokens,
        }
    return out


def judge(cfg: EvalConfig, rows: list[dict], target, draft, first_prompt: list[int]) -> None:
    """Fill each row's equivalence and decision."""
    if cfg.sampling().greedy:
        # A mismatch in any configuration means the decoder is not exact here: no configuration is enabled.
        all_passed = all(r["equivalence"]["passed"] for r in rows)
        for row in rows:
            row["equivalence"] = {**row["equivalence"], "all_configurations_passed": all_passed}
            row["equivalence"]["passed"] = row["equivalence"]["passed"] and all_passed
    else:
        check = None
        if cfg.equivalence_samples:
            log.info("sampling: checking the first two tokens' distribution on prompt 0 (%d draws)", cfg.equivalence_samples)
            check = check_pair(target, draft, [first_prompt], cfg.sampling(), cfg.equivalence_samples,
                               min(64, cfg.equivalence_samples), seed=cfg.seed, label=f"{cfg.target} + {cfg.draft}")
        eq = equivalence.sampling_equivalence(check)
        for row in rows:
            row["equivalence"] = eq
    for row in rows:
        row["decision"] = decision_mod.decide(
            row["speculative"]["acceptance_rate"], row["speedup"], row["equivalence"]["passed"],
            row["memory"]["overhead_mb"], row["memory"]["target_only_mb"], cfg.thresholds(),
            row["speculative"]["fallback"])


def recommend(rows: list[dict], by: str) -> tuple[dict, dict]:
    """(recommended, fastest): the best row by the chosen metric among those whose verdict is enable, and the best
    overall, which is also the recommended one when no row passes (ties: shallower proposal, then smaller batch)."""
    key = {
        "speedup": lambda r: -r["speedup"],
        "tokens_per_s": lambda r: -r["speculative"]["tokens_per_s"],
        "latency_p50": lambda r: r["speculative"]["latency_s"]["p50"],
        "latency_p95": lambda r: r["speculative"]["latency_s"]["p95"],
    }[by]
    index = list(range(len(rows)))  # rows are dicts (unhashable): choose among their positions
    chosen, fastest = decision_mod.prefer_passing(
        index, lambda i: (key(rows[i]), _depth(rows[i]), rows[i]["batch_size"]),
        {i: rows[i]["decision"]["failed_gates"] for i in index})
    return rows[chosen], rows[fastest]


def _depth(row: dict) -> int:
    """Draft tokens a round of the row's proposal can accept at most: k, or the tree's depth."""
    return row["tree_depth"] if row.get("tree") else row["num_draft_tokens"]
