"""The MCTS loop on a seeded toy problem: saved tree, scale invariance, failures, dedupe, budgets.

The saved tree (tests/data/toy_tree.json) pins the search's behaviour. Regenerate it only
on purpose, after a deliberate change of the policy: KFORGE_REGENERATE_TOY_TREE=1 pytest tests/test_mcts.py

Every test runs twice: over a run directory's SQLite store and over a MemoryStore (the
search must not know which one it writes to).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest
from fakes import FAST_HW, FakeEvaluator, FakeProposer, toy_card

from kforge.errors import BudgetExhausted, ProposerError, ProposerUnavailable
from kforge.hardware import Hardware
from kforge.store import MemoryStore, SQLiteStore
from kforge.search import Budget, search_card
from kforge.search.tree import Tree
from kforge.verdict import EvalResult, Verdict

TOY_TREE = Path(__file__).parent / "data" / "toy_tree.json"
RUN = "run-1"


def _new_store(where: Path):
    raise AssertionError("the backend fixture sets this")


@pytest.fixture(autouse=True, params=["sqlite", "memory"])
def backend(request, monkeypatch):
    """The store every _search of the test writes to: a run directory's, or one in memory."""
    make = SQLiteStore if request.param == "sqlite" else (lambda where: MemoryStore())
    monkeypatch.setattr(sys.modules[__name__], "_new_store", make)
    return request.param


def _search(tmp_path, card=None, proposer=None, evaluator=None, log=None, **kw):
    log = log or _new_store(tmp_path)
    log.start_run(RUN)
    kw.setdefault("budget", Budget(iterations=40))
    kw.setdefault("hardware", FAST_HW)
    outcome = search_card(card or toy_card(), proposer or FakeProposer(), evaluator or FakeEvaluator(), log, RUN, **kw)
    return outcome, log


def test_seeded_toy_search_matches_the_saved_tree(tmp_path):
    outcome, _ = _search(tmp_path, rng_seed=3)
    got = outcome.tree.to_json()
    if os.environ.get("KFORGE_REGENERATE_TOY_TREE"):
        TOY_TREE.write_text(json.dumps(got, indent=1) + "\n")
    assert got == json.loads(TOY_TREE.read_text())


def test_same_tree_at_microsecond_and_millisecond_scale(tmp_path):
    micro, _ = _search(tmp_path / "us", card=toy_card(eager_us=7.0), rng_seed=3)
    milli, _ = _search(tmp_path / "ms", card=toy_card(eager_us=7000.0), rng_seed=3)
    assert micro.tree.to_json() == milli.tree.to_json()
    assert micro.best_speedup == pytest.approx(milli.best_speedup)


def test_seed_changes_the_tree_and_repeats_it(tmp_path):
    a, _ = _search(tmp_path / "a", rng_seed=1)
    b, _ = _search(tmp_path / "b", rng_seed=1)
    c, _ = _search(tmp_path / "c", rng_seed=2)
    assert a.tree.to_json() == b.tree.to_json()
    assert a.tree.to_json() != c.tree.to_json()


@pytest.mark.parametrize("seed", range(4))
def test_failures_are_recorded_but_never_expanded(tmp_path, seed):
    outcome, log = _search(tmp_path, rng_seed=seed)
    rows = {r.id: r for r in log.candidates(RUN, outcome.card_id)}
    failed = {i for i, r in rows.items() if Verdict(r.verdict).failed}
    assert failed, "the toy landscape has compile errors and incorrect kernels"
    assert not any(r.parent_id in failed for r in rows.values())
    for node in outcome.tree:
        if node.failed:
            assert node.children == [] and node.q == 0.0
    # A repair is a sibling of what it repairs, and only errors are repaired.
    for r in rows.values():
        if r.repair_of is not None:
            broken = rows[r.repair_of]
            assert Verdict(broken.verdict).repairable
            assert r.parent_id == broken.parent_id and r.iteration == broken.iteration


def test_repair_loop_fixes_compile_errors_within_its_bound(tmp_path):
    outcome, log = _search(tmp_path, rng_seed=0, budget=Budget(iterations=60))
    rows = log.candidates(RUN, outcome.card_id)
    repairs = [r for r in rows if r.repair_of is not None]
    assert repairs and all(r.knobs["unroll"] == 1 for r in repairs)
    per_iteration: dict[int, int] = {}
    for r in rows:
        per_iteration[r.iteration] = per_iteration.get(r.iteration, 0) + 1
    assert max(per_iteration.values()) <= 1 + 2  # one expansion + repair_attempts


