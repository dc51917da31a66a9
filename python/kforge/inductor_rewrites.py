"""The rewrites kforge's compile pass (kforge.inductor) runs on a post-grad graph: each fusable
region that matches a region card becomes one call of the card's custom op (RegionRewrite), and
each node whose call hits a single-op card's guard becomes the card's custom op where the
package's evidence says the split chain beats Inductor's fused one (OpRewrite, Evidence). The
module doc of kforge.inductor says why each step is as it is."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Sequence

import torch

from . import conv_bias
from . import regions as regions_mod
from .cards import qualified_name
from .codegen import gather
from .contraction import reader, replace_sites
from .dispatch import Variant
from .errors import CardError
from .guards import call_values, slot_kind, traced_key

log = logging.getLogger("kforge.inductor")


_UNTRACED = object()  # a node without meta["val"]: its key is "not a tensor", which no card has


class Rewrite(Protocol):
    """Rewrites a post-grad graph in place; returns how many sites it replaced."""

    key: str  # what it replaces, for the pass's uuid()
    whole: set  # ops whose every call kforge.compile keeps whole for it (Inductor's table would decompose them)

    def __call__(self, graph: torch.fx.Graph) -> int: ...


@dataclass(frozen=True)
class FusedRegion:
    """A region card's torch.compile time (the region compiled alone, with its noise) and the op
    card of each of its nodes: what a single-op card inside that region must beat."""

    compile_us: float
    noise_us: float
    op_cards: tuple  # per region node, its op card's id or None


@dataclass
class Evidence:
    """The package's numbers a fusion-aware OpRewrite decides by (see the module doc)."""

    regions: dict[tuple, FusedRegion] = field(default_factory=dict)  # by regions.match_key
    # the ops of those regions: kept whole by kforge.compile, so that its graphs show the regions as captured
    whole: set = field(default_factory=set)
    eager_us: dict[str, float] = field(default_factory=dict)  # op card id -> its eager time
    kernel_us: dict[str, float] = field(default_factory=dict)  # op card id -> its kernel's, against torch.compile
    compile_us: dict[str, float] = field(default_factory=dict)  # op card id -> its op compiled alone

    @staticmethod
    def of(package: Any) -> "Evidence":
        ev = Evidence()
        for c in package.cards:
            timing, compiled = c.entry.get("timing") or {}, c.entry.get("compile") or {}
            if c.card.region is not None:
                if compiled.get("compile_us") is not None and _resolvable(c.card.region):
                    ev.whole |= {n.overload() for n in c.card.region.nodes}
                    fused = FusedRegion(compiled["compile_us"], compiled.get("noise_us") or 0.0,
                                        tuple(n.op_card for n in c.card.region.nodes))
                    for region in (c.card.region, _as_inductor_sees(c.card.region)):
                        ev.regions[regions_mod.match_key(region, c.card.inputs)] = fused
                continue
            if timing.get("eager_us") is not None:
                ev.eager_us[c.id] = timing["eager_us"]
            if compiled.get("kernel_us") is not None:
                ev.kernel_us[c.id] = compiled["kernel_us"]
            if compiled.get("compile_us") is not None:
                ev.compile_us[c.id] = compiled["compile_us"]
        return ev

    @property
    def key(self) -> str:
        return hashlib.sha256(repr((sorted(self.regions.items(), key=repr), sorted(self.eager_us.items()),
                                    sorted(self.kernel_us.items()), sorted(self.compile_us.items()))).encode()).hexdigest()[:16]

    def wins_inside(self, card: str, node: torch.fx.Node, site: regions_mod.Site) -> bool:
        """Whether card's kernel at `node`, with the rest of `site` split off and run alone, is
        faster than Inductor's fused kernel for the site: its kernel plus the eager time of the
        site's other working nodes (more than Inductor's code for them takes) under the region
        card's torch.compile time by more than its noise. False without every number."""
        region = self.regions.get(site.match_key())
        kernel = self.kernel_us.get(card)
        if region is None or kernel is None:
            return False
        rest = [self.eager_us.get(op_card) if op_card else None for m, op_card in zip(site.nodes, region.op_cards)
                if m is not node and regions_mod.role(m) != "view"]
        return None not in rest and kernel + sum(rest) < region.compile_us - region.noise_us


