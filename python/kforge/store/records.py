"""The search log's records: what a store writes and what its queries give back.

One dataclass per table (runs, cards, candidates, llm_calls, events), with JSON columns
already parsed, plus the aggregates the runner, CLI and dashboard read. Readers never see
SQL rows: a schema change is a change here and in the store, and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..candidate import Candidate, LaunchPlan
from ..proposers.base import Tried
from ..verdict import EvalResult, Verdict


@dataclass(frozen=True)
class RunRecord:
    id: str
    created: float
    model: str
    status: str  # running | done | interrupted | failed (| captured: the dashboard's capture-only runs)
    device: str | None
    arch: str | None
    torch: str | None
    kforge: str | None
    config: dict[str, Any]

    @property
    def validated(self) -> bool:
        """A GPU validated and timed its candidates (a compile-only run's config says False)."""
        return bool(self.config.get("validated", True))


@dataclass(frozen=True)
class CardRecord:
    """A card of a run, with what its candidates add up to."""

    run_id: str
    card_id: str
    op: str
    family: str
    summary: str
    calls: int | None
    eager_us: float | None
    share: float | None
    status: str  # pending | searching | done | skipped | failed
    skip_reason: str | None
    best_candidate: int | None
    best_speedup: float | None
    iterations: int
    floor_us: float | None
    card: dict[str, Any]  # Card.to_json() as the search recorded it
    verdicts: dict[str, int] = field(default_factory=dict)  # verdict -> candidates, most frequent first
    eval_s: float = 0.0  # evaluation wall time over its candidates
    best_us: float | None = None  # the best candidate's kernel time
    cost_usd: float = 0.0  # the LLM calls made for it

    @property
    def candidates(self) -> int:
        return sum(self.verdicts.values())


@dataclass(frozen=True)
class CandidateRecord:
    """One evaluated candidate. A listing (`bodies=False`) leaves source, compile_log, plan and
    evidence as None: they are the large columns."""

    id: int
    run_id: str
    card_id: str
    parent_id: int | None  # MCTS parent (None: a child of the root)
    repair_of: int | None  # the failed candidate this one repairs
    iteration: int
    created: float
    proposer: str
    kind: str  # custom | vendor
    digest: str
    knobs: dict[str, Any]
    note: str
    verdict: str
    message: str
    eager_us: float | None
    kernel_us: float | None
    dispatched_us: float | None
    speedup: float | None
    reward: float | None
    max_abs_err: float | None
    max_rel_err: float | None
    flags: list[str]
    eval_s: float | None
    compile_us: float | None
    source: str | None = None
    compile_log: str | None = None
    plan: dict[str, Any] | None = None
    evidence: dict[str, Any] | None = None

    def tried(self) -> Tried:
        """The candidate and its result as the search holds them (a full record only)."""
        candidate = Candidate(self.source, LaunchPlan.from_json(self.plan), self.kind, self.proposer, self.knobs,
                              self.note)
        result = EvalResult(
            verdict=Verdict(self.verdict), message=self.message, evidence=self.evidence, compile_log=self.compile_log,
            eager_us=self.eager_us, kernel_us=self.kernel_us, dispatched_us=self.dispatched_us,
            max_abs_err=self.max_abs_err, max_rel_err=self.max_rel_err, flags=list(self.flags),
        )
        return Tried(candidate, result, self.id)


@dataclass(frozen=True)
class LLMCallRecord:
    id: int
    run_id: str
    card_id: str | None
    candidate_id: int | None
    created: float
    model: str
    base_url: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cost_usd: float | None
    duration_s: float | None
    status: str  # ok | error | retry
    error: str | None


@dataclass(frozen=True)
class LLMUsage:
    """What the LLM calls of one model (or of a whole run) add up to."""

    calls: int = 0
    failed_calls: int = 0
    tokens: int = 0
    cost_usd: float = 0.0

    def __add__(self, other: "LLMUsage") -> "LLMUsage":
        return LLMUsage(self.calls + other.calls, self.failed_calls + other.failed_calls,
                        self.tokens + other.tokens, self.cost_usd + other.cost_usd)


@dataclass(frozen=True)
class EventRecord:
    id: int
    run_id: str
    card_id: str | None
    created: float
    level: str  # info | warning | error
    kind: str
    message: str
