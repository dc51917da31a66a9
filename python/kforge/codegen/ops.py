"""The one pointwise table: aten op -> IR expression (POINTWISE), or the reason it is not
generated (DECLINED). The reduction kinds and the reductions, normalizations, scans and
windows built on them are codegen.reductions; what an entry is given is codegen.call.

A POINTWISE entry is keyed by the op's packet name without a trailing underscore (`add`
serves add.Tensor, add.Scalar, add_.Tensor, add.out, ...) and maps a `Call` (the node's
arguments, bound by name) to an Expr in the op's compute dtype, or to a str saying why this
call is declined. Type promotion is eager's (torch._prims_common.elementwise_dtypes with
the op's promotion kind): operands are cast to the common dtype, then computed in its
opmath (float32 for float16/bfloat16), and the builder rounds once to the output dtype.
Formulas follow eager's CUDA kernels (aten/src/ATen/native/cuda/*.cu), edge values
included; tests/test_codegen.py checks them against eager on the CPU.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .call import ALWAYS_BOOL, BOOL_TO_LONG, DEFAULT, INT_TO_FLOAT, Call, Entry, _k, maximum, minimum
from .ir import FLOATS, Expr, eq, isnan, ne, opmath, prim, where


# ---- helpers the entries share ---------------------------------------------------------

def _unary(f: Callable[[Expr], Expr], kind=DEFAULT, floats_only: bool = False) -> Entry:
    def entry(c: Call):
        common, (x,) = c.promote(["self"], kind)
        if floats_only and x.dtype not in FLOATS:
            return f"{c.name} of {common} is not generated (eager computes it for floating dtypes)"
        return f(x)
    return entry


def _binary(f: Callable[[Expr, Expr], Expr], a: str = "self", b: str = "other", kind=DEFAULT,
            dtypes: str = "any") -> Entry:
    def entry(c: Call):
        common, (x, y) = c.promote([a, b], kind)
        if dtypes == "float" and x.dtype not in FLOATS:
            return f"{c.name} of {common} is not generated"
        if dtypes == "int" and x.dtype in FLOATS:
            return f"{c.name} needs integer or bool operands, got {common}"
        return f(x, y)
    return entry


def _sigmoid(x: Expr) -> Expr:
    return 1.0 / (1.0 + prim("exp", -x))


def _gelu(x: Expr, approximate: str) -> Expr:
    if approximate == "tanh":
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + prim("tanh", inner))
    return x * 0.5 * (1.0 + prim("erf", x * 0.7071067811865476))


def _softplus(c: Call):
    _, (x,) = c.promote(["self"])
    beta, threshold = c.s("beta", 1), c.s("threshold", 20)
    bx = x * beta
    return where(bx > threshold, x, prim("log1p", prim("exp", bx)) / beta)


def _elu(c: Call, alpha=None, scale=None, input_scale=None):
    _, (x,) = c.promote(["self"])
    alpha = c.s("alpha", 1.0) if alpha is None else alpha
    scale = c.s("scale", 1.0) if scale is None else scale
    input_scale = c.s("input_scale", 1.0) if input_scale is None else input_scale
    neg = prim("expm1", x * input_scale) * (alpha * scale)
    return where(x > 0, x * scale, neg)


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _clamp(c: Call):
    lo, hi = c.v("min"), c.v("max")
    names = ["self"] + [n for n, v in (("min", lo), ("max", hi)) if v is not None]
    if len(names) == 1:
        return "clamp needs min or max"
    _, vals = c.promote(names)
    x = vals[0]
    bounds = dict(zip(names[1:], vals[1:]))
    if x.dtype in FLOATS:  # NaN in x stays NaN; a NaN bound gives NaN (eager's clamp)
        if "min" in bounds:
            x = maximum(x, bounds["min"])
        if "max" in bounds:
            x = minimum(x, bounds["max"])
        return x
    if "min" in bounds:
        x = where(x < bounds["min"], bounds["min"], x)
    if "max" in bounds:
        x = where(x > bounds["max"], bounds["max"], x)
    return x


def _clamp_side(side: str) -> Entry:
    def entry(c: Call):
        values = dict(c.values)
        values[side] = values.pop(side)
        return _clamp(Call(c.name, c.overload, values))
    return entry


def _hardtanh(c: Call):
    _, (x,) = c.promote(["self"])
    lo, hi = c.s("min_val", -1), c.s("max_val", 1)
    return minimum(maximum(x, _k(x, lo)), _k(x, hi)) if x.dtype in FLOATS else \
        where(x < lo, _k(x, lo), where(x > hi, _k(x, hi), x))


def _round(c: Call):
    common, (x,) = c.promote(["self"])
    if x.dtype not in FLOATS:
        return x
    d = c.s("decimals", 0)
    if d == 0:
        return prim("rint", x)
    # eager: neg_flag = decimals < 0; ten_pow = 10**|decimals|; rint(x * ten_pow) / ten_pow (or / and *),
    # all in the tensor's own dtype: for float16/bfloat16, ten_pow and the scaled value are rounded
    # to it (3.496 rounds to 3.5 in bf16, and rint(3.5) = 4 where fp32 would give 3)
    dt = getattr(torch, common)
    ten = float(torch.tensor(10.0, dtype=torch.float64).pow(abs(d)).to(dt).double())  # inf past the dtype's range
    scaled = x / ten if d < 0 else x * ten
    if common in ("float16", "bfloat16"):
        scaled = scaled.cast(common)
    return prim("rint", scaled) * ten if d < 0 else prim("rint", scaled) / ten


def _div(c: Call):
    mode = c.s("rounding_mode")
    if mode is None:
        _, (a, b) = c.promote(["self", "other"], INT_TO_FLOAT)
        if not c.v("other").is_tensor and a.dtype == "float32":  # eager multiplies by the reciprocal of a scalar
            return a * Expr.const(float(torch.tensor(1.0, dtype=torch.float64) / c.v("other").number), "float32")
        return a / b
    _, (a, b) = c.promote(["self", "other"])
    if mode == "trunc":
        if a.dtype in FLOATS:
            return prim("trunc", a / b)
        return a / b  # C division truncates
    if mode != "floor":
        return f"div rounding_mode={mode!r} is not one of None, 'trunc', 'floor'"
    if a.dtype in FLOATS:  # c10::div_floor_floating
        mod = prim("fmod", a, b)
        div = (a - mod) / b
        div = where((ne(mod, 0)) & (ne(b < 0, mod < 0)), div - 1.0, div)
        fl = prim("floor", div)
        fl = where((div - fl) > 0.5, fl + 1.0, fl)
        res = where(ne(div, 0), fl, prim("copysign", _k(a, 0), a / b))
        return where(eq(b, 0), a / b, res)
    if a.dtype == "bool":
        return "div floor of bool is not generated"
    q, r = a / b, prim("mod", a, b)  # c10::div_floor_integer
    return where(ne(a < 0, b < 0) & ne(r, 0), q - 1, q)


def _remainder(c: Call):
    _, (a, b) = c.promote(["self", "other"])
    if a.dtype in FLOATS:
        m = prim("fmod", a, b)
        return where(ne(m, 0) & ne(b < 0, m < 0), m + b, m)
    if a.dtype == "bool":
        return "remainder of bool is not generated"
    r = prim("mod", a, b)
    return where(ne(r, 0) & ne(r < 0, b < 0), r + b, r)


def _fmod(c: Call):
    _, (a, b) = c.promote(["self", "other"])
    if a.dtype == "bool":
        return "fmod of bool is not generated"
    return prim("fmod", a, b) if a.dtype in FLOATS else prim("mod", a, b)


def _ipow(a: Expr, n: int) -> Expr:
    out, base = _k(a, 1), a
    while n:
        if n & 1:
            out = out * base
        base, n = base * base, n >> 1
    return out


def _pow(c: Call):
    base_name = "self"
    exp_name = "exponent"
    common, (a, b) = c.promote([base_name, exp_name])
    e = c.v(exp_name)
    if a.dtype == "bool":
        return "pow of bool is not generated"
    if a.dtype in FLOATS:
        if not e.is_tensor and c.v(base_name).is_tensor:  # pow_tensor_scalar_kernel_impl
            # eager takes the exponent in the tensor's dtype (rounded for fp16/bf16)
            n = float(torch.tensor(float(e.number), dtype=getattr(torch, common)))
            b = Expr.const(n, a.dtype)
            special = {0.5: lambda: prim("sqrt", a), 2.0: lambda: a * a, 3.0: lambda: a * a * a,
                       -0.5: lambda: prim("rsqrt", a), -1.0: lambda: 1.0 / a, -2.0: lambda: 1.0 / (a * a)}
            if n in special:
                return special[n]()
        return prim("pow", a, b)
    if not e.is_tensor:
        n = int(e.number)
        if n < 0:
            return "integer pow with a negative scalar exponent raises in eager"
        return _ipow(a, n) if n < 64 else "integer pow with a scalar exponent >= 64 is not generated"
    return "integer pow with a tensor exponent is not generated (a loop per element)"


def _shift(left: bool) -> Entry:
    def entry(c: Call):
        common, (a, b) = c.promote(["self", "other"])
        if a.dtype in FLOATS or a.dtype == "bool":
            return f"shift of {common} is not generated"
        bits = torch.iinfo(getattr(torch, common)).bits
        big = (b < 0) | (b >= bits)
        if left:
            return where(big, _k(a, 0), prim("shl", a, b))
        unsigned = common == "uint8"
        return where(big, _k(a, 0) if unsigned else where(a < 0, _k(a, -1), _k(a, 0)), prim("shr", a, b))
    return entry


def _logical(f) -> Entry:
    def entry(c: Call):
        names = ["self", "other"] if c.v("other") is not None else ["self"]
        vals = [c.v(n) for n in names]
        bools = [ne(x.at(x.dtype or "float32"), 0) if x.is_tensor else Expr.const(bool(x.number), "bool") for x in vals]
        return f(*bools)
    return entry


def _nan_to_num(c: Call):
    _, (x,) = c.promote(["self"])
    if x.dtype not in FLOATS:
        return x
    stored = c.v("self").dtype
    fi = torch.finfo(getattr(torch, stored))
    nan, pos, neg = c.s("nan", 0.0), c.s("posinf", fi.max), c.s("neginf", fi.min)
    inf = prim("isinf", x)
    return where(isnan(x), _k(x, nan), where(inf & (x > 0), _k(x, pos), where(inf & (x < 0), _k(x, neg), x)))


def _sign(x: Expr) -> Expr:
    if x.dtype == "bool":
        return x
    zero = _k(x, 0)  # (0 < x) - (x < 0): NaN gives 0, as eager
    return where(zero < x, _k(x, 1), zero) - where(x < zero, _k(x, 1), zero)


def _logit(c: Call):
    _, (x,) = c.promote(["self"], INT_TO_FLOAT)
    eps = c.s("eps")
    if eps is not None:
        x = where(x < eps, _k(x, eps), where(x > 1.0 - eps, _k(x, 1.0 - eps), x))
    return prim("log", x / (1.0 - x))


def _xlogy(log1p: bool) -> Entry:
    def entry(c: Call):
        _, (x, y) = c.promote(["self", "other"], INT_TO_FLOAT)
        ly = prim("log1p", y) if log1p else prim("log", y)
        return where(isnan(y), y, where(eq(x, 0), _k(x, 0), x * ly))
    return entry


def _lerp(c: Call):
    _, (a, b, w) = c.promote(["self", "end", "weight"])
    if a.dtype not in FLOATS:
        return "lerp of integers raises in eager"
    d = b - a  # eager: |w| < 0.5 ? a + w * (b - a) : b - (b - a) * (1 - w)
    return where(prim("abs", w) < 0.5, a + w * d, b - d * (1.0 - w))


def _addc(div: bool) -> Entry:
    def entry(c: Call):
        # `value` is not promoted with the tensors: eager converts it to their type, so an
        # integer addcmul truncates it (value=0.5 multiplies by 0).
        _, (s, t1, t2) = c.promote(["self", "tensor1", "tensor2"])
        value = c.s("value", 1)
        if s.dtype not in FLOATS:
            if div:
                return "addcdiv of integers raises in eager"
            value = int(value)
        term = t1 / t2 if div else t1 * t2
        return s + term * _k(term, value) if value != 1 else s + term
    return entry


def _where(c: Call):
    _, (a, b) = c.promote(["self", "other"])
    cond = c.v("condition")
    return where(cond.expr if cond.dtype == "bool" else ne(cond.at(cond.dtype), 0), a, b)


def _filled(c: Call) -> Expr:  # fill_, zero_ (0) and masked_fill's fill: the value cast to self's dtype
    v, stored = c.v("value") if "value" in c.values else None, c.v("self").dtype
    return v.at(stored) if v is not None and v.is_tensor else Expr.const(0 if v is None else v.number, opmath(stored)).cast(stored)


def _masked_fill(c: Call):
    return where(c.v("mask").expr, _filled(c), c.v("self").at(c.v("self").dtype))


def _gelu_backward(c: Call):
    _, (g, x) = c.promote(["grad_output", "self"])
    if c.s("approximate", "none") == "tanh":
        k_beta, k_kappa = 0.7978845608028654, 0.044715
        x_sq = x * x
        x_cube = x_sq * x
        inner = k_beta * (x + k_kappa * x_cube)
        t = prim("tanh", inner)
        left, right = 0.5 * x, 1.0 + t
        left_d, tanh_d = 0.5 * right, 1.0 - t * t
        inner_d = k_beta * (1.0 + 3.0 * k_kappa * x_sq)
        return g * (left_d + left * tanh_d * inner_d)
    cdf = 0.5 * (1.0 + prim("erf", x * 0.7071067811865476))
    pdf = (2.0 / math.sqrt(math.pi) * 0.7071067811865476 * 0.5) * prim("exp", x * x * -0.5)
    return g * (cdf + x * pdf)


def _heaviside(c: Call):
    common, (x, v) = c.promote(["self", "values"])
    if c.v("self").dtype != c.v("values").dtype:
        return "heaviside needs self and values of one dtype (eager raises otherwise)"
    return where(eq(x, 0), v, where(x > 0, _k(x, 1), _k(x, 0))) if x.dtype != "bool" else where(x, _k(x, 1), v)


def _logaddexp(base2: bool) -> Entry:
    def entry(c: Call):
        _, (a, b) = c.promote(["self", "other"], INT_TO_FLOAT)
        m, mn = maximum(a, b), minimum(a, b)
        both_inf = prim("isinf", a) & eq(a, b)
        if base2:
            tail = prim("log1p", prim("exp2", mn - m)) * (1.0 / math.log(2.0))
        else:
            tail = prim("log1p", prim("exp", mn - m))
        return where(both_inf, a, m + tail)
    return entry


def _bessel_i(name: str, x: Expr) -> Expr:
    """i0 and i1 as eager computes them: above |x| = 8 its series is multiplied by exp(|x|), so
    the result is ±inf once exp overflows (|x| >= 88.7228 in float32), where CUDA's
    cyl_bessel_i0f/i1f are still finite up to |x| ~ 91."""
    a = prim("abs", x)
    big = a > 709.782712893384 if x.dtype == "float64" else a >= 88.72283935546875  # exp(|x|) is inf
    inf = _k(x, math.inf)
    over = where(x < 0, -inf, inf) if name == "i1" else inf  # i1 is odd, i0 even
    # at ±inf eager's product is inf / inf: NaN
    return where(prim("isinf", x), _k(x, math.nan), where(big, over, prim(name, x)))


def _same(x: Expr) -> Expr:
    return x


POINTWISE: dict[str, Entry] = {
    # identities and copies
    "clone": _unary(_same), "positive": _unary(_same), "conj_physical": _unary(_same),
    "_to_copy": _unary(_same), "copy": lambda c: c.v("src").at(c.v("src").dtype),
    # a pad of zeros is a copy (timm's Swin pads its windows by 0 where they fit); a real one reads out of bounds
    "constant_pad_nd": lambda c: "a pad that pads or crops: not generated" if any(c.s("pad")) else c.v("self").at(c.v("self").dtype),
    # float maps (integers promote to float32)
    **{n: _unary(lambda x, n=n: prim(n, x), INT_TO_FLOAT) for n in (
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos", "tan", "asin",
        "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "erfinv", "lgamma")},
    "i0": _unary(lambda x: _bessel_i("i0", x), INT_TO_FLOAT),
    "special_i1": _unary(lambda x: _bessel_i("i1", x), INT_TO_FLOAT),
    "special_bessel_j0": _unary(lambda x: prim("j0", x), INT_TO_FLOAT),
    "special_bessel_j1": _unary(lambda x: prim("j1", x), INT_TO_FLOAT),
    "sigmoid": _unary(_sigmoid, INT_TO_FLOAT),
    "reciprocal": _unary(lambda x: 1.0 / x, INT_TO_FLOAT),
    "deg2rad": _unary(lambda x: x * (math.pi / 180.0), INT_TO_FLOAT),
    "rad2deg": _unary(lambda x: x * (180.0 / math.pi), INT_TO_FLOAT),
    "sinc": _unary(lambda x: where(eq(x, 0), _k(x, 1), prim("sin", x * math.pi) / (x * math.pi)), INT_TO_FLOAT),
    "angle": _unary(lambda x: where(isnan(x), x, where(x < 0, _k(x, math.pi), _k(x, 0))), INT_TO_FLOAT),
    "logit": _logit,
    "special_entr": _unary(lambda x: where(isnan(x), x, where(x > 0, -x * prim("log", x),
                                                              where(eq(x, 0), _k(x, 0), _k(x, -math.inf)))),
                           INT_TO_FLOAT),
    # same-dtype maps
    "neg": _unary(lambda x: -x),
    "abs": _unary(lambda x: prim("abs", x) if x.dtype != "bool" else x),
    "square": _unary(lambda x: x * x, BOOL_TO_LONG),
    "ceil": _unary(lambda x: prim("ceil", x) if x.dtype in FLOATS else x),
    "floor": _unary(lambda x: prim("floor", x) if x.dtype in FLOATS else x),
    "trunc": _unary(lambda x: prim("trunc", x) if x.dtype in FLOATS else x),
    "round": _round,
    "frac": _unary(lambda x: x - prim("trunc", x), floats_only=True),
    "sign": _unary(_sign), "sgn": _unary(_sign),
    "signbit": _unary(lambda x: prim("signbit", x) if x.dtype in FLOATS else x < 0, ALWAYS_BOOL),
    "isnan": _unary(isnan, ALWAYS_BOOL),
    "isinf": _unary(lambda x: prim("isinf", x) if x.dtype in FLOATS else Expr.const(False, "bool"), ALWAYS_BOOL),
    "isposinf": _unary(lambda x: prim("isinf", x) & (x > 0) if x.dtype in FLOATS else Expr.const(False, "bool"),
                       ALWAYS_BOOL),
    "isneginf": _unary(lambda x: prim("isinf", x) & (x < 0) if x.dtype in FLOATS else Expr.const(False, "bool"),
                       ALWAYS_BOOL),
    "isfinite": _unary(lambda x: ~(isnan(x) | prim("isinf", x)) if x.dtype in FLOATS else Expr.const(True, "bool"),
                       ALWAYS_BOOL),
    "nan_to_num": _nan_to_num,
    "bitwise_not": lambda c: (lambda x: ~x if x.dtype not in FLOATS else "bitwise_not of floats raises in eager")(
        c.promote(["self"])[1][0]),
    "logical_not": _logical(lambda a: ~a),
    # activations
    "relu": _unary(lambda x: where(x < 0, _k(x, 0), x) if x.dtype != "bool" else x),
    "relu6": _unary(lambda x: minimum(maximum(x, _k(x, 0)), _k(x, 6)), floats_only=True),
    "hardtanh": _hardtanh,
    "hardsigmoid": _unary(lambda x: minimum(maximum(x + 3.0, _k(x, 0)), _k(x, 6)) / 6.0, floats_only=True),
    "hardswish": _unary(lambda x: x * minimum(maximum(x + 3.0, _k(x, 0)), _k(x, 6)) / 6.0, floats_only=True),
    "hardshrink": lambda c: (lambda x, l: where((x >= -l) & (x <= l), _k(x, 0), x))(
        c.promote(["self"])[1][0], c.s("lambd", 0.5)),
    "softshrink": lambda c: (lambda x, l: where(x > l, x - l, where(x < -l, x + l, x * 0.0)))(
        c.promote(["self"])[1][0], c.s("lambd", 0.5)),
    "silu": _unary(lambda x: x / (1.0 + prim("exp", -x)), floats_only=True),
    "mish": _unary(lambda x: x * prim("tanh", prim("log1p", prim("exp", x))), floats_only=True),
    "gelu": lambda c: _gelu(c.promote(["self"])[1][0], c.s("approximate", "none"))
    if c.s("approximate", "none") in ("none", "tanh") else f"gelu approximate={c.s('approximate')!r}",
    "elu": _elu,
    "selu": lambda c: _elu(c, _SELU_ALPHA, _SELU_SCALE, 1.0),
    "celu": lambda c: _elu(c, c.s("alpha", 1.0), 1.0, 1.0 / c.s("alpha", 1.0)),
    "leaky_relu": lambda c: (lambda x: where(x > 0, x, x * c.s("negative_slope", 0.01)))(c.promote(["self"])[1][0]),
    "softplus": _softplus,
    "threshold": lambda c: (lambda x: where(x <= c.s("threshold"), _k(x, c.s("value")), x))(c.promote(["self"])[1][0]),
    "clamp": _clamp, "clip": _clamp, "clamp_min": _clamp_side("min"), "clamp_max": _clamp_side("max"),
    # binary arithmetic
    "add": lambda c: (lambda a, b: a + b * c.s("alpha", 1) if c.s("alpha", 1) != 1 else a + b)(*c.promote(["self", "other"])[1]),
    "sub": lambda c: (lambda a, b: a - b * c.s("alpha", 1) if c.s("alpha", 1) != 1 else a - b)(*c.promote(["self", "other"])[1]),
    "rsub": lambda c: (lambda a, b: b - a * c.s("alpha", 1) if c.s("alpha", 1) != 1 else b - a)(*c.promote(["self", "other"])[1]),
    "mul": _binary(lambda a, b: a * b if a.dtype != "bool" else a & b),
    "div": _div, "true_divide": _div,
    "remainder": _remainder, "fmod": _fmod,
    "pow": _pow,
    "atan2": _binary(lambda a, b: prim("atan2", a, b), kind=INT_TO_FLOAT),
    "hypot": _binary(lambda a, b: prim("hypot", a, b), dtypes="float"),
    "copysign": _binary(lambda a, b: prim("copysign", a, b), kind=INT_TO_FLOAT),
    "nextafter": _binary(lambda a, b: prim("nextafter", a, b), dtypes="float"),
    "fmax": _binary(lambda a, b: prim("fmax", a, b) if a.dtype in FLOATS else prim("max", a, b)),
    "fmin": _binary(lambda a, b: prim("fmin", a, b) if a.dtype in FLOATS else prim("min", a, b)),
    "maximum": _binary(maximum), "minimum": _binary(minimum),
    "max": _binary(maximum), "min": _binary(minimum),  # max.other / min.other
    "xlogy": _xlogy(False), "special_xlog1py": _xlogy(True),
    "logaddexp": _logaddexp(False), "logaddexp2": _logaddexp(True),
    "heaviside": _heaviside,
    "ldexp": _binary(lambda a, b: a * prim("exp2", b), kind=INT_TO_FLOAT),
    **{n: _binary(lambda a, b, n=n: prim(n, a, b), kind=ALWAYS_BOOL) for n in ("eq", "ne", "lt", "le", "gt", "ge")},
    "logical_and": _logical(lambda a, b: a & b), "logical_or": _logical(lambda a, b: a | b),
    "logical_xor": _logical(lambda a, b: ne(a, b)),
    **{n: _binary(lambda a, b, p=p: prim(p, a, b), dtypes="int") for n, p in (
        ("bitwise_and", "and"), ("bitwise_or", "or"), ("bitwise_xor", "xor"), ("__xor__", "xor"),
        ("__ixor__", "xor"), ("__and__", "and"), ("__or__", "or"))},
    "bitwise_left_shift": _shift(True), "__lshift__": _shift(True), "__ilshift__": _shift(True),
    "bitwise_right_shift": _shift(False), "__rshift__": _shift(False), "__irshift__": _shift(False),
    # ternary and masked
    "lerp": _lerp, "addcmul": _addc(False), "addcdiv": _addc(True),
    "where": _where, "masked_fill": _masked_fill, "fill": _filled, "zero": _filled,
    # backward maps
    "gelu_backward": _gelu_backward,
    "sigmoid_backward": _binary(lambda g, y: g * (1.0 - y) * y, "grad_output", "output"),
    "tanh_backward": _binary(lambda g, y: g * (1.0 - y * y), "grad_output", "output"),
    "silu_backward": _binary(lambda g, x: (lambda s: g * s * (1.0 + x * (1.0 - s)))(_sigmoid(x)),
                             "grad_output", "self"),
    "threshold_backward": lambda c: (lambda g, x: where(x <= c.s("threshold"), _k(g, 0), g))(
        *c.promote(["grad_output", "self"])[1]),
    "logit_backward": lambda c: (lambda g, x, eps: where((x < eps) | (x > 1.0 - eps), _k(x, 0), g / (x * (1.0 - x)))
                                 if eps is not None else where((x < 0) | (x > 1), _k(x, math.nan), g / (x * (1.0 - x))))(
        *c.promote(["grad_output", "self"])[1], c.s("eps")),
    "native_dropout_backward": lambda c: (lambda g: g * where(c.v("mask").expr, _k(g, c.s("scale")), _k(g, 0)))(
        c.v("grad_output").at(c.v("grad_output").dtype)),
}

# Tagged pointwise by torch, not generated, and why (printed by the tests: it must not grow silently).
DECLINED: dict[str, str] = {
    "digamma": "no CUDA math builtin (eager's own series)",
    "special_i0e": "no CUDA math builtin (eager's Chebyshev series; i0(x)*exp(-|x|) overflows)",
    "special_i1e": "no CUDA math builtin (eager's Chebyshev series; i1(x)*exp(-|x|) overflows)",
    "frexp": "two outputs of different dtypes from one libm call: not in the IR yet",
    "float_power": "computes in float64 and casts in place; rare",
    "gcd": "a data-dependent loop per element", "lcm": "a data-dependent loop per element",
    "igamma": "incomplete gamma series has no CUDA math builtin", "igammac": "incomplete gamma series has no CUDA math builtin",
    "polygamma": "series per order n has no CUDA math builtin", "mvlgamma": "a sum of lgamma over p terms; rare",
    "special_zeta": "Hurwitz zeta series has no CUDA math builtin",
    "special_airy_ai": "no CUDA math builtin", "special_bessel_y0": "y0 differs from eager's Cephes port at edges",
    "special_bessel_y1": "y1 differs from eager's Cephes port at edges",
    "special_erfcx": "no CUDA math builtin (eager's own rational approximation)",
    "special_log_ndtr": "eager's piecewise asymptotic series", "special_ndtri": "eager's Cephes rational approximation",
    **{f"special_{k}": "a polynomial recurrence with a data-dependent degree" for k in (
        "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
        "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
        "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
        "legendre_polynomial_p")},
    **{f"special_{k}": "no CUDA math builtin (eager's Cephes port)" for k in (
        "modified_bessel_i0", "modified_bessel_i1", "modified_bessel_k0", "modified_bessel_k1",
        "scaled_modified_bessel_k0", "scaled_modified_bessel_k1", "spherical_bessel_j0")},
}
