"""kforge inside torch.compile: a post-grad Inductor pass that puts a package's kernels into compiled graphs.

    compiled = kforge.compile(model, kforge.load("model.cast"))        # or pkg.compile(model)
    compiled = kforge.compile(model, pkg, mode="reduce-overhead")      # cudagraph trees
    compiled = torch.compile(model, options=pkg.inductor_options())    # the pass alone

The pass (Inductor's post_grad_custom_post_pass, a CustomGraphPass whose uuid() is the
package's digest, so Inductor's FX-graph and AOT caches key on it) rewrites each graph in three
steps, all keyed on the cards whose compile decision is "dispatched" (their kernel beat the card
compiled alone by torch.compile; kforge.package):

  regions   each fusable region of the graph (kforge.regions, the partition capture uses) whose
            structure and input metadata match a region card becomes one call of the card's
            custom op; where matched regions overlap, the set that saves the most against
            torch.compile's time of each region alone (package.choose_regions).
  ops       each node whose call hits a single-op card's guard becomes the card's custom op,
            where the node is alone in its fusable region. Inside a chain Inductor fuses
            (add -> cast -> softmax -> cast) the unit a kernel must beat is the fused kernel,
            not the op compiled alone, and an extern call in the middle of the chain would
            break the fusion into several kernels: there the node is replaced only where the
            package's evidence bounds the split chain below the fused one (Evidence.wins_inside:
            the card's kernel plus the eager time of the region's other nodes, an upper bound on
            Inductor's code for them, under the region card's torch.compile time, beyond its
            noise). kforge.optimize (no Inductor, nothing fuses) takes every hit.
  leftovers Inductor decomposes many ops before any post-grad pass runs (group_norm, softmax,
            layer_norm, ...). kforge.compile hands Inductor its own decomposition table, in
            which a call that hits a card, and every op of a region card, stays whole for the
            pass; what the pass does not replace is decomposed here as Inductor's table would
            have, so Inductor generates the code it would have generated without kforge.

The guard of an op node is the card's guard specification (kforge.guards), the one eager
dispatch checks: its key against the traced key of the node's arguments, their FakeTensors
(node.meta["val"]) described as a card describes tensors, their alignment that of their storage
offset (storage bases are 16-byte aligned; the op checks real pointers when it runs).
torch.compile(options=pkg.inductor_options()) cannot change the decomposition table: there,
cards of decomposed ops are Inductor's.

The whole model decides last: when the model check (kforge.modelcheck) found kforge.compile no
faster than torch.compile, the package records it (manifest "model_check") and compile() runs
plain torch.compile for that package, or without the cards the check names, and says so once.

The pass uses private Inductor APIs. On a torch where they are missing, compile() is plain
torch.compile and options() is empty, each with a CompileFallbackWarning that says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import operator
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Collection, Protocol, Sequence

import torch

from . import customops
from . import regions as regions_mod
from .dispatch import Launcher, Variant
from .errors import CardError, KforgeError
from .guards import call_values, slot_kind, traced_key

try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # unsupported() says so before any pass is made
    _PassBase = object

log = logging.getLogger("kforge.inductor")

# Bumped when what the pass does to a graph changes: part of uuid(), so Inductor's caches never
# serve a graph an older pass rewrote.
PASS_VERSION = 2  # 2: fusion-aware op substitution, region cards, leftovers decomposed


class CompileFallbackWarning(UserWarning):
    """kforge could not put its pass into torch.compile here; the model compiles without it."""


def unsupported() -> str | None:
    """Why this torch cannot take the pass (the private Inductor APIs it needs), or None."""
    try:
        from torch._inductor import config, custom_graph_pass, list_mode_options  # noqa: F401
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.decomposition import select_decomp_table  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no {e.name or e} (kforge's pass needs Inductor)"
    if not isinstance(getattr(custom_graph_pass, "CustomGraphPass", None), type):
        return f"torch {torch.__version__} has no torch._inductor.custom_graph_pass.CustomGraphPass"
    try:  # (after the check above: importing the pattern matcher imports CustomGraphPass)
        from torch._inductor.pattern_matcher import stable_topological_sort  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no {e.name or e} (kforge's region rewrite needs it)"
    if "post_grad_custom_post_pass" not in config.get_config_copy():
        return f"torch {torch.__version__}'s Inductor has no post_grad_custom_post_pass option"
    if "decompositions" not in inspect.signature(compile_fx).parameters:
        return f"torch {torch.__version__}'s compile_fx takes no decomposition table"
    return None


# ---- matching nodes against cards ------------------------------------------------------------

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
        return ev

    @property
    def key(self) -> str:
        return hashlib.sha256(repr((sorted(self.regions.items(), key=repr), sorted(self.eager_us.items()),
                                    sorted(self.kernel_us.items()))).encode()).hexdigest()[:16]

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
            if site is not None and not self.evidence.wins_inside(v.card.id, node, site):
                self.declined.append(kernel.name())
                log.info("%s stays Inductor's at %s: it fuses with its neighbours there", kernel.name(), node.name)
                continue
            inputs = [x for x in _tensor_args(node.target, node.args, node.kwargs) if x is not None]
            with graph.inserting_before(node):
                new = _call(graph, kernel, inputs)
            new.meta.update({key: val for key, val in node.meta.items() if key != "val"})
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            replaced += 1
        return replaced


def _fused_sites(graph: torch.fx.Graph) -> dict[torch.fx.Node, regions_mod.Site]:
    """Nodes Inductor fuses with others (members of a fused region of two or more working
    nodes), each with its region."""
    return {n: site for site in regions_mod.find(graph, epilogues=False) for n in site.nodes}


def _call(graph: torch.fx.Graph, kernel: torch._ops.OpOverload, inputs: Sequence[torch.fx.Node]) -> torch.fx.Node:
    """A call of `kernel` on `inputs`, its meta["val"] the card's outputs as Inductor will lay them out."""
    from torch._guards import detect_fake_mode

    new = graph.call_function(kernel, tuple(inputs))
    fakes = [x.meta["val"] for x in inputs]
    with detect_fake_mode(fakes) or contextlib.nullcontext():
        new.meta["val"] = kernel(*fakes)
    return new


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
        from torch._inductor.pattern_matcher import stable_topological_sort

        from .optimize import match_regions

        chosen = match_regions(graph, self._by_match)
        for site, ks in chosen:
            _replace_site(graph, site, self._op[id(_aligned(site, ks))])
        if chosen:
            stable_topological_sort(graph)  # an output's user may stand before the site's last node
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


