"""Rows picked by an index tensor: embedding, index_select and gather as pointwise programs.

out[..., i, ...] = self[..., index[i], ...] reads one input at an address that depends on another
input's value, which strides cannot say. The program's domain is the output's shape; the table
(`self`) is read through its strides over the domain with 0 along the picked dim, plus the
index's value times that dim's stride (ir.Program.gathers); the index is an ordinary input,
broadcast over the dims it does not vary in. Where the index is constant along the inner dim
(an embedding's row), the lowering reads each row in 16-byte vectors (lower/pointwise.py).

An index outside [0, rows) stops the kernel (__trap), as eager's device-side assert stops
eager's: nothing is read out of bounds.

    embedding(weight (V, H), indices (*)) -> (*, H)
    index_select(self, dim, index (n,)) -> self with size n at dim
    gather(self, dim, index) -> index's shape: self at index's value along dim
"""

from __future__ import annotations

from ..cards import Card, decode_value
from .ir import Expr, Program

OPS = ("aten::embedding.default", "aten::index_select.default", "aten::gather.default")


def _tensor_args(card: Card) -> dict:
    out, k = {}, 0
    for a in card.args:
        if a.kind == "tensor":
            out[a.name] = card.inputs[k]
            k += 1
        elif a.kind != "tensors":
            out[a.name] = decode_value(a.value)
    return out


def program(card: Card) -> Program | str:
    """The card's program, or why not."""
    args = _tensor_args(card)
    (out,) = card.outputs
    if card.op == "aten::embedding.default":
        table, index, dim = args.get("weight"), args.get("indices"), 0
        if table is None or index is None or len(table.shape) != 2:
            return "an embedding of a table that is not 2-d"
        # the index's dims, then the row's
        index_strides = tuple(index.stride) + (0,)
        table_strides = (0,) * len(index.shape) + (table.stride[1],)
    elif card.op == "aten::index_select.default":
        table, index, dim = args.get("self"), args.get("index"), args.get("dim")
        if table is None or index is None or not isinstance(dim, int) or len(index.shape) > 1 or not table.shape:
            return "an index_select of a 0-d tensor or with a multi-dim index"
        dim %= len(table.shape)
        istride = index.stride[0] if index.shape else 0
        index_strides = tuple(istride if d == dim else 0 for d in range(len(table.shape)))
        table_strides = tuple(0 if d == dim else s for d, s in enumerate(table.stride))
    else:  # gather: out[..., i, ...] = self[..., index[..., i, ...], ...], out shaped like the index
        table, index, dim = args.get("self"), args.get("index"), args.get("dim")
        if table is None or index is None or not isinstance(dim, int) or not table.shape or \
                len(index.shape) != len(table.shape) or args.get("sparse_grad"):
            return "a gather of a 0-d tensor, with an index of another rank, or sparse"
        dim %= len(table.shape)
        index_strides = tuple(index.stride)
        table_strides = tuple(0 if d == dim else s for d, s in enumerate(table.stride))
    if index.dtype not in ("int64", "int32"):
        return f"an index of dtype {index.dtype}: int64 and int32 are generated"
    if out.dtype != table.dtype or not out.numel:
        return "an output of another dtype than its table, or an empty one"
    rows = table.shape[dim]
    if not rows:
        return "a table with no rows to pick"
    if index.lo is None or index.hi is None or index.lo < 0 or index.hi >= rows:
        # fresh inputs are drawn in the recorded range: outside the table, eager itself would fail
        return "the index's recorded values are unknown or outside the table"
    domain = tuple(out.shape)
    if len(table_strides) != len(domain):
        return "an output whose rank is not the table's and the index's"
    return Program(domain=domain, inputs=[table, index], outputs=[out],
                   in_strides={0: table_strides, 1: index_strides}, out_strides=[tuple(out.stride)],
                   results=[Expr.load(0, table.dtype)], gathers={0: (1, table.stride[dim], rows)})
