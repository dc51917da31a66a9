"""The evaluation worker: a process that owns one device and judges candidates on it.

A kernel can fault, hang or poison the CUDA context, so it only ever runs here; the
parent (kforge.evaluate) kills and restarts this process and the search goes on.

Protocol, over a multiprocessing Pipe; messages are plain dicts of the dataclasses below:

  parent -> worker   Request("evaluate", id, card, run_dir, candidate)   card/candidate as JSON
                     Request("ping", id)  |  Request("shutdown")
  worker -> parent   Reply("progress", id, phase=..., budget_s=...)  heartbeat: the parent waits
                         at most budget_s for the next message, so a hung launch is caught
                     Reply("result", id, result=EvalResult JSON, fatal=...)  fatal: the CUDA
                         context is poisoned and the worker exits right after sending it
                     Reply("pong", id, info={pid, rss_bytes, evaluated})
                     Reply("error", id, error=..., message=...)  the card, not the kernel, is at fault

Per candidate: compile (cached) -> "compiled" -> load -> for each input set (the captured
sample, then `fresh_sets` fresh ones) kernel -> eager reference -> kernel, every run on
fresh copies of the inputs with fresh poisoned outputs (the second kernel run with another
poison) and workspaces -> "validated" ->
timing (eager, kernel and the card's reference compiled by torch.compile interleaved, L2
flushed, inputs rotated; the compiled baseline is compiled once per card) -> a last kernel run on
a held-out input set, so a kernel that stops working after the checks (a launch counter,
work hidden from the timer) is caught -> verdict.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
import importlib
import math
import os
import re
import resource
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from . import cards as cards_mod
from . import timing
from . import validate as V
from .candidate import Candidate
from .cards import Card
from .errors import CardError, CompileError, LaunchError, cuda_error_name
from .hardware import Hardware
from .tolerance import Tolerance, derive, observed
from .verdict import EvalResult, Measurement, Verdict

# CUDA errors that leave the context usable; any other device error poisons it (sticky
# errors: illegal address, trap, misaligned access, ...) and the worker must exit.
RECOVERABLE = frozenset({"CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "CUDA_ERROR_NOT_FOUND",
                         "CUDA_ERROR_INVALID_IMAGE", "CUDA_ERROR_NO_BINARY_FOR_GPU", "CUDA_ERROR_INVALID_PTX",
                         "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "CUDA_ERROR_INVALID_HANDLE",
                         "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"})

HOLDOUT_SEED = 1_000_003  # fresh input set used only after timing, never during the checks
FATAL_EXIT = 3  # exit status of a worker that left after a context-poisoning CUDA error


@dataclass
class EvalOptions:
    timeout_s: float = 5.0  # per launch step (compile excluded); the parent kills the worker past it
    compile_timeout_s: float = 300.0
    fresh_sets: int = 3  # fresh input sets besides the captured sample
    min_reps: int = 100
    min_ms: float = 100.0  # with min_reps: a median of >= 100 reps, L2 flushed before each
    warmup_ms: float = 25.0
    max_copies: int = 4  # input copies rotated in timing when a set fits in L2
    restart_every: int = 50  # the parent restarts a worker after this many candidates
    far_slower: float = 20.0  # skip timing when validation wall time is this many times eager's (and > 1 ms)
    compile_baseline: bool = True  # also time the card's reference compiled by torch.compile (compile_us)
    backend_options: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Request:
    op: str  # evaluate | ping | shutdown
    id: int = 0
    card: dict | None = None
    run_dir: str = ""
    candidate: dict | None = None


@dataclass
class Reply:
    kind: str  # progress | result | pong | error
    id: int = 0
    phase: str = ""
    budget_s: float = 0.0
    result: dict | None = None
    fatal: bool = False
    info: dict = field(default_factory=dict)
    error: str = ""
    message: str = ""


# ---- backends -------------------------------------------------------------------------

@dataclass
class Fault:
    """A device error raised by a launch; fatal when it poisons the context."""

    cuda_error: str
    message: str

    @property
    def fatal(self) -> bool:
        return self.cuda_error not in RECOVERABLE


@dataclass
class Compiled:
    image: Any
    log: str = ""
    cached: bool = False


class NotDispatched(Exception):
    """The kernel could not be timed through kforge.dispatch; the message says why."""


class Backend(abc.ABC):
    """How the worker compiles, loads, launches and times; the CUDA backend is the product,
    the fake one lets CPU tests drive the real worker protocol."""

    device: torch.device
    hardware: Hardware
    dispatch_key: str | None = None  # where kforge.dispatch overrides ops; None: no dispatch path

    @abc.abstractmethod
    def compile(self, candidate: Candidate) -> Compiled:
        """Raises CompileError."""

    @abc.abstractmethod
    def load(self, candidate: Candidate, compiled: Compiled) -> Any:
        """A launchable kernel; raises LaunchError (load_error)."""

    @abc.abstractmethod
    def launch(self, kernel: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
               workspaces: list[torch.Tensor]) -> None: ...

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    @abc.abstractmethod
    def fault(self, exc: BaseException) -> Fault | None:
        """The device error `exc` reports, or None if it is no device error."""

    @abc.abstractmethod
    def time(self, fns: list[Callable[[], object]], opts: EvalOptions) -> list[Measurement]:
        """Interleaved timing of fns, one Measurement each."""

    def bench(self, kernel: Any, input_sets: list[list[torch.Tensor]], outputs: list[torch.Tensor],
              workspaces: list[torch.Tensor], opts: EvalOptions) -> Measurement | None:
        """GPU time of the kernel alone (the C++ harness); None where there is none."""
        return None

    def dispatch_launcher(self, kernel: Any) -> Any:
        """A kforge.dispatch Launcher for `kernel` (backends with a dispatch_key)."""
        raise NotImplementedError

    compile_backend: Any = "inductor"  # torch.compile's backend for the compiled baseline

    def compile_reference(self, card: Card) -> Callable[[list[torch.Tensor]], object]:
        """The card's own call compiled alone by torch.compile (compiled lazily, on its first
        call, which raises where torch.compile cannot compile it)."""
        return compiled_reference(card, self.device, self.compile_backend)

    def time_as_called(self, entries: list) -> list[Measurement]:
        """timing.time_as_called on this backend's device."""
        raise NotImplementedError

    def time_dispatched(self, card: Card, candidate: Candidate, kernel: Any, inputs: list[torch.Tensor],
                        opts: EvalOptions) -> tuple[Measurement, Measurement] | None:
        """(eager, dispatched) latency per call as a model sees it: the op called through
        PyTorch, and through kforge.dispatch's guard path with this kernel installed. None
        where the backend has no dispatch path; raises NotDispatched where the op cannot
        take the guard path, and device errors as they come."""
        if self.dispatch_key is None:
            return None
        from . import dispatch

        ws = [n for n, _ in candidate.plan.workspace_bytes()]
        if card.region is not None:
            return self._time_region_dispatched(card, kernel, inputs, ws)
        variants: list = []

        def call() -> None:
            card.call_eager(inputs, device=self.device)

        @contextlib.contextmanager
        def through_kforge():
            with dispatch.installed(card, self.dispatch_launcher(kernel), workspace=ws, key=self.dispatch_key) as v:
                variants.append(v)
                yield

        try:
            eager, dispatched = self.time_as_called([(contextlib.nullcontext, call), (through_kforge, call)])
        except Exception as e:
            if self.fault(e) is not None or isinstance(e, LaunchError):
                raise
            # E.g. an overload dispatch cannot override: the candidate stays valid but will
            # not be packaged, and its evidence says why.
            raise NotDispatched(f"timing {card.op} as dispatched failed: {type(e).__name__}: {e}") from e
        hits = sum(v.counters.hits for v in variants)
        missed = sum((v.counters.fallbacks for v in variants), collections.Counter())
        if missed or not hits:
            # Every miss ran eager inside the override: "dispatched" would be eager's latency
            # under the kernel's name, and a package would miss the same way.
            raise NotDispatched(f"the guard did not take the kernel: {sum(missed.values())} of "
                                f"{hits + sum(missed.values())} calls fell back to eager ({dict(missed)})")
        return eager, dispatched


    def _time_region_dispatched(self, card: Card, kernel: Any, inputs: list[torch.Tensor],
                                ws: list[int]) -> tuple[Measurement, Measurement]:
        """A region is dispatched by kforge.optimize, not by an aten override: as dispatched is
        its guarded call (kforge.optimize.RegionCall) against the replay of its aten calls."""
        from .optimize import RegionCall, RegionKernel, fits, launch_kernel

        if not fits(card, inputs):
            raise NotDispatched("the region's guard did not take the kernel (the inputs are not the card's shapes, "
                                "strides and dtypes)")
        k = RegionKernel(card, launch_kernel(card, self.dispatch_launcher(kernel), 0, ws))
        call = RegionCall(card.region, [k])
        eager, dispatched = self.time_as_called([(contextlib.nullcontext, lambda: card.call_eager(inputs, self.device)),
                                                 (contextlib.nullcontext, lambda: call(*inputs))])
        if k.counters.fallbacks or not k.counters.hits:
            raise NotDispatched(f"the region's guard did not take the kernel ({dict(k.counters.fallbacks)})")
        return eager, dispatched


