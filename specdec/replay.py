"""Teacher-forced replay: how many tokens per round would a draft give on the target's own outputs?

Used by the trainer's held-out evaluation, `specdec eval`'s choice of k and `bench/distill.py --score`; every kind
of draft enters through `replay_runs` (and `target_states` for what it reads from the target besides tokens).

Method (greedy speculative decoding, exact when the held-out completion is the target's greedy output):
let agree[i] say whether the draft's argmax at completion position i (given the prompt and the true
completion before i) equals the target's token there. A round that starts at position i proposes k tokens;
while they are accepted the draft's context *is* the true prefix, so the teacher-forced agreement of the
next position is exactly the acceptance test. The round therefore accepts a = the number of leading
agreements in agree[i : i + k], emits a + 1 tokens (the correction, or the bonus when a = k; fewer at the
end of the completion) and the next round starts at i + a + 1. tau(k) = tokens emitted / rounds over all
held-out completions, the same "mean accepted tokens" the decoder reports (DESIGN.md).

For completions sampled at temperature > 0 this is an estimate (the greedy path differs from the data).
For sampling-mode decoding the per-position alpha applies instead: `tau_from_alpha` gives the i.i.d.
closed form (1 - alpha^(k+1)) / (1 - alpha) of Leviathan et al. (2023).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


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
    """What `draft` reads from `target` besides the tokens, for `replay_runs`: None for a plain draft."""
    read = getattr(draft, "read_target", None)
    return None if read is None else read(target, input_ids, attention_mask)


@torch.no_grad()
def replay_runs(draft, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                steps: int, states: torch.Tensor | None = None) -> list[list[int]]:
    """Per row, for each scored position i (loss_mask: logits position i predicts a completion token): how many
    proposals in a row (up to `steps`) a greedy round whose first proposal is token i + 1 would have accepted, the
    data being the target's greedy output. A draft class with its own scheme provides `replay_runs`."""
    own = getattr(draft, "replay_runs", None)
    if own is not None:
        return own(input_ids, attention_mask, loss_mask, steps, states)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = draft(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
    guess = logits.argmax(-1)  # [B, S]
    id_map = getattr(draft, "draft_to_target", None)
    guess = guess if id_map is None else id_map.to(guess.device)[guess]
    agree = guess[:, :-1] == input_ids[:, 1:]  # logits position t proposes token t + 1
    runs = []
    for row_agree, row_scored in zip(agree.tolist(), loss_mask[:, :-1].tolist()):
        scored = [a for a, s in zip(row_agree, row_scored) if s]
        runs.append([min(r, steps) for r in runs_from_agreement(scored)])
    return runs
