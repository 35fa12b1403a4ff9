"""How eval weighs a proposal (specdec/proposal.py: a chain of k or a draft tree): the config's tree texts parsed,
the tau a teacher-forced replay predicts for it, and its predicted speedup."""

from __future__ import annotations

from specdec import replay
from specdec.proposal import Proposal


def normalise_trees(trees: list[str], setting: str = "tree") -> list[Proposal]:
    """The trees of a setting, parsed once, duplicates dropped; a width-1 tree is refused (it is the chain: list
    its depth as k)."""
    out: list[Proposal] = []
    for text in trees:
        proposal = Proposal.of(str(text))
        if not proposal.is_tree:
            raise ValueError(f"{setting}={text} is a chain of {proposal.k}: list it in num_draft_tokens (k) "
                             f"instead; trees are shapes with some width above 1, e.g. 3x1x1")
        if proposal not in out:
            out.append(proposal)
    return out


def label(value: Proposal | int | str) -> str:
    """The report's key of a proposal, from the Proposal or its JSON value (report.json's choose_k lists those)."""
    return Proposal.of(value).label


def replayed_tau(ranks, p: Proposal) -> float:
    """tau of a chain or a static tree from teacher-forced ranks (specdec/replay.py)."""
    widths = p.widths()
    runs = replay.runs_from_ranks(ranks, widths)
    return replay.tau_from_runs(runs, [len(widths)])[len(widths)]


def predicted_speedup(tau: float, p: Proposal, c: float, v: dict[str, float], forwards: int | None = None) -> float:
    """tau / (d c + v(n + 1)): d draft forwards per round (a tree's levels; each feeds its nodes at once; a block
    or parallel draft's `forwards`, from its kind: specdec/draft_kind.py `draft_forwards`), n nodes verified in one
    target forward."""
    return tau / ((p.depth if forwards is None else forwards) * c + v[str(p.verified_nodes)])