class CudaBackend(Backend):
    """NVRTC via kforge.compiler, the driver via kforge.runtime, events via kforge.timing."""

    def __init__(self, device: int):
        from . import cuda, hardware

        cuda.require()
        # The worker is a daemonic process: Inductor compiles the baseline's kernels in it,
        # with no pool of compile processes of its own.
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1
        torch.cuda.set_device(device)
        self.index = device
        self.device = torch.device("cuda", device)
        self.hardware = hardware.current(device)

    def compile(self, candidate: Candidate) -> Compiled:
        from . import compiler

        k = compiler.compile(candidate.source, name=f"cand_{candidate.digest()}.cu", options=candidate.plan.options)
        return Compiled(k, k.log, k.cached)

    def load(self, candidate: Candidate, compiled: Compiled) -> Any:
        from . import runtime

        return runtime.build_plan(candidate, compiled.image.cubin, self.index)

    def launch(self, kernel, inputs, outputs, workspaces) -> None:
        from . import runtime

        runtime.launch(kernel, inputs, outputs, workspaces)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def fault(self, exc: BaseException) -> Fault | None:
        from . import _C

        if isinstance(exc, LaunchError) and exc.cuda_error:
            return Fault(exc.cuda_error, str(exc))
        if isinstance(exc, _C.CudaError):
            return Fault(cuda_error_name(exc), str(exc))
        text = str(exc)
        if isinstance(exc, RuntimeError) and ("CUDA error" in text or "CUDA kernel errors" in text):
            named = _CUDA_ERROR_NAME.search(text)  # kforge._dispatch names the driver's error
            name = named.group(0) if named else next((n for phrase, n in _TORCH_CUDA_ERRORS if phrase in text),
                                                     "CUDA_ERROR_UNKNOWN")
            return Fault(name, text.splitlines()[0])
        return None

    def time(self, fns, opts):
        return timing.time_fns(fns, min_reps=opts.min_reps, min_ms=opts.min_ms, warmup_ms=opts.warmup_ms,
                               flush=True, device=self.index)

    dispatch_key = "CUDA"

    def dispatch_launcher(self, kernel):
        from . import dispatch

        return dispatch.PlanLauncher(kernel, device=self.index)

    def time_as_called(self, entries):
        return timing.time_as_called(entries, device=self.index)

    def bench(self, kernel, input_sets, outputs, workspaces, opts):
        # Corroborating evidence (GPU time with no Python in the loop), not what decides: a
        # quarter of the timed reps' time budget. On the H200 it was the costliest phase.
        return timing.bench_plan(kernel, input_sets, outputs, workspaces, device=self.index, warmup_ms=opts.warmup_ms,
                                 min_reps=opts.min_reps, min_ms=opts.min_ms / 4)


