"""A card's input sets for judging a candidate: the captured sample, fresh sets drawn like it
and a held-out one, kept on the host with the tolerance derived on each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from . import cards as cards_mod
from .card_files import load_sample
from .cards import Card
from .errors import CardError
from .tolerance import Tolerance, derive, observed

HOLDOUT_SEED = 1_000_003  # fresh input set used only after timing, never during the checks


@dataclass
class InputSet:
    """One set of inputs, kept on the host (a kernel cannot scribble on host memory), and
    the tolerance of each observed tensor on it."""

    name: str
    packed: list[torch.Tensor]  # cards.pack() spans, in Card.inputs order
    tolerances: list[Tolerance]

    def materialize(self, card: Card, device: torch.device) -> list[torch.Tensor]:
        """Fresh device copies with the card's exact strides and alignment."""
        return [cards_mod.unpack(p, m, device) for p, m in zip(self.packed, card.inputs)]


def prepare(card: Card, run_dir: str | Path, device: torch.device, fresh_sets: int) -> tuple[list[InputSet], InputSet]:
    """(input sets for the checks, held-out set): the captured sample when there is one,
    then fresh sets drawn like it; tolerances derived on each. Raises CardError."""
    # One set on the device at a time: a 1 GB card's five sets at once took what the next
    # allocation needed on an 80 GB GPU.
    names = (["sample0"] if card.samples > 0 else []) + [f"seed{s}" for s in range(1, fresh_sets + 1)] + \
        [f"seed{HOLDOUT_SEED}"]
    sets = []
    for name in names:
        ins = load_sample(card, run_dir, 0, device=device)[0] if name == "sample0" else \
            card.random_inputs(int(name.removeprefix("seed")), device)
        packed = [cards_mod.pack(t) for t in ins]
        if device.type == "cuda":  # pinned: each candidate copies every set to the GPU several times
            packed = [p.pin_memory() for p in packed]
        try:
            ref = observed(card, ins, card.call_eager(ins, device=device))
        except (RuntimeError, TypeError, ValueError) as e:
            raise CardError(f"eager {card.op} fails on input set {name} of card {card.id}: {e}; "
                            "the card cannot be evaluated, capture it again") from e
        s = InputSet(name, packed, [])
        s.tolerances = derive(card, s.materialize(card, device), ref)
        sets.append(s)
        del ins, ref
    return sets[:-1], sets[-1]


def record_tolerances(evidence: dict, s: InputSet) -> None:
    """Add the tolerances a candidate passed on input set `s` to its evidence: per set, one per
    observed tensor (what the package's manifest and the dashboard read back)."""
    evidence.setdefault("tolerances", {})[s.name] = [t.to_json() for t in s.tolerances]
    evidence.setdefault("tolerance", s.tolerances[0].to_json())  # the first output on the first set
