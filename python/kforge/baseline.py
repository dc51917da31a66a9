"""The compiled baseline: a card's own call compiled alone by torch.compile, timed next to
eager and the kernel so a kernel is also judged against what torch.compile would run."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from .cards import Card
from .worker_protocol import EvalOptions

if TYPE_CHECKING:
    from .backends import Backend

class _Slot:
    """Where the i-th tensor input goes in a card's call."""

    def __init__(self, i: int):
        self.i = i


def compiled_reference(card: Card, device: torch.device, backend: Any) -> Callable[[list[torch.Tensor]], object]:
    """torch.compile of a function that makes the card's call: its op with its scalar args as
    constants, its tensors as inputs (a region replays its calls). The call is built here, not
    traced: Dynamo sees the op and nothing of kforge's card code."""
    if card.region is not None:
        def reference(*ins: torch.Tensor) -> object:
            return card.call_eager(list(ins), device=device)
    else:
        op = card.overload()
        args, kwargs = card.build_call([_Slot(i) for i in range(len(card.inputs))], device)

        def put(x: Any, ins: tuple) -> Any:
            if isinstance(x, _Slot):
                return ins[x.i]
            return [put(y, ins) for y in x] if isinstance(x, list) else x

        def reference(*ins: torch.Tensor) -> object:
            return op(*[put(a, ins) for a in args], **{k: put(v, ins) for k, v in kwargs.items()})

    compiled = torch.compile(reference, backend=backend, dynamic=False, fullgraph=True)
    return lambda ins: compiled(*ins)


@dataclass
class Baseline:
    """A card's compiled reference, or why torch.compile could not compile it."""

    fn: Callable[[list[torch.Tensor]], object] | None
    error: str = ""
    compile_s: float = 0.0


class Baselines:
    """The compiled baseline of the last card seen: torch.compile costs seconds a card, and the
    search sends one card's candidates in a row, so it is compiled once per card per worker,
    not per candidate. Dynamo is reset between cards: every card's reference has the same code
    object, and past its recompile limit Dynamo would silently run eager instead."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.value: Baseline | None = None

    def get(self, backend: Backend, card: Card, inputs: list[torch.Tensor],
            progress: Callable[[str, float], None], opts: EvalOptions) -> Baseline:
        if card.id != self.key:
            self.key, self.value = None, None
            torch._dynamo.reset()
            progress("compiling the torch.compile baseline", opts.compile_timeout_s)
            t0 = time.perf_counter()
            try:
                fn = backend.compile_reference(card)
                fn(inputs)  # compiles
                backend.synchronize()
                value = Baseline(fn)
            except Exception as e:
                if backend.fault(e) is not None:
                    raise
                text = " ".join(str(e).split())  # Dynamo's first line names the backend, the next ones the cause
                value = Baseline(None, f"torch.compile cannot compile {card.op} alone: {type(e).__name__}: {text}"[:500])
            value.compile_s = round(time.perf_counter() - t0, 3)
            self.key, self.value = card.id, value
        return self.value
