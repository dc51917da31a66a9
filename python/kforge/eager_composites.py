"""Composite ops traced as eager runs them: the upsampling family.

torch registers Python decompositions for some ops that are composite in C++ (torch._decomp's
`py_impl(CompositeImplicitAutograd)`), and they run whenever the Python dispatcher is on, as it
is while aot_autograd traces a graph. For upsampling they are not what eager runs:
`F.interpolate(x, scale_factor=2)` is one `upsample_nearest2d` kernel in eager and, traced,
arange-built index tensors and an `_unsafe_index` with two of them; bilinear is four such
gathers and a blend. Inductor fuses either form into its neighbours; kforge.optimize runs a
graph's unmatched nodes one call at a time, where the traced form is several kernels for eager's
one, and the per-op cards, captured from eager, never match it.

`as_eager()` removes those Python kernels for the duration of a trace (and puts them back), so
the C++ composite runs and the graph holds the op eager calls: `upsample_nearest2d.default`,
`upsample_bilinear2d.default`, ... OpOverload.py_kernels is private to torch (present from 2.0
to 2.14): where it is missing, the trace keeps torch's decomposition, with a warning.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch

# every upsampling op whose .vec (and, in some versions, .default) overload has a Python decomposition
UPSAMPLING = ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
              "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
              "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
              "_upsample_lanczos2d_aa")
_KEYS = ("CompositeImplicitAutograd", "Autograd")


class EagerCompositesWarning(UserWarning):
    pass


def _overloads() -> list:
    found = []
    for name in UPSAMPLING:
        packet = getattr(torch.ops.aten, name, None)
        for overload in ("vec", "default"):
            op = getattr(packet, overload, None) if packet is not None else None
            if op is not None:
                found.append(op)
    return found


@contextlib.contextmanager
def as_eager() -> Iterator[None]:
    """Within it, the upsampling ops trace to the aten op eager calls (module doc)."""
    removed: list = []
    try:
        keys = [getattr(torch._C.DispatchKey, k) for k in _KEYS]
        for op in _overloads():
            for key in keys:
                if key in op.py_kernels:
                    removed.append((op, key, op.py_kernels.pop(key)))
            op._dispatch_cache.clear()
    except AttributeError as e:  # a torch without these private attributes: its decomposition stays
        _restore(removed)
        removed = []
        warnings.warn(f"torch {torch.__version__}: upsampling is traced as torch decomposes it, not as eager "
                      f"calls it ({e})", EagerCompositesWarning, stacklevel=3)
    try:
        yield
    finally:
        _restore(removed)


def _restore(removed: list) -> None:
    for op, key, kernel in removed:
        op.py_kernels[key] = kernel
    for op in {id(op): op for op, _, _ in removed}.values():
        op._dispatch_cache.clear()
