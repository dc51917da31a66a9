"""A card's eager time and its share of the captured runtime.

A card's share is `eager_us * calls / total_us`, where `total_us` sums the cards' time over
the calls that are not nested in another recorded call. The shares of top-level cards add up
to 1; a nested card's share is part of its parent's (the card's notes say so).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

from .cards import Card, TensorMeta, pack, unpack
from .op_capture import Entry, Recorder


def time_entry(entry: Entry, dev: torch.device) -> None:
    card = entry.card
    try:
        if entry.samples:
            inputs = [unpack(pack(t), TensorMeta.of(t), dev) for t in entry.samples[0][0]]
        else:
            inputs = card.random_inputs(seed=0, device=dev)
        args, kwargs = card.build_call(inputs, dev)
        op = card.overload()
        card.eager_us = time_fn(lambda: op(*args, **kwargs), dev)
    except Exception as e:  # an op that cannot be replayed alone is reported, not fatal
        card.notes.append(f"not timed: replay raised {type(e).__name__}: {e}")
        return
    card.total_us = card.eager_us * card.calls


def time_fn(fn: Callable[[], Any], dev: torch.device, cpu_reps: int = 5) -> float:
    """Median microseconds per call: CUDA events with L2 flushed on the GPU, perf_counter on the CPU."""
    if dev.type == "cuda":
        from . import timing

        (m,) = timing.time_fns([fn], min_reps=20, min_ms=10.0, warmup_ms=5.0, device=dev)
        return m.median
    fn()
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def assign_shares(rec: Recorder) -> float:
    total = sum(e.card.eager_us * e.top_calls for e in rec.entries.values() if e.card.eager_us is not None)
    for e in rec.entries.values():
        c = e.card
        c.share = c.total_us / total if c.total_us is not None and total > 0 else None
    return total


def shares_by_family(cards: Sequence[Card]) -> dict[str, float]:
    """Share of the captured runtime per family, counting only calls not nested in another
    recorded call (a nested call's time is inside its parent's), so the shares add up to 1."""
    times: dict[str, float] = {}
    for c in cards:
        if c.eager_us is not None:
            top = c.calls if c.top_calls is None else c.top_calls
            times[c.family] = times.get(c.family, 0.0) + c.eager_us * top
    total = sum(times.values())
    return {f: t / total for f, t in sorted(times.items(), key=lambda kv: -kv[1])} if total > 0 else {}
