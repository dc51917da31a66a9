"""Composite ops kforge captures and dispatches as one card.

Most aten ops reach the backend key (CUDA) as themselves, and that is where capture and
dispatch intercept them. A composite op (a CompositeImplicitAutograd kernel, no backend
kernel) never does: it is decomposed above autograd, and only its parts reach the backend.
Where the parts are several kernels over the same bytes, the composite is what is worth a
kernel: `F.softmax(x, dim, dtype=torch.float32)` on bf16 scores is a cast (read 2 bytes,
write 4) and then a softmax (read 4, write 4); one kernel reads 2 and writes 4.

An override of a composite op is registered at CompositeImplicitAutograd, so it runs above
autograd: a call that needs a backward (grad mode on, an input that requires grad) goes to
eager's decomposition, which records one. The kernel that serves a miss is the backend key's
computed kernel, which for a composite op is the decomposition itself.

WORTH says, per composite op, when a call runs more than one kernel under eager and so is
recorded as a card of its own; other calls pass through unrecorded (their parts are
recorded as usual).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

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


def captured_ops() -> list[torch._ops.OpOverload]:
    """The composite ops capture watches from the first run (its dispatch mode never sees them)."""
    out = []
    for name in WORTH:
        ns, rest = name.split("::", 1)
        packet, overload = rest.split(".", 1)
        out.append(getattr(getattr(getattr(torch.ops, ns), packet), overload))
    return out


def worth(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """This call of a composite op is recorded as a card (see WORTH)."""
    rule = WORTH.get(f"{op._schema.name}.{op._overloadname}")
    return rule is not None and rule(op, args, kwargs)


def needs_grad(tensors: list[torch.Tensor]) -> bool:
    """Only eager's decomposition can record a backward for this call."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
