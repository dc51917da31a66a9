"""Monte Carlo tree search over kernel revisions of one card.

One iteration: select (UCT down the tree while progressive widening forbids a new child)
-> expand (the proposer writes a first version or a revision; a candidate whose digest was
already evaluated is skipped) -> evaluate -> bounded repair of compile/load/runtime errors
-> backpropagate. Every evaluated candidate is one log row, committed before the loop moves
on, and one backup, so a killed search resumes from the log without losing or repeating
an evaluation. Proposer and evaluator exceptions are recorded, never a crashed search.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..candidate import Candidate
from ..cards import Card
from ..errors import BudgetExhausted, ProposerUnavailable
from ..hardware import Hardware
from ..log import SearchLog
from ..proposers.base import Proposal, ProposalContext, Proposer, Tried
from ..spend import Spend
from ..verdict import EvalResult, Evaluator, Verdict
from . import policy as P
from .tree import Node, Tree


@dataclass(frozen=True)
class Budget:
    """When the search of one card stops. None means no limit."""

    iterations: int = 50  # per card, counted across resumes; repairs belong to their iteration
    wall_time_s: float | None = None  # per card, from when this session starts searching it
    deadline: float | None = None  # time.monotonic() after which no card starts an iteration (run-wide)
    max_cost_usd: float | None = None  # LLM spend, run-wide: the limits of the run's Spend
    max_tokens: int | None = None
    near_floor: float = 0.9  # stop once the best kernel reaches this fraction of the HBM floor
    stagnation: int = 10  # iterations without a new best before exploring harder from the root
    give_up: int = 20  # stop a card whose first this-many iterations gave no kernel faster than eager (0: never)


@dataclass(frozen=True)
class Policy:
    """Tree-policy knobs. Rewards live in [0, 1] (policy.reward), so c is scale-free."""

    c: float = 0.7  # UCT exploration
    k: float = 1.5  # progressive widening: up to k * N^alpha children
    alpha_start: float = 0.5  # alpha annealed from start to end over the iteration budget
    alpha_end: float = 0.25
    stagnation_boost: float = 2.0  # c is multiplied by this while the search is stagnant
    proposer_retries: int = 2  # proposer failures (errors, duplicates) at a node before giving up on it
    unavailable_after: int = 3  # consecutive asks that got no answer from the proposer's service before the card stops


@dataclass(frozen=True)
class SearchProgress:
    """What on_progress receives after every iteration."""

    card_id: str
    iteration: int  # iterations done, resumed ones included
    iterations: int  # the budget
    best_speedup: float | None
    last_verdict: str | None  # None when the iteration evaluated nothing (duplicate, proposer error)


@dataclass
class SearchOutcome:
    card_id: str
    best: Tried | None  # fastest valid candidate (tried.id is its log row)
    iterations: int  # done in total, resumed ones included
    evaluated: int  # candidates evaluated by this call
    stop_reason: str  # iterations | wall_time | cost | tokens | budget | near_floor | no_gain | exhausted | interrupted | unavailable
    tree: Tree = field(repr=False)
    stop_detail: str = ""  # the proposer's last error when it was unavailable

    @property
    def best_speedup(self) -> float | None:
        return self.best.result.speedup if self.best else None


def select(tree: Tree, rng: random.Random, c: float, k: float, alpha: float) -> Node | None:
    """The node to expand: walk down by UCT while widening forbids a new child here.
    None when nothing in the tree can be expanded any more."""
    node = tree.root
    if not node.open():
        return None
    while True:
        kids = [ch for ch in node.children if not ch.failed and ch.open()]
        if node.expandable and (not kids or P.may_widen(len(node.children), node.visits, k, alpha)):
            return node
        scores = [P.uct(ch.total, ch.visits, node.visits, c) for ch in kids]
        node = kids[P.argmax_random(scores, rng)]


class _CardSearch:
    """The state of one card's search; search_card() is its entry point."""

    def __init__(self, card: Card, proposer: Proposer, evaluator: Evaluator, log: SearchLog, run_id: str,
                 budget: Budget, hardware: Hardware, policy: Policy, spend: Spend, repair_attempts: int,
                 cancel: threading.Event | None):
        self.card, self.proposer, self.evaluator, self.log, self.run_id = card, proposer, evaluator, log, run_id
        self.cancel = cancel
        self.budget, self.hardware, self.policy, self.spend = budget, hardware, policy, spend
        self.repair_attempts = repair_attempts
        self.floor_us = hardware.floor_us(card.io_bytes())
        self.tree = Tree.replay(log.candidates(run_id, card.id))
        self.best = self.tree.best()
        self.evaluated = 0
        self.unanswered = 0  # consecutive asks the proposer's service did not answer

    # ---- the loop ---------------------------------------------------------------------
    def run(self, rng_seed: int, on_progress: Callable[[SearchProgress], None] | None) -> SearchOutcome:
        it = self.log.card_iterations(self.run_id, self.card.id)
        # Seeded by where this session starts, so a resumed search is reproducible too.
        rng = random.Random(f"{rng_seed}:{self.card.id}:{it}")
        started = time.monotonic()
        c, stagnant, from_root = self.policy.c, 0, False
        detail = ""
        while True:
            stop = self._stop_reason(it, started)
            if stop:
                break
            alpha = P.annealed_alpha(it / max(self.budget.iterations, 1), self.policy.alpha_start,
                                     self.policy.alpha_end)
            leaf = self.tree.root if from_root and self.tree.root.expandable else select(
                self.tree, rng, c, self.policy.k, alpha)
            from_root = False
            if leaf is None:
                stop = "exhausted"
                break
            previous_best = self.best
            try:
                last = self._expand(leaf, it, rng)
            except BudgetExhausted as e:
                self.log.event(self.run_id, "budget", str(e), card_id=self.card.id)
                stop = e.reason
                break
            except ProposerUnavailable as e:
                if not e.transient:  # no later ask can do better: the run stops
                    raise
                stop, detail = "unavailable", str(e)  # it stayed down for unavailable_after asks
                break
            it += 1
            self.log.note_iteration(self.run_id, self.card.id, it)
            if self.best is not previous_best:
                c, stagnant = self.policy.c, 0
            else:
                stagnant += 1
                if stagnant >= self.budget.stagnation:
                    c, stagnant, from_root = self.policy.c * self.policy.stagnation_boost, 0, True
                    self.log.event(self.run_id, "stagnation",
                                   f"no new best in {self.budget.stagnation} iterations: exploring from the root "
                                   f"with c={c:g}", card_id=self.card.id)
            if on_progress:
                on_progress(SearchProgress(self.card.id, it, self.budget.iterations, self._best_speedup(),
                                           last.result.verdict.value if last else None))
        self.log.event(self.run_id, "search_done", f"stopped ({stop}) after {it} iterations", card_id=self.card.id)
        return SearchOutcome(self.card.id, self.best.tried if self.best else None, it, self.evaluated, stop, self.tree,
                             detail)

    def _stop_reason(self, it: int, started: float) -> str | None:
        b, now = self.budget, time.monotonic()
        if self._cancelled():
            return "interrupted"
        if it >= b.iterations:
            return "iterations"
        if (b.wall_time_s is not None and now - started >= b.wall_time_s) or (b.deadline is not None and now >= b.deadline):
            return "wall_time"
        over = self.spend.over()
        if over:
            return over
        best_us = self.best.tried.result.kernel_us if self.best else None
        if best_us and self.floor_us > 0 and self.floor_us / best_us >= b.near_floor:
            return "near_floor"
        if b.give_up and it >= b.give_up and self.best is None:
            return "no_gain"  # e.g. eager is already at the roofline: the budget is better spent elsewhere
        return None

    def _best_speedup(self) -> float | None:
        return self.best.tried.result.speedup if self.best else None

    def _cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    # ---- one expansion and its repairs ---------------------------------------------------
    def _context(self, leaf: Node, it: int, rng: random.Random) -> ProposalContext:
        return ProposalContext(
            card=self.card, hardware=self.hardware, parent=leaf.tried, lineage=Tree.lineage(leaf),
            best=self.best.tried if self.best else None,
            sibling_failures=[ch.tried for ch in leaf.children if ch.failed],
            tried_digests=set(self.tree.digests), iteration=it, rng=rng,
        )

    def _expand(self, leaf: Node, it: int, rng: random.Random) -> Tried | None:
        """Propose under `leaf`, evaluate, repair; returns the last evaluated candidate, if any."""
        ctx = self._context(leaf, it, rng)
        proposal = self._ask(leaf, "propose", lambda: self.proposer.propose(ctx))
        if proposal is None:
            return None
        tried = self._evaluate(leaf, proposal, it, repair_of=None)
        if tried is None:
            return None
        for _ in range(self.repair_attempts):
            if not tried.result.verdict.repairable or "evaluator_error" in tried.result.evidence:
                break
            if self._cancelled():  # stop after the candidate in flight, not after its repairs
                break
            ctx = self._context(leaf, it, rng)
            failed = tried
            proposal = self._ask(leaf, "repair", lambda: self.proposer.repair(ctx, failed))
            repaired = self._evaluate(leaf, proposal, it, repair_of=failed.id) if proposal else None
            if repaired is None:
                break
            tried = repaired
        return tried

    def _ask(self, leaf: Node, what: str, call: Callable[[], Proposal | None]) -> Proposal | None:
        """Call the proposer; an exception is recorded against the node, never raised, except
        BudgetExhausted and KeyboardInterrupt, a ProposerUnavailable that is not transient, and
        a transient one that lasted `unavailable_after` asks: these stop the search."""
        try:
            proposal = call()
        except (BudgetExhausted, KeyboardInterrupt):
            raise
        except Exception as e:  # any proposer bug or bad reply becomes a recorded failure
            self.log.event(self.run_id, "proposer_error", f"{what} failed: {type(e).__name__}: {e}",
                           level="warning", card_id=self.card.id)
            if isinstance(e, ProposerUnavailable):  # the service's fault, not the node's
                self.unanswered += 1
                if not e.transient or self.unanswered >= self.policy.unavailable_after:
                    raise
                return None
            self.unanswered = 0  # it answered, if not usefully
            self._proposer_failed(leaf)
            return None
        self.unanswered = 0
        return proposal

    def _proposer_failed(self, leaf: Node) -> None:
        leaf.proposer_failures += 1
        if leaf.proposer_failures >= self.policy.proposer_retries:
            leaf.exhausted = True

    def _evaluate(self, leaf: Node, proposal: Proposal, it: int, repair_of: int | None) -> Tried | None:
        """Evaluate a proposal, log it, add it to the tree and back its reward up.
        None when it was a duplicate of something already evaluated (not re-evaluated)."""
        cand = proposal.candidate
        digest = cand.digest()
        if digest in self.tree.digests:
            self.log.event(self.run_id, "duplicate", f"candidate {digest} was already evaluated; skipped",
                           card_id=self.card.id)
            self._proposer_failed(leaf)
            return None
        result, eval_s = self._run_evaluator(cand)
        reward = P.result_reward(result)
        row = self.log.add_candidate(self.run_id, self.card.id, cand, result, parent_id=leaf.id, iteration=it,
                                     reward=reward, repair_of=repair_of, eval_s=eval_s)
        tried = Tried(cand, result, row)
        node = self.tree.add(tried, leaf, digest)
        Tree.backpropagate(node, reward)
        self.evaluated += 1
        # The same rule as Tree.best, so a resumed search keeps the same best.
        if result.verdict is Verdict.VALID and result.speedup and (self.best is None or
                                                                   result.speedup > self._best_speedup()):
            self.best = node
        return tried

    def _run_evaluator(self, cand: Candidate) -> tuple[EvalResult, float]:
        t0 = time.monotonic()
        try:
            result = self.evaluator.evaluate(self.card, cand)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # the evaluator must not raise, but one that does must not end the search
            self.log.event(self.run_id, "evaluator_error", f"{type(e).__name__}: {e}", level="error",
                           card_id=self.card.id)
            result = EvalResult(Verdict.RUNTIME_ERROR, f"the evaluator raised {type(e).__name__}: {e}",
                                evidence={"evaluator_error": repr(e)})
        return result, time.monotonic() - t0


