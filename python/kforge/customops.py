"""A dispatched card's kernel as a functional torch.library custom op: what a compiled graph calls.

One op per card and kernel, kforge::k_<card id>_<kernel digest>. It takes the card's tensor
inputs in launch-plan order (Card.inputs) and returns its outputs; the card's other arguments
are part of its guard, so they are constants of the op. The fake implementation makes outputs
with the card's shapes, strides and dtypes on the inputs' device, which is all Inductor needs
to plan around the call. The real one, registered at the card's device key only (a CUDA card's
op has no CPU kernel), launches through the package's launcher (Variant.run: outputs from the
caching allocator, the current stream, no host sync), so it records into CUDA graphs and
cudagraph trees. A pointer's alignment is the one guard a traced graph cannot see: an input
whose alignment is not the card's goes to eager's op, counted as an "alignment" fallback.
Where kforge._dispatch can serve the op (its launcher has native()), the op's kernel at that
key is the C++ boxed one, exactly as an overridden aten op's (dispatch.Dispatcher): host cost
per call as an eager override's hit, and the Python implementation below it only serves the
misses the C++ guard has already counted.

Only functional cards become ops: a compiled graph is functional, so an in-place or out= call
never appears in it as the card recorded it.

A region card's op (region_op) is the same: it launches the region's kernel
(kforge.optimize.RegionKernel), behind the same C++ front where the kernel says how to launch it
(RegionKernel.launch), and a call the guard misses replays the region's aten calls.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .cards import ArgSpec, Card
from .dispatch import Dispatcher, DispatchError, Variant
from .guards import GuardSpec, tensor_key
from .native_override import native_variants

NAMESPACE = "kforge"

_lock = threading.Lock()
_lib: torch.library.Library | None = None
_ops: dict[str, "_KernelOp | _RegionOp"] = {}
_native: dict[str, Dispatcher] = {}  # device key -> the C++ kernels in front of the ops' Python ones


def op_blocker(card: Card) -> str | None:
    """Why this card has no custom op (its kernel stays out of compiled graphs), or None."""
    if card.written_inputs or card.aliases:
        return "it writes its inputs (in-place or out=), and a compiled graph is functional"
    if not card.inputs or not card.outputs:
        return "it has no tensor inputs or outputs"
    if card.device_type not in ("cuda", "cpu"):
        return f"custom ops are registered for CUDA and CPU cards, not {card.device_type}"
    return None


@dataclass(eq=False)
class _KernelOp:
    """One op's binding: the variant whose launcher serves it (the last package to bind it)."""

    variant: Variant
    native: bool = False  # kforge._dispatch's kernel is in front: calls reaching this one missed, and are counted
    guard: GuardSpec = field(init=False)  # the op's own arguments: the card's tensors

    def __post_init__(self) -> None:
        self.bind(self.variant)

    def bind(self, variant: Variant) -> None:
        self.variant, self.guard = variant, GuardSpec.of_inputs(variant.card.inputs)

    def take(self, other: "_KernelOp") -> None:
        self.bind(other.variant)

    def native_launch(self) -> list[tuple[Card, tuple | None]]:
        """[(the card, (vid, launcher, workspace, counters))]: what the C++ front launches."""
        v = self.variant
        return [(v.card, (v.vid, v.launcher, v.workspace, v.counters))]

    def __call__(self, *ins: torch.Tensor):
        v = self.variant
        if self.native:
            outs = v.card.call_eager(list(ins))
        elif (key := tuple(tensor_key(t) for t in ins)) != self.guard.key:  # alignment: the graph could not see it
            v.counters.fell_back(self.guard.differences(key)[0])
            outs = v.card.call_eager(list(ins))
        else:
            outs = v.run(ins)
            if outs is None:  # counted by run(): eager's op serves the call
                outs = v.card.call_eager(list(ins))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def fake(self, *ins: torch.Tensor):
        return _fake_outputs(self.variant.card, ins)


def _fake_outputs(card: Card, ins: Sequence[torch.Tensor]):
    dev = ins[0].device
    outs = [torch.empty_strided(tuple(m.shape), tuple(m.stride), dtype=m.torch_dtype, device=dev) for m in card.outputs]
    return outs[0] if len(outs) == 1 else tuple(outs)


@dataclass(eq=False)
class _RegionOp:
    """A region op's binding: the region kernels that serve it (the last package to bind it), one
    per card the region was captured as: the same region and metadata but for the inputs'
    alignments, so a call takes the kernel whose alignments its inputs have."""

    kernels: list  # kforge.optimize.RegionKernel
    native: bool = False  # kforge._dispatch's kernel is in front: calls reaching this one missed, and are counted
    guards: list = field(init=False)  # each kernel's: the region's inputs

    def __post_init__(self) -> None:
        self.take(self)

    def take(self, other: "_RegionOp") -> None:
        self.kernels, self.guards = list(other.kernels), [GuardSpec.of_inputs(k.card.inputs) for k in other.kernels]

    def native_launch(self) -> list[tuple[Card, tuple | None]]:
        """Per kernel: (its card, (vid, launcher, workspace, counters) or None), what the C++ front launches."""
        return [(k.card, (*k.launch, k.counters) if k.launch is not None else None) for k in self.kernels]

    def __call__(self, *ins: torch.Tensor):
        if not self.kernels:
            raise DispatchError("this region op was released: it holds no kernel")
        k = self.kernels[0]
        if self.native:
            outs = k.card.call_eager(list(ins))
        else:
            key = tuple(tensor_key(t) for t in ins)
            hit = next((kernel for kernel, g in zip(self.kernels, self.guards) if g.key == key), None)
            if hit is None:  # alignment: the graph could not see it
                k.counters.fell_back(self.guards[0].differences(key)[0])
                outs = k.card.call_eager(list(ins))
            else:
                hit.counters.hit()
                outs = hit.run(list(ins))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def fake(self, *ins: torch.Tensor):
        return _fake_outputs(self.kernels[0].card, ins)


