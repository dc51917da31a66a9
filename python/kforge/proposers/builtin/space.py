"""Knob spaces as a neighbourhood: which configs are one or two moves from another.

A move changes one knob to the next legal value (a step), one knob to any value, or two
knobs by a step each; switching algorithm is a larger move. The proposer draws among the
smallest moves first, so revisions stay local, as a tuner's neighbourhood search does.
"""

from __future__ import annotations

import itertools

from .template import Knobs, KnobSpace

SAFETY_ORDER = ("vec", "threads", "warps", "items", "rows", "lanes", "ty", "split")  # what repair shrinks first


def configs(space: KnobSpace) -> list[Knobs]:
    names = list(space)
    return [dict(zip(names, values)) for values in itertools.product(*(space[n] for n in names))]


def space_of(spaces: list[KnobSpace], knobs: Knobs) -> KnobSpace | None:
    return next((s for s in spaces if s["algo"][0] == knobs.get("algo")), None)


def _steps(space: KnobSpace, name: str, a, b) -> int | None:
    values = space[name]
    if a not in values or b not in values:
        return None
    return abs(values.index(a) - values.index(b))


def move_size(spaces: list[KnobSpace], parent: Knobs, k: Knobs) -> int:
    """1: one knob one step; 2: one knob any distance, or two knobs one step each;
    3: another algorithm; 4: anything further."""
    if k.get("algo") != parent.get("algo"):
        return 3
    space = space_of(spaces, k)
    diffs = [n for n in space if n != "algo" and k[n] != parent.get(n)]
    steps = [_steps(space, n, parent.get(n), k[n]) for n in diffs]
    if len(diffs) == 1:
        return 1 if steps[0] == 1 else 2
    if len(diffs) == 2 and steps == [1, 1]:
        return 2
    return 4


def repeats_failure(parent: Knobs, k: Knobs, failed: Knobs) -> bool:
    """k makes the same change to the parent that a failed sibling made."""
    changed = [n for n in failed if failed[n] != parent.get(n)]
    return bool(changed) and all(k.get(n) == failed[n] for n in changed)


def safer(spaces: list[KnobSpace], knobs: Knobs) -> list[Knobs]:
    """Configs of the same algorithm with one knob a step more conservative, in SAFETY_ORDER."""
    space = space_of(spaces, knobs)
    if space is None:
        return []
    out = []
    for name in SAFETY_ORDER:
        values = space.get(name, ())
        if knobs.get(name) in values and values.index(knobs[name]) > 0:
            out.append({**knobs, name: values[values.index(knobs[name]) - 1]})
    return out