_CUDA_ERROR_NAME = re.compile(r"\bCUDA_ERROR_[A-Z_]+\b")
# How PyTorch words the CUDA errors a kernel of ours can leave behind for its next call.
_TORCH_CUDA_ERRORS = (
    ("illegal memory access", "CUDA_ERROR_ILLEGAL_ADDRESS"),
    ("misaligned address", "CUDA_ERROR_MISALIGNED_ADDRESS"),
    ("illegal instruction", "CUDA_ERROR_ILLEGAL_INSTRUCTION"),
    ("unspecified launch failure", "CUDA_ERROR_LAUNCH_FAILED"),
    ("device-side assert", "CUDA_ERROR_ASSERT"),
    ("hardware stack error", "CUDA_ERROR_HARDWARE_STACK_ERROR"),
)


class FakeFault(RuntimeError):
    """Raised by a fake kernel to act out a device error, e.g. FakeFault("CUDA_ERROR_ILLEGAL_ADDRESS")."""

    def __init__(self, cuda_error: str):
        self.cuda_error = cuda_error
        super().__init__(cuda_error)


class _FakeLauncher:
    def __init__(self, kernel: Callable) -> None:
        self.kernel = kernel

    def launch(self, vid, inputs, outputs, workspaces, device) -> None:
        self.kernel(inputs, outputs, workspaces)


