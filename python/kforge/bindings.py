"""An aten graph's calls made through the Python bindings eager code calls.

A traced graph names each call by its overload (torch.ops.aten.add.Tensor). Calling an
OpOverload from Python goes through its boxed path, which parses the arguments against the
schema: about 3 µs more per call on the host than the binding eager code calls (torch.add,
Tensor.view), which parses them in generated C++. A graph of a hundred calls pays that on
every forward, and a forward bound by launch overhead shows it whole.

`retarget(gm)` points each aten node at a binding of the same name (torch._C._VariableFunctions,
torch._C._nn, a Tensor method, ...) where calling that binding with the node's own arguments
dispatches exactly the node's overload and gives outputs with the node's shapes, strides and
dtypes: checked once per node on its fake values, under a dispatch mode that records what
the call dispatched. A node no binding passes for keeps its overload.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

_MODULES = (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase, torch._C._special,
            torch._C._linalg, torch._C._fft)


class _Dispatched(TorchDispatchMode):
    """The overloads a call dispatches at the top level (what it calls inside is not seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _metas(v: Any) -> list | None:
    vals = list(v) if isinstance(v, (tuple, list)) else [v]
    if not all(isinstance(t, torch.Tensor) for t in vals):
        return None
    return [(tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in vals]


def _binding(node: fx.Node, fake_mode: Any) -> Callable | None:
    op = node.target
    name = op._schema.name.split("::")[-1]
    want = _metas(node.meta.get("val"))
    if want is None:
        return None
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    for module in _MODULES:
        fn = getattr(module, name, None)
        if fn is None:
            continue
        seen = _Dispatched()
        try:
            with fake_mode, seen:
                got = fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 (this binding does not take these arguments: try the next)
            continue
        # prim.device and the like are metadata queries a view's dispatch makes, not calls
        if [o for o in seen.ops if o.namespace != "prim"] == [op] and _metas(got) == want:
            return fn
    return None


def retarget(gm: fx.GraphModule) -> int:
    """Point every aten node of `gm` whose binding passes (see the module doc) at it; returns how
    many. The caller recompiles `gm`."""
    from torch._guards import detect_fake_mode

    fakes = [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    fake_mode = detect_fake_mode(fakes)
    if fake_mode is None:
        return 0
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target.namespace != "aten":
            continue
        fn = _binding(node, fake_mode)
        if fn is not None:
            node.target = fn
            count += 1
    return count