def _replace_site(graph: torch.fx.Graph, site: regions_mod.Site, kernel: torch._ops.OpOverload) -> None:
    """The site's nodes become one call of `kernel`, placed before its last node (after every
    input, since each input feeds a member); the caller re-sorts the graph for outputs' users."""
    def read(src: torch.fx.Node, k: int) -> torch.fx.Node:
        if isinstance(src.meta.get("val"), (tuple, list)):  # read through its getitem node
            return next(u for u in src.users if regions_mod._is_getitem(u) and regions_mod._value(u) == (src, k))
        return src

    with graph.inserting_before(site.nodes[-1]):
        call = _call(graph, kernel, [read(src, k) for src, k in site.inputs])
        outs = [call] if len(site.outputs) == 1 else [graph.call_function(operator.getitem, (call, j))
                                                        for j in range(len(site.outputs))]
    if len(outs) > 1:
        for j, out in enumerate(outs):
            out.meta["val"] = call.meta["val"][j]
    for (src, k), out in zip(site.outputs, outs):
        read(src, k).replace_all_uses_with(out)  # an output value has no user inside its region
    members = set(site.nodes)
    doomed = [n for n in graph.nodes if n in members or (regions_mod._is_getitem(n) and n.args[0] in members)]
    for n in reversed(doomed):
        graph.erase_node(n)


class Decompose:
    """What kforge.compile kept whole for the pass and the pass did not replace, decomposed as
    Inductor's own table decomposes it (each node traced through the table and inlined)."""

    whole: frozenset = frozenset()

    def __init__(self, kept: Collection[torch._ops.OpOverload], table: dict):
        self.kept, self._table = frozenset(kept), table
        self.key = "decompose:" + ",".join(sorted(op.name() for op in self.kept))

    def __call__(self, graph: torch.fx.Graph) -> int:
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in self.kept:
                _inline_decomposition(graph, node, self._table)
        return 0  # nothing replaced by a kernel


def _inline_decomposition(graph: torch.fx.Graph, node: torch.fx.Node, table: dict) -> None:
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils import _pytree as pytree

    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    slots = [i for i, x in enumerate(flat) if isinstance(x, torch.fx.Node)]
    fakes = [flat[i].meta["val"] for i in slots]

    def call(*tensors: Any) -> Any:
        vals = list(flat)
        for i, t in zip(slots, tensors):
            vals[i] = t
        args, kwargs = pytree.tree_unflatten(vals, spec)
        out = table[node.target](*args, **kwargs)
        # A plain tuple: a decomposition's named tuple (native_layer_norm's return type) would be
        # traced as a call of its class, which Inductor cannot lower.
        return tuple(out) if isinstance(out, tuple) else out

    try:
        with detect_fake_mode(fakes) or contextlib.nullcontext(), enable_python_dispatcher():
            sub = make_fx(call, table, tracing_mode="real")(*fakes)
    except Exception as e:  # noqa: BLE001 (the node stays whole: Inductor runs it as an extern op)
        log.warning("kforge could not decompose %s (%s: %s); Inductor runs it whole", node.name, type(e).__name__, e)
        return
    env: dict[torch.fx.Node, Any] = {}
    placeholders = iter(flat[i] for i in slots)
    result: Any = None
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "output":
                result = torch.fx.node.map_arg(n.args[0], lambda a: env[a])
            else:
                env[n] = graph.node_copy(n, lambda a: env[a])
    if isinstance(result, (list, tuple)):
        for user in list(node.users):  # a tuple's users are its getitem nodes
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)


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


