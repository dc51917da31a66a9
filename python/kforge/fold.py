"""Values a traced graph computes from none of its inputs, computed once.

A decoder layer builds its causal mask (full, then triu) and its rotary positions (arange)
from constants on every forward: kernels and dispatcher calls whose result never changes,
since the graph's guards fix every shape and constant argument. `fold(graph)` replaces each
such value that something else reads by one call of a `Folded` holder, which computes it on
its first call (the subgraph that makes it, on the device the graph names) and returns the
same tensor from then on.

What is folded: nodes that read no graph input, only constants and other folded nodes, whose
op draws no random numbers, writes none of its arguments and is not an allocation whose
contents are undefined (empty); each folded value is a single tensor of at most
MAX_BYTES, not a graph output (the caller could write it) and not written by its readers.
The holder keeps the tensor alive as long as the graph: a mask of 2048 x 2048 fp32 is 16 MB.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

MAX_BYTES = 64 << 20
_UNDEFINED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                        "empty_permuted"})


class Folded:
    """A constant value of a graph: its subgraph, run on the first call, the result kept."""

    reads_only = True

    def __init__(self, make: fx.GraphModule, name: str):
        self.make, self.value = make, None
        self.__name__ = f"kforge_folded_{name}"

    def __call__(self) -> torch.Tensor:
        if self.value is None:
            self.value = self.make()
        return self.value


def _foldable_op(n: fx.Node) -> bool:
    op = n.target
    if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in op.tags or op._schema.name.split("::")[-1] in _UNDEFINED:
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def _static_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and all(isinstance(x, int) for x in (*v.shape, *v.stride()))


def _writes(user: fx.Node, node: fx.Node) -> bool:
    """Whether `user` may write `node`'s value (an argument its schema marks written)."""
    op = user.target
    if not isinstance(op, torch._ops.OpOverload):  # an opaque call may, unless it says it only reads
        return user.op == "call_function" and not getattr(op, "reads_only", False)
    schema = op._schema.arguments
    for k, a in enumerate(user.args):
        if a is node and k < len(schema) and schema[k].alias_info is not None and schema[k].alias_info.is_write:
            return True
    return any(v is node and next((s.alias_info is not None and s.alias_info.is_write for s in schema if s.name == key),
                                  False) for key, v in user.kwargs.items())


def fold(graph: fx.Graph) -> int:
    """Replace the graph's input-free values by Folded calls; returns how many."""
    const: set[fx.Node] = set()
    for n in graph.nodes:
        if not _foldable_op(n) or not _static_tensor(n.meta.get("val")):
            continue
        deps: list[fx.Node] = []
        fx.node.map_arg((n.args, n.kwargs), deps.append)
        if all(d in const for d in deps):
            const.add(n)
    done = 0
    for n in [n for n in graph.nodes if n in const]:
        readers = [u for u in n.users if u not in const]
        if not readers:
            continue
        val = n.meta["val"]
        if (any(u.op == "output" or _writes(u, n) for u in readers)
                or val.numel() * val.element_size() > MAX_BYTES):
            continue
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for m in graph.nodes:  # n's ancestors, in graph order
            if m in const and (m is n or _feeds(m, n)):
                env[m] = sub.node_copy(m, lambda a: env[a])
        sub.output(env[n])
        with graph.inserting_before(_first(graph, readers)):
            new = graph.call_function(Folded(fx.GraphModule(torch.nn.Module(), sub), n.name), ())
        new.meta["val"] = val
        for u in readers:
            u.replace_input_with(n, new)
        done += 1
    for n in reversed(list(graph.nodes)):
        if n in const and not n.users:
            graph.erase_node(n)
    return done


def _feeds(m: fx.Node, n: fx.Node) -> bool:
    """Whether n depends on m."""
    todo, seen = [n], set()
    while todo:
        x = todo.pop()
        for d in x.all_input_nodes:
            if d is m:
                return True
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return False


def _first(graph: fx.Graph, nodes: list[fx.Node]) -> fx.Node | None:
    """The earliest of `nodes` in graph order."""
    want = set(nodes)
    return next((x for x in graph.nodes if x in want), None)
