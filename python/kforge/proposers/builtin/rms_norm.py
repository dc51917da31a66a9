"""aten::_fused_rms_norm: (out, rstd) over the trailing normalized_shape dims.

Torch's schema: _fused_rms_norm(Tensor input, int[] normalized_shape, Tensor? weight,
float? eps) -> (Tensor, Tensor). With eps None torch uses the fp32 machine epsilon (the
opmath type's). Kernels live in rownorm.py; on a torch without the op, every card is
declined."""

from __future__ import annotations

import math

import torch

from ...cards import Card, decode_value
from . import rownorm

OPS = frozenset({"aten::_fused_rms_norm.default"})
FP32_EPS = float(torch.finfo(torch.float32).eps)


def _problem(card: Card) -> rownorm.RowNorm | str:
    if card.op not in OPS:
        return f"{card.op} is not _fused_rms_norm"
    if not hasattr(torch.ops.aten, "_fused_rms_norm"):
        return f"torch {torch.__version__} has no aten::_fused_rms_norm"
    a = {s.name: s for s in card.args}
    x = a["input"].tensor
    norm = decode_value(a["normalized_shape"].value)
    if len(card.outputs) != 2 or not norm or tuple(x.shape[len(x.shape) - len(norm):]) != tuple(norm):
        return "normalized_shape must name the input's trailing dims"
    weight = a["weight"].tensor if a["weight"].kind == "tensor" else None
    eps = decode_value(a["eps"].value) if "eps" in a else None
    cols = math.prod(norm)
    rn = rownorm.RowNorm(True, x, weight, None, FP32_EPS if eps is None else float(eps), x.numel // max(cols, 1), cols,
                         1 if weight else None, None)
    return rownorm.checked(card, rn)


TEMPLATE = rownorm.template("rms_norm", OPS, _problem)
