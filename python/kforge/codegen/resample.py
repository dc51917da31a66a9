"""Nearest upsampling by whole factors as views and a copy the builder already generates.

`F.interpolate(x, scale_factor=k, mode="nearest")` is `upsample_nearest2d`: out[n, c, y, x] =
in[n, c, y // k, x // k] where each output size is k times the input's. That is the input with
a size-1 dim after each upsampled one, expanded to k there, copied, and viewed back with each
pair of dims merged:

    view (N, C, H, 1, W, 1) -> expand (N, C, H, k, W, k) -> clone -> view (N, C, H*k, W*k)

The builder reads the expanded input with stride 0 along the k dims and keeps the finer domain
through the merging view (build.from_nodes' `merge`), so the same nodes generate the op alone and
inside a region (an add before it, a sigmoid after it), over any layout of the output.

Eager's CUDA kernels pick the source index as min(floor(dst * scale), in - 1) in float32, scale
being 1 / scales where the call passes one and in / out otherwise (the `_exact` ops: floor((dst +
0.5) * scale)); a scale of 2.05 with an output of exactly twice the input does not pick dst // 2
everywhere. Where a whole factor k meets every index
of the output as dst // k (checked index by index here, in float32 as eager computes it), the
views are exact; other sizes and scales are declined.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..cards import TensorMeta
from .ir import Node, Ref
from .views import contiguous

NEAREST = {f"aten::{p}upsample_nearest{e}{d}d.default": d for d in (1, 2, 3) for p, e in (("", ""), ("_", "_exact"))}
_SCALES = {1: ("scales",), 2: ("scales_h", "scales_w"), 3: ("scales_d", "scales_h", "scales_w")}


def _factor(n_in: int, n_out: int, scale: float | None, exact: bool) -> int | None:
    """The whole factor eager's index map is along one dim, or None."""
    if n_in <= 0 or n_out % n_in:
        return None
    k = n_out // n_in
    if scale is not None and scale > 0:  # 1 / scale in double, then float (compute_scales_value)
        f = torch.tensor(1.0 / scale, dtype=torch.float32)
    else:  # (float)in / out
        f = torch.tensor(n_in, dtype=torch.float32) / torch.tensor(n_out, dtype=torch.float32)
    dst = torch.arange(n_out, dtype=torch.float32) + (0.5 if exact else 0.0)
    src = torch.clamp(torch.floor(dst * f).to(torch.int64), max=n_in - 1)
    return k if torch.equal(src, torch.arange(n_out) // k) else None


def nearest_nodes(node: Node, x: TensorMeta, out: TensorMeta, first: int) -> list[Node] | str:
    """The upsampling `node` (an op of NEAREST) of the tensor x as builder nodes, numbered from
    `first` (the last one's output 0 is the upsampled value), or why not."""
    spatial = NEAREST[node.op]
    if len(x.shape) != spatial + 2 or len(out.shape) != len(x.shape) or out.dtype != x.dtype:
        return "an upsampling whose input and output do not have the op's dims and one dtype"
    exact = "_exact" in node.op
    scales = [node.args.get(a) for a in _SCALES[spatial]]
    lead = tuple(x.shape[:2])
    factors = [_factor(i, o, s, exact) for i, o, s in zip(x.shape[2:], out.shape[2:], scales)]
    if tuple(out.shape[:2]) != lead or None in factors:
        return ("an upsampling by other than a whole factor per dim (or a scale that does not pick "
                "dst // k): not generated")
    ones, wide, st = list(lead), list(lead), list(x.stride[:2])  # the k dims: stride 0 in the view and the expand
    for n, k, s in zip(x.shape[2:], factors, x.stride[2:]):
        ones, wide, st = ones + [n, 1], wide + [n, k], st + [s, 0]
    ones, wide, st, shape = tuple(ones), tuple(wide), tuple(st), tuple(out.shape)
    r = lambda j: Ref("node", first + j, 0)  # noqa: E731
    return [Node("aten::view.default", {"self": node.args["self"], "size": list(ones)}, [replace(x, shape=ones, stride=st)]),
            Node("aten::expand.default", {"self": r(0), "size": list(wide), "implicit": False},
                 [replace(x, shape=wide, stride=st)]),
            Node("aten::clone.default", {"self": r(1), "memory_format": None},
                 [replace(x, shape=wide, stride=contiguous(wide), storage_offset=0)]),
            Node("aten::view.default", {"self": r(2), "size": list(shape)},
                 [replace(x, shape=shape, stride=contiguous(shape), storage_offset=0)])]
