"""Judging one candidate on one card, in the worker process.

compile (cached) -> "compiled" -> load -> for each input set (the captured sample, then
`fresh_sets` fresh ones) kernel -> eager reference -> kernel, every run on fresh copies of
the inputs with fresh poisoned outputs (the second kernel run with another poison) and
workspaces -> "validated" -> timing (eager, kernel and the card's reference compiled by
torch.compile interleaved, L2 flushed, inputs rotated; the compiled baseline is compiled once
per card) -> a last kernel run on a held-out input set, so a kernel that stops working after
the checks (a launch counter, work hidden from the timer) is caught -> verdict.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from . import cards as cards_mod
from . import timing
from . import validate as V
from .backends import Backend, Compiled, NotDispatched
from .baseline import Baselines
from .candidate import Candidate
from .cards import Card
from .errors import CompileError, LaunchError
from .inputsets import InputSet, record_tolerances
from .tolerance import observed
from .verdict import EvalResult, Measurement, Verdict
from .worker_protocol import EvalOptions

class Rejected(Exception):
    """Ends a judgement early with its result."""

    def __init__(self, result: EvalResult, fatal: bool = False):
        self.result, self.fatal = result, fatal


class Judge:
    """Everything needed to judge one candidate; `run()` gives (EvalResult, fatal)."""

    def __init__(self, backend: Backend, card: Card, sets: list[InputSet], holdout: InputSet,
                 candidate: Candidate, opts: EvalOptions, progress: Callable[[str, float], None],
                 baselines: Baselines | None = None):
        self.b, self.card, self.sets, self.holdout = backend, card, sets, holdout
        self.cand, self.opts, self.progress = candidate, opts, progress
        self.baselines = baselines or Baselines()
        self.kernel: Any = None
        self.evidence: dict[str, Any] = {"input_sets": [s.name for s in sets]}
        self.max_abs = self.max_rel = 0.0
        self.worst: dict[str, Any] | None = None
        self.compile_log = ""
        # Fastest wall time of one launch + synchronize: the first launch of a module pays
        # for loading it, so the minimum is what says how slow the kernel really is.
        self.kernel_wall_s = self.eager_wall_s = math.inf

    def run(self) -> tuple[EvalResult, bool]:
        phases = self.evidence["phase_s"] = {}
        t = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            phases[name] = round(now - t, 4)
            t = now

        try:
            compiled = self._compile()
            lap("compile")
            self.progress("compiled", self.opts.timeout_s)
            self.kernel = self._load(compiled)
            for s in self.sets:
                self._check_set(s)
                self.progress(f"validated {s.name}", self.opts.timeout_s)
            lap("validate")
            result = self._time()
            lap("time")
            self._revalidate(result)
            lap("revalidate")
            result.evidence = {**self.evidence, **result.evidence}
            return result, False
        except Rejected as r:
            r.result.evidence = {**self.evidence, **r.result.evidence}
            if r.result.max_abs_err is None and r.result.verdict == Verdict.INCORRECT:
                r.result.max_abs_err, r.result.max_rel_err = self.max_abs, self.max_rel
            return r.result, r.fatal

    # -- steps --
    def _compile(self) -> Compiled:
        try:
            compiled = self.b.compile(self.cand)
        except CompileError as e:
            raise Rejected(EvalResult(Verdict.COMPILE_ERROR, f"compile failed: {e.log.strip()[:500]}", compile_log=e.log))
        self.evidence["compile_cached"] = compiled.cached
        self.compile_log = compiled.log
        return compiled

    def _load(self, compiled: Compiled) -> Any:
        try:
            return self.b.load(self.cand, compiled)
        except LaunchError as e:
            raise Rejected(EvalResult(Verdict.LOAD_ERROR, str(e), {"cuda_error": e.cuda_error}, compile_log=compiled.log))

    def _guarded(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run fn (a launch and a synchronize); a device error becomes runtime_error."""
        try:
            return fn()
        except Exception as e:
            fault = self.b.fault(e)
            if fault is None and not isinstance(e, LaunchError):
                raise
            name = fault.cuda_error if fault else e.cuda_error
            raise Rejected(EvalResult(Verdict.RUNTIME_ERROR, f"{what}: {name or type(e).__name__}: {e}",
                                      {"cuda_error": name, "phase": what}, compile_log=self.compile_log),
                           fatal=bool(fault and fault.fatal))

    def _outputs(self, inputs: list[torch.Tensor], byte: int = V.POISON_BYTE) -> list[torch.Tensor]:
        """Fresh outputs poisoned with `byte`, with the card's strides; in-place outputs are their input."""
        return [inputs[self.card.aliases[j]] if j in self.card.aliases
                else V.poison(cards_mod.empty_like_meta(m, self.b.device), byte)
                for j, m in enumerate(self.card.outputs)]

    def _workspaces(self) -> list[torch.Tensor]:
        # Poisoned too: a kernel must not rely on what an uninitialised workspace holds.
        return [V.poison(torch.empty(max(n, 1), dtype=torch.uint8, device=self.b.device))
                for n, _ in self.cand.plan.workspace_bytes()]

    def _kernel_run(self, s: InputSet, what: str,
                    byte: int = V.POISON_BYTE) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(inputs after the run, observed results) of one launch on fresh copies, the
        outputs poisoned with `byte`."""
        ins = s.materialize(self.card, self.b.device)
        outs = self._outputs(ins, byte)
        ws = self._workspaces()

        def go() -> None:
            self.b.launch(self.kernel, ins, outs, ws)
            self.b.synchronize()

        t0 = time.perf_counter()
        self._guarded(what, go)
        self.kernel_wall_s = min(self.kernel_wall_s, time.perf_counter() - t0)
        return ins, observed(self.card, ins, outs)

    def _eager_run(self, s: InputSet) -> list[torch.Tensor]:
        ins = s.materialize(self.card, self.b.device)
        t0 = time.perf_counter()
        outs = self._guarded(f"eager on {s.name}", lambda: self.card.call_eager(ins, device=self.b.device))
        self._guarded(f"eager on {s.name}", self.b.synchronize)
        self.eager_wall_s = min(self.eager_wall_s, time.perf_counter() - t0)
        return observed(self.card, ins, outs)

    def _reject(self, failure: V.Failure, s: InputSet, **extra: Any) -> None:
        raise Rejected(EvalResult(Verdict.INCORRECT, f"{s.name}: {failure.message}",
                                  {"check": failure.check, "input_set": s.name, **failure.evidence, **extra},
                                  compile_log=self.compile_log))

    def _check_set(self, s: InputSet) -> None:
        written = self.card.written_inputs
        pristine = s.materialize(self.card, self.b.device)
        ins1, got1 = self._kernel_run(s, f"kernel on {s.name}")
        ref = self._eager_run(s)  # between the two kernel runs: stale buffers now hold eager's data
        ins2, got2 = self._kernel_run(s, f"second kernel run on {s.name}", V.SECOND_POISON_BYTE)
        fresh = [j < len(self.card.outputs) and j not in self.card.aliases for j in range(len(ref))]
        for j, (g, r, tol) in enumerate(zip(got1, ref, s.tolerances)):
            for f in (V.check_meta(g, r), fresh[j] and V.check_written(g, r), V.check_not_constant(g, r)):
                if f:
                    self._reject(f, s, output=j)
            c = V.compare(g, r, tol)
            if c.max_abs_err >= self.max_abs and c.worst:
                self.worst = {**c.worst, "input_set": s.name, "output": j}
            self.max_abs, self.max_rel = max(self.max_abs, c.max_abs_err), max(self.max_rel, c.max_rel_err)
            if c.failure:
                self._reject(c.failure, s, output=j, tolerance=tol.to_json())
        f = V.check_inputs_unchanged(pristine, ins1, written) or V.check_inputs_unchanged(pristine, ins2, written)
        if f:
            self._reject(f, s)
        for j, (g, r) in enumerate(zip(got2, ref)):
            f = fresh[j] and V.check_written(g, r, V.SECOND_POISON_BYTE)
            if f:
                self._reject(V.Failure(f.check, "second run on a fresh output: " + f.message, f.evidence), s, output=j)
        f = V.check_repeatable(got1, got2, s.tolerances if self.cand.knobs.get("atomics") else None)
        if f:
            self._reject(f, s)
        record_tolerances(self.evidence, s)

    def _time(self) -> EvalResult:
        o, card = self.opts, self.card
        floor = self.b.hardware.floor_us(card.io_bytes())
        common = dict(compile_log=self.compile_log, max_abs_err=self.max_abs, max_rel_err=self.max_rel)
        if self.kernel_wall_s > max(1e-3, o.far_slower * self.eager_wall_s):
            return EvalResult(Verdict.SLOWER, f"far slower than eager in validation ({self.kernel_wall_s * 1e3:.2f} vs "
                              f"{self.eager_wall_s * 1e3:.2f} ms wall); not timed", {"floor_us": floor}, **common)
        s = self.sets[0]
        l2, per_set = self.b.hardware.l2_bytes, max(card.io_bytes(), 1)
        n = max(1, min(o.max_copies, math.ceil(2 * l2 / per_set))) if per_set < l2 else 1
        copies = [s.materialize(card, self.b.device) for _ in range(n)]
        outs = [self._outputs(c) for c in copies]
        ws = self._workspaces()
        turn = {"k": 0, "e": 0, "c": 0}

        def kernel_fn() -> None:
            i = turn["k"] = (turn["k"] + 1) % n
            self.b.launch(self.kernel, copies[i], outs[i], ws)

        def eager_fn() -> None:
            i = turn["e"] = (turn["e"] + 1) % n
            card.call_eager(copies[i], device=self.b.device)

        fns = [eager_fn, kernel_fn]
        baseline = None
        if o.compile_baseline:
            t = time.perf_counter()
            baseline = self._guarded("torch.compile baseline",
                                     lambda: self.baselines.get(self.b, card, copies[0], self.progress, o))
            self.evidence.setdefault("phase_s", {})["baseline"] = round(time.perf_counter() - t, 4)  # once per card
            if baseline.fn is not None:
                def compiled_fn() -> None:
                    i = turn["c"] = (turn["c"] + 1) % n
                    baseline.fn(copies[i])

                fns.append(compiled_fn)  # the same reps, interleaved with eager and the kernel
        # One heartbeat per phase, each with room for its own work: a kernel of a few ms
        # needs far longer as dispatched (time_as_called's fixed count of calls) than in
        # the timed reps, and one budget for all three would call it a hang.
        k, e = self.kernel_wall_s, self.eager_wall_s
        self.progress("timing", self._budget(k + (len(fns) - 1) * e + 1e-3, sides=len(fns)))
        t0 = time.perf_counter()
        ms = self._guarded("timing", lambda: self.b.time(fns, o))
        phases = self.evidence.setdefault("phase_s", {})
        phases["time_gpu"] = round(time.perf_counter() - t0, 4)
        eager_m, kernel_m = ms[0], ms[1]
        compiled_m = ms[2] if len(ms) > 2 else None
        verdict, message = V.speed_verdict(kernel_m, eager_m)
        bench = as_called = not_dispatched = None
        if verdict == Verdict.VALID:
            # The packager's evidence, for winners only: a kernel slower than eager on the
            # GPU can only be slower as dispatched, and these two phases are most of the
            # time a loser would otherwise cost the search.
            self.progress("timing (kernel alone)", self._budget(k + 1e-3))
            bench = self._guarded("timing (kernel alone)", lambda: self.b.bench(self.kernel, copies, outs[0], ws, o))
            self.progress("timing as dispatched", o.timeout_s + 3 * timing.as_called_calls() * (k + e))
            t1 = time.perf_counter()
            phases["time_alone"] = round(t1 - t0 - phases["time_gpu"], 4)
            try:
                as_called = self._guarded("timing as dispatched",
                                          lambda: self.b.time_dispatched(card, self.cand, self.kernel, copies[0], o))
            except NotDispatched as nd:
                not_dispatched = str(nd)
            phases["time_dispatched"] = round(time.perf_counter() - t1, 4)
        else:
            not_dispatched = "not timed as dispatched: not faster than eager on the GPU"
        flags = V.speed_flags(kernel_m.median, eager_m.median, floor)
        evidence = {"floor_us": floor, "worst": self.worst, "eager": eager_m.summary(), "kernel": kernel_m.summary(),
                    "input_copies": n, "eager_samples_us": _rounded(eager_m), "kernel_samples_us": _rounded(kernel_m)}
        if as_called is not None:
            evidence["eager_dispatched"], evidence["dispatched"] = as_called[0].summary(), as_called[1].summary()
        if not_dispatched:
            evidence["not_dispatched"] = not_dispatched
        if bench is not None:
            evidence["kernel_alone"] = bench.summary()  # GPU time alone, the C++ harness
        if baseline is not None:
            evidence["compile_baseline_s"] = baseline.compile_s  # compile time, paid once per card and worker
            if compiled_m is not None:
                evidence["compiled"] = compiled_m.summary()
            else:
                evidence["compile_error"] = baseline.error
        return EvalResult(verdict, message, evidence, eager_us=eager_m.median, kernel_us=kernel_m.median,
                          dispatched_us=as_called[1].median if as_called else None,
                          eager_dispatched_us=as_called[0].median if as_called else None,
                          compile_us=compiled_m.median if compiled_m is not None else None, flags=flags, **common)

    def _budget(self, per_rep_s: float, sides: int = 1) -> float:
        """Heartbeat budget of a timing phase of `per_rep_s` a rep for each of `sides`
        callables: their warm-up and reps, three times over, on top of the launch timeout."""
        o = self.opts
        return o.timeout_s + 3 * sides * (o.warmup_ms / 1e3 + max(o.min_reps * per_rep_s, o.min_ms / 1e3))

    def _revalidate(self, result: EvalResult) -> None:
        """One more run on a held-out set after timing. A kernel that computes only on its
        first few launches passes the checks and then times beyond the roofline; this run
        turns such a result (flagged or not) into incorrect. A flagged result that passes
        keeps its verdict and its flag, for review."""
        self.progress("revalidating", self.opts.timeout_s)
        s = self.holdout
        _, got = self._kernel_run(s, f"kernel on held-out {s.name}")
        ref = self._eager_run(s)
        for j, (g, r, tol) in enumerate(zip(got, ref, s.tolerances)):
            fresh = j < len(self.card.outputs) and j not in self.card.aliases
            f = (fresh and V.check_written(g, r)) or V.check_not_constant(g, r) or V.compare(g, r, tol).failure
            if f:
                raise Rejected(EvalResult(
                    Verdict.INCORRECT, f"after timing, on held-out {s.name}: {f.message}",
                    {**result.evidence, "check": f.check, "input_set": s.name, "output": j, "after_timing": True, **f.evidence},
                    compile_log=self.compile_log, eager_us=result.eager_us, kernel_us=result.kernel_us, flags=result.flags))


def _rounded(m: Measurement) -> list[float]:
    return [round(x, 3) for x in m.samples_us]
