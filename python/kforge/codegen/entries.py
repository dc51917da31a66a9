"""Which entry of the generator's op tables an aten op overload has: ops.POINTWISE (every op torch
tags pointwise, or that the table takes untagged), reductions' SCAN_OPS, WINDOW_OPS, NORM_OPS
and REDUCTION_OPS, or why none."""

from __future__ import annotations

import torch

from ..families import out_form_of_pointwise, tagged_nowhere
from . import ops, reductions


def table_key(op: str) -> tuple[str, str]:
    """'aten::add_.Tensor' -> ('add', 'Tensor'): in-place and out= forms share the entry."""
    name, _, overload = op.removeprefix("aten::").partition(".")
    if not name.startswith("__") and name.endswith("_"):
        name = name[:-1]
    return name, overload or "default"


def overload_of(op: str):
    """torch.ops.aten's overload named by 'aten::name.overload', or None in this torch."""
    name, _, ov = op.removeprefix("aten::").partition(".")
    try:
        return getattr(getattr(torch.ops.aten, name), ov or "default")
    except AttributeError:
        return None


def entry_for(op: str):
    """('pointwise' | 'reduction' | 'norm' | 'scan' | 'window', entry) for an op overload, or (None, why)."""
    name, overload = table_key(op)
    ov = overload_of(op)
    if ov is not None and (torch.Tag.pointwise in ov.tags or out_form_of_pointwise(ov)
                           or name in ops.POINTWISE and tagged_nowhere(ov)) \
            or name in ("_to_copy", "copy"):
        if name in ops.POINTWISE:
            return "pointwise", ops.POINTWISE[name]
        return None, ops.DECLINED.get(name, f"{name} is not in the op table (kforge/codegen/ops.py)")
    if name in reductions.SCAN_OPS:
        return "scan", reductions.SCAN_OPS[name]
    if name in reductions.WINDOW_OPS:
        return "window", reductions.WINDOW_OPS[name]
    if name in reductions.NORM_OPS:
        return "norm", reductions.NORM_OPS[name]
    entry = reductions.REDUCTION_OPS.get(f"{name}.{overload}") or reductions.REDUCTION_OPS.get(name)
    if entry is not None and (f"{name}.{overload}" in reductions.REDUCTION_OPS or name not in ("max", "min")):
        return "reduction", entry
    return None, f"no builtin template or generated kernel for {op}: not a pointwise op or reduction of the table"
