"""kforge.optimize(model, package): the model's traced graphs run with the package's region kernels
in place of the regions they match, and everything else as eager runs it (no Inductor).

    fast = kforge.optimize(model, pkg)      # or pkg.optimize(model)
    y = fast(x)

How: torch.compile with kforge's aten backend (kforge.graph), which runs convolutions
channels-last as torch.compile does (kforge.layout). In each graph, the regions are
found as capture found them (kforge.regions); a region whose structure and input metadata
match a dispatched region card of the package is contracted into one call: of the region op
of its cards (kforge.customops; a site may match several, the same region captured with its
inputs at other alignments), whose C++ kernel checks the inputs' metadata, picks the card,
allocates the outputs and launches, where the launcher can launch from C++ (as the package's
can); else of a plain Python callable (RegionCall), which launches the kernel of the card whose
pointer alignments the inputs have (dynamo's guards fix the rest of the card's guard
specification, kforge.guards). Either runs the region's original aten calls on a miss. Where matched regions overlap (a fused region and a vendor op's
epilogue), package.choose_regions keeps the set that saves the most by the package's own
measurements. Then each remaining node whose call hits a single-op card's guard becomes that
card's custom op (the rewrite kforge.compile's pass runs). Nothing is installed: the model's
own eager calls elsewhere are untouched.

Host cost per forward, which a launch-bound forward pays on every call: a graph the package
and the layout pass change nothing in runs as dynamo traced it (eager's own calls); a changed graph runs with no
aot_autograd runtime wrapper where that wrapper has nothing to do (kforge.graph), and its aten
calls go through the bindings eager code calls (kforge.bindings), so what remains over eager is
dynamo's guard check and one dispatcher call per region (a Python call where the launcher cannot
launch from C++). With cuda_graphs=True each graph is
replayed from a CUDA graph instead (kforge.replay).

Guards and recompiles: dynamo guards each graph on its inputs' shapes, strides and dtypes
(dynamic=False); a new shape traces a new graph, whose regions are matched anew, and a
region no card describes runs its original nodes. A new shape is a miss, never an error;
past dynamo's recompile limit (torch._dynamo.config.recompile_limit, 8 per frame by
default) dynamo runs that frame eagerly. A frame traced for two new shapes within one forward,
with nothing of the package in either (a mixture-of-experts' expert, called with its own token
count), runs as plain Python from then on, with no guard check (OptimizedModel._count_frame). Outputs come from the caching allocator and
kernels launch on the current stream, so an optimized forward can be captured in a CUDA graph.

Where the package's model check (kforge run) found kforge.optimize slower than eager, op by op or
from CUDA graphs, the package records it and kforge.optimize in that mode runs the model as it is,
said once (OptimizeFallbackWarning); use_verdict=False overrides.

The kernel call is `RegionKernel.run(inputs) -> outputs`, one callable per card: it can be
swapped for a torch.library custom op without changing the graph surgery.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import operator
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.autograd.profiler as _profiler
import torch.fx as fx

from . import bindings, fold, layout, linears, restride
from . import graph as graph_mod
from . import regions as regions_mod
from .cards import Card
from .contraction import replace_sites, without_cycles
from .dispatch import Counters, DispatchError, Launcher
from .guards import _ALIGN, GuardSpec, TensorGuard, tensor_key
from .replay import Replayed
from .subgraph import Subgraph


@dataclass(eq=False)
class RegionKernel:
    """One dispatched region card: its kernel as a callable, and the evidence to choose by."""

    card: Card
    run: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    kernel_us: float | None = None  # as dispatched, from the package's evidence
    baseline_us: float | None = None  # its nodes without it: their best op kernels, else eager
    counters: Counters = field(default_factory=Counters)
    launch: tuple | None = None  # (variant id, launcher, workspace bytes): what launches it from C++ (customops)
    digest: str = ""  # the kernel's, which names its custom op

    @functools.cached_property
    def guard(self) -> GuardSpec:
        return GuardSpec.of_inputs(self.card.inputs)

    @classmethod
    def launched(cls, card: Card, launcher: Launcher, vid: int, workspace: Sequence[int] = (), **kw: Any) -> "RegionKernel":
        """The card's kernel as variant `vid` of `launcher`, launched from Python (run) or from C++ (launch)."""
        return cls(card, launch_kernel(card, launcher, vid, workspace), launch=(vid, launcher, tuple(workspace)), **kw)


