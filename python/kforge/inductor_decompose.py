"""Inductor's decompositions around kforge's compile pass: the table kforge.compile hands
Inductor keeps whole every call a rewrite may replace (_decompositions), and Decompose, the
pass's last step, decomposes what stayed whole and was not replaced, as Inductor's own table
would have, so Inductor generates the code it would have generated without kforge."""

from __future__ import annotations

import logging
from typing import Any, Callable, Collection, Sequence

import torch

from .inductor_rewrites import Rewrite
from .inline import inline

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
                inline(graph, node, self._table)
        return 0  # nothing replaced by a kernel


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
