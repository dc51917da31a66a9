"""The reduction kinds (REDUCTIONS) and the aten ops built on them: reductions over any set of
dims (REDUCTION_OPS, each giving a ReductionPlan), normalizations (NORM_OPS), scans (SCAN_OPS)
and windowed reductions (WINDOW_OPS: pooling). An entry takes a codegen.call.Call, like the
pointwise table's (codegen.ops)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from .call import INT_TO_FLOAT, Call, Val, _k, maximum, minimum
from .ir import FLOATS, INTS, Expr, ReductionKind, eq, isnan, ne, opmath, prim, where
from .views import lead_stripped


# ---- reductions ------------------------------------------------------------------------

def _sum_kind(name: str, combine, ident) -> ReductionKind:
    return ReductionKind(name, lambda d: (d,), lambda d: (ident(d),), lambda x, r: (x,),
                         lambda a, b: (combine(a[0], b[0]),))


def _min_value(d: str):
    return -math.inf if d in FLOATS else (False if d == "bool" else torch.iinfo(getattr(torch, d)).min)


def _max_value(d: str):
    return math.inf if d in FLOATS else (True if d == "bool" else torch.iinfo(getattr(torch, d)).max)


def _arg_kind(name: str, greater: bool) -> ReductionKind:
    """(value, index): NaN wins (eager's max/argmax propagate it), ties go to the lower index."""
    def better(a, b):
        av, ai, bv, bi = a[0], a[1], b[0], b[1]
        beats = (av > bv) if greater else (av < bv)
        nan_a, nan_b = isnan(av), isnan(bv)
        tie = eq(av, bv) | (nan_a & nan_b)
        return beats | (nan_a & ~nan_b) | (tie & (ai < bi))

    def merge(a, b):
        w = better(a, b)
        return (where(w, a[0], b[0]), where(w, a[1], b[1]))
    return ReductionKind(name, lambda d: (d, "int64"),
                         lambda d: ((_min_value if greater else _max_value)(d), 2**63 - 1),
                         lambda x, r: (x, r), merge)


NO_INDEX = 2**63 - 1  # the index of a fold that has taken no element


def _pool_max_kind() -> ReductionKind:
    """Max pooling's (value, index) as eager's pooling kernels fold a window, in order, one point
    at a time: a point is taken where it is greater or NaN (the last NaN's index, where torch.max
    keeps the first), ties keep the first, and the first point's index is taken whatever its value
    (a window all -inf gives its first point). Windows only: a thread folds its window in order,
    so the merge is never asked to combine two partial folds. Cheaper than argmax's merge too:
    a compare and a NaN test a point, where argmax's tie-break by index costs a dozen ops."""
    def merge(a, b):
        take = (b[0] > a[0]) | isnan(b[0])
        return (where(take, b[0], a[0]), where(take | eq(a[1], Expr.const(NO_INDEX, "int64")), b[1], a[1]))
    return ReductionKind("pool_max", lambda d: (d, "int64"), lambda d: (_min_value(d), NO_INDEX),
                         lambda x, r: (x, r), merge)


def _welford_merge(a, b):
    n = a[0] + b[0]
    d = b[1] - a[1]
    wb = where(eq(n, 0), _k(n, 0), b[0] / n)
    return (n, a[1] + d * wb, a[2] + b[2] + d * d * a[0] * wb)


def _welford_chunk(xs):
    """(count, mean, sum of squared deviations) of a vector's elements: its mean by one multiply
    (vector widths are powers of two, so 1 / n is exact), its deviations from that mean."""
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    mean = total * _k(total, 1.0 / len(xs))
    m2 = (xs[0] - mean) * (xs[0] - mean)
    for x in xs[1:]:
        m2 = m2 + (x - mean) * (x - mean)
    return (_k(total, len(xs)), mean, m2)


def _lse_merge(a, b):
    """(max, sum of exp(x - max)): the online logsumexp state. One exp per merge (the smaller
    max's sum is scaled by exp(-|a - b|)); equal maxima (both -inf or +inf too) add."""
    m = maximum(a[0], b[0])
    e = prim("exp", -prim("abs", a[0] - b[0]))
    s = where(eq(a[0], b[0]), a[1] + b[1], where(a[0] > b[0], a[1] + b[1] * e, a[1] * e + b[1]))
    return (m, s)


REDUCTIONS: dict[str, ReductionKind] = {
    "sum": _sum_kind("sum", lambda a, b: a + b, lambda d: 0),
    "prod": _sum_kind("prod", lambda a, b: a * b, lambda d: 1),
    "max": _sum_kind("max", maximum, _min_value),
    "min": _sum_kind("min", minimum, _max_value),
    "any": _sum_kind("any", lambda a, b: a | b, lambda d: False),
    "all": _sum_kind("all", lambda a, b: a & b, lambda d: True),
    "argmax": _arg_kind("argmax", True),
    "argmin": _arg_kind("argmin", False),
    "pool_max": _pool_max_kind(),
    "welford": ReductionKind("welford", lambda d: (d, d, d), lambda d: (0.0, 0.0, 0.0),
                             lambda x, r: (_k(x, 1), x, _k(x, 0)), _welford_merge, chunk=_welford_chunk),
    "logsumexp": ReductionKind("logsumexp", lambda d: (d, d), lambda d: (-math.inf, 0.0),
                               lambda x, r: (x, _k(x, 1)), _lse_merge),
}
# Staged, max first, then the sum of exp(x - max), an element equal to the max counting 1 as the
# online merge counts it (so rows of -inf, or with +inf, fold to the same state).
REDUCTIONS["logsumexp"] = replace(REDUCTIONS["logsumexp"], phases=(
    (REDUCTIONS["max"], lambda x, s: x),
    (REDUCTIONS["sum"], lambda x, s: where(eq(x, s[0]), _k(x, 1), prim("exp", x - s[0])))))


@dataclass
class ReductionPlan:
    """What an aten reduction call folds, over which dims, and each output from the state."""

    kind: str
    operand: Expr  # the prologue
    dims: tuple[int, ...]  # normalized, of the operand's shape
    keepdim: bool
    outputs: Callable[[tuple[Expr, ...], int], list[Expr]]  # (state refs, count) -> per output
    # (dim, groups): the operand's dim is split into (groups, size // groups) and `dims` are
    # dims of that split shape (group norm: its statistics are per (sample, group))
    split: tuple[int, int] | None = None


def broadcastable(plan: ReductionPlan, ndim: int) -> ReductionPlan:
    """`plan` as keepdim where it folds every dim of an `ndim`-dim operand: its 0-dim result then
    broadcasts over them all as a keepdim result does (x / x.norm(), x - x.mean())."""
    whole = not plan.keepdim and plan.split is None and set(plan.dims) == set(range(ndim))
    return replace(plan, keepdim=True) if whole else plan


def folds_one(args: dict, src, out) -> bool:
    """Whether a reduction node (its args; operand and output metas) folds one element per output:
    every dim it names (all where it names none) of size 1, its output the operand's trailing dims
    as values before it are (keepdim, or only leading dims dropped). Known before its plan, so that
    its loads keep the phase they are read in."""
    d, nd = args.get("dim"), len(src.shape)
    dims = range(nd) if d is None or d == [] else ([d] if isinstance(d, int) else d)
    return all(src.shape[x % nd] == 1 for x in dims) and lead_stripped(out.shape) == lead_stripped(src.shape)


def _dims(c: Call, ndim: int, name: str = "dim") -> tuple[int, ...]:
    d = c.s(name)
    if d is None or d == []:
        return tuple(range(ndim))
    d = [d] if isinstance(d, int) else list(d)
    return tuple(sorted({x % max(ndim, 1) for x in d})) if ndim else ()


def _acc(stored: str, kind: str) -> str:
    if kind in ("sum", "prod"):
        return "int64" if stored in INTS + ("bool",) else ("float64" if stored == "float64" else "float32")
    return opmath(stored)


def _reduce_sum(kind: str, mean: bool = False) -> Callable:
    def entry(c: Call):
        x = c.v("self")
        acc = _acc(x.dtype, kind)
        dt = c.s("dtype")
        if dt is not None:
            acc = _acc(str(dt).removeprefix("torch."), kind)
        if mean and acc not in FLOATS:
            return "mean of integers raises in eager"
        op = x.at(x.dtype).cast(acc)
        return ReductionPlan(kind, op, _dims(c, x.ndim), bool(c.s("keepdim", False)),
                             lambda s, n: [s[0] / float(n) if mean else s[0]])
    return entry


def _reduce_ext(kind: str) -> Callable:  # amax/amin, max.default/min.default
    def entry(c: Call):
        x = c.v("self")
        return ReductionPlan(kind, x.at(x.dtype), _dims(c, c.v("self").ndim), bool(c.s("keepdim", False)),
                             lambda s, n: [s[0]])
    return entry


def _reduce_arg(kind: str, values: bool) -> Callable:  # argmax/argmin, max.dim/min.dim
    def entry(c: Call):
        x = c.v("self")
        d = c.s("dim")
        ndim = c.v("self").ndim
        dims = tuple(range(ndim)) if d is None else ((d % max(ndim, 1),) if ndim else ())
        outs = (lambda s, n: [s[0], s[1]]) if values else (lambda s, n: [s[1]])
        return ReductionPlan(kind, x.at(x.dtype), dims, bool(c.s("keepdim", False)), outs)
    return entry


def _reduce_bool(kind: str) -> Callable:
    def entry(c: Call):
        x = c.v("self")
        e = x.at(x.dtype)
        return ReductionPlan(kind, e if e.dtype == "bool" else ne(e, 0), _dims(c, c.v("self").ndim),
                             bool(c.s("keepdim", False)), lambda s, n: [s[0]])
    return entry


def _reduce_var(std: bool, with_mean: bool) -> Callable:
    def entry(c: Call):
        x = c.v("self")
        if x.dtype not in FLOATS:
            return "var/std of integers raises in eager"
        corr = c.s("correction", 1)
        if "unbiased" in c.values:
            corr = 1 if c.s("unbiased", True) else 0

        def outs(s, n):
            dof = max(0.0, float(n - corr))
            v = s[2] / dof if dof > 0 else s[2] * math.inf  # eager: NaN for 0/0, inf beyond
            v = prim("sqrt", v) if std else v
            return [v, s[1]] if with_mean else [v]
        return ReductionPlan("welford", x.at(x.dtype), _dims(c, c.v("self").ndim), bool(c.s("keepdim", False)), outs)
    return entry


def _logsumexp(c: Call):
    _, (e,) = c.promote(["self"], INT_TO_FLOAT)

    def outs(s, n):  # all -inf: max is -inf and the sum 0; +inf: max is inf and the sum NaN
        m = s[0]
        return [where(prim("isinf", m), m, m + prim("log", s[1]))]
    return ReductionPlan("logsumexp", e, _dims(c, c.v("self").ndim), bool(c.s("keepdim", False)), outs)


def _vector_norm(c: Call):
    x = c.v("self")
    if x.dtype not in FLOATS:
        return "vector_norm of integers raises in eager"
    ordv = float(c.s("ord", c.s("p", 2.0)))
    dt = c.s("dtype")
    e = x.at(x.dtype)
    if dt is not None:
        e = e.cast(opmath(str(dt).removeprefix("torch.")))
    a = prim("abs", e)
    dims = _dims(c, c.v("self").ndim)
    keep = bool(c.s("keepdim", False))
    if math.isinf(ordv):
        return ReductionPlan("max" if ordv > 0 else "min", a, dims, keep, lambda s, n: [s[0]])
    if ordv == 0:
        return ReductionPlan("sum", ne(e, 0).cast(e.dtype), dims, keep, lambda s, n: [s[0]])
    if ordv == 1:
        return ReductionPlan("sum", a, dims, keep, lambda s, n: [s[0]])
    if ordv == 2:
        return ReductionPlan("sum", e * e, dims, keep, lambda s, n: [prim("sqrt", s[0])])
    return ReductionPlan("sum", prim("pow", a, _k(a, ordv)), dims, keep,
                         lambda s, n: [prim("pow", s[0], _k(s[0], 1.0 / ordv))])


def _loss(name: str, term: Callable[[Call, Expr], Expr]) -> Callable:
    """A pointwise loss of (self - target) reduced over every element, as eager computes it:
    the loss tensor in the input dtype (each term computed in its opmath, then stored), then
    its mean (reduction=1) or sum (2)."""
    def entry(c: Call):
        x, t = c.v("self"), c.v("target")
        if x.dtype not in FLOATS or t is None or not t.is_tensor or t.dtype != x.dtype or t.ndim != x.ndim:
            return f"{name}: a float input and a target of its dtype and rank are generated (no promotion or broadcast)"
        reduction = c.s("reduction", 1)
        if reduction not in (1, 2):
            return f"{name} with reduction='none' is a pointwise loss, not generated yet"
        loss = term(c, x.at(x.dtype) - t.at(x.dtype)).cast(x.dtype).cast(_acc(x.dtype, "sum"))
        mean = reduction == 1
        return ReductionPlan("sum", loss, tuple(range(x.ndim)), False, lambda s, n: [s[0] / float(n) if mean else s[0]])
    return entry


def _smooth_l1(c: Call, d: Expr) -> Expr:
    beta = float(c.s("beta", 1.0))
    z = prim("abs", d)
    if beta == 0.0:
        return z
    return where(z < _k(z, beta), _k(z, 0.5) * z * z / _k(z, beta), z - _k(z, 0.5 * beta))


def _huber(c: Call, d: Expr) -> Expr:
    delta = float(c.s("delta", 1.0))
    z = prim("abs", d)
    return where(z < _k(z, delta), _k(z, 0.5) * z * z, _k(z, delta) * (z - _k(z, 0.5 * delta)))


# op packet (with overload where it matters) -> entry giving a ReductionPlan or a reason
REDUCTION_OPS: dict[str, Callable] = {
    "sum": _reduce_sum("sum"), "mean": _reduce_sum("sum", mean=True), "prod": _reduce_sum("prod"),
    "amax": _reduce_ext("max"), "amin": _reduce_ext("min"),
    "max.default": _reduce_ext("max"), "min.default": _reduce_ext("min"),
    "max.dim": _reduce_arg("argmax", True), "min.dim": _reduce_arg("argmin", True),
    "argmax": _reduce_arg("argmax", False), "argmin": _reduce_arg("argmin", False),
    "any": _reduce_bool("any"), "all": _reduce_bool("all"),
    "var": _reduce_var(False, False), "std": _reduce_var(True, False),
    "var_mean": _reduce_var(False, True), "std_mean": _reduce_var(True, True),
    "logsumexp": _logsumexp, "linalg_vector_norm": _vector_norm, "norm": _vector_norm,
    "mse_loss": _loss("mse_loss", lambda c, d: d * d), "smooth_l1_loss": _loss("smooth_l1_loss", _smooth_l1),
    "huber_loss": _loss("huber_loss", _huber),
}


# ---- normalizations ---------------------------------------------------------------------
# One reduction level whose outputs are over the whole reduced domain (and the statistics
# over the kept dims), or a per-channel affine map (batch norm with running statistics).
# Formulas follow eager's CUDA kernels: statistics and the affine map in the opmath dtype.

def _opt(c: Call, name: str) -> Expr | None:
    v = c.v(name)
    return v.at(v.dtype) if v is not None and v.is_tensor else None


def _affine(y: Expr, w: Expr | None, b: Expr | None) -> Expr:
    y = y * w if w is not None else y
    return y + b if b is not None else y


def _softmax(log: bool, safe: bool = False) -> Callable:
    """softmax and log_softmax over dims; `safe`: _safe_softmax (SDPA's masked rows), 0 on a row
    that is all -inf where softmax gives NaN (the row's max is -inf exactly then)."""
    def entry(c: Call):
        x = c.v("self")
        if x.dtype not in FLOATS:
            return "softmax of integers raises in eager"
        dt = c.s("dtype")  # softmax.int: the input cast to dtype first
        e = x.at(str(dt).removeprefix("torch.") if dt is not None else x.dtype)
        dims = _dims(c, x.ndim)
        if log:
            outs = lambda s, n: [e - (s[0] + prim("log", s[1]))]  # noqa: E731 (CUDA's LogSoftMaxForwardEpilogue)
        else:
            # eager divides by the sum; its reciprocal, taken once a row, differs by an ulp at most
            # and cannot overflow: the sum is at least 1 (the max's exp(0)) unless it is NaN
            outs = lambda s, n: [prim("exp", e - s[0]) * (1.0 / s[1])]  # noqa: E731
        if safe:
            soft = outs
            outs = lambda s, n: [where(eq(s[0], _k(s[0], -math.inf)), _k(s[0], 0.0), soft(s, n)[0])]  # noqa: E731
        return ReductionPlan("logsumexp", e, dims, True, outs)
    return entry


def _float_input(c: Call, what: str) -> tuple[Val, Expr] | str:
    x = c.v("input")
    return (x, x.at(x.dtype)) if x.dtype in FLOATS else f"{what} of integers raises in eager"


def _channels_input(c: Call, what: str) -> tuple[Val, Expr] | str:
    """A floating (N, C, ...) input, as group and batch norm need."""
    got = _float_input(c, what)
    if not isinstance(got, str) and got[0].ndim < 2:
        return f"{what} needs (N, C, ...) input"
    return got


def _last_dims_norm(rms: bool) -> Callable:
    """layer_norm (Welford: mean, variance) and rms_norm (the mean of squares) over the last
    len(normalized_shape) dims; rstd = rsqrt(var + eps); rms_norm's eps defaults to the
    compute dtype's epsilon, as eager's."""
    def entry(c: Call):
        got = _float_input(c, "rms_norm" if rms else "layer_norm")
        if isinstance(got, str):
            return got
        x, e = got
        dims = tuple(range(x.ndim - len(c.s("normalized_shape")), x.ndim))
        w, b, eps = _opt(c, "weight"), None if rms else _opt(c, "bias"), c.s("eps")
        eps = torch.finfo(getattr(torch, e.dtype)).eps if eps is None else eps

        def outs(s, n):
            rstd = prim("rsqrt", s[-1] / float(n) + _k(s[-1], eps))
            return [_affine(e * rstd, w, None), rstd] if rms else [_affine((e - s[1]) * rstd, w, b), s[1], rstd]
        return ReductionPlan("sum", e * e, dims, True, outs) if rms else ReductionPlan("welford", e, dims, True, outs)
    return entry


def _group_norm(c: Call):
    got = _channels_input(c, "group_norm")
    if isinstance(got, str):
        return got
    x, e = got
    g, eps = c.s("group"), c.s("eps")
    w, b = _opt(c, "weight"), _opt(c, "bias")

    def outs(s, n):  # eager: y = a * x + c with a = rstd * w, c = bias - a * mean
        var = maximum(s[2] / float(n), _k(s[2], 0))
        rstd = prim("rsqrt", var + _k(var, eps))
        a = rstd * w if w is not None else rstd
        shift = -a * s[1]
        return [a * e + (shift + b if b is not None else shift), s[1], rstd]
    return ReductionPlan("welford", e, tuple(range(2, x.ndim + 1)), True, outs, split=(1, g))


def _batch_norm(c: Call):
    """Per-channel (dim 1) statistics: running ones (inference: a pointwise affine map) or the
    batch's own (training with no running stats: instance norm's form)."""
    got = _channels_input(c, "batch_norm")
    if isinstance(got, str):
        return got
    x, e = got
    w, b, eps = _opt(c, "weight"), _opt(c, "bias"), c.s("eps")
    training = c.name != "_native_batch_norm_legit_no_training" and bool(c.s("training", False))
    rm, rv = _opt(c, "running_mean"), _opt(c, "running_var")
    if not training:
        if rm is None or rv is None:
            return "batch_norm in inference without running statistics raises in eager"
        invstd = prim("rsqrt", rv + _k(rv, eps))
        return (_affine((e - rm) * invstd, w, b),)
    if rm is not None or rv is not None:
        return "batch_norm in training updates its running statistics in place: not generated"

    def outs(s, n):
        invstd = 1.0 / prim("sqrt", s[2] / float(n) + _k(s[2], eps))
        return [_affine((e - s[1]) * invstd, w, b), s[1], invstd]
    return ReductionPlan("welford", e, (0,) + tuple(range(2, x.ndim)), True, outs)


PER_CHANNEL = frozenset({"_native_batch_norm_legit_no_training"})  # normalization that reduces nothing: an affine map per channel

# op packet -> (arguments that are per-channel vectors of dim 1, entry giving a ReductionPlan,
# a tuple of pointwise Exprs (one per output; outputs that are empty tensors get none), or a reason)
NORM_OPS: dict[str, tuple[tuple[str, ...], Callable]] = {
    "_softmax": ((), _softmax(False)), "_log_softmax": ((), _softmax(True)),
    "softmax": ((), _softmax(False)), "log_softmax": ((), _softmax(True)), "_safe_softmax": ((), _softmax(False, True)),
    "native_layer_norm": ((), _last_dims_norm(False)), "_fused_rms_norm": ((), _last_dims_norm(True)),
    "native_group_norm": (("weight", "bias"), _group_norm),
    **{k: (("weight", "bias", "running_mean", "running_var"), _batch_norm)
       for k in ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training")},
}


# ---- scans -------------------------------------------------------------------------------

@dataclass
class ScanPlan:
    kind: str  # a one-component REDUCTIONS kind
    operand: Expr
    dim: int


def _scan(kind: str) -> Callable:
    def entry(c: Call):
        x = c.v("self")
        dt = c.s("dtype")
        acc = _acc(str(dt).removeprefix("torch.") if dt is not None else x.dtype, kind)
        return ScanPlan(kind, x.at(x.dtype).cast(acc), c.s("dim") % max(x.ndim, 1) if x.ndim else 0)
    return entry


SCAN_OPS: dict[str, Callable] = {"cumsum": _scan("sum"), "cumprod": _scan("prod")}


# ---- windows (pooling) -------------------------------------------------------------------

@dataclass
class WindowPlan:
    kind: str
    kernel: tuple[int, ...]  # one entry per pooled (trailing) dim
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    outputs: Callable[[tuple[Expr, ...], Expr], list[Expr]]  # (state, divisor) -> per output
    count_include_pad: bool = True
    divisor_override: int | None = None


def _per_dim(v, default, k: int) -> tuple[int, ...]:
    v = default if v is None or v == [] else v
    v = [v] if isinstance(v, int) else list(v)
    return tuple(v) * k if len(v) == 1 else tuple(v)


def _pool(kind: str, k: int) -> Callable:
    """Pooling over the last k dims (k = 2: the *_pool2d ops, which 1-D pooling reaches on CUDA
    with a height of 1; k = 3: the *_pool3d ops)."""
    def entry(c: Call):
        x = c.v("self")
        if x.ndim not in (k + 1, k + 2):
            return f"{k}-D pooling needs a {k + 1}-D or {k + 2}-D input"
        ks = _per_dim(c.s("kernel_size"), None, k)
        geo = (ks, _per_dim(c.s("stride"), ks, k), _per_dim(c.s("padding"), 0, k), _per_dim(c.s("dilation"), 1, k))
        if kind == "avg":
            if x.dtype not in FLOATS:
                return "avg_pool of integers raises in eager"
            return WindowPlan("sum", *geo, lambda s, n: [s[0] / n.cast(s[0].dtype)],
                              bool(c.s("count_include_pad", True)), c.s("divisor_override"))
        with_indices = c.name.endswith("with_indices")
        return WindowPlan("pool_max", *geo, (lambda s, n: [s[0], s[1]]) if with_indices else (lambda s, n: [s[0]]))
    return entry


WINDOW_OPS: dict[str, Callable] = {"max_pool2d_with_indices": _pool("max", 2), "max_pool2d": _pool("max", 2),
                                   "avg_pool2d": _pool("avg", 2), "max_pool3d_with_indices": _pool("max", 3),
                                   "avg_pool3d": _pool("avg", 3)}
