"""A store in memory: the search's writes and reads without a file, for a search that needs
no log (tests, a throwaway run). It keeps what the SQLite store keeps, as records, and
applies the same secret scrubbing, so a search behaves the same over either."""

from __future__ import annotations

import json
import threading
from dataclasses import replace as _replace
import time
from typing import Any

from ..redact import scrub
from .records import CandidateRecord, CardRecord, EventRecord, LLMCallRecord, RunRecord


class MemoryStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # workers of a run share one store
        self._runs: dict[str, RunRecord] = {}
        self._cards: dict[tuple[str, str], CardRecord] = {}
        self._candidates: list[CandidateRecord] = []
        self._llm_calls: list[LLMCallRecord] = []
        self._events: list[EventRecord] = []

    def close(self) -> None:
        pass

    # ---- runs -----------------------------------------------------------------------
    def start_run(self, run_id: str, model: str = "", config: dict | None = None, **info: Any) -> None:
        with self._lock:
            run = self._runs.get(run_id) or RunRecord(run_id, time.time(), model, "running", info.get("device"),
                                                       info.get("arch"), info.get("torch"), info.get("kforge"),
                                                       dict(config or {}))
            self._runs[run_id] = _replace(run, status="running")

    def set_run_status(self, run_id: str, status: str) -> None:
        with self._lock:
            if run_id in self._runs:
                self._runs[run_id] = _replace(self._runs[run_id], status=status)

    def run(self, run_id: str) -> RunRecord | None:
        return self._runs.get(run_id)

    # ---- cards ----------------------------------------------------------------------
    def upsert_card(self, run_id: str, card, floor_us: float | None = None) -> None:
        with self._lock:
            old = self._cards.get((run_id, card.id))
            if old is None:
                self._cards[(run_id, card.id)] = CardRecord(
                    run_id, card.id, card.op, card.family, card.summary(), card.calls, card.eager_us, card.share,
                    "pending", None, None, None, 0, floor_us, _as_stored(card.to_json()))
            else:
                self._cards[(run_id, card.id)] = _replace(
                    old, calls=card.calls, eager_us=card.eager_us, share=card.share, card=_as_stored(card.to_json()),
                    floor_us=floor_us if floor_us is not None else old.floor_us)

    def set_card_status(self, run_id: str, card_id: str, status: str, skip_reason: str | None = None) -> None:
        self._update_card(run_id, card_id, status=status, skip_reason=scrub(skip_reason) if skip_reason else skip_reason)

    def note_iteration(self, run_id: str, card_id: str, iterations: int) -> None:
        card = self._cards.get((run_id, card_id))
        if card is not None:
            self._update_card(run_id, card_id, iterations=max(card.iterations, iterations))

    def card_iterations(self, run_id: str, card_id: str) -> int:
        card = self._cards.get((run_id, card_id))
        return card.iterations if card else 0

    def card(self, run_id: str, card_id: str) -> CardRecord | None:
        return self._cards.get((run_id, card_id))

    def _update_card(self, run_id: str, card_id: str, **changes: Any) -> None:
        with self._lock:
            if (run_id, card_id) in self._cards:
                self._cards[(run_id, card_id)] = _replace(self._cards[(run_id, card_id)], **changes)

    # ---- candidates -----------------------------------------------------------------
    def add_candidate(self, run_id: str, card_id: str, candidate, result, *, parent_id: int | None,
                      iteration: int, reward: float | None = None, repair_of: int | None = None,
                      eval_s: float | None = None) -> int:
        r = result
        with self._lock:
            cid = len(self._candidates) + 1
            self._candidates.append(CandidateRecord(
                cid, run_id, card_id, parent_id, repair_of, iteration, time.time(), candidate.proposer, candidate.kind,
                candidate.digest(), _as_stored(candidate.knobs), candidate.note,
                r.verdict.value, r.message, r.eager_us, r.kernel_us, r.dispatched_us, r.speedup, reward, r.max_abs_err,
                r.max_rel_err, list(r.flags), eval_s, r.compile_us, candidate.source, r.compile_log,
                _as_stored(candidate.plan.to_json()), json.loads(scrub(json.dumps(r.evidence, default=str), limit=None))))
        card = self._cards.get((run_id, card_id))
        if card is not None:
            better = r.verdict.value == "valid" and (r.speedup or 0) > (card.best_speedup or 0)
            self._update_card(run_id, card_id, iterations=max(card.iterations, iteration + 1),
                              **(dict(best_candidate=cid, best_speedup=r.speedup) if better else {}))
        return cid

    def candidates(self, run_id: str, card_id: str | None = None) -> list[CandidateRecord]:
        return [c for c in self._candidates if c.run_id == run_id and (card_id is None or c.card_id == card_id)]

    # ---- LLM calls and events ---------------------------------------------------------
    def add_llm_call(self, run_id: str, card_id: str | None, model: str, *, prompt_tokens: int = 0,
                     completion_tokens: int = 0, cost_usd: float = 0.0, duration_s: float = 0.0,
                     status: str = "ok", error: str | None = None, base_url: str | None = None,
                     candidate_id: int | None = None) -> int:
        with self._lock:
            cid = len(self._llm_calls) + 1
            self._llm_calls.append(LLMCallRecord(cid, run_id, card_id, candidate_id, time.time(), model, base_url,
                                                 prompt_tokens, completion_tokens, cost_usd, duration_s, status,
                                                 scrub(error) if error else error))
        return cid

    def llm_calls(self, run_id: str) -> list[LLMCallRecord]:
        return [c for c in self._llm_calls if c.run_id == run_id]

    def llm_spend(self, run_id: str) -> tuple[int, float]:
        calls = self.llm_calls(run_id)
        return (sum((c.prompt_tokens or 0) + (c.completion_tokens or 0) for c in calls),
                sum(c.cost_usd or 0.0 for c in calls))

    def event(self, run_id: str, kind: str, message: str, level: str = "info", card_id: str | None = None) -> None:
        with self._lock:
            self._events.append(EventRecord(len(self._events) + 1, run_id, card_id, time.time(), level, kind,
                                            scrub(message)))

    def events(self, run_id: str, kind: str | None = None) -> list[EventRecord]:
        return [e for e in self._events if e.run_id == run_id and (kind is None or e.kind == kind)]


def _as_stored(value: Any) -> Any:
    """`value` through JSON, as the SQLite store keeps it: what a reader gets is what a log would give."""
    return json.loads(json.dumps(value, default=str))
