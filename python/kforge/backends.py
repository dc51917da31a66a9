"""How the evaluation worker compiles, loads, launches and times: the CUDA backend is the
product, the fake one plays kernels with Python functions so CPU tests drive the real worker."""

from __future__ import annotations

import abc
import collections
import contextlib
import importlib
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import timing
from .baseline import compiled_reference
from .candidate import Candidate
from .cards import Card
from .errors import CompileError, CudaError, LaunchError
from .hardware import Hardware
from .verdict import Measurement
from .worker_protocol import EvalOptions

# CUDA errors that leave the context usable; any other device error poisons it (sticky
# errors: illegal address, trap, misaligned access, ...) and the worker must exit.
RECOVERABLE = frozenset({"CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "CUDA_ERROR_NOT_FOUND",
                         "CUDA_ERROR_INVALID_IMAGE", "CUDA_ERROR_NO_BINARY_FOR_GPU", "CUDA_ERROR_INVALID_PTX",
                         "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "CUDA_ERROR_INVALID_HANDLE",
                         "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"})

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
        the call kforge.optimize makes (its region op from C++, else kforge.optimize.RegionCall:
        the guard, then the kernel) against the replay of its aten calls. Every candidate of a
        card is timed through one op, released after its timing (it keeps no candidate's kernel loaded)."""
        from . import customops
        from .optimize import RegionCall, RegionKernel, fits, native_op

        if not fits(card, inputs):
            raise NotDispatched("the region's guard did not take the kernel (the inputs are not the card's shapes, "
                                "strides and dtypes)")
        k = RegionKernel.launched(card, self.dispatch_launcher(kernel), 0, ws, digest="timed")
        op = native_op([k])
        call = op or RegionCall(card.region, [k])
        try:
            eager, dispatched = self.time_as_called([(contextlib.nullcontext, lambda: card.call_eager(inputs, self.device)),
                                                     (contextlib.nullcontext, lambda: call(*inputs))])
        finally:
            if op is not None:
                customops.release(op)
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
        if isinstance(exc, LaunchError) and exc.cuda_error:
            return Fault(exc.cuda_error, str(exc))
        if isinstance(exc, CudaError):
            return Fault(exc.name, str(exc))
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
