"""Monte Carlo tree search over kernel revisions of one card.

One iteration: select (UCT down the tree while progressive widening forbids a new child)
-> expand (the proposer writes a first version or a revision; a candidate whose digest was
already evaluated is skipped) -> evaluate -> bounded repair of compile/load/runtime errors
-> backpropagate. Every evaluated candidate is one store record, committed before the loop moves
on, and one backup, so a killed search resumes from the log without losing or repeating
an evaluation. Proposer and evaluator exceptions are recorded, never a crashed search.

The search is functions over the tree (`State`), the proposer and the evaluator (`Search`);
what it records goes to the store through one callback object (`CardLog`), so it runs the
same over a run directory's SQLite log and over a MemoryStore.
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
from ..proposers.base import Proposal, ProposalContext, Proposer, Tried
from ..spend import Spend
from ..store import SearchStore
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


class CardLog:
    """The store as one card's search calls it back: everything the search records goes
    through here (the store may be a run directory's SQLite log or a MemoryStore)."""

    def __init__(self, store: SearchStore, run_id: str, card_id: str):
        self.store, self.run_id, self.card_id = store, run_id, card_id

    def candidate(self, cand: Candidate, result: EvalResult, *, parent_id: int | None, iteration: int, reward: float,
                  repair_of: int | None, eval_s: float) -> int:
        """Record an evaluated candidate; its id."""
        return self.store.add_candidate(self.run_id, self.card_id, cand, result, parent_id=parent_id,
                                        iteration=iteration, reward=reward, repair_of=repair_of, eval_s=eval_s)

    def event(self, kind: str, message: str, level: str = "info") -> None:
        self.store.event(self.run_id, kind, message, level=level, card_id=self.card_id)

    def iterations(self, done: int) -> None:
        self.store.note_iteration(self.run_id, self.card_id, done)


@dataclass(frozen=True)
class Search:
    """What one card's search works with: the card, the proposer, the evaluator, the store
    callback and the limits. The functions below take it with the tree they grow."""

    card: Card
    proposer: Proposer
    evaluator: Evaluator
    log: CardLog
    budget: Budget
    hardware: Hardware
    policy: Policy
    spend: Spend
    repair_attempts: int
    cancel: threading.Event | None = None

    @property
    def floor_us(self) -> float:
        return self.hardware.floor_us(self.card.io_bytes())

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


@dataclass
class State:
    """A card's search so far: the tree, its best node, and this session's counters."""

    tree: Tree
    best: Node | None = None
    evaluated: int = 0  # candidates evaluated this session
    unanswered: int = 0  # consecutive asks the proposer's service did not answer

    @property
    def best_speedup(self) -> float | None:
        return self.best.tried.result.speedup if self.best else None


# ---- the loop -------------------------------------------------------------------------------

def run_search(s: Search, state: State, it: int, rng_seed: int,
               on_progress: Callable[[SearchProgress], None] | None) -> SearchOutcome:
    """Iterate from iteration `it` (what the store says is done) until a stop reason holds."""
    # Seeded by where this session starts, so a resumed search is reproducible too.
    rng = random.Random(f"{rng_seed}:{s.card.id}:{it}")
    started = time.monotonic()
    c, stagnant, from_root = s.policy.c, 0, False
    detail = ""
    while True:
        stop = stop_reason(s, state, it, started)
        if stop:
            break
        alpha = P.annealed_alpha(it / max(s.budget.iterations, 1), s.policy.alpha_start, s.policy.alpha_end)
        tree = state.tree
        leaf = tree.root if from_root and tree.root.expandable else select(tree, rng, c, s.policy.k, alpha)
        from_root = False
        if leaf is None:
            stop = "exhausted"
            break
        previous_best = state.best
        try:
            last = expand(s, state, leaf, it, rng)
        except BudgetExhausted as e:
            s.log.event("budget", str(e))
            stop = e.reason
            break
        except ProposerUnavailable as e:
            if not e.transient:  # no later ask can do better: the run stops
                raise
            stop, detail = "unavailable", str(e)  # it stayed down for unavailable_after asks
            break
        it += 1
        s.log.iterations(it)
        if state.best is not previous_best:
            c, stagnant = s.policy.c, 0
        else:
            stagnant += 1
            if stagnant >= s.budget.stagnation:
                c, stagnant, from_root = s.policy.c * s.policy.stagnation_boost, 0, True
                s.log.event("stagnation", f"no new best in {s.budget.stagnation} iterations: exploring from the root "
                                          f"with c={c:g}")
        if on_progress:
            on_progress(SearchProgress(s.card.id, it, s.budget.iterations, state.best_speedup,
                                       last.result.verdict.value if last else None))
    s.log.event("search_done", f"stopped ({stop}) after {it} iterations")
    return SearchOutcome(s.card.id, state.best.tried if state.best else None, it, state.evaluated, stop, state.tree,
                         detail)


def stop_reason(s: Search, state: State, it: int, started: float) -> str | None:
    b, now = s.budget, time.monotonic()
    if s.cancelled():
        return "interrupted"
    if it >= b.iterations:
        return "iterations"
    if (b.wall_time_s is not None and now - started >= b.wall_time_s) or (b.deadline is not None and now >= b.deadline):
        return "wall_time"
    over = s.spend.over()
    if over:
        return over
    best_us = state.best.tried.result.kernel_us if state.best else None
    if best_us and s.floor_us > 0 and s.floor_us / best_us >= b.near_floor:
        return "near_floor"
    if b.give_up and it >= b.give_up and state.best is None:
        return "no_gain"  # e.g. eager is already at the roofline: the budget is better spent elsewhere
    return None


# ---- one expansion and its repairs ---------------------------------------------------------

def context(s: Search, state: State, leaf: Node, it: int, rng: random.Random) -> ProposalContext:
    return ProposalContext(
        card=s.card, hardware=s.hardware, parent=leaf.tried, lineage=Tree.lineage(leaf),
        best=state.best.tried if state.best else None,
        sibling_failures=[ch.tried for ch in leaf.children if ch.failed],
        tried_digests=set(state.tree.digests), iteration=it, rng=rng,
    )


def expand(s: Search, state: State, leaf: Node, it: int, rng: random.Random) -> Tried | None:
    """Propose under `leaf`, evaluate, repair; returns the last evaluated candidate, if any."""
    ctx = context(s, state, leaf, it, rng)
    proposal = ask(s, state, leaf, "propose", lambda: s.proposer.propose(ctx))
    if proposal is None:
        return None
    tried = evaluate(s, state, leaf, proposal, it, repair_of=None)
    if tried is None:
        return None
    for _ in range(s.repair_attempts):
        if not tried.result.verdict.repairable or "evaluator_error" in tried.result.evidence:
            break
        if s.cancelled():  # stop after the candidate in flight, not after its repairs
            break
        ctx = context(s, state, leaf, it, rng)
        failed = tried
        proposal = ask(s, state, leaf, "repair", lambda: s.proposer.repair(ctx, failed))
        repaired = evaluate(s, state, leaf, proposal, it, repair_of=failed.id) if proposal else None
        if repaired is None:
            break
        tried = repaired
    return tried


def ask(s: Search, state: State, leaf: Node, what: str, call: Callable[[], Proposal | None]) -> Proposal | None:
    """Call the proposer; an exception is recorded against the node, never raised, except
    BudgetExhausted and KeyboardInterrupt, a ProposerUnavailable that is not transient, and
    a transient one that lasted `unavailable_after` asks: these stop the search."""
    try:
        proposal = call()
    except (BudgetExhausted, KeyboardInterrupt):
        raise
    except Exception as e:  # any proposer bug or bad reply becomes a recorded failure
        s.log.event("proposer_error", f"{what} failed: {type(e).__name__}: {e}", level="warning")
        if isinstance(e, ProposerUnavailable):  # the service's fault, not the node's
            state.unanswered += 1
            if not e.transient or state.unanswered >= s.policy.unavailable_after:
                raise
            return None
        state.unanswered = 0  # it answered, if not usefully
        proposer_failed(s.policy, leaf)
        return None
    state.unanswered = 0
    return proposal


def proposer_failed(policy: Policy, leaf: Node) -> None:
    leaf.proposer_failures += 1
    if leaf.proposer_failures >= policy.proposer_retries:
        leaf.exhausted = True


def evaluate(s: Search, state: State, leaf: Node, proposal: Proposal, it: int, repair_of: int | None) -> Tried | None:
    """Evaluate a proposal, record it, add it to the tree and back its reward up.
    None when it was a duplicate of something already evaluated (not re-evaluated)."""
    cand = proposal.candidate
    digest = cand.digest()
    if digest in state.tree.digests:
        s.log.event("duplicate", f"candidate {digest} was already evaluated; skipped")
        proposer_failed(s.policy, leaf)
        return None
    result, eval_s = run_evaluator(s, cand)
    reward = P.result_reward(result)
    row = s.log.candidate(cand, result, parent_id=leaf.id, iteration=it, reward=reward, repair_of=repair_of,
                          eval_s=eval_s)
    tried = Tried(cand, result, row)
    node = state.tree.add(tried, leaf, digest)
    Tree.backpropagate(node, reward)
    state.evaluated += 1
    # The same rule as Tree.best, so a resumed search keeps the same best.
    if result.verdict is Verdict.VALID and result.speedup and (state.best is None or
                                                               result.speedup > state.best_speedup):
        state.best = node
    return tried


def run_evaluator(s: Search, cand: Candidate) -> tuple[EvalResult, float]:
    t0 = time.monotonic()
    try:
        result = s.evaluator.evaluate(s.card, cand)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # the evaluator must not raise, but one that does must not end the search
        s.log.event("evaluator_error", f"{type(e).__name__}: {e}", level="error")
        result = EvalResult(Verdict.RUNTIME_ERROR, f"the evaluator raised {type(e).__name__}: {e}",
                            evidence={"evaluator_error": repr(e)})
    return result, time.monotonic() - t0


def search_card(card: Card, proposer: Proposer, evaluator: Evaluator, log: SearchStore, run_id: str, *,
                budget: Budget = Budget(), hardware: Hardware, rng_seed: int = 0, repair_attempts: int = 2,
                on_progress: Callable[[SearchProgress], None] | None = None, policy: Policy = Policy(),
                spend: Spend | None = None, cancel: threading.Event | None = None) -> SearchOutcome:
    """Search kernels for one card, continuing whatever the store `log` already holds for it
    (a run directory's SQLiteStore, or a MemoryStore).

    The card is registered in the store (status 'searching', then 'done'). `spend` is shared
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
    s = Search(card, proposer, evaluator, CardLog(log, run_id, card.id), budget, hardware, policy, spend,
               repair_attempts, cancel)
    tree = Tree.replay(log.candidates(run_id, card.id))
    outcome = run_search(s, State(tree, tree.best()), log.card_iterations(run_id, card.id), rng_seed, on_progress)
    if outcome.stop_reason == "unavailable":
        log.set_card_status(run_id, card.id, "failed", f"the proposer gave no answer: {outcome.stop_detail}")
    elif outcome.stop_reason != "interrupted":
        log.set_card_status(run_id, card.id, "done", None if outcome.tree.digests else _nothing_tried(outcome.stop_reason))
    return outcome


_STOPPED = {"wall_time": "the run's wall time ran out before its turn (give it more --wall-time, or search fewer "
                         "cards with a higher --min-share)",
            "cost": "the LLM cost budget ran out before its turn (--max-cost)",
            "tokens": "the LLM token budget ran out before its turn",
            "exhausted": "the proposer had nothing new for it (no candidate, or only repeats and errors)",
            "iterations": "its iteration budget was spent before a candidate was evaluated"}


def _nothing_tried(stop: str) -> str:
    """Why a card whose search ended has no candidate at all (what the package says of it)."""
    return _STOPPED.get(stop, f"the search stopped ({stop}) before a candidate was evaluated")


__all__ = ["Budget", "CardLog", "Policy", "Search", "SearchOutcome", "SearchProgress", "State", "run_search", "search_card",
           "select"]