class FakeBackend(Backend):
    """CPU stand-in for tests: a candidate's source is "module:function" naming a Python
    function fn(inputs, outputs, workspaces) that plays the kernel. It may sleep (hang),
    os._exit or raise a signal (crash), or raise FakeFault (a CUDA error). With
    dispatch=True it times as dispatched through an override at the CPU key (the kernel
    must then not call the card's own op)."""

    def __init__(self, device: int = 0, bandwidth: float = 1e12, dispatch: bool = False,
                 compile_backend: str = "eager"):
        self.device = torch.device("cpu")
        self.hardware = Hardware("fake CPU device", "cpu", 1, 0, 0, 0, bandwidth)
        self.dispatch_key = "CPU" if dispatch else None
        # Dynamo's "eager" backend traces the baseline as on the GPU without Inductor's C++
        # build; "module:function" names a torch.compile backend (one that raises plays a card
        # torch.compile cannot compile).
        mod, _, name = compile_backend.partition(":")
        self.compile_backend = getattr(importlib.import_module(mod), name) if name else compile_backend

    def compile(self, candidate: Candidate) -> Compiled:
        mod, _, name = candidate.source.strip().partition(":")
        try:
            fn = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise CompileError(f"cannot resolve fake kernel {candidate.source.strip()!r}: {e}", candidate.source) from e
        return Compiled(fn)

    def load(self, candidate, compiled):
        if not callable(compiled.image):
            raise LaunchError(f"{candidate.source.strip()} is not callable", "CUDA_ERROR_NOT_FOUND")
        return compiled.image

    def launch(self, kernel, inputs, outputs, workspaces) -> None:
        kernel(inputs, outputs, workspaces)

    def synchronize(self) -> None:
        pass

    def fault(self, exc):
        return Fault(exc.cuda_error, str(exc)) if isinstance(exc, FakeFault) else None

    def time(self, fns, opts):
        samples: list[list[float]] = [[] for _ in fns]
        for _ in range(opts.min_reps):
            for s, fn in zip(samples, fns):
                t0 = time.perf_counter()
                fn()
                s.append((time.perf_counter() - t0) * 1e6)
        return [Measurement(s) for s in samples]

    def dispatch_launcher(self, kernel):
        return _FakeLauncher(kernel)

    def time_as_called(self, entries):
        return timing.time_as_called(entries, calls=4, rounds=5, device="cpu")


def make_backend(name: str, device: int, options: dict) -> Backend:
    if name == "cuda":
        return CudaBackend(device, **options)
    if name == "fake":
        return FakeBackend(device, **options)
    raise ValueError(f"unknown evaluation backend {name!r}: use 'cuda' or 'fake'")


# ---- the compiled baseline ------------------------------------------------------------

class _Slot:
    """Where the i-th tensor input goes in a card's call."""

    def __init__(self, i: int):
        self.i = i


