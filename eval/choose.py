"""choose_k: before any timed run, pick the proposal (a chain of k, or a static tree) with the best predicted speedup
tau / (d c + v(n+1)), every term measured here (eval/proposals.py: d draft forwards, n verified nodes per round)."""

from __future__ import annotations

import logging

import torch

from specdec import draft_registry, replay
from specdec.decode import target_generate
from specdec.eval import decision as decision_mod
from specdec.eval import metrics, proposals
from specdec.eval.config import EvalConfig
from specdec.eval.rows import accounted
from specdec.eval.timing import measure_costs
from specdec.proposal import Proposal

log = logging.getLogger(__name__)


def choose_num_draft_tokens(target, draft, prompts: list[list[int]], candidates: list[Proposal], cfg: EvalConfig,
                            eos, pad, device: torch.device, longest_prompt: int | None = None) -> dict:
    """Pick k (or a static tree) by predicted speedup: the fastest candidate that passes the config's thresholds,
    or the fastest overall when none does (eval/decision.py: prefer_passing).

    tau comes from the draft teacher-forced on the target's own outputs for `prompts`: greedy rounds replayed
    exactly from the ranks of the target's tokens among the draft's proposals (specdec/replay.py, for any kind of
    draft). Under sampling the target's sampled output and the draft's ranking give an estimate, not the exact
    figure. c and v are timed as in the report. The gates are held to these figures: the acceptance rate (tau - 1)
    / d, the predicted speedup, and the accounted memory for prompts of up to `longest_prompt` tokens (default:
    the longest of `prompts`); equivalence and fallback are judged on the timed run only.

    The returned dict is report.json's `choose_k`: proposals as their JSON values, figures keyed by label.
    """
    ranks = _replayed_ranks(target, draft, prompts, max(p.depth for p in candidates), cfg, eos, pad, device)
    tau = {p: proposals.replayed_tau(ranks, p) for p in candidates}
    nodes = sorted({p.verified_nodes for p in candidates})
    costs = measure_costs(target, draft, torch.tensor([prompts[0]], device=device), nodes, cfg.cost_repeats)
    kind = draft_registry.of_model(draft)
    predicted = {p: proposals.predicted_speedup(tau[p], p, costs["c"], costs["v"], kind.draft_forwards(p))
                 for p in candidates}
    # a round emits its accepted tokens plus one correction or bonus token, and proposes d
    acceptance = {p: (tau[p] - 1.0) / p.depth for p in candidates}
    longest = longest_prompt or max(map(len, prompts))
    mem = {p: accounted(cfg, target, draft, longest, p) for p in candidates}
    failed = {p: decision_mod.failed_gates(decision_mod.threshold_checks(
        acceptance[p], predicted[p], mem[p]["overhead_mb"], mem[p]["target_only_mb"], cfg.thresholds()))
        for p in candidates}
    chosen, fastest = decision_mod.prefer_passing(candidates, lambda p: (-predicted[p], p.verified_nodes), failed)
    chains = [p for p in candidates if not p.is_tree]
    best_chain = max(chains, key=lambda p: (predicted[p], -p.k)) if chains else None
    log.info("choose_k: predicted speedup %s, failing %s -> %s (fastest %s)",
             {p.label: round(v, 3) for p, v in predicted.items()}, {p.label: f for p, f in failed.items() if f},
             chosen.label, fastest.label)

    def by_label(values: dict) -> dict:  # "k=2" / "tree=2": a one-level tree and the chain of its width share a text
        return {p.label: values[p] for p in candidates}

    return {"candidates": [p.value for p in candidates], "prompts": len(prompts),
            "tau": by_label(tau), "c": costs["c"], "v": costs["v"],
            "predicted_speedup": by_label(predicted), "acceptance_rate": by_label(acceptance),
            "memory_overhead_mb": by_label({p: m["overhead_mb"] for p, m in mem.items()}),
            "memory_limit_mb": by_label({p: m["limit_mb"] for p, m in mem.items()}),
            "gates_checked": ["acceptance_rate", "speedup", "memory"], "failed_gates": by_label(failed),
            "chosen": chosen.value, "fastest": fastest.value, "best_chain": None if best_chain is None else best_chain.value,
            "top_n_agreement": replay.top_n_agreement(ranks)}


def _replayed_ranks(target, draft, prompts, steps: int, cfg: EvalConfig, eos, pad, device) -> list:
    """The ranks of the target's own tokens among the draft's proposals, teacher-forced, `steps` deep."""
    ranks = []
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=device)
            gen = torch.Generator(device=device).manual_seed(cfg.seed + i)
            out = target_generate(target, ids, None, cfg.sampling(), cfg.max_new_tokens, eos, gen, pad_token_id=pad)
            seq = out.sequences[:, : len(prompt) + metrics.generated_lengths(
                out.sequences[:, len(prompt):].tolist(), eos)[0]]
            if seq.shape[1] - len(prompt) < 2:
                continue
            # The first token comes from the target's prefill; rounds start after it, as in the decoder: logits
            # positions from len(prompt) on, each predicting the next completion token.
            mask = torch.ones_like(seq)
            scored = torch.zeros_like(seq, dtype=torch.bool)
            scored[0, len(prompt): seq.shape[1] - 1] = True
            states = replay.target_states(draft, target, seq, mask)
            ranks += replay.replay_ranks(draft, seq, mask, scored, steps, states)
    return ranks
