"""Draft trees: several candidates per position, verified in one target forward.

A round grows a tree of draft proposals below the last emitted token (the root), feeds the root and every node to
the target in one forward with a tree attention mask (each node sees the prefix, its ancestors and itself), and
keeps the longest path the target accepts (SpecInfer, Miao et al. 2023, arXiv:2305.09781; EAGLE-2, Li et al.
2024, arXiv:2406.16858).

Shapes (`TreeSpec`):
  static   "3x1x1": the root gets the draft's top 3 tokens, each node below its top 1: 9 nodes, depth 3.
  dynamic  "dyn8":  EAGLE-2's rule: at each depth expand the `width` nodes of highest cumulative draft
           log-probability into their top `width` children, for `depth` levels, then keep the `nodes` best
           nodes of the whole tree (a child never scores above its parent, so the kept set is a tree).
           "dyn8-d4-w3" names depth and width (defaults 4 and 3).

Children are the draft's top-w tokens, a deterministic function of the sequence. Verification then treats each
candidate as a point-mass proposal, which keeps both decoders exact:
  greedy    follow the child equal to the target's argmax at each node; the next token is the argmax where
            no child matches (correction) or at the leaf reached (bonus).
  sampling  at a node with target distribution r_0 = p, try its children x_1..x_m in order: accept x_i with
            probability r_{i-1}(x_i); on rejection r_i = r_{i-1} with x_i removed, renormalised; when all are
            rejected emit a draw from r_m. This is speculative sampling's rule (accept min(1, r/q), residual
            norm(max(r - q, 0))) with q = the point mass at x_i, applied recursively as SpecInfer's multi-step
            speculative sampling and Sequoia's sampling without replacement (Chen et al. 2024,
            arXiv:2402.12374) do. Since r_{i-1}(x) = p(x) / (1 - sum_{j<i} p(x_j)) for x not yet tried,
            P(emit x_i) = prod_{j<i} (1 - r_{j-1}(x_j)) * r_{i-1}(x_i) = p(x_i), and a token that is no
            candidate is emitted with (1 - sum_j p(x_j)) * p(x) / (1 - sum_j p(x_j)) = p(x): each emitted
            token is distributed as the target's, at every depth (`emitted_distribution` computes it; the
            tests check it, and check that a wrong residual fails).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from specdec.sampling import sample_from

_DYNAMIC = re.compile(r"dyn(\d+)(?:-d(\d+))?(?:-w(\d+))?")
_STATIC = re.compile(r"\d+(?:x\d+)*")


@dataclass(frozen=True)
class TreeSpec:
    """A tree shape: static `widths` (children per node at each depth) or EAGLE-2's dynamic rule."""

    widths: tuple[int, ...] = ()
    nodes: int = 0  # dynamic: the node budget (0 = static)
    depth: int = 0  # dynamic: levels grown
    width: int = 0  # dynamic: nodes expanded per level, and children per expanded node

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        text = str(text).strip().lower()
        if _STATIC.fullmatch(text):
            widths = tuple(int(w) for w in text.split("x"))
            if min(widths) < 1:
                raise ValueError(f"tree {text!r}: every width must be >= 1")
            return cls(widths=widths)
        match = _DYNAMIC.fullmatch(text)
        if match:
            nodes, depth, width = int(match[1]), int(match[2] or 4), int(match[3] or 3)
            if nodes < 1 or depth < 1 or width < 1:
                raise ValueError(f"tree {text!r}: nodes, depth and width must be >= 1")
            return cls(nodes=nodes, depth=depth, width=width)
        raise ValueError(f"tree {text!r} is not a tree shape: write widths per depth like 3x1x1 (top 3 at depth 1, "
                         f"top 1 below) or a dynamic tree like dyn8 / dyn8-d4-w3 (8 nodes, depth 4, width 3)")

    @property
    def dynamic(self) -> bool:
        return self.nodes > 0

    @property
    def max_depth(self) -> int:
        return self.depth if self.dynamic else len(self.widths)

    @property
    def is_chain(self) -> bool:
        return not self.dynamic and all(w == 1 for w in self.widths)

    @property
    def max_nodes(self) -> int:
        if self.dynamic:
            return self.nodes
        total, level = 0, 1
        for w in self.widths:
            level *= w
            total += level
        return total

    def __str__(self) -> str:
        if self.dynamic:
            return f"dyn{self.nodes}-d{self.depth}-w{self.width}"
        return "x".join(map(str, self.widths))