def compiled_reference(card: Card, device: torch.device, backend: Any) -> Callable[[list[torch.Tensor]], object]:
    """torch.compile of a function that makes the card's call: its op with its scalar args as
    constants, its tensors as inputs (a region replays its calls). The call is built here, not
    traced: Dynamo sees the op and nothing of kforge's card code."""
    if card.region is not None:
        def reference(*ins: torch.Tensor) -> object:
            return card.call_eager(list(ins), device=device)
    else:
        op = card.overload()
        args, kwargs = card.build_call([_Slot(i) for i in range(len(card.inputs))], device)

        def put(x: Any, ins: tuple) -> Any:
            if isinstance(x, _Slot):
                return ins[x.i]
            return [put(y, ins) for y in x] if isinstance(x, list) else x

        def reference(*ins: torch.Tensor) -> object:
            return op(*[put(a, ins) for a in args], **{k: put(v, ins) for k, v in kwargs.items()})

    compiled = torch.compile(reference, backend=backend, dynamic=False, fullgraph=True)
    return lambda ins: compiled(*ins)


@dataclass
class Baseline:
    """A card's compiled reference, or why torch.compile could not compile it."""

    fn: Callable[[list[torch.Tensor]], object] | None
    error: str = ""
    compile_s: float = 0.0


class _Baselines:
    """The compiled baseline of the last card seen: torch.compile costs seconds a card, and the
    search sends one card's candidates in a row, so it is compiled once per card per worker,
    not per candidate. Dynamo is reset between cards: every card's reference has the same code
    object, and past its recompile limit Dynamo would silently run eager instead."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.value: Baseline | None = None

    def get(self, backend: Backend, card: Card, inputs: list[torch.Tensor],
            progress: Callable[[str, float], None], opts: EvalOptions) -> Baseline:
        if card.id != self.key:
            self.key, self.value = None, None
            torch._dynamo.reset()
            progress("compiling the torch.compile baseline", opts.compile_timeout_s)
            t0 = time.perf_counter()
            try:
                fn = backend.compile_reference(card)
                fn(inputs)  # compiles
                backend.synchronize()
                value = Baseline(fn)
            except Exception as e:
                if backend.fault(e) is not None:
                    raise
                text = " ".join(str(e).split())  # Dynamo's first line names the backend, the next ones the cause
                value = Baseline(None, f"torch.compile cannot compile {card.op} alone: {type(e).__name__}: {text}"[:500])
            value.compile_s = round(time.perf_counter() - t0, 3)
            self.key, self.value = card.id, value
        return self.value


# ---- the card's input sets ------------------------------------------------------------

@dataclass
class InputSet:
    """One set of inputs, kept on the host (a kernel cannot scribble on host memory), and
    the tolerance of each observed tensor on it."""

    name: str
    packed: list[torch.Tensor]  # cards.pack() spans, in Card.inputs order
    tolerances: list[Tolerance]

    def materialize(self, card: Card, device: torch.device) -> list[torch.Tensor]:
        """Fresh device copies with the card's exact strides and alignment."""
        return [cards_mod.unpack(p, m, device) for p, m in zip(self.packed, card.inputs)]


def prepare(card: Card, run_dir: str | Path, device: torch.device, fresh_sets: int) -> tuple[list[InputSet], InputSet]:
    """(input sets for the checks, held-out set): the captured sample when there is one,
    then fresh sets drawn like it; tolerances derived on each. Raises CardError."""
    raw: list[tuple[str, list[torch.Tensor]]] = []
    if card.samples > 0:
        ins, _ = cards_mod.load_sample(card, run_dir, 0, device=device)
        raw.append(("sample0", ins))
    raw += [(f"seed{s}", card.random_inputs(s, device)) for s in range(1, fresh_sets + 1)]
    raw.append((f"seed{HOLDOUT_SEED}", card.random_inputs(HOLDOUT_SEED, device)))
    sets = []
    for name, ins in raw:
        packed = [cards_mod.pack(t) for t in ins]
        if device.type == "cuda":  # pinned: each candidate copies every set to the GPU several times
            packed = [p.pin_memory() for p in packed]
        try:
            ref = observed(card, ins, card.call_eager(ins, device=device))
        except (RuntimeError, TypeError, ValueError) as e:
            raise CardError(f"eager {card.op} fails on input set {name} of card {card.id}: {e}; "
                            "the card cannot be evaluated, capture it again") from e
        s = InputSet(name, packed, [])
        s.tolerances = derive(card, s.materialize(card, device), ref)
        sets.append(s)
    return sets[:-1], sets[-1]


