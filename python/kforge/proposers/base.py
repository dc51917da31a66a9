"""The proposer interface the search drives."""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field

from ..candidate import Candidate
from ..cards import Card
from ..hardware import Hardware
from ..spend import Spend
from ..verdict import EvalResult


@dataclass
class Tried:
    """A candidate and what the evaluator said of it."""

    candidate: Candidate
    result: EvalResult
    id: int | None = None  # its row in the search log


@dataclass
class ProposalContext:
    card: Card
    hardware: Hardware
    parent: Tried | None = None  # None: propose a fresh first version (child of the root)
    lineage: list[Tried] = field(default_factory=list)  # ancestors of parent, root first
    best: Tried | None = None  # best valid candidate of this card so far
    sibling_failures: list[Tried] = field(default_factory=list)  # failed children of parent: do not repeat
    tried_digests: set[str] = field(default_factory=set)  # everything evaluated for this card
    iteration: int = 0
    rng: random.Random = field(default_factory=random.Random)


@dataclass
class Proposal:
    candidate: Candidate


class Proposer(abc.ABC):
    name: str = "proposer"

    @abc.abstractmethod
    def supports(self, card: Card) -> tuple[bool, str]:
        """(True, "") if this proposer can write kernels for the card, else (False, why not)."""

    @abc.abstractmethod
    def propose(self, ctx: ProposalContext) -> Proposal:
        """A new candidate: a first version when ctx.parent is None, else a revision of it.
        Raises ProposerError when it has nothing new to offer, ProposerUnavailable when its
        service gives no answer, BudgetExhausted when a paid call would pass the run's limits."""

    def repair(self, ctx: ProposalContext, failed: Tried) -> Proposal | None:
        """A fix for a candidate that failed to compile, load or run; None if it cannot."""
        return None

    def bind(self, log, run_id: str, spend: Spend) -> None:
        """Where a proposer that pays for its calls records each attempt (the log's llm_calls)
        and charges it (`spend`, whose limits it checks before every call). The search calls it
        before asking; a proposer that pays nothing ignores it."""

    def preflight(self, spend: Spend) -> None:
        """Raise now if this proposer cannot work for a run with `spend`'s limits (endpoint
        down, a cost budget it cannot price): called before a run's capture, so that a dead
        endpoint costs seconds, not a capture and a search of failures."""

    def close(self) -> None:
        """Release clients, connections."""
