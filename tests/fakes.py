"""Deterministic stand-ins for the proposer and the evaluator, shared by CPU tests.

FakeProposer writes knob-based "kernels" (threads, vec, unroll): first versions draw knobs
from ctx.rng, revisions change one knob of the parent, repairs drop the unroll. FakeEvaluator
scores them with a card -> knobs -> speedup function and fails some on purpose:
vec=4 with unroll=8 does not compile (repairable), threads=1024 with vec=1 is incorrect.
"""

from __future__ import annotations

import math
import os
import sqlite3
import time
from pathlib import Path
from typing import Callable

from kforge.candidate import Candidate, LaunchPlan
from kforge.cards import ArgSpec, Card, TensorMeta
from kforge.hardware import Hardware
from kforge.proposers.base import Proposal, ProposalContext, Proposer, Tried
from kforge.verdict import EvalResult, Evaluator, Verdict

KNOBS = {"threads": (64, 128, 256, 512, 1024), "vec": (1, 2, 4), "unroll": (1, 2, 4, 8)}

# A GPU so fast that no fake kernel gets near its HBM floor (the floor stop stays out of the way).
FAST_HW = Hardware("fake GPU", "sm_90", 132, 60 * 2**20, 227 * 1024, 141 * 10**9, 1e18)


def logged(where, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
    """Rows of a statement on a search log file as SQLite holds it (`where`: a store, a run dir
    or the file), over a connection of its own and committed: what tests check of the file
    itself, or how they damage it."""
    path = Path(getattr(where, "path", where))
    conn = sqlite3.connect(path / "search.sqlite" if path.is_dir() else path)
    try:
        conn.row_factory = sqlite3.Row
        with conn:
            return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def toy_card(eager_us: float = 7.0, n: int = 1 << 20, op: str = "aten::relu.default", family: str = "pointwise",
             share: float = 1.0) -> Card:
    m = TensorMeta((n,), (1,), "float32", "cuda")
    return Card(op=op, schema=f"{op}(Tensor self) -> Tensor", args=[ArgSpec("self", "tensor", tensor=m)],
                outputs=[m], arch="sm_90", family=family, calls=1, eager_us=eager_us, total_us=eager_us, share=share)


def candidate(knobs: dict, note: str = "") -> Candidate:
    t, v, u = knobs["threads"], knobs["vec"], knobs["unroll"]
    source = (f'extern "C" __global__ void fake_kernel(const float* x, float* y) {{\n'
              f"  // threads={t} vec={v} unroll={u}\n}}\n")
    plan = LaunchPlan.from_json({"kernels": [{"name": "fake_kernel", "grid": [1024, 1, 1], "block": [t, 1, 1],
                                              "args": [{"in": 0}, {"out": 0}]}]})
    return Candidate(source, plan, proposer="fake", knobs=dict(knobs), note=note)


class FakeProposer(Proposer):
    name = "fake"

    def __init__(self, *, decline: Callable[[Card], str | None] = lambda card: None, cost_usd: float = 0.0,
                 tokens: int = 0):
        self.decline = decline
        self.cost_usd = cost_usd
        self.tokens = tokens
        self.closed = False
        self.bound = None

    def bind(self, log, run_id, spend) -> None:
        self.bound = (log, run_id, spend)

    def pay(self, ctx: ProposalContext) -> None:
        """Charge one call of `tokens` and `cost_usd` as a paid proposer must: reserve, settle, log."""
        if self.tokens or self.cost_usd:
            log, run_id, spend = self.bound
            spend.settle(spend.reserve(self.tokens, self.cost_usd), self.tokens, self.cost_usd)
            log.add_llm_call(run_id, ctx.card.id, "fake", prompt_tokens=self.tokens, cost_usd=self.cost_usd)

    def supports(self, card: Card) -> tuple[bool, str]:
        why = self.decline(card)
        return (why is None, why or "")

    def propose(self, ctx: ProposalContext) -> Proposal:
        if ctx.parent is None:
            knobs = {k: ctx.rng.choice(v) for k, v in KNOBS.items()}
        else:
            knobs = dict(ctx.parent.candidate.knobs)
            k = ctx.rng.choice(sorted(KNOBS))
            knobs[k] = ctx.rng.choice([v for v in KNOBS[k] if v != knobs[k]])
        self.pay(ctx)
        return Proposal(candidate(knobs))

    def repair(self, ctx: ProposalContext, failed: Tried) -> Proposal | None:
        knobs = dict(failed.candidate.knobs, unroll=1)
        return Proposal(candidate(knobs, note=f"repair of {failed.id}"))

    def close(self) -> None:
        self.closed = True


def default_speedup(card: Card, knobs: dict) -> float:
    """A smooth landscape peaking at threads=256, vec=4, unroll=2 (about 3.1x)."""
    t = math.exp(-math.log2(knobs["threads"] / 256) ** 2 / 4)
    v = 1 + 0.3 * math.log2(knobs["vec"])
    u = 1 / (1 + 0.2 * abs(math.log2(knobs["unroll"] / 2)))
    return 2.0 * t * v * u


class FakeEvaluator(Evaluator):
    """Verdicts from knobs; latencies scale with card.eager_us. With `record`, every evaluated
    digest is appended (and fsynced) to that file, so tests can see evaluations across processes.
    With `untimed`, it stands in for the compile-only evaluator: what compiles is 'untimed'."""

    def __init__(self, speedup: Callable[[Card, dict], float] = default_speedup, *, sleep_s: float = 0.0,
                 record: str | Path | None = None, raise_on: Callable[[dict], bool] = lambda knobs: False,
                 untimed: bool = False, evidence_dir: str | Path | None = None):
        """With `evidence_dir` (the run dir), correct results carry what the GPU worker adds too:
        a latency as dispatched and the tolerances kforge.worker derives for the card (here on
        the CPU), so a package written from them holds real manifest fields."""
        self.speedup = speedup
        self.evidence_dir = Path(evidence_dir) if evidence_dir else None
        self._tolerances: dict[str, dict] = {}
        self.untimed = untimed
        self.sleep_s = sleep_s
        self.record = Path(record) if record else None
        self.raise_on = raise_on
        self.calls: list[str] = []  # digests, in evaluation order
        self.pairs: list[tuple[str, str]] = []  # (card id, digest): the same kernel may serve several cards
        self.closed = False

    def evaluate(self, card: Card, cand: Candidate) -> EvalResult:
        digest = cand.digest()
        self.calls.append(digest)
        self.pairs.append((card.id, digest))
        if self.record:
            with open(self.record, "a") as f:
                f.write(digest + "\n")
                f.flush()
                os.fsync(f.fileno())
        if self.sleep_s:
            time.sleep(self.sleep_s)
        k = cand.knobs
        if self.raise_on(k):
            raise RuntimeError("fake evaluator crashed")
        if k["vec"] == 4 and k["unroll"] == 8:
            return EvalResult(Verdict.COMPILE_ERROR, "too many registers", compile_log="error: fake")
        if self.untimed:
            return EvalResult(Verdict.UNTIMED, "compiled; no GPU to validate or time it")
        if k["threads"] == 1024 and k["vec"] == 1:
            return EvalResult(Verdict.INCORRECT, "max abs err 3.0", max_abs_err=3.0)
        s = self.speedup(card, k)
        eager = card.eager_us
        result = EvalResult(Verdict.VALID if s > 1 else Verdict.SLOWER, eager_us=eager, kernel_us=eager / s)
        if self.evidence_dir is not None:
            result.dispatched_us = result.kernel_us + 0.01 * eager  # the guard's and the launch's overhead
            result.evidence = dict(self._worker_tolerances(card))
        return result

    def _worker_tolerances(self, card: Card) -> dict:
        if card.id not in self._tolerances:
            import torch

            from kforge import inputsets

            evidence: dict = {}
            sets, _ = inputsets.prepare(card, self.evidence_dir, torch.device("cpu"), fresh_sets=1)
            for s in sets:
                inputsets.record_tolerances(evidence, s)
            self._tolerances[card.id] = evidence
        return self._tolerances[card.id]

    def close(self) -> None:
        self.closed = True
