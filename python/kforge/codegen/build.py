"""aten nodes -> Program (the builder the ir docstring describes), for a single-op card (one
node) and for a region card (its subgraph's nodes, region_nodes).

Each node's value comes from the op table (ops.POINTWISE, ops.REDUCTION_OPS). Nodes before
the one reduction are its prologue, evaluated over the reduced operand's shape (the
domain); nodes after it are the epilogue, over the reduction's output shape. A node's value
is rounded to its output dtype, as eager stores it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..cards import Card, TensorMeta, decode_value
from ..errors import CardError
from ..families import family_of, packet_name, tagged_nowhere
from ..subgraph import Node as SubNode
from ..subgraph import is_ref
from . import ops
from .ir import FLOATS, Expr, Node, Program, Reduction, Ref, Scan, Window, broadcast_strides

IR_DTYPES = FLOATS + ("int64", "int32", "int16", "int8", "uint8", "bool")


def table_key(op: str) -> tuple[str, str]:
    """'aten::add_.Tensor' -> ('add', 'Tensor'): in-place and out= forms share the entry."""
    name, _, overload = op.removeprefix("aten::").partition(".")
    if not name.startswith("__") and name.endswith("_"):
        name = name[:-1]
    return name, overload or "default"


def _overload(op: str):
    name, _, ov = op.removeprefix("aten::").partition(".")
    try:
        return getattr(getattr(torch.ops.aten, name), ov or "default")
    except AttributeError:
        return None


def entry_for(op: str):
    """('pointwise' | 'reduction' | 'scan', entry) for an op overload, or (None, why)."""
    name, overload = table_key(op)
    ov = _overload(op)
    if ov is not None and (torch.Tag.pointwise in ov.tags or name in ops.POINTWISE and tagged_nowhere(ov)) \
            or name in ("_to_copy", "copy"):
        if name in ops.POINTWISE:
            return "pointwise", ops.POINTWISE[name]
        return None, ops.DECLINED.get(name, f"{name} is not in the op table (kforge/codegen/ops.py)")
    if name in ops.SCAN_OPS:
        return "scan", ops.SCAN_OPS[name]
    if name in ops.WINDOW_OPS:
        return "window", ops.WINDOW_OPS[name]
    entry = ops.REDUCTION_OPS.get(f"{name}.{overload}") or ops.REDUCTION_OPS.get(name)
    if entry is not None and (f"{name}.{overload}" in ops.REDUCTION_OPS or name not in ("max", "min")):
        return "reduction", entry
    return None, f"no builtin template or generated kernel for {op}: not a pointwise op or reduction of the table"


def _to_domain(strides: tuple[int, ...], domain: tuple[int, ...], dims: tuple[int, ...], keepdim: bool):
    """Strides over a reduction's output shape -> strides over its domain (0 on reduced dims)."""
    if keepdim:
        return tuple(0 if d in dims else s for d, s in enumerate(strides))
    it = iter(strides)
    return tuple(0 if d in dims else next(it) for d in range(len(domain)))


def _copy_declined(args: dict, src: TensorMeta, out: TensorMeta) -> str | None:
    device, layout, dtype = args.get("device"), args.get("layout"), args.get("dtype")
    if dtype is not None and str(dtype).removeprefix("torch.") != out.dtype:
        return f"_to_copy dtype={str(dtype).removeprefix('torch.')} but the card's output is {out.dtype}"
    if device is not None and device.type != src.device:
        return f"a copy to {device.type} from {src.device} is not a kernel on one device"
    if args.get("pin_memory"):
        return "a copy with pin_memory=True makes a pinned host tensor"
    if layout is not None and layout != torch.strided:
        return f"a copy to layout {layout} is not generated (only torch.strided is)"
    return None


