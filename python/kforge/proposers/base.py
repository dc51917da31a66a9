"""The proposer interface the search drives."""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field

from ..candidate import Candidate
from ..cards import Card
from ..errors import ProposerError
from ..hardware import Hardware
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
    # LLM accounting for this proposal (zero for the builtin proposer)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0


class ProposalFailed(ProposerError):
    """No usable candidate, after calls that cost tokens: the search still counts them
    against its budgets and logs them."""

    def __init__(self, message: str, *, prompt_tokens: int = 0, completion_tokens: int = 0, cost_usd: float = 0.0):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.cost_usd = cost_usd


class Proposer(abc.ABC):
    name: str = "proposer"

    @abc.abstractmethod
    def supports(self, card: Card) -> tuple[bool, str]:
        """(True, "") if this proposer can write kernels for the card, else (False, why not)."""

    @abc.abstractmethod
    def propose(self, ctx: ProposalContext) -> Proposal:
        """A new candidate: a first version when ctx.parent is None, else a revision of it.
        Raises ProposerError when it has nothing new to offer (ProposalFailed when that cost tokens)."""

    def repair(self, ctx: ProposalContext, failed: Tried) -> Proposal | None:
        """A fix for a candidate that failed to compile, load or run; None if it cannot."""
        return None

    def close(self) -> None:
        """Release clients, connections."""
