"""Evaluators the search drives: a pool of worker processes, one per GPU, and a
compile-only stand-in for machines without one.

The parent side of the worker protocol (kforge.worker_protocol) lives here: it enforces the time
limits, kills a worker that hangs (SIGKILL) or notices one that died, turns that into a
verdict, and starts a fresh worker on the next candidate. Compile time is excluded from
the launch timeout: the worker sends a "compiled" heartbeat, then one per launch step,
each carrying how long the parent should wait for the next.

Two decisions, made here:
- A candidate labelled "custom" whose source uses a vendor library (cuBLAS, cuDNN,
  CUTLASS, CuTe, CUB, Thrust, ...) is judged incorrect ("mislabelled vendor wrapper"),
  not relabelled: its proposer misreported what it wrote, and the search feeds the
  failure back. A candidate labelled "vendor" is evaluated like any other and flagged
  "vendor_wrapper" so the package audits it as one (docs/security.md: vendor libraries).
- A result faster than the HBM roofline is kept only if a held-out run after timing
  still passes (the worker always does that run); it then keeps its verdict with the
  flag "beyond_roofline" for review, otherwise it is incorrect.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import signal
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Callable, Sequence

from . import validate, worker
from .candidate import Candidate
from .cards import Card
from .errors import CardError, CompileError, CudaUnavailableError, PlanError
from .verdict import EvalResult, Evaluator, Verdict
from .worker_protocol import EvalOptions, Request, WorkerMessage


def screen(card: Card, candidate: Candidate) -> EvalResult | None:
    """Verdicts that need no device: a plan that does not fit the card, a mislabelled
    vendor wrapper. None when the candidate should be compiled and run."""
    try:
        candidate.plan.validate(len(card.inputs), len(card.outputs))
    except PlanError as e:
        return EvalResult(Verdict.LOAD_ERROR, f"launch plan does not fit card {card.id}: {e}", {"plan_error": str(e)})
    uses = validate.vendor_uses(candidate.source)
    if uses and candidate.kind == "custom":
        return EvalResult(Verdict.INCORRECT, f"mislabelled vendor wrapper: labelled custom CUDA but uses {', '.join(uses)}; "
                          "write the kernel without vendor libraries or label the candidate kind='vendor'",
                          {"check": "mislabelled_vendor", "vendor_uses": uses})
    return None


def _flag_vendor(candidate: Candidate, result: EvalResult) -> EvalResult:
    if candidate.kind == "vendor" and "vendor_wrapper" not in result.flags:
        result.flags.append("vendor_wrapper")
    return result


class WorkerHandle:
    """One worker process on one device, started lazily and restarted after a crash, a
    hang, a poisoned context or every `restart_every` candidates."""

    join_s = 10.0  # how long a worker that should be leaving gets before SIGKILL

    def __init__(self, device: int, backend: str, opts: EvalOptions):
        self.device, self.backend, self.opts = device, backend, opts
        self._ctx = mp.get_context("spawn")  # fork would copy a CUDA context, which CUDA forbids
        self._proc = None
        self._conn = None
        self._ids = itertools.count(1)
        self.served = 0  # candidates evaluated by the current process
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.is_alive() else None

    def _start(self) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        self._proc = self._ctx.Process(target=worker.main, args=(child, self.backend, self.device, self.opts.to_json()),
                                       name=f"kforge-worker-{self.backend}{self.device}", daemon=True)
        self._proc.start()
        child.close()  # so the parent sees EOF the moment the worker dies
        self._conn = parent
        self.served = 0
        self.starts += 1

    def _ensure(self) -> None:
        if self._proc is None or not self._proc.is_alive():
            self._reap()
            self._start()

    def _recv(self, timeout_s: float) -> WorkerMessage | None:
        """The next reply, None on timeout; EOFError when the worker died."""
        if not self._conn.poll(timeout_s):
            return None
        return WorkerMessage(**self._conn.recv())

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()  # SIGKILL: a hung kernel ignores everything gentler
        self._reap()

    def _reap(self) -> int | None:
        code = None
        if self._proc is not None:
            self._proc.join(timeout=self.join_s)
            if self._proc.is_alive():
                # E.g. stuck tearing down a poisoned context: it must not keep the GPU.
                self._proc.kill()
                self._proc.join(timeout=self.join_s)
            code = self._proc.exitcode
            if code is not None:
                self._proc.close()
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None
        return code

    def _request(self, req: Request) -> None:
        self._ensure()
        self._conn.send(req.__dict__)

    def ping(self, timeout_s: float = 60.0) -> dict:
        """{pid, rss_bytes, evaluated} of the (started if needed) worker."""
        req = Request("ping", next(self._ids))
        self._request(req)
        reply = self._recv(timeout_s)
        if reply is None or reply.kind != "pong":
            raise RuntimeError(f"worker on device {self.device} did not answer a ping within {timeout_s} s")
        return reply.info

    def evaluate(self, card: Card, candidate: Candidate, run_dir: str | Path) -> EvalResult:
        req = Request("evaluate", next(self._ids), card.to_json(), str(run_dir), candidate.to_json())
        self._request(req)
        try:
            return self._await(req)
        except CardError:
            raise  # the worker said so and is ready for the next request
        except BaseException:
            # Ctrl-C (or anything else) while the worker judges: it goes on and would answer the
            # next request with this one's late replies; a kept worker (KeptEvaluators) would
            # hand them to the next run. It is killed and starts afresh when next asked.
            self._kill()
            raise

    def _await(self, req: Request) -> EvalResult:
        phase, budget = "preparing and compiling", self.opts.compile_timeout_s
        while True:
            try:
                reply = self._recv(budget)
            except (EOFError, ConnectionResetError, OSError):
                return self._died(phase)
            if reply is None:
                self._kill()
                return self._timed_out(phase, budget)
            if reply.id != req.id:
                continue  # an earlier request's, which is over
            if reply.kind == "progress":
                phase, budget = reply.phase, reply.budget_s
            elif reply.kind == "error":
                raise CardError(reply.message)
            elif reply.kind == "result":
                result = EvalResult.from_json(reply.result)
                self.served += 1
                if reply.fatal:
                    code = self._reap()  # it exits on its own: its CUDA context is poisoned
                    result.evidence["worker_exit"] = code
                elif self.served >= self.opts.restart_every:
                    self.close()  # a backstop against anything a long-lived process accumulates
                return result

    def _died(self, phase: str) -> EvalResult:
        code = self._reap()
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        ev = {"phase": phase, "exitcode": code}
        if code is not None and code < 0:
            ev["signal"] = signal.Signals(-code).name
        return EvalResult(Verdict.RUNTIME_ERROR, f"the worker process died while {phase} ({how}); it was restarted", ev)

    def _timed_out(self, phase: str, budget: float) -> EvalResult:
        ev = {"phase": phase, "timeout_s": budget}
        if phase.startswith("preparing"):
            return EvalResult(Verdict.COMPILE_ERROR, f"compilation did not finish within {budget:.0f} s; the worker was killed", ev)
        return EvalResult(Verdict.HANG, f"no progress for {budget:.1f} s after '{phase}': the kernel hangs or is far too "
                          "slow; the worker was killed (SIGKILL) and restarted", ev)

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(Request("shutdown").__dict__)
            except OSError:  # BrokenPipeError included
                pass
            self._proc.join(timeout=self.join_s)
        self._kill()


class WorkerPool(Evaluator):
    """Thread-safe evaluator over one worker per device: each call takes a free worker."""

    def __init__(self, run_dir: str | Path, devices: Sequence[int], backend: str, opts: EvalOptions):
        self.run_dir = Path(run_dir)
        self.opts = opts
        self.handles = [WorkerHandle(d, backend, opts) for d in devices]
        self._free: queue.Queue[WorkerHandle] = queue.Queue()
        for h in self.handles:
            self._free.put(h)

    def evaluate(self, card: Card, candidate: Candidate, run_dir: str | Path | None = None) -> EvalResult:
        """run_dir: where the card's samples are (default: the pool's run directory)."""
        early = screen(card, candidate)
        if early is not None:
            return early
        h = self._free.get()
        try:
            t0 = time.monotonic()
            result = h.evaluate(card, candidate, run_dir or self.run_dir)
            result.evidence.setdefault("eval_s", round(time.monotonic() - t0, 3))
            return _flag_vendor(candidate, result)
        finally:
            self._free.put(h)

    def close(self) -> None:
        for h in self.handles:
            h.close()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KeptEvaluators:
    """An `evaluator_factory` for kforge.run that keeps each device's evaluator, and so its
    worker process, from one run to the next: a script or notebook that runs many models (a
    benchmark suite) pays the worker's start, its CUDA context and Inductor's first compile of
    a torch.compile baseline once, not per run. Each run still reads its own run directory,
    and a worker that crashes is restarted as usual. Runs that share it should run one after
    the other; close() (or the with block) stops the workers.

        with KeptEvaluators() as workers:
            for model, inputs in models:
                kforge.run(model, inputs, evaluator_factory=workers, ...)

    make(run_dir, device) builds an evaluator the first time a device is asked for (default:
    kforge.run's own, one worker process per GPU, compile-only without one); what it returns
    is a WorkerPool (each run's requests name the run's directory) or an evaluator that reads
    nothing from a run directory. It serves this machine's GPUs: a Ray cluster's actors own
    their workers (kforge.run(cluster=...) refuses it)."""

    def __init__(self, make: Callable[[Path, int | None], Evaluator] | None = None):
        if make is None:
            from .runner import default_evaluator as make
        self._make = make
        self._kept: dict[int | None, Evaluator] = {}
        self._lock = threading.Lock()

    def __call__(self, run_dir: Path, device: int | None) -> Evaluator:
        with self._lock:
            if device not in self._kept:
                self._kept[device] = self._make(Path(run_dir), device)
            return _Borrowed(self._kept[device], Path(run_dir))

    def close(self) -> None:
        with self._lock:
            kept, self._kept = list(self._kept.values()), {}
        for ev in kept:
            ev.close()

    def __enter__(self) -> "KeptEvaluators":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Borrowed(Evaluator):
    """A kept evaluator lent to one run: it evaluates against the run's directory, and closing
    it (which the run does when it ends) gives it back instead of stopping its worker."""

    def __init__(self, kept: Evaluator, run_dir: Path):
        self.kept, self.run_dir = kept, run_dir

    def evaluate(self, card: Card, candidate: Candidate) -> EvalResult:
        if isinstance(self.kept, WorkerPool):
            return self.kept.evaluate(card, candidate, self.run_dir)
        return self.kept.evaluate(card, candidate)  # compile-only: reads nothing from the run directory

    def close(self) -> None:
        pass


_OPTION_NAMES = {f.name for f in fields(EvalOptions)}


def make_evaluator(run_dir: str | Path, *, devices: Sequence[int] | None = None, timeout_s: float = 5.0,
                   backend: str = "cuda", **opts) -> WorkerPool:
    """A pool with one worker per device (default: every visible GPU).

    opts are EvalOptions fields (compile_timeout_s, fresh_sets, min_reps, min_ms,
    restart_every, backend_options, ...). backend="fake" runs Python stand-in kernels on
    the CPU (tests). Raises CudaUnavailableError for the CUDA backend without a GPU."""
    unknown = set(opts) - _OPTION_NAMES
    if unknown:
        raise TypeError(f"unknown evaluator option(s) {sorted(unknown)}; known: {sorted(_OPTION_NAMES)}")
    if backend == "cuda":
        from . import cuda

        cuda.require()
        if devices is None:
            import torch

            devices = list(range(torch.cuda.device_count()))
        if not devices:
            raise CudaUnavailableError("no visible GPU to evaluate on (check CUDA_VISIBLE_DEVICES)")
    elif backend == "fake":
        devices = list(devices) if devices is not None else [0]
    else:
        raise ValueError(f"unknown evaluation backend {backend!r}: use 'cuda' or 'fake'")
    return WorkerPool(run_dir, list(devices), backend, EvalOptions(timeout_s=timeout_s, **opts))


class CompileOnlyEvaluator(Evaluator):
    """Without a GPU: NVRTC compiles each candidate, so a CPU-only `kforge run` still
    generates and compiles; the verdict is compile_error, load_error or untimed.

    NVRTC runs in a child process with a time and an address-space limit, as it does in the
    GPU worker (which has the time limit): a 1 KB source can expand macros or instantiate
    templates for hours or into gigabytes, and NVRTC cannot be stopped in-process (its flow
    callback fires only between phases, after the front end is done). The child stays up
    between candidates and is replaced after it is killed."""

    def __init__(self, arch: str = "sm_90", timeout_s: float = 300.0, memory_bytes: int = 8 << 30):
        self.arch, self.timeout_s, self.memory_bytes = arch, timeout_s, memory_bytes
        self._ctx = mp.get_context("spawn")  # the parent may hold threads and a CUDA-less torch: never fork it
        self._proc = self._conn = None

    def evaluate(self, card: Card, candidate: Candidate) -> EvalResult:
        early = screen(card, candidate)
        if early is not None:
            return early
        if self._proc is None or not self._proc.is_alive():
            self.close()
            parent, child = self._ctx.Pipe(duplex=True)
            self._proc = self._ctx.Process(target=_compile_serve, args=(child, self.memory_bytes),
                                           name="kforge-compile", daemon=True)
            self._proc.start()
            child.close()
            self._conn = parent
            # Starting the child (an interpreter, NVRTC loaded) is not the candidate's time.
            started = self._conn.recv() if self._conn.poll(_START_S) else ("raise", RuntimeError(
                f"the compiler process did not start within {_START_S:.0f} s"))
            if started[0] == "raise":
                self.close()
                raise started[1]
        self._conn.send((candidate.source, f"cand_{candidate.digest()}.cu", list(candidate.plan.options), self.arch))
        ev = {"phase": "compiling", "timeout_s": self.timeout_s, "memory_bytes": self.memory_bytes}
        try:
            ready = self._conn.poll(self.timeout_s)
            reply = self._conn.recv() if ready else None
        except (EOFError, OSError):
            reply = ("died", None)
        if reply is None or reply[0] == "died":
            self.close()
            why = (f"did not finish within {self.timeout_s:.0f} s" if reply is None else
                   f"died (it may have passed the {self.memory_bytes >> 20} MiB memory limit)")
            return EvalResult(Verdict.COMPILE_ERROR, f"compilation {why}; the compiler process was killed and "
                              "restarted: keep macro expansion and template instantiation small", ev)
        if reply[0] == "raise":
            raise reply[1]
        if reply[0] == "error":
            return EvalResult(Verdict.COMPILE_ERROR, f"compile failed: {reply[1].strip()[:500]}", compile_log=reply[1])
        k = reply[1]
        missing = [kl.name for kl in candidate.plan.kernels if not has_kernel(k.cubin, kl.name)]
        if missing:
            return EvalResult(Verdict.LOAD_ERROR, f"kernel(s) {missing} named in the launch plan are not in the cubin; "
                              'declare them extern "C" __global__', {"missing_kernels": missing}, compile_log=k.log)
        return _flag_vendor(candidate, EvalResult(
            Verdict.UNTIMED, f"compiled for {self.arch}; no GPU here to validate or time it",
            {"cubin_bytes": len(k.cubin), "compile_cached": k.cached, "arch": self.arch}, compile_log=k.log))

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()  # it holds no state worth a goodbye: the disk cache is written atomically
            self._proc.join()
            self._proc.close()
            self._conn.close()
        self._proc = self._conn = None


_START_S = 120.0  # a loaded machine can take tens of seconds to start an interpreter


def _compile_serve(conn, memory_bytes: int) -> None:
    """The compile child: (source, name, options, arch) in, ("ok", CompiledKernel) or ("error", log) out."""
    import resource

    try:
        from . import compiler

        compiler.nvrtc_version()  # maps NVRTC's libraries before the limit, which counts them
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))  # NVRTC then fails "out of memory"
    except Exception as e:  # noqa: BLE001 - NVRTC missing and the like: the parent raises it as before
        conn.send(("raise", e))
        return
    conn.send(("ready",))
    while True:
        try:
            source, name, options, arch = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", compiler.compile(source, name=name, options=options, arch=arch)))
        except CompileError as e:
            conn.send(("error", e.log))
        except MemoryError:
            conn.send(("error", f"the compiler ran out of its {memory_bytes >> 20} MiB memory limit"))
        except Exception as e:  # noqa: BLE001 - NVRTC missing and the like: the parent raises it as before
            conn.send(("raise", e))


def has_kernel(cubin: bytes, name: str) -> bool:
    """Whether an ELF cubin holds a kernel called `name`: each kernel has a .text.<name> section."""
    return b".text." + name.encode() + b"\0" in cubin
