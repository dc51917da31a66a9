"""Fusable regions of an aten graph (kforge.graph): where one kernel can do the work of several.

Three kinds of candidates, found independently (they may overlap; the packager picks):

  fused      connected chains of pointwise, reduction, scan, normalization and pooling nodes, with
             the views between them, whose intermediates are used only inside the region.
             A region ends at vendor ops (mm/addmm/conv/attention), `other` ops but cat
             (the generator cuts a cat into slabs of pointwise work) and nearest upsampling
             (views and a copy to the generator), graph inputs
             and outputs, and at any value that is also used outside it (a multi-use value
             is a region output, never an intermediate). At most one reduction level: no
             reduction (sum, mean, softmax, layer/group norm, pooling, cumsum) may depend on another
             inside the region; the work before it is its prologue, after it its epilogue.
             Inference batch norm reduces nothing (per-channel scale and shift), so it is
             pointwise work here.
  shared     the same chains grown through values also used outside them, where such a value
             comes before a reduction in the region and is not a graph output: it is then one
             of the region's outputs (a residual sum, written beside the norm it feeds); never
             a view of the region's own input (it stays a graph node the region reads).
  epilogue   one vendor op (mm, addmm, bmm, baddbmm, convolution), the views feeding it, and
             the pointwise work after it (bias, scale, activation, residual, batch norm).

Regions are convex (no path leaves a region and comes back), have at least two nodes that
do work (or one pooling or reduction the code generator lowers whose unused outputs are at
least a quarter of the bytes it writes: a max pool's indices, which the op must write and a
region need not; or one op eager runs as several kernels, an inference batch norm), and never hold a node that
writes its inputs or draws random numbers. Each found
region is a Site: its graph nodes, the values it reads and returns, and its Subgraph
(kforge.subgraph) with the metadata the trace recorded.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from .cards import TensorMeta, dtype_name, encode_value, pointer_alignment, qualified_name
from .codegen.reductions import PER_CHANNEL, SCAN_OPS  # normalization that reduces nothing; the scans the generator folds
from .codegen.resample import NEAREST
from .errors import CardError
from .families import _returns_view, family_of, packet_name
from .subgraph import Node, Subgraph

EPILOGUE_VENDOR = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution"})
_VIEW_LIKE = frozenset({"_unsafe_view", "_reshape_alias"})  # views the schema does not mark as aliases

Value = tuple[fx.Node, int]  # a producing node and the index of the output (0 for one output)


@dataclass
class Site:
    """One region at one place in a graph."""

    kind: str
    nodes: list[fx.Node]  # members in graph order (getitem nodes are folded into refs)
    inputs: list[Value]  # values read from outside, in first-use order
    outputs: list[Value]  # member values used outside (later nodes or the graph's output)
    subgraph: Subgraph
    input_metas: list[TensorMeta]  # from the trace (alignment from the storage offset)

    def match_key(self) -> tuple:
        return match_key(self.subgraph, self.input_metas)


def match_key(subgraph: Subgraph, input_metas: Iterable[TensorMeta]) -> tuple:
    """What a traced site and a card must share to be the same region; the alignment of
    the inputs is left to the run-time guard (a trace does not know data pointers)."""
    return (subgraph.key(), tuple(m.key()[:4] for m in input_metas))


def meta_of(t: torch.Tensor) -> TensorMeta:
    """TensorMeta of a traced (fake) value: fresh allocations are 16-byte aligned, so a view's
    alignment follows from its storage offset."""
    return TensorMeta(shape=tuple(int(s) for s in t.shape), stride=tuple(int(s) for s in t.stride()),
                      dtype=dtype_name(t.dtype), device=t.device.type,
                      align=pointer_alignment(int(t.storage_offset()) * t.element_size()),
                      storage_offset=int(t.storage_offset()))


# ---- what a node is ---------------------------------------------------------------------

def _is_getitem(n: Any) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is operator.getitem


def _tensors(val: Any) -> list | None:
    """The tensors of a node's value, or None unless it is a tensor or a tuple of tensors with
    concrete shapes."""
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    if not vals or not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    if not all(isinstance(s, int) for v in vals for s in (*v.shape, *v.stride(), v.storage_offset())):
        return None
    return vals


def _output(val: Any, k: int) -> torch.Tensor | None:
    """Output k of a node's value if it is a tensor of concrete shape, else None."""
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    t = vals[k] if k < len(vals) else None
    return t if t is not None and _tensors(t) is not None else None