def test_no_repair_when_repair_attempts_is_zero(tmp_path):
    outcome, log = _search(tmp_path, rng_seed=0, repair_attempts=0)
    assert all(r.repair_of is None for r in log.candidates(RUN, outcome.card_id))


def test_duplicates_are_skipped_without_evaluation(tmp_path):
    evaluator = FakeEvaluator()
    outcome, log = _search(tmp_path, evaluator=evaluator, rng_seed=0)
    assert len(evaluator.calls) == len(set(evaluator.calls)) == outcome.evaluated
    digests = [r.digest for r in log.candidates(RUN, outcome.card_id)]
    assert len(digests) == len(set(digests))
    dupes = log.events(RUN, "duplicate")
    assert dupes and outcome.evaluated + len(dupes) >= outcome.iterations  # skipped iterations still count


def test_evaluator_exception_becomes_a_recorded_failure(tmp_path):
    evaluator = FakeEvaluator(raise_on=lambda k: k["threads"] == 128)
    outcome, log = _search(tmp_path, evaluator=evaluator, rng_seed=0)
    rows = log.candidates(RUN, outcome.card_id)
    crashed = [r for r in rows if "evaluator_error" in r.evidence]
    assert crashed and all(r.verdict == "runtime_error" for r in crashed)
    assert not any(r.repair_of in {c.id for c in crashed} for r in rows)  # not the kernel's fault: no repair
    assert log.events(RUN, "evaluator_error")
    assert outcome.iterations == 40 and outcome.stop_reason == "iterations"


class _BrokenProposer(FakeProposer):
    def propose(self, ctx):
        if ctx.parent is not None:
            raise RuntimeError("no revision for you")
        return super().propose(ctx)


def test_proposer_exception_is_recorded_and_the_node_given_up(tmp_path):
    outcome, log = _search(tmp_path, proposer=_BrokenProposer(), rng_seed=0, budget=Budget(iterations=30))
    errors = log.events(RUN, "proposer_error")
    assert errors and "no revision for you" in errors[0].message
    rows = log.candidates(RUN, outcome.card_id)
    assert all(r.parent_id is None for r in rows)  # only first versions could be made
    assert outcome.iterations == 30


def test_search_ends_when_nothing_is_left_to_expand(tmp_path):
    class Nothing(FakeProposer):
        def propose(self, ctx):
            raise RuntimeError("nothing new")

    outcome, _ = _search(tmp_path, proposer=Nothing())
    assert outcome.stop_reason == "exhausted" and outcome.iterations == 2  # Policy.proposer_retries at the root


# ---- budgets ------------------------------------------------------------------------------

def test_iteration_budget(tmp_path):
    outcome, log = _search(tmp_path, budget=Budget(iterations=12))
    assert outcome.stop_reason == "iterations" and outcome.iterations == 12
    assert log.card_iterations(RUN, outcome.card_id) == 12
    assert max(r.iteration for r in log.candidates(RUN, outcome.card_id)) <= 11
    assert log.card(RUN, outcome.card_id).status == "done"


def test_wall_time_budget(tmp_path):
    outcome, _ = _search(tmp_path, evaluator=FakeEvaluator(sleep_s=0.05), budget=Budget(iterations=1000, wall_time_s=0.4))
    assert outcome.stop_reason == "wall_time" and 1 <= outcome.iterations < 30


def test_a_card_whose_time_ran_out_before_any_candidate_says_so_in_its_package(tmp_path):
    """A run's shared wall time can end before a card's first candidate: the card says which
    budget ran out and what to change, where it said 'no candidate was evaluated'; a later
    search of it that evaluates something clears that."""
    from kforge.winners import choose

    outcome, log = _search(tmp_path, budget=Budget(iterations=40, wall_time_s=0.0))
    row = log.card(RUN, outcome.card_id)
    assert outcome.stop_reason == "wall_time" and row.status == "done" and not log.candidates(RUN, outcome.card_id)
    assert choose([], row.skip_reason).reason == ("not searched: the run's wall time ran out before its turn (give it "
                                                  "more --wall-time, or search fewer cards with a higher --min-share)")
    outcome, log = _search(tmp_path, log=log, budget=Budget(iterations=3))
    assert log.candidates(RUN, outcome.card_id) and log.card(RUN, outcome.card_id).skip_reason is None


