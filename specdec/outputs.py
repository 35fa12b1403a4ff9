"""What a decoder call returns: its sequences, its counters (`DecodeStats`) and, when asked, its rounds.

`DecodeStats` observes one verification round at a time (`observe_round`) and merges several calls' counters
(`merged`, optionally weighted); every rate a report shows is a property here, defined once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.proposal import Proposal
from specdec.tree import Tree, describe_round

# The counters that add up over calls (`merged`); the rest (flags, shape, per-position lists) merge by their own rule.
_SUMMED = ("rounds", "row_rounds", "proposed", "accepted", "emitted", "corrections", "bonus", "target_forwards",
           "draft_forwards", "tree_nodes")


@dataclass
class DecodeStats:
    """Counts over all rounds and unfinished rows; names as in docs/design.md."""

    depth: int = 0  # draft tokens a round can accept at most: k for a chain, a tree's depth
    rounds: int = 0  # verification forwards of the target (batch-wide)
    row_rounds: int = 0  # rounds x rows still generating: the denominator of the per-row means
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens appended during rounds (corrections and bonuses included)
    corrections: int = 0
    bonus: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    position_tried: list[int] = field(default_factory=list)  # [depth] rounds that reached draft position i
    position_accepted: list[int] = field(default_factory=list)  # [depth] ... and accepted it
    fallback: bool = False
    fallback_reason: str | None = None
    tree: str | None = None  # the tree shape (specdec/tree.py), None for a chain
    tree_nodes: int = 0  # nodes verified over all rounds (a chain's: proposed)

    @classmethod
    def for_proposal(cls, proposal: Proposal) -> DecodeStats:
        d = proposal.depth
        return cls(depth=d, position_tried=[0] * d, position_accepted=[0] * d,
                   tree=str(proposal.tree) if proposal.is_tree else None)

    def observe_round(self, accepted: Sequence[int], depth: int, nodes: int | None = None) -> None:
        """One verification round: `accepted` draft tokens per unfinished row, out of `depth` proposed each.

        A tree round counts its depth as proposed (acceptance = accepted / depth) and its verified `nodes`."""
        self.rounds += 1
        self.row_rounds += len(accepted)
        self.proposed += depth * len(accepted)
        self.tree_nodes += depth * len(accepted) if nodes is None else nodes
        self.accepted += sum(accepted)
        for n in accepted:
            self.bonus += n == depth
            self.corrections += n < depth
            for i in range(min(n + 1, depth)):
                self.position_tried[i] += 1
                self.position_accepted[i] += i < n

    @classmethod
    def merged(cls, parts: Sequence[DecodeStats], weights: Sequence[float] | None = None) -> DecodeStats:
        """The counters of several calls summed, each weighted (e.g. the share of a batch's rows a category
        holds; the counts are then fractional): the rates of the result are the rates over all of them."""
        weights = [1.0] * len(parts) if weights is None else list(weights)
        out = cls(depth=max((p.depth for p in parts), default=0),
                  tree=next((p.tree for p in parts if p.tree), None))
        out.position_tried, out.position_accepted = [0] * out.depth, [0] * out.depth
        for part, w in zip(parts, weights):
            for name in _SUMMED:
                setattr(out, name, getattr(out, name) + w * getattr(part, name))
            for i, (tried, accepted) in enumerate(zip(part.position_tried, part.position_accepted)):
                out.position_tried[i] += w * tried
                out.position_accepted[i] += w * accepted
            out.fallback = out.fallback or part.fallback
            out.fallback_reason = out.fallback_reason or part.fallback_reason
        return out

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """tau: tokens emitted per round per row, the correction or bonus token included."""
        return self.emitted / self.row_rounds if self.row_rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float | None]:
        """P(draft token i accepted | tokens < i accepted), i = 1..depth; None where no round reached position i
        (a rate of nothing is unknown, not 0: every round rejected earlier, or none could propose that far)."""
        return [a / t if t else None for a, t in zip(self.position_accepted, self.position_tried)]

    @property
    def nodes_per_round(self) -> float:
        """Draft tokens verified per round (a chain's: k per row)."""
        return self.tree_nodes / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "per_position_acceptance": self.per_position_acceptance,
            "corrections": self.corrections,
            "bonus": self.bonus,
            "emitted": self.emitted,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "fallback": self.fallback,
            "fallback_reason": self.fallback_reason,
            "tree": self.tree,
            "tree_nodes": self.tree_nodes,
        }


NOT_REACHED = "—"  # a per-position rate where no round reached the position (null in report.json)


def position_rates(rates: Sequence[float | None], digits: int = 3, numbered: bool = True) -> str:
    """Per-position rates as text ("1: 0.812, 2: 0.500, 3: —"), NOT_REACHED where no round reached a position:
    report.md's and the engine section's one spelling of `per_position_acceptance`."""
    cells = [NOT_REACHED if a is None else f"{a:.{digits}f}" for a in rates]
    return ", ".join(f"{i + 1}: {c}" if numbered else c for i, c in enumerate(cells))


@dataclass
class RoundTrace:
    """One round, per row: what was proposed, how much was accepted, and the target's own token."""

    proposed: torch.Tensor  # [B, k]
    num_accepted: torch.Tensor  # [B]
    next_token: torch.Tensor  # [B] correction (num_accepted < k) or bonus (== k)
    advanced: int  # T + 1 tokens appended to every row


@dataclass
class TreeTrace:
    """One tree round (batch 1): the tree, the accepted path (node indices) and the target's own token."""

    tree: Tree
    path: list[int]
    next_token: int  # correction (no child matched) or bonus (a leaf was reached)
    advanced: int

    def describe(self, decode=str) -> str:
        """The tree, the accepted path (*) and the correction or bonus, as text (`decode`: id -> str)."""
        return describe_round(self.tree, self.path, self.next_token, decode)


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, prompt_len + new] rows padded after their EOS
    stats: DecodeStats
    prompt_length: int
    trace: list[RoundTrace | TreeTrace] = field(default_factory=list)
    # (seconds since the call began, tokens appended to each row) after the first token and each step;
    # filled when timing=True (device-synchronised), for TTFT and inter-token latency.
    timings: list[tuple[float, int]] = field(default_factory=list)
    # target_generate(top_logprobs=n): the target's n most likely ids and their log-softmax (raw logits,
    # temperature 1, no warping) at each generated position, [B, new, n]; None otherwise.
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    # target_generate(drop_finished=True): the rows (places in the batch) each decoding step after the prefill ran;
    # None when every step ran every row.
    step_rows: list[torch.Tensor] | None = None