def launch_kernel(card: Card, launcher: Launcher, vid: int, workspace: Sequence[int] = ()) -> Callable:
    """inputs -> outputs of variant `vid` of `launcher`: outputs allocated with the card's shapes,
    strides and dtypes on the inputs' device, launched on the current stream."""
    specs = [(tuple(m.shape), tuple(m.stride), m.torch_dtype) for m in card.outputs]
    workspace = tuple(workspace)

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        dev = inputs[0].device
        outs = [torch.empty_strided(s, st, dtype=dt, device=dev) for s, st, dt in specs]
        ws = [torch.empty(n, dtype=torch.uint8, device=dev) for n in workspace]
        launcher.launch(vid, inputs, outs, ws, dev)
        return outs

    return run


class RegionCall:
    """What one region site of a graph becomes where its launcher cannot launch from C++ (else the
    region op, native_op): guard hit -> the card's kernel, miss -> the region's own aten calls.

    Its callers hand it inputs with the cards' shapes, strides, dtypes and device: a traced
    graph's own guards (dynamo's, on every graph input's metadata, dynamic=False) fix those of
    every value inside the graph, and the site matched its cards on them when the graph was
    traced; the worker calls it on the card's samples. What a trace cannot see is where the
    inputs lie, so the guard at run time is one compare of the inputs' pointer alignments
    against each card's."""

    reads_only = True  # it writes none of its inputs (kforge.fold may hand it a folded constant)

    def __init__(self, subgraph: Subgraph, kernels: list[RegionKernel]):
        self.subgraph = subgraph
        self.table = {tuple(s.tensor.align for s in k.guard.slots): k for k in kernels}
        self.kernels = kernels
        self.__name__ = "kforge_region_" + "_".join(subgraph.ops)[:60]

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        k = self.table.get(tuple([_ALIGN[t.data_ptr() & 15] for t in inputs]))
        if k is not None:
            k.counters.hit()
            if getattr(_profiler, "_is_profiler_enabled", False):  # a profile names the card of its kernels
                with torch.profiler.record_function(f"kforge::k_{k.card.id}_region"):
                    return tuple(k.run(list(inputs)))
            return tuple(k.run(list(inputs)))
        self.kernels[0].counters.fell_back("alignment")
        return tuple(self.subgraph.replay(list(inputs)))


def native_op(kernels: Sequence[RegionKernel]) -> torch._ops.OpOverload | None:
    """The region op whose C++ kernel serves a site (kforge.customops: every card the site
    matches a variant of it, told apart by the inputs' alignments), where each kernel launches
    natively: its guard, output allocation and launch cost one dispatcher call, where RegionCall
    makes a Python call, a Python guard, an allocation per output and a Python launch (about
    2 µs against 3-4 on a CPU); else None."""
    from . import customops

    # Only kernels that can launch from C++ take the op: binding it rebinds it for every graph that
    # calls it (ops are named by card and kernel), which must not lose its C++ front to a Python launcher.
    if not kernels or any(k.launch is None or not callable(getattr(k.launch[1], "native", None)) for k in kernels):
        return None
    digest = kernels[0].digest or kernels[0].card.id
    if len(kernels) > 1:  # one op per set of kernels
        digest = hashlib.sha256("|".join(k.digest or k.card.id for k in kernels).encode()).hexdigest()
    try:
        op, native = customops.region_op(kernels, digest)
    except DispatchError:
        return None
    return op if native else None


