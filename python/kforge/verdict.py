"""The outcome of evaluating one candidate against one card."""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .redact import scrub


class Verdict(str, enum.Enum):
    COMPILE_ERROR = "compile_error"
    LOAD_ERROR = "load_error"
    RUNTIME_ERROR = "runtime_error"  # fault, trap, launch failure
    HANG = "hang"  # per-launch timeout; the worker was killed
    INCORRECT = "incorrect"
    SLOWER = "slower"  # correct, but not faster than eager
    VALID = "valid"  # correct and faster than eager
    UNTIMED = "untimed"  # compiled, but no GPU here to validate or time it

    @property
    def failed(self) -> bool:
        """Failures are recorded but never expanded by the search."""
        return self not in (Verdict.SLOWER, Verdict.VALID)

    @property
    def repairable(self) -> bool:
        """Errors a proposer may be asked to fix in the bounded repair loop."""
        return self in (Verdict.COMPILE_ERROR, Verdict.LOAD_ERROR, Verdict.RUNTIME_ERROR, Verdict.HANG)


@dataclass
class Measurement:
    """Timing samples of one thing, in microseconds."""

    samples_us: list[float]

    @property
    def n(self) -> int:
        return len(self.samples_us)

    def _q(self, q: float) -> float:
        s = sorted(self.samples_us)
        if not s:
            return math.nan
        pos = q * (len(s) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    @property
    def median(self) -> float:
        return self._q(0.5)

    @property
    def iqr(self) -> float:
        return self._q(0.75) - self._q(0.25)

    @property
    def min(self) -> float:
        return min(self.samples_us) if self.samples_us else math.nan

    def summary(self) -> dict[str, float]:
        return {"median_us": self.median, "iqr_us": self.iqr, "q1_us": self._q(0.25), "q3_us": self._q(0.75),
                "min_us": self.min, "n": self.n}

    def __repr__(self) -> str:
        return f"Measurement(median={self.median:.3f}us, iqr={self.iqr:.3f}us, min={self.min:.3f}us, n={self.n})"


def facing_spread(baseline: dict, kernel: dict) -> float | None:
    """The timing noise between two timing summaries (Measurement.summary()): the facing halves of
    their interquartile ranges, the baseline's from its median down to its first quartile and the
    kernel's from its median up to its third. A kernel whose median beats the baseline's by more
    has its slowest quarter of reps faster than the baseline's fastest quarter; a baseline's slow
    outliers (a host hiccup in a launch-bound eager) do not hide it. Summaries without quartiles
    take half of each IQR; None where an IQR is missing."""
    def half(m: dict, quartile: str, toward: int) -> float | None:
        if isinstance(m.get(quartile), (int, float)) and isinstance(m.get("median_us"), (int, float)):
            return max(0.0, toward * (m[quartile] - m["median_us"]))
        return 0.5 * m["iqr_us"] if isinstance(m.get("iqr_us"), (int, float)) else None
    b, k = half(baseline, "q1_us", -1), half(kernel, "q3_us", 1)
    return None if b is None or k is None else b + k


@dataclass
class EvalResult:
    verdict: Verdict
    message: str = ""
    # Evidence: compiler log, CUDA error name, worst element (index, got, expected),
    # error metrics, tolerance, flags ("beyond_roofline", "over_10x", ...).
    evidence: dict[str, Any] = field(default_factory=dict)
    compile_log: str = ""
    eager_us: float | None = None  # GPU time, median
    kernel_us: float | None = None  # GPU time, median
    dispatched_us: float | None = None  # as dispatched through the guard path
    eager_dispatched_us: float | None = None
    compile_us: float | None = None  # GPU time, median, of the card's reference compiled by torch.compile alone
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    flags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Every text of a verdict reaches the search log, the dashboard and the next prompt:
        # no secret and no unbounded host output in any of them.
        self.message = scrub(self.message)
        self.compile_log = scrub(self.compile_log)

    @property
    def speedup(self) -> float | None:
        if self.eager_us and self.kernel_us:
            return self.eager_us / self.kernel_us
        return None

    def to_json(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict.value
        d["speedup"] = self.speedup
        return d

    @staticmethod
    def from_json(d: dict) -> "EvalResult":
        d = {k: v for k, v in d.items() if k != "speedup"}
        d["verdict"] = Verdict(d["verdict"])
        return EvalResult(**d)


class Evaluator:
    """What the search needs from an evaluator: one verdict per candidate, never an exception
    for a bad kernel (a crash or hang is a verdict, not a crashed search)."""

    def evaluate(self, card, candidate) -> EvalResult:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        """Stop worker processes."""
