"""What an operator call computes, as PyTorch code a model can read.

`reference_code` is the call itself (`out0, out1, out2 = torch.ops.aten.native_layer_norm...`),
which says nothing of what out1 and out2 are. For the composite and multi-output ops kforge
writes kernels for, `decomposed` spells the computation out step by step in plain PyTorch,
over the same names (in0.., out0..) and with the card's own values, including the dtype
each step runs in; other ops with several outputs get the schema's names for them.
The tests run every decomposition against the op itself.
"""

from __future__ import annotations

from typing import Any, Callable

from ...cards import Card, decode_value
from ...errors import CardError


def arg_exprs(card: Card) -> list[tuple[str, str, Any]]:
    """(schema name, expression, decoded value or None) per argument: tensors are in0.., in the
    launch plan's order; values are Python literals."""
    it = iter(range(len(card.inputs)))
    out = []
    for a in card.args:
        if a.kind == "tensor":
            out.append((a.name, f"in{next(it)}", None))
        elif a.kind == "tensors":
            out.append((a.name, "[" + ", ".join(f"in{next(it)}" if m is not None else "None" for m in a.tensors) + "]",
                        None))
        else:
            v = decode_value(a.value, card.device_type)
            out.append((a.name, repr(v), v))
    return out


def reference_code(card: Card) -> str:
    """The call as PyTorch code, tensors named in0.. and out0.. like the launch plan; a
    region card's is a function of its aten calls, returning out0.. in order."""
    if card.region is not None:
        return card.region.code(card.inputs)
    args = [f"{name}={expr}" if a.kwarg_only else expr for a, (name, expr, _) in zip(card.args, arg_exprs(card))]
    outs = ", ".join(f"out{j}" for j in range(len(card.outputs))) or "_"
    return f"{outs} = torch.ops.{card.op.replace('::', '.')}({', '.join(args)})"


def decomposed(card: Card) -> list[str]:
    """The call step by step (lines of PyTorch), or the outputs' names; [] when the call
    says it all."""
    if card.region is not None:  # its code is already step by step
        return []
    build = _DECOMPOSED.get(card.op)
    try:
        if build is not None:
            return build(_Call(card))
        names = [r.name for r in card.overload()._schema.returns] if len(card.outputs) > 1 else []
    except (KeyError, CardError):  # a card from a torch whose schema differs: the call alone says it
        return []
    return [f"# {', '.join(f'out{j} = {n}' for j, n in enumerate(names))}"] if names and all(names) else []


class _Call:
    """An argument's expression (`c.x("eps")`) or value (`c.v("eps")`) by schema name, and the
    outputs' dtypes."""

    def __init__(self, card: Card):
        self.card = card
        self._args = {name: (expr, value) for name, expr, value in arg_exprs(card)}
        self._dtypes = {a.name: a.tensor.dtype for a in card.args if a.kind == "tensor"}

    def x(self, name: str) -> str:
        return self._args[name][0]

    def up(self, name: str) -> str:
        """The tensor argument in the precision PyTorch computes in: float32 (float64 stays)."""
        return f"{self.x(name)}.{'double' if self._dtypes.get(name) == 'float64' else 'float'}()"

    def v(self, name: str) -> Any:
        return self._args[name][1]

    def has(self, name: str) -> bool:
        return name in self._args

    def given(self, name: str) -> bool:
        return self._args[name][0] != "None"

    def out(self, j: int) -> str:
        return f"torch.{self.card.outputs[j].dtype}"

    def ndim(self) -> int:
        return len(self.card.inputs[0].shape)


def _affine(c: _Call, shape: str = "") -> list[str]:
    lines = []
    if c.given("weight"):
        lines.append(f"y = y * {c.up('weight')}{shape}")
    if c.given("bias"):
        lines.append(f"y = y + {c.up('bias')}{shape}")
    return lines


def _layer_norm(c: _Call) -> list[str]:
    dims = tuple(range(-len(c.v("normalized_shape")), 0))
    return ["# out0 = normalized input, out1 = mean, out2 = rstd = 1/sqrt(biased var + eps), over the last "
            f"{len(dims)} dim(s), statistics in float32",
            f"x = {c.up('input')}",
            f"mean = x.mean(dim={dims}, keepdim=True)",
            f"rstd = torch.rsqrt(x.var(dim={dims}, unbiased=False, keepdim=True) + {c.x('eps')})",
            "y = (x - mean) * rstd", *_affine(c),
            f"out0, out1, out2 = y.to({c.out(0)}), mean.to({c.out(1)}), rstd.to({c.out(2)})"]


