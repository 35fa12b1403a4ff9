"""What a configuration proposes each round: a chain of k draft tokens (an int) or a draft tree (its shape text,
specdec/tree.py). The sweep, the costs, the prediction and the report name both through these helpers."""

from __future__ import annotations

from specdec import replay
from specdec.tree import TreeSpec

Proposal = int | str  # k, or a tree shape such as "3x1x1" / "dyn8-d4-w3"


def normalise_trees(trees: list[str], setting: str = "tree") -> list[str]:
    """Canonical shape texts; a width-1 tree is refused (it is the chain: list its depth as k)."""
    out = []
    for text in trees:
        spec = TreeSpec.parse(text)
        if spec.is_chain:
            raise ValueError(f"{setting}={text} is a chain of {spec.max_depth}: list it in num_draft_tokens (k) "
                             f"instead; trees are shapes with some width above 1, e.g. 3x1x1")
        out.append(str(spec))
    return sorted(set(out), key=out.index)


def is_tree(p: Proposal) -> bool:
    return isinstance(p, str)


def depth(p: Proposal) -> int:
    """Draft tokens a round can accept at most (k for a chain)."""
    return TreeSpec.parse(p).max_depth if is_tree(p) else int(p)


def verified_nodes(p: Proposal) -> int:
    """Draft tokens the target verifies per round (k for a chain, the node budget for a tree): the key of the
    timed verification v, which feeds one token more."""
    return TreeSpec.parse(p).max_nodes if is_tree(p) else int(p)


def label(p: Proposal) -> str:
    return f"tree={p}" if is_tree(p) else f"k={p}"


def widths(p: Proposal) -> list[int]:
    """Candidates per depth of a chain or a static tree; a dynamic tree's kept nodes depend on draft scores off the
    target's path, which the teacher-forced replay does not see: refused."""
    if not is_tree(p):
        return [1] * int(p)
    spec = TreeSpec.parse(p)
    if spec.dynamic:
        raise ValueError(f"choose_tree={p}: a dynamic tree cannot be predicted from the replay; list static "
                         f"shapes (e.g. 3x1x1) to choose among, and measure dynamic ones with tree=")
    return list(spec.widths)


def replayed_tau(ranks, p: Proposal) -> float:
    """tau of a chain or a static tree from teacher-forced ranks (specdec/replay.py)."""
    widths_p = widths(p)
    runs = replay.runs_from_ranks(ranks, widths_p)
    return replay.tau_from_runs(runs, [len(widths_p)])[len(widths_p)]


def predicted_speedup(tau: float, p: Proposal, c: float, v: dict[str, float]) -> float:
    """tau / (d c + v(n + 1)): d draft forwards per round (a tree's levels; each feeds its nodes at once), n nodes
    verified in one target forward."""
    return tau / (depth(p) * c + v[str(verified_nodes(p))])
