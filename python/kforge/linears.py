"""Linear layers in a traced graph as one call each.

aot_autograd decomposes F.linear into the weight's transpose, a view of the input to 2-D, mm
(addmm with a bias) and a view back: four dispatcher calls from Python on every forward where
eager code makes one (torch._C._nn.linear, which makes the same calls inside, in C++). A
transformer layer has a linear per projection, so a forward bound by launch overhead pays
three calls more per projection than eager does.

`recompose(graph)` puts the one call back wherever the four are exactly a linear: checked per
node on its fake values, the linear must dispatch the same matmul overload and give the
output's shape, strides and dtype.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .bindings import _Dispatched, _metas
from .families import packet_name

_LINEAR = torch._C._nn.linear


def _is(n, *names: str) -> bool:
    return (isinstance(n, fx.Node) and n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "aten" and packet_name(n.target) in names)


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _site(mm: fx.Node):
    """(input, weight, bias, the node the linear replaces) of a linear ending at `mm`, or None."""
    if _is(mm, "mm") and len(mm.args) == 2 and not mm.kwargs:
        bias, a, wt = None, *mm.args
    elif _is(mm, "addmm") and len(mm.args) == 3 and all(mm.kwargs.get(k, 1) == 1 for k in ("beta", "alpha")) \
            and set(mm.kwargs) <= {"beta", "alpha"}:
        bias, a, wt = mm.args
    else:
        return None
    if not _is(wt, "t") or not isinstance(wt.args[0], fx.Node):
        return None
    x, out = a, mm
    users = list(mm.users)
    if _is(a, "view", "_unsafe_view") and len(users) == 1 and _is(users[0], "view", "_unsafe_view"):
        x, out = a.args[0], users[0]
    if not isinstance(x, fx.Node) or (bias is not None and not isinstance(bias, fx.Node)):
        return None
    return x, wt.args[0], bias, out


def recompose(graph: fx.Graph) -> int:
    """Replace each exact decomposed linear by one torch._C._nn.linear call; returns how many."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode([v for n in graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)])
    if fake_mode is None:
        return 0
    count = 0
    for mm in list(graph.nodes):
        site = _site(mm)
        if site is None:
            continue
        x, w, bias, out = site
        args = (x, w) if bias is None else (x, w, bias)
        vals = [_val(n) for n in args]
        want = _metas(_val(out))
        if want is None or any(not isinstance(v, torch.Tensor) for v in vals):
            continue
        seen = _Dispatched()
        try:
            with fake_mode, seen:
                got = _LINEAR(*vals)
        except Exception:  # noqa: BLE001 (not a linear these values make: leave it)
            continue
        matmuls = [o for o in seen.ops if packet_name(o) in ("mm", "addmm", "bmm", "baddbmm", "matmul")]
        if matmuls != [mm.target] or _metas(got) != want:
            continue
        with graph.inserting_before(out):
            new = graph.call_function(_LINEAR, args)
        new.meta["val"] = _val(out)
        out.replace_all_uses_with(new)
        graph.erase_node(out)
        count += 1
    for n in reversed(list(graph.nodes)):  # the decomposition's views and transposes nothing reads now
        if (_is(n, "t", "view", "_unsafe_view", "mm", "addmm")) and not n.users:
            graph.erase_node(n)
    return count
