"""Helpers for the evaluation tests: cards built from a real aten call, and the FakeBackend's
stand-in kernels (fn(inputs, outputs, workspaces)), good and deliberately bad.

The worker process imports this module by name (a candidate's source is "evalkit:<fn>"),
so it must stay importable without side effects."""

from __future__ import annotations

import os
import signal
import time

import torch

from kforge.candidate import Candidate, LaunchPlan
from kforge.cards import ArgSpec, Card, TensorMeta, encode_value, flatten_outputs
from kforge.backends import FakeFault


def make_card(op: torch._ops.OpOverload, *args, family: str = "other", arch: str = "cpu") -> Card:
    """A card for op(*args) as capture would record it."""
    schema = op._schema
    specs = []
    for a, v in zip(schema.arguments, args):
        if isinstance(v, torch.Tensor):
            written = bool(a.alias_info and a.alias_info.is_write)
            specs.append(ArgSpec(a.name, "tensor", a.kwarg_only, tensor=TensorMeta.of(v), written=written))
        else:
            specs.append(ArgSpec(a.name, "value", a.kwarg_only, value=encode_value(v)))
    outs = flatten_outputs(op(*[v.clone() if isinstance(v, torch.Tensor) else v for v in args]))
    aliases = {j: 0 for j, r in enumerate(schema.returns) if r.alias_info and r.alias_info.is_write}
    name = f"{schema.name}.{schema.overload_name or 'default'}"
    return Card(op=name, schema=str(schema), args=specs, outputs=[TensorMeta.of(o) for o in outs], arch=arch,
                family=family, aliases=aliases)


def relu_card(shape=(64, 256)) -> Card:
    return make_card(torch.ops.aten.relu.default, torch.randn(shape), family="pointwise")


def softmax_card(rows: int = 8, cols: int = 4096) -> Card:
    return make_card(torch.ops.aten._softmax.default, torch.randn(rows, cols), -1, False, family="normalization")


def fake(name: str, kind: str = "custom", **knobs) -> Candidate:
    """A FakeBackend candidate running evalkit.<name> for a one-input, one-output card."""
    plan = LaunchPlan.from_json({"kernels": [{"name": "k", "grid": [1], "block": [1], "args": [{"in": 0}, {"out": 0}]}]})
    return Candidate(f"evalkit:{name}", plan, kind=kind, proposer="test", knobs=knobs)


def failing_compile_backend(gm, example_inputs):
    """A torch.compile backend that raises: plays a card torch.compile cannot compile."""
    raise RuntimeError("this op cannot be compiled here")


# ---- stand-in kernels for relu ---------------------------------------------------------

def relu_good(ins, outs, ws):
    outs[0].copy_(ins[0].clamp_min(0))


def relu_sleepy(ins, outs, ws):
    time.sleep(0.005)
    relu_good(ins, outs, ws)


def relu_partial(ins, outs, ws):
    flat = outs[0].view(-1)
    flat[: flat.numel() // 2].copy_(ins[0].view(-1)[: flat.numel() // 2].clamp_min(0))


def relu_zeros(ins, outs, ws):
    outs[0].zero_()


def relu_nan(ins, outs, ws):
    relu_good(ins, outs, ws)
    outs[0].view(-1)[3] = float("nan")


def relu_mutates(ins, outs, ws):
    relu_good(ins, outs, ws)
    ins[0].view(-1)[0] = 123.0


def relu_jitter(ins, outs, ws):
    """Within tolerance, but never the same bits twice: a race."""
    noise = torch.randint(0, 2, ins[0].shape).mul(2).sub(1) * 1e-7
    outs[0].copy_(ins[0].clamp_min(0) * (1 + noise))


_first: list[torch.Tensor] = []


def relu_overfit(ins, outs, ws):
    """Remembers the first answer it computed and returns it for every input."""
    if not _first:
        _first.append(ins[0].clamp_min(0))
    outs[0].copy_(_first[0])


_launches = [0]


def relu_counter(ins, outs, ws):
    """Works for its first 8 launches (the checks take 6), then does nothing: fakes speed."""
    _launches[0] += 1
    if _launches[0] <= 8:
        relu_good(ins, outs, ws)


def relu_exit(ins, outs, ws):
    os._exit(7)


def relu_segv(ins, outs, ws):
    os.kill(os.getpid(), signal.SIGSEGV)


def relu_hang(ins, outs, ws):
    time.sleep(3600)


def relu_illegal_address(ins, outs, ws):
    raise FakeFault("CUDA_ERROR_ILLEGAL_ADDRESS")


def relu_out_of_resources(ins, outs, ws):
    raise FakeFault("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")


# ---- stand-in kernels for softmax ------------------------------------------------------

def softmax_good(ins, outs, ws):
    outs[0].copy_(torch.softmax(ins[0], -1))


def softmax_half(ins, outs, ws):
    """Computes an fp32 op in fp16: silent precision loss."""
    outs[0].copy_(torch.softmax(ins[0].half(), -1).float())


class _Faulted(torch.Tensor):
    """A tensor whose every use raises the device error its kernel left behind."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise FakeFault("CUDA_ERROR_ILLEGAL_ADDRESS")


def relu_late_fault(ins, outs, ws):
    """Its fault surfaces only when the checks read the output, outside any guarded launch."""
    relu_good(ins, outs, ws)
    outs[0] = outs[0].as_subclass(_Faulted)


def sign_skips_minus_one(ins, outs, ws):
    """Leaves alone the elements whose answer is -1: exactly the first poison's bit pattern."""
    s = ins[0].sign()
    keep = s != -1
    outs[0][keep] = s[keep]
