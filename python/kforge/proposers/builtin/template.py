"""What a template provides, and how its output becomes a Candidate.

A template owns a few aten ops. For a card it can say why it declines, list its knob
spaces (one per algorithm: every combination of the listed values is a legal kernel for
the card, values ordered from the most conservative to the most aggressive), pick a
default from shapes and hardware, and build the specialized candidate for any point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from ...candidate import Candidate, KernelLaunch, LaunchPlan
from ...cards import Card
from ...hardware import Hardware
from .common import cuda_source

KnobSpace = dict[str, tuple]  # knob -> legal values, conservative first; "algo" has one value
Knobs = dict[str, Any]


@dataclass(frozen=True)
class Template:
    name: str
    ops: frozenset[str] | None  # None: any op, and `check` says which cards it declines (the generator)
    check: Callable[[Card], str | None]  # why the card is declined, or None
    spaces: Callable[[Card, Hardware], list[KnobSpace]]
    default: Callable[[Card, Hardware], Knobs]
    build: Callable[[Card, Knobs, Hardware], Candidate]

    def takes(self, op: str) -> bool:
        return self.ops is None or op in self.ops


def launch(name: str, grid, block, args: list[dict], smem: int = 0, cooperative: bool = False,
           pdl: bool = False, cluster: int = 0) -> KernelLaunch:
    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = tuple(block) + (1,) * (3 - len(block))
    return KernelLaunch(name, grid, block, smem, args, cooperative, pdl, cluster)


def candidate(template: str, card: Card, knobs: Knobs, dtypes, body: str, kernels: list[KernelLaunch],
              workspace: list | None = None, note: str = "") -> Candidate:
    title = f"{template} {card.op} knobs={json.dumps(knobs, sort_keys=True)}"
    return Candidate(source=cuda_source(title, dtypes, body), plan=LaunchPlan(kernels, workspace or [], []),
                     kind="custom", proposer="builtin", knobs=dict(knobs), note=note)


def pick(values: tuple, target) -> Any:
    """The legal value nearest to a heuristic target (ties go to the conservative one)."""
    return min(values, key=lambda v: (abs(v - target), v)) if values else target
