"""Grouped keys and values handed to SDPA as they are, not repeated to the queries' heads.

A model with fewer key/value heads than query heads (grouped-query attention: Llama, Qwen,
Gemma) repeats each key and value head for its group of queries before attention, or asks SDPA
to (`enable_gqa=True`). transformers asks SDPA only where it passes no mask, and it passes one
while it is traced; so the traced graph repeats them (`x[:, :, None].expand(b, h, n, s, d)
.reshape(b, h * n, s, d)`: a copy of each, n times its size, written and then read by the
attention kernel); other models repeat them with `repeat_interleave(n, dim=1)`, the same copy. Once kforge.masks has taken the traced mask away (it was constant), eager's
call is SDPA on the grouped heads with enable_gqa=True, and this pass makes the call that
one: the repeat's copies are gone, and the fused kernels read each key and value head once.

SDPA's enable_gqa repeats each key and value head for q_heads / kv_heads consecutive query
heads, which is what the pattern computes, so no result changes. Only calls with no mask are
rewritten (with one, transformers keeps the repeat: some fused kernels take no grouped heads
with a mask).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .masks import SDPA, bound, example


def _unsqueezed(node: Any) -> fx.Node | None:
    """x where `node` is x with a new size-1 dim 2 (x[:, :, None] or x.unsqueeze(2))."""
    if not isinstance(node, fx.Node):
        return None
    x = node.args[0] if node.args else None
    if node.op == "call_function" and node.target is operator.getitem:
        idx = node.args[1]
        whole = slice(None)
        ok = isinstance(idx, tuple) and len(idx) >= 3 and idx[0] == whole and idx[1] == whole and idx[2] is None \
            and all(i == whole or i is Ellipsis for i in idx[3:])
    elif (node.op == "call_method" and node.target == "unsqueeze") or \
            (node.op == "call_function" and node.target is torch.unsqueeze):
        ok = node.args[1:] == (2,) or node.kwargs.get("dim") == 2
    else:
        return None
    xv, uv = example(x), example(node)
    if not ok or xv is None or uv is None or xv.dim() != 4:
        return None
    return x if tuple(uv.shape) == (*xv.shape[:2], 1, *xv.shape[2:]) else None


def _interleaved(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(x, n) where `node` is x.repeat_interleave(n, dim=1) (or torch.repeat_interleave) of a 4-D x."""
    if not ((node.op == "call_method" and node.target == "repeat_interleave")
            or (node.op == "call_function" and node.target is torch.repeat_interleave)):
        return None
    args = dict(zip(("input", "repeats", "dim"), node.args)) | dict(node.kwargs)
    x, n, dim = args.get("input"), args.get("repeats"), args.get("dim")
    xv = example(x)
    if xv is None or xv.dim() != 4 or not isinstance(n, int) or n < 2 or dim not in (1, -3) \
            or set(args) - {"input", "repeats", "dim"}:
        return None
    return x, n


def repeated(node: Any) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """(x, n, the nodes that repeat it, last first) where `node` repeats each head of x (batch,
    heads, seq, dim) n times, as repeat_kv: x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n,
    s, d), or x.repeat_interleave(n, dim=1); else None."""
    if not isinstance(node, fx.Node):
        return None
    interleaved = _interleaved(node)
    if interleaved:
        return (*interleaved, [node])
    if node.op != "call_method" or node.target not in ("reshape", "view"):
        return None
    e = node.args[0]
    if not isinstance(e, fx.Node) or e.op != "call_method" or e.target != "expand":
        return None
    x = _unsqueezed(e.args[0])
    xv, ev, rv = example(x), example(e), example(node)
    if x is None or ev is None or rv is None:
        return None
    b, h, s, d = xv.shape
    n = ev.shape[2]
    if tuple(ev.shape) != (b, h, n, s, d) or tuple(rv.shape) != (b, h * n, s, d) or n < 2:
        return None
    return x, n, [node, e, e.args[0]]


def apply(gm: fx.GraphModule, notes: list[str] | None = None) -> int:
    """Rewrite the graph's SDPA calls on repeated keys and values (module doc); how many. A note
    where any was."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA:
            continue
        args = bound(node)
        if args.get("attn_mask") is not None or args.get("enable_gqa") or len(node.args) > 3:
            continue
        k, v, q = repeated(args.get("key")), repeated(args.get("value")), example(args.get("query"))
        if k is None or v is None or q is None or k[1] != v[1]:
            continue
        if q.dim() != 4 or q.shape[1] != example(k[0]).shape[1] * k[1]:
            continue
        node.args = (node.args[0], k[0], v[0])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        for c in dict.fromkeys(k[2] + v[2]):  # the repeats (last first), where nothing else reads them
            if not c.users:
                gm.graph.erase_node(c)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
        if notes is not None:
            notes.append(f"{count} attention call(s) read their grouped keys and values (enable_gqa), "
                         "not copies repeated to the queries' heads, as eager's call does")
    return count