def _window_program(node: Node, inputs: list[TensorMeta], out_metas: list[TensorMeta], aliases) -> Program | str:
    """A pooling node alone (windows are not fused with other nodes yet)."""
    name, overload = table_key(node.op)
    ref = node.args["self"]
    if not isinstance(ref, Ref) or ref.kind != "in":
        return "a window over a computed tensor is not generated (pooling reads a card input)"
    m = inputs[ref.index]
    if m.dtype not in FLOATS:
        return f"pooling of {m.dtype} tensors: eager has no CUDA kernel for it to check a kernel against"
    plan = ops.WINDOW_OPS[name](ops.Call(name, overload, {**node.args, "self": ops.Val(Expr.load(ref.index, m.dtype),
                                                                                        m.dtype, len(m.shape))}))
    if isinstance(plan, str):
        return plan
    if any(s < 0 for s in m.stride):
        return "negative strides are not generated"
    kind = ops.REDUCTIONS[plan.kind]
    x = Expr.load(ref.index, m.dtype)
    refs = tuple(Expr.var(f"s{i}", d) for i, d in enumerate(kind.state(x.dtype)))
    results = [e.cast(o.dtype) for e, o in zip(plan.outputs(refs, Expr.var("count", "int64")), out_metas)]
    domain = tuple(out_metas[0].shape)
    win = Window(kind, ref.index, plan.kernel, plan.stride, plan.padding, plan.dilation, plan.count_include_pad,
                 plan.divisor_override)
    return Program(domain, list(inputs), list(out_metas), {ref.index: tuple(m.stride)},
                   [tuple(o.stride) for o in out_metas], results, None, dict(aliases), None, win)


