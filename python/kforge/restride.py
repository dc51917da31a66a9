"""Chains of views in a traced graph as one call each.

An aten graph spells out every view eager code made: a projection's output reshaped, its
heads split off, transposed, unsqueezed and expanded for a batched matmul is five calls, each
a trip through the dispatcher on every forward, for what is, once the graph's shapes are
fixed, one set of sizes and strides over the first tensor of the chain. A graph bound by
launch overhead pays each of them as much as a kernel launch.

`collapse(graph)` replaces each view whose input is itself a view by one `as_strided` of the
chain's base with the traced sizes and strides, at the traced distance from the base's
storage offset (what every view op computes from its input's metadata, which the graph's
guards fix). Views a chain passes through disappear where nothing else reads them. Views of a
base the trace has no value for, and views with symbolic sizes, stay as they are.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .families import _returns_view, family_of, packet_name
from .regions import _VIEW_LIKE

_as_strided = torch._C.TensorBase.as_strided


def restride(base: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...], rel: int) -> torch.Tensor:
    """The view of `base` with `size` and `stride`, `rel` elements past base's own first element."""
    return _as_strided(base, size, stride, base.storage_offset() + rel)


def _is_view(n) -> bool:
    if not isinstance(n, fx.Node) or n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    if family_of(n.target) != "view" or not (_returns_view(n.target) or packet_name(n.target) in _VIEW_LIKE) or not n.args:
        return False
    return isinstance(n.meta.get("val"), torch.Tensor) and isinstance(n.args[0], fx.Node)


def _link(n) -> bool:
    """A view, or a chain this pass has already made one call."""
    return _is_view(n) or (isinstance(n, fx.Node) and n.op == "call_function" and n.target is restride)


def _static(t) -> bool:
    return isinstance(t, torch.Tensor) and all(isinstance(x, int) for x in (*t.shape, *t.stride(), t.storage_offset()))


def collapse(graph: fx.Graph) -> int:
    """Views of views made one as_strided of their chain's base; returns how many."""
    changed = 0
    for node in list(graph.nodes):
        if not _is_view(node) or not _link(node.args[0]):
            continue  # a view of a non-view is one call already
        base = node.args[0]
        while _link(base):
            base = base.args[0]
        val, bval = node.meta["val"], base.meta.get("val")
        if not (_static(val) and _static(bval)) or val.dtype != bval.dtype:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(restride, (base, tuple(val.shape), tuple(val.stride()),
                                                 val.storage_offset() - bval.storage_offset()))
        new.meta["val"] = val
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        changed += 1
    for node in reversed(list(graph.nodes)):  # the chains' links nothing reads any more
        if _link(node) and not node.users:
            graph.erase_node(node)
    return changed
