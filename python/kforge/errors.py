"""Error types. Each carries its evidence and a message that says what to do."""

from __future__ import annotations

import enum
from typing import IO


class KforgeError(Exception):
    """Base class of every error kforge raises on purpose."""


class CudaUnavailableError(KforgeError):
    """The CUDA driver, a GPU or NVRTC is missing for something that needs it."""


def numbered(source: str, around: int | None = None, context: int = 3) -> str:
    """Source with 1-based line numbers; with `around`, only the lines near it."""
    lines = source.splitlines()
    lo, hi = 0, len(lines)
    if around is not None:
        lo, hi = max(0, around - 1 - context), min(len(lines), around + context)
    width = len(str(hi))
    return "\n".join(f"{i + 1:>{width}} | {lines[i]}" for i in range(lo, hi))


class CompileError(KforgeError):
    """NVRTC rejected a kernel. Carries the log, the options, the name and the source."""

    def __init__(self, log: str, source: str, name: str = "kernel.cu", options: list[str] | None = None):
        self.log = log
        self.source = source
        self.name = name
        self.options = list(options or [])
        super().__init__(
            f"NVRTC failed to compile {name} with options {self.options}:\n{log.strip()}\n\n"
            f"source:\n{numbered(source)}"
        )

    def __reduce__(self):  # the evidence crosses process boundaries (worker -> parent) whole
        return type(self), (self.log, self.source, self.name, self.options)

    def dump(self, file: IO[str] | None = None) -> str:
        """The source with 1-based line numbers (what the log's `name(line)` refer to), also
        written to `file` when given."""
        text = numbered(self.source)
        if file is not None:
            file.write(text + "\n")
        return text


class CudaError(KforgeError, RuntimeError):
    """A CUDA driver call failed; raised by kforge._C. `name` is the driver's error
    (CUDA_ERROR_ILLEGAL_ADDRESS), `code` its CUresult (-1 where no driver call failed: the
    library is missing, too old, or not loaded)."""

    def __init__(self, message: str, name: str = "CUDA_ERROR_UNKNOWN", code: int = -1):
        super().__init__(message)
        self.name = name
        self.code = code

    def __reduce__(self):
        return type(self), (str(self), self.name, self.code)


class LaunchRefused(CudaError):
    """The driver refused a plan's first launch before any kernel ran (a cooperative grid or a
    cluster that cannot be resident now): nothing was written, so eager can serve the call."""


class LaunchError(KforgeError):
    """A CUDA driver call failed while loading or launching a kernel."""

    def __init__(self, message: str, cuda_error: str | None = None):
        self.cuda_error = cuda_error
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.cuda_error)

    @classmethod
    def from_cuda(cls, message: str, err: CudaError) -> "LaunchError":
        return cls(message, err.name)


class PlanError(KforgeError):
    """A launch plan is malformed or does not fit the card it is meant for."""


class CaptureError(KforgeError):
    """The model could not be run or recorded."""


class CardError(KforgeError):
    """An operator card is missing, corrupt or does not fit what it is used with."""


class PackageError(KforgeError):
    """A .cast package is malformed, corrupt or unsafe."""


class LogError(KforgeError):
    """A search log is missing, damaged, locked, or not one this kforge can read or write."""


class ProposerError(KforgeError):
    """A proposer could not produce a candidate (reply malformed, no template, ...)."""


class LLMError(ProposerError):
    """The LLM proposer's settings cannot work (no model, a bad config file, no price for a cost budget)."""


class ProposerUnavailable(ProposerError):
    """The proposer's service gives no answer: it refuses (bad key, unknown model, a request it
    rejects; `transient` False, no later call can do better) or stays unreachable after its
    retries (`transient` True). The search stops rather than spend its budget on failures."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class BudgetExhausted(KforgeError):
    """A search budget is spent; `reason` is the search's stop reason (cost, tokens, budget)."""

    def __init__(self, message: str, reason: str = "budget"):
        super().__init__(message)
        self.reason = reason


class ExitCode(enum.IntEnum):
    """What `kforge` exits with; `kforge --help` lists them from here."""

    OK = 0
    ERROR = 1  # bad input or a check that failed: the message says what to fix
    USAGE = 2  # the command line itself is wrong (argparse)
    NO_GPU = 3  # what was asked needs a CUDA GPU, driver or NVRTC that is not here
    PROPOSER_UNAVAILABLE = 4  # the LLM endpoint refused or could not be reached
    INTERRUPTED = 130  # Ctrl-C

    @staticmethod
    def of(error: BaseException) -> "ExitCode":
        if isinstance(error, KeyboardInterrupt):
            return ExitCode.INTERRUPTED
        if isinstance(error, CudaUnavailableError):
            return ExitCode.NO_GPU
        if isinstance(error, ProposerUnavailable):
            return ExitCode.PROPOSER_UNAVAILABLE
        return ExitCode.ERROR


EXIT_CODE_HELP = {
    ExitCode.OK: "success",
    ExitCode.ERROR: "bad input or a failed check (the message says what to fix)",
    ExitCode.USAGE: "bad command line",
    ExitCode.NO_GPU: "no CUDA GPU, driver or NVRTC for what was asked",
    ExitCode.PROPOSER_UNAVAILABLE: "the proposer is unavailable (LLM endpoint refused or unreachable)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C); the run can be resumed",
}
