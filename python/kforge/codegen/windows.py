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


ORDER_KEEPING_VIEWS = frozenset({"squeeze", "unsqueeze", "view", "reshape", "_unsafe_view", "alias"})


def _ones(shape) -> list[int]:
    return [n for n in shape if n != 1]


def ones_view(op: str, src: TensorMeta, out: TensorMeta) -> bool:
    """A view (packet `op`) that only adds or drops size-1 dims (avg_pool1d's squeeze after its
    2-D pooling): the same elements in the same order. A transpose of a square plane is not one."""
    return op in ORDER_KEEPING_VIEWS and _ones(src.shape) == _ones(out.shape)


def _over(shape, strides, domain: tuple[int, ...]) -> tuple[int, ...] | None:
    """Strides over `shape` as strides over `domain`, which it equals up to size-1 dims (0 along each
    size-1 dim of the domain)."""
    if strides is None or _ones(shape) != _ones(domain):
        return None
    own = iter(st for n, st in zip(shape, strides) if n != 1)
    return tuple(0 if n == 1 else next(own) for n in domain)


def program(win: Window, domain: tuple[int, ...], views: list[tuple[int, ...]], inputs, sources, loads, out_metas,
            results, aliases) -> Program | str:
    """A pooling with its prologue and epilogue: the domain is the pooling's output shape (`domain`;
    the region's outputs are it up to size-1 dims, `views` the shapes its values took in between);
    the prologue's loads are strided over the pooled tensor's shape (win.frame), the epilogue's
    over the domain, and, read after such a view, broadcast over that view as over the domain (an
    input that would broadcast differently, (4, 1, 1) over a squeezed (4, 4, 8) against the
    domain's (4, 4, 1, 8), is declined)."""
    if win.kind.name == "pool_max" and not any(n.op == "var" and n.value == "s1" for r in results for n in r.walk()):
        win = replace(win, kind=reductions.REDUCTIONS["max"])  # indices unused: a max folds the same values
    out_strides = [_over(m.shape, m.stride, domain) for m in out_metas]
    if any(st is None for st in out_strides):
        return "a region output beside a pooling's: only the pooling's outputs are generated with it"
    in_strides = {}
    for i in loads:  # the operand's loads over the pooled tensor, the epilogue's over the output
        st = broadcast_strides(inputs[i].shape, inputs[i].stride, domain if loads[i] == "epi" else win.frame)
        if st is None:
            return f"input {i} of shape {inputs[i].shape} does not broadcast to {win.frame}"
        if loads[i] == "epi" and any(_over(q, broadcast_strides(inputs[i].shape, inputs[i].stride, q), domain)
                                     != _over(domain, st, domain) for q in views):
            return (f"input {i} of shape {inputs[i].shape} broadcasts otherwise over a view of the pooling's output "
                    f"than over the output {domain}")
        in_strides[i] = st
    if any(s < 0 for st in list(in_strides.values()) + out_strides for s in st):
        return "negative strides are not generated"
    return Program(domain, inputs, list(out_metas), in_strides, out_strides, results, None, dict(aliases), None, win,
                   sources=None if sources == list(range(len(inputs))) else sources)
