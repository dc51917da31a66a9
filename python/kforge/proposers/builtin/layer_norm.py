"""aten::native_layer_norm: (out, mean, rstd) over the trailing normalized_shape dims.

The math and the kernels live in rownorm.py (shared with rms_norm); this module reads
the op's arguments. mean and rstd are written in the card's output dtypes (fp32 for
16-bit inputs on CUDA)."""

from __future__ import annotations

import math

from ...cards import Card, decode_value
from . import rownorm

OPS = frozenset({"aten::native_layer_norm.default"})


def _problem(card: Card) -> rownorm.RowNorm | str:
    if card.op not in OPS:
        return f"{card.op} is not native_layer_norm"
    a = {s.name: s for s in card.args}
    x = a["input"].tensor
    norm = decode_value(a["normalized_shape"].value)
    if len(card.outputs) != 3 or not norm or tuple(x.shape[len(x.shape) - len(norm):]) != tuple(norm):
        return "normalized_shape must name the input's trailing dims"
    weight = a["weight"].tensor if a["weight"].kind == "tensor" else None
    bias = a["bias"].tensor if a["bias"].kind == "tensor" else None
    cols = math.prod(norm)
    rn = rownorm.RowNorm(False, x, weight, bias, float(decode_value(a["eps"].value)), x.numel // max(cols, 1), cols,
                         1 if weight else None, (2 if weight else 1) if bias else None)
    return rownorm.checked(card, rn)


TEMPLATE = rownorm.template("layer_norm", OPS, _problem)
