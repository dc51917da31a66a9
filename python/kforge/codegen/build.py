"""aten nodes -> Program (the builder the ir docstring describes), for a single-op card (one
node) and for a region card (its subgraph's nodes: card_program turns a card into them).

Each node's value comes from the op table (ops.POINTWISE, reductions.REDUCTION_OPS, reductions.NORM_OPS).
Nodes before the one reduction or normalization are its prologue, evaluated over the reduced
operand's shape (the frame; the domain is the frame with group norm's channel dim split);
nodes after it are the epilogue, over the reduction's output shape, or over the whole frame
after a keepdim reduction or a norm op (a normalization). A node's value is rounded to its
output dtype, as eager stores it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..cards import TensorMeta
from ..families import family_of, packet_name
from . import reductions, windows
from .call import Call, Val
from .entries import entry_for, overload_of, table_key
from .ir import FLOATS, Expr, Node, opmath, Program, Reduction, Ref, Scan, Window, broadcast_strides, siblings
from .order import prologue_first
from .views import (Decline, composed, keeps_element_order, lead_stripped, merged_groups, moved_strides, moved_to, overlaps,
                    permute_dims, read_fine, refinement, remappable, reshaped, split_domain, split_merged, split_strides,
                    viewed_strides, widened)

IR_DTYPES = FLOATS + ("int64", "int32", "int16", "int8", "uint8", "bool")


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


def _channel_input(ref, ndim: int, inputs: list[TensorMeta], sources: list[int], what: str) -> Ref | str:
    """A per-channel vector (C,) of an (N, C, ...) operand as an input of its own with shape
    (1, C, 1, ...): the same memory, broadcast over every dim but 1."""
    if not isinstance(ref, Ref) or ref.kind != "in":
        return f"{what}: a computed per-channel vector is not generated"
    m = inputs[ref.index]
    if len(m.shape) != 1:
        return f"{what}: a per-channel argument of shape {m.shape}"
    shape = (1, m.shape[0]) + (1,) * (ndim - 2)
    inputs.append(replace(m, shape=shape, stride=(0, m.stride[0]) + (0,) * (ndim - 2)))
    sources.append(sources[ref.index])
    return Ref("in", len(inputs) - 1)


def from_nodes(nodes: list[Node], inputs: list[TensorMeta], outputs: list[Ref], out_metas: list[TensorMeta],
               aliases: dict[int, int], sources: list[int] | None = None) -> Program | str:
    """`sources`: the launch-plan input each of `inputs` reads (region_nodes); the builder
    appends inputs of its own (per-channel vectors broadcast over their operand)."""
    for m in list(inputs) + list(out_metas):
        if m.dtype not in IR_DTYPES:
            return f"dtype {m.dtype} is not generated (real floats, ints and bool are)"
    if not out_metas or all(m.numel == 0 for m in out_metas):
        return "no output, or only empty ones"
    inputs = list(inputs)
    sources = list(range(len(inputs))) if sources is None else list(sources)
    values: dict[tuple[int, int], tuple[Expr, TensorMeta]] = {}
    stats: set[tuple[int, int]] = set()  # a normalization's statistics: region outputs only
    phase = "pro"  # prologue, then epilogue after the reduction
    red: reductions.ReductionPlan | None = None
    red_kind = ""  # "reduction" or "norm": what made `red`
    sibs: list[reductions.ReductionPlan] = []  # reductions folded beside `red` over the same elements
    scan: reductions.ScanPlan | None = None
    frame: tuple[int, ...] | None = None  # the reduced operand's shape; the domain is it split (group norm)
    out_shape: tuple[int, ...] | None = None  # a plain reduction's output shape
    in_strides: dict[int, tuple[int, ...]] = {}
    loads: dict[int, str] = {}  # input -> the phase that loads it
    # Reshapes after the reduction (instance norm's view back to (N, C, ...)): frames[f] is the shape
    # nodes see after the f-th, frames[0] `frame`; an input read in two frames is two program inputs.
    frames: list[tuple[int, ...]] = []
    frame_of: dict[tuple[int, int], int] = {}
    load_frame: dict[int, int] = {}
    in_frame: dict[tuple[int, int], int] = {}
    # Views that reorder or regroup computed values (channels-last layer norm: permute, norm, permute
    # back). Before the reduction one moves every value to its domain (moved_to); `moved`: each moved
    # value's shape before and the stride maps since, `stale`: values it could not move. After the
    # reduction, a permute may only be a region output: written permuted.
    moved: dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    stale: set[tuple[int, int]] = set()
    # A reshape that merges dims an input read before it cannot be read merged through (Swin's window
    # reverse; then its view to (B, H*W, C)): the domain stays the finer shape, the later nodes' split
    # back to it (`merge`: (fine shape, their shape, its dims' factors)); the inputs read before it
    # are read over the fine shape (`fine_inputs`).
    merge: tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...]] | None = None
    fine_inputs: set[int] = set()
    pre_merge: set[tuple[int, int]] = set()  # values computed before it, other than the one it views
    split_view = False  # the reshape splits the frame (a window partition): values before it are over the frame
    written_permuted: dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def val(ref: Ref) -> Val:
        if win is not None and ref.kind == "in":  # a pooling's epilogue reads an input at each output point
            e = epi_reads.setdefault(ref.index, len(inputs))
            if e == len(inputs):
                inputs.append(inputs[ref.index])
                sources.append(sources[ref.index])
                loads[e] = "epi"
            return Val(Expr.load(e, inputs[e].dtype), inputs[e].dtype, len(inputs[e].shape))
        if win is not None and (ref.index, ref.output) in before_window:
            raise Decline("a node after a pooling reads a value from before it: its epilogue is generated from "
                          "the pooling's outputs, inputs and constants")
        if ref.kind == "in":
            i, f = ref.index, len(frames) - 1 if frames else 0
            if f:
                if (i, f) not in in_frame:
                    inputs.append(inputs[i])
                    sources.append(sources[i])
                    in_frame[(i, f)] = len(inputs) - 1
                i = in_frame[(i, f)]
            if merge is not None and i in fine_inputs:
                raise Decline(f"input {i} is read both before and after a reshape that merges dims")
            m = inputs[i]
            load_frame[i] = f
            loads.setdefault(i, phase)
            if loads[i] != phase and not red.keepdim:
                raise Decline(f"input {i} is read both before and after the reduction")
            return Val(Expr.load(i, m.dtype), m.dtype, len(m.shape))
        if (ref.index, ref.output) in stats:
            raise Decline("a node uses a normalization's statistics (mean, rstd): not generated")
        if (ref.index, ref.output) in stale:
            raise Decline("a value from before a permute, of a shape it does not broadcast to, is used after it")
        if (ref.index, ref.output) in pre_merge:
            raise Decline("a value from before a reshape that merges dims is used after it: not generated")
        if (ref.index, ref.output) in written_permuted:
            raise Decline("a permute after the reduction is read by another node: only a region output may be one")
        if frames and frame_of.get((ref.index, ref.output), 0) != len(frames) - 1:
            raise Decline("a value from before a reshape is used after it: not generated")
        e, m = values[(ref.index, ref.output)]
        return Val(e, m.dtype, len(m.shape))

    def merge_into(j: int, src: Ref, shape, to, groups, out: TensorMeta, fine: bool = True) -> None:
        """Keep the domain at the finer of `shape` and `to` (from_nodes' `merge`: `fine` when the
        view merges, else it splits the reduced operand's shape): the values so far stay functions
        of the fine domain, and only the view's is used after it."""
        nonlocal merge, split_view
        merge, split_view = ((shape, to, groups) if fine else (to, shape, groups)), not fine
        fine_inputs.update(loads if fine else ())
        pre_merge.update(values)  # the viewed value included: only the view's own is used after
        values[(j, 0)] = (values[(src.index, src.output)][0], out)

    def reshape(j: int, node: Node) -> str | None:
        """A view of a computed value that keeps its elements' order: later nodes see its shape.
        A view of an input (a cat's piece in its slab, concat.py) is that input read through the view's strides."""
        src = node.args.get("self")
        if isinstance(src, Ref) and src.kind == "in" and red is None and scan is None and win is None and not frames \
                and node.metas[0].dtype == inputs[src.index].dtype and (st := viewed_strides(
                    inputs[src.index], table_key(node.op)[0], node.args, tuple(node.metas[0].shape))) is not None:
            inputs.append(replace(inputs[src.index], shape=tuple(node.metas[0].shape), stride=st))
            sources.append(sources[src.index])
            values[(j, 0)] = (val(Ref("in", len(inputs) - 1)).expr, node.metas[0])
            return None
        if src is not None and red is None and scan is None and not frames and src.kind == "node":
            # Before any reduction every value is a function of the domain's trailing dims (loads broadcast
            # right-aligned): a view that only adds or drops leading size-1 dims, or an expand, leaves it
            # that function (repeat_kv's unsqueeze + expand of the rotated keys).
            m, out = values[(src.index, src.output)][1], node.metas[0]
            shape, to = tuple(m.shape), tuple(out.shape)
            keeps_order = keeps_element_order(table_key(node.op)[0], node.args, m, out)
            if lead_stripped(shape) == lead_stripped(to) and keeps_order or (
                    table_key(node.op)[0] == "expand" and broadcast_strides(m.shape, m.stride, to) is not None):
                values[(j, 0)] = (val(src).expr, out)
                return None
            dims = permute_dims(table_key(node.op)[0], node.args, len(shape))
            if dims is not None:
                remap = lambda st: tuple(st[d] for d in dims)  # noqa: E731
            elif out.numel == m.numel and table_key(node.op)[0] != "expand" and keeps_order:  # (as_strided may not)
                remap = lambda st: reshaped(shape, st, to)  # noqa: E731
            else:
                return (f"{packet_name(node.op)} of a computed value from {shape} to {to}: before a reduction, views "
                        "that keep the number of elements, permutes and expands are generated")
            val(src)
            groups = merged_groups(shape, to) if dims is None else None
            fine = refinement(shape, to) if groups is None and dims is None and merge is None else None
            fine_groups = merged_groups(fine, to) if fine not in (None, shape, to) else None
            if fine_groups is not None and not remappable(loads, inputs, shape, remap):  # it splits, then merges: split first
                moved_to(shape, fine, lambda st: reshaped(shape, st, fine), values, moved, stale, inputs, sources,
                         loads, load_frame)
                shape, groups, remap = fine, fine_groups, lambda st: reshaped(fine, st, to)  # noqa: E731
            if groups is not None and merge is not None and shape == merge[1]:  # merged again: (B, H, W, C) to (B, H*W, C)
                read_fine(loads, inputs, fine_inputs, merge)
                merge_into(j, src, merge[0], to, composed(merge[2], groups), out)
                return None
            if groups is not None and merge is None and not remappable(loads, inputs, shape, remap):
                merge_into(j, src, shape, to, groups, out)
                return None
            if merge is not None:
                raise Decline(f"a view from {shape} to {to} after a merging reshape: not generated")
            moved_to(shape, to, remap, values, moved, stale, inputs, sources, loads, load_frame)
            values[(j, 0)] = (values[(src.index, src.output)][0], out)
            return None
        if red is None or not red.keepdim or src is None:
            return (f"{packet_name(node.op)} of a computed value: reshapes are generated after a normalization "
                    "(or a keepdim reduction) only")
        e, m = val(src).expr, values[(src.index, src.output)][1]
        out = node.metas[0]
        dims = permute_dims(table_key(node.op)[0], node.args, len(m.shape))
        if dims is not None and not frames:
            values[(j, 0)] = (e, out)
            written_permuted[(j, 0)] = (dims, tuple(m.shape))
            return None
        groups = merged_groups(tuple(out.shape), frame) if merge is None and not frames and tuple(m.shape) == frame else None
        if groups is not None and red.split is None and any(  # a window partition: split, then permuted
                n.args.get("self") == Ref("node", j, 0) and table_key(n.op)[0] in ("permute", "transpose") for n in nodes):
            merge_into(j, src, frame, tuple(out.shape), groups, out, fine=False)
            return None
        back = table_key(node.op)[0] == "expand" and not frames and lead_stripped(out.shape) == lead_stripped(frame)  # F.normalize
        if not back and (out.numel != m.numel or reshaped(m.shape, m.stride, tuple(out.shape)) != reshaped(
                out.shape, out.stride, tuple(out.shape))):
            return f"{packet_name(node.op)} of a computed value reorders its elements: not generated"
        if back or tuple(out.shape) == tuple(m.shape):  # or restrides only size-1 dims (as_strided after a keepdim mean)
            values[(j, 0)] = (e, out)
            frame_of[(j, 0)] = frame_of.get((src.index, src.output), 0)
            return None
        if not frames:
            frames.append(frame)
        frames.append(tuple(out.shape))
        values[(j, 0)] = (e, out)
        frame_of[(j, 0)] = len(frames) - 1
        return None

    def fold_outputs(j: int, node: Node, plan: reductions.ReductionPlan, offset: int = 0) -> None:
        """The node's outputs from its fold's state, which starts at state var s<offset>."""
        kind_ = reductions.REDUCTIONS[plan.kind]
        refs = tuple(Expr.var(f"s{offset + i}", d) for i, d in enumerate(kind_.state(plan.operand.dtype)))
        dom = split_domain(frame, plan.split)
        n = math.prod(dom[d] for d in plan.dims) if dom else 1
        for k, (e, m) in enumerate(zip(plan.outputs(refs, n), node.metas)):
            values[(j, k)] = (e.cast(m.dtype), m)

    def reduce(j: int, node: Node, plan: reductions.ReductionPlan, src_meta: TensorMeta):
        nonlocal red, frame, phase
        plan = reductions.broadcastable(plan, len(src_meta.shape))
        red, frame, phase = plan, tuple(src_meta.shape), "epi"
        fold_outputs(j, node, plan)

    def sibling(j: int, node: Node, plan: reductions.ReductionPlan, kind: str, src_meta: TensorMeta) -> str | None:
        """Fold `plan` beside the reduction there is, over the same elements; or why not."""
        second, plan = "a second reduction: the IR has one reduction level", reductions.broadcastable(plan, len(src_meta.shape))
        if scan is not None or kind != "reduction" or red_kind != "reduction":
            return second + " (beside a scan or a normalization)" if scan is not None or red_kind else second
        if (plan.dims, plan.keepdim, plan.split, tuple(src_meta.shape)) != (red.dims, red.keepdim, red.split, frame):
            return second + ", and this one folds other elements than the first"
        if any(e.op == "var" and str(e.value).startswith("s") for e in plan.operand.walk()):
            return second + " (a reduction of a reduction's result)"
        fold_outputs(j, node, plan, sum(len(reductions.REDUCTIONS[p.kind].state(p.operand.dtype)) for p in [red, *sibs]))
        sibs.append(plan)
        return None

    win: Window | None = None  # a pooling node: the nodes before it its prologue, pointwise ones after it its epilogue
    win_shape: tuple[int, ...] = ()  # its output's shape: the domain (region outputs may drop its size-1 dims)
    win_views: list[tuple[int, ...]] = []  # shapes of the views after it that add or drop size-1 dims
    before_window: dict = {}  # the values computed before the pooling, which its epilogue may not read
    epi_reads: dict[int, int] = {}  # input -> its program input read over the pooling's output domain
    try:
        entries = [entry_for(n.op) for n in nodes]
        for j in prologue_first(nodes, [j for j, (k, _) in enumerate(entries) if k in ("reduction", "norm")]):
            node, (kind, entry) = nodes[j], entries[j]
            src = node.args.get("self")
            if packet_name(node.op) == "clone" and isinstance(src, Ref) and (key := (src.index, src.output)) in written_permuted:
                values[(j, 0)], written_permuted[(j, 0)] = (values[key][0], node.metas[0]), written_permuted[key]
                continue  # the permute made contiguous: written permuted as well
            if win is not None and kind != "pointwise":  # a pooling's epilogue: pointwise maps of what it computes
                if kind is None and isinstance(src, Ref) and src.kind == "node" and windows.ones_view(
                        packet_name(node.op), values[(src.index, src.output)][1], node.metas[0]):
                    values[(j, 0)] = (val(src).expr, node.metas[0])  # 1-D pooling's squeeze: the same points
                    win_views.append(tuple(node.metas[0].shape))
                    continue
                return f"{packet_name(node.op)} after a pooling: a window ends what is generated as one kernel"
            if kind is None and family_of(node.op) == "view":  # (positive is in the table)
                why = reshape(j, node)
                if why:
                    return why
                continue
            if kind is None:
                return entry
            if kind == "window" and (red is not None or scan is not None):
                return "a window beside a reduction or a scan: the IR has one fold level"
            if red is not None and not red.keepdim and any(tuple(m.shape) == frame != out_shape for m in node.metas):
                return ("a node over the reduced elements after a reduction without keepdim: a normalization "
                        "is generated from keepdim reductions (or the aten norm ops)")
            name, overload = table_key(node.op)
            channel = entry[0] if kind == "norm" else ()
            src = node.args.get("self", node.args.get("input"))
            src_meta = _meta_of(src, inputs, values) if kind in ("reduction", "norm") else None
            one = kind == "reduction" and reductions.folds_one(node.args, src_meta, node.metas[0])
            if kind == "reduction" and red is not None and not one:
                phase = "pro"  # a sibling reduction's operand is read over the reduced elements
            bound = {}
            ov = overload_of(node.op)  # its out= arguments are written, never read (nor broadcast)
            written_only = {a.name for a in ov._schema.arguments if a.is_out} if ov is not None else set()
            for k, v in node.args.items():
                if k in written_only:
                    continue
                if k in channel and v is not None:
                    ndim = len(_meta_of(node.args["input"], inputs, values).shape)
                    v = _channel_input(v, ndim, inputs, sources, f"{packet_name(node.op)} {k}")
                    if isinstance(v, str):
                        return v
                if isinstance(v, Ref):
                    bound[k] = val(v)
                elif isinstance(v, list) and any(isinstance(x, Ref) for x in v):
                    return f"{node.op}: tensor-list arguments are not generated"
                else:
                    bound[k] = v
            if name == "_to_copy":
                why = _copy_declined(bound, _meta_of(node.args["self"], inputs, values), node.metas[0])
                if why:
                    return why
            call = Call(name, overload, bound)
            if kind == "window":
                before_window.update(values)
                win = windows.window(j, node, call, _meta_of(node.args["self"], inputs, values), values)
                win_shape = tuple(node.metas[0].shape)
                if isinstance(win, str):
                    return win
                frame = win.frame
                continue
            if kind == "scan":
                if red is not None or scan is not None:
                    return "a scan beside a reduction or another scan: the IR has one fold level"
                plan = entry(call)
                scan, frame = plan, tuple(_meta_of(node.args["self"], inputs, values).shape)
                state = reductions.REDUCTIONS[plan.kind].state(plan.operand.dtype)[0]
                values[(j, 0)] = (Expr.var("s0", state).cast(node.metas[0].dtype), node.metas[0])
                continue
            if kind in ("reduction", "norm"):
                plan = entry(call) if kind == "reduction" else entry[1](call)
                if isinstance(plan, str):
                    return plan
                if kind == "norm" and isinstance(plan, tuple):  # pointwise (batch norm with running stats)
                    for k, m in enumerate(node.metas):
                        values[(j, k)] = ((plan[k] if k < len(plan) else Expr.const(0, opmath(m.dtype))).cast(m.dtype), m)
                    stats.update((j, k) for k in range(len(plan), len(node.metas)))
                    continue
                if one:  # a fold of one element: pointwise (its lift at reduced index 0, then its outputs)
                    alone = reductions.REDUCTIONS[plan.kind].lift_exprs(plan.operand, Expr.const(0, "int64"))
                    for k, (e, m) in enumerate(zip(plan.outputs(alone, 1), node.metas)):
                        values[(j, k)] = (e.cast(m.dtype), m)
                        frame_of[(j, k)] = len(frames) - 1 if frames else 0
                    continue
                if red is not None or scan is not None:
                    phase = "epi"
                    why = sibling(j, node, plan, kind, src_meta)
                    if why:
                        return why
                    continue
                reduce(j, node, plan, src_meta)
                red_kind = kind
                if kind == "norm":
                    stats.update((j, k) for k in range(1, len(node.metas)))
                else:
                    out_shape = tuple(node.metas[0].shape)
                continue
            e = entry(call)
            if isinstance(e, str):
                return e
            results = e if isinstance(e, tuple) else (e,)
            for k, (r, m) in enumerate(zip(results, node.metas)):
                values[(j, k)] = (r.cast(m.dtype), m)
                frame_of[(j, k)] = len(frames) - 1 if frames else 0
    except Decline as d:
        return str(d)
    except TypeError as e:  # a primitive given a dtype it does not take
        return f"not generated for these dtypes: {e}"

    if win is not None:
        return windows.program(win, win_shape, win_views, inputs, sources, loads, out_metas, results_of(values, outputs), aliases)
    live = [m for m in out_metas if m.numel]
    split = red.split if red is not None else None
    if red is None:
        # outputs that differ only in leading size-1 dims share one domain: the one with the most dims
        frame = tuple(max(live, key=lambda m: len(m.shape)).shape)
        if any(lead_stripped(m.shape) != lead_stripped(frame) for m in live):
            return DIFFERENT_SHAPES
        if scan is not None and not frame:
            return "a scan of a 0-dim tensor is a copy"
    if red is not None and red.keepdim and red.split is None and merge is None and not frames:
        frame = widened(frame, [inputs[i].shape for i, p in loads.items() if p == "epi"] + [m.shape for m in live], red.dims)
    if merge is not None:
        fine, frame_merged, groups = merge
        if frame != frame_merged or split is not None or frames or scan is not None or (red is not None and not red.keepdim):
            return (f"a reshape from {fine} to {frame_merged} that merges dims, then a domain of {frame}: "
                    "generated only where the nodes after it keep its shape (pointwise work, a normalization)")
        starts = [sum(len(g) for g in groups[:d]) for d in range(len(groups))]
        domain = fine
        dims = tuple(starts[d] + k for d in (red.dims if red is not None else ()) for k in range(len(groups[d])))
    else:
        domain = split_domain(frame, split)
        dims = red.dims if red is not None else ()
    keep_dom = tuple(1 if d in dims else n for d, n in enumerate(domain))
    results = results_of(values, outputs)
    def to_frame(st, f: int):  # strides over frames[f] -> over the domain
        st = st if st is None or not f else reshaped(frames[f], st, frame)
        if st is not None and merge is not None:
            return split_merged(st, merge[2])
        return st if st is None else split_strides(st, frame, split)

    for i in loads:
        m = inputs[i]
        if i in fine_inputs:  # read before a merging reshape: over the fine domain as it is
            st = broadcast_strides(m.shape, m.stride, domain)
        elif loads[i] == "pro" or red.keepdim:
            f = load_frame.get(i, 0)
            st = to_frame(broadcast_strides(m.shape, m.stride, frames[f] if f else frame), f)
        else:
            st = broadcast_strides(m.shape, m.stride, out_shape)
            st = st if st is None else _to_domain(st, domain, red.dims, red.keepdim)
        if st is None:
            return f"input {i} of shape {m.shape} does not broadcast to {frame}"
        in_strides[i] = st
    out_strides = []
    for r, m in zip(outputs, out_metas):
        f = frame_of.get((r.index, r.output), 0)
        key = (r.index, r.output)
        if key in stale:
            return "a region output from before a permute has a shape it does not broadcast to"
        if key in pre_merge and not (split_view and tuple(m.shape) == frame):  # a split's: over the frame, split too
            return "a region output from before a reshape that merges dims: not generated"
        if not m.numel:
            out_strides.append((0,) * len(domain))
        elif key in moved or key in written_permuted:  # permuted over the fine domain of a split after the norm, or the frame
            over = domain if merge is not None and written_permuted.get(key, ((), ()))[1] == merge[0] else frame
            st = moved_strides(m, moved.get(key), written_permuted.get(key), over)
            if st is None:
                return f"output of shape {m.shape} is not a permutation of the region's {frame}"
            out_strides.append(st if over is domain else to_frame(st, 0))
        elif f:
            st = to_frame(tuple(m.stride), f)
            if st is None:
                return f"output of shape {m.shape} is not a view of the region's {frame}"
            out_strides.append(st)
        elif red is None or tuple(m.shape) == frame:
            lead = len(frame) - len(m.shape)  # an output with fewer (leading size-1) dims than the domain
            out_strides.append(to_frame((0,) * lead + tuple(m.stride), 0))
        else:
            st = reshaped(m.shape, m.stride, keep_dom)
            if st is None:
                return f"output of shape {m.shape}: neither the reduced operand's {frame} nor its reduction's {keep_dom}"
            out_strides.append(st)
    if any(s < 0 for st in list(in_strides.values()) + out_strides for s in st):
        return "negative strides are not generated"
    if any(overlaps(m) for m in live):  # gaps are fine: a slab of a cat's output has them
        return "an output overlaps itself (an expanded view): not generated"
    reduction = None
    if red is not None:
        kind_ = reductions.REDUCTIONS[red.kind]
        if sibs:
            if any(st[d] for st in out_strides for d in dims):
                return "sibling reductions under a normalization are not generated"
            kind_ = siblings([(reductions.REDUCTIONS[p.kind], p.operand.dtype) for p in [red, *sibs]])
        reduction = Reduction(kind_, red.operand, dims, tuple(p.operand for p in sibs))
    if reduction is not None and not red.dims:
        return "a reduction over no dims"
    scan_ = Scan(reductions.REDUCTIONS[scan.kind], scan.operand, scan.dim) if scan is not None else None
    return Program(domain, inputs, list(out_metas), in_strides, out_strides, results, reduction, dict(aliases),
                   scan_, sources=None if sources == list(range(len(inputs))) else sources)


def results_of(values, outputs: list[Ref]) -> list[Expr]:
    """The values of the region's outputs."""
    return [values[(r.index, r.output)][0] for r in outputs]


def _meta_of(ref, inputs, values) -> TensorMeta:
    return inputs[ref.index] if ref.kind == "in" else values[(ref.index, ref.output)][1]


DIFFERENT_SHAPES = "pointwise outputs of different shapes (an inference batch norm's statistics, too)"
