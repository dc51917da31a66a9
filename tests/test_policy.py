"""The tree policy: normalized reward, UCT, random tie-break, progressive widening, selection."""

from __future__ import annotations

import math
import random

import pytest
from fakes import candidate

from kforge.proposers.base import Tried
from kforge.search import policy as P
from kforge.search.mcts import select
from kforge.search.tree import Tree
from kforge.verdict import EvalResult, Verdict


def test_reward_maps_log_speedup_to_unit_interval():
    assert P.reward(1.0) == 0.5
    assert P.reward(P.S_MAX) == 1.0
    assert P.reward(1 / P.S_MAX) == 0.0
    assert P.reward(100.0) == 1.0 and P.reward(0.001) == 0.0  # clipped
    assert P.reward(2.0) + P.reward(0.5) == pytest.approx(1.0)  # 2x faster and 2x slower mirror around eager
    assert P.reward(1.1) < P.reward(1.5) < P.reward(3.0)


@pytest.mark.parametrize("bad", [None, 0.0, -1.0, math.nan, math.inf])
def test_reward_of_missing_speedup_is_zero(bad):
    assert P.reward(bad) == 0.0


def test_reward_depends_on_the_ratio_only():
    for eager, s in [(7.0, 1.37), (3.3, 2.9), (0.9, 0.61)]:
        micro = P.reward(eager / (eager / s))
        milli = P.reward((eager * 1000) / (eager * 1000 / s))
        assert micro == milli


def test_result_reward_zero_for_failures_and_untimed():
    for v in (Verdict.COMPILE_ERROR, Verdict.INCORRECT, Verdict.RUNTIME_ERROR, Verdict.HANG, Verdict.UNTIMED):
        assert P.result_reward(EvalResult(v, eager_us=10.0, kernel_us=5.0)) == 0.0
    assert P.result_reward(EvalResult(Verdict.VALID, eager_us=10.0, kernel_us=5.0)) == P.reward(2.0)
    assert 0 < P.result_reward(EvalResult(Verdict.SLOWER, eager_us=10.0, kernel_us=12.0)) < 0.5


def test_uct_prefers_unvisited_then_value_then_exploration():
    assert P.uct(0.0, 0, 10, 0.7) == math.inf
    assert P.uct(3.0, 4, 10, 0.7) > P.uct(2.0, 4, 10, 0.7)  # same visits: higher Q wins
    assert P.uct(0.5, 1, 100, 0.7) > P.uct(5.0, 10, 100, 0.7)  # same Q: the less visited wins
    assert P.uct(2.0, 4, 10, 0.0) == 0.5  # c = 0 is pure exploitation


def test_argmax_random_breaks_ties_with_the_seeded_rng():
    scores = [0.3, 0.9, 0.9, 0.1]
    picks = {P.argmax_random(scores, random.Random(seed)) for seed in range(50)}
    assert picks == {1, 2}
    assert P.argmax_random(scores, random.Random(7)) == P.argmax_random(scores, random.Random(7))


def test_progressive_widening_grows_with_visits():
    assert P.may_widen(0, 0, 1.5, 0.5)  # an unvisited node may always get its first child
    assert not P.may_widen(2, 1, 1.5, 0.5)  # 1.5 * 1^0.5 = 1.5 children
    assert P.may_widen(2, 4, 1.5, 0.5)  # 1.5 * 2 = 3
    assert not P.may_widen(3, 4, 1.5, 0.5)
    assert P.widening_limit(100, 1.0, 0.25) < P.widening_limit(100, 1.0, 0.5)


def test_alpha_is_annealed_linearly_over_the_budget():
    assert P.annealed_alpha(0.0, 0.5, 0.25) == 0.5
    assert P.annealed_alpha(1.0, 0.5, 0.25) == 0.25
    assert P.annealed_alpha(0.5, 0.5, 0.25) == pytest.approx(0.375)
    assert P.annealed_alpha(3.0, 0.5, 0.25) == 0.25  # clamped past the budget


# ---- select() on hand-built trees -----------------------------------------------------------

def _tried(speedup: float | None, verdict: Verdict = Verdict.VALID, i: int = 0) -> Tried:
    res = EvalResult(verdict, eager_us=10.0, kernel_us=10.0 / speedup if speedup else None)
    return Tried(candidate({"threads": 64 * (i + 1), "vec": 1, "unroll": 1}), res, i + 1)


def _grow(tree: Tree, parent, speedup, verdict=Verdict.VALID):
    tried = _tried(speedup, verdict, len(tree.nodes))
    node = tree.add(tried, parent)
    Tree.backpropagate(node, P.result_reward(tried.result))
    return node


def test_select_expands_root_while_widening_allows():
    tree = Tree()
    assert select(tree, random.Random(0), 0.7, 1.5, 0.5) is tree.root
    _grow(tree, tree.root, 2.0)
    assert select(tree, random.Random(0), 0.7, 1.5, 0.5) is tree.root  # 1 child < 1.5 * 1^0.5


def test_select_descends_by_uct_when_widening_forbids():
    tree = Tree()
    fast = _grow(tree, tree.root, 4.0)
    _grow(tree, tree.root, 1.1)
    # 2 children, N=2: k=1 * 2^0.5 = 1.41 < 2, so the root may not widen; c=0 picks the better child.
    assert select(tree, random.Random(0), 0.0, 1.0, 0.5) is fast


def test_select_never_expands_failures_and_skips_exhausted_nodes():
    tree = Tree()
    _grow(tree, tree.root, None, Verdict.COMPILE_ERROR)
    _grow(tree, tree.root, None, Verdict.INCORRECT)
    # Only failures below the root: the root itself is the only thing to expand.
    assert select(tree, random.Random(0), 0.7, 1.0, 0.0) is tree.root
    ok = _grow(tree, tree.root, 1.5)
    for seed in range(20):
        assert select(tree, random.Random(seed), 5.0, 1.0, 0.0) is ok
    ok.exhausted = True
    assert select(tree, random.Random(0), 5.0, 1.0, 0.0) is tree.root
    tree.root.exhausted = True
    assert select(tree, random.Random(0), 5.0, 1.0, 0.0) is None
