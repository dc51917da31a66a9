"""Which kernel ships for each card, and where: per card the candidate that beats eager as
dispatched (pkg.apply) and the one that beats torch.compile (kforge.compile), each beyond
timing noise; per captured call site the non-overlapping regions that save the most."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Sequence

from .store import CandidateRecord
from .verdict import Verdict, facing_spread

# Without an IQR in the evidence a kernel must beat eager by this fraction to be dispatched.
DEFAULT_MARGIN = 0.03


@dataclass(frozen=True)
class Decision:
    """Whether a card's kernel goes where one baseline runs: True (dispatched), False (fallback),
    None (no decision: nothing was timed to decide against); why, and the numbers it rests on."""

    dispatched: bool | None
    reason: str
    baseline_us: float | None = None
    kernel_us: float | None = None
    noise_us: float | None = None


def noise(baseline_us: float, baseline: dict, kernel: dict, *, noise_factor: float = 1.0,
          margin: float = DEFAULT_MARGIN) -> float:
    """How much faster than a baseline (median `baseline_us`) a kernel must be to count, from the
    two timing summaries: noise_factor times their facing spread (verdict.facing_spread: at 1, the
    kernel's slowest quarter of reps must beat the baseline's fastest quarter), or `margin` of the
    baseline where an IQR is missing."""
    spread = facing_spread(baseline, kernel)
    return margin * baseline_us if spread is None else noise_factor * spread


def beats(kernel_us: float, baseline_us: float, noise_us: float, baseline: str) -> Decision:
    """Dispatched where the kernel is faster than `baseline` (named in the reason) by more than the noise."""
    numbers = dict(baseline_us=baseline_us, kernel_us=kernel_us, noise_us=noise_us)
    if kernel_us >= baseline_us:
        return Decision(False, f"slower than {baseline} ({kernel_us:.2f} µs vs {baseline_us:.2f} µs)", **numbers)
    if baseline_us - kernel_us <= noise_us:
        return Decision(False, f"within timing noise of {baseline} ({kernel_us:.2f} µs vs {baseline_us:.2f} µs, "
                               f"noise {noise_us:.2f} µs)", **numbers)
    return Decision(True, f"{baseline_us / kernel_us:.2f}x faster than {baseline} ({kernel_us:.2f} µs vs "
                          f"{baseline_us:.2f} µs)", **numbers)


def decide(*, eager_us: float, dispatched_us: float, eager_noise_us: float, kernel_us: float | None,
           compile_us: float | None, compile_noise_us: float | None,
           no_compile: str = "never timed against torch.compile") -> tuple[Decision, Decision]:
    """The two decisions for one kernel: eager dispatch (pkg.apply) where it beats eager as
    dispatched, guard and launch included; compiled graphs (kforge.compile) where its GPU time
    beats the same card compiled alone by torch.compile, timed in the same reps. Without a
    torch.compile time there is no compile decision, and `no_compile` says why."""
    eager = beats(dispatched_us, eager_us, eager_noise_us, "eager as dispatched")
    if compile_us is None or kernel_us is None or compile_noise_us is None:
        return eager, Decision(None, no_compile)
    return eager, beats(kernel_us, compile_us, compile_noise_us, "torch.compile")


@dataclass
class Choice:
    """The candidate to ship for a card (None: nothing ships) and its two decisions."""

    candidate: CandidateRecord | None
    eager: Decision
    compiled: Decision

    @property
    def reason(self) -> str:
        return self.eager.reason


def _summary(evidence: dict, *names: str) -> dict:
    return next((evidence[n] for n in names if isinstance(evidence.get(n), dict)), {})


def _compile_decision(row: CandidateRecord, noise_factor: float, margin: float) -> tuple[float | None, str]:
    """(noise of the kernel against torch.compile, why there is no compile time) of a candidate."""
    evidence = row.evidence
    if row.compile_us is None:
        why = evidence.get("compile_error")
        return None, why if isinstance(why, str) and why else "never timed against torch.compile (searched without the compile baseline)"
    return noise(row.compile_us, _summary(evidence, "compiled"), _summary(evidence, "kernel"),
                 noise_factor=noise_factor, margin=margin), ""


def choose(rows: list[CandidateRecord], skip_reason: str | None, *, noise_factor: float = 1.0,
           margin: float = DEFAULT_MARGIN) -> Choice:
    """Decide twice (see decide()). For eager dispatch: the valid candidate with the lowest
    latency as dispatched, against eager as dispatched, noise from evidence["eager"/"dispatched"]
    IQRs (the kernel's standing in for the dispatched one). For compiled graphs: that same
    kernel when eager dispatches it (one kernel per card), else the valid candidate with the
    lowest GPU time, against its torch.compile time, noise from evidence["compiled"/"kernel"]."""
    def nothing(reason: str) -> Choice:
        return Choice(None, Decision(False, reason), Decision(False, reason))

    if skip_reason:
        return nothing(f"not searched: {skip_reason}")
    if not rows:
        return nothing("not searched: no candidate was evaluated")
    valid = [r for r in rows if r.verdict == Verdict.VALID.value]
    if not valid:
        counts = collections.Counter(r.verdict for r in rows)
        failed = [r for r in rows if r.verdict != Verdict.SLOWER.value and r.message]
        last = max(failed, key=lambda r: r.id).message.strip().splitlines()[0][:200] if failed else ""
        return nothing(f"no valid candidate ({len(rows)} tried: "
                       + ", ".join(f"{n} {v}" for v, n in counts.most_common()) + ")"
                       + (f"; the last failure: {last}" if last else ""))
    trusted = [r for r in valid if "beyond_roofline" not in r.flags]
    if not trusted:
        return nothing("every valid candidate is faster than the HBM floor (flagged beyond_roofline); needs review")

    def compiled(row: CandidateRecord) -> Decision:
        c_noise, why = _compile_decision(row, noise_factor, margin)
        if c_noise is None:
            return Decision(None, why)
        return beats(row.kernel_us, row.compile_us, c_noise, "torch.compile")

    timed = [r for r in trusted if r.dispatched_us is not None]
    best = min(timed, key=lambda r: (r.dispatched_us, r.id)) if timed else None
    evidence = best.evidence if best is not None else {}
    eager_us = (_summary(evidence, "eager_dispatched").get("median_us") or best.eager_us) if best is not None else None
    if best is None or eager_us is None:
        eager = Decision(False, "valid, but never timed as dispatched (through the guard path)" if best is None
                         else "no eager timing to compare against")
    else:
        e_noise = noise(eager_us, _summary(evidence, "eager_dispatched", "eager"), _summary(evidence, "dispatched", "kernel"),
                        noise_factor=noise_factor, margin=margin)
        c_noise, why = _compile_decision(best, noise_factor, margin)
        eager, on_compile = decide(eager_us=eager_us, dispatched_us=best.dispatched_us, eager_noise_us=e_noise,
                                   kernel_us=best.kernel_us, compile_us=best.compile_us,
                                   compile_noise_us=c_noise, no_compile=why)
        if eager.dispatched:
            return Choice(best, eager, on_compile)
    against = [r for r in trusted if r.compile_us is not None and r.kernel_us is not None]
    if not against:
        return Choice(None, eager, compiled(trusted[0]))
    fastest = min(against, key=lambda r: (r.kernel_us, r.id))
    on_compile = compiled(fastest)
    return Choice(fastest if on_compile.dispatched else None, eager, on_compile)


# ---- regions: what ships where they overlap ---------------------------------------------------

@dataclass(frozen=True)
class RegionOption:
    """A region card at one call site: the graph nodes it covers there and its evidence."""

    card: str
    nodes: frozenset  # node names of the call site's graph
    kernel_us: float | None  # the region's kernel as dispatched
    baseline_us: float | None  # the same nodes without it: their best op kernels, else eager

    @property
    def saving_us(self) -> float | None:
        return None if self.kernel_us is None or self.baseline_us is None else self.baseline_us - self.kernel_us


def choose_regions(options: Sequence[RegionOption], exact_limit: int = 16) -> list[RegionOption]:
    """Of a graph's region options, the non-overlapping set that saves the most time. An
    option saves its baseline minus its kernel (the nodes it does not cover keep their best
    op kernel or eager, so the total is minimal); one without both numbers or saving nothing
    is never chosen. Exact within each group of overlapping options of up to `exact_limit`,
    greedy by saving above that; ties go to the option listed first. Returned in input order."""
    useful = [o for o in options if o.saving_us is not None and o.saving_us > 0]
    groups: list[list[RegionOption]] = []
    for o in useful:  # connected components of the overlap relation
        touching = [g for g in groups if any(o.nodes & x.nodes for x in g)]
        merged = [x for g in touching for x in g] + [o]
        groups = [g for g in groups if g not in touching] + [merged]
    chosen: list[RegionOption] = []
    for g in groups:
        chosen += _best_disjoint(g) if len(g) <= exact_limit else _greedy_disjoint(g)
    order = {id(o): i for i, o in enumerate(options)}
    return sorted(chosen, key=lambda o: order[id(o)])


def _best_disjoint(group: list[RegionOption]) -> list[RegionOption]:
    best: tuple[float, list[RegionOption]] = (0.0, [])

    def walk(i: int, taken: list[RegionOption], covered: frozenset, saved: float) -> None:
        nonlocal best
        if i == len(group):
            if saved > best[0]:
                best = (saved, list(taken))
            return
        o = group[i]
        if not (o.nodes & covered):
            walk(i + 1, taken + [o], covered | o.nodes, saved + o.saving_us)
        walk(i + 1, taken, covered, saved)

    walk(0, [], frozenset(), 0.0)
    return best[1]


def _greedy_disjoint(group: list[RegionOption]) -> list[RegionOption]:
    taken: list[RegionOption] = []
    for o in sorted(group, key=lambda o: -o.saving_us):
        if not any(o.nodes & t.nodes for t in taken):
            taken.append(o)
    return taken
