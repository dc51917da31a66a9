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
    index.Tensor(self, [None, ..., index (*)]) -> self with the index's dims at its one indexed
        dim (`table[idx]`, `x[:, idx]`: Swin's relative position bias); several index tensors,
        or a bool mask, are not generated
"""

from __future__ import annotations

from ..cards import TensorMeta
from .ir import Expr, Node, Program, Ref

OPS = ("aten::embedding.default", "aten::index_select.default", "aten::gather.default", "aten::index.Tensor")
_OPERANDS = {"aten::embedding.default": ("weight", "indices")}  # (table, index); the others: self, index


def program(node: Node, inputs: list[TensorMeta], outputs: list[TensorMeta]) -> Program | str:
    """The program of one call (card_program.node_of_card: its tensors are refs to `inputs`), or why not."""
    dim = node.args.get("dim", 0)
    if node.op == "aten::index.Tensor":  # one index tensor, at `dim`: the indexed dim
        indices = node.args.get("indices") or []
        picked = [k for k, r in enumerate(indices) if r is not None]
        if len(picked) != 1:
            return "an index with several index tensors (or none): one is generated"
        dim = picked[0]
        table_ref, index_ref = node.args.get("self"), indices[dim]
    else:
        table_ref, index_ref = (node.args.get(a) for a in _OPERANDS.get(node.op, ("self", "index")))
    if not isinstance(table_ref, Ref) or not isinstance(index_ref, Ref):
        return "the table or the index is not a tensor"
    table, index, (out,) = inputs[table_ref.index], inputs[index_ref.index], outputs
    if not table.shape or not isinstance(dim, int):
        return "a 0-d table, or a dim that is not a number"
    dim %= len(table.shape)
    if node.op == "aten::embedding.default":
        if len(table.shape) != 2:
            return "an embedding of a table that is not 2-d"
        # the index's dims, then the row's
        index_strides = tuple(index.stride) + (0,)
        table_strides = (0,) * len(index.shape) + (table.stride[1],)
    elif node.op == "aten::index_select.default":
        if len(index.shape) > 1:
            return "an index_select with a multi-dim index"
        istride = index.stride[0] if index.shape else 0
        index_strides = tuple(istride if d == dim else 0 for d in range(len(table.shape)))
        table_strides = tuple(0 if d == dim else s for d, s in enumerate(table.stride))
    elif node.op == "aten::index.Tensor":  # the table's dims before `dim`, the index's, the table's after
        lead, trail = dim, len(table.shape) - dim - 1
        index_strides = (0,) * lead + tuple(index.stride) + (0,) * trail
        table_strides = tuple(table.stride[:dim]) + (0,) * len(index.shape) + tuple(table.stride[dim + 1:])
    else:  # gather: out[..., i, ...] = self[..., index[..., i, ...], ...], out shaped like the index
        if len(index.shape) != len(table.shape) or node.args.get("sparse_grad"):
            return "a gather with an index of another rank, or sparse"
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
    t, i = table_ref.index, index_ref.index
    return Program(domain=domain, inputs=list(inputs), outputs=[out], in_strides={t: table_strides, i: index_strides},
                   out_strides=[tuple(out.stride)], results=[Expr.load(t, table.dtype)],
                   gathers={t: (i, table.stride[dim], rows)})
