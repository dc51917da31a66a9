"""Channels-last convolutions in a traced inference graph, the layout torch.compile gives them.

Eager runs a 2-D convolution in the layout its input arrives in, NCHW for a model that does not
ask otherwise, and cuDNN's tensor-core convolutions read and write NHWC: on an NCHW input they
transpose around the convolution, or pick a slower kernel. torch.compile runs convolutions
channels-last (Inductor's layout optimization); a traced graph kforge runs (kforge.optimize) or
captures regions from (kforge.region_capture) gets the same treatment here, so that a region
card's inputs have the strides the optimized model gives them:

- each 2-D convolution's input is converted to channels-last where it is not already: the
  output of a channels-last convolution, and the batch norms, activations and adds after it,
  keep that layout, so in a ResNet only the first convolution's input is converted;
- each convolution's weight is converted once and the copy reused for as long as the weight is
  the same tensor at the same version (an in-place update converts it anew): the copies cost the
  convolution weights' memory once more, where converting on every call costs a copy kernel per
  convolution per forward;
- every graph output keeps the strides the graph gave it before (converted back where needed),
  so callers see what eager returns;
- every node's traced value (node.meta["val"]) is propagated anew, so regions are found and
  matched on the strides that will run.

An op outside a short list of layout-agnostic ones (pointwise ops, views, batch norm, layer norm,
pooling, mean, convolution) that reads a relaid value gets it back in its traced strides, a copy; where
those copies would be many (a group norm after every convolution, as in a diffusion VAE) the
graph keeps its layout. The pass applies to a graph with 2-D convolutions on CUDA, unless grouped
convolutions (whose channels-last kernels are slower) are most of them. KFORGE_LAYOUT=keep turns it off for capture
and kforge.optimize alike (cards captured one way do not match graphs laid out the other way:
they then run eagerly). A graph whose values do not propagate in the new layout is left as it
was, with a note.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from . import env, fold
from .fold import memoizable, unchanged, weight_key

DEVICES = ("cuda",)  # where the pass applies (tests add "cpu")
CHANGED = "kforge_channels_last"  # GraphModule.meta key: how many convolutions the pass laid out
_CONV = torch.ops.aten.convolution.default
_CL = torch.channels_last


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """`t` in channels-last layout (itself where it already is)."""
    return t.contiguous(memory_format=_CL)


channels_last.kforge_pure = True  # a function of its argument alone: kforge.fold may keep its value


class ConvertedOnce:
    """A convolution weight in channels-last layout, copied once per tensor and version."""

    def __init__(self) -> None:
        self._memo: tuple[tuple, torch.Tensor] | None = None  # (fold.weight_key of the source, its copy)
        self.__name__ = "kforge_channels_last_weight"

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if fold._recording is not None:
            fold._recording.append(self)
        memo = self._memo  # the hit first, as cheap as can be: it runs once per convolution per forward
        if memo is not None and unchanged(memo[0], t) \
                and not (t.requires_grad and torch.is_grad_enabled()):  # autograd must see the copy made
            return memo[1]
        if t.is_contiguous(memory_format=_CL):
            return t
        if not memoizable(t):
            return channels_last(t)
        if memo is not None and memo[1].shape == t.shape and memo[1].dtype == t.dtype and memo[1].device == t.device:
            out = memo[1].copy_(t)  # in its own memory, where a CUDA graph reads it
        else:
            out = channels_last(t)
        self._memo = (weight_key(t), out)
        return out

    def weights(self) -> list[torch.Tensor]:
        """The weight the kept copy was made from (none where nothing is kept)."""
        t = self._memo[0][0]() if self._memo is not None else None
        return [] if t is None else [t]

    def refresh(self) -> bool:
        """Before a CUDA graph replay that reads the copy: copy the weight again if it was written
        since (fold.Folded.refresh)."""
        if self._memo is None:
            return True  # nothing kept: the graph converts or reads the weight itself
        t = fold.live([self._memo[0]])
        if t is None:
            return False
        self(*t)  # a hit, or the weight copied again into the kept memory
        return True


class Restrided:
    """`t` copied into the strides a graph output had before the pass."""

    def __init__(self, stride: Sequence[int]):
        self.stride = tuple(stride)
        self.__name__ = "kforge_restride"

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(t.shape, self.stride, dtype=t.dtype, device=t.device)
        return out.copy_(t)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _convs(graph: fx.Graph, devices: Sequence[str]) -> list[fx.Node]:
    out = []
    for n in graph.nodes:
        if n.op == "call_function" and n.target is _CONV and len(n.args) >= 9:
            x, w = _val(n.args[0]), _val(n.args[1])
            if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() == 4 \
                    and x.device.type in devices:
                out.append(n)
    return out


def _grouped(n: fx.Node) -> bool:
    return int(n.args[8]) > 1 and _val(n.args[1]).shape[1] > 1


def wanted(graph: fx.Graph) -> list[fx.Node]:
    """The convolutions the pass would lay out: none where it does not apply (see the module doc)."""
    if env.layout_mode() == "keep":
        return []
    convs = _convs(graph, DEVICES)
    if not convs or 2 * sum(map(_grouped, convs)) > len(convs):
        return []
    return convs


# Ops whose kernels take any layout and whose traced strides are the ones they produce: a value
# they read channels-last stays channels-last. Any other op reading a value the pass relaid
# gets it back in its traced strides (a copy): native_group_norm's CUDA kernel, for one, takes
# only contiguous input, which its traced call never had to ask for. native_layer_norm makes its
# input contiguous itself and writes a contiguous output whatever it reads: ConvNeXt's norm of
# its stem (the convolution's output permuted to channels last) is contiguous once the
# convolution is channels-last, where a copy back to the traced permute copied 19 MB twice,
# once here and once inside the norm (ConvNeXt-T, batch 32, round 31).
KEEPS_LAYOUT = frozenset({"convolution", "_native_batch_norm_legit_no_training", "max_pool2d_with_indices",
                          "avg_pool2d", "mean", "native_layer_norm"})
_FAMILIES = frozenset({"pointwise", "view"})
RESTORED_PER_CONV = 0.25  # more copies back than this per convolution: the pass does not pay


def keeps_layout(n: fx.Node) -> bool:
    from .families import family_of, packet_name

    if n.op != "call_function":
        return n.op == "output"  # outputs are restrided on their own
    if n.target is operator.getitem or isinstance(n.target, (ConvertedOnce, Restrided)) or n.target is channels_last:
        return True
    if not isinstance(n.target, torch._ops.OpOverload):
        return False
    return packet_name(n.target) in KEEPS_LAYOUT or family_of(n.target) in _FAMILIES


def apply(gm: fx.GraphModule, notes: list[str]) -> int:
    """Lay the graph's convolutions out channels-last (the module doc); returns how many, 0 where
    the pass does not apply or the graph was left as it was."""
    convs = wanted(gm.graph)
    if not convs:
        return 0
    graph = gm.graph
    before = {n: n.meta.get("val") for n in graph.nodes}
    added: list[fx.Node] = []

    def insert(fn: Any, src: fx.Node, at: fx.Node) -> fx.Node:
        with graph.inserting_before(at):
            new = graph.call_function(fn, (src,))
        added.append(new)
        return new

    def relaid(a: Any) -> bool:
        old, new = before.get(a), _val(a)
        return isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.stride() != new.stride()

    for conv in convs:
        x, w = conv.args[0], conv.args[1]
        weight = insert(ConvertedOnce() if w.op == "placeholder" else channels_last, w, conv)
        conv.update_arg(0, insert(channels_last, x, conv))
        conv.update_arg(1, weight)
    try:
        _propagate(gm)
        restored: dict[fx.Node, fx.Node] = {}
        for n in [n for n in graph.nodes if not keeps_layout(n)]:
            for a in dict.fromkeys(a for a in n.all_input_nodes if relaid(a)):
                if a not in restored:
                    restored[a] = insert(Restrided(before[a].stride()), a, n)
                    restored[a].meta["val"] = before[a]
                n.replace_input_with(a, restored[a])
        if len(restored) > RESTORED_PER_CONV * len(convs):
            raise _NotWorth(f"{len(restored)} values would be copied back for ops that need their traced "
                            f"layout, against {len(convs)} convolutions")
        if restored:
            _propagate(gm)
        out = graph.output_node()
        results = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
        for i, r in enumerate(results):
            if relaid(r):
                results[i] = insert(Restrided(before[r].stride()), r, out)
                results[i].meta["val"] = before[r]
        out.args = (type(out.args[0])(results) if isinstance(out.args[0], (tuple, list)) else results[0],)
    except Exception as e:  # noqa: BLE001 (the graph runs as traced; the note says why)
        for n in reversed(added):
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
        for n, v in before.items():
            n.meta["val"] = v
        why = str(e) if isinstance(e, _NotWorth) else f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"
        notes.append(f"convolutions left in the traced layout ({why})")
        return 0
    for n in added:  # a conversion of what is already channels-last does nothing: drop it
        if n.target is channels_last and _val(n.args[0]) is not None and \
                _val(n.args[0]).is_contiguous(memory_format=_CL):
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    gm.meta[CHANGED] = len(convs)
    return len(convs)


class _NotWorth(Exception):
    pass


def _propagate(gm: fx.GraphModule) -> None:
    """node.meta["val"] of every node anew, from the placeholders' traced values."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(vals)
    if mode is None:
        raise RuntimeError("the graph's inputs carry no traced values")
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*vals)
    for n in gm.graph.nodes:  # a multi-output node's items: FakeTensorProp sets them on getitem too
        if n.op == "call_function" and n.target is operator.getitem and "val" not in n.meta:
            n.meta["val"] = _val(n.args[0])[n.args[1]]
