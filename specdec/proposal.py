"""What one round proposes: a chain of k draft tokens, or a draft tree of a given shape (specdec/tree.py).

One type for both, parsed once from the caller's or the config's text, so that no field holds "an int, a tree
string or None". Its JSON value (`value`) stays what report.json has always written: k for a chain, the shape
text for a tree (a one-level tree "2" is a tree, the int 2 a chain).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from specdec.tree import TreeSpec


@dataclass(frozen=True)
class Proposal:
    """A chain of `k` draft tokens (tree None), or the draft tree `tree` (k 0)."""

    k: int = 0
    tree: TreeSpec | None = None

    @classmethod
    def chain(cls, k: int) -> Proposal:
        if int(k) < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {k}")
        return cls(k=int(k))

    @classmethod
    def of(cls, value: Proposal | TreeSpec | int | str) -> Proposal:
        """From k (an int), a tree shape (its text or a TreeSpec) or a Proposal; a width-1 tree is the chain."""
        if isinstance(value, Proposal):
            return value
        if not isinstance(value, (str, TreeSpec)):
            try:
                return cls.chain(operator.index(value))
            except TypeError:
                raise ValueError(f"a proposal is k (an int) or a tree shape such as '3x1x1', got {value!r}") from None
        spec = TreeSpec.parse(value) if isinstance(value, str) else value
        return cls.chain(spec.max_depth) if spec.is_chain else cls(tree=spec)

    @property
    def is_tree(self) -> bool:
        return self.tree is not None

    @property
    def depth(self) -> int:
        """Draft tokens a round can accept at most: k for a chain, the tree's depth."""
        return self.tree.max_depth if self.is_tree else self.k

    @property
    def verified_nodes(self) -> int:
        """Draft tokens the target verifies per round (k, or the tree's node budget): the key of the timed
        verification v, which feeds one token more."""
        return self.tree.max_nodes if self.is_tree else self.k

    @property
    def value(self) -> int | str:
        """The JSON value: k, or the tree's shape text."""
        return str(self.tree) if self.is_tree else self.k

    @property
    def label(self) -> str:
        """The report's key: "k=2" or "tree=3x1x1" (a one-level tree and the chain of its width share a text)."""
        return f"tree={self.tree}" if self.is_tree else f"k={self.k}"

    def widths(self) -> list[int]:
        """Candidates per depth of a chain or a static tree. A dynamic tree's kept nodes depend on draft scores
        off the target's path, which a teacher-forced replay does not see: refused."""
        if not self.is_tree:
            return [1] * self.k
        if self.tree.dynamic:
            raise ValueError(f"{self.label}: a dynamic tree cannot be predicted from the replay")
        return list(self.tree.widths)

    def __str__(self) -> str:
        return f"tree {self.tree}" if self.is_tree else f"k = {self.k}"
