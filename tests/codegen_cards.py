"""Cards for the code generator's tests, made from an op's schema alone (so the tests can
list ops from torch's tags instead of by hand), plus edge values for numerics checks."""

from __future__ import annotations

import torch

from builtin_cards import make_card, meta
from kforge.families import functional_of

A = torch.ops.aten
SHAPE = (5, 7)
BOOL_ARGS = ("mask", "condition")
# Scalar arguments by name; the rest get 2 (or 2.0 for float parameters).
SCALARS = {"rounding_mode": "floor", "approximate": "tanh", "decimals": 1, "exponent": 2.5, "eps": None,
           "min": -0.5, "max": 0.5, "min_val": -0.5, "max_val": 0.5, "alpha": 0.5, "value": 0.5, "threshold": 0.25,
           "scale": 2.0, "weight": 0.25, "lambd": 0.5, "negative_slope": 0.1, "beta": 2.0, "nan": 0.0,
           "posinf": None, "neginf": None}


def pointwise_overloads() -> dict[str, list[torch._ops.OpOverload]]:
    """Every aten overload torch tags pointwise, by packet name."""
    out: dict[str, list] = {}
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not hasattr(packet, "overloads"):
            continue
        for ov in packet.overloads():
            op = getattr(packet, ov)
            if torch.Tag.pointwise in op.tags:
                out.setdefault(name, []).append(op)
    return out


def _value(arg, dtype):
    kind = str(arg.type)
    if "Tensor" in kind:
        return meta(*SHAPE, dtype=torch.bool if arg.name in BOOL_ARGS else dtype)
    if arg.name in SCALARS:
        return SCALARS[arg.name]
    if kind.startswith("int"):
        return 2
    if kind.startswith("bool"):
        return False
    if kind.startswith(("float", "Scalar", "number", "Optional[number]", "Optional[float]")):
        return 2.0 if dtype.is_floating_point else 2
    return arg.default_value if arg.has_default_value() else None


def card_for(op: torch._ops.OpOverload, dtype=torch.float32):
    """A card of op on (5, 7) tensors of dtype (out= buffers in the dtype the op returns), or None."""
    args, kwargs = [], {}
    outs = []
    for a in op._schema.arguments:
        written = a.alias_info is not None and a.alias_info.is_write
        if written and a.kwarg_only:
            outs.append(a.name)
            continue
        v = _value(a, dtype)
        (kwargs.__setitem__(a.name, v) if a.kwarg_only else args.append(v))
    if outs:  # the out= buffers take the functional result's dtypes
        try:
            res = op(*args, **{**kwargs, **{n: meta(*SHAPE, dtype=dtype) for n in outs}})
        except Exception:
            res = None
        try:  # the functional overload's result dtype first (a meta call does not check it: isinf.out)
            first = [functional_of(op)(*args, **kwargs).dtype]
        except Exception:
            first = []
        for n in outs:
            for dt in (*first, dtype, torch.bool, torch.float32, torch.int64):
                try:
                    op(*args, **{**kwargs, **{m: meta(*SHAPE, dtype=dt) for m in outs}})
                    kwargs.update({m: meta(*SHAPE, dtype=dt) for m in outs})
                    break
                except Exception:
                    continue
            break
        del res
    try:
        return make_card(op, *args, **kwargs)
    except Exception:
        return None


EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -3.0, 1e-40, -1e-40, 1e-6, 20.0, 21.0, -20.0, 88.0, -88.0, 1e30,
         -1e30, 3e38, float("inf"), float("-inf"), float("nan")]