def record_tolerances(evidence: dict, s: InputSet) -> None:
    """Add the tolerances a candidate passed on input set `s` to its evidence: per set, one per
    observed tensor (what the package's manifest and the dashboard read back)."""
    evidence.setdefault("tolerances", {})[s.name] = [t.to_json() for t in s.tolerances]
    evidence.setdefault("tolerance", s.tolerances[0].to_json())  # the first output on the first set


# ---- judging one candidate ------------------------------------------------------------

class Rejected(Exception):
    """Ends a judgement early with its result."""

    def __init__(self, result: EvalResult, fatal: bool = False):
        self.result, self.fatal = result, fatal


class Judge:
    """Everything needed to judge one candidate; `run()` gives (EvalResult, fatal)."""

    def __init__(self, backend: Backend, card: Card, sets: list[InputSet], holdout: InputSet,
                 candidate: Candidate, opts: EvalOptions, progress: Callable[[str, float], None],
                 baselines: _Baselines | None = None):
        self.b, self.card, self.sets, self.holdout = backend, card, sets, holdout
        self.cand, self.opts, self.progress = candidate, opts, progress
        self.baselines = baselines or _Baselines()
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
            baseline = self._guarded("torch.compile baseline",
                                     lambda: self.baselines.get(self.b, card, copies[0], self.progress, o))
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


# ---- the process ----------------------------------------------------------------------

class _CardCache:
    """Input sets of the last card seen: the search sends one card's candidates in a row."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.value: tuple[list[InputSet], InputSet] | None = None

    def get(self, card: Card, run_dir: str, backend: Backend, opts: EvalOptions) -> tuple[list[InputSet], InputSet]:
        key = (card.id, run_dir)
        if key != self.key:
            self.key, self.value = None, None
            self.value = prepare(card, run_dir, backend.device, opts.fresh_sets)
            self.key = key
        return self.value


def _rss_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(conn, backend_name: str, device: int, opts_json: dict) -> None:
    """Entry point of the worker process: serve requests until shutdown or EOF."""
    # Ctrl-C in the terminal reaches the whole process group. The parent decides when the
    # search stops; a worker killed mid-candidate would log a false "worker died" verdict.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    opts = EvalOptions(**opts_json)
    backend = make_backend(backend_name, device, opts.backend_options)
    cache = _CardCache()
    baselines = _Baselines()
    evaluated = 0
    while True:
        try:
            req = Request(**conn.recv())
        except EOFError:
            return
        if req.op == "shutdown":
            return
        if req.op == "ping":
            conn.send(dataclasses.asdict(Reply("pong", req.id, info={"pid": os.getpid(), "rss_bytes": _rss_bytes(),
                                                                     "evaluated": evaluated})))
            continue
        def progress(phase: str, budget_s: float, _id: int = req.id) -> None:
            conn.send(dataclasses.asdict(Reply("progress", _id, phase=phase, budget_s=budget_s)))

        try:
            card = Card.from_json(req.card)
            candidate = Candidate.from_json(req.candidate)
            sets, holdout = cache.get(card, req.run_dir, backend, opts)
            result, fatal = Judge(backend, card, sets, holdout, candidate, opts, progress, baselines).run()
        except CardError as e:
            conn.send(dataclasses.asdict(Reply("error", req.id, error="CardError", message=str(e))))
            continue
        except Exception as e:
            # A bug of ours (or a case we do not handle): like a failed trial in Optuna it
            # becomes a failed record with the traceback, and the search goes on. A device
            # error that surfaced outside a guarded launch still poisons the context.
            fault = backend.fault(e)
            result = EvalResult(Verdict.RUNTIME_ERROR, f"evaluation failed inside kforge: {type(e).__name__}: {e}",
                                {"evaluator_error": traceback.format_exc(),
                                 **({"cuda_error": fault.cuda_error} if fault else {})})
            fatal = bool(fault and fault.fatal)
        evaluated += 1
        conn.send(dataclasses.asdict(Reply("result", req.id, result=result.to_json(), fatal=fatal)))
        if fatal:
            conn.close()
            os._exit(FATAL_EXIT)  # never evaluate again in a poisoned CUDA context