def fits(card: Card, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether `inputs` have the card's shapes, strides, dtypes and device type: what a RegionCall
    does not check (in a graph, dynamo's guards do), so what a caller outside a graph checks first."""
    return len(inputs) == len(card.inputs) and all(
        isinstance(t, torch.Tensor) and tensor_key(t)[:4] == TensorGuard.of(m).key[:4] for t, m in zip(inputs, card.inputs))


# ---- the optimized model ---------------------------------------------------------------------

def region_kernels(package: Any, launcher: Launcher, *, compiled: bool = False) -> list[RegionKernel]:
    """The package's dispatched region cards as kernels, with the evidence to choose by: the
    package's (kernel against its nodes without it: GPU times, or as dispatched), or with `compiled` the
    cards kforge.compile dispatches and their evidence against torch.compile (the kernel's GPU
    time against the region compiled alone). Variant ids are positions among the package's
    kernel_cards() (the order of CastPackage.launcher()'s registry)."""
    out = []
    for vid, c in enumerate(package.kernel_cards()):
        if c.card.region is None or not (c.compiled if compiled else c.dispatched):
            continue
        ws = [n for n, _ in c.candidate.plan.workspace_bytes()] if c.candidate is not None else []
        if compiled:
            evidence = c.entry.get("compile") or {}
            kernel_us, baseline_us = evidence.get("kernel_us"), evidence.get("compile_us")
        else:  # the basis the package chose on (package_write._region_decisions)
            baseline = c.entry.get("baseline") or {}
            kernel_us = baseline.get("kernel_us", (c.entry.get("timing") or {}).get("dispatched_us"))
            baseline_us = baseline.get("baseline_us")
        out.append(RegionKernel.launched(c.card, launcher, vid, ws, kernel_us=kernel_us, baseline_us=baseline_us,
                                         counters=c.counters, digest=c.candidate.digest() if c.candidate is not None else ""))
    return out


def by_match(kernels: Sequence[RegionKernel]) -> dict[tuple, list[RegionKernel]]:
    """Region kernels by the key a graph's site must have to be their card's region."""
    out: dict[tuple, list[RegionKernel]] = collections.defaultdict(list)
    for k in kernels:
        out[regions_mod.match_key(k.card.region, k.card.inputs)].append(k)
    return dict(out)


def match_regions(graph: fx.Graph | fx.GraphModule, kernels: dict[tuple, list[RegionKernel]],
                  keep: Callable[[regions_mod.Site, list[RegionKernel]], bool] | None = None,
                  ) -> list[tuple[regions_mod.Site, list[RegionKernel]]]:
    """The graph's regions (as capture finds them) that match `kernels` (by_match) and that
    `keep` accepts, and of those that overlap, the set that saves the most by the kernels'
    evidence, less any whose replacement together with the others would close a cycle; in graph
    order. Shared by kforge.optimize and kforge.compile's pass: one matcher."""
    from .package import RegionOption, choose_regions

    options, matched = [], {}
    for site in regions_mod.find(graph):
        ks = kernels.get(site.match_key())
        if not ks or len({_device(src, k) for src, k in site.inputs}) != 1:  # a kernel runs on one device
            continue
        if keep is not None and not keep(site, ks):
            continue
        best = min(ks, key=lambda k: k.kernel_us if k.kernel_us is not None else float("inf"))
        opt = RegionOption(best.card.id, frozenset(n.name for n in site.nodes), best.kernel_us, best.baseline_us)
        options.append(opt)
        matched[opt] = (site, ks)
    chosen = [matched[o] for o in sorted(choose_regions(options), key=lambda o: -(o.saving_us or 0.0))]
    kept = {id(s) for s in without_cycles(graph, [s for s, _ in chosen])}  # most saving first
    chosen = sorted((sk for sk in chosen if id(sk[0]) in kept), key=lambda sk: min(n.name for n in sk[0].nodes))
    return chosen


@dataclass
class Replaced:
    """One region site replaced in a traced graph."""

    graph: int
    first_node: str
    cards: list[str]  # the card ids whose guards the site's call tries


def _device(src: fx.Node, k: int) -> torch.device:
    return regions_mod.traced_value(src, k).device


def eager_batch_norms(graph: fx.Graph) -> int:
    """Point the graph's inference batch norms back at the call eager makes; returns how many.
    Tracing turns F.batch_norm into aten._native_batch_norm_legit_no_training, whose CUDA
    kernel is not the one eager runs: eager's aten::batch_norm goes to cuDNN where cuDNN takes
    the call. Everything a region kernel does not replace should run as eager runs it, so that
    the package's kernels are the only difference (on the H200, optimized graphs of MobileNetV2
    and ResNet-18 ran 3-6 % slower than eager with one region kernel in them; this is one
    difference between the two, not yet measured alone). A node whose saved statistics are
    used stays."""
    bn = torch.ops.aten._native_batch_norm_legit_no_training.default
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not bn or node.kwargs or len(node.args) != 7:
            continue
        users = list(node.users)
        if not users or not all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0
                                for u in users):
            continue
        x, weight, bias, mean, var, momentum, eps = node.args
        with graph.inserting_before(node):  # F.batch_norm's own call, cuDNN as eager has it now
            new = graph.call_function(torch.batch_norm, (x, weight, bias, mean, var, False, momentum, eps,
                                                         torch.backends.cudnn.enabled))
        new.meta.update(users[0].meta)
        for u in users:
            u.replace_all_uses_with(new)
            graph.erase_node(u)
        graph.erase_node(node)
        count += 1
    return count


IDLE_SHAPES = 2  # new shapes of a frame traced in one forward, with nothing of the package, before it runs natively


class OptimizeFallbackWarning(UserWarning):
    """kforge.optimize runs the model as it is: the package's model check found it slower than eager."""


class OptimizedModel(torch.nn.Module):
    """`model` traced by kforge's backend with the package's kernels in its graphs (see the
    module doc); with `as_is` (why, for notes), the model run as it is, untraced."""

    def __init__(self, model: torch.nn.Module, package: Any, kernels: list[RegionKernel], op_rewrites: list,
                 cuda_graphs: bool = False, as_is: str | None = None):
        super().__init__()
        self.model = model
        self.package = package
        self.kernels = kernels
        self.cuda_graphs = cuda_graphs
        self.notes: list[str] = []
        self.replaced: list[Replaced] = []
        self.ops_replaced = 0  # graph nodes given a single-op card's kernel
        self.graphs: list[fx.GraphModule | None] = []  # what each traced graph runs (None: dynamo's graph, unchanged)
        self._op_rewrites = op_rewrites
        self._by_match = by_match(kernels)
        self._forwards = 0
        self._to_run_natively: list[types.CodeType] = []
        self._idle: dict[types.CodeType, tuple[int, int]] = {}  # code -> (forward, shapes traced in it with nothing)
        self.replayed: list[Replayed] = []  # with cuda_graphs, one per traced graph
        if as_is:
            self.notes.append(as_is)
            self.__dict__["_compiled"] = model
            return
        backend = graph_mod.aten_backend(self._compile_graph, self.notes, self._replayed if cuda_graphs else None)
        self.__dict__["_compiled"] = torch.compile(model, backend=backend, dynamic=False)  # not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._forwards += 1
        try:
            return self._compiled(*args, **kwargs)
        finally:
            while self._to_run_natively:  # once dynamo is done with them: it sets a frame's strategy on return
                graph_mod.run_natively(self._to_run_natively.pop())

    def _compile_graph(self, gm: fx.GraphModule, index: int, note: str | None) -> Callable:
        chosen = match_regions(gm, self._by_match)
        for site, ks in chosen:
            self.replaced.append(Replaced(index, site.nodes[0].name, [k.card.id for k in ks]))
        if chosen:
            def call(i: int, inputs: list[fx.Node]) -> list[fx.Node]:
                site, ks = chosen[i]
                op = native_op(ks)
                node = gm.graph.call_function(op or RegionCall(site.subgraph, ks), tuple(inputs))
                outs = [node] if op is not None and len(site.outputs) == 1 else [
                    gm.graph.call_function(operator.getitem, (node, j)) for j in range(len(site.outputs))]
                for out, (src, k) in zip(outs, site.outputs):
                    out.meta["val"] = regions_mod.traced_value(src, k)  # later rewrites read it
                return outs

            replace_sites(gm.graph, [site for site, _ in chosen], call)
            gm.graph.lint()
        replaced = sum(rewrite(gm.graph) for rewrite in self._op_rewrites)
        self.ops_replaced += replaced
        idle = not chosen and not replaced and not gm.meta.get(layout.CHANGED)
        self._count_frame(idle, note)
        if idle:
            self.graphs.append(None)
            return None  # nothing of the package here: dynamo's graph runs, as eager would
        fold.fold(gm.graph, gm.meta.get(graph_mod.WEIGHTS, ()))  # with values of weights alone
        eager_batch_norms(gm.graph)
        linears.recompose(gm.graph)
        restride.collapse(gm.graph)
        bindings.retarget(gm)
        gm.recompile()
        self.graphs.append(gm)
        return gm.forward

    def _count_frame(self, idle: bool, broke: str | None) -> None:
        """A frame dynamo traces for a second new shape within one forward, each time whole (no graph
        break) and with nothing of the package in it, runs natively once that forward returns
        (kforge.graph.run_natively). Dynamo keeps one compiled entry per shape and checks their
        guards in turn on every call, so a frame called with ever-new shapes in every forward (a
        mixture-of-experts' expert, one token count per call) costs a guard check per entry per
        call, and past the recompile limit it runs eagerly behind those checks anyway: 1.8 ms a
        forward in the Qwen MoE block, for nothing the package does. A model called with a new
        batch size traces each frame once per forward, and keeps its frames."""
        code = graph_mod.tracing_code() if idle and not broke else None  # a break: the resumed part may match
        if code is None:
            return
        forward, shapes = self._idle.get(code, (None, 0))
        shapes = shapes + 1 if forward == self._forwards else 1
        self._idle[code] = (self._forwards, shapes)
        if shapes == IDLE_SHAPES and graph_mod.can_run_natively():
            self._to_run_natively.append(code)
            self.notes.append(f"{code.co_name} ({code.co_filename}:{code.co_firstlineno}) traced for "
                              f"{IDLE_SHAPES} new shapes in one forward, with nothing of the package in them: it "
                              "runs eagerly from now on, with no guard checks")

    def _replayed(self, fn: Callable, pure: bool) -> Replayed:
        r = Replayed(fn, pure, self._owned_ptrs, self.notes, len(self.replayed))
        self.replayed.append(r)
        return r

    def _owned_ptrs(self) -> set[int]:
        return {t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers())}

    def report(self) -> dict:
        """Per region kernel: hits and fallbacks by reason; the sites replaced; notes."""
        return {"regions": [{"id": k.card.id, "op": k.card.op, "hits": k.counters.hits,
                             "fallbacks": dict(k.counters.fallbacks)} for k in self.kernels],
                "replaced": [vars(r) for r in self.replaced], "ops_replaced": self.ops_replaced,
                "cuda_graphs": [{"graph": r.index, "captured": r.graph is not None, "replays": r.replays,
                                 "misses": r.misses} for r in self.replayed],
                "notes": list(self.notes)}


