"""bench/bench_model.py's GPU breakdown, from profiler rows: the GPU time under each kforge op is
its card's, per forward, most first; other ops and ops that launched nothing are left out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_model import by_card  # noqa: E402


def test_gpu_time_per_card_per_forward():
    rows = [("kforge::k_0252f7d66bc07f40_9ff64f5d958f", 6, 90.0), ("aten::addmm", 24, 400.0),
            ("kforge::k_fbad1b6d9d04d7d9_0123456789ab", 3, 300.0), ("kforge::k_aaaaaaaaaaaaaaaa_0", 3, 0.0)]
    got = by_card(rows, forwards=3)
    assert [r["card"] for r in got] == ["fbad1b6d9d04d7d9", "0252f7d66bc07f40"]
    assert got[0]["us"] == 100.0 and got[1]["calls"] == 2 and got[1]["us"] == 30.0
