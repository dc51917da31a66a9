"""Where a run evaluates its candidates: a pool of slots, one per GPU, each with its own evaluator.

The runner starts one search thread per slot; each thread takes cards off one queue and
evaluates their candidates on its slot. Two pools exist: this machine's GPUs (`LocalPool`,
one worker process per GPU) and a Ray cluster's (`kforge.cluster`, one actor per GPU on
any node). The search, the log and the budget are the same for both.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Callable

from .hardware import Hardware, current
from .verdict import Evaluator

EvaluatorFactory = Callable[[Path, "int | None"], Evaluator]


class EvaluatorPool(abc.ABC):
    """The slots a run evaluates on. `slots` names each in words (for messages and the log),
    `hardware` is the GPU they all are, `validated` says whether they validate and time (or
    only compile), `config` is what the run's log records of them and `notes` are warnings
    for the run's log (GPUs left out, and why)."""

    slots: list[str]
    hardware: Hardware
    validated: bool
    config: dict[str, Any]
    notes: list[str] = []

    @abc.abstractmethod
    def evaluator(self, slot: int) -> Evaluator:
        """The evaluator of slot `slot`, made in the thread that uses it and closed by it."""

    def close(self) -> None:
        """Give back what the pool holds besides its evaluators."""


class LocalPool(EvaluatorPool):
    """The GPUs of this machine, one `factory(run_dir, device)` evaluator each; without a GPU
    one compile-only slot (device None)."""

    def __init__(self, run_dir: Path, devices: list[int], factory: EvaluatorFactory):
        self.run_dir, self.devices, self.factory = run_dir, devices, factory
        self.slots = [f"GPU {d}" for d in devices] or ["this machine (no GPU: compile only)"]
        self.validated = bool(devices)
        self.hardware = current(devices[0] if devices else None)
        self.config = {"devices": devices}

    def evaluator(self, slot: int) -> Evaluator:
        return self.factory(self.run_dir, self.devices[slot] if self.devices else None)
