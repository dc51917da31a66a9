"""bench/bench_model.py's GPU breakdown, from profiler rows: the GPU time under each kforge op is
its card's, per forward, most first; other ops and ops that launched nothing are left out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_model import by_card, host_ops  # noqa: E402


def test_gpu_time_per_card_per_forward():
    rows = [("kforge::k_0252f7d66bc07f40_9ff64f5d958f", 6, 90.0), ("aten::addmm", 24, 400.0),
            ("kforge::k_fbad1b6d9d04d7d9_0123456789ab", 3, 300.0), ("kforge::k_aaaaaaaaaaaaaaaa_0", 3, 0.0)]
    got = by_card(rows, forwards=3)
    assert [r["card"] for r in got] == ["fbad1b6d9d04d7d9", "0252f7d66bc07f40"]
    assert got[0]["us"] == 100.0 and got[1]["calls"] == 2 and got[1]["us"] == 30.0


def test_a_range_and_its_device_side_twin_count_once():
    """record_function's range appears twice in a profile with CUDA activity, on the host and as a
    GPU-side annotation of the same name: only the host's counts."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key, device, us):
        return SimpleNamespace(key=key, device_type=device, device_time_total=us)

    region = "kforge::k_0252f7d66bc07f40_region"
    events = [event(region, DeviceType.CPU, 30.0), event(region, DeviceType.CUDA, 31.0),
              event(region, DeviceType.CPU, 30.0), event("aten::add", DeviceType.CPU, 5.0)]
    assert sorted(host_ops(events)) == [("aten::add", 1, 5.0), (region, 2, 60.0)]
    assert by_card(host_ops(events), forwards=2)[0]["us"] == 30.0