_said: set[tuple[str, bool]] = set()  # (package, cuda_graphs) whose model verdict optimize() has reported


def _slower_than_eager(package: Any, cuda_graphs: bool) -> str | None:
    """Why kforge.optimize runs the model as it is, where the package's model check found it slower
    than eager in this mode (warned once per package and mode); else None."""
    check = ((getattr(package, "manifest", None) or {}).get("model_check") or {}).get("optimize") or {}
    found = check.get("cuda_graphs" if cuda_graphs else "ops")
    if not found or found["use"] != "eager":
        return None
    mode = " with cuda_graphs" if cuda_graphs else ""
    why = (f"{package.path}: the model check found kforge.optimize{mode} slower than eager "
           f"({found.get('optimize_us', float('nan')):.1f} µs against {found.get('eager_us', float('nan')):.1f}): "
           "it runs the model as it is; kforge.optimize(..., use_verdict=False) overrides")
    if (package.digest, cuda_graphs) not in _said:
        _said.add((package.digest, cuda_graphs))
        warnings.warn(why, OptimizeFallbackWarning, stacklevel=3)
    return why


def optimize(model: torch.nn.Module, package: Any, *, ops: bool = True, launcher: Launcher | None = None,
             cuda_graphs: bool = False, use_verdict: bool = True) -> OptimizedModel:
    """`model` with the package's kernels in its traced graphs: its region cards, and with
    `ops` its single-op cards too, each node whose call hits a card's guard given the card's
    custom op (kforge.inductor_rewrites.OpRewrite, the pass kforge.compile runs). Nothing is installed:
    eager calls outside the optimized model are untouched. `launcher` defaults to the
    package's kernels loaded on the current device (tests pass a CPU stand-in). With
    `cuda_graphs`, each graph is replayed from a CUDA graph (kforge.replay says when that is
    safe and what each call checks; a graph it cannot hold runs op by op, with a note). Where the
    package's model check found this mode slower than eager, the model runs as it is (said once;
    `use_verdict=False` ignores the check)."""
    from .inductor import _rewrites

    as_is = _slower_than_eager(package, cuda_graphs) if use_verdict else None
    if as_is:
        return OptimizedModel(model, package, [], [], as_is=as_is)

    if launcher is None and any(c.dispatched for c in package.cards):
        launcher = package.launcher()
    kernels = region_kernels(package, launcher) if launcher is not None else []
    op_rewrites = _rewrites(package, launcher, compiled=False) if ops and launcher is not None else []
    return OptimizedModel(model, package, kernels, op_rewrites, cuda_graphs)


class _CallableModule(types.ModuleType):
    """`kforge.optimize` names both this module and its `optimize` function: once the module is
    imported, the package's attribute is the module, so calling the module calls the function."""

    def __call__(self, *args, **kwargs) -> OptimizedModel:
        return optimize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
