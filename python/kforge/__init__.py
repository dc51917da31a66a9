"""kforge: make unmodified PyTorch models faster with generated, verified, guarded CUDA kernels.

    import kforge
    result = kforge.run(model, example_inputs, out="model.cast")
    kforge.load("model.cast").apply()                 # eager: the ops overridden
    compiled = kforge.compile(model, kforge.load("model.cast"))  # torch.compile with the kernels inside

Submodules are imported on first use, so `import kforge` is cheap and works without a GPU.
"""

from __future__ import annotations

import importlib

from . import env
from .errors import (BudgetExhausted, CaptureError, CardError, CompileError, CudaError, CudaUnavailableError,
                     KforgeError, LaunchError, LaunchRefused, LLMError, LogError, PackageError, PlanError, ProposerError)

__version__ = "0.1.0"

env.configure_logging()

_LAZY = {
    # No submodule is named kforge.capture: importing one would rebind this name to it.
    "capture": ("kforge.capturing", "capture"),
    # Callable as its optimize() function, like capture.
    "optimize": ("kforge.optimize", None),
    "run": ("kforge.runner", "run"),
    "load": ("kforge.package", "load"),
    "compile": ("kforge.inductor", "compile"),  # the model under torch.compile; kernels: kforge.compiler.compile
    "cuda_status": ("kforge.cuda", "cuda_status"),
    "Card": ("kforge.cards", "Card"),
    "Candidate": ("kforge.candidate", "Candidate"),
    "LaunchPlan": ("kforge.candidate", "LaunchPlan"),
}

__all__ = list(_LAZY) + ["__version__", "BudgetExhausted", "CaptureError", "CardError", "CompileError", "CudaError",
                         "CudaUnavailableError", "KforgeError", "LaunchError", "LaunchRefused", "LLMError", "LogError",
                         "PackageError", "PlanError", "ProposerError"]


def __getattr__(name: str):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        module = importlib.import_module(mod)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kforge' has no attribute {name!r}")