def op_name(card: Card, kernel_digest: str) -> str:
    return f"k_{card.id}_{kernel_digest[:12]}"


def kernel_op(variant: Variant, kernel_digest: str) -> torch._ops.OpOverload:
    """The custom op of `variant`'s card and kernel (defined on first use), now launched
    through `variant`. The same card and kernel from another package is the same op: it
    launches through whichever package bound it last, which runs the same kernel."""
    card = variant.card
    why = op_blocker(card)
    if why:
        raise DispatchError(f"card {card.id} has no custom op: {why}")
    with _lock:
        bound, op = _bind(card, kernel_digest, _KernelOp(variant))
        _serve_natively(bound, op)
    return op


def region_op(kernels: Sequence[Any], kernel_digest: str) -> tuple[torch._ops.OpOverload, bool]:
    """(the custom op of a region's kernels, whether kforge._dispatch's C++ kernel serves it).
    The kernels are kforge.optimize.RegionKernel, one card each, the same region but for its
    inputs' alignments; the op is named after the first. Defined on first use and now launched
    through them, as kernel_op() does for single-op cards, natively where it can."""
    card = kernels[0].card
    if not card.inputs or not card.outputs or card.device_type not in ("cuda", "cpu"):
        raise DispatchError(f"region card {card.id} has no custom op: it needs tensor inputs and outputs on CUDA or CPU")
    with _lock:
        bound, op = _bind(card, kernel_digest, _RegionOp(list(kernels)))
        _serve_natively(bound, op)
        return op, bound.native


def release(op: torch._ops.OpOverload) -> None:
    """Let kforge op `op` hold no kernel (its C++ front removed): what the evaluation worker does
    with the op it timed a region candidate through, so no candidate's loaded module outlives its
    timing. A call of the op after this fails."""
    with _lock:
        bound = _ops.get(op._schema.name.split("::")[-1])
        if bound is None:
            return
        for dispatcher in _native.values():
            if dispatcher.owns(bound):
                dispatcher.remove(bound)
        bound.native = False
        if isinstance(bound, _RegionOp):
            bound.kernels, bound.guards = [], []


def _bind(card: Card, kernel_digest: str, fresh: "_KernelOp | _RegionOp") -> tuple:
    """(binding, op) of the card's kernel op, now served as `fresh` serves it: an op defined
    before keeps its binding object (the op's registered kernel), which takes fresh's kernel.
    Caller holds _lock."""
    name = op_name(card, kernel_digest)
    bound = _ops.get(name)
    if bound is not None:
        bound.take(fresh)
    else:
        bound = _ops[name] = _define(name, card, fresh)
    return bound, getattr(getattr(torch.ops, NAMESPACE), name).default


def _define(name: str, card: Card, bound: "_KernelOp | _RegionOp") -> "_KernelOp | _RegionOp":
    """Define kforge::name with the card's tensor inputs and outputs, served by `bound`. Caller holds _lock."""
    global _lib
    if _lib is None:
        _lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    params = ", ".join(f"Tensor x{i}" for i in range(len(card.inputs)))
    returns = "Tensor" if len(card.outputs) == 1 else "(" + ", ".join(["Tensor"] * len(card.outputs)) + ")"
    # Fixed stride order: Inductor hands the op its inputs laid out as traced, which are the
    # strides its guard matched (else a producer Inductor fuses could pick other strides).
    _lib.define(f"{name}({params}) -> {returns}", tags=(torch.Tag.needs_fixed_stride_order,))
    _lib.impl(name, bound, "CUDA" if card.device_type == "cuda" else "CPU")
    torch.library.register_fake(f"{NAMESPACE}::{name}", bound.fake, lib=_lib)
    return bound


def _serve_natively(bound: "_KernelOp | _RegionOp", op: torch._ops.OpOverload) -> None:
    """Put kforge._dispatch's kernel in front of the op's Python one, guarding the op's own
    arguments (the card's tensors), where it can serve every kernel bound; else leave the Python one."""
    launches = bound.native_launch()
    key = "CUDA" if launches[0][0].device_type == "cuda" else "CPU"
    dispatcher = _native.setdefault(key, Dispatcher(key))
    if dispatcher.owns(bound):
        dispatcher.remove(bound)
    bound.native = False
    if any(launch is None for _, launch in launches):  # a region kernel with no launcher to hand the C++ kernel
        return
    schema = op._schema
    variants = [Variant(Card(op=f"{schema.name}.default", schema=str(schema), outputs=list(card.outputs), arch=card.arch,
                             args=[ArgSpec(a.name, "tensor", tensor=m) for a, m in zip(schema.arguments, card.inputs)]),
                        *launch) for card, launch in launches]
    if native_variants(variants, key)[0] is None:
        return
    dispatcher.add(bound, variants)
    bound.native = dispatcher.path(variants[0].card.op)[0] == "native"
    if not bound.native:  # kforge._dispatch refused it: a Python override over the Python op would only cost time
        dispatcher.remove(bound)
