"""What the Ray tests' actors run instead of a GPU: importable by every Ray worker of the test
cluster (the test puts this directory on their PYTHONPATH), as actors get these by reference.

A simulated node tells what it "is" by custom resources: `kforge_test_sm80` makes it a node
whose GPU is an sm_80.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from fakes import FAST_HW, FakeEvaluator

from kforge.verdict import EvalResult, Verdict


def fake_facts() -> dict:
    import ray
    import torch

    import kforge

    me = ray.get_runtime_context().get_node_id()
    resources = next(n["Resources"] for n in ray.nodes() if n["NodeID"] == me)
    arch = "sm_80" if "kforge_test_sm80" in resources else FAST_HW.arch
    gpus = [{"name": FAST_HW.name, "arch": arch}] if resources.get("GPU") else []
    return {"host": "sim", "kforge": kforge.__version__, "torch": torch.__version__, "python": "3",
            "driver": 13000, "nvrtc": "13.0", "gpus": gpus, "hardware": FAST_HW.to_json() if gpus else None}


class _Busy(FakeEvaluator):
    """A FakeEvaluator that appends (card, digest, whether the card's sample reached this
    node) to `record` as it starts a candidate, and holds a file named for its pid in
    `busy_dir` while it evaluates (so a test can kill the process mid-candidate)."""

    def __init__(self, run_dir: Path, record: str, busy_dir: str, **kw):
        super().__init__(**kw)
        self.run_dir, self.record_to, self.busy_dir = Path(run_dir), record, Path(busy_dir)

    def evaluate(self, card, cand):
        shipped = (self.run_dir / "cards" / card.id / "sample0.safetensors").exists()
        with open(self.record_to, "a") as f:  # one write of one short line: whole even from several nodes
            f.write(f"{card.id} {cand.digest()} {shipped}\n")
        flag = self.busy_dir / f"pid{os.getpid()}"
        flag.touch()
        try:
            return super().evaluate(card, cand)
        finally:
            flag.unlink()


def fake_evaluator(run_dir: Path, device, *, sleep_s: float, record: str, busy_dir: str) -> FakeEvaluator:
    return _Busy(run_dir, record, busy_dir, sleep_s=sleep_s)


class Latency:
    """An evaluator that only waits: each candidate is 'slower' after `sleep_s`."""

    def __init__(self, sleep_s: float):
        self.sleep_s = sleep_s

    def evaluate(self, card, cand) -> EvalResult:
        time.sleep(self.sleep_s)
        return EvalResult(Verdict.SLOWER, eager_us=1.0, kernel_us=2.0)

    def close(self) -> None:
        pass


def latency_evaluator(run_dir: Path, device, *, sleep_s: float) -> Latency:
    return Latency(sleep_s)
