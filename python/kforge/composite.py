"""Composite ops kforge captures and dispatches as one card.

Most aten ops reach the backend key (CUDA) as themselves, and that is where capture and
dispatch intercept them. A composite op (a CompositeImplicitAutograd kernel, no backend
kernel) never does: it is decomposed above autograd, and only its parts reach the backend.
Where the parts are several kernels over the same bytes, the composite is what is worth a
kernel: `F.softmax(x, dim, dtype=torch.float32)` on bf16 scores is a cast (read 2 bytes,
write 4) and then a softmax (read 4, write 4); one kernel reads 2 and writes 4.

An override of a composite op is registered at CompositeImplicitAutograd, so it runs above
autograd and above the layers that wrap tensors: a call that needs a backward (grad mode
on and an input that requires grad, or a forward-mode tangent) goes to eager's
decomposition, which records one; so does any call that is not on plain tensors (fake
tensors under torch.compile's tracing, functionalization, functorch transforms, tensor
subclasses and dispatch modes, conjugate/negative views): those layers, not a kernel,
must see it. The kernel that serves a miss is the backend key's
computed kernel, which for a composite op is the decomposition itself.

WORTH says, per composite op, when a call runs more than one kernel under eager and so is
recorded as a card of its own; other calls pass through unrecorded (their parts are
recorded as usual).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .cards import qualified_name
from .families import _resolve

AT = "CompositeImplicitAutograd"


def _arg(op: torch._ops.OpOverload, args: tuple, kwargs: dict, i: int) -> Any:
    a = op._schema.arguments[i]
    if i < len(args):
        return args[i]
    return kwargs.get(a.name, a.default_value if a.has_default_value() else None)


def _softmax_casts(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """softmax/log_softmax with dtype= other than the input's: a cast, then the softmax.
    Eager's one exception: half to float on CUDA is a single kernel (half_to_float)."""
    x, dtype = _arg(op, args, kwargs, 0), _arg(op, args, kwargs, 2)
    if not isinstance(x, torch.Tensor) or dtype is None or dtype == x.dtype:
        return False
    return not (x.is_cuda and x.dtype == torch.float16 and dtype == torch.float32)


WORTH: dict[str, Callable[[torch._ops.OpOverload, tuple, dict], bool]] = {
    "aten::softmax.int": _softmax_casts,
    "aten::log_softmax.int": _softmax_casts,
}


def is_composite(op: torch._ops.OpOverload, key: str) -> bool:
    """The op has no kernel at `key` of its own, only a CompositeImplicitAutograd one."""
    name = op.name()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(name, AT) and not any(has(name, k) for k in (key, "CompositeExplicitAutograd",
                                                            "CompositeExplicitAutogradNonFunctional"))


def override_key(op: torch._ops.OpOverload, key: str) -> str:
    """Where an override of `op` for the backend `key` is registered."""
    return AT if is_composite(op, key) else key


@functools.cache
def captured_ops() -> tuple[torch._ops.OpOverload, ...]:
    """The composite ops capture watches from the first run (its dispatch mode never sees them)."""
    return tuple(op for op in map(_resolve, WORTH) if op is not None)


def worth(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """This call of a composite op is recorded as a card (see WORTH)."""
    rule = WORTH.get(qualified_name(op))
    return rule is not None and rule(op, args, kwargs)


_K = torch._C.DispatchKey
# Keys of the layers above the backend that a kernel must not bypass (kept in step with
# wrapped_keys() in csrc/torch_dispatch.cpp).
WRAPPED = ("Python", "PythonTLSSnapshot", "Functionalize", "FuncTorchDynamicLayerFrontMode",
           "FuncTorchDynamicLayerBackMode", "FuncTorchGradWrapper", "FuncTorchBatched", "FuncTorchVmapMode",
           "Batched", "BatchedNestedTensor", "Conjugate", "Negative", "ZeroTensor", "Sparse", "SparseCsr",
           "NestedTensor", "Quantized")
_WRAPPED_RAW = 0
for _name in WRAPPED:
    if hasattr(_K, _name):  # Python's enum lacks the legacy Batched keys
        _WRAPPED_RAW |= torch._C.DispatchKeySet(getattr(_K, _name)).raw_repr()


def wrapped(keyset: Any) -> bool:
    """The call is not on plain dense tensors: some layer between autograd and the backend
    (a mode, a subclass, a transform, a lazy view) must handle it."""
    return bool(keyset.raw_repr() & _WRAPPED_RAW)


def needs_grad(tensors: list[torch.Tensor]) -> bool:
    """Only eager's decomposition can record a backward (or carry a tangent) for this call."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return True
    return torch._C._is_fwd_grad_enabled() and any(torch._VF._unpack_dual(t, 0)[1] is not None for t in tensors)
