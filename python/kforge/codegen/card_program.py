"""What a card's program is: its call, or its region's subgraph, as the builder's nodes
(build.from_nodes). A region's views of its inputs become inputs of their own, and a pointwise
region whose outputs have different shapes becomes one program per shape (ir.Program.parts)."""

from __future__ import annotations

from dataclasses import replace

from ..cards import Card, TensorMeta, decode_value
from ..errors import CardError
from ..families import family_of, packet_name
from ..subgraph import Node as SubNode
from ..subgraph import is_ref
from . import concat, gather, resample
from .build import DIFFERENT_SHAPES, from_nodes
from .ir import Node, Program, Ref
from .views import lead_stripped


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


def _view_input(n: SubNode, j: int, src, inputs: list[TensorMeta], sources: list[int]) -> list[Ref] | str:
    """A view of a region input folded into inputs of their own, one per tensor it returns (unbind,
    split and chunk return several): the same memory read with the view's shape, strides and
    storage offset (program inputs appended to `inputs`, their launch-plan input to `sources`;
    the kernel reads from the input's pointer plus the offset), or why not."""
    what = f"region node {j} ({packet_name(n.op)})"
    if not isinstance(src, Ref) or src.kind != "in":
        return f"{what} is a view of a computed value: views of intermediates are not generated"
    m = inputs[src.index]
    if not n.outputs or any(out.dtype != m.dtype for out in n.outputs):
        return f"{what} reinterprets its input's dtype: not generated"
    refs = []
    for out in n.outputs:
        moved = (out.storage_offset - m.storage_offset) * m.itemsize  # bytes past the input's pointer
        if moved < 0:
            return f"{what} starts before its input's first element"
        align = m.align if not moved else min(m.align, moved & -moved)
        inputs.append(replace(out, device=m.device, align=align, lo=m.lo, hi=m.hi))
        sources.append(sources[src.index])
        refs.append(Ref("in", len(inputs) - 1))
    return refs


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

    for j in views_early(card.region.nodes):
        n = card.region.nodes[j]
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
        src = args.get(schema[0].name) if schema else None
        if family_of(n.op) == "view" and isinstance(src, Ref) and src.kind == "in":
            made = _view_input(n, j, src, inputs, sources)
            if isinstance(made, str):
                return made
            refs.update({(j, k): r for k, r in enumerate(made)})
            continue
        if n.op in resample.NEAREST and isinstance(src, Ref):  # views and a copy (codegen/resample.py)
            x = inputs[src.index] if src.kind == "in" else nodes[src.index].metas[src.output]
            made = resample.nearest_nodes(Node(n.op, args, list(n.outputs)), x, n.outputs[0], len(nodes))
            if isinstance(made, str):
                return made
            nodes += made
            refs[(j, 0)] = Ref("node", len(nodes) - 1, 0)
            continue
        refs.update({(j, k): Ref("node", len(nodes), k) for k in range(len(n.outputs))})
        nodes.append(Node(n.op, args, list(n.outputs)))
    outputs = [refs[(r["node"], r["out"])] for r in card.region.outputs]
    if any(r.kind == "in" for r in outputs):
        return "a region output is a view of an input: there is nothing to compute"
    return nodes, inputs, sources, outputs


def _reads(v, out: set[int]) -> set[int]:
    """The region nodes `v` (an argument) refers to, added to `out`."""
    if is_ref(v) and "node" in v:
        out.add(v["node"])
    elif isinstance(v, list):
        for x in v:
            _reads(x, out)
    return out


