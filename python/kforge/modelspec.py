"""Turn a command-line model spec into (model, example inputs).

Two forms:
  path/to/model.py          a file defining get_model() and get_inputs()
  package.module:factory    an importable function returning (model, inputs)
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from .errors import CaptureError


def load_model_spec(spec: str) -> tuple[Any, Any]:
    """(model, example inputs) from a spec; raises CaptureError saying what the spec must provide."""
    if spec.endswith(".py") or Path(spec).is_file():
        module = _load_file(Path(spec))
        hint = "a model file must define get_model() and get_inputs()"
        model = _module(_call(_function(module, "get_model", spec, hint), spec), f"{spec}: get_model() returned")
        return model, _call(_function(module, "get_inputs", spec, hint), spec)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CaptureError(f"model spec {spec!r} is neither a .py file nor 'package.module:factory'; "
                           f"pass a file defining get_model() and get_inputs(), or a factory returning (model, inputs)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CaptureError(f"cannot import {module_name!r} for model spec {spec!r}: {e}; "
                           f"check the name and that it is on PYTHONPATH") from e
    result = _call(_function(module, attr, spec, "the factory must be a function returning (model, inputs)"), spec)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise CaptureError(f"{spec}() returned {type(result).__name__}; it must return a (model, inputs) tuple")
    return _module(result[0], f"{spec}() returned as the model"), result[1]


def _module(model: Any, what: str) -> Any:
    """The model must be a torch.nn.Module: capture reads its parameters and modules."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"{what} a {type(model).__name__}, not a torch.nn.Module: return the model itself "
                           f"(like `return MyModel()`), not a function that builds or runs it")
    return model


def _load_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise CaptureError(f"model file {path} does not exist")
    # A name unique per path, so two model files named model.py do not replace each other.
    name = f"kforge_model_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise CaptureError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise CaptureError(f"importing model file {path} raised {type(e).__name__}: {e}") from e
    return module


def _function(module: ModuleType, name: str, spec: str, hint: str) -> Callable[[], Any]:
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if not n.startswith("_") and callable(v))
        raise CaptureError(f"{spec} defines no function {name}() (callables there: {', '.join(found) or 'none'}); "
                           f"{hint}")
    return fn


def _call(fn: Callable[[], Any], spec: str) -> Any:
    """fn(); an exception from the user's code becomes a CaptureError naming the function and
    the line it came from (the original stays chained for the Python API)."""
    try:
        return fn()
    except Exception as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        raise CaptureError(f"{spec}: {getattr(fn, '__name__', repr(fn))}() raised {type(e).__name__}: {e} "
                           f"(at {frame.filename}:{frame.lineno})") from e
