"""What a run's paid proposer calls cost, and the hard limits on it.

One Spend is shared by every card and worker of a run. A paid call first reserves its worst
case (`reserve`): it is refused with BudgetExhausted when that, on top of what is spent and
what calls in flight have reserved, could pass a limit. When the call ends, `settle` replaces
the reservation by what it really cost, which the caller keeps at or under the reservation.
So the limits hold even with several workers calling at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .errors import BudgetExhausted


@dataclass(frozen=True)
class Hold:
    """A reservation: the worst case of one call."""

    tokens: int
    cost_usd: float


class Spend:
    """LLM tokens and USD spent by a run (thread-safe), with optional limits on both."""

    def __init__(self, tokens: int = 0, cost_usd: float = 0.0, *, max_tokens: int | None = None,
                 max_cost_usd: float | None = None):
        self._lock = threading.Lock()
        self.tokens = tokens
        self.cost_usd = cost_usd
        self.max_tokens = max_tokens
        self.max_cost_usd = max_cost_usd
        self._held_tokens = 0
        self._held_cost = 0.0

    @classmethod
    def from_log(cls, log, run_id: str, **limits) -> "Spend":
        """What the log says the run already spent (a resumed run keeps its budget)."""
        tokens, cost = log.llm_spend(run_id)
        return cls(tokens, cost, **limits)

    def reserve(self, tokens: int, cost_usd: float) -> Hold:
        """Hold the worst case of a call, or raise BudgetExhausted (reason cost or tokens)."""
        with self._lock:
            if self.max_cost_usd is not None and self.cost_usd + self._held_cost + cost_usd > self.max_cost_usd:
                raise BudgetExhausted(
                    f"LLM cost budget: ${self.cost_usd:.4f} spent, the next call may cost up to ${cost_usd:.4f}, "
                    f"over the limit of ${self.max_cost_usd:.4f}; raise --max-cost to go on", "cost")
            if self.max_tokens is not None and self.tokens + self._held_tokens + tokens > self.max_tokens:
                raise BudgetExhausted(
                    f"LLM token budget: {self.tokens} used, the next call may take up to {tokens} more, over the "
                    f"limit of {self.max_tokens}; raise max_tokens to go on", "tokens")
            self._held_tokens += tokens
            self._held_cost += cost_usd
            return Hold(tokens, cost_usd)

    def settle(self, hold: Hold, tokens: int, cost_usd: float) -> None:
        """Release `hold` and count what the call cost (at most what it held)."""
        with self._lock:
            self._held_tokens -= hold.tokens
            self._held_cost -= hold.cost_usd
            self.tokens += min(tokens, hold.tokens)
            self.cost_usd += min(cost_usd, hold.cost_usd)

    def over(self) -> str | None:
        """Which limit is reached, if any (the search's stop reason)."""
        if self.max_cost_usd is not None and self.cost_usd >= self.max_cost_usd:
            return "cost"
        if self.max_tokens is not None and self.tokens >= self.max_tokens:
            return "tokens"
        return None
