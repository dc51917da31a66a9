"""Search over kernel revisions: MCTS per card (tree.py nodes, policy.py UCT and widening, mcts.py loop)."""

from .mcts import Budget, Policy, SearchOutcome, SearchProgress, search_card

__all__ = ["Budget", "Policy", "SearchOutcome", "SearchProgress", "search_card"]
