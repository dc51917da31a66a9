"""The order the builder (build.from_nodes) takes a region's nodes in."""

from __future__ import annotations

from .ir import Node, Ref


def _refs(v) -> list[Ref]:
    return [v] if isinstance(v, Ref) else [x for x in v if isinstance(x, Ref)] if isinstance(v, list) else []


def prologue_first(nodes: list[Node], folds: list[int]) -> list[int]:
    """The order the builder takes `nodes` in: their own, except that where a region has several
    reductions (`folds`, their indices in order), the nodes a later one folds (its operand's ancestors after the first reduction that
    depend on no reduction) come before the first, so that sibling reductions over the same elements
    (a triplet loss's two distances) share one prologue."""
    if len(folds) < 2:
        return list(range(len(nodes)))
    deps = [{r.index for v in n.args.values() for r in _refs(v) if r.kind == "node"} for n in nodes]
    after_fold = [False] * len(nodes)
    for j in range(len(nodes)):
        after_fold[j] = any(d in folds or after_fold[d] for d in deps[j])
    wanted, todo = set(), [d for r in folds[1:] for d in deps[r]]
    while todo:
        d = todo.pop()
        if d not in wanted:
            wanted.add(d)
            todo += deps[d]
    first = folds[0]
    moved = [j for j in sorted(wanted) if j > first and not after_fold[j] and j not in folds]
    return [j for j in range(first)] + moved + [j for j in range(first, len(nodes)) if j not in moved]
