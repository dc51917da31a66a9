"""kforge inside torch.compile: a post-grad Inductor pass that puts a package's kernels into compiled graphs.

    compiled = kforge.compile(model, kforge.load("model.cast"))        # or pkg.compile(model)
    compiled = kforge.compile(model, pkg, mode="reduce-overhead")      # cudagraph trees
    compiled = torch.compile(model, options=pkg.inductor_options())    # the pass alone

The pass (Inductor's post_grad_custom_post_pass, a CustomGraphPass whose uuid() is the
package's digest, so Inductor's FX-graph and AOT caches key on it) rewrites each graph in these
steps, all keyed on the cards whose compile decision is "dispatched" (their kernel beat the card
compiled alone by torch.compile; kforge.package):

  regions   each fusable region of the graph (kforge.regions, the partition capture uses) whose
            structure and input metadata match a region card becomes one call of the card's
            custom op; where matched regions overlap, the set that saves the most against
            torch.compile's time of each region alone (package.choose_regions). First, every
            CUDA convolution gives its bias to an add after it, as Inductor lowers it anyway
            (kforge.conv_bias), so that regions and fusions are those Inductor will see; capture
            splits cuDNN's convolutions read by one op only, so a card captured after another
            convolution (CUDA's NCHW depthwise kernel, one read twice) may not match here.
  ops       each node whose call hits a single-op card's guard becomes the card's custom op,
            where the node is alone in its fusable region. Inside a chain Inductor fuses
            (add -> cast -> softmax -> cast) the unit a kernel must beat is the fused kernel,
            not the op compiled alone, and an extern call in the middle of the chain would
            break the fusion into several kernels: there the node is replaced only where the
            package's evidence bounds the split chain below the fused one (Evidence.wins_inside:
            the card's kernel plus the eager time of the region's other nodes, an upper bound on
            Inductor's code for them, under the region card's torch.compile time, beyond its
            noise). kforge.optimize (no Inductor, nothing fuses) takes every hit.
  layout    a kforge op takes its inputs in the stride order traced. Where Inductor will lay the
            graph's convolutions out channels-last (its layout optimization, asked of Inductor
            per graph), a region or op next to a convolution is replaced only where its margin
            over torch.compile covers the copies into and out of that layout (their bytes at
            the GPU's copy bandwidth; kforge.inductor_rewrites.pays_for_relayout).
  attention before all these, a fused attention call becomes matmul-softmax-matmul where that
            was measured faster on this GPU (kforge.attention; it needs no card: with none,
            kforge.compile is torch.compile plus this step).
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

import hashlib
import inspect
import logging
import warnings
from typing import Any, Collection, Sequence

import torch

from . import attention, customops, env
from .graph import sdpa_as_eager
from .dispatch import Launcher
from .errors import KforgeError
from .inductor_decompose import Decompose, _decompositions
from .inductor_rewrites import ConvBiasSplit, Evidence, OpRewrite, RegionRewrite, Rewrite, _resolvable
from .regions import SEVERAL_KERNELS

try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # unsupported() says so before any pass is made
    _PassBase = object

log = logging.getLogger("kforge.inductor")

# The backend each package, launcher and setting was compiled with, the last few: dynamo keeps at
# most eight compiled versions of a function (then runs it eager, saying so only in its log), and
# a new backend callable is a new version, so compiling the same model again with the same package
# reuses the backend, as torch.compile reuses Inductor's.
_BACKENDS: dict[tuple, tuple[Any, Any, Any]] = {}  # key -> (package, launcher, backend): ids stay theirs
BACKENDS_KEPT = 8

# Bumped when what the pass does to a graph changes: part of uuid(), so Inductor's caches never
# serve a graph an older pass rewrote.
PASS_VERSION = 4  # 2: fusion-aware op substitution, region cards, leftovers decomposed; 3: layout copies; 4: attention


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

        regions = [(k, customops.region_op([k], kernels[k.card.id].digest())[0])
                   for k in region_kernels(package, launcher, compiled=True)
                   if k.card.id not in drop and _resolvable(k.card.region) and not _eagers_kernels_only(k.card.region)]
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


def _pass_rewrites(package: Any, launcher: Launcher | None, drop: Collection[str]) -> list[Rewrite]:
    """What kforge.compile's pass runs: kforge's own rewrites, then, where the package has any for
    compiled graphs, the convolutions' biases split off (ConvBiasSplit) and the package's."""
    theirs = _rewrites(package, launcher, drop=drop)
    return _own() + ([ConvBiasSplit(), *theirs] if theirs else [])


def _eagers_kernels_only(region: Any) -> bool:
    """A region of one op that is a region only for the kernels eager runs beside it (a lone
    inference batch norm: kforge.regions.SEVERAL_KERNELS). Inductor runs it as one kernel and
    fuses it with what it can (a padding before a convolution), which the region would split:
    it stays out of compiled graphs."""
    return len(region.ops) == 1 and region.ops[0] in SEVERAL_KERNELS


def _own() -> list[Rewrite]:
    """kforge's rewrites that need no package: attention as matmul-softmax-matmul where measured
    faster (kforge.attention), unless KFORGE_ATTENTION=keep."""
    return [] if env.attention_mode() == "keep" else [attention.AttentionRewrite()]


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
    return {"post_grad_custom_post_pass": KforgePass(package.digest, _pass_rewrites(package, launcher, drop),
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
    device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    key = (id(package), id(launcher), device, tuple(sorted(drop)), mode, kwargs["dynamic"], repr(sorted(user_options.items())))
    held = _BACKENDS.get(key)
    if held is not None and held[0] is package and held[1] is launcher:
        return torch.compile(model, backend=held[2], **kwargs)
    rewrites = _pass_rewrites(package, launcher, drop)
    if not rewrites:
        log.info("%s has no kernel for compiled graphs here: plain torch.compile", package.path)
        return torch.compile(model, **torch_compile_options)
    table, kept = _decompositions(rewrites)
    passes = rewrites + ([Decompose(kept, select_decomp_table())] if kept else [])
    patches = {**(list_mode_options(mode, kwargs["dynamic"]) if mode else {}), **user_options,
               "post_grad_custom_post_pass": KforgePass(package.digest, passes, keeps_whole=True)}

    def kforge_inductor(gm: torch.fx.GraphModule, example_inputs: Sequence) -> Any:
        sdpa_as_eager(gm)
        return compile_fx(gm, example_inputs, config_patches=patches, decompositions=table)

    _BACKENDS[key] = (package, launcher, kforge_inductor)
    while len(_BACKENDS) > BACKENDS_KEPT:
        del _BACKENDS[next(iter(_BACKENDS))]  # the oldest
    return torch.compile(model, backend=kforge_inductor, **kwargs)
