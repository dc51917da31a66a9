"""Proposers turn a card (and the search's feedback) into candidate kernels."""

from .base import Proposal, ProposalContext, Proposer, Tried

__all__ = ["Proposal", "ProposalContext", "Proposer", "Tried", "get_proposer"]


def get_proposer(name: str, **options) -> Proposer:
    """`builtin` (default, no network) or `llm` (any OpenAI-compatible endpoint)."""
    if name == "builtin":
        from .builtin import BuiltinProposer

        return BuiltinProposer(**options)
    if name == "llm" or name.startswith("llm:"):
        from .llm import LLMProposer

        if ":" in name:
            options.setdefault("model", name.split(":", 1)[1])
        return LLMProposer(**options)
    from ..errors import ProposerError

    raise ProposerError(f"unknown proposer {name!r}: use 'builtin' or 'llm' (or 'llm:<model>')")