def _node_args(n: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), lambda a: found.append(a))
    return found


def role(n: fx.Node) -> str | None:
    """"view", "compute", "reduce", "vendor" (an epilogue's root), or None: never in a region."""
    op = n.target
    if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return None
    if any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
        return None
    if torch.Tag.nondeterministic_seeded in op.tags:
        return None
    if _tensors(n.meta.get("val")) is None:
        return None
    args = _node_args(n)
    if not args or any(_tensors(a.meta.get("val")) is None or len(_tensors(a.meta.get("val"))) != 1
                       for a in args if not _is_getitem(a)):
        return None
    name, family = packet_name(op), family_of(op)
    if family == "view":
        return "view" if _returns_view(op) or name in _VIEW_LIKE else None
    if family == "vendor":
        return "vendor" if name in EPILOGUE_VENDOR else None
    if family in ("reduction", "pooling") or name in SCAN_OPS or (family == "normalization" and name not in PER_CHANNEL):
        return "reduce"
    if family == "pointwise" and not _broadcasts(n, args):  # a pad that pads (the op table's pad is a copy)
        return None
    if family in ("pointwise", "normalization") or name == "cat":  # a cat: slabs of pointwise work (codegen/concat.py)
        return "compute"
    if qualified_name(op) in NEAREST:  # nearest upsampling: views and a copy (codegen/resample.py)
        return "compute"
    return None


def _broadcasts(n: fx.Node, args: list[fx.Node]) -> bool:
    """Whether the node's first output has its tensor inputs' broadcast shape, as pointwise work's does."""
    shapes = [tuple(t[0].shape) for t in (_tensors(a.meta.get("val")) for a in args) if t is not None and len(t) == 1]
    try:
        return tuple(_tensors(n.meta.get("val"))[0].shape) == tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return False


def traced_value(node: fx.Node, k: int) -> Any:
    """Output k's traced (fake) value of `node`: meta["val"], or its k-th item for a node with several."""
    val = node.meta.get("val")
    return val[k] if isinstance(val, (tuple, list)) else val


def _value(a: fx.Node) -> Value:
    if _is_getitem(a) and isinstance(a.args[0], fx.Node) and isinstance(a.args[0].meta.get("val"), (tuple, list)):
        return a.args[0], int(a.args[1])
    return a, 0


# ---- the graph's structure --------------------------------------------------------------

class _Graph:
    def __init__(self, graph: fx.Graph):
        self.nodes = [n for n in graph.nodes if not _is_getitem(n)]
        self.position = {n: i for i, n in enumerate(self.nodes)}
        self.roles = {n: role(n) for n in self.nodes}
        self.bit = {n: 1 << i for i, n in enumerate(graph.nodes)}
        self.anc: dict[fx.Node, int] = {}
        for n in graph.nodes:
            acc = 0
            for a in _node_args(n):
                acc |= self.anc[a] | self.bit[a]
            self.anc[n] = acc
        # consumers of each node's value(s), getitem resolved; the output node stands for "outside"
        self.users: dict[fx.Node, list[tuple[int, fx.Node]]] = {n: [] for n in self.nodes}
        for n in self.nodes:
            for a in _node_args(n):
                src, k = _value(a)
                if src in self.users:
                    self.users[src].append((k, n))
        self.producers = {n: list(dict.fromkeys(_value(a)[0] for a in _node_args(n))) for n in self.nodes}


def _eligible(g: _Graph, roles: frozenset[str]) -> set[fx.Node]:
    """Nodes that may join a region of this pass. A view joins only where it can be internal
    (every consumer may join too): regions neither start nor end on a view's output."""
    ok: set[fx.Node] = set()
    for n in reversed(g.nodes):
        r = g.roles[n]
        if r not in roles:
            continue
        if r == "view":
            users = [u for _, u in g.users[n]]
            if not users or any(u not in ok for u in users):
                continue
        ok.add(n)
    return ok


