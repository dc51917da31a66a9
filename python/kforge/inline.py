"""One node of an FX graph replaced by a function of its inputs, traced in place: the mechanism
behind kforge.compile's leftover decompositions (kforge.inductor_decompose) and the attention
rewrite (kforge.attention)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

log = logging.getLogger("kforge")


class _LoweredWhole(Exception):
    """An entry of Inductor's table returned NotImplemented (its add.Tensor does for real
    tensors): Inductor lowers the call itself, so the node stays as it is."""


def inline(graph: torch.fx.Graph, node: torch.fx.Node, table: dict) -> bool:
    """Replace `node` in `graph` by its entry of `table` traced on the node's FakeTensors (node.meta["val"]),
    every op inside decomposed by the same table, as make_fx does; the traced nodes keep their
    values in meta["val"]. False, and the node stays as it is, where the entry returns
    NotImplemented (the caller lowers the call itself) or cannot be traced (a warning)."""
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
        if out is NotImplemented:  # the table's way of saying Inductor lowers this call whole
            raise _LoweredWhole
        # A plain tuple: a decomposition's named tuple (native_layer_norm's return type) would be
        # traced as a call of its class, which Inductor cannot lower.
        return tuple(out) if isinstance(out, tuple) else out

    try:
        with detect_fake_mode(fakes) or contextlib.nullcontext(), enable_python_dispatcher():
            sub = make_fx(call, table, tracing_mode="real")(*fakes)
    except _LoweredWhole:
        return False
    except Exception as e:  # noqa: BLE001 (the node stays whole: Inductor runs it as an extern op)
        log.warning("kforge could not rewrite %s (%s: %s): it runs as traced", node.name, type(e).__name__, e)
        return False
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
                for key in ("nn_module_stack", "stack_trace"):  # where the new nodes come from
                    if key in node.meta:
                        env[n].meta.setdefault(key, node.meta[key])
    if isinstance(result, (list, tuple)):
        for user in list(node.users):  # a tuple's users are its getitem nodes
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)
    return True
