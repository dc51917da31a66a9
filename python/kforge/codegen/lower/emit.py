"""What every lowering shares: C types and conversions, the expression emitter, the layout
(dims coalesced as TensorIterator does, offsets as constants), the kernel header and pointer
arguments, and the warp and block merges of a reduction state."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...proposers.builtin.common import f32
from ..ir import FLOATS, INTS, Expr, Program

CTYPE = {"float32": "float", "float64": "double", "float16": "__half", "bfloat16": "__nv_bfloat16",
         "int64": "long long", "int32": "int", "int16": "short", "int8": "signed char", "uint8": "unsigned char",
         "bool": "bool"}

_PRELUDE = r"""
typedef long long kf_i64;
template <typename T> __device__ __forceinline__ T kf_ld(T x) { return x; }
template <typename T, int V> struct alignas(sizeof(T) * V) kf_vec { T v[V]; };
// NaN-propagating, as torch.maximum/minimum: a NaN b fails the comparison and is returned.
template <typename T> __device__ __forceinline__ T kf_nanmax(T a, T b) { return (a != a || a > b) ? a : b; }
template <typename T> __device__ __forceinline__ T kf_nanmin(T a, T b) { return (a != a || a < b) ? a : b; }
template <typename T> __device__ __forceinline__ T kf_imax(T a, T b) { return a > b ? a : b; }
template <typename T> __device__ __forceinline__ T kf_imin(T a, T b) { return a < b ? a : b; }
// __fdividef where it is accurate (a divisor of normal magnitude up to 2^126: past it, it returns
// 0), IEEE division elsewhere (subnormal, huge, infinite or NaN divisors).
__device__ __forceinline__ float kf_fdiv(float a, float b) {
  const float m = fabsf(b);
  return (m >= 1.17549435e-38f && m < 8.50705917e37f) ? __fdividef(a, b) : a / b;
}
// log1p for a value rounded to a 16-bit float next: the series to x^4 where 1 + x would drop x's
// low bits (|x| < 2^-5: the first term left out is under 2^-20 of the sum), the hardware's log of
// 1 + x elsewhere (absolute error 2^-21 near 1, so at most 2^-16 of a result of 2^-5 or more).
__device__ __forceinline__ float kf_log1p16(float x) {
  return fabsf(x) < 0.03125f ? x * (1.0f + x * (-0.5f + x * (0.333333343f - 0.25f * x))) : __logf(1.0f + x);
}
"""
_HALF = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ float kf_ld(__half x) { return __half2float(x); }
"""
_BF16 = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ float kf_ld(__nv_bfloat16 x) { return __bfloat162float(x); }
"""

# primitive -> C for floats (libm name; the float32 form takes an f suffix)
_LIBM = {"exp": "exp", "exp2": "exp2", "expm1": "expm1", "log": "log", "log2": "log2", "log10": "log10",
         "log1p": "log1p", "sqrt": "sqrt", "rsqrt": "rsqrt", "sin": "sin", "cos": "cos", "tan": "tan",
         "asin": "asin", "acos": "acos", "atan": "atan", "sinh": "sinh", "cosh": "cosh", "tanh": "tanh",
         "asinh": "asinh", "acosh": "acosh", "atanh": "atanh", "erf": "erf", "erfc": "erfc", "erfinv": "erfinv",
         "lgamma": "lgamma", "ceil": "ceil", "floor": "floor", "trunc": "trunc", "rint": "rint", "j0": "j0",
         "j1": "j1", "i0": "cyl_bessel_i0", "i1": "cyl_bessel_i1", "pow": "pow", "atan2": "atan2", "fmod": "fmod",
         "hypot": "hypot", "copysign": "copysign", "nextafter": "nextafter", "fmax": "fmax", "fmin": "fmin",
         "abs": "fabs"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "mod": "%", "and": "&", "or": "|", "xor": "^",
          "shl": "<<", "shr": ">>", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


def _const(e: Expr) -> str:
    v = e.value
    if e.dtype == "bool":
        return "true" if v else "false"
    if e.dtype in INTS:
        if e.dtype == "int64":
            return "(-9223372036854775807LL - 1)" if v == -2**63 else f"{v}LL"
        return f"(({CTYPE[e.dtype]}){v})"
    if e.dtype == "float32":
        return f32(v)
    if math.isnan(v):
        return "__longlong_as_double(0x7ff8000000000000LL)"
    if math.isinf(v):
        return f"__longlong_as_double({'0x7ff0000000000000LL' if v > 0 else '0xfff0000000000000LL'})"
    return repr(v)


def convert(x: str, src: str, dst: str) -> str:
    """C for value x (compute dtype src, or a storage dtype) converted to dtype dst."""
    if src == dst:
        return x
    if dst == "float16":
        return f"__float2half_rn((float)({x}))"
    if dst == "bfloat16":
        return f"__float2bfloat16_rn((float)({x}))"
    if src in ("float16", "bfloat16"):
        x, src = f"kf_ld({x})", "float32"
        if src == dst:
            return x
    return f"(({CTYPE[dst]})({x}))"


class Emitter:
    """SSA statements for Expr DAGs in one scope; equal subtrees are emitted once. The nodes in
    `fast` (float32 exp, division and log1p, fast_nodes) use the hardware's approximations (__expf,
    __fdividef, __logf past a short series: a few ulps, against an ulp; about 3 instructions
    against 10, and log1pf's 20 or more), and 1 +- tanh(z)
    (GELU's tanh form) takes 2 / (1 + exp(-+2z)) through them: for values rounded to a 16-bit
    type next, whose rounding hides that difference."""

    def __init__(self, prefix: str, env: dict[str, str], load, fast: frozenset = frozenset()):
        self.prefix, self.env, self.load, self.fast = prefix, env, load, fast
        self.names: dict[Expr, str] = {}
        self.lines: list[str] = []

    def __call__(self, e: Expr) -> str:
        def go(n: Expr) -> None:  # operands before users; a named subtree is not entered (see bind)
            if n in self.names:
                return
            shifted = _one_plus_tanh(n) if n in self.fast else None
            for a in (shifted[0],) if shifted else n.args:
                go(a)
            self.names[n] = self._emit(n)

        go(e)
        return self.names[e]

    def bind(self, e: Expr, name: str) -> None:
        """`e` is already computed, as `name`: its subtree is not emitted again."""
        self.names[e] = name

    def _emit(self, n: Expr) -> str:
        if n.op == "const":
            return _const(n)
        if n.op == "var":
            return self.env[n.value]
        if n.op == "load":
            c = self.load(*n.value)
            expr = convert(c, n.value[1], n.dtype)
        elif n.op == "cast":
            x = self.names[n.args[0]]
            src = n.args[0].dtype
            expr = f"kf_ld({convert(x, src, n.value[1])})" if n.value else convert(x, src, n.dtype)
        elif n in self.fast and n.op in ("add", "sub"):  # 1 +- tanh(z) = 2 / (1 + exp(-+2z)): no cancellation
            z, k = _one_plus_tanh(n)
            expr = f"kf_fdiv(2.0f, 1.0f + __expf({k:.1f}f * {self.names[z]}))"
        elif n in self.fast:
            a = [self.names[x] for x in n.args]
            expr = {"exp": f"__expf({a[0]})", "log1p": f"kf_log1p16({a[0]})"}.get(n.op) or f"kf_fdiv({a[0]}, {a[1]})"
        elif n.op in ("sin", "cos") and n.args[0].dtype in ("float32", "float64"):
            return self._sincos(n)
        else:
            expr = self._prim(n, [self.names[a] for a in n.args])
        name = f"{self.prefix}{len(self.lines)}"
        self.lines.append(f"const {CTYPE[n.dtype]} {name} = {expr};")
        return name

    def _sincos(self, n: Expr) -> str:
        """sin and cos of one value share their argument reduction (a rotary embedding takes both
        of each angle; the compiler does not merge sinf and cosf). Both are named: the other one,
        if nothing asks for it, is dead code the compiler drops."""
        x = n.args[0]
        name = f"{self.prefix}{len(self.lines)}"
        fn = "sincosf" if x.dtype == "float32" else "sincos"
        self.lines.append(f"{CTYPE[n.dtype]} {name}s, {name}c; {fn}({self.names[x]}, &{name}s, &{name}c);")
        self.names[Expr("sin", n.args, n.dtype, n.value)] = f"{name}s"
        self.names[Expr("cos", n.args, n.dtype, n.value)] = f"{name}c"
        return f"{name}{n.op[0]}"

    @staticmethod
    def _prim(n: Expr, a: list[str]) -> str:
        t = n.args[-1].dtype if n.args else n.dtype
        floating = t in FLOATS
        ct = CTYPE[n.dtype]
        if n.op == "where":
            return f"({a[0]} ? {a[1]} : {a[2]})"
        if n.op in ("isnan", "isinf", "signbit"):
            return f"{n.op}({a[0]})"
        if n.op == "neg":
            return f"(({ct})(-{a[0]}))"
        if n.op == "not":
            return f"(!{a[0]})" if t == "bool" else f"(({ct})(~{a[0]}))"
        if n.op in ("max", "min"):
            fn = ("kf_nan" if floating else "kf_i") + n.op
            return f"{fn}<{CTYPE[t]}>({a[0]}, {a[1]})"
        if n.op == "abs" and not floating:
            return f"(({ct})({a[0]} < 0 ? -{a[0]} : {a[0]}))"
        if n.op in _INFIX:
            return f"(({ct})({a[0]} {_INFIX[n.op]} {a[1]}))"
        fn = _LIBM[n.op] + ("f" if t == "float32" else "")
        return f"{fn}({', '.join(a)})"


# ---- layout --------------------------------------------------------------------------

def coalesce(sizes: list[int], strides: list[list[int]], order: list[int]) -> tuple[list[int], list[list[int]]]:
    """Dims `order` (outermost first, size-1 dims dropped) merged where every tensor is
    contiguous across neighbours: (sizes, per-tensor strides)."""
    out_sizes: list[int] = []
    out: list[list[int]] = [[] for _ in strides]
    for d in order:
        if sizes[d] == 1:
            continue
        if out_sizes and all(o[-1] == st[d] * sizes[d] for o, st in zip(out, strides)):
            out_sizes[-1] *= sizes[d]
            for o, st in zip(out, strides):
                o[-1] = st[d]
        else:
            out_sizes.append(sizes[d])
            for o, st in zip(out, strides):
                o.append(st[d])
    if not out_sizes:
        return [1], [[0] for _ in strides]
    return out_sizes, out


def vector_fits(v: int, m, st: tuple[int, ...] | list[int], inner: int, offset: int = 0, wide: bool = False) -> bool:
    """Whether a tensor (meta m, strides st over the layout) contiguous along dim `inner` can be
    read or written `v` elements at a time: 16 bytes at most (with `wide`, any whole number of
    16-byte pieces: vector_copy), aligned, and every other stride (and its offset) a multiple of v."""
    size = v * m.itemsize
    return (size <= 16 or wide and size % 16 == 0) and m.align % min(size, 16) == 0 and offset % v == 0 and \
        all(s % v == 0 for d, s in enumerate(st) if d != inner % len(st))


def vector_copy(ct: str, itemsize: int, v: int, dst: str, src: str) -> str:
    """C statement copying the kernel's V (= `v`) elements of type `ct` from `src` to `dst`
    (pointers) as one vector access, or, where they are wider than 16 bytes, as 16-byte pieces:
    a program whose tensors differ in width (int64 positions into a bf16 mask, an fp32 -> bf16
    cast) reads and writes its narrow tensors 16 bytes at a time too."""
    piece = 16 // itemsize
    if v * itemsize <= 16:
        return f"*reinterpret_cast<kf_vec<{ct}, V>*>({dst}) = *reinterpret_cast<const kf_vec<{ct}, V>*>({src});"
    return (f"_Pragma(\"unroll\") for (int c_ = 0; c_ < V; c_ += {piece}) *reinterpret_cast<kf_vec<{ct}, {piece}>*>({dst} + c_) = "
            f"*reinterpret_cast<const kf_vec<{ct}, {piece}>*>({src} + c_);")


def offsets_code(var: str, sizes: list[int], strides: list[list[int]], names: list[str], idx: str,
                 declare: bool = True) -> list[str]:
    """Statements setting names[t] (declared here unless `declare` is False) to tensor t's
    offset of flat index `var`."""
    lines = [f"{idx + ' ' if declare else ''}{n} = 0;" for n in names]
    lines.append(f"{{ {idx} e_ = {var};")
    for d in range(len(sizes) - 1, -1, -1):
        c = f"(e_ % {sizes[d]})" if d else "e_"
        used = [(n, st[d]) for n, st in zip(names, strides) if st[d]]
        if used:
            lines.append(f"  {{ const {idx} c_ = {c};" + "".join(f" {n} += c_ * {s};" for n, s in used) + " }")
        if d:
            lines.append(f"  e_ /= {sizes[d]};")
    lines.append("}")
    return lines


@dataclass
class Built:
    source: str
    kernels: list  # (name, grid, block, args, smem[, cooperative])
    workspace: list


# Ops whose result jumps where an operand crosses a point: a few ulps in the operand may move a
# whole step (a rounding, a comparison, a where's condition, an integer cast).
_STEPS = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "rint", "floor", "ceil", "trunc", "mod", "fmod", "isnan",
                    "isinf", "signbit", "not", "and", "or", "xor", "shl", "shr", "copysign", "nextafter"})


def fast_nodes(prog: Program, results: list) -> frozenset:
    """The float32 exp, division, log1p and 1 +- tanh nodes of `results` (epilogue expressions) that may take
    Emitter's fast forms: every output a 16-bit float, so each value is rounded to 8 or 11
    significant bits (a few fp32 ulps then change a rounding once in thousands of elements, by
    one ulp of the output), and no step between the node and the output (nothing under a
    comparison, a rounding, a where's condition or an integer cast)."""
    if not all(m.dtype in ("float16", "bfloat16") for m in prog.outputs if m.numel):
        return frozenset()
    stepped: set = set()

    def under_step(e) -> None:
        if e not in stepped:
            stepped.add(e)
            for a in e.args:
                under_step(a)

    nodes = {n for r in results for n in r.walk()}
    for n in nodes:
        if n.op in _STEPS or (n.op == "cast" and n.dtype not in FLOATS):
            for a in n.args:
                under_step(a)
        elif n.op == "where":
            under_step(n.args[0])
    return frozenset(n for n in nodes if n.dtype == "float32" and n not in stepped and
                     (n.op in ("exp", "div", "log1p") or _one_plus_tanh(n)))


def _one_plus_tanh(n: Expr) -> tuple[Expr, float] | None:
    """(z, k) where `n` is 1 + tanh(z) (k = -2) or 1 - tanh(z) (k = 2): 2 / (1 + exp(k z)) either way."""
    if n.op not in ("add", "sub") or len(n.args) != 2:
        return None
    a, b = n.args
    if n.op == "add" and b.op == "const":
        a, b = b, a
    if a.op == "const" and a.value == 1 and b.op == "tanh" and b.dtype == "float32":
        return b.args[0], -2.0 if n.op == "add" else 2.0
    return None


def _header(body: str) -> str:
    parts = ["// kforge codegen"]
    if "__half" in body:
        parts.append(_HALF)
    if "__nv_bfloat16" in body:
        parts.append(_BF16)
    return "\n".join(parts + [_PRELUDE, body]) + "\n"


def _pointers(prog: Program) -> tuple[list[str], list[dict], dict[int, str]]:
    """Kernel parameters, launch args, and the pointer each loaded input is read through
    (an input an output overwrites is read through that output: no second pointer to it)."""
    params, args, ptr = [], [], {}
    written = {i: j for j, i in prog.aliases.items()}
    for j, m in enumerate(prog.outputs):
        aliased = j in prog.aliases and prog.aliases[j] in prog.in_strides
        params.append(f"{CTYPE[m.dtype]}* {'' if aliased else '__restrict__ '}out{j}")
        args.append({"out": j})
    for i in sorted(prog.in_strides):
        if i in written:
            ptr[i] = f"out{written[i]}"
        else:
            ptr[i] = f"(in{i} + {prog.offset(i)})" if prog.offset(i) else f"in{i}"
            params.append(f"const {CTYPE[prog.inputs[i].dtype]}* __restrict__ in{i}")
            args.append({"in": prog.source(i)})
    return params, args, ptr


def _index_type(prog: Program, extra: int = 0) -> str:
    spans = [m.span() + prog.out_offset(j) for j, m in enumerate(prog.outputs)] + [prog.inputs[i].span() + prog.offset(i) for i in prog.in_strides]
    big = max(spans + [math.prod(prog.domain) if prog.domain else 1]) + extra >= 2**31 - 2**20
    return "kf_i64" if big else "int"


# ---- warp and block merges (reductions, norms, scans) ------------------------------------

def _shfl(x: str, dtype: str, o: int, width: int, way: str = "down") -> str:
    fn = f"__shfl_{way}_sync"
    if dtype == "bool":
        return f"(bool){fn}(0xffffffffu, (int){x}, {o}, {width})"
    if dtype in ("int8", "uint8", "int16"):
        return f"({CTYPE[dtype]}){fn}(0xffffffffu, (int){x}, {o}, {width})"
    return f"{fn}(0xffffffffu, {x}, {o}, {width})"


def _merge_block(kind, dtype: str, into: list[str], other: list[str], tag: str) -> list[str]:
    """Statements: into = merge(into, other)."""
    a, b, merged = kind.merge_exprs(dtype)
    env = {v.value: n for v, n in zip(a, into)}
    env.update({v.value: n for v, n in zip(b, other)})
    em = Emitter(f"m{tag}_", env, None)
    res = [em(m) for m in merged]
    return ["{"] + [f"  {line}" for line in em.lines] + [f"  {n} = {r};" for n, r in zip(into, res)] + ["}"]


def _chunk_block(kind, dtype: str, into: list[str], operand, width: int, load, env: dict, tag: str,
                 after=None) -> list[str]:
    """Statements: into = merge(into, the kind's chunk state of `width` consecutive elements), the
    operand evaluated at each element j (load(i, stored, j) and env(j) say where its inputs are;
    after(j, name) adds statements that use element j's value)."""
    from ..ir import Expr

    em = Emitter(f"{tag}_", {}, None)
    values, extra = [], []
    for j in range(width):
        em.load = lambda i, stored, j=j: load(i, stored, j)
        em.env.update(env(j))
        em.names = {}  # the same operand expression at another element
        values.append(em(operand))
        extra += after(j, values[-1]) if after else []
    xs = tuple(Expr.var(f"kf_c{j}", dtype) for j in range(width))
    em.env.update({x.value: v for x, v in zip(xs, values)})
    em.names = {}
    chunk = [em(e) for e in kind.chunk_exprs(xs)]
    return em.lines + extra + _merge_block(kind, dtype, into, chunk, tag)