def _valid(g: _Graph, members: set[fx.Node], epilogue: bool) -> bool:
    reduces = [m for m in members if g.roles[m] == "reduce"]
    if len(reduces) > 1 and any(packet_name(m.target) in SCAN_OPS for m in reduces):
        return False  # a scan is its region's only fold (the generator folds no sibling beside it)
    mask = 0
    for m in members:
        mask |= g.bit[m]
    for m in members:  # convex: nothing outside depends on a member and feeds another member
        if any(p not in members and g.anc[p] & mask for p in g.producers[m]):
            return False
    level: dict[fx.Node, int] = {}
    for m in (n for n in g.nodes if n in members):
        inner = [p for p in g.producers[m] if p in members]
        lvl = max((level[p] for p in inner), default=0)
        if g.roles[m] == "reduce":
            if lvl >= 1:
                return False  # a second reduction level
            lvl += 1
        level[m] = lvl
    if epilogue:
        roots = [m for m in members if g.roles[m] == "vendor"]
        if len(roots) > 1:
            return False
        if roots and any(g.roles[p] != "view" for p in members if g.anc[roots[0]] & g.bit[p]):
            return False  # only the views feeding the vendor op may come before it
    return True


def _grow(g: _Graph, eligible: set[fx.Node], forbidden: set[fx.Node], epilogue: bool) -> list[set[fx.Node]]:
    """Greedy, in graph order: each node joins the regions of its producers when the result is
    still a valid region, through producers whose every consumer may join."""
    region_of: dict[fx.Node, int] = {}
    regions: dict[int, set[fx.Node]] = {}
    for i, n in enumerate(g.nodes):
        if n not in eligible:
            continue
        group = {n}
        for p in g.producers[n]:
            r = region_of.get(p)
            # (the graph's output node is never eligible: a graph output is never an intermediate)
            if r is None or r not in regions or p in forbidden or any(u not in eligible for _, u in g.users[p]):
                continue
            merged = regions[r] | group
            if _valid(g, merged, epilogue):
                del regions[r]
                group = merged
        regions[i] = group
        for m in group:
            region_of[m] = i
    return list(regions.values())


def _escaping(g: _Graph, regions: list[set[fx.Node]]) -> set[fx.Node]:
    """Members whose value is used both inside and outside their region."""
    bad = set()
    for members in regions:
        for m in members:
            inside = [u for _, u in g.users[m] if u in members]
            if inside and len(inside) < len(g.users[m]):
                bad.add(m)
    return bad


def _partition(g: _Graph, roles: frozenset[str], epilogue: bool, shared: bool = False) -> list[set[fx.Node]]:
    """Regions of the eligible nodes. Their intermediates are read only inside them, unless
    `shared`: a member read outside too is then one of its region's outputs."""
    eligible = _eligible(g, roles)
    forbidden: set[fx.Node] = set()
    if shared:
        return [_without_leading_views(g, ms) for ms in _grow(g, eligible, forbidden, epilogue)]
    while True:
        regions = _grow(g, eligible, forbidden, epilogue)
        bad = _escaping(g, regions) - forbidden
        if not bad:
            return regions
        forbidden |= bad


def _without_leading_views(g: _Graph, members: set[fx.Node]) -> set[fx.Node]:
    """The region less its views of its own inputs that are read outside it too (Swin's residual
    stream viewed as the image, read by the next block's norm and by its residual add): such a
    view is no work, and as a region output the kernel would have to return an alias of its input.
    It stays a graph node; the region reads its result."""
    members = set(members)
    while True:
        lead = {m for m in members if g.roles[m] == "view" and not any(p in members for p in g.producers[m])
                and any(u not in members for _, u in g.users[m])}
        if not lead:
            return members
        members -= lead


# ---- from members to a site -------------------------------------------------------------

def _site(g: _Graph, members: set[fx.Node], kind: str) -> Site | None:
    order = [n for n in g.nodes if n in members]
    index = {n: j for j, n in enumerate(order)}
    inputs: list[Value] = []

    def ref(a: Any) -> Any:
        if isinstance(a, fx.Node):
            src, k = _value(a)
            if src in index:
                return {"node": index[src], "out": k}
            if (src, k) not in inputs:
                inputs.append((src, k))
            return {"in": inputs.index((src, k))}
        if isinstance(a, (list, tuple)):
            return [ref(x) for x in a]
        return encode_value(a)

    values = [_tensors(n.meta.get("val")) for n in order]
    if any(v is None for v in values):
        return None  # a member whose value is not tensors of concrete shapes
    try:
        nodes = [Node(qualified_name(n.target), ref(list(n.args)),
                      {k: ref(v) for k, v in n.kwargs.items()}, [meta_of(t) for t in vals])
                 for n, vals in zip(order, values)]
    except CardError:
        return None  # an argument value cards cannot record
    outputs: list[Value] = []
    for n in order:
        for k in sorted({k for k, u in g.users[n] if u not in members}):
            outputs.append((n, k))
    refs = [{"node": index[n], "out": k} for n, k in outputs]
    # an input is one output of its source, whose others may be anything (CUDA's flash attention
    # returns its RNG state as integers beside its tensors)
    ins = [_output(src.meta.get("val"), k) for src, k in inputs]
    if any(t is None for t in ins):
        return None
    return Site(kind, order, inputs, outputs, Subgraph(nodes, refs, kind), [meta_of(t) for t in ins])