def views_early(nodes: list[SubNode]) -> list[int]:
    """An order of the region's nodes (a topological one) in which each view of a computed value
    with no reduction, pooling or scan before it comes right after the nodes it depends on.

    The builder moves every value computed before a view into the view's shape (build.py); a
    value the view does not read, of another shape, cannot move, and was declined where used
    after it. ECA's gate (NFNet, ECA-ResNet): the sigmoid of a (B, 1, C) convolution viewed to
    (B, C, 1, 1), after the bias added to the (B, C, H, W) map it scales. Values the view does
    not depend on are computed after it, in its shape's terms, as torch broadcasts them."""
    deps = [sorted(d for d in _reads(n.kwargs, _reads(n.args, set())) if 0 <= d < j) for j, n in enumerate(nodes)]
    order: list[int] = []
    placed: set[int] = set()

    def place(j: int) -> None:  # j after every node it depends on (refs point backwards: no cycle)
        for d in sorted(before(j)):
            if d not in placed:
                placed.add(d)
                order.append(d)

    def before(j: int) -> set[int]:  # j and every node it depends on
        seen, todo = {j}, [j]
        while todo:
            for d in deps[todo.pop()]:
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return seen

    for j, n in enumerate(nodes):
        if family_of(n.op) == "view" and {family_of(nodes[d].op) for d in before(j)} == {"pointwise", "view"}:
            place(j)  # a view of a computed value
    for j in range(len(nodes)):  # the rest in graph order: what each reads is placed by then
        if j not in placed:
            placed.add(j)
            order.append(j)
    return order


def program_for_card(card: Card) -> Program | str:
    if any(m.device != "cuda" for m in card.inputs + card.outputs):
        return "a tensor is not on the GPU: generated kernels read CUDA memory only"
    if not card.outputs:
        return "the op returns no tensor"
    if card.region is None and card.op in gather.OPS:
        return gather.program(node_of_card(card), list(card.inputs), list(card.outputs))
    if card.region is None and card.op in resample.NEAREST:
        made = resample.nearest_nodes(node_of_card(card), card.inputs[0], card.outputs[0], 0)
        if isinstance(made, str):
            return made
        return from_nodes(made, list(card.inputs), [Ref("node", len(made) - 1, 0)], list(card.outputs), card.aliases)
    if card.region is None and card.op == concat.ROLL:
        rolled = concat.roll_nodes(node_of_card(card), list(card.inputs), card.outputs[0])
        if isinstance(rolled, str):
            return rolled
        nodes, inputs, sources, ref = rolled
        if not any(concat.is_cat(n.op) for n in nodes):
            return from_nodes(nodes, inputs, [ref], list(card.outputs), card.aliases)
        return _slabbed(nodes, inputs, sources, [ref], list(card.outputs), card.aliases)
    if card.region is not None:
        conv = region_nodes(card)
        if isinstance(conv, str):
            return conv
        nodes, inputs, sources, refs = conv
    else:
        nodes, inputs, sources = [node_of_card(card)], list(card.inputs), list(range(len(card.inputs)))
        refs = [Ref("node", 0, k) for k in range(len(card.outputs))]
    if any(concat.is_cat(n.op) for n in nodes):
        return _slabbed(nodes, inputs, sources, refs, list(card.outputs), card.aliases)
    if card.region is None:  # one op: outputs of different shapes (batch norm's statistics) are declined
        return from_nodes(nodes, inputs, refs, list(card.outputs), card.aliases)
    return _built(nodes, inputs, sources, refs, list(card.outputs), card.aliases)


def _built(nodes: list[Node], inputs: list[TensorMeta], sources: list[int], refs: list[Ref],
           out_metas: list[TensorMeta], aliases: dict[int, int]) -> Program | str:
    prog = from_nodes(nodes, inputs, refs, out_metas, aliases, sources)
    if prog == DIFFERENT_SHAPES:
        return _by_shape(nodes, inputs, refs, out_metas, aliases, sources)
    if isinstance(prog, str) and len(refs) > 1:  # outputs one domain cannot hold: one part each
        alone = _parts(nodes, inputs, refs, out_metas, aliases, sources, [[j] for j in range(len(refs))])
        return prog if isinstance(alone, str) else alone
    return prog


