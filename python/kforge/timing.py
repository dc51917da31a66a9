"""Timing on the GPU the way peers agree is honest: L2 flushed before every rep, one
CUDA event pair per rep, warm-up sized by time, median and IQR of >= 100 reps or
>= 200 ms. Several callables are interleaved rep by rep, so eager and a candidate see
the same clocks and the same neighbours.

What is timed is GPU time: before each rep's start event the GPU is kept busy (the L2
flush, then a spin kernel) for longer than the callable takes to enqueue its work, so
the work is queued before the start event fires and the host's cost of issuing it is
not in the sample. Without the spin, a callable whose host side outlasts the flush
(torch.compile's guards and wrapper, about 100 µs for a small graph) was timed at its
host cost: a 9 µs Inductor kernel measured 128 µs, and a kernel of ours "beat" it 14x.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

from .verdict import Measurement

_flush: dict = {}


def flush_buffer(device=None):
    """A buffer of at least twice the L2 (>= 120 MB on an H200), one per device."""
    import torch

    dev = torch.device(device or "cuda")
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _flush:
        l2 = torch.cuda.get_device_properties(idx).L2_cache_size
        _flush[idx] = torch.empty(max(2 * l2, 64 * 2**20) // 4, dtype=torch.int32, device=f"cuda:{idx}")
    return _flush[idx]


def _on_gpu(device) -> bool:
    import torch

    return torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")


def time_fns(fns: Sequence[Callable[[], object]], *, min_reps: int = 100, min_ms: float = 200.0,
             warmup_ms: float = 25.0, max_reps: int = 5000, flush: bool = True, device=None) -> list[Measurement]:
    """Median-ready samples for each callable, interleaved. GPU time per rep where the
    device is CUDA (events around the call, its host time hidden behind the flush and a
    spin: see the module's docstring), else host wall time."""
    import torch

    on_gpu = _on_gpu(device)
    if not on_gpu:
        return _time_cpu(fns, min_reps=min(min_reps, 20), min_ms=min(min_ms, 50.0))
    buf = flush_buffer(device) if flush else None
    stream = torch.cuda.current_stream(device)

    # Warm-up by time, which also estimates the cost of one round and each callable's host
    # time (the first round, which compiles and allocates, left out).
    start = time.perf_counter()
    rounds = 0
    host: list[list[float]] = [[] for _ in fns]
    while rounds < 3 or (time.perf_counter() - start) * 1e3 < warmup_ms:
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            if rounds:
                host[i].append((time.perf_counter() - t0) * 1e6)
        rounds += 1
        torch.cuda.synchronize(device)
    per_round_ms = max((time.perf_counter() - start) * 1e3 / rounds, 1e-3)
    reps = int(min(max_reps, max(min_reps, math.ceil(min_ms / per_round_ms))))
    spins = [spin_cycles(sorted(h)[len(h) // 2], device) for h in host]

    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for _ in fns]
    for r in range(reps):
        for i, fn in enumerate(fns):
            if buf is not None:
                buf.fill_(r)
            if spins[i]:
                torch.cuda._sleep(spins[i])
            s, e = events[i][r]
            s.record(stream)
            fn()
            e.record(stream)
    torch.cuda.synchronize(device)
    return [Measurement([s.elapsed_time(e) * 1e3 for s, e in evs]) for evs in events]


HOST_MARGIN = 1.5  # the spin outlasts the callable's median host time by this factor ...
HOST_PAD_US = 10.0  # ... plus this (the event record and the host's jitter)
MAX_SPIN_US = 20_000.0  # a callable slower than this on the host is timed with its host time
_cycles_per_us: dict = {}


def spin_cycles(host_us: float, device=None) -> int:
    """Cycles of torch.cuda._sleep that keep the GPU busy for longer than `host_us` of host
    time (0 where it is not worth it or cannot be: past MAX_SPIN_US)."""
    want = HOST_MARGIN * host_us + HOST_PAD_US
    if want > MAX_SPIN_US:
        return 0
    return int(want * cycles_per_us(device))


def cycles_per_us(device=None) -> float:
    """The spin kernel's clock, measured once per device (the SM clock moves with load,
    so this is an estimate; HOST_MARGIN covers it)."""
    import torch

    dev = torch.device(device or "cuda")
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _cycles_per_us:
        stream = torch.cuda.current_stream(idx)
        cycles, best = 1 << 20, float("inf")
        for _ in range(3):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(stream)
            torch.cuda._sleep(cycles)
            e.record(stream)
            e.synchronize()
            best = min(best, s.elapsed_time(e) * 1e3)
        _cycles_per_us[idx] = cycles / max(best, 1e-3)
    return _cycles_per_us[idx]


def _time_cpu(fns, *, min_reps: int, min_ms: float) -> list[Measurement]:
    samples: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    start = time.perf_counter()
    while len(samples[0]) < min_reps or (time.perf_counter() - start) * 1e3 < min_ms:
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            samples[i].append((time.perf_counter() - t0) * 1e6)
        if len(samples[0]) >= 10 * min_reps:
            break
    return [Measurement(s) for s in samples]


def bench_plan(plan, input_sets, outputs, workspaces=(), *, device=None, warmup_ms: float = 25.0,
               min_reps: int = 100, min_ms: float = 200.0, max_reps: int = 10000) -> Measurement:
    """GPU time of a resolved launch plan alone, through the C++ harness."""
    import torch

    from . import _C

    buf = flush_buffer(device)
    stream = torch.cuda.current_stream(device).cuda_stream
    ms = _C.bench(plan, [[t.data_ptr() for t in s] for s in input_sets], [t.data_ptr() for t in outputs],
                  [t.data_ptr() for t in workspaces], int(stream), buf.data_ptr(), buf.numel() * 4,
                  warmup_ms, min_reps, min_ms, max_reps)
    return Measurement([x * 1e3 for x in ms])


AS_CALLED_CALLS = 32
AS_CALLED_ROUNDS = 25


def as_called_calls(calls: int = AS_CALLED_CALLS, rounds: int = AS_CALLED_ROUNDS) -> int:
    """How many times time_as_called calls each entry (warm-up included)."""
    return (rounds + 2) * (calls + 1)


AS_CALLED_TARGET_S = 1e-3  # back-to-back calls per sample: about this long, 4 to AS_CALLED_CALLS


def time_as_called(entries, *, calls: int | None = None, rounds: int = AS_CALLED_ROUNDS,
                   device=None) -> list[Measurement]:
    """Latency per call as a model sees it: `calls` back-to-back calls between one event pair,
    host overhead included and no flush between calls (so both sides see the same warm L2).
    `entries` are (context factory, fn): the context (e.g. a package installed) is entered
    outside the timed region; rounds interleave the entries. Host wall time where the
    device is not CUDA. calls=None sizes the batch from the first call (about 1 ms a
    sample): host overhead matters for µs ops, and ms ops need no long batches."""
    import torch

    on_gpu = _on_gpu(device)
    stream = torch.cuda.current_stream(device) if on_gpu else None
    samples: list[list[float]] = [[] for _ in entries]
    for r in range(rounds + 2):  # the first two rounds warm up
        for i, (ctx, fn) in enumerate(entries):
            with ctx():
                t0 = time.perf_counter()
                fn()
                if on_gpu:
                    torch.cuda.synchronize(device)
                if calls is None and r == 1:  # sized on the second round: the first may compile or load
                    one = max(time.perf_counter() - t0, 1e-7)
                    calls = int(min(AS_CALLED_CALLS, max(4, math.ceil(AS_CALLED_TARGET_S / one))))
                if calls is None:
                    continue  # first warm-up round: nothing timed yet
                if on_gpu:
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record(stream)
                    for _ in range(calls):
                        fn()
                    e.record(stream)
                    e.synchronize()
                    us = s.elapsed_time(e) * 1e3
                else:
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    us = (time.perf_counter() - t0) * 1e6
            if r >= 2:
                samples[i].append(us / calls)
    return [Measurement(x) for x in samples]
