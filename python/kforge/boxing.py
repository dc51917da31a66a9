"""Calling an original aten kernel from a Python override, faithfully.

When the dispatcher hands a call to a Python kernel, a wrapped number (the 0-dim tensor
PyTorch makes of `x + 1e-6`) arrives as a plain Python scalar, and the original kernel's
call_boxed then refuses it ("Expected a value of type 'Tensor'"). `rewrap` turns such
scalars back into 0-dim CPU tensors of the dtype a wrapped number has in type promotion
(default float dtype, int64, bool, default complex), so the call computes what eager did.
"""

from __future__ import annotations

from typing import Any

import torch


def _tensor_slots(schema: torch.FunctionSchema) -> tuple[tuple[int, str], ...]:
    return tuple((i, a.name) for i, a in enumerate(schema.arguments) if str(a.type) in ("Tensor", "Optional[Tensor]"))


_SLOTS: dict[str, tuple[tuple[int, str], ...]] = {}


def _scalar_tensor(v: bool | int | float | complex) -> torch.Tensor:
    if isinstance(v, bool):
        return torch.tensor(v, dtype=torch.bool)
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.get_default_dtype())
    return torch.tensor(v, dtype=torch.complex64 if torch.get_default_dtype() == torch.float32 else torch.complex128)


def rewrap(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """args/kwargs with Python scalars in Tensor-typed slots turned back into 0-dim tensors."""
    slots = _SLOTS.get(op._schema.name + "." + op._schema.overload_name)
    if slots is None:
        slots = _SLOTS.setdefault(op._schema.name + "." + op._schema.overload_name, _tensor_slots(op._schema))
    changed_args: list[Any] | None = None
    for i, name in slots:
        if i < len(args):
            v = args[i]
            if isinstance(v, (bool, int, float, complex)):
                changed_args = changed_args if changed_args is not None else list(args)
                changed_args[i] = _scalar_tensor(v)
        elif name in kwargs and isinstance(kwargs[name], (bool, int, float, complex)):
            kwargs = {**kwargs, name: _scalar_tensor(kwargs[name])}
    return (tuple(changed_args) if changed_args is not None else args), kwargs


def call_original(original: Any, op: torch._ops.OpOverload, keyset: Any, args: tuple, kwargs: dict) -> Any:
    """original.call_boxed, with wrapped numbers restored."""
    args, kwargs = rewrap(op, args, kwargs)
    return original.call_boxed(keyset, *args, **kwargs)
