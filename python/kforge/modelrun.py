"""Running the user's model as it is: example inputs as a call, the one device it runs on,
eval mode for the run and the training flags given back, and its plain wall time."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .errors import CaptureError


def as_call(inputs: Any, move_to: torch.device | None) -> tuple[tuple, dict]:
    move = (lambda t: t.to(move_to)) if move_to is not None else (lambda t: t)
    if isinstance(inputs, torch.Tensor):
        return (move(inputs),), {}
    if isinstance(inputs, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in inputs):
        return tuple(move(t) for t in inputs), {}
    if isinstance(inputs, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in inputs.items()):
        return (), {k: move(v) for k, v in inputs.items()}
    raise CaptureError(
        f"example inputs must be a tensor, a tuple/list of tensors (passed positionally) or a dict of "
        f"tensors (passed as keywords); got {_describe(inputs)}. Wrap other arguments into the model "
        f"(a small nn.Module or functools.partial) so that only tensors are passed.")


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of ({', '.join(type(v).__name__ for v in x)})"
    if isinstance(x, dict):
        return f"dict of ({', '.join(f'{k!r}: {type(v).__name__}' for k, v in x.items())})"
    return type(x).__name__


def model_device(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.device:
    """The one device the model's parameters and all inputs are on."""
    tensors = [(f"input {i}", t) for i, t in enumerate(args)] + [(f"input {k!r}", t) for k, t in kwargs.items()]
    state = next(iter(model.parameters()), None)
    state = state if state is not None else next(iter(model.buffers()), None)
    if state is not None:
        dev, owner = state.device, "the model's parameters are"
    elif tensors:
        dev, owner = tensors[0][1].device, f"{tensors[0][0]} is"
    else:
        raise CaptureError("the model has no parameters and no example inputs: pass at least one input tensor")
    for where, t in tensors:
        if t.device != dev:
            raise CaptureError(
                f"{where} is on {t.device} but {owner} on {dev}: pass example inputs on {dev} "
                f"(x.to('{dev}')), or pass device= to capture() to move the model and the inputs together")
    if dev.type not in ("cpu", "cuda"):
        raise CaptureError(f"capture runs models on CPU or CUDA, not {dev.type}: move the model and inputs")
    return dev


@dataclass(frozen=True)
class Target:
    """Where calls are intercepted: the backend dispatch key, and what cards say of the device."""

    device: torch.device
    key: str  # "CUDA" or "CPU"
    arch: str
    device_name: str

    @staticmethod
    def of(dev: torch.device) -> "Target":
        if dev.type == "cuda":
            major, minor = torch.cuda.get_device_capability(dev)
            return Target(dev, "CUDA", f"sm_{major}{minor}", torch.cuda.get_device_name(dev))
        return Target(dev, "CPU", "cpu", "cpu")


@contextlib.contextmanager
def model_state(model: torch.nn.Module, eval_mode: bool) -> Iterator[None]:
    """eval() for the capture, then give every module back the training flag it had."""
    flags = {m: m.training for m in model.modules()}
    if eval_mode:
        model.eval()
    try:
        yield
    finally:
        for m, training in flags.items():
            m.training = training


def run_model(model, args, kwargs):
    return model(*args, **kwargs)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def model_wall_us(model, args, kwargs, dev: torch.device, reps: int = 3) -> float:
    """Median wall time of plain forwards (no overrides, no hooks)."""
    times = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        run_model(model, args, kwargs)
        sync(dev)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)
