"""Calling an original aten kernel from a Python override, faithfully.

When the dispatcher hands a call to a Python kernel, a wrapped number (the 0-dim tensor
PyTorch makes of `x + 1e-6`) arrives as a plain Python scalar, and the original kernel's
call_boxed then refuses it ("Expected a value of type 'Tensor'"). `rewrap` turns such
scalars back into 0-dim CPU tensors. Python cannot mark a tensor as a wrapped number, so
the stand-in is an ordinary 0-dim tensor, and its dtype is chosen so that type promotion
gives eager's result dtype and the value is held as exactly as eager's double holds it.
"""

from __future__ import annotations

from typing import Any

import torch

from .cards import qualified_name

_CATEGORIES = (bool, int, float, complex)  # type promotion's categories, lowest first
_WIDEST = (torch.bool, torch.int64, torch.float64, torch.complex128)


def _tensor_slots(schema: torch.FunctionSchema) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, takes part in type promotion) of every Tensor-typed argument; out=
    arguments do not take part (in-place `self` does: it is read too)."""
    return tuple((i, a.name, not (a.kwarg_only and a.alias_info is not None and a.alias_info.is_write))
                 for i, a in enumerate(schema.arguments) if str(a.type) in ("Tensor", "Optional[Tensor]"))


_SLOTS: dict[str, tuple[tuple[int, str, bool], ...]] = {}


def _category(dtype: torch.dtype) -> int:
    return 3 if dtype.is_complex else 2 if dtype.is_floating_point else 0 if dtype == torch.bool else 1


def _scalar_category(v: bool | int | float | complex) -> int:
    return next(i for i, t in enumerate(_CATEGORIES) if isinstance(v, t))


def _scalar_dtype(v: bool | int | float | complex, others: list[torch.Tensor]) -> torch.dtype:
    """The dtype of a plain 0-dim tensor standing in for the wrapped number v next to tensor
    arguments `others`. Eager's rule: a wrapped number decides the result dtype (as the
    default dtype of its category) only when no tensor argument reaches its category; a 0-dim
    tensor instead promotes with the other 0-dim tensors, so it must match their dtype."""
    cat = _scalar_category(v)
    dims = max((_category(t.dtype) for t in others if t.dim()), default=-1)
    if dims >= cat:  # dimensioned tensors of this or a higher category decide alone
        return _WIDEST[cat]
    zero = None
    for t in others:
        if not t.dim():
            zero = t.dtype if zero is None else torch.promote_types(zero, t.dtype)
    if zero is not None and _category(zero) >= cat:
        if _category(zero) == cat:
            # An int that does not fit keeps int64: the value matters more where the op computes
            # in floats (true division), and the dtype is off for an overflow eager wraps anyway.
            fits = cat != 1 or torch.iinfo(zero).min <= v <= torch.iinfo(zero).max
            return zero if fits else torch.int64
        return zero.to_real() if cat == 2 and zero.is_complex else _WIDEST[cat]
    if cat == 3 and dims == 2:  # complex next to real tensors: their precision decides
        return torch.complex128
    if cat == 3 and zero is not None and zero.is_floating_point:
        return zero.to_complex()
    return (torch.bool, torch.int64, torch.get_default_dtype(),
            torch.complex64 if torch.get_default_dtype() != torch.float64 else torch.complex128)[cat]


def _scalar_tensor(v: bool | int | float | complex, others: list[torch.Tensor]) -> torch.Tensor:
    t = torch.tensor(v, dtype=_WIDEST[_scalar_category(v)])
    dtype = _scalar_dtype(v, others)
    return t if t.dtype == dtype else t.to(dtype)  # one rounding, from v itself, as eager casts


def rewrap(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """args/kwargs with Python scalars in Tensor-typed slots turned back into 0-dim tensors."""
    key = qualified_name(op)
    slots = _SLOTS.get(key)
    if slots is None:
        slots = _SLOTS.setdefault(key, _tensor_slots(op._schema))
    found, others = [], []
    for i, name, promotes in slots:
        v = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(v, (bool, int, float, complex)):
            found.append((i, name, v))
        elif promotes and isinstance(v, torch.Tensor):
            others.append(v)
    if not found:
        return args, kwargs
    changed_args, kwargs = list(args), dict(kwargs)
    for i, name, v in found:
        if i < len(args):
            changed_args[i] = _scalar_tensor(v, others)
        else:
            kwargs[name] = _scalar_tensor(v, others)
    return tuple(changed_args), kwargs


def call_original(original: Any, op: torch._ops.OpOverload, keyset: Any, args: tuple, kwargs: dict) -> Any:
    """original.call_boxed, with wrapped numbers restored."""
    args, kwargs = rewrap(op, args, kwargs)
    return original.call_boxed(keyset, *args, **kwargs)