def _resolvable(region: Any) -> bool:
    """Whether every op of a region exists in this torch (a package from another one may name one that does not)."""
    try:
        for n in region.nodes:
            n.overload()
    except CardError as e:
        log.info("a region card stays out of compiled graphs: %s", e)
        return False
    return True


def _loads_into_fusion(node: torch.fx.Node) -> bool:
    """An indexing op (an embedding) whose value pointwise or reduction work reads: Inductor
    lowers it as loads inside that work's kernel (an LLM's embedding inside its first norm), so a
    kernel of its own, however fast alone, adds a pass over its output. kforge's region finder
    keeps such ops out of regions, so `_fused_sites` cannot see this."""
    if not isinstance(node.target, torch._ops.OpOverload) or qualified_name(node.target) not in gather.OPS:
        return False
    return any(regions_mod.role(u) in ("compute", "reduce") for u in node.users)


class OpRewrite:
    """Nodes whose call hits a single-op card's guard, each replaced by the card's custom op.
    `fusion_aware` (compiled graphs): a node inside a fusable region only where `evidence`
    says the card wins there (see the module doc)."""

    def __init__(self, sites: Sequence[tuple[Variant, torch._ops.OpOverload]], *, fusion_aware: bool = True,
                 evidence: Evidence | None = None):
        self._tables: dict[torch._ops.OpOverload, dict[tuple, tuple[torch._ops.OpOverload, Variant]]] = {}
        for v, kernel in sites:  # later sites win on equal keys, as in eager dispatch
            op = v.card.overload()
            self._tables.setdefault(op, {})[v.guard.key] = kernel, v
        self.fusion_aware = fusion_aware
        self.evidence = evidence or Evidence()
        self.whole = self.evidence.whole if fusion_aware else set()
        self.declined: list[str] = []  # the custom ops of hits left to Inductor's fusion, one per node
        self.key = (f"fusion-aware={int(fusion_aware)}:{self.evidence.key}:" +
                    ",".join(sorted(str(k) for table in self._tables.values() for k, _ in table.values())))

    @property
    def ops(self) -> list[torch._ops.OpOverload]:
        return list(self._tables)

    def match(self, op: Any, args: Sequence, kwargs: dict) -> torch._ops.OpOverload | None:
        """The custom op a call of `op` with these (fake) arguments hits, or None."""
        hit = self._hit(op, args, kwargs)
        return None if hit is None else hit[0]

    def _hit(self, op: Any, args: Sequence, kwargs: dict) -> tuple[torch._ops.OpOverload, Variant] | None:
        table = self._tables.get(op)
        if table is None:
            return None
        vals = call_values(op._schema, args, kwargs)
        kernel, v = table.get(traced_key(op._schema, vals), (None, None))
        if kernel is None:
            return None
        # What a key cannot see, as eager dispatch checks it (inputs on one device, a device argument naming it).
        ins = [t for t in _tensor_args(op, args, kwargs) if t is not None]
        return None if v.guard.unrunnable(ins, [vals[i] for i in v.guard.device_slots]) else (kernel, v)

    def __call__(self, graph: torch.fx.Graph) -> int:
        site_of = _fused_sites(graph) if self.fusion_aware else {}
        relayout = None  # whether Inductor lays the graph out channels-last: asked at the first hit, compiled graphs only
        replaced = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in self._tables:
                continue
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val", _UNTRACED))
            hit = self._hit(node.target, args, kwargs)
            if hit is None:
                continue
            kernel, v = hit
            site = site_of.get(node)
            if self.fusion_aware and _loads_into_fusion(node):
                self.declined.append(kernel.name())
                log.info("%s stays Inductor's at %s: Inductor reads its rows inside the next kernel", kernel.name(),
                         node.name)
                continue
            if site is not None and not self.evidence.wins_inside(v.card.id, node, site):
                self.declined.append(kernel.name())
                log.info("%s stays Inductor's at %s: it fuses with its neighbours there", kernel.name(), node.name)
                continue
            inputs = [x for x in _tensor_args(node.target, node.args, node.kwargs) if x is not None]
            if relayout is None:
                relayout = self.fusion_aware and layout_optimized(graph)
            if relayout:
                outs = node.meta.get("val")
                moved = relayout_bytes([(x, 0) for x in inputs if isinstance(x, torch.fx.Node)],
                                       [(node, k) for k in range(len(outs) if isinstance(outs, (tuple, list)) else 1)])
                if not pays_for_relayout(kernel.name(), node.name, moved, self.evidence.kernel_us.get(v.card.id),
                                         self.evidence.compile_us.get(v.card.id)):
                    self.declined.append(kernel.name())
                    continue
            with graph.inserting_before(node):
                new = _call(graph, kernel, inputs)
            new.meta.update({key: val for key, val in node.meta.items() if key != "val"})
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            replaced += 1
        return replaced


