"""The evaluation worker: a process that owns one device and judges candidates on it.

A kernel can fault, hang or poison the CUDA context, so it only ever runs here; the parent
(kforge.evaluate) kills and restarts this process and the search goes on. What the two say
to each other is kforge.worker_protocol; how one candidate is judged is kforge.judge.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import resource
import signal
import threading
import time
import traceback
from pathlib import Path

import torch

from .backends import Backend, make_backend
from .baseline import Baselines
from .candidate import Candidate
from .cards import Card
from .errors import CardError
from .inputsets import InputSet, prepare
from .judge import Judge
from .verdict import EvalResult, Verdict
from .worker_protocol import FATAL_EXIT, EvalOptions, Request, WorkerMessage

class _CardCache:
    """Input sets of the last card seen: the search sends one card's candidates in a row."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.value: tuple[list[InputSet], InputSet] | None = None

    def get(self, card: Card, run_dir: str, backend: Backend, opts: EvalOptions) -> tuple[list[InputSet], InputSet]:
        key = (card.id, run_dir)
        if key != self.key:
            self.key, self.value = None, None
            release_cached_memory()  # the last card's blocks: another card's sizes fragment them
            self.value = prepare(card, run_dir, backend.device, opts.fresh_sets)
            self.key = key
        return self.value


def release_cached_memory() -> None:
    """Give the CUDA caching allocator's free blocks back to the driver, for other processes
    (the workers, after a capture) or other sizes (the next card)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _memory_note() -> str:
    """Where an out-of-memory error's GPU memory is: this worker's share first (the error's own
    text, which says it last, is cut short in reports)."""
    try:
        free, total = torch.cuda.mem_get_info()
        mine, live = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    except Exception:  # noqa: BLE001 (no CUDA: no note)
        return ""
    gib = 2.0**30
    return (f"[this worker holds {mine / gib:.2f} GiB ({live / gib:.2f} in tensors); other processes "
            f"{max(0, total - free - mine) / gib:.2f} GiB; free {free / gib:.2f} of {total / gib:.2f}] ")


def _rss_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


ORPHAN_EXIT = 3  # the exit code of a worker whose parent is gone


def _exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """End this process once the one that started it is gone. A parent that exits or is
    killed closes the pipe, which ends the request loop, but not while a hung kernel holds the
    main thread: a SIGKILLed `kforge run` or a dead Ray actor would leave a process holding the
    GPU. os._exit works from this thread whatever the main one is doing."""
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(ORPHAN_EXIT)


def main(conn, backend_name: str, device: int, opts_json: dict) -> None:
    """Entry point of the worker process: serve requests until shutdown or EOF."""
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="kforge-orphan-watch", daemon=True).start()
    # Ctrl-C in the terminal reaches the whole process group. The parent decides when the
    # search stops; a worker killed mid-candidate would log a false "worker died" verdict.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    opts = EvalOptions(**opts_json)
    backend = make_backend(backend_name, device, opts.backend_options)
    cache = _CardCache()
    baselines = Baselines()
    evaluated = 0
    while True:
        try:
            req = Request(**conn.recv())
        except EOFError:
            return
        if req.op == "shutdown":
            return
        if req.op == "ping":
            conn.send(dataclasses.asdict(WorkerMessage("pong", req.id, info={"pid": os.getpid(), "rss_bytes": _rss_bytes(),
                                                                     "evaluated": evaluated})))
            continue
        def progress(phase: str, budget_s: float, _id: int = req.id) -> None:
            conn.send(dataclasses.asdict(WorkerMessage("progress", _id, phase=phase, budget_s=budget_s)))

        try:
            card = Card.from_json(req.card)
            candidate = Candidate.from_json(req.candidate)
            def judge() -> tuple[EvalResult, bool]:
                t0 = time.perf_counter()
                sets, holdout = cache.get(card, req.run_dir, backend, opts)  # built once per card
                sets_s = time.perf_counter() - t0
                result, fatal = Judge(backend, card, sets, holdout, candidate, opts, progress, baselines).run()
                result.evidence.setdefault("phase_s", {})["sets"] = round(sets_s, 4)
                return result, fatal

            try:
                result, fatal = judge()
                retry = False
            except torch.OutOfMemoryError:
                retry = True
            if retry:
                # Blocks the allocator caches for other cards' sizes: give them back, try once more
                # (outside the handler: its traceback held the first try's tensors through the second,
                # 77 GB of a 1 GB card's on an 80 GB GPU).
                release_cached_memory()
                result, fatal = judge()
        except CardError as e:
            conn.send(dataclasses.asdict(WorkerMessage("error", req.id, error="CardError", message=str(e))))
            continue
        except Exception as e:
            # A bug of ours (or a case we do not handle): like a failed trial in Optuna it
            # becomes a failed record with the traceback, and the search goes on. A device
            # error that surfaced outside a guarded launch still poisons the context.
            fault = backend.fault(e)
            result = EvalResult(Verdict.RUNTIME_ERROR, f"evaluation failed inside kforge: {type(e).__name__}: "
                                f"{_memory_note() if isinstance(e, torch.OutOfMemoryError) else ''}{e}",
                                {"evaluator_error": traceback.format_exc(),
                                 **({"cuda_error": fault.cuda_error} if fault else {})})
            fatal = bool(fault and fault.fatal)
        evaluated += 1
        conn.send(dataclasses.asdict(WorkerMessage("result", req.id, result=result.to_json(), fatal=fatal)))
        if fatal:
            conn.close()
            os._exit(FATAL_EXIT)  # never evaluate again in a poisoned CUDA context
