"""What the evaluation parent (kforge.evaluate) and the worker process (kforge.worker) say
to each other over a multiprocessing Pipe; messages are plain dicts of the dataclasses below:

  parent -> worker   Request("evaluate", id, card, run_dir, candidate)   card/candidate as JSON
                     Request("ping", id)  |  Request("shutdown")
  worker -> parent   WorkerMessage("progress", id, phase=..., budget_s=...)  heartbeat: the parent
                         waits at most budget_s for the next message, so a hung launch is caught
                     WorkerMessage("result", id, result=EvalResult JSON, fatal=...)  fatal: the CUDA
                         context is poisoned and the worker exits right after sending it
                     WorkerMessage("pong", id, info={pid, rss_bytes, evaluated})
                     WorkerMessage("error", id, error=..., message=...)  the card, not the kernel, is at fault
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

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
class WorkerMessage:
    kind: str  # progress | result | pong | error
    id: int = 0
    phase: str = ""
    budget_s: float = 0.0
    result: dict | None = None
    fatal: bool = False
    info: dict = field(default_factory=dict)
    error: str = ""
    message: str = ""
