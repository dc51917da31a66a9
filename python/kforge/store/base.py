"""What a store must do for the search (search_card, Spend.from_log, a proposer's bind):
the writes it makes and the reads resume needs. SQLiteStore and MemoryStore both do it;
the same tests run against both."""

from __future__ import annotations

from typing import Any, Protocol

from .records import CandidateRecord


class SearchStore(Protocol):
    def start_run(self, run_id: str, model: str = "", config: dict | None = None, **info: Any) -> None: ...

    def upsert_card(self, run_id: str, card, floor_us: float | None = None) -> None: ...

    def set_card_status(self, run_id: str, card_id: str, status: str, skip_reason: str | None = None) -> None: ...

    def note_iteration(self, run_id: str, card_id: str, iterations: int) -> None: ...

    def card_iterations(self, run_id: str, card_id: str) -> int: ...

    def add_candidate(self, run_id: str, card_id: str, candidate, result, *, parent_id: int | None,
                      iteration: int, reward: float | None = None, repair_of: int | None = None,
                      eval_s: float | None = None) -> int: ...

    def candidates(self, run_id: str, card_id: str | None = None) -> list[CandidateRecord]: ...

    def add_llm_call(self, run_id: str, card_id: str | None, model: str, *, prompt_tokens: int = 0,
                     completion_tokens: int = 0, cost_usd: float = 0.0, duration_s: float = 0.0,
                     status: str = "ok", error: str | None = None, base_url: str | None = None,
                     candidate_id: int | None = None) -> int: ...

    def llm_spend(self, run_id: str) -> tuple[int, float]: ...

    def event(self, run_id: str, kind: str, message: str, level: str = "info", card_id: str | None = None) -> None: ...