def _group_norm(c: _Call) -> list[str]:
    n, ch, group = c.x("N"), c.x("C"), c.x("group")
    return ["# out0 = normalized input, out1 = mean, out2 = rstd = 1/sqrt(biased var + eps), each of shape "
            "[N, group], over the C/group channels x HxW elements of a group, statistics in float32",
            f"x = {c.up('input')}.reshape({n}, {group}, -1)",
            "mean = x.mean(-1)",
            f"rstd = torch.rsqrt(x.var(-1, unbiased=False) + {c.x('eps')})",
            f"y = ((x - mean[..., None]) * rstd[..., None]).reshape({n}, {ch}, -1)", *_affine(c, "[None, :, None]"),
            f"out0 = y.reshape({list(c.card.inputs[0].shape)}).to({c.out(0)})",
            f"out1, out2 = mean.to({c.out(1)}), rstd.to({c.out(2)})"]


def _rms_norm(c: _Call) -> list[str]:
    dims = tuple(range(-len(c.v("normalized_shape")), 0))
    eps = c.x("eps") if c.v("eps") is not None else f"torch.finfo({c.x('input')}.dtype).eps"
    lines = ["# out0 = input * rstd * weight, out1 = rstd = 1/sqrt(mean(x^2) + eps) over the last "
             f"{len(dims)} dim(s), in float32",
             f"x = {c.up('input')}",
             f"rstd = torch.rsqrt(x.pow(2).mean(dim={dims}, keepdim=True) + {eps})",
             "y = x * rstd"]
    if c.given("weight"):
        lines.append(f"y = y * {c.up('weight')}")
    return lines + [f"out0, out1 = y.to({c.out(0)}), rstd.to({c.out(1)})"]


def _softmax(log: bool, safe: bool = False) -> Callable[[_Call], list[str]]:
    def build(c: _Call) -> list[str]:
        dim = c.x("dim")
        cast = c.v("dtype") if c.has("dtype") else None  # softmax(x, dtype=...) casts the input first
        x = f"{c.x('self')}.to({cast!r}).float()" if cast is not None else c.up("self")
        lines = [f"x = {x}  # computed in float32 (float64 stays), written as {c.card.outputs[0].dtype}",
                 f"m = x.amax({dim}, keepdim=True)"]
        if log:
            lines.append(f"y = x - m - (x - m).exp().sum({dim}, keepdim=True).log()")
        else:
            lines += ["e = (x - m).exp()", f"y = e / e.sum({dim}, keepdim=True)"]
        if safe:
            lines.append("y = torch.where(m == float('-inf'), 0.0, y)  # a row of -inf gives zeros, not NaN")
        return lines + [f"out0 = y.to({c.out(0)})"]

    return build


def _var_mean(std: bool) -> Callable[[_Call], list[str]]:
    def build(c: _Call) -> list[str]:
        dim = c.x("dim") if c.v("dim") is not None else f"{tuple(range(c.ndim()))}"
        correction = c.v("correction") if c.v("correction") is not None else 1
        what = "std" if std else "var"
        return [f"# out0 = {what}, out1 = mean, over dim(s) {dim}",
                f"x = {c.up('self')}",
                f"v = x.var(dim={dim}, correction={correction!r}, keepdim={c.x('keepdim')})",
                f"out0 = {'v.sqrt()' if std else 'v'}.to({c.out(0)})",
                f"out1 = x.mean(dim={dim}, keepdim={c.x('keepdim')}).to({c.out(1)})"]

    return build


def _max_pool_indices(c: _Call) -> list[str]:
    return ["# out0 = the maximum of each window, out1 = where it is: the int64 index h * W + w into the "
            "input's H x W plane of that (n, c)"]


_DECOMPOSED: dict[str, Callable[[_Call], list[str]]] = {
    "aten::native_layer_norm.default": _layer_norm,
    "aten::native_group_norm.default": _group_norm,
    "aten::_fused_rms_norm.default": _rms_norm,
    "aten::_softmax.default": _softmax(log=False),
    "aten::_log_softmax.default": _softmax(log=True),
    "aten::softmax.int": _softmax(log=False),
    "aten::log_softmax.int": _softmax(log=True),
    "aten::_safe_softmax.default": _softmax(log=False, safe=True),
    "aten::var_mean.correction": _var_mean(std=False),
    "aten::std_mean.correction": _var_mean(std=True),
    "aten::max_pool2d_with_indices.default": _max_pool_indices,
}