def _fused_sites(graph: torch.fx.Graph) -> dict[torch.fx.Node, regions_mod.Site]:
    """Nodes Inductor fuses with others (members of a fused region of two or more working
    nodes), each with its region. A region of one node (a max pool whose indices nobody reads)
    fuses nothing: its op card is judged alone, as without it. Shared candidates, which overlap the
    fused regions, are not asked here (kforge.compile judged op cards against fused regions only
    when it was measured)."""
    return {n: site for site in regions_mod.find(graph, epilogues=False)
            if site.kind == "fused" and sum(regions_mod.role(m) != "view" for m in site.nodes) >= 2 for n in site.nodes}


def _call(graph: torch.fx.Graph, kernel: torch._ops.OpOverload, inputs: Sequence[torch.fx.Node]) -> torch.fx.Node:
    """A call of `kernel` on `inputs`, its meta["val"] the card's outputs as Inductor will lay them out."""
    from torch._guards import detect_fake_mode

    new = graph.call_function(kernel, tuple(inputs))
    fakes = [x.meta["val"] for x in inputs]
    with detect_fake_mode(fakes) or contextlib.nullcontext():
        new.meta["val"] = kernel(*fakes)
    return new


# ---- layout copies around a kernel ----------------------------------------------------------
# A kforge op takes its inputs in the stride order traced (needs_fixed_stride_order: the
# strides its guard matched). Where Inductor lays a graph's convolutions out channels-last
# (its layout optimization), a kernel between two convolutions costs a copy of its input into
# the traced layout and one of its output back, which Inductor's own fused kernel for the
# same nodes does not pay. On the H200, kforge.compile placing such kernels made MobileNetV1
# 1.47x slower than torch.compile. A site pays for those copies out of the kernel's margin
# over torch.compile, or stays Inductor's.

_CONV = (torch.ops.aten.convolution.default,)


def layout_optimized(graph: torch.fx.Graph) -> bool:
    """Whether Inductor will lay this graph's convolutions out channels-last (its own heuristic,
    a private API: False, with a log line, where it cannot be asked)."""
    gm = graph.owning_module
    if gm is None or not any(n.op == "call_function" and n.target in _CONV for n in graph.nodes):
        return False
    try:
        from torch._inductor.graph import GraphLowering

        return bool(GraphLowering.decide_layout_opt(gm, is_inference=True))
    except Exception as e:  # noqa: BLE001 (another torch: assume the layout stays as traced)
        log.info("cannot ask Inductor whether it lays this graph out channels-last: %s: %s", type(e).__name__, e)
        return False


def _users_of(node: torch.fx.Node, k: int) -> list[torch.fx.Node]:
    r = reader(node, k)
    return list(r.users) if r is not None else []


def relayout_bytes(inputs: Sequence[tuple[torch.fx.Node, int]], outputs: Sequence[tuple[torch.fx.Node, int]]) -> int:
    """Bytes Inductor's layout copies move around a kernel in a channels-last graph: each input
    of 4 or more dims that a convolution produced, and each output a convolution reads, read
    once and written once."""
    def nbytes(v: Any) -> int:
        return v.numel() * v.element_size() if isinstance(v, torch.Tensor) and v.dim() >= 4 else 0
    moved = sum(nbytes(regions_mod.traced_value(n, k)) for n, k in inputs if n.op == "call_function" and n.target in _CONV)
    moved += sum(nbytes(regions_mod.traced_value(n, k)) for n, k in outputs
                 if any(u.target in _CONV for u in _users_of(n, k)))
    return 2 * moved