@dataclass
class Tree:
    """Nodes in breadth-first order (parents before children; siblings best first). Parent -1 is the root."""

    tokens: list[int] = field(default_factory=list)  # target ids
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # 1 = a child of the root
    scores: list[float] = field(default_factory=list)  # cumulative draft log-probability

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {-1: []}
        for i, parent in enumerate(self.parents):
            kids.setdefault(parent, []).append(i)
            kids.setdefault(i, [])
        return kids

    def sees(self, node: int, other: int) -> bool:
        """Whether `other` is `node` or one of its ancestors."""
        while node >= 0:
            if node == other:
                return True
            node = self.parents[node]
        return False

    def ancestry(self, rows: list[int], columns: list[int]) -> torch.Tensor:
        """[len(rows), len(columns)] bool: column node is the row node or its ancestor."""
        return torch.tensor([[self.sees(r, c) for c in columns] for r in rows], dtype=torch.bool)

    def subtree(self, keep: list[int]) -> Tree:
        """The tree of the kept nodes (closed under parents), in breadth-first order."""
        order = sorted(keep, key=lambda i: (self.depths[i], i))
        index = {old: new for new, old in enumerate(order)}
        out = Tree()
        for old in order:
            parent = self.parents[old]
            out.add(self.tokens[old], -1 if parent < 0 else index[parent], self.scores[old])
        return out


def describe_round(tree: Tree, path: list[int], next_token: int, decode=str) -> str:
    """A tree round as text: the nodes indented by depth with their draft log-probability, the accepted path
    marked `*`, then the target's own token (a bonus when the path ends at a leaf, else a correction)."""
    kids, lines = tree.children(), []

    def walk(node: int) -> None:
        for child in kids[node]:
            mark = "*" if child in path else " "
            lines.append(f"{'  ' * (tree.depths[child] - 1)}{mark} {decode(tree.tokens[child])!s}  "
                         f"({tree.scores[child]:.2f})")
            walk(child)

    walk(-1)
    bonus = bool(path) and not kids[path[-1]]
    lines.append(f"-> {'bonus' if bonus else 'correction'} {decode(next_token)!s} (accepted {len(path)})")
    return "\n".join(lines)


def grow(drafter, batch, spec: TreeSpec, depth: int, stats) -> Tree:
    """The round's tree from the drafter, at most `depth` deep: one draft forward per level fed (the root first).

    The drafter provides `tree_root(batch) -> (log-probs [V_draft], state)` for the token after the last emitted
    one, `tree_step(tokens, parent_states, depths, allowed) -> (log-probs [m, V_draft], states)` for m nodes fed
    at once with `allowed` [m, cached + m] (True = may attend), `to_target_ids` and `tree_cached()`."""
    log_probs, states = drafter.tree_root(batch)
    stats.draft_forwards += 1
    log_probs, level, base = log_probs[None], [-1], drafter.tree_cached()
    tree, fed = Tree(), []
    for d in range(1, depth + 1):
        width = spec.width if spec.dynamic else spec.widths[d - 1]
        top = torch.topk(log_probs.float(), min(width, log_probs.shape[-1]), dim=-1)
        ids = drafter.to_target_ids(top.indices).tolist()
        new = []
        for row, parent in enumerate(level):
            parent_score = 0.0 if parent < 0 else tree.scores[parent]
            for token, lp in zip(ids[row], top.values[row].tolist()):
                new.append(tree.add(token, parent, parent_score + lp))
        if d == depth:
            break
        expand = sorted(new, key=lambda i: -tree.scores[i])[: spec.width] if spec.dynamic else new
        parent_rows = [level.index(tree.parents[i]) for i in expand]
        allowed = torch.cat([torch.ones(len(expand), base, dtype=torch.bool),
                             tree.ancestry(expand, fed + expand)], dim=1)
        parent_states = None if states is None else states[parent_rows]
        log_probs, states = drafter.tree_step(torch.tensor([tree.tokens[i] for i in expand]), parent_states,
                                              [tree.depths[i] for i in expand], allowed)
        stats.draft_forwards += 1
        fed, level = fed + expand, expand
    if spec.dynamic and len(tree) > spec.nodes:
        best = sorted(range(len(tree)), key=lambda i: (-tree.scores[i], tree.depths[i]))[: spec.nodes]
        tree = tree.subtree(best)
    return tree