def test_cost_budget_and_llm_accounting(tmp_path):
    proposer = FakeProposer(cost_usd=0.01, tokens=100)
    outcome, log = _search(tmp_path, proposer=proposer, budget=Budget(iterations=100, max_cost_usd=0.035))
    assert outcome.stop_reason == "cost"
    calls = log.llm_calls(RUN)
    assert len(calls) == 3  # a 4th proposal would cross $0.035: refused before it is made
    assert log.llm_spend(RUN) == (300, pytest.approx(0.03))


def test_llm_conversations_that_gave_nothing_usable_still_count_against_the_budget(tmp_path):
    class Unusable(FakeProposer):
        """Every other conversation costs $0.01 and 100 tokens and yields no candidate."""
        asked = 0

        def propose(self, ctx):
            self.asked += 1
            if self.asked % 2:
                self.pay(ctx)
                raise ProposerError("no usable answer in 3 asks")
            return super().propose(ctx)

    outcome, log = _search(tmp_path, proposer=Unusable(cost_usd=0.01, tokens=100),
                           budget=Budget(iterations=100, max_cost_usd=0.045))
    assert outcome.stop_reason == "cost" and outcome.iterations == 4
    assert log.llm_spend(RUN) == (400, pytest.approx(0.04)) and len(log.llm_calls(RUN)) == 4
    assert len([c for c in log.candidates(RUN, outcome.card_id) if c.repair_of is None]) == 2  # half the paid asks gave one


def test_token_budget(tmp_path):
    outcome, log = _search(tmp_path, proposer=FakeProposer(tokens=1000), budget=Budget(iterations=100, max_tokens=2500))
    assert outcome.stop_reason == "tokens" and outcome.iterations == 2 and log.llm_spend(RUN)[0] == 2000


def test_budget_exhausted_from_the_proposer_stops_the_search(tmp_path):
    class Broke(FakeProposer):
        def propose(self, ctx):
            if ctx.iteration >= 5:
                raise BudgetExhausted("LLM budget of $1 spent")
            return super().propose(ctx)

    outcome, log = _search(tmp_path, proposer=Broke())
    assert outcome.stop_reason == "budget" and outcome.iterations == 5
    assert "LLM budget" in log.events(RUN, "budget")[0].message


def test_stops_near_the_hbm_floor(tmp_path):
    card = toy_card(eager_us=7.0)
    # Pick a bandwidth that puts the floor at 2.5 µs: speedup 2.52x or more is within 90% of it.
    hw = Hardware("tight GPU", "sm_90", 132, 60 * 2**20, 227 * 1024, 141 * 10**9, card.io_bytes() / 2.5e-6)
    outcome, _ = _search(tmp_path, card=card, hardware=hw, budget=Budget(iterations=200))
    assert outcome.stop_reason == "near_floor" and outcome.iterations < 200
    assert 2.5 / outcome.best.result.kernel_us >= 0.9


def test_stagnation_restarts_from_the_root_with_more_exploration(tmp_path):
    flat = FakeEvaluator(speedup=lambda card, knobs: 1.5)  # nothing ever beats the first valid kernel

    def roots(budget):
        outcome, log = _search(tmp_path / str(budget.stagnation), evaluator=flat, budget=budget, rng_seed=0)
        stalls = log.events(RUN, "stagnation")
        return len(outcome.tree.root.children), stalls

    stalled_roots, stalls = roots(Budget(iterations=40, stagnation=5))
    steady_roots, no_stalls = roots(Budget(iterations=40, stagnation=10**6))
    assert stalls and "c=1.4" in stalls[0].message and not no_stalls
    assert stalled_roots > steady_roots


def test_cancel_stops_after_the_candidate_in_flight_without_repairing_it(tmp_path):
    cancel = threading.Event()

    class CtrlCDuringAFailure(FakeEvaluator):
        def evaluate(self, card, cand):
            result = super().evaluate(card, cand)
            if result.verdict.repairable:
                cancel.set()  # another thread's Ctrl-C arrives while this candidate is evaluated
            return result

    outcome, log = _search(tmp_path, evaluator=CtrlCDuringAFailure(), rng_seed=0, cancel=cancel)
    rows = log.candidates(RUN, outcome.card_id)
    assert outcome.stop_reason == "interrupted" and rows[-1].verdict == "compile_error"
    assert all(r.repair_of is None for r in rows)
    assert log.card(RUN, outcome.card_id).status == "searching"  # resumes later


