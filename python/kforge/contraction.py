"""Replacing regions of an aten graph by one call each, in place: what kforge.optimize does
for the package's region kernels in the graphs it traces and kforge.compile's pass does in
Inductor's post-grad graphs (one mechanism for both).

Each region (kforge.regions.Site) is convex on its own, but two together need not be: where A
writes what B reads and B writes what A reads, through nodes of neither, one call for each
would need the other's output first. `without_cycles` keeps, in priority order, the sites that
can all be replaced; `replace_sites` replaces them, each call reading the calls before it
where a site reads another's output, then re-sorts the graph so that every node follows what
it reads, keeping the original order wherever it can.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Sequence

import torch.fx as fx

from .regions import Site, _is_getitem, _value

__all__ = ["replace_sites", "without_cycles", "reader"]


def reader(src: fx.Node, k: int) -> fx.Node | None:
    """The node whose value is output k of `src`: src itself, or its getitem node (None: unread)."""
    if isinstance(src.meta.get("val"), (tuple, list)):
        return next((u for u in src.users if _is_getitem(u) and _value(u) == (src, k)), None)
    return src


def _owners(sites: Sequence[Any]) -> dict[fx.Node, int]:
    """Each member's site index; a member's getitem nodes belong to its site too."""
    owner: dict[fx.Node, int] = {}
    for i, site in enumerate(sites):
        for n in site.nodes:
            owner[n] = i
            for u in n.users:
                if _is_getitem(u) and u.args[0] is n:
                    owner[u] = i
    return owner


def without_cycles(graph: fx.Graph | fx.GraphModule, sites: Sequence[Site]) -> list[Site]:
    """Of disjoint sites, in priority order, those that can all be replaced together: a site
    whose replacement with those kept before it would close a cycle is dropped."""
    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    if _acyclic(g, _owners(sites)):  # the common case: one pass over the graph
        return list(sites)
    kept: list[Site] = []
    for site in sites:
        if _acyclic(g, _owners([*kept, site])):
            kept.append(site)
    return kept


def _acyclic(graph: fx.Graph, owner: dict[fx.Node, int]) -> bool:
    def unit(n: fx.Node) -> Any:
        return ("site", owner[n]) if n in owner else n
    succ: dict[Any, set] = {}
    indegree: dict[Any, int] = {}
    for n in graph.nodes:
        a = unit(n)
        succ.setdefault(a, set())
        indegree.setdefault(a, 0)
        for u in n.users:
            b = unit(u)
            if b != a and b not in succ[a]:
                succ[a].add(b)
                indegree[b] = indegree.get(b, 0) + 1
    ready = [a for a, d in indegree.items() if d == 0]
    seen = 0
    while ready:
        a = ready.pop()
        seen += 1
        for b in succ[a]:
            indegree[b] -= 1
            if indegree[b] == 0:
                ready.append(b)
    return seen == len(indegree)


def replace_sites(graph: fx.Graph, sites: Sequence[Site],
                  call: Callable[[int, list[fx.Node]], list[fx.Node]]) -> None:
    """Replace each site's nodes by what `call(i, inputs)` adds to the graph for sites[i]: one
    node per site output, in order, given the nodes holding the site's inputs. The sites must
    be disjoint and replaceable together (without_cycles)."""
    owner = _owners(sites)
    end = next(n for n in reversed(graph.nodes) if n.op == "output")
    outputs_of: dict[tuple[fx.Node, int], fx.Node] = {}
    rank: dict[fx.Node, tuple[int, int]] = {n: (j, 0) for j, n in enumerate(graph.nodes)}  # added nodes: (site's first, k)
    for i, site in enumerate(sites):
        # An input from a site replaced before is its call's output; from one replaced after,
        # the member's node, which that site's replace_all_uses_with then points at its call.
        ins = [outputs_of.get((src, k)) or reader(src, k) for src, k in site.inputs]
        with graph.inserting_before(end):
            outs = call(i, ins)
        added, n = [], end.prev
        while n not in rank:  # the nodes call() added, just before the output
            added.append(n)
            n = n.prev
        first = min(rank[m][0] for m in site.nodes)
        rank.update((m, (first, 1 + j)) for j, m in enumerate(reversed(added)))
        for (src, k), out in zip(site.outputs, outs, strict=True):
            outputs_of[(src, k)] = out
            reader(src, k).replace_all_uses_with(out)  # an output value has no user inside its region
    for n in reversed([n for n in graph.nodes if n in owner]):
        graph.erase_node(n)
    _sort(graph, rank)


def _sort(graph: fx.Graph, rank: dict[fx.Node, tuple[int, int]]) -> None:
    """Reorder the graph's nodes so that each follows its inputs, lowest rank first among the ready."""
    nodes = list(graph.nodes)
    waiting = {n: len(n.all_input_nodes) for n in nodes}
    ready = [(rank[n], id(n), n) for n in nodes if not waiting[n]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in n.users:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (rank[u], id(u), u))
    if len(order) != len(nodes):
        raise ValueError("the graph has a cycle after replacing its sites")
    end = order[-1]
    assert end.op == "output"
    for n in order[:-1]:
        end.prepend(n)
