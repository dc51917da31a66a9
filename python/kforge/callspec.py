"""What one aten call is, in card terms: its arguments as ArgSpecs in schema order, which outputs alias a written input, and faithful CPU copies of its
tensors. Shared by the op recorder (kforge.op_capture) and the region finder."""

from __future__ import annotations

from typing import Any

import torch

from .cards import ArgSpec, TensorMeta, encode_value, flatten_outputs, pack, unpack


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """cards.faithful_clone onto the CPU: strides, storage offset and alignment kept."""
    return unpack(pack(t), TensorMeta.of(t), "cpu")


def bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """(schema argument, value) for every argument; boxed kernels leave defaults out."""
    bound = []
    for i, a in enumerate(op._schema.arguments):
        if not a.kwarg_only and i < len(args):
            v = args[i]
        elif a.name in kwargs:
            v = kwargs[a.name]
        else:
            v = a.default_value if a.has_default_value() else None
        bound.append((a, v))
    return bound


def arg_specs(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[list[ArgSpec], list[torch.Tensor]]:
    """ArgSpecs in schema order and the tensor inputs in cards' launch-plan order."""
    specs, tensors = [], []
    for a, v in bind(op, args, kwargs):
        written = a.alias_info is not None and a.alias_info.is_write
        if isinstance(v, torch.Tensor):
            specs.append(ArgSpec(a.name, "tensor", a.kwarg_only, tensor=TensorMeta.of(v), written=written))
            tensors.append(v)
        elif isinstance(v, (list, tuple)) and "Tensor" in str(a.type):
            specs.append(ArgSpec(a.name, "tensors", a.kwarg_only, written=written,
                                 tensors=[TensorMeta.of(t) if t is not None else None for t in v]))
            tensors += [t for t in v if t is not None]
        else:
            specs.append(ArgSpec(a.name, "value", a.kwarg_only, value=encode_value(v)))
    return specs, tensors


def output_aliases(op: torch._ops.OpOverload, specs: list[ArgSpec], out: Any) -> dict[int, int]:
    """Output index -> input index for outputs the schema says are a written input (relu_, add_, out=)."""
    written_at, idx = {}, 0
    for a, spec in zip(op._schema.arguments, specs):
        if spec.kind == "tensor":
            if a.alias_info is not None and a.alias_info.is_write:
                written_at[frozenset(a.alias_info.before_set)] = idx
            idx += 1
        elif spec.kind == "tensors":
            idx += sum(m is not None for m in spec.tensors)
    rets = op._schema.returns
    values = [out] if len(rets) == 1 else list(out) if isinstance(out, (tuple, list)) else []
    aliases, j = {}, 0
    for r, v in zip(rets, values):
        n = len(flatten_outputs(v))
        if n == 1 and r.alias_info is not None and r.alias_info.is_write:
            i = written_at.get(frozenset(r.alias_info.before_set))
            if i is not None:
                aliases[j] = i
        j += n
    return aliases