# ---- the pass --------------------------------------------------------------------------------

class KforgePass(_PassBase):
    """The post-grad pass: runs its rewrites in order on every graph Inductor compiles.
    `keeps_whole`: its graphs were traced with kforge's decomposition table (part of uuid():
    another table traces another graph)."""

    def __init__(self, digest: str, rewrites: Sequence[Rewrite], *, keeps_whole: bool):
        self.rewrites = list(rewrites)
        state = f"{PASS_VERSION}|{digest}|{int(keeps_whole)}|" + "|".join(r.key for r in self.rewrites)
        self._uuid = hashlib.sha256(state.encode()).hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        n = sum(rewrite(graph) for rewrite in self.rewrites)
        log.debug("kforge pass: %d sites replaced by kforge kernels", n)

    def uuid(self) -> str:
        return self._uuid

    def __deepcopy__(self, memo: dict) -> "KforgePass":
        # Inductor deep-copies its config (cudagraph trees do, with the options holding this
        # pass); the pass holds loaded kernels, which cannot be copied and need not be: it
        # never changes after it is made, and uuid() is what caches key on.
        return self


def _rewrites(package: Any, launcher: Launcher | None, *, compiled: bool = True,
              drop: Collection[str] = ()) -> list[Rewrite]:
    """The package's rewrites, less the cards in `drop`. compiled=True (kforge.compile): its
    region cards, then its single-op cards, each where its compile decision is "dispatched"
    (the kernel beat the card compiled alone by torch.compile), single-op cards fusion-aware.
    compiled=False (kforge.optimize, whose graphs run eager around them and do their regions
    themselves): the single-op cards eager dispatch takes, at every hit."""
    kernels = {c.id: c.candidate for c in package.cards if (c.compiled if compiled else c.dispatched)}
    if launcher is None and kernels:
        try:  # one launcher for the region and the op kernels
            launcher = package.launcher()
        except KforgeError as e:  # nothing has run yet: Inductor serves every call
            package._fall_back(f"its kernels cannot be loaded here: {e}")
            return []
    out: list[Rewrite] = []
    if compiled:
        from .optimize import region_kernels

        regions = [(k, customops.region_op(k, kernels[k.card.id].digest()))
                   for k in region_kernels(package, launcher, compiled=True)
                   if k.card.id not in drop and _resolvable(k.card.region)]
        if regions:
            out.append(RegionRewrite(regions))
    sites = []
    for v in package.variants(launcher, compiled=compiled):  # single-op cards
        if v.card.id in drop:
            continue
        why = customops.op_blocker(v.card)
        if why:
            log.info("card %s stays out of compiled graphs: %s", v.card.id, why)
            continue
        sites.append((v, customops.kernel_op(v, kernels[v.card.id].digest())))
    return out + ([OpRewrite(sites, fusion_aware=compiled, evidence=Evidence.of(package) if compiled else None)]
                  if sites else [])


def _decompositions(rewrites: Sequence[Rewrite]) -> tuple[dict, set]:
    """Inductor's decomposition table, except that a call hitting an OpRewrite's card, and every
    call of an op a rewrite keeps whole (the ops of the regions it matches), stays whole; and the
    ops so kept."""
    from torch._inductor.decomposition import select_decomp_table

    table = dict(select_decomp_table())
    kept = {op for rewrite in rewrites for op in rewrite.whole} & set(table)
    for op in kept:
        table[op] = _keep_whole(None, op, table[op])
    for rewrite in rewrites:
        for op in set(getattr(rewrite, "ops", ())) - kept:
            if op in table:
                table[op] = _keep_whole(rewrite.match, op, table[op])
                kept.add(op)
    return table, kept


def _keep_whole(match: Callable | None, op: Any, decompose: Callable) -> Callable:
    """`decompose`, except where `match` (None: always) says the call is a card's."""
    def decomposition(*args: Any, **kwargs: Any) -> Any:
        # NotImplemented: the tracer records the op itself, which the pass then replaces or decomposes.
        if match is None or match(op, args, kwargs) is not None:
            return NotImplemented
        return decompose(*args, **kwargs)

    return decomposition


