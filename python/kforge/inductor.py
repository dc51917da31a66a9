"""kforge inside torch.compile: a post-grad Inductor pass that puts a package's kernels into compiled graphs.

    compiled = kforge.compile(model, kforge.load("model.cast"))        # or pkg.compile(model)
    compiled = kforge.compile(model, pkg, mode="reduce-overhead")      # cudagraph trees
    compiled = torch.compile(model, options=pkg.inductor_options())    # the pass alone

The pass (Inductor's post_grad_custom_post_pass, a CustomGraphPass whose uuid() is the
package's digest, so Inductor's FX-graph and AOT caches key on it) replaces every node whose
call hits the guard of a card whose compile decision is "dispatched" (its kernel beat the card
compiled alone by torch.compile; kforge.package) with the card's custom op (kforge.customops). The guard is
the card's guard specification (kforge.guards), the one eager dispatch checks: its key against
the traced key of the node's arguments, their FakeTensors (node.meta["val"]) described as a
card describes tensors, their alignment that of their storage offset (storage bases are
16-byte aligned; the op checks real pointers when it runs). Everything else is left to Inductor.

Inductor decomposes many ops before any post-grad pass runs (group_norm, softmax, layer_norm,
...), so their nodes never reach the pass. kforge.compile therefore hands Inductor its own
decomposition table with one change: a call that hits a card is kept whole for the pass, every
other call decomposes as Inductor would. torch.compile(options=pkg.inductor_options()) cannot
change the table: there, cards of decomposed ops are Inductor's.

Regions: a Rewrite is anything that rewrites a post-grad graph in place and returns how many
sites it replaced. Single-op cards are one Rewrite (OpRewrite); region cards plug theirs in
(_rewrites), e.g. a torch._inductor.pattern_matcher pass whose patterns are the regions'
references traced with Inductor's decompositions, so they match what Inductor sees.

The pass uses private Inductor APIs. On a torch where they are missing, compile() is plain
torch.compile and options() is empty, each with a CompileFallbackWarning that says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import warnings
from typing import Any, Callable, Protocol, Sequence

import torch

from . import customops
from .dispatch import Launcher, Variant
from .guards import call_values, slot_kind, traced_key
from .errors import KforgeError

try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # unsupported() says so before any pass is made
    _PassBase = object

log = logging.getLogger("kforge.inductor")

# Bumped when what the pass does to a graph changes: part of uuid(), so Inductor's caches never
# serve a graph an older pass rewrote.
PASS_VERSION = 1


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

    def __call__(self, graph: torch.fx.Graph) -> int: ...


class OpRewrite:
    """Nodes whose call hits a single-op card's guard, each replaced by the card's custom op."""

    def __init__(self, sites: Sequence[tuple[Variant, torch._ops.OpOverload]]):
        self._tables: dict[torch._ops.OpOverload, dict[tuple, tuple[torch._ops.OpOverload, Variant]]] = {}
        for v, kernel in sites:  # later sites win on equal keys, as in eager dispatch
            op = v.card.overload()
            self._tables.setdefault(op, {})[v.guard.key] = kernel, v
        self.key = ",".join(sorted(str(k) for table in self._tables.values() for k, _ in table.values()))

    @property
    def ops(self) -> list[torch._ops.OpOverload]:
        return list(self._tables)

    def match(self, op: Any, args: Sequence, kwargs: dict) -> torch._ops.OpOverload | None:
        """The custom op a call of `op` with these (fake) arguments hits, or None."""
        table = self._tables.get(op)
        if table is None:
            return None
        vals = call_values(op._schema, args, kwargs)
        kernel, v = table.get(traced_key(op._schema, vals), (None, None))
        if kernel is None:
            return None
        # What a key cannot see, as eager dispatch checks it (inputs on one device, a device argument naming it).
        ins = [t for t in _tensor_args(op, args, kwargs) if t is not None]
        return None if v.guard.unrunnable(ins, [vals[i] for i in v.guard.device_slots]) else kernel

    def __call__(self, graph: torch.fx.Graph) -> int:
        from torch._guards import detect_fake_mode

        replaced = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in self._tables:
                continue
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val", _UNTRACED))
            kernel = self.match(node.target, args, kwargs)
            if kernel is None:
                continue
            inputs = [x for x in _tensor_args(node.target, node.args, node.kwargs) if x is not None]
            with graph.inserting_before(node):
                new = graph.call_function(kernel, tuple(inputs))
            new.meta.update(node.meta)
            fakes = [x.meta["val"] for x in inputs]
            with detect_fake_mode(fakes) or contextlib.nullcontext():
                new.meta["val"] = kernel(*fakes)  # the card's outputs, as Inductor will lay them out
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            replaced += 1
        return replaced


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


def _rewrites(package: Any, launcher: Launcher | None, *, compiled: bool = True) -> list[Rewrite]:
    """The package's rewrites: its single-op cards' whose compile decision is "dispatched" (the
    kernel beat the card compiled alone by torch.compile), or with compiled=False those eager
    dispatch takes (kforge.optimize's graphs run eager around them); region cards add theirs here."""
    kernels = {c.id: c.candidate for c in package.cards if (c.compiled if compiled else c.dispatched)}
    sites = []
    for v in package.variants(launcher, compiled=compiled):  # single-op cards (region cards are kforge.optimize's)
        why = customops.op_blocker(v.card)
        if why:
            log.info("card %s stays out of compiled graphs: %s", v.card.id, why)
            continue
        sites.append((v, customops.kernel_op(v, kernels[v.card.id].digest())))
    return [OpRewrite(sites)] if sites else []


def _decompositions(rewrites: Sequence[Rewrite]) -> dict:
    """Inductor's decomposition table, except that a call hitting an OpRewrite's card stays whole."""
    from torch._inductor.decomposition import select_decomp_table

    table = dict(select_decomp_table())
    for rewrite in rewrites:
        for op in getattr(rewrite, "ops", ()):  # a region's rewrite matches decomposed graphs: it has none
            if op in table:
                table[op] = _keep_whole(rewrite, op, table[op])
    return table


def _keep_whole(rewrite: OpRewrite, op: Any, decompose: Callable) -> Callable:
    def decomposition(*args: Any, **kwargs: Any) -> Any:
        # NotImplemented: the tracer records the op itself, which the pass then replaces.
        return NotImplemented if rewrite.match(op, args, kwargs) is not None else decompose(*args, **kwargs)

    return decomposition


def _fall_back(why: str) -> None:
    message = f"kforge's kernels stay out of this compiled model: {why}; it compiles with plain torch.compile"
    log.warning(message)
    warnings.warn(message, CompileFallbackWarning, stacklevel=3)


def options(package: Any, *, launcher: Launcher | None = None) -> dict:
    """Inductor options installing `package`'s pass: torch.compile(model, options=...). Cards of
    ops Inductor decomposes (group_norm, softmax, layer_norm, ...) only reach graphs through
    kforge.compile. Add your own options to the dict (and mode's, e.g. "triton.cudagraphs": True
    for reduce-overhead: torch.compile takes options or mode, not both)."""
    why = unsupported()
    if why:
        _fall_back(why)
        return {}
    return {"post_grad_custom_post_pass": KforgePass(package.digest, _rewrites(package, launcher), keeps_whole=False)}


def compile(model: Any, package: Any, *, launcher: Launcher | None = None, **torch_compile_options: Any) -> Any:
    """`model` under torch.compile (Inductor) with `package`'s kernels inside the compiled graphs
    wherever a call hits a dispatched card; everything else is Inductor's. Takes torch.compile's
    arguments (mode, options, fullgraph, dynamic, ...); dynamic defaults to False, since a card is
    one exact shape. `launcher` defaults to the package's kernels loaded on the current device,
    now, before any capture. The package need not be installed (pkg.apply() is eager's path)."""
    kwargs = dict(torch_compile_options)
    backend = kwargs.pop("backend", "inductor")
    if backend != "inductor":
        raise KforgeError(f"kforge.compile puts kernels into Inductor's graphs; backend={backend!r} is not "
                          "Inductor: drop the backend argument, or use torch.compile with pkg.apply()")
    why = unsupported()
    if why:
        _fall_back(why)
        return torch.compile(model, **torch_compile_options)
    kwargs.setdefault("dynamic", False)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    mode, user_options = kwargs.pop("mode", None), dict(kwargs.pop("options", None) or {})
    if "post_grad_custom_post_pass" in user_options:
        raise KforgeError("kforge.compile installs its own post_grad_custom_post_pass: leave it out of options "
                          "(run your pass as post_grad_custom_pre_pass)")
    rewrites = _rewrites(package, launcher)
    if not rewrites:
        log.info("%s has no kernel for compiled graphs here: plain torch.compile", package.path)
        return torch.compile(model, **torch_compile_options)
    patches = {**(list_mode_options(mode, kwargs["dynamic"]) if mode else {}), **user_options,
               "post_grad_custom_post_pass": KforgePass(package.digest, rewrites, keeps_whole=True)}
    table = _decompositions(rewrites)

    def kforge_inductor(gm: torch.fx.GraphModule, example_inputs: Sequence) -> Any:
        return compile_fx(gm, example_inputs, config_patches=patches, decompositions=table)

    return torch.compile(model, backend=kforge_inductor, **kwargs)
