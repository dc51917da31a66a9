"""A pooling in a region: its Window from the pooling node, and the Program of the pooling with its
prologue and epilogue (what build.from_nodes hands over once a region has a pooling)."""

from __future__ import annotations

from dataclasses import replace

from ..cards import TensorMeta
from . import reductions
from .call import Call
from .ir import FLOATS, Expr, Node, Program, Window, broadcast_strides


def window(j: int, node: Node, call: Call, src: TensorMeta, values) -> Window | str:
    """A pooling node's Window (its operand: the pooled value, a load or the prologue's
    expression), its outputs' values set in `values`."""
    if src.dtype not in FLOATS:
        return f"pooling of {src.dtype} tensors: eager has no CUDA kernel for it to check a kernel against"
    plan = reductions.WINDOW_OPS[call.name](call)
    if isinstance(plan, str):
        return plan
    operand = call.v("self").expr
    kind = reductions.REDUCTIONS[plan.kind]
    refs = tuple(Expr.var(f"s{i}", d) for i, d in enumerate(kind.state(operand.dtype)))
    for k, (e, m) in enumerate(zip(plan.outputs(refs, Expr.var("count", "int64")), node.metas)):
        values[(j, k)] = (e.cast(m.dtype), m)
    return Window(kind, operand, tuple(src.shape), plan.kernel, plan.stride, plan.padding, plan.dilation,
                  plan.count_include_pad, plan.divisor_override)


def program(win: Window, inputs, sources, loads, out_metas, results, aliases) -> Program | str:
    """A pooling with its prologue and epilogue: the domain is the pooling's output shape; the
    prologue's loads are strided over the pooled tensor's shape (win.frame), the epilogue's over
    the domain."""
    if win.kind.name == "argmax" and not any(n.op == "var" and n.value == "s1" for r in results for n in r.walk()):
        win = replace(win, kind=reductions.REDUCTIONS["max"])  # indices unused: a max folds the same values
    domain = tuple(out_metas[0].shape)
    if any(tuple(m.shape) != domain for m in out_metas):
        return "a region output beside a pooling's: only the pooling's outputs are generated with it"
    in_strides = {}
    for i in loads:  # the operand's loads over the pooled tensor, the epilogue's over the output
        st = broadcast_strides(inputs[i].shape, inputs[i].stride, domain if loads[i] == "epi" else win.frame)
        if st is None:
            return f"input {i} of shape {inputs[i].shape} does not broadcast to {win.frame}"
        in_strides[i] = st
    out_strides = [tuple(m.stride) for m in out_metas]
    if any(s < 0 for st in list(in_strides.values()) + out_strides for s in st):
        return "negative strides are not generated"
    return Program(domain, inputs, list(out_metas), in_strides, out_strides, results, None, dict(aliases), None, win,
                   sources=None if sources == list(range(len(inputs))) else sources)
