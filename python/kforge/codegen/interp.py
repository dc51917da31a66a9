"""A reference interpreter of the IR in torch on the CPU.

It evaluates the very Expr trees lower/ turns into CUDA (the op table's formulas, the
casts, the reduction kinds' lift and merge), with one torch function per primitive, so a
test against eager checks the table and the kinds, not a second copy of them. Reductions
fold with merge as a balanced tree over the reduced elements in row-major order, scans one
element after another.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator

import torch

from .ir import INTS, Expr, Program

_T = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
      "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
      "bool": torch.bool}


def _fmod(a, b):
    # fmod is exact, so float64 gives the same float32 result without CPU's vectorized
    # fmod, which returns NaN for denormal or huge operands (CUDA's fmodf does not).
    return torch.fmod(a.double(), b.double()).to(a.dtype) if a.dtype == torch.float32 else torch.fmod(a, b)


def _idiv(a, b):
    return torch.div(a, b, rounding_mode="trunc") if a.dtype != torch.bool else a


PRIM_FNS = {
    "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1, "log": torch.log, "log2": torch.log2,
    "log10": torch.log10, "log1p": torch.log1p, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "sin": torch.sin,
    "cos": torch.cos, "tan": torch.tan, "asin": torch.asin, "acos": torch.acos, "atan": torch.atan,
    "sinh": torch.sinh, "cosh": torch.cosh, "tanh": torch.tanh, "asinh": torch.asinh, "acosh": torch.acosh,
    "atanh": torch.atanh, "erf": torch.erf, "erfc": torch.erfc, "erfinv": torch.erfinv, "lgamma": torch.lgamma,
    "ceil": torch.ceil, "floor": torch.floor, "trunc": torch.trunc, "rint": torch.round,
    "j0": torch.special.bessel_j0, "j1": torch.special.bessel_j1, "i0": torch.i0, "i1": torch.special.i1,
    "pow": torch.pow, "atan2": torch.atan2, "fmod": _fmod, "hypot": torch.hypot, "copysign": torch.copysign,
    "nextafter": torch.nextafter, "fmax": torch.fmax, "fmin": torch.fmin,
    "neg": torch.neg, "abs": torch.abs, "add": torch.add, "sub": torch.sub, "mul": torch.mul,
    "div": lambda a, b: torch.div(a, b) if a.is_floating_point() else _idiv(a, b),
    "max": torch.maximum, "min": torch.minimum,
    "and": torch.bitwise_and, "or": torch.bitwise_or, "xor": torch.bitwise_xor, "not": torch.bitwise_not,
    "shl": torch.bitwise_left_shift, "shr": torch.bitwise_right_shift, "mod": torch.fmod,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "isnan": torch.isnan, "isinf": torch.isinf, "signbit": torch.signbit,
    "where": torch.where,
}


def evaluate(e: Expr, env: dict, loads) -> torch.Tensor:
    """e's value: `env` binds var names to tensors, `loads(i, stored)` gives input i."""
    memo: dict[Expr, torch.Tensor] = {}
    for n in e.walk():
        if n.op == "load":
            v = loads(*n.value).to(_T[n.dtype])
        elif n.op == "const":
            v = torch.tensor(n.value, dtype=_T[n.dtype])
        elif n.op == "var":
            v = env[n.value]
        elif n.op == "cast":
            x = memo[n.args[0]]
            v = x.to(_T[n.value[1]]).to(_T[n.dtype]) if n.value else x.to(_T[n.dtype])
        else:
            args = [memo[a] for a in n.args]
            if n.op in ("add", "sub", "mul") and n.dtype == "bool":  # C++ bool arithmetic, then back to bool
                args = [a.to(torch.int64) for a in args]
            v = PRIM_FNS[n.op](*args)
            if n.op == "pow" and n.dtype in INTS:
                v = v.to(_T[n.dtype])
            v = v.to(_T[n.dtype])
        memo[n] = v
    return memo[e]