def verification_inputs(tree: Tree, root_token: int, root_position: int, cached: int, device):
    """input_ids [1, 1+N], position_ids [1, 1+N] and `allowed` [1+N, cached+1+N] for the target's forward over
    the root and the tree: every row sees the cached prefix and the root; a node sees its ancestors and itself."""
    n = len(tree)
    ids = torch.tensor([[root_token, *tree.tokens]], device=device)
    positions = torch.tensor([[root_position, *(root_position + d for d in tree.depths)]], device=device)
    block = torch.zeros(1 + n, 1 + n, dtype=torch.bool)
    block[:, 0] = True
    block[1:, 1:] = tree.ancestry(list(range(n)), list(range(n)))
    return ids, positions, torch.cat([torch.ones(1 + n, cached, dtype=torch.bool), block], dim=1)


def greedy_walk(tree: Tree, logits: torch.Tensor) -> tuple[list[int], int]:
    """The accepted path (node indices) and the next token, from the target's logits [1+N, V] (row 0: root)."""
    choice = logits.argmax(dim=-1).tolist()
    kids, node, path = tree.children(), -1, []
    while True:
        wanted = choice[node + 1]
        match = next((c for c in kids[node] if tree.tokens[c] == wanted), None)
        if match is None:
            return path, wanted
        path.append(match)
        node = match


def without(r: torch.Tensor, token: int) -> torch.Tensor:
    """The residual after a rejected point-mass candidate: r with `token` removed, renormalised.  [V]"""
    r = r.clone()
    r[token] = 0.0
    total = r.sum()
    return r / total if float(total) > 0 else r


def sampled_walk(tree: Tree, p: torch.Tensor, generator=None) -> tuple[list[int], int]:
    """Recursive rejection sampling over the tree (module docstring); p [1+N, V] warped, float32 (row 0: root)."""
    kids, node, path = tree.children(), -1, []
    while True:
        r = p[node + 1]
        accepted = None
        for child in kids[node]:
            token = tree.tokens[child]
            u = torch.rand((), generator=generator, device=p.device)
            if float(u) < float(r[token]):
                accepted = child
                break
            r = without(r, token)
        if accepted is None:
            return path, int(sample_from(r, generator))
        path.append(accepted)
        node = accepted


def emitted_distribution(p: torch.Tensor, candidates: list[int]) -> torch.Tensor:
    """Analytical distribution of the token `sampled_walk` emits at one node with these candidates, from the same
    `without` residual: candidate x_i with prod_{j<i} (1 - r_{j-1}(x_j)) * r_{i-1}(x_i), and any token with the
    leftover mass times r_m. Equals p; the property tests check that identity.  p [V] -> [V]"""
    out, r, left = torch.zeros_like(p), p, 1.0
    for token in candidates:
        out[token] += left * r[token]
        left = left * (1.0 - float(r[token]))
        r = without(r, token)
    return out + left * r