def test_a_valid_verdict_without_timings_never_becomes_the_best(tmp_path):
    class FirstUntimed(FakeEvaluator):
        def evaluate(self, card, cand):
            result = super().evaluate(card, cand)
            if len(self.calls) == 1:
                return EvalResult(Verdict.VALID, "timing lost")
            return result

    outcome, log = _search(tmp_path, evaluator=FirstUntimed(), rng_seed=0, budget=Budget(iterations=10))
    assert outcome.stop_reason == "iterations" and outcome.best_speedup > 1
    assert outcome.best.id == Tree.replay(log.candidates(RUN, outcome.card_id)).best().id


def test_progress_is_reported_every_iteration(tmp_path):
    seen = []
    outcome, _ = _search(tmp_path, budget=Budget(iterations=10), on_progress=seen.append)
    assert [p.iteration for p in seen] == list(range(1, 11))
    assert all(p.iterations == 10 and p.card_id == outcome.card_id for p in seen)
    assert seen[-1].best_speedup == outcome.best_speedup


def test_best_is_the_fastest_valid_candidate(tmp_path):
    outcome, log = _search(tmp_path, rng_seed=5)
    rows = log.candidates(RUN, outcome.card_id)
    fastest = max((r for r in rows if r.verdict == "valid"), key=lambda r: r.speedup)
    assert outcome.best.id == fastest.id
    card_row = log.card(RUN, outcome.card_id)
    assert card_row.best_candidate == fastest.id and card_row.best_speedup == pytest.approx(fastest.speedup)


def test_a_card_with_no_kernel_faster_than_eager_is_given_up(tmp_path):
    """Eager at the roofline (add_ on big tensors): after `give_up` iterations without a
    valid kernel the card stops, leaving the run's time to cards that can still win."""
    outcome, _ = _search(tmp_path, evaluator=FakeEvaluator(speedup=lambda card, k: 0.9),
                         budget=Budget(iterations=50, give_up=12))
    assert outcome.stop_reason == "no_gain" and outcome.iterations == 12
    outcome, _ = _search(tmp_path / "never", evaluator=FakeEvaluator(speedup=lambda card, k: 0.9),
                         budget=Budget(iterations=30, give_up=0))
    assert outcome.stop_reason == "iterations"
    outcome, _ = _search(tmp_path / "wins", budget=Budget(iterations=30, give_up=5))
    assert outcome.stop_reason != "no_gain"  # one valid kernel is enough to go on


def test_a_proposer_service_that_stays_down_stops_the_card_and_one_that_refuses_stops_the_search(tmp_path):
    class Down(FakeProposer):
        asked = 0

        def propose(self, ctx):
            self.asked += 1
            raise ProposerUnavailable("endpoint down", transient=True)

    down = Down()
    outcome, log = _search(tmp_path / "down", proposer=down, budget=Budget(iterations=100))
    assert (outcome.stop_reason, outcome.stop_detail, down.asked) == ("unavailable", "endpoint down", 3)
    card_row = log.card(RUN, outcome.card_id)
    assert (card_row.status, card_row.skip_reason) == ("failed", "the proposer gave no answer: endpoint down")

    class Refused(FakeProposer):
        def propose(self, ctx):
            raise ProposerUnavailable("bad key")

    log = _new_store(tmp_path / "refused")
    with pytest.raises(ProposerUnavailable, match="bad key"):
        _search(tmp_path / "refused", proposer=Refused(), log=log)
    assert log.card(RUN, toy_card().id).status == "searching"  # never 'done': no answer came


def test_only_consecutive_unanswered_asks_stop_a_card(tmp_path):
    class Flaky(FakeProposer):
        """Down, down, then an answer it cannot use, and again: never 3 unanswered in a row."""
        asked = 0

        def propose(self, ctx):
            self.asked += 1
            if self.asked % 3:
                raise ProposerUnavailable("endpoint down", transient=True)
            raise ProposerError("no usable answer")

    outcome, _ = _search(tmp_path, proposer=Flaky(), budget=Budget(iterations=30))
    assert outcome.stop_reason != "unavailable"