def from_nodes(nodes: list[Node], inputs: list[TensorMeta], outputs: list[Ref], out_metas: list[TensorMeta],
               aliases: dict[int, int]) -> Program | str:
    for m in list(inputs) + list(out_metas):
        if m.dtype not in IR_DTYPES:
            return f"dtype {m.dtype} is not generated (real floats, ints and bool are)"
    if not out_metas or any(m.numel == 0 for m in out_metas):
        return "no output, or an empty one"
    values: dict[tuple[int, int], tuple[Expr, TensorMeta]] = {}
    phase = "pro"  # prologue, then epilogue after the reduction
    red: ops.ReductionPlan | None = None
    scan: ops.ScanPlan | None = None
    domain: tuple[int, ...] | None = None
    out_shape: tuple[int, ...] | None = None
    in_strides: dict[int, tuple[int, ...]] = {}
    loads: dict[int, str] = {}  # input -> the phase that loads it

    def val(ref: Ref) -> ops.Val:
        if ref.kind == "in":
            m = inputs[ref.index]
            loads.setdefault(ref.index, phase)
            if loads[ref.index] != phase:
                raise _Decline(f"input {ref.index} is read both before and after the reduction")
            return ops.Val(Expr.load(ref.index, m.dtype), m.dtype, len(m.shape))
        e, m = values[(ref.index, ref.output)]
        return ops.Val(e, m.dtype, len(m.shape))

    if len(nodes) == 1 and entry_for(nodes[0].op)[0] == "window":
        return _window_program(nodes[0], inputs, out_metas, aliases)
    try:
        for j, node in enumerate(nodes):
            kind, entry = entry_for(node.op)
            if kind is None:
                return entry
            if kind == "window":
                return "a window fused with other nodes is not generated yet"
            bound = {}
            for k, v in node.args.items():
                if isinstance(v, Ref):
                    bound[k] = val(v)
                elif isinstance(v, list) and any(isinstance(x, Ref) for x in v):
                    return f"{node.op}: tensor-list arguments are not generated"
                else:
                    bound[k] = v
            name, overload = table_key(node.op)
            if name == "_to_copy":
                why = _copy_declined(bound, _meta_of(node.args["self"], inputs, values), node.metas[0])
                if why:
                    return why
            call = ops.Call(name, overload, bound)
            if kind == "scan":
                if red is not None or scan is not None:
                    return "a scan beside a reduction or another scan: the IR has one fold level"
                plan = entry(call)
                scan, domain = plan, tuple(_meta_of(node.args["self"], inputs, values).shape)
                state = ops.REDUCTIONS[plan.kind].state(plan.operand.dtype)[0]
                values[(j, 0)] = (Expr.var("s0", state).cast(node.metas[0].dtype), node.metas[0])
                continue
            if kind == "reduction":
                if red is not None or scan is not None:
                    return "a second reduction: the IR has one reduction level"
                plan = entry(call)
                if isinstance(plan, str):
                    return plan
                src_meta = _meta_of(node.args["self"], inputs, values)
                red, domain, phase = plan, tuple(src_meta.shape), "epi"
                out_shape = tuple(node.metas[0].shape)
                kind_ = ops.REDUCTIONS[plan.kind]
                refs = tuple(Expr.var(f"s{i}", d) for i, d in enumerate(kind_.state(plan.operand.dtype)))
                n = math.prod(domain[d] for d in plan.dims) if domain else 1
                for k, (e, m) in enumerate(zip(plan.outputs(refs, n), node.metas)):
                    values[(j, k)] = (e.cast(m.dtype), m)
                continue
            e = entry(call)
            if isinstance(e, str):
                return e
            results = e if isinstance(e, tuple) else (e,)
            for k, (r, m) in enumerate(zip(results, node.metas)):
                values[(j, k)] = (r.cast(m.dtype), m)
    except _Decline as d:
        return str(d)
    except TypeError as e:  # a primitive given a dtype it does not take
        return f"not generated for these dtypes: {e}"

    if red is None:
        domain = out_shape = tuple(out_metas[0].shape)
        if any(tuple(m.shape) != domain for m in out_metas):
            return "pointwise outputs of different shapes"
        if scan is not None and not domain:
            return "a scan of a 0-dim tensor is a copy"
    for m in out_metas:
        if tuple(m.shape) != out_shape and red is not None:
            return (f"an output of shape {m.shape} after the reduction to {out_shape}: a normalization (the "
                    "reduced elements used again after their reduction) is not generated")
        if tuple(m.shape) != out_shape:
            return f"output of shape {m.shape}, expected {out_shape}"
    results = [values[(r.index, r.output)][0] for r in outputs]
    for i in loads:
        m = inputs[i]
        if loads[i] == "pro":
            st = broadcast_strides(m.shape, m.stride, domain)
        else:
            st = broadcast_strides(m.shape, m.stride, out_shape)
            st = st if st is None else _to_domain(st, domain, red.dims, red.keepdim)
        if st is None:
            return f"input {i} of shape {m.shape} does not broadcast to {domain}"
        in_strides[i] = st
    out_strides = []
    for m in out_metas:
        out_strides.append(tuple(m.stride) if red is None else _to_domain(tuple(m.stride), domain, red.dims, red.keepdim))
    if any(s < 0 for st in list(in_strides.values()) + out_strides for s in st):
        return "negative strides are not generated"
    for m in out_metas:
        if m.span() != m.numel:
            return "an output is not dense (it overlaps or has gaps)"
    reduction = Reduction(ops.REDUCTIONS[red.kind], red.operand, red.dims) if red is not None else None
    if reduction is not None and not red.dims:
        return "a reduction over no dims"
    scan_ = Scan(ops.REDUCTIONS[scan.kind], scan.operand, scan.dim) if scan is not None else None
    return Program(domain, list(inputs), list(out_metas), in_strides, out_strides, results, reduction, dict(aliases),
                   scan_)


class _Decline(Exception):
    pass


def _meta_of(ref, inputs, values) -> TensorMeta:
    return inputs[ref.index] if ref.kind == "in" else values[(ref.index, ref.output)][1]


def node_of_card(card: Card) -> Node:
    """The card's call as one node whose tensors are the card's inputs."""
    args, idx = {}, 0
    for a in card.args:
        if a.kind == "tensor":
            args[a.name] = Ref("in", idx)
            idx += 1
        elif a.kind == "tensors":
            refs = []
            for m in a.tensors:
                refs.append(Ref("in", idx) if m is not None else None)
                idx += m is not None
            args[a.name] = refs
        else:
            args[a.name] = decode_value(a.value)
    return Node(card.op, args, list(card.outputs))