def search_card(card: Card, proposer: Proposer, evaluator: Evaluator, log: SearchLog, run_id: str, *,
                budget: Budget = Budget(), hardware: Hardware, rng_seed: int = 0, repair_attempts: int = 2,
                on_progress: Callable[[SearchProgress], None] | None = None, policy: Policy = Policy(),
                spend: Spend | None = None, cancel: threading.Event | None = None) -> SearchOutcome:
    """Search kernels for one card, continuing whatever the log already holds for it.

    The card is registered in the log (status 'searching', then 'done'). `spend` is shared
    by the cards of a run so LLM budgets are run-wide; without it, it starts from what the
    log says this run already spent, with the budget's limits. The proposer records and
    charges its calls there (Proposer.bind). Setting `cancel` (another thread's Ctrl-C) stops
    it before the next iteration with stop_reason 'interrupted'; KeyboardInterrupt in this
    thread propagates. Either way everything evaluated is in the log, the card stays
    'searching' and resumes later. A proposer whose service stays unavailable leaves the card
    'failed' (stop_reason 'unavailable'); one that refuses for good raises ProposerUnavailable
    with the card left 'searching': neither is 'done', as no answer came.
    """
    log.upsert_card(run_id, card, hardware.floor_us(card.io_bytes()))
    log.set_card_status(run_id, card.id, "searching")
    if spend is None:
        spend = Spend.from_log(log, run_id, max_cost_usd=budget.max_cost_usd, max_tokens=budget.max_tokens)
    proposer.bind(log, run_id, spend)
    search = _CardSearch(card, proposer, evaluator, log, run_id, budget, hardware, policy, spend, repair_attempts,
                         cancel)
    outcome = search.run(rng_seed, on_progress)
    if outcome.stop_reason == "unavailable":
        log.set_card_status(run_id, card.id, "failed", f"the proposer gave no answer: {outcome.stop_detail}")
    elif outcome.stop_reason != "interrupted":
        log.set_card_status(run_id, card.id, "done")
    return outcome


__all__ = ["Budget", "Policy", "SearchOutcome", "SearchProgress", "search_card", "select"]
