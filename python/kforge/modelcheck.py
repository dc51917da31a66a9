"""The whole model, eager and with a package applied: its forward timed both ways, interleaved
in one process, as the model calls its ops (host overhead included, no L2 flush).

Every dispatched card beats eager as dispatched, yet the model as a whole can still lose:
a forward bound by launch overhead pays for every call of an overridden op, the calls that
miss the guard included, and per-op timings do not see that. `kforge run` ends with this
check and says when the package does not make the model faster.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from . import timing
from .capture import _as_call, _model_device, _model_state
from .errors import KforgeError

REL_NOISE = 0.01  # differences under 1 % of eager are "level" however steady the timings
MIN_ROUNDS = 3


@dataclass(frozen=True)
class ModelCheck:
    """Forward latency per call in µs, medians over interleaved rounds, with their spread."""

    eager_us: float
    eager_iqr_us: float
    package_us: float
    package_iqr_us: float
    device: str
    calls: int = 0  # forwards per timed sample
    rounds: int = 0  # timed rounds, each entry once per round
    hits: int = -1  # calls the package's kernels served during the check (-1: not counted)

    @property
    def speedup(self) -> float:
        return self.eager_us / self.package_us if self.package_us > 0 else float("nan")

    @property
    def noise_us(self) -> float:
        """A difference smaller than this is not a difference: half the larger spread, and
        never less than REL_NOISE of eager."""
        return max(max(self.eager_iqr_us, self.package_iqr_us) / 2, REL_NOISE * self.eager_us)

    @property
    def verdict(self) -> str:
        """"faster", "slower" or "level" (the two medians within the noise of each other);
        "unused" when no call of the forward reached the package's kernels."""
        if self.hits == 0:
            return "unused"
        diff = self.eager_us - self.package_us
        if abs(diff) <= self.noise_us:
            return "level"
        return "faster" if diff > 0 else "slower"

    def message(self) -> str:
        line = (f"model forward on {self.device}: eager {self.eager_us:.1f} µs (iqr {self.eager_iqr_us:.1f}), "
                f"with the package {self.package_us:.1f} µs (iqr {self.package_iqr_us:.1f}): "
                f"{self.speedup:.3f}x, {self.verdict}")
        if self.verdict == "slower":
            line += ("; every dispatched card beats eager on its own, but this model is slower with the package. "
                     "A forward bound by launch overhead pays for each call of an overridden op: do not apply the "
                     "package as it is. Either replay the forward from a CUDA graph (torch.cuda.graph; the package "
                     "works inside one), or search fewer cards (--ops, --min-share) and check again")
        elif self.verdict == "level":
            line += "; the package's gains are within the timing noise of this model"
        elif self.verdict == "unused":
            line += ("; no call of this forward reached the package's kernels (other shapes, dtypes or device "
                     "than the capture's): the package does nothing for it")
        return line

    def to_json(self) -> dict:
        return {"eager_us": self.eager_us, "eager_iqr_us": self.eager_iqr_us, "package_us": self.package_us,
                "package_iqr_us": self.package_iqr_us, "device": self.device, "speedup": self.speedup,
                "verdict": self.verdict, "calls": self.calls, "rounds": self.rounds, "hits": self.hits}


def check_model(model: torch.nn.Module, example_inputs: Any, package, *, rounds: int = 10, calls: int | None = None,
                budget_s: float = 10.0, **install_options: Any) -> ModelCheck:
    """Time `model` on `example_inputs` eager and under `package.apply(**install_options)`,
    interleaved: `rounds` rounds of `calls` forwards each (calls=None: about a millisecond of
    forwards per sample), in eval mode and without autograd, as capture ran it. A slow model
    gets fewer rounds (never fewer than 3) so that the check takes about `budget_s` seconds;
    a model too slow for even that raises KforgeError. The package's kernels are loaded once
    for all rounds (unless install_options names a launcher)."""
    args, kwargs = _as_call(example_inputs, None)
    dev = _model_device(model, args, kwargs)

    def forward():
        return model(*args, **kwargs)

    def synced():
        forward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    with _model_state(model, eval_mode=True), torch.no_grad():
        synced()  # warm-up
        t0 = time.perf_counter()
        synced()
        one = max(time.perf_counter() - t0, 1e-7)
        if calls is None:
            calls = max(1, min(20, math.ceil(1e-3 / one)))
        # Each round runs both entries, each an untimed call then `calls` timed ones; plus 2 warm-up rounds.
        per_round = 2 * (1 + calls) * one
        if (MIN_ROUNDS + 2) * per_round > 3 * budget_s:
            raise KforgeError(f"one forward takes {one:.3g} s, so the model check would take "
                              f"{(MIN_ROUNDS + 2) * per_round:.3g} s; time the model with and without the "
                              f"package yourself (kforge.modelcheck.check_model with a larger budget_s)")
        rounds = max(MIN_ROUNDS, min(rounds, int(budget_s / per_round) - 2))
        if "launcher" not in install_options and any(c.dispatched for c in package.cards):
            install_options = {**install_options, "launcher": package.launcher()}
        hits0 = sum(c.counters.hits for c in package.cards)
        eager, packaged = timing.time_as_called(
            [(contextlib.nullcontext, forward), (lambda: package.apply(**install_options), forward)],
            calls=calls, rounds=rounds, device=dev)
        hits = sum(c.counters.hits for c in package.cards) - hits0
    return ModelCheck(eager.median, eager.iqr, packaged.median, packaged.iqr, str(dev), calls, rounds, hits)