def _works(g: _Graph, members: set[fx.Node]) -> int:
    return sum(g.roles[m] != "view" for m in members)


DEAD_SHARE = 0.25  # of a node's output bytes, unused, that makes it a region on its own
# Ops eager runs as more than one kernel where one would do, each a region on its own: CUDA's
# inference batch norm computes its inverse deviations in one kernel, then normalizes in another
# (EfficientNet-B0's 20 batch norms with nothing fusable after them: 168 + 31 µs a forward on the
# H100, round 31).
SEVERAL_KERNELS = frozenset({"_native_batch_norm_legit_no_training"})


def _drops_outputs(g: _Graph, members: set[fx.Node]) -> bool:
    """One node that does work, a pooling or reduction the code generator lowers (a region the
    built-in proposer declines would cost a capture and a search for nothing), whose outputs
    nobody reads are DEAD_SHARE or more of its bytes."""
    from .codegen.entries import entry_for

    (n,) = [m for m in members if g.roles[m] != "view"]
    if entry_for(qualified_name(n.target))[0] not in ("window", "reduction"):
        return False
    outs = _tensors(n.meta.get("val")) or []
    used = {k for k, _ in g.users[n]}
    size = [t.numel() * t.element_size() for t in outs]
    return sum(b for k, b in enumerate(size) if k not in used) >= DEAD_SHARE * max(1, sum(size))


def _several_kernels(g: _Graph, members: set[fx.Node]) -> bool:
    """One node that does work, of an op eager runs as several kernels (SEVERAL_KERNELS)."""
    (n,) = [m for m in members if g.roles[m] != "view"]
    return isinstance(n.target, torch._ops.OpOverload) and packet_name(n.target) in SEVERAL_KERNELS


def _shares(g: _Graph, members: set[fx.Node]) -> bool:
    """A shared candidate: a chain with a reduction in it, one of whose values before it is read
    after the region too, by a node of the graph (not as a graph output). A transformer's residual
    stream: each residual sum feeds the next block's norm and the next residual add, so the fused
    pass stops at it and the sum and the norm run as two kernels (5 passes over the row); writing
    the sum from the norm's kernel takes 4 and one launch. It overlaps the fused regions and op
    cards it covers; what is faster where they overlap ships (choose_regions)."""
    folds = [m for m in members if g.roles[m] == "reduce"]
    exported = _escaping(g, [members])
    if any(u.op == "output" for m in exported for _, u in g.users[m]):
        return False  # no region across a graph output
    return any(g.anc[r] & g.bit[m] for m in exported for r in folds)


def find(graph: fx.Graph | fx.GraphModule, *, epilogues: bool = True) -> list[Site]:
    """The fused regions of an aten graph, the shared candidates, then (with `epilogues`) the
    vendor-op epilogue candidates, each list in graph order."""
    g = _Graph(graph.graph if isinstance(graph, fx.GraphModule) else graph)
    chains = frozenset({"view", "compute", "reduce"})
    passes: list[tuple[str, frozenset[str], Callable[[set], bool]]] = [
        ("fused", chains, lambda ms: _works(g, ms) >= 2 or _works(g, ms) == 1 and (_drops_outputs(g, ms)
                                                                                   or _several_kernels(g, ms))),
        ("shared", chains, lambda ms: _works(g, ms) >= 2 and _shares(g, ms))]
    if epilogues:
        passes.append(("epilogue", frozenset({"view", "compute", "vendor"}),
                       lambda ms: any(g.roles[m] == "vendor" for m in ms) and _works(g, ms) >= 2))
    sites = []
    for kind, roles, keep in passes:
        found = [ms for ms in _partition(g, roles, kind == "epilogue", kind == "shared") if keep(ms)]
        found.sort(key=lambda ms: min(g.position[m] for m in ms))
        sites += [s for s in (_site(g, ms, kind) for ms in found) if s is not None]
    return sites