def _slabbed(nodes: list[Node], inputs: list[TensorMeta], sources: list[int], refs: list[Ref],
             out_metas: list[TensorMeta], aliases: dict[int, int]) -> Program | str:
    """Work that reads cats as one pointwise program per slab of the outputs (concat.py), the
    parts of one launch plan; a slab that still reads cats (along another dim) is cut again, its
    slabs' offsets counted from the slab's own."""
    cut = concat.slabs(nodes, inputs, refs, out_metas, aliases, sources)
    if isinstance(cut, str):
        return cut
    progs: list[Program] = []
    for sub, sub_inputs, sub_sources, sub_refs, sub_metas, index, offsets in cut:
        for k, r in enumerate(sub_refs):
            if r.kind == "in":  # the slab is a piece of the cat as it came in: a copy of it
                sub.append(Node("aten::clone.default", {"self": r, "memory_format": None}, [sub_metas[k]]))
                sub_refs[k] = Ref("node", len(sub) - 1, 0)
        again = any(concat.is_cat(n.op) for n in sub)
        prog = (_slabbed if again else _built)(sub, sub_inputs, sub_sources, sub_refs, sub_metas, {})
        if isinstance(prog, str):
            return prog
        for p in [prog, *prog.parts]:
            if p.reduction is not None or p.scan is not None or p.window is not None:
                return "a cat beside a reduction: cats are generated in pointwise work only"
            local = p.out_index or list(range(len(p.outputs)))
            inner = p.out_offsets or [0] * len(local)
            p.out_index, p.out_offsets = [index[j] for j in local], [offsets[j] + o for j, o in zip(local, inner)]
            p.card_outputs = None
            progs.append(p)
        prog.parts = []
    if len(progs) > concat.MAX_SLABS:
        return f"cats cut into {len(progs)} slabs: at most {concat.MAX_SLABS} are generated"
    progs[0].parts, progs[0].card_outputs = progs[1:], out_metas
    return progs[0]


def _by_shape(nodes: list[Node], inputs: list[TensorMeta], outputs: list[Ref], out_metas: list[TensorMeta],
              aliases: dict[int, int], sources: list[int]) -> Program | str:
    """A region whose pointwise outputs have different shapes as one program per shape."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for j, m in enumerate(out_metas):
        groups.setdefault(lead_stripped(m.shape), []).append(j)
    return _parts(nodes, inputs, outputs, out_metas, aliases, sources, list(groups.values()))


def _parts(nodes: list[Node], inputs: list[TensorMeta], outputs: list[Ref], out_metas: list[TensorMeta],
           aliases: dict[int, int], sources: list[int], groups: list[list[int]]) -> Program | str:
    """Pointwise outputs as one program per group of them (ir.Program.parts), each built from the
    nodes its outputs need (what two of them need is computed by both). A group that one domain
    cannot hold (GQA's repeated keys beside the queries: the keys' expand regroups the heads the
    queries index directly) is built one output at a time."""
    progs = []
    for idx in groups:
        keep = _needed(nodes, [outputs[j] for j in idx])
        renumber = {old: new for new, old in enumerate(keep)}

        def moved(v):
            if isinstance(v, Ref):
                return Ref("node", renumber[v.index], v.output) if v.kind == "node" else v
            return [moved(x) for x in v] if isinstance(v, list) else v

        sub = [Node(nodes[k].op, {a: moved(v) for a, v in nodes[k].args.items()}, nodes[k].metas) for k in keep]
        local = {j: k for k, j in enumerate(idx)}
        prog = from_nodes(sub, list(inputs), [moved(outputs[j]) for j in idx], [out_metas[j] for j in idx],
                          {local[j]: i for j, i in aliases.items() if j in local}, list(sources))
        if isinstance(prog, str) and len(idx) > 1:
            alone = _parts(nodes, inputs, outputs, out_metas, aliases, sources, [[j] for j in idx])
            if isinstance(alone, str):
                return prog
            progs += [alone, *alone.parts]
            alone.parts = []
            continue
        if isinstance(prog, str):
            return prog
        if prog.reduction is not None or prog.scan is not None or prog.window is not None:
            return DIFFERENT_SHAPES
        prog.out_index = idx
        progs.append(prog)
    progs[0].parts = progs[1:]
    return progs[0]


def _needed(nodes: list[Node], refs: list[Ref]) -> list[int]:
    """The nodes `refs` depend on, in order."""
    seen, todo = set(), [r.index for r in refs if r.kind == "node"]
    while todo:
        k = todo.pop()
        if k in seen:
            continue
        seen.add(k)

        def walk(v):
            if isinstance(v, Ref) and v.kind == "node":
                todo.append(v.index)
            elif isinstance(v, list):
                for x in v:
                    walk(x)

        for v in nodes[k].args.values():
            walk(v)
    return sorted(seen)