def _view_input(n: SubNode, j: int, src, inputs: list[TensorMeta], sources: list[int]) -> Ref | str:
    """A view of a region input folded into an input of its own: the same memory read with the
    view's shape and strides (program input appended to `inputs`, its launch-plan input to
    `sources`), or why not."""
    what = f"region node {j} ({packet_name(n.op)})"
    if not isinstance(src, Ref) or src.kind != "in":
        return f"{what} is a view of a computed value: views of intermediates are not generated"
    if len(n.outputs) != 1 or n.outputs[0].dtype != inputs[src.index].dtype:
        return f"{what} splits its input or reinterprets its dtype: not generated"
    m, out = inputs[src.index], n.outputs[0]
    if out.storage_offset != m.storage_offset:
        return (f"{what} starts at storage offset {out.storage_offset}, its input at {m.storage_offset}: "
                "the kernel reads from the input's pointer")
    inputs.append(replace(out, device=m.device, align=m.align, lo=m.lo, hi=m.hi))
    sources.append(sources[src.index])
    return Ref("in", len(inputs) - 1)


def region_nodes(card: Card) -> tuple[list[Node], list[TensorMeta], list[int], list[Ref]] | str:
    """A region card's subgraph as builder nodes: (nodes, program inputs, the launch-plan input
    each reads, the refs it returns), or why not. Arguments are bound to schema names with
    their defaults filled; views of inputs become inputs (_view_input)."""
    inputs, sources = list(card.inputs), list(range(len(card.inputs)))
    refs: dict[tuple[int, int], Ref] = {}  # subgraph (node, out) -> its ref among the builder's nodes or inputs
    nodes: list[Node] = []

    def value(v):
        if is_ref(v):
            return Ref("in", v["in"]) if "in" in v else refs[(v["node"], v["out"])]
        if isinstance(v, list):
            return [value(x) for x in v]
        return decode_value(v)

    for j, n in enumerate(card.region.nodes):
        try:
            schema = n.overload()._schema.arguments
        except CardError as e:
            return str(e)
        positional = [a for a in schema if not a.kwarg_only]
        unknown = set(n.kwargs) - {a.name for a in schema}
        if len(n.args) > len(positional) or unknown:
            return f"region node {j} ({n.op}) does not match its schema"
        args = {}
        for k, a in enumerate(schema):
            if k < len(n.args) and not a.kwarg_only:
                args[a.name] = value(n.args[k])
            elif a.name in n.kwargs:
                args[a.name] = value(n.kwargs[a.name])
            elif a.has_default_value():
                args[a.name] = a.default_value
            else:
                return f"region node {j} ({n.op}) has no value for argument {a.name}"
        if family_of(n.op) == "view":
            ref = _view_input(n, j, args.get(schema[0].name) if schema else None, inputs, sources)
            if isinstance(ref, str):
                return ref
            refs[(j, 0)] = ref
            continue
        refs.update({(j, k): Ref("node", len(nodes), k) for k in range(len(n.outputs))})
        nodes.append(Node(n.op, args, list(n.outputs)))
    outputs = [refs[(r["node"], r["out"])] for r in card.region.outputs]
    if any(r.kind == "in" for r in outputs):
        return "a region output is a view of an input: there is nothing to compute"
    return nodes, inputs, sources, outputs


def program_for_card(card: Card) -> Program | str:
    if any(m.device != "cuda" for m in card.inputs + card.outputs):
        return "a tensor is not on the GPU: generated kernels read CUDA memory only"
    if not card.outputs:
        return "the op returns no tensor"
    if card.region is not None:
        conv = region_nodes(card)
        if isinstance(conv, str):
            return conv
        nodes, inputs, sources, refs = conv
        prog = from_nodes(nodes, inputs, refs, list(card.outputs), card.aliases)
        return prog if isinstance(prog, str) else replace(prog, sources=sources)
    node = node_of_card(card)
    refs = [Ref("node", 0, k) for k in range(len(card.outputs))]
    return from_nodes([node], card.inputs, refs, list(card.outputs), card.aliases)
