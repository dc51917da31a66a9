"""bench/ablate_model.py's package variants, on a CPU package with a stand-in launcher: a
subset keeps only the cards asked for, and the unmatchable package overrides the same ops
while every call misses."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from test_dispatch import FakeLauncher, relu_kernel
from test_package import cpu_cast  # noqa: F401  (fixture)

from kforge.dispatch import Dispatcher
from kforge.package import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from ablate_model import subset, unmatchable  # noqa: E402


def test_subset_and_unmatchable_variants(cpu_cast):  # noqa: F811
    path, x = cpu_cast
    pkg = load(path, arch="sm_90")
    (cid,) = [c.id for c in pkg.cards if c.dispatched]
    kept = subset(pkg, lambda k: k == cid)
    dropped = subset(pkg, lambda k: k != cid)
    assert [c.dispatched for c in kept.cards] == [True] and [c.dispatched for c in dropped.cards] == [False]
    assert [c.dispatched for c in pkg.cards] == [True]  # the original is untouched

    launcher = FakeLauncher(relu_kernel)
    with kept.apply(dispatcher=Dispatcher("CPU"), launcher=launcher):
        torch.relu(x)
    assert len(launcher.calls) == 1

    miss = unmatchable(pkg)
    launcher = FakeLauncher(relu_kernel)
    cpu = Dispatcher("CPU")
    with miss.apply(dispatcher=cpu, launcher=launcher):
        assert cpu.ops == ["aten::relu.default"]  # the op is overridden ...
        y = torch.relu(x)
    assert not launcher.calls and torch.equal(y, torch.relu(x))  # ... and the call ran PyTorch's kernel
    (row,) = miss.report()["cards"]
    assert row["hits"] == 0 and row["fallbacks"] == {"dtype": 1}
