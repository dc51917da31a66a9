"""Attention masks that keep a traced SDPA call off the fused kernels eager runs.

A model can call SDPA differently when it is traced. transformers builds its attention mask
only where it cannot read values: run eagerly, it sees that nothing is masked and passes no
mask (SDPA then runs flash or cuDNN); traced, it passes the mask it built, and for BERT with no
padding mask that is `q_idx >= 0` expanded over the keys: a boolean mask whose last dim has
stride 0. SDPA's fused CUDA kernels take no mask whose last dim is strided, so the traced call
runs SDPA's math path (fp32 scores, a softmax and two batched matmuls): BERT-base's attention
went from cuDNN's time to several times that, under torch.compile as under kforge.

This pass rewrites dynamo's torch-level graph before aot_autograd lowers it to aten, which is
where SDPA picks its kernel. A mask computed from no graph input (factories, and ops on what
they make; nothing random, no parameter or buffer) is a constant: it is evaluated once, and
where it masks nothing (all True; all zero where additive) the call takes no mask, as eager's
call does. No result changes: masking nothing, or adding zero, leaves every score as it was.

Masks that do depend on inputs are left as they are. Making a key-strided one contiguous would
let the fused kernels take it, but such a mask is the same along each row of scores: it either
masks nothing in a row or all of it, and for a row masked whole SDPA's math path returns zeros
where its fused kernels need not; what runs then is what eager runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
RANDOM = ("rand", "normal", "bernoulli", "dropout", "empty", "multinomial", "uniform", "exponential",
          "poisson", "cauchy", "geometric", "seed")  # in an op's name: its values are not a constant
CONSTANT_BYTES = 1 << 28  # the most memory one value of a constant mask may take to be evaluated


def _target_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _mask(node: fx.Node) -> tuple[Any, fx.Node] | None:
    """(where the call holds its mask: a position or "attn_mask", the mask's node), or None."""
    if node.op != "call_function" or node.target not in SDPA:
        return None
    where: Any = 3 if len(node.args) > 3 else "attn_mask"
    mask = node.args[3] if where == 3 else node.kwargs.get("attn_mask")
    return (where, mask) if isinstance(mask, fx.Node) else None


def _set_mask(node: fx.Node, where: Any, value: Any) -> None:
    if where == 3:
        node.args = (*node.args[:3], value, *node.args[4:])
    else:
        node.kwargs = {**node.kwargs, "attn_mask": value}


def constant_nodes(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes computing `mask`, in graph order, where none reads a graph input or a module's
    state, draws random numbers or holds a value over CONSTANT_BYTES; else None."""
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op not in ("call_function", "call_method") or any(r in _target_name(n).lower() for r in RANDOM):
            return None
        val = n.meta.get("example_value")
        if isinstance(val, torch.Tensor) and val.numel() * val.element_size() > CONSTANT_BYTES:
            return None
        stack.extend(n.all_input_nodes)
    return sorted(seen, key=order.__getitem__)


def evaluate(nodes: list[fx.Node]) -> Any:
    """The last node's value, computed from the nodes alone (real tensors, outside any fake mode)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    env: dict[fx.Node, Any] = {}
    with unset_fake_temporarily(), torch.no_grad():
        for n in nodes:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            if n.op == "call_function":
                env[n] = n.target(*args, **kwargs)
            else:
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
    return env[nodes[-1]]


def masks_nothing(mask: Any) -> bool:
    """An attention mask that keeps every score as it is: all True, or all zero where additive."""
    if not isinstance(mask, torch.Tensor):
        return False
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return mask.is_floating_point() and bool((mask == 0).all())


def apply(gm: fx.GraphModule, notes: list[str] | None = None) -> int:
    """Drop the constant masks of the graph's SDPA calls that mask nothing (module doc); how many.
    One note where any was dropped."""
    dropped = 0
    unused: list[fx.Node] = []  # the dropped masks' computations
    nothing: dict[fx.Node, bool] = {}  # mask -> whether it masks nothing
    for node in list(gm.graph.nodes):
        found = _mask(node)
        if found is None:
            continue
        where, mask = found
        nodes = constant_nodes(mask)
        if nodes is None:
            continue
        if mask not in nothing:  # one mask, often shared by every layer's call, evaluated once
            try:
                nothing[mask] = masks_nothing(evaluate(nodes))
            except Exception:  # noqa: BLE001 (not evaluable here: the mask stays)
                nothing[mask] = False
        if nothing[mask]:
            _set_mask(node, where, None)
            unused.extend(nodes)
            dropped += 1
    if dropped:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for node in sorted(set(unused), key=order.__getitem__, reverse=True):
            if not node.users:
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
    if dropped and notes is not None:
        notes.append(f"{dropped} attention mask(s) built from no input mask nothing: SDPA runs without them, "
                     "as eager does")
    return dropped
