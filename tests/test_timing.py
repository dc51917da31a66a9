"""Host-side behaviour of kforge.timing (the GPU paths run in tests/gpu)."""

from __future__ import annotations

import contextlib
import time

from kforge import timing


def test_time_as_called_sizes_its_batches_to_the_op():
    """Back-to-back batches of about 1 ms: many calls for a µs op (host overhead shows),
    few for a ms op (no need to spend seconds on it)."""
    counts = {"slow": 0, "fast": 0}

    def slow():
        counts["slow"] += 1
        time.sleep(0.002)

    def fast():
        counts["fast"] += 1

    for fn, name in ((slow, "slow"), (fast, "fast")):
        m, = timing.time_as_called([(contextlib.nullcontext, fn)], rounds=3, device="cpu")
        assert m.n == 3
    # Round 0 makes one call; rounds 1-4 one warm call plus a batch: 4 calls for the 2 ms
    # op (the minimum), AS_CALLED_CALLS for the µs one.
    assert counts["slow"] == 1 + 4 * (1 + 4), counts
    assert counts["fast"] == 1 + 4 * (1 + timing.AS_CALLED_CALLS), counts
    assert m.median < 1000


def test_time_as_called_enters_each_context_outside_the_timed_batch():
    entered = []

    @contextlib.contextmanager
    def ctx():
        entered.append(1)
        yield

    timing.time_as_called([(ctx, lambda: None)], calls=4, rounds=2, device="cpu")
    assert len(entered) == 4  # one per round: 2 warm-up + 2 timed


def test_the_spin_outlasts_the_host_time_and_gives_up_past_its_cap(monkeypatch):
    monkeypatch.setattr(timing, "cycles_per_us", lambda device=None: 2000.0)
    assert timing.spin_cycles(0.0) == int(timing.HOST_PAD_US * 2000)
    assert timing.spin_cycles(100.0) == int((timing.HOST_MARGIN * 100 + timing.HOST_PAD_US) * 2000)
    assert timing.spin_cycles(timing.MAX_SPIN_US) == 0  # past the cap: timed with its host time
