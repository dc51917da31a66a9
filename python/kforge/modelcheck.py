"""The whole model, eager and with a package applied: its forward timed both ways, interleaved
in one process, as the model calls its ops (host overhead included, no L2 flush).

Every dispatched card beats eager as dispatched, yet the model as a whole can still lose:
a forward bound by launch overhead pays for every call of an overridden op, the calls that
miss the guard included, and per-op timings do not see that. `kforge run` ends with this
check and says when the package does not make the model faster.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from . import timing
from .capture import _as_call, _model_device, _model_state


@dataclass(frozen=True)
class ModelCheck:
    """Forward latency per call in µs, medians over interleaved rounds, with their spread."""

    eager_us: float
    eager_iqr_us: float
    package_us: float
    package_iqr_us: float
    device: str

    @property
    def speedup(self) -> float:
        return self.eager_us / self.package_us

    @property
    def noise_us(self) -> float:
        """A difference smaller than this is not a difference: half the larger spread."""
        return max(self.eager_iqr_us, self.package_iqr_us) / 2

    @property
    def verdict(self) -> str:
        """"faster", "slower" or "level" (the two medians within the noise of each other)."""
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
        return line

    def to_json(self) -> dict:
        return {"eager_us": self.eager_us, "eager_iqr_us": self.eager_iqr_us, "package_us": self.package_us,
                "package_iqr_us": self.package_iqr_us, "device": self.device, "speedup": self.speedup,
                "verdict": self.verdict}


def check_model(model: torch.nn.Module, example_inputs: Any, package, *, rounds: int = 10, calls: int | None = None,
                **install_options: Any) -> ModelCheck:
    """Time `model` on `example_inputs` eager and under `package.apply(**install_options)`,
    interleaved (`rounds` rounds of `calls` forwards each; calls=None sizes them to about a
    millisecond), in eval mode and without autograd, as capture ran it."""
    args, kwargs = _as_call(example_inputs, None)
    dev = _model_device(model, args, kwargs)

    def forward():
        return model(*args, **kwargs)

    with _model_state(model, eval_mode=True), torch.no_grad():
        eager, packaged = timing.time_as_called(
            [(contextlib.nullcontext, forward), (lambda: package.apply(**install_options), forward)],
            calls=calls, rounds=rounds, device=dev)
    return ModelCheck(eager.median, eager.iqr, packaged.median, packaged.iqr, str(dev))