def pays_for_relayout(what: str, at: str, moved: int, kernel_us: float | None, compile_us: float | None) -> bool:
    """Whether a kernel's margin over torch.compile covers the layout copies placing it costs."""
    if not moved:
        return True
    from .hardware import current

    copies_us = current().floor_us(moved)
    if kernel_us is not None and compile_us is not None and compile_us - kernel_us > copies_us:
        return True
    log.info("%s stays Inductor's at %s: Inductor lays this graph out channels-last, and the layout copies to and "
             "from the kernel (%.1f µs at least) cost more than it saves over torch.compile (%s)", what, at, copies_us,
             "no numbers" if kernel_us is None or compile_us is None else f"{compile_us - kernel_us:.1f} µs")
    return False


class ConvBiasSplit:
    """Every CUDA convolution's bias as an add after it (kforge.conv_bias, `every=True`), views
    spelled as reshapes as in Inductor's post-grad graphs: what Inductor's lowering of a
    convolution does anyway, done first so that the regions the other rewrites match and the
    fusions OpRewrite weighs are the graph Inductor will fuse, whatever else the package holds."""

    key = "conv_bias"
    whole: set = frozenset()

    def __call__(self, graph: torch.fx.Graph) -> int:
        conv_bias.split(graph, every=True, view_op=torch.ops.aten.reshape.default)
        return 0  # nothing replaced by a kforge kernel


class RegionRewrite:
    """Regions of the graph that match a region card (kforge.optimize's matching: structure and
    input metadata), each replaced by one call of the card's custom op. `kernels`: the region
    kernels (their evidence against torch.compile) and their ops."""

    def __init__(self, kernels: Sequence[tuple[Any, torch._ops.OpOverload]]):
        from .optimize import by_match

        self._op = {id(k): op for k, op in kernels}
        self._by_match = by_match([k for k, _ in kernels])
        for k, _ in kernels:  # and as Inductor's post-grad graphs show it, where that differs
            seen = _as_inductor_sees(k.card.region)
            if seen != k.card.region:
                self._by_match.setdefault(regions_mod.match_key(seen, k.card.inputs), []).append(k)
        self.whole = {n.overload() for k, _ in kernels for n in k.card.region.nodes}
        self.key = "regions:" + ",".join(sorted(op.name() for op in self._op.values()))

    def __call__(self, graph: torch.fx.Graph) -> int:
        from .optimize import match_regions

        def pays(site: regions_mod.Site, ks: list) -> bool:  # before choosing: an overlapping region may pay
            k = _aligned(site, ks)
            return pays_for_relayout(self._op[id(k)].name(), site.nodes[0].name,
                                     relayout_bytes(site.inputs, site.outputs), k.kernel_us, k.baseline_us)

        chosen = match_regions(graph, self._by_match, pays if layout_optimized(graph) else None)

        def call(i: int, inputs: list[torch.fx.Node]) -> list[torch.fx.Node]:
            site, ks = chosen[i]
            node = _call(graph, self._op[id(_aligned(site, ks))], inputs)
            if len(site.outputs) == 1:
                return [node]
            outs = [graph.call_function(operator.getitem, (node, j)) for j in range(len(site.outputs))]
            for j, out in enumerate(outs):
                out.meta["val"] = node.meta["val"][j]
            return outs

        replace_sites(graph, [site for site, _ in chosen], call)
        return len(chosen)


# Inductor's post-grad passes (view_to_reshape) turn every view into a reshape before kforge's pass runs.
_INDUCTOR_NAMES = {"aten::view.default": "aten::reshape.default"}


def _as_inductor_sees(region: Any) -> Any:
    """A captured region's subgraph with its calls named as a post-grad graph names them."""
    return replace(region, nodes=[replace(n, op=_INDUCTOR_NAMES.get(n.op, n.op)) for n in region.nodes])


def _aligned(site: regions_mod.Site, kernels: Sequence[Any]) -> Any:
    """Of the kernels whose card matches a site, the one whose input alignment is the trace's."""
    return next((k for k in kernels if [m.align for m in k.card.inputs] == [m.align for m in site.input_metas]),
                kernels[0])


def _tensor_args(op: torch._ops.OpOverload, args: Sequence, kwargs: dict) -> list:
    """A call's tensor arguments in Card.inputs order: schema order, lists flattened."""
    out: list = []
    for i, a in enumerate(op._schema.arguments):
        kind = slot_kind(a)
        if kind == "value":
            continue
        x = args[i] if i < len(args) else kwargs.get(a.name)
        out += list(x) if kind == "tensors" and x is not None else [x]
    return out
