"""Inductor's decompositions around kforge's compile pass: the table kforge.compile hands
Inductor keeps whole every call a rewrite may replace (_decompositions), and Decompose, the
pass's last step, decomposes what stayed whole and was not replaced, as Inductor's own table
would have, so Inductor generates the code it would have generated without kforge."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Collection, Sequence

import torch

from .inductor_rewrites import Rewrite

log = logging.getLogger("kforge.inductor")


class Decompose:
    """What kforge.compile kept whole for the pass and the pass did not replace, decomposed as
    Inductor's own table decomposes it (each node traced through the table and inlined)."""

    whole: frozenset = frozenset()

    def __init__(self, kept: Collection[torch._ops.OpOverload], table: dict):
        self.kept, self._table = frozenset(kept), table
        self.key = "decompose:" + ",".join(sorted(op.name() for op in self.kept))

    def __call__(self, graph: torch.fx.Graph) -> int:
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in self.kept:
                _inline_decomposition(graph, node, self._table)
        return 0  # nothing replaced by a kernel


class _LoweredWhole(Exception):
    """An entry of Inductor's table returned NotImplemented (its add.Tensor does for real
    tensors): Inductor lowers the call itself, so the node stays as it is."""


def _inline_decomposition(graph: torch.fx.Graph, node: torch.fx.Node, table: dict) -> None:
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
        return
    except Exception as e:  # noqa: BLE001 (the node stays whole: Inductor runs it as an extern op)
        log.warning("kforge could not decompose %s (%s: %s); Inductor runs it whole", node.name, type(e).__name__, e)
        return
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
    if isinstance(result, (list, tuple)):
        for user in list(node.users):  # a tuple's users are its getitem nodes
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)


def _decompositions(rewrites: Sequence[Rewrite]) -> tuple[dict, set]:
    """Inductor's decomposition table, except that a call hitting an OpRewrite's card, and every
    call of an op a rewrite keeps whole (the ops of the regions it matches), stays whole; and the
    ops so kept."""
    from torch._inductor.decomposition import select_decomp_table

    table = dict(select_decomp_table())
    kept = {op for rewrite in rewrites for op in rewrite.whole} & set(table)
    for op in kept:
        table[op] = _keep_whole(None, op, table[op])
    for rewrite in rewrites:
        for op in set(getattr(rewrite, "ops", ())) - kept:
            if op in table:
                table[op] = _keep_whole(rewrite.match, op, table[op])
                kept.add(op)
    return table, kept


def _keep_whole(match: Callable | None, op: Any, decompose: Callable) -> Callable:
    """`decompose`, except where `match` (None: always) says the call is a card's."""
    def decomposition(*args: Any, **kwargs: Any) -> Any:
        # NotImplemented: the tracer records the op itself, which the pass then replaces or decomposes.
        if match is None or match(op, args, kwargs) is not None:
            return NotImplemented
        return decompose(*args, **kwargs)

    return decomposition
