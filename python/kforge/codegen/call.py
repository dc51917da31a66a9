"""What an op-table entry (codegen.ops, codegen.reductions) is given and the expression helpers
both tables share: an operand (Val), one node's arguments bound by schema name (Call), eager's
type promotion kinds, and constants, max and min as eager computes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND
from torch._prims_common import elementwise_dtypes

from .ir import Expr, opmath, prim

DEFAULT, INT_TO_FLOAT, ALWAYS_BOOL, BOOL_TO_LONG = KIND.DEFAULT, KIND.INT_TO_FLOAT, KIND.ALWAYS_BOOL, KIND.BOOL_TO_LONG


@dataclass
class Val:
    """One operand: a tensor (its value at the current point, in its stored dtype) or a
    Python number."""

    expr: Expr | None
    dtype: str | None  # stored dtype of a tensor
    ndim: int = 0
    number: Any = None

    @property
    def is_tensor(self) -> bool:
        return self.expr is not None

    def stand_in(self):
        if self.is_tensor:
            return torch.empty((1,) * min(self.ndim, 1), dtype=getattr(torch, self.dtype), device="meta")
        return self.number

    def at(self, common: str) -> Expr:
        """This operand as eager feeds it to the op: cast to the common dtype, in its opmath."""
        if not self.is_tensor:
            return Expr.const(self.number, opmath(common))
        e = self.expr if self.dtype == common else self.expr.cast(common)
        return e.cast(opmath(common))


class Call:
    """The arguments of one node, bound by schema name: tensors as Vals, the rest as values."""

    def __init__(self, name: str, overload: str, values: dict[str, Any]):
        self.name, self.overload, self.values = name, overload, values

    def v(self, name: str) -> Val | None:
        x = self.values.get(name)
        if x is None or isinstance(x, Val):
            return x
        return Val(None, None, number=x)

    def s(self, name: str, default=None):
        x = self.values.get(name, default)
        return default if x is None else x

    def promote(self, names: list[str], kind=DEFAULT) -> tuple[str, list[Expr]]:
        """(common dtype, the operands in its opmath) for eager's promotion `kind`."""
        vals = [self.v(n) for n in names]
        _, result = elementwise_dtypes(*(x.stand_in() for x in vals), type_promotion_kind=kind)
        common = str(result).removeprefix("torch.")
        if kind == ALWAYS_BOOL:  # compare in the operands' own common dtype
            _, c = elementwise_dtypes(*(x.stand_in() for x in vals), type_promotion_kind=DEFAULT)
            common = str(c).removeprefix("torch.")
        return common, [x.at(common) for x in vals]


Entry = Callable[[Call], "Expr | tuple | str"]


def _k(x: Expr, v) -> Expr:
    """The number v as a constant of x's dtype."""
    return Expr.const(v, x.dtype)


def maximum(a: Expr, b: Expr) -> Expr:
    """NaN-propagating max, as torch.maximum and clamp."""
    return prim("max", a, b)


def minimum(a: Expr, b: Expr) -> Expr:
    return prim("min", a, b)
