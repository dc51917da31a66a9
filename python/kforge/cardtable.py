"""Which cards the search takes, and the table of cards `kforge capture` and `kforge inspect` print."""

from __future__ import annotations

import math
from typing import AbstractSet, Sequence

from .cards import Card
from .hardware import Hardware
from .op_capture import nested_in


# Every family but views and vendor ops: whether a card is searched is then up to the
# proposer (`supports`), so `other` ops (cumsum, index, scatter, cat, ...) reach the LLM. A
# region card (capture(regions=True)) is searched like the families it fuses.
SEARCHABLE = frozenset({"pointwise", "reduction", "normalization", "pooling", "other", "region"})

_SKIP_REASONS = {
    "view": "view/metadata op: no kernel to write",
    "vendor": "vendor-backed (cuBLAS/cuDNN): skipped unless asked",
}


def skip_reason(card: Card) -> str | None:
    """Why the search leaves this card alone, or None when it is searchable."""
    if card.family not in SEARCHABLE:
        return _SKIP_REASONS.get(card.family, f"family {card.family!r} is not searched")
    return resizes(card)


def resizes(card: Card) -> str | None:
    """Why no kernel can serve this call, where it resizes a tensor it writes: `abs(x)` runs as
    `abs.out` into an empty tensor that the op resizes first. A kernel writes into the tensors it
    is given, so one for such a call would write past the end of the empty one (the search skips
    it; a package that carries one is not dispatched)."""
    def dims(m) -> str:
        return "x".join(map(str, m.shape)) or "scalar"

    for j, i in card.aliases.items():
        before, after = card.inputs[i], card.outputs[j]
        if (before.shape, before.stride) != (after.shape, after.stride):
            return (f"the call resizes the tensor it writes ({dims(before)} before, {dims(after)} after): "
                    "a kernel writes into tensors as given")
    return None


# A card whose eager call already runs at the memory floor still ranks by a tenth of its share
# (the floor counts a broadcast input whole, so an at-floor call can measure below it).
HEADROOM_MIN = 0.1


def headroom(card: Card, hardware: Hardware | None) -> float:
    """The share of the model's time a kernel at the memory floor would save on this card: its share
    times the part of its eager time above the time its bytes take at the copy bandwidth. On an
    H100 ECA-NFNet-L0's channels-last avg_pool2d took 96 µs for 21 µs of bytes (share 1 %, headroom
    0.8 %), while a residual add at the floor saves next to nothing whatever its share."""
    share = card.share or 0.0
    if hardware is None or not card.eager_us:
        return share
    return share * max(HEADROOM_MIN, 1.0 - hardware.floor_us(card.io_bytes()) / card.eager_us)


def search_order(cards: Sequence[Card], hardware: Hardware | None = None,
                 alone: AbstractSet[str] = frozenset()) -> list[Card]:
    """The chosen cards in the order the search takes them: region cards and the single-op cards
    in `alone` (calls the traced graphs make outside every region: capture's regions.json) by
    headroom (by share where `hardware` is not given), then the other single-op cards so, except
    that a card whose every call runs inside another chosen card's op (clamp_min_ inside relu_,
    copy_ inside _to_copy) comes after all the others. A call in `alone` is one kforge.optimize
    runs as a single-op card (ECA-NFNet-L0's channels-last avg_pool2d, 4.5x its memory floor,
    waited behind every region card in a 40 s H100 search). With a deadline the search time goes
    first to what kforge.optimize and kforge.compile replace: a 50 s ResNet-50 bf16 search on an
    H100 reached 20 candidates, spent many of them on single-op batch norms (which only
    pkg.apply uses: eager's batch norm is not a call of the traced graphs) and left 8 of its 17
    batch-norm regions unsearched, which then ran as eager runs them (kforge.optimize 0.88x
    torch.compile; 1.10x with all of them, in 100 s).
    A nested card's calls run only where the outer op's kernel falls back, and its share is
    already in the outer card's."""
    ops = {c.op.removeprefix("aten::") for c in cards}
    return sorted(cards, key=lambda c: (nested_in(c) in ops, c.region is None and c.id not in alone,
                                        -headroom(c, hardware)))


def cards_table(cards: list[Card], limit: int | None = None, searchable_only: bool = False):
    """A rich Table of cards ranked by share: op with shapes/dtypes, family, calls, time, share,
    status, card id (what `kforge search --cards` takes) and where in the model it ran. With
    `searchable_only`, cards the search leaves alone (view ops, vendor libraries) are left out."""
    from rich.table import Table

    ranked = sorted(cards, key=lambda c: -(c.share or 0.0))
    picked = [c for c in ranked if skip_reason(c) is None] if searchable_only else ranked
    shown = picked[:limit] if limit is not None else picked
    table = Table(title="operator cards", show_lines=False)
    for name, justify in (("#", "right"), ("op (shapes:dtypes)", "left"), ("family", "left"), ("calls", "right"),
                          ("eager µs", "right"), ("share", "right"), ("status", "left"), ("card", "left"),
                          ("module", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    nested = 0
    for i, c in enumerate(shown, 1):
        status = skip_reason(c) or "searchable"
        inside = nested_in(c)
        if inside:
            nested += 1
            status += f"; inside {inside}"
        table.add_row(str(i), c.summary(), c.family, str(c.calls), _fmt(c.eager_us, "{:.1f}"),
                      _fmt(c.share, "{:.1%}"), status, c.id, module_path(c))
    hidden = len(ranked) - len(shown)
    captions = [f"{hidden} more cards not shown" + (" (--all lists them)" if searchable_only else "")] if hidden else []
    if nested:
        captions.append("a card marked 'inside' runs within another card's calls: its share is also in that "
                        "card's share (the other cards' shares add up to 100 %)")
    table.caption = "\n".join(captions) or None
    return table


def module_path(card: Card) -> str:
    """Where in the model a card ran: its first module path, and how many others there are."""
    paths = card.module_paths or []
    return (paths[0] + (f" (+{len(paths) - 1})" if len(paths) > 1 else "")) if paths else "-"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or math.isnan(x) else spec.format(x)
