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
they make; nothing random, no parameter or buffer) is a constant: it is evaluated once; where
it masks nothing (all True; all zero where additive) the call takes no mask, and where it is
the causal mask (Llama's, traced: queries see the keys up to their own position) the call
takes is_causal=True instead, as eager's call does. Eager's fused kernels then run, and a
causal one skips the masked half of the scores; the traced mask cost a kernel to build and a
masked kernel to read it (Llama-3.2-1B at 2048 tokens: cuDNN's attention with a 2048 x 2048 mask,
under torch.compile too). No result changes: masking nothing or adding zero leaves every score
as it was, and a causal kernel masks what the mask did.

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


ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")  # F.sdpa's


def bound(node: fx.Node) -> dict[str, Any]:
    """An SDPA call's arguments by name (those it was given)."""
    return dict(zip(ARGS, node.args)) | dict(node.kwargs)


def set_arg(node: fx.Node, name: str, value: Any) -> None:
    """Give the SDPA call `value` for argument `name`, where the call holds it."""
    i = ARGS.index(name)
    if len(node.args) > i:
        node.args = (*node.args[:i], value, *node.args[i + 1:])
    else:
        node.kwargs = {**node.kwargs, name: value}


def example(x: Any) -> torch.Tensor | None:
    """The traced value (a fake tensor) of a node of dynamo's graph, if it is a tensor."""
    v = x.meta.get("example_value") if isinstance(x, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _target_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


FACTORIES = frozenset({"arange", "ones", "zeros", "full", "eye", "tensor", "scalar_tensor", "linspace", "tril_indices",
                       "triu_indices"})  # ops with no tensor input whose values are a constant
# ops that return a view of their first argument: an in-place write to one writes the argument
VIEWS = frozenset({"getitem", "view", "reshape", "expand", "expand_as", "transpose", "permute", "unsqueeze", "squeeze",
                   "narrow", "select", "t", "as_strided", "diagonal", "unflatten", "flatten", "view_as", "movedim",
                   "swapaxes", "swapdims", "unbind", "split", "chunk", "detach", "contiguous", "to", "type_as",
                   "float", "bool", "int", "long", "half", "bfloat16"})


def _pure(n: fx.Node) -> bool:
    """A call of torch's or Python's operators (no custom op, no function of the model's own,
    which may read state), drawing no random numbers."""
    name = _target_name(n).lower()
    if any(r in name for r in RANDOM):
        return False
    if n.op == "call_method":
        return True
    module = getattr(n.target, "__module__", None) or ""
    return module in ("torch", "_operator", "operator", "torch.functional", "torch.nn.functional", "torch._C._nn",
                      "torch._C._VariableFunctions") or module.startswith("torch._ops.aten")


def _writes(n: fx.Node) -> bool:
    """An in-place op: it writes its first argument."""
    name = _target_name(n)
    return name in ("setitem", "__setitem__") or (name.endswith("_") and not name.endswith("__")) or "out" in n.kwargs


def _written(nodes: set[fx.Node]) -> bool:
    """Whether any of `nodes`, or a view of one, is written in place by an op of the graph
    (other than one of `nodes` writing a value only it reads)."""
    stack, seen = list(nodes), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.op not in ("call_function", "call_method"):
                continue
            target = u.kwargs["out"] if "out" in u.kwargs else u.args[0] if u.args else None
            if _writes(u) and target is n and not (u in nodes and len(n.users) == 1):
                return True
            if _target_name(u) in VIEWS and u.args and u.args[0] is n:
                stack.append(u)
    return False


def constant_nodes(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes computing `mask`, in graph order, where none reads a graph input or a module's
    state, calls anything but torch's and Python's operators, draws random numbers, creates a
    tensor other than by a factory of known values, holds a value over CONSTANT_BYTES, or is
    written in place by another op (a write the mask's own chain does not see); else None."""
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op not in ("call_function", "call_method") or not _pure(n):
            return None
        if not n.all_input_nodes and _target_name(n) not in FACTORIES:
            return None
        val = n.meta.get("example_value")
        if isinstance(val, torch.Tensor) and val.numel() * val.element_size() > CONSTANT_BYTES:
            return None
        stack.extend(n.all_input_nodes)
    if _written(seen):
        return None
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


def kept(mask: torch.Tensor) -> torch.Tensor:
    """Which scores an attention mask keeps (bool, the mask's shape)."""
    if mask.dtype == torch.bool:
        return mask
    return mask == 0


def masks_nothing(mask: Any) -> bool:
    """An attention mask that keeps every score as it is: all True, or all zero where additive."""
    if not isinstance(mask, torch.Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        return False
    return bool(kept(mask).all())


def is_causal(mask: Any) -> bool:
    """An attention mask that is SDPA's own causal one, `is_causal=True`: over its last two dims
    (queries, keys) the lower triangle from the first key, the same for every batch and head, and
    where additive, exactly zero where kept and elsewhere -inf, its dtype's lowest value, or one
    at most bf16's lowest (-3.39e38: a bf16 model's `finfo.min` held in an fp32 mask); a score
    plus any of them is zero after the softmax."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or not (mask.dtype == torch.bool or mask.is_floating_point()):
        return False
    tril = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    if not bool((kept(mask) == tril).all()):
        return False
    if mask.dtype == torch.bool:
        return True
    dropped = mask.masked_select(~tril.expand(mask.shape))
    return bool(((dropped <= torch.finfo(torch.bfloat16).min) | (dropped == torch.finfo(mask.dtype).min)).all())


def _call(node: fx.Node) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The traced (query, key, mask) of a call eager would run as it is: not already causal, its
    mask bool, fp32 or of the queries' dtype, and broadcasting to the scores without growing them
    (eager refuses the others: dropping their mask would run what eager does not); else None."""
    args = bound(node)
    q, k, m = (example(args.get(n)) for n in ("query", "key", "attn_mask"))
    if args.get("is_causal") or not all(t is not None and t.dim() >= 2 for t in (q, k, m)):
        return None
    scores = (*q.shape[:-1], k.shape[-2])
    if m.dim() > len(scores) or any(a not in (1, b) for a, b in zip(reversed(m.shape), reversed(scores))):
        return None
    return (q, k, m) if m.dtype in (torch.bool, torch.float32, q.dtype) else None


def _takes_causal(q: torch.Tensor, m: torch.Tensor) -> bool:
    """A causal mask that becomes is_causal=True: bool or of the queries' dtype. SDPA takes an
    fp32 mask with half-precision queries, and on Hopper its cuDNN kernel reads that mask as the
    queries' dtype (pytorch/pytorch#191612; torch 2.11 on an H100: a causal one gave garbage), so
    what that call means is eager's to keep. A mask of zeros reads as zeros in any dtype: dropping
    one that masks nothing is what eager computes either way."""
    return m.dtype in (torch.bool, q.dtype)


def apply(gm: fx.GraphModule, notes: list[str] | None = None) -> int:
    """Drop the constant masks of the graph's SDPA calls that mask nothing, and take is_causal=True
    for those that are its causal mask (module doc); how many calls changed. A note for each kind."""
    dropped = causal = 0
    unused: list[fx.Node] = []  # the dropped masks' computations
    kinds: dict[fx.Node, str | None] = {}  # mask -> "nothing", "causal" or None
    for node in list(gm.graph.nodes):
        call = _call(node) if node.op == "call_function" and node.target in SDPA else None
        nodes = constant_nodes(bound(node)["attn_mask"]) if call is not None else None
        if nodes is None:
            continue
        mask = nodes[-1]
        if mask not in kinds:  # one mask, often shared by every layer's call, evaluated once
            try:
                value = evaluate(nodes)
                kinds[mask] = "nothing" if masks_nothing(value) else "causal" if is_causal(value) else None
            except Exception:  # noqa: BLE001 (not evaluable here: the mask stays)
                kinds[mask] = None
        if kinds[mask] == "nothing":
            dropped += 1
        elif kinds[mask] == "causal" and tuple(call[2].shape[-2:]) == (call[0].shape[-2], call[1].shape[-2]) \
                and _takes_causal(call[0], call[2]):
            set_arg(node, "is_causal", True)  # (a mask shorter than the scores broadcasts: something else)
            causal += 1
        else:
            continue
        set_arg(node, "attn_mask", None)
        unused.extend(nodes)
    if dropped or causal:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for node in sorted(set(unused), key=order.__getitem__, reverse=True):
            if not node.users and not _writes(node):  # a write's effect stays, whoever reads it
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
    if dropped and notes is not None:
        notes.append(f"{dropped} attention mask(s) built from no input mask nothing: SDPA runs without them, "
                     "as eager does")
    if causal and notes is not None:
        notes.append(f"{causal} causal attention mask(s) built from no input: SDPA runs with is_causal=True "
                     "instead, as eager does")
    return dropped + causal
