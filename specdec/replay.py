"""Teacher-forced replay: how many tokens per round would a draft give on the target's own outputs?

Used by the trainer's held-out evaluation, `specdec eval`'s choice of k and `bench/distill.py --score`; every kind
of draft enters through `replay_runs` (and `target_states` for what it reads from the target besides tokens), which
ask the draft's kind (specdec/draft_kind.py) for its ranks (specdec/ranks.py).

Method (greedy speculative decoding, exact when the held-out completion is the target's greedy output):
let agree[i] say whether the draft's argmax at completion position i (given the prompt and the true
completion before i) equals the target's token there. A round that starts at position i proposes k tokens;
while they are accepted the draft's context *is* the true prefix, so the teacher-forced agreement of the
next position is exactly the acceptance test. The round therefore accepts a = the number of leading
agreements in agree[i : i + k], emits a + 1 tokens (the correction, or the bonus when a = k; fewer at the
end of the completion) and the next round starts at i + a + 1. tau(k) = tokens emitted / rounds over all
held-out completions, the same "mean accepted tokens" the decoder reports (docs/design.md).

Draft trees (specdec/tree.py) generalise the test from "the draft's first choice" to "within the draft's top w_j at
the round's j-th position": `replay_ranks` gives, for each round start and j, the rank of the target's token among
the draft's j-th proposals (teacher-forced: the accepted path is the true prefix), and a static tree of widths
w_1..w_D accepts the leading j with rank < w_j (`runs_from_ranks`); a chain is widths 1..1. `top_n_agreement`
summarises the ranks per position.

For completions sampled at temperature > 0 this is an estimate (the greedy path differs from the data).
For sampling-mode decoding the per-position alpha applies instead: `tau_from_alpha` gives the i.i.d.
closed form (1 - alpha^(k+1)) / (1 - alpha) of Leviathan et al. (2023).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from specdec import draft_registry


def greedy_rounds(agree: Sequence[bool], k: int) -> tuple[int, int]:
    """Simulate greedy speculative rounds over one completion: returns (rounds, tokens emitted)."""
    if k < 1:
        raise ValueError(f"k (num_draft_tokens) must be >= 1, got {k}")
    n, i, rounds, tokens = len(agree), 0, 0, 0
    while i < n:
        accepted = 0
        while accepted < k and i + accepted < n and agree[i + accepted]:
            accepted += 1
        emitted = min(accepted + 1, n - i)
        rounds, tokens, i = rounds + 1, tokens + emitted, i + emitted
    return rounds, tokens


def simulated_tau(agreements: Iterable[Sequence[bool]], ks: Iterable[int] = range(1, 9)) -> dict[int, float]:
    """Mean accepted tokens per round (tau) for each k, pooled over completions (0.0 when there are none)."""
    agreements = [list(a) for a in agreements]
    out: dict[int, float] = {}
    for k in ks:
        rounds = tokens = 0
        for agree in agreements:
            r, t = greedy_rounds(agree, k)
            rounds, tokens = rounds + r, tokens + t
        out[int(k)] = tokens / rounds if rounds else 0.0
    return out


def tau_from_alpha(alpha: float, k: int) -> float:
    """Expected tokens per round for i.i.d. per-token acceptance alpha: (1 - alpha^(k+1)) / (1 - alpha)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def per_position_agreement(agreements: Iterable[Sequence[bool]], k: int) -> list[float]:
    """P(draft token j accepted | tokens < j accepted), j = 1..k, from the simulated greedy rounds."""
    tried, passed = [0] * k, [0] * k
    for agree in agreements:
        agree, n, i = list(agree), len(agree), 0
        while i < n:
            accepted = 0
            while accepted < k and i + accepted < n:
                tried[accepted] += 1
                if not agree[i + accepted]:
                    break
                passed[accepted] += 1
                accepted += 1
            i += min(accepted + 1, n - i)
    return [p / t if t else 0.0 for p, t in zip(passed, tried)]


def runs_from_agreement(agree: Sequence[bool]) -> list[int]:
    """run[i] = how many agreements in a row start at position i (a plain draft's accepted run there)."""
    runs, count = [0] * len(agree), 0
    for i in range(len(agree) - 1, -1, -1):
        count = count + 1 if agree[i] else 0
        runs[i] = count
    return runs


def tau_from_runs(runs: Iterable[Sequence[int]], ks: Iterable[int] = range(1, 9)) -> dict[int, float]:
    """tau(k) from run lengths: a round starting at position i accepts min(run[i], k) (as `greedy_rounds`)."""
    runs = [list(r) for r in runs]
    out: dict[int, float] = {}
    for k in ks:
        rounds = tokens = 0
        for run in runs:
            n, i = len(run), 0
            while i < n:
                emitted = min(min(run[i], k) + 1, n - i)
                rounds, tokens, i = rounds + 1, tokens + emitted, i + emitted
        out[int(k)] = tokens / rounds if rounds else 0.0
    return out


def target_states(draft, target, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
    """What `draft` reads from `target` besides the tokens, for `replay_runs` (None for a plain draft)."""
    return draft_registry.of_model(draft).target_states(draft, target, input_ids, attention_mask)


@torch.no_grad()
def replay_ranks(draft, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                 steps: int, states: torch.Tensor | None = None) -> list[list[list[int]]]:
    """Per row, for each scored position i (loss_mask: logits position i predicts a completion token): the ranks
    [r_1..r_steps] of the target's tokens i + 1 .. i + steps among the draft's proposals at positions 1..steps of a
    round whose first proposal is token i + 1, the round having accepted the true tokens before (RANK_CAP past the
    completion's end), as the draft's kind computes them."""
    return draft_registry.of_model(draft).replay_ranks(draft, input_ids, attention_mask, loss_mask, steps, states)


def runs_from_ranks(ranks: Iterable[Sequence[Sequence[int]]], widths: Sequence[int]) -> list[list[int]]:
    """Accepted run per round start of a static tree of `widths`: the leading j with rank_j < widths[j]."""
    runs = []
    for row in ranks:
        row_runs = []
        for position in row:
            run = 0
            while run < len(widths) and run < len(position) and position[run] < widths[run]:
                run += 1
            row_runs.append(run)
        runs.append(row_runs)
    return runs


def top_n_agreement(ranks: Iterable[Sequence[Sequence[int]]], ns: Sequence[int] = (1, 2, 4, 8)) -> list[dict]:
    """Per round position j: the share of round starts (whose j-th token lies in the completion) where the target's
    token is within the draft's top n, for each n: what a tree of width n at that depth would find."""
    flat = [position for row in ranks for position in row]
    steps = max((len(p) for p in flat), default=0)
    out = []
    for j in range(steps):
        # the last j round starts have no j-th completion token: RANK_CAP there is the end, not a miss
        reach = flat if j == 0 else [p for row in ranks for p in row[: len(row) - j]]
        out.append({str(n): (sum(p[j] < n for p in reach) / len(reach)) if reach else 0.0 for n in ns})
    return out


@torch.no_grad()
def replay_runs(draft, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                steps: int, states: torch.Tensor | None = None) -> list[list[int]]:
    """Per row, for each scored position i: how many proposals in a row (up to `steps`) a greedy round whose
    first proposal is token i + 1 would have accepted, the data being the target's greedy output."""
    return runs_from_ranks(replay_ranks(draft, input_ids, attention_mask, loss_mask, steps, states), [1] * steps)