def _fall_back(why: str) -> None:
    message = f"kforge's kernels stay out of this compiled model: {why}; it compiles with plain torch.compile"
    log.warning(message)
    warnings.warn(message, CompileFallbackWarning, stacklevel=3)


_said: set[str] = set()  # packages whose model verdict compile() has reported


def _verdict(package: Any) -> tuple[bool, list[str]]:
    """(whether kforge.compile runs plain torch.compile for this package, the cards it leaves
    out), from the model check the package records; the message once per package."""
    check = (getattr(package, "manifest", None) or {}).get("model_check")
    if not check:
        return False, []
    plain, drop = check["use"] == "torch.compile", list(check.get("drop") or [])
    if package.digest not in _said and (plain or drop):
        _said.add(package.digest)
        numbers = (f"torch.compile {check['torch_compile_us']:.1f} µs, kforge.compile {check['kforge_compile_us']:.1f} "
                   f"µs on {check.get('device') or 'its GPU'}")
        what = ("it compiles with plain torch.compile" if plain else
                f"it compiles without card(s) {', '.join(drop)}, which the check found to slow it")
        message = (f"{package.path}: the model check found kforge.compile {check['verdict']} than torch.compile "
                   f"({numbers}): {what}; kforge.compile(..., use_verdict=False) overrides")
        log.warning(message)
        warnings.warn(message, CompileFallbackWarning, stacklevel=3)
    return plain, drop


def options(package: Any, *, launcher: Launcher | None = None) -> dict:
    """Inductor options installing `package`'s pass: torch.compile(model, options=...). Cards of
    ops Inductor decomposes (group_norm, softmax, layer_norm, ...) only reach graphs through
    kforge.compile. Add your own options to the dict (and mode's, e.g. "triton.cudagraphs": True
    for reduce-overhead: torch.compile takes options or mode, not both). The package's model
    verdict holds here too: {} where it says plain torch.compile."""
    why = unsupported()
    if why:
        _fall_back(why)
        return {}
    plain, drop = _verdict(package)
    if plain:
        return {}
    return {"post_grad_custom_post_pass": KforgePass(package.digest, _rewrites(package, launcher, drop=drop),
                                                     keeps_whole=False)}


def compile(model: Any, package: Any, *, launcher: Launcher | None = None, drop: Collection[str] = (),
            use_verdict: bool = True, **torch_compile_options: Any) -> Any:
    """`model` under torch.compile (Inductor) with `package`'s kernels inside the compiled graphs
    wherever a region or call hits a dispatched card (see the module doc); everything else is
    Inductor's. Takes torch.compile's arguments (mode, options, fullgraph, dynamic, ...); dynamic
    defaults to False, since a card is one exact shape. `launcher` defaults to the package's
    kernels loaded on the current device, now, before any capture. The package need not be
    installed (pkg.apply() is eager's path). `drop`: card ids to leave to Inductor. Where the
    package's model check found kforge.compile no faster than torch.compile, this is plain
    torch.compile (or drops the cards the check names), said once; use_verdict=False ignores it."""
    kwargs = dict(torch_compile_options)
    backend = kwargs.pop("backend", "inductor")
    if backend != "inductor":
        raise KforgeError(f"kforge.compile puts kernels into Inductor's graphs; backend={backend!r} is not "
                          "Inductor: drop the backend argument, or use torch.compile with pkg.apply()")
    why = unsupported()
    if why:
        _fall_back(why)
        return torch.compile(model, **torch_compile_options)
    if use_verdict:
        plain, dropped = _verdict(package)
        if plain:
            return torch.compile(model, **torch_compile_options)
        drop = {*drop, *dropped}
    kwargs.setdefault("dynamic", False)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    mode, user_options = kwargs.pop("mode", None), dict(kwargs.pop("options", None) or {})
    if "post_grad_custom_post_pass" in user_options:
        raise KforgeError("kforge.compile installs its own post_grad_custom_post_pass: leave it out of options "
                          "(run your pass as post_grad_custom_pre_pass)")
    rewrites = _rewrites(package, launcher, drop=drop)
    if not rewrites:
        log.info("%s has no kernel for compiled graphs here: plain torch.compile", package.path)
        return torch.compile(model, **torch_compile_options)
    table, kept = _decompositions(rewrites)
    passes = rewrites + ([Decompose(kept, select_decomp_table())] if kept else [])
    patches = {**(list_mode_options(mode, kwargs["dynamic"]) if mode else {}), **user_options,
               "post_grad_custom_post_pass": KforgePass(package.digest, passes, keeps_whole=True)}

    def kforge_inductor(gm: torch.fx.GraphModule, example_inputs: Sequence) -> Any:
        return compile_fx(gm, example_inputs, config_patches=patches, decompositions=table)

    return torch.compile(model, backend=kforge_inductor, **kwargs)
