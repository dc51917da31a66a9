"""A convolution's bias added after it, where the ops that follow can take the add in.

Eager runs a CUDA convolution with a bias on cuDNN as two kernels: the convolution, then the bias
added in place by a broadcast add (aten's `_convolution`). On a channels-last output that add is
a strided elementwise kernel of its own: 10 µs a call on ConvNeXt-T's 32×384×14×14 in bf16 (H100,
torch 2.11), 232 µs of a 3.5 ms forward, where Inductor, which gives the convolution no bias and
adds it in the kernel of the ops after it, spends nothing on it.

`split(graph)` does what Inductor does to a traced aten graph: a 2-D or 3-D convolution with a
bias takes none, and an add of the bias viewed to broadcast over the channels follows it. The
regions kforge captures and matches then take the add into the normalization, activation or
residual add after the convolution. In the graphs kforge.optimize runs and captures regions from
(kforge.graph), only convolutions eager runs on cuDNN are split (torch's own backend choice on the
traced values): their results are eager's, the same two kernels' arithmetic; and only those read
by one op a region can take the add into, or by several such where one is a reduction (ECA's
gate: a shared region writes the sum and its mean). Elsewhere (CUDA's
depthwise kernels, the CPU's) the bias is added inside the convolution, whose rounding a split
would change. kforge.compile's pass splits every CUDA convolution (`every=True`) before its
other rewrites (inductor_rewrites.ConvBiasSplit), as Inductor's lowering of a convolution would.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from . import regions

_CONV = torch.ops.aten.convolution.default
DEVICES = ("cuda",)
CUDNN = frozenset({"Cudnn", "CudnnTranspose"})


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else None


def backend(conv: fx.Node) -> str | None:
    """The backend eager's convolution picks for the traced call (torch's _select_conv_backend on
    its FakeTensors), or None where torch cannot say."""
    select = getattr(torch._C, "_select_conv_backend", None)
    x, w, b = (_val(a) for a in conv.args[:3])
    if select is None or not all(isinstance(t, torch.Tensor) for t in (x, w)):
        return None
    try:
        return select(x, w, b, *conv.args[3:9], None).name
    except Exception:  # noqa: BLE001 (an argument this torch's binding does not take)
        return None


def _splittable(n: fx.Node, every: bool) -> bool:
    if not (n.op == "call_function" and n.target is _CONV and len(n.args) == 9 and isinstance(n.args[2], fx.Node)):
        return False
    out, b = _val(n), _val(n.args[2])
    if not (isinstance(out, torch.Tensor) and isinstance(b, torch.Tensor) and out.device.type in DEVICES
            and out.dim() in (4, 5) and b.shape == (out.shape[1],) and b.dtype == out.dtype):
        return False
    if every:
        return True
    # Read by ops a region may take the add into (a view, pointwise work, a norm): once, or by
    # several where one reduces (ECA's and squeeze-excite's mean beside the product it gates: the
    # add and the mean are then one shared region). A convolution read by a vendor op or a layout
    # copy, or twice with no reduction (ConvNeXt's downsampling, read by the next convolution and
    # the residual add), keeps its bias: its add would be one more call from Python.
    roles = [regions.role(u) for u in n.users]
    return (all(r in ("view", "compute", "reduce") for r in roles) and (len(roles) == 1 or "reduce" in roles)
            and backend(n) in CUDNN)


def split(graph: fx.Graph, *, every: bool = False, view_op: Any = torch.ops.aten.view.default) -> int:
    """Give each convolution with a bias (the module doc says which) none, and add the bias,
    viewed by `view_op`, after it; returns how many were split. Inductor's post-grad graphs
    spell every view as a reshape (view_to_reshape), and region cards are matched there so."""
    count = 0
    for conv in [n for n in graph.nodes if _splittable(n, every)]:
        bias, out = conv.args[2], _val(conv)
        shape = [1, out.shape[1]] + [1] * (out.dim() - 2)
        with graph.inserting_after(conv):
            view = graph.call_function(view_op, (bias, shape))
        with graph.inserting_after(view):
            add = graph.call_function(torch.ops.aten.add.Tensor, (conv, view))
        conv.replace_all_uses_with(add, delete_user_cb=lambda user: user is not add)
        conv.update_arg(2, None)
        view.meta["val"] = _val(bias).view(shape)
        add.meta["val"] = out + view.meta["val"]
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in conv.meta:
                view.meta[key] = add.meta[key] = conv.meta[key]
        count += 1
    return count

