"""The search tree of one card: plain nodes, rebuilt from the store's candidates on resume.

The root is a virtual node, "no kernel yet"; its children are first versions. Every
evaluated candidate is one node and one backup, so replaying the log's rows in id order
gives back exactly the tree (visits and rewards) the search had when it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ..proposers.base import Tried
from ..store.records import CandidateRecord
from ..verdict import Verdict
from .policy import result_reward


@dataclass(eq=False)
class Node:
    id: int | None  # the candidate's row in the search log; None for the virtual root
    tried: Tried | None
    parent: "Node | None" = None
    children: list["Node"] = field(default_factory=list)
    visits: int = 0
    total: float = 0.0  # W: sum of rewards backed up through this node
    proposer_failures: int = 0  # proposer errors and duplicates here (this session only)
    exhausted: bool = False  # the proposer had nothing new to offer from here (this session only)

    @property
    def failed(self) -> bool:
        return self.tried is not None and self.tried.result.verdict.failed

    @property
    def q(self) -> float:
        return self.total / self.visits if self.visits else 0.0

    @property
    def expandable(self) -> bool:
        """May get a new child: failures never do, nor nodes the proposer gave up on."""
        return not self.failed and not self.exhausted

    def open(self) -> bool:
        """Is there anything left to expand in this subtree?"""
        return self.expandable or any(c.open() for c in self.children if not c.failed)


class Tree:
    def __init__(self) -> None:
        self.root = Node(None, None)
        self.nodes: dict[int, Node] = {}
        self.digests: set[str] = set()  # everything evaluated for this card, failures included

    def add(self, tried: Tried, parent: Node, digest: str | None = None) -> Node:
        """A new node under `parent` for an evaluated candidate (tried.id is its log row).
        `digest` is the one the log recorded, so a resumed search dedupes on exactly it."""
        node = Node(tried.id, tried, parent)
        parent.children.append(node)
        if tried.id is not None:
            self.nodes[tried.id] = node
        self.digests.add(digest or tried.candidate.digest())
        return node

    def node(self, row_id: int | None) -> Node:
        return self.root if row_id is None else self.nodes[row_id]

    @staticmethod
    def backpropagate(node: Node, reward: float) -> None:
        n: Node | None = node
        while n is not None:
            n.visits += 1
            n.total += reward
            n = n.parent

    @staticmethod
    def lineage(node: Node) -> list[Tried]:
        """The candidates above `node`, root first (the virtual root and `node` excluded)."""
        out: list[Tried] = []
        n = node.parent
        while n is not None and n.tried is not None:
            out.append(n.tried)
            n = n.parent
        return out[::-1]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def best(self) -> Node | None:
        """The fastest valid candidate (ties: the earliest)."""
        valid = [n for n in self if n.tried.result.verdict is Verdict.VALID and n.tried.result.speedup]
        return max(valid, key=lambda n: (n.tried.result.speedup, -n.id)) if valid else None

    # ---- persistence ----------------------------------------------------------------
    @classmethod
    def replay(cls, records: Iterable[CandidateRecord]) -> "Tree":
        """Rebuild the tree from a card's stored candidates (in id order), with the rewards they recorded."""
        tree = cls()
        for rec in records:
            tried = rec.tried()
            node = tree.add(tried, tree.node(rec.parent_id), rec.digest)
            tree.backpropagate(node, rec.reward if rec.reward is not None else result_reward(tried.result))
        return tree

    def to_json(self) -> dict:
        """The tree's shape and statistics (what the saved toy trees in tests compare)."""
        return {
            "root": {"visits": self.root.visits, "total": round(self.root.total, 9)},
            "nodes": [
                {"id": n.id, "parent": n.parent.id, "visits": n.visits, "total": round(n.total, 9),
                 "verdict": n.tried.result.verdict.value}
                for n in self
            ],
        }

