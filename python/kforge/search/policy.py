"""The MCTS policy as small pure functions: reward, UCT selection, progressive widening.

Rewards are functions of the speedup over eager only, never of raw latencies, so a tree
of 7 µs kernels is explored exactly like a tree of 7 ms kernels.
"""

from __future__ import annotations

import math
import random
from typing import Sequence

from ..verdict import EvalResult, Verdict

# Speedups at or beyond S_MAX (or at or below 1/S_MAX) saturate the reward. 32, not 8: the H200
# gave 10-19x on group_norm and pooling, and a saturated reward cannot tell those apart.
S_MAX = 32.0


def reward(speedup: float | None, s_max: float = S_MAX) -> float:
    """Normalized reward in [0, 1]: r = clip(0.5 + log2(s) / (2 * log2(s_max)), 0, 1).

    Eager speed (s = 1) is 0.5, s_max times faster is 1, s_max times slower is 0. The log
    makes 2x faster and 2x slower symmetric around eager, and only the ratio matters.
    A missing or non-positive speedup is a failure: 0.
    """
    if speedup is None or not speedup > 0 or not math.isfinite(speedup):
        return 0.0
    r = min(1.0, max(0.0, 0.5 + math.log2(speedup) / (2.0 * math.log2(s_max))))
    # Rounded far below timing noise so that eager/kernel computed at another latency scale
    # (7 µs vs 7 ms) gives bit-identical rewards, hence an identical tree.
    return round(r, 9)


def result_reward(result: EvalResult, s_max: float = S_MAX) -> float:
    """Reward of an evaluation: failures (and untimed compiles) earn 0 so their branch cools down."""
    if result.verdict in (Verdict.VALID, Verdict.SLOWER):
        return reward(result.speedup, s_max)
    return 0.0


def uct(total: float, visits: int, parent_visits: int, c: float) -> float:
    """UCT score Q/N + c * sqrt(ln N_parent / N); an unvisited child scores +inf."""
    if visits == 0:
        return math.inf
    return total / visits + c * math.sqrt(math.log(max(parent_visits, 1)) / visits)


def argmax_random(scores: Sequence[float], rng: random.Random) -> int:
    """Index of the highest score, ties broken uniformly with the search's seeded rng."""
    best = max(scores)
    return rng.choice([i for i, s in enumerate(scores) if s == best])


def widening_limit(visits: int, k: float, alpha: float) -> float:
    """Progressive widening: a node may hold up to k * N^alpha children (N >= 1)."""
    return k * max(visits, 1) ** alpha


def may_widen(n_children: int, visits: int, k: float, alpha: float) -> bool:
    return n_children < widening_limit(visits, k, alpha)


def annealed_alpha(progress: float, start: float, end: float) -> float:
    """Widening exponent moved linearly from `start` to `end` over the budget (progress in [0, 1]):
    wide early, to find good first versions, then deeper, refining the best ones."""
    p = min(1.0, max(0.0, progress))
    return start + (end - start) * p