def _fold(kind, dtype: str, states: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Balanced-tree merge of states shaped [K, R] along R."""
    a_vars, b_vars, merged = kind.merge_exprs(dtype)
    ident = [evaluate(x, {}, None) for x in kind.identity_exprs(dtype)]
    r = states[0].shape[1]
    width = 1 << max(0, math.ceil(math.log2(max(r, 1))))
    states = tuple(torch.cat([s, i.expand(s.shape[0], width - r)], 1) if width > r else s
                   for s, i in zip(states, ident))
    while states[0].shape[1] > 1:
        env = {v.value: s[:, 0::2] for v, s in zip(a_vars, states)}
        env.update({v.value: s[:, 1::2] for v, s in zip(b_vars, states)})
        states = tuple(evaluate(m, env, None).expand_as(env[a_vars[0].value]) for m in merged)
    return tuple(s[:, 0] for s in states)


def _scan(scan, x: torch.Tensor) -> torch.Tensor:
    """The running state along scan.dim, one merge per element in order (as the kernel does)."""
    (a,), (b,), (merged,) = scan.kind.merge_exprs(scan.operand.dtype)
    (ident,) = scan.kind.identity_exprs(scan.operand.dtype)
    (lift,) = scan.kind.lift_exprs(Expr.var("x", scan.operand.dtype))
    xs = x.movedim(scan.dim, 0)
    order = range(xs.shape[0] - 1, -1, -1) if scan.reverse else range(xs.shape[0])
    state = evaluate(ident, {}, None).expand(xs.shape[1:])
    out = torch.empty_like(xs, dtype=state.dtype)
    for i in order:
        el = evaluate(lift, {"x": xs[i]}, None).expand(xs.shape[1:])
        nxt = evaluate(merged, {a.value: state, b.value: el}, None).expand(xs.shape[1:])
        out[i] = state if scan.exclusive else nxt
        state = nxt
    return out.movedim(0, scan.dim)


def _window(prog: Program, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The folded state and the divisor at every output point of a pooling program."""
    w = prog.window
    k = len(w.kernel)
    dt = w.kind.state(w.operand.dtype)[0]

    def load(i, stored):
        t = inputs[prog.source(i)]
        return torch.as_strided(t, w.frame, prog.in_strides[i], t.storage_offset() + prog.offset(i))

    x = evaluate(w.operand, {}, load).expand(w.frame).to(_T[dt])
    size, out = w.frame[-k:], prog.domain[-k:]
    # output coordinates along each pooled dim, shaped to broadcast over the others
    o = [torch.arange(n).reshape([-1 if j == i else 1 for j in range(k)]) for i, n in enumerate(out)]
    a_vars, b_vars, merged = w.kind.merge_exprs(dt)
    lifted = w.kind.lift_exprs(Expr.var("x", dt))
    state = [evaluate(i, {}, None).expand(prog.domain) for i in w.kind.identity_exprs(dt)]
    for offs in itertools.product(*(range(n) for n in w.kernel)):
        pos = [o[i] * w.stride[i] - w.padding[i] + offs[i] * w.dilation[i] for i in range(k)]
        valid = functools.reduce(operator.and_, [(p >= 0) & (p < n) for p, n in zip(pos, size)])
        val = x[(...,) + tuple(p.clamp(0, n - 1) for p, n in zip(pos, size))]
        flat = functools.reduce(lambda acc, pn: acc * pn[1] + pn[0], zip(pos[1:], size[1:]), pos[0])
        env = {"x": val, "ridx": flat.expand(out)}
        el = [evaluate(e, env, None).expand(prog.domain) for e in lifted]
        env = {v.value: s for v, s in zip(a_vars, state)}
        env.update({v.value: s for v, s in zip(b_vars, el)})
        state = [torch.where(valid, evaluate(e, env, None).expand(prog.domain), s) for e, s in zip(merged, state)]
    starts = [o[i] * w.stride[i] - w.padding[i] for i in range(k)]
    ends = [torch.clamp(s + n, max=sz + p) for s, n, sz, p in zip(starts, w.kernel, size, w.padding)]
    pool = functools.reduce(operator.mul, [e - s for s, e in zip(starts, ends)])
    valid = functools.reduce(operator.mul, [e.clamp(max=sz) - s.clamp(min=0) for s, e, sz in zip(starts, ends, size)])
    count = torch.full_like(pool, w.divisor_override) if w.divisor_override else pool if w.count_include_pad else valid
    return {**{f"s{i}": s for i, s in enumerate(state)}, "count": count.to(torch.int64).expand(prog.domain)}


def run(prog: Program, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The program's outputs (contiguous, with the output shapes and dtypes) for CPU `inputs`
    (the launch plan's: a region's views of an input read that input), in the card's order
    (a program with parts: every part's outputs too)."""
    if prog.out_index is None and not prog.parts:
        return _run(prog, inputs)
    if prog.card_outputs is not None:  # slabs: each part writes its slab of the card outputs
        full = [torch.empty_strided(tuple(m.shape), tuple(m.stride), dtype=_T[m.dtype]) for m in prog.card_outputs]
        for p in [prog, *prog.parts]:
            for j, t in enumerate(_run(p, inputs)):
                m, out = p.outputs[j], full[p.card_output(j)]
                torch.as_strided(out, tuple(m.shape), tuple(m.stride), p.out_offset(j)).copy_(t)
        return [t.contiguous() for t in full]
    got: dict[int, torch.Tensor] = {}
    for p in [prog, *prog.parts]:
        got.update((p.card_output(j), t) for j, t in enumerate(_run(p, inputs)))
    return [got[j] for j in range(len(got))]


def _gathered(prog: Program, inputs: list[torch.Tensor], i: int, shape) -> torch.Tensor:
    """Input i at each domain point: its strides' offset plus the index's value times the stride."""
    j, stride, rows = prog.gathers[i]
    t, ti = inputs[prog.source(i)], inputs[prog.source(j)]
    index = torch.as_strided(ti, shape, prog.in_strides[j], ti.storage_offset() + prog.offset(j)).to(torch.int64)
    if bool(((index < 0) | (index >= rows)).any()):
        raise IndexError(f"an index outside [0, {rows})")
    n = t.untyped_storage().nbytes() // t.element_size()
    at = torch.as_strided(torch.arange(n), shape, prog.in_strides[i], t.storage_offset() + prog.offset(i))
    return torch.as_strided(t, (n,), (1,), 0)[at + index * stride]


def _run(prog: Program, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    dom = prog.domain
    red = prog.reduction
    kept = tuple(1 if d in prog.reduce_dims else s for d, s in enumerate(dom))

    def loads_over(shape):
        def load(i, stored):
            t = inputs[prog.source(i)]
            if i in prog.gathers:
                return _gathered(prog, inputs, i, shape)
            return torch.as_strided(t, shape, prog.in_strides[i], t.storage_offset() + prog.offset(i))
        return load

    env: dict[str, torch.Tensor] = {}
    if red is not None:
        kd = [d for d in range(len(dom)) if d not in red.dims]
        perm = kd + list(red.dims)
        rshape = [dom[d] for d in red.dims]
        ridx = torch.arange(math.prod(rshape), dtype=torch.int64).reshape(rshape) if rshape else torch.zeros((), dtype=torch.int64)
        ridx_dom = ridx.reshape([dom[d] if d in red.dims else 1 for d in range(len(dom))]).expand(dom)
        xs, lifted = red.lifted()
        env = {x.value: evaluate(o, {"ridx": ridx_dom}, loads_over(dom)).expand(dom) for x, o in zip(xs, red.operands)}
        k = math.prod(dom[d] for d in kd)
        flat = lambda t: t.expand(dom).permute(perm).reshape(k, -1)  # noqa: E731
        states = tuple(flat(evaluate(e, {**env, "ridx": ridx_dom}, None)) for e in lifted)
        folded = _fold(red.kind, red.operand.dtype, states)
        env = {f"s{i}": s.reshape(kept) for i, s in enumerate(folded)}
    if prog.window is not None:
        env = _window(prog, inputs)
    if prog.scan is not None:
        env = {"s0": _scan(prog.scan, evaluate(prog.scan.operand, {}, loads_over(dom)).expand(dom))}
    shape = kept if red is not None and not prog.normalizes else dom
    at_kept = tuple(slice(0, 1) if d in prog.reduce_dims else slice(None) for d in range(len(dom)))
    outs = []
    for e, m, st in zip(prog.results, prog.outputs, prog.out_strides):
        if not m.numel:
            outs.append(torch.empty(m.shape, dtype=_T[m.dtype]))
            continue
        v = evaluate(e, env, loads_over(shape)).expand(shape)  # a pooling's epilogue reads over its output domain
        if shape != kept and not any(st[d] for d in prog.reduce_dims):  # a statistic of a normalization
            v = v[at_kept]
        # written through the output's strides over the domain, as the kernel writes it
        out = torch.empty_strided(tuple(m.shape), tuple(m.stride), dtype=_T[m.dtype])
        torch.as_strided(out, v.shape, st).copy_(v.to(_T[m.dtype]))
        outs.append(out.contiguous())
    return outs

