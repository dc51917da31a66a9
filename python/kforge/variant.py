"""One card's kernel as dispatch sees it (Variant), what it did (Counters), and whether a card
can be dispatched at all (dispatch_blocker)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .cards import Card
from .cardtable import resizes
from .errors import CardError, KforgeError, LaunchRefused
from .guards import REASONS, GuardSpec
from .launchers import Launcher, NotPrepared

_KNOWN = frozenset(REASONS)


class DispatchError(KforgeError):
    """A card cannot be dispatched, or the dispatcher was misused."""


class Counters:
    """What the override did for one card; read by CastPackage.report().

    Calls served in C++ count into a kforge._dispatch.Counts cell, which `hits` and
    `fallbacks` read through. Inside a CUDA graph only the capture goes through the
    override: replays are not counted.
    """

    __slots__ = ("_hits", "_fallbacks", "_cell")

    def __init__(self, hits: int = 0, fallbacks: dict[str, int] | None = None):
        self._hits = hits
        self._fallbacks = collections.Counter(fallbacks or {})
        self._cell: Any = None

    @property
    def hits(self) -> int:
        return self._hits + (self._cell.hits if self._cell is not None else 0)

    @property
    def fallbacks(self) -> collections.Counter:
        """Fallbacks by reason (see REASONS); a snapshot."""
        if self._cell is None:
            return collections.Counter(self._fallbacks)
        return self._fallbacks + collections.Counter(self._cell.fallbacks())

    def hit(self) -> None:
        self._hits += 1

    def fell_back(self, reason: str) -> None:
        if reason not in _KNOWN:
            raise ValueError(f"unknown fallback reason {reason!r}: name it in kforge.guards.REASONS")
        self._fallbacks[reason] += 1

    def native_cell(self, native: Any) -> Any:
        """The C++ counts of these counters (created on first use, kept for good)."""
        if self._cell is None:
            self._cell = native.Counts()
        return self._cell

    def __repr__(self) -> str:
        return f"Counters(hits={self.hits}, fallbacks={dict(self.fallbacks)})"


def dispatch_blocker(card: Card) -> str | None:
    """Why this card's kernel cannot be dispatched through an override, or None if it can."""
    try:
        schema = card.overload()._schema
    except CardError as e:
        return str(e)
    if not all(str(r.type) == "Tensor" for r in schema.returns) or not schema.returns:
        return f"cannot dispatch: {card.op} does not return plain tensors"
    if len(card.outputs) != len(schema.returns):
        return f"cannot dispatch: card has {len(card.outputs)} outputs, {card.op} returns {len(schema.returns)}"
    if not card.inputs:
        return "cannot dispatch: the op has no tensor inputs to guard on"
    if len({m.device for m in card.inputs}) > 1:
        return "cannot dispatch: its inputs are on more than one device type (a CPU scalar tensor beside GPU tensors)"
    if any(not 0 <= i < len(card.inputs) for i in card.aliases.values()) or \
            any(not 0 <= j < len(card.outputs) for j in card.aliases):
        return f"cannot dispatch: aliases {card.aliases} name inputs or outputs the card does not have"
    resized = resizes(card)
    if resized:
        return f"cannot dispatch: {resized}"
    names = {a.name for a in schema.arguments}
    if any(a.name not in names for a in card.args):
        return f"cannot dispatch: card arguments do not match the schema of {card.op} in torch {torch.__version__}"
    try:
        GuardSpec.of_card(card, schema)
    except CardError as e:
        return f"cannot dispatch: {e}"
    return None


@dataclass(eq=False)
class Variant:
    """One card's kernel as the override sees it."""

    card: Card
    vid: int
    launcher: Launcher
    workspace: tuple[int, ...] = ()  # bytes per workspace buffer (the plan zeroes those that ask)
    counters: Counters = field(default_factory=Counters)
    guard: GuardSpec = field(init=False)  # what a call must be to run the kernel
    out_specs: tuple = field(init=False)

    def __post_init__(self) -> None:
        why = dispatch_blocker(self.card)
        if why:
            raise DispatchError(f"card {self.card.id} ({self.card.summary()}): {why}")
        self.guard = GuardSpec.of_card(self.card)
        # (aliased input index or None, shape, stride, dtype) per output, resolved once.
        self.out_specs = tuple(
            (self.card.aliases.get(j), tuple(m.shape), tuple(m.stride), m.torch_dtype)
            for j, m in enumerate(self.card.outputs))

    def run(self, ins: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The kernel on `ins` (Card.inputs order) into outputs from the caching allocator, on the
        current stream; counts the hit. None, with the reason counted, when it did not run: its
        kernels cannot load on this device ("device"), or the driver refused the launch ("refused")."""
        dev = ins[0].device
        outs = [ins[src] if src is not None else torch.empty_strided(shape, stride, dtype=dt, device=dev)
                for src, shape, stride, dt in self.out_specs]
        ws = [torch.empty(n, dtype=torch.uint8, device=dev) for n in self.workspace]
        try:
            self.launcher.launch(self.vid, ins, outs, ws, dev)
        except NotPrepared:
            self.counters.fell_back("device")
            return None
        except LaunchRefused:
            self.counters.fell_back("refused")
            return None
        self.counters.hit()
        return outs
