"""IR -> CUDA C for NVRTC plus a launch plan, for one point of the knob space.

Layout: the domain's dims are reduced the way TensorIterator does it (size-1 dims dropped,
dims ordered by the first output's strides, neighbours merged where every tensor is
contiguous across them); a reduction does this separately for its kept and reduced dims.
Shapes and strides are compile-time constants, so the index arithmetic folds.

Pointwise (`algo` "flat"): each thread handles `items` vectors of `vec` elements, loads
issued for all items before any math (16-byte accesses where a tensor is contiguous along
the inner dim), values computed in the compute dtype and rounded once on store.

Reduction: a group of `lanes` threads folds each output's reduced elements (`items` loads
of `vec` consecutive elements in flight per thread), merges through warp shuffles and, for groups wider than a warp,
shared memory; `algo` "rows" puts whole warps on an output (reduced dims contiguous), "cols"
one thread per output (kept dims contiguous: the loads coalesce across outputs). `split` > 1
divides the reduced elements over that many blocks, which write their states to a workspace
that a second kernel merges in order (two passes) before the epilogue.

Scan (`algo` "gen_scan"): one thread per line along the scanned dim, walking it in order;
`algo` "gen_scan_block" (lines contiguous in memory): one block per line, a parallel scan of
chunks of threads x items elements carried from chunk to chunk.
Window (`algo` "gen_window", 2-D and 3-D pooling): one thread per output point folding its window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..proposers.builtin.common import ceil_div, f32
from .ir import FLOATS, INTS, Expr, Program, opmath

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
            return f"(-9223372036854775807LL - 1)" if v == -2**63 else f"{v}LL"
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
    """SSA statements for Expr DAGs in one scope; equal subtrees are emitted once."""

    def __init__(self, prefix: str, env: dict[str, str], load):
        self.prefix, self.env, self.load = prefix, env, load
        self.names: dict[Expr, str] = {}
        self.lines: list[str] = []

    def __call__(self, e: Expr) -> str:
        for n in e.walk():
            if n not in self.names:
                self.names[n] = self._emit(n)
        return self.names[e]

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
        else:
            expr = self._prim(n, [self.names[a] for a in n.args])
        name = f"{self.prefix}{len(self.lines)}"
        self.lines.append(f"const {CTYPE[n.dtype]} {name} = {expr};")
        return name

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
    kernels: list  # (name, grid, block, args, smem)
    workspace: list


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
            ptr[i] = f"in{i}"
            params.append(f"const {CTYPE[prog.inputs[i].dtype]}* __restrict__ in{i}")
            args.append({"in": prog.source(i)})
    return params, args, ptr


def _index_type(prog: Program, extra: int = 0) -> str:
    spans = [m.span() for m in prog.outputs] + [prog.inputs[i].span() for i in prog.in_strides]
    big = max(spans + [math.prod(prog.domain) if prog.domain else 1]) + extra >= 2**31 - 2**20
    return "kf_i64" if big else "int"


# ---- pointwise -----------------------------------------------------------------------

def pointwise_layout(prog: Program):
    tensors = [list(s) for s in prog.out_strides] + [list(prog.in_strides[i]) for i in sorted(prog.in_strides)]
    nd = len(prog.domain)
    order = sorted(range(nd), key=lambda d: -prog.out_strides[0][d])
    return coalesce(list(prog.domain), tensors, order)


def pointwise_vecs(prog: Program) -> tuple[int, ...]:
    """Legal vector widths (elements) along the inner coalesced dim, narrowest first."""
    sizes, strides = pointwise_layout(prog)
    metas = list(prog.outputs) + [prog.inputs[i] for i in sorted(prog.in_strides)]
    out = []
    for v in (1, 2, 4, 8, 16):
        ok = sizes[-1] % v == 0
        for m, st in zip(metas, strides):
            if st[-1] == 1 and v > 1:
                ok &= v * m.itemsize <= 16 and m.align % (v * m.itemsize) == 0 and all(s % v == 0 for s in st[:-1])
        if ok:
            out.append(v)
    return tuple(out)


def lower_pointwise(prog: Program, knobs: dict, sm_count: int) -> Built:
    nt, v, it = knobs["threads"], knobs["vec"], knobs["items"]
    sizes, strides = pointwise_layout(prog)
    numel = math.prod(sizes)
    nv = numel // v
    params, args, ptr = _pointers(prog)
    no = len(prog.outputs)
    loaded = sorted(prog.in_strides)
    idx = _index_type(prog, 2 * nt * it * v)
    names = [f"o{t}" for t in range(len(strides))]
    ins_of = {i: no + k for k, i in enumerate(loaded)}
    hoist, decl, loads, body = [], [], [], []
    for i in loaded:
        t = ins_of[i]
        st = strides[t]
        ct = CTYPE[prog.inputs[i].dtype]
        if not any(st):
            hoist.append(f"  const {ct} h{i} = {ptr[i]}[0];")
            continue
        decl.append(f"    {ct} x{i}[IT][V];")
        if st[-1] == 1 and v > 1:
            loads.append(f"        *reinterpret_cast<kf_vec<{ct}, V>*>(x{i}[k]) = "
                         f"*reinterpret_cast<const kf_vec<{ct}, V>*>({ptr[i]} + off[k][{t}]);")
        else:
            loads.append(f"        for (int j = 0; j < V; ++j) x{i}[k][j] = {ptr[i]}[off[k][{t}] + j * {st[-1]}];")

    def load(i, stored):
        return f"h{i}" if not any(strides[ins_of[i]]) else f"x{i}[k][j]"

    em = Emitter("v", {}, load)
    res = [em(e) for e in prog.results]
    body += [f"          {line}" for line in em.lines]
    stores = []
    for j, (m, r) in enumerate(zip(prog.outputs, res)):
        ct = CTYPE[m.dtype]
        body.append(f"          r{j}[j] = {convert(r, prog.results[j].dtype, m.dtype)};")
        if strides[j][-1] == 1 and v > 1:
            stores.append(f"        *reinterpret_cast<kf_vec<{ct}, V>*>(out{j} + off[k][{j}]) = "
                          f"*reinterpret_cast<const kf_vec<{ct}, V>*>(r{j});")
        else:
            stores.append(f"        for (int j = 0; j < V; ++j) out{j}[off[k][{j}] + j * {strides[j][-1]}] = r{j}[j];")
    rdecl = [f"        {CTYPE[m.dtype]} r{j}[V];" for j, m in enumerate(prog.outputs)]
    offs = offsets_code("(base + k * NT) * V", sizes, strides, [f"off[k][{t}]" for t in range(len(strides))], idx, False)
    src = "\n".join([
        f"typedef {idx} kf_idx;",
        f"constexpr int NT = {nt}; constexpr int V = {v}; constexpr int IT = {it}; constexpr kf_idx NV = {nv};",
        f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(params)}) {{',
        *hoist,
        "  for (kf_idx base = (kf_idx)blockIdx.x * (NT * IT) + threadIdx.x; base < NV;"
        " base += (kf_idx)gridDim.x * (NT * IT)) {",
        f"    kf_idx off[IT][{len(strides)}];",
        *decl,
        "#pragma unroll",
        "    for (int k = 0; k < IT; ++k) {",
        "      if (base + k * NT < NV) {",
        *[f"        {line}" for line in offs],
        *loads,
        "      }",
        "    }",
        "#pragma unroll",
        "    for (int k = 0; k < IT; ++k) {",
        "      if (base + k * NT < NV) {",
        *rdecl,
        "#pragma unroll",
        "        for (int j = 0; j < V; ++j) {",
        *body,
        "        }",
        *stores,
        "      }",
        "    }",
        "  }",
        "}",
    ])
    blocks = max(1, ceil_div(nv, nt * it))
    if knobs.get("grid") == "stride":
        blocks = min(blocks, sm_count * max(1, 2048 // nt))
    return Built(_header(src), [("kf_gen", (blocks,), (nt,), args, 0)], [])


# ---- reduction -----------------------------------------------------------------------

@dataclass
class RedLayout:
    ksizes: list[int]
    kstrides: list[list[int]]  # per tensor: outputs, loaded inputs, then the logical index
    rsizes: list[int]
    rstrides: list[list[int]]
    kn: int
    rn: int


def reduction_layout(prog: Program) -> RedLayout:
    dims = prog.reduce_dims
    nd = len(prog.domain)
    dom = list(prog.domain)
    logical, acc = [0] * nd, 1
    for d in reversed(dims):
        logical[d] = acc
        acc *= dom[d]
    tensors = [list(s) for s in prog.out_strides] + [list(prog.in_strides[i]) for i in sorted(prog.in_strides)] + [logical]
    kept = [d for d in range(nd) if d not in dims]
    korder = sorted(kept, key=lambda d: -prog.out_strides[0][d])
    # the reduced dims in the memory order of the input read most (the prologue's first load)
    pro = sorted({e.value[0] for e in prog.reduction.operand.walk() if e.op == "load"})
    ref = list(prog.in_strides[pro[0]]) if pro else logical
    rorder = sorted(dims, key=lambda d: -ref[d])
    ks, kst = coalesce(dom, tensors, korder)
    rs, rst = coalesce(dom, tensors, rorder)
    return RedLayout(ks, kst, rs, rst, math.prod(ks), math.prod(rs))


def reduced_is_inner(prog: Program) -> bool:
    """The reduced elements of one output are contiguous in memory (rows suit, not cols)."""
    lay = reduction_layout(prog)
    pro = [t for t, i in enumerate(sorted(prog.in_strides)) if prog.in_strides[i] and any(
        prog.in_strides[i][d] for d in prog.reduce_dims)]
    if not pro:
        return True
    t = len(prog.outputs) + pro[0]
    return lay.rstrides[t][-1] == 1


def reduction_vecs(prog: Program, splits: tuple[int, ...]) -> tuple[int, ...]:
    """Legal vector widths (elements) for the prologue's loads, narrowest first: the reduced
    elements one run contiguous in every tensor the prologue loads, each tensor's kept
    offsets and alignment a multiple of the width, and every split's chunk whole vectors."""
    lay = reduction_layout(prog)
    red = prog.reduction
    loads = sorted({e.value[0] for e in red.operand.walk() if e.op == "load"})
    no = len(prog.outputs)
    tix = {i: no + k for k, i in enumerate(sorted(prog.in_strides))}
    out = [1]
    if len(lay.rsizes) != 1 or not loads:
        return tuple(out)
    for v in (2, 4, 8, 16):
        ok = all(-(-lay.rn // s) % v == 0 for s in splits)
        for i in loads:
            m, t = prog.inputs[i], tix[i]
            ok &= (lay.rstrides[t][-1] == 1 and v * m.itemsize <= 16 and m.align % (v * m.itemsize) == 0
                   and all(st % v == 0 for st in lay.kstrides[t]))
        if ok:
            out.append(v)
    return tuple(out)


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


def lower_reduction(prog: Program, knobs: dict, sm_count: int) -> Built:
    red = prog.reduction
    kind, dt = red.kind, red.operand.dtype
    st_types = kind.state(dt)
    ns = len(st_types)
    lay = reduction_layout(prog)
    nt, it, split, vec = knobs["threads"], knobs["items"], knobs["split"], knobs.get("vec", 1)
    lanes = 1 if knobs["algo"] == "gen_cols" else (nt if knobs["lanes"] == "block" else knobs["lanes"])
    rows = nt // lanes
    params, args, ptr = _pointers(prog)
    no = len(prog.outputs)
    loaded = sorted(prog.in_strides)
    tix = {i: no + k for k, i in enumerate(loaded)}
    logical_t = no + len(loaded)
    idx = _index_type(prog, 2 * nt * it * vec)
    pro_loads = {e.value[0] for e in red.operand.walk() if e.op == "load"}
    ch = ceil_div(lay.rn, split)
    ident = [_const(e) for e in kind.identity_exprs(dt)]
    st = [f"st{c}" for c in range(ns)]
    lines = [f"typedef {idx} kf_idx;",
             f"constexpr int NT = {nt}; constexpr int LANES = {lanes}; constexpr int ROWS = {rows}; "
             f"constexpr int IT = {it}; constexpr int V = {vec};",
             f"constexpr kf_idx KN = {lay.kn}; constexpr kf_idx RN = {lay.rn}; constexpr kf_idx CH = {ch};"]
    if split > 1:
        params = params + ["unsigned char* __restrict__ ws"]

    def ws_ptr(c: int) -> str:
        return f"reinterpret_cast<{CTYPE[st_types[c]]}*>(ws + {c * split * lay.kn * 8}LL)"

    # kept offsets of every tensor for output q
    kofs = offsets_code("q", lay.ksizes, lay.kstrides, [f"k{t}" for t in range(len(lay.kstrides))], idx)
    rofs = offsets_code("r", lay.rsizes, [lay.rstrides[tix[i]] for i in sorted(pro_loads)] + [lay.rstrides[logical_t]],
                        [f"ro{i}" for i in sorted(pro_loads)] + ["rl"], idx)
    xv = red.operand
    body = [f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(params)}) {{',
            "  const int lane = threadIdx.x % LANES;",
            "  const kf_idx q = (kf_idx)blockIdx.x * ROWS + threadIdx.x / LANES;",
            "  const bool live = q < KN;",
            *[f"  {line}" for line in kofs],
            f"  const kf_idx lo = (kf_idx)blockIdx.y * CH, hi = lo + CH < RN ? lo + CH : RN;",
            *[f"  {CTYPE[t]} {n} = {v};" for n, t, v in zip(st, st_types, ident)],
            "  if (live) {",
            # each lane takes V consecutive elements at a time (V > 1: one vector load per tensor;
            # chunks and rows are whole vectors, reduction_vecs says when)
            "    for (kf_idx r0 = lo + lane * V; r0 < hi; r0 += (kf_idx)LANES * IT * V) {"]
    for i in sorted(pro_loads):
        body.append(f"      {CTYPE[prog.inputs[i].dtype]} x{i}[IT][V];")

    def vector_load(i) -> str:
        ct = CTYPE[prog.inputs[i].dtype]
        if vec == 1:
            return f"x{i}[u][0] = {ptr[i]}[k{tix[i]} + ro{i}];"
        return (f"*reinterpret_cast<kf_vec<{ct}, V>*>(x{i}[u]) = "
                f"*reinterpret_cast<const kf_vec<{ct}, V>*>({ptr[i]} + k{tix[i]} + ro{i});")
    lstride = lay.rstrides[logical_t][-1] if lay.rstrides[logical_t] else 0
    body += ["      kf_i64 ri[IT];",
             "#pragma unroll",
             "      for (int u = 0; u < IT; ++u) {",
             "        const kf_idx r = r0 + (kf_idx)u * LANES * V;",
             "        if (r < hi) {",
             *[f"          {line}" for line in rofs],
             *[f"          {vector_load(i)}" for i in sorted(pro_loads)],
             "          ri[u] = rl;",
             "        }",
             "      }",
             "#pragma unroll",
             "      for (int u = 0; u < IT; ++u) {",
             "        if (r0 + (kf_idx)u * LANES * V < hi) {",
             "#pragma unroll",
             "        for (int j = 0; j < V; ++j) {"]

    def pro_load(i, stored):
        return f"x{i}[u][j]" if i in pro_loads else f"{ptr[i]}[k{tix[i]}]"

    em = Emitter("p", {"ridx": f"(ri[u] + (kf_i64)j * {lstride})"}, pro_load)
    x = em(xv)
    lift = kind.lift_exprs(Expr.var("x", dt))
    em.env["x"] = x
    lifted = [em(e) for e in lift]
    body += [f"          {line}" for line in em.lines]
    body += [f"          {line}" for line in _merge_block(kind, dt, st, lifted, "u")]
    body += ["        }", "        }", "      }", "    }", "  }"]
    # lanes -> lane 0 of the group: shuffles within a warp, then shared memory across warps
    w = min(lanes, 32)
    if w > 1:
        body.append("#pragma unroll")
        body.append(f"  for (int o = {w // 2}; o > 0; o >>= 1) {{")
        other = [f"sh{c}" for c in range(ns)]
        body += [f"    const {CTYPE[t]} {o} = {_shfl(n, t, 'o', w)};" for o, n, t in zip(other, st, st_types)]
        body += [f"    {line}" for line in _merge_block(kind, dt, st, other, "s")]
        body.append("  }")
    if lanes > 32:
        nw = lanes // 32
        body += [f"  __shared__ {CTYPE[t]} sm{c}[ROWS][{nw}];" for c, t in enumerate(st_types)]
        body.append("  if (lane % 32 == 0) {")
        body += [f"    sm{c}[threadIdx.x / LANES][lane / 32] = {n};" for c, n in enumerate(st)]
        body += ["  }", "  __syncthreads();", "  if (lane == 0) {", f"    for (int wi = 1; wi < {nw}; ++wi) {{"]
        other = [f"sm{c}[threadIdx.x / LANES][wi]" for c in range(ns)]
        body += [f"      {line}" for line in _merge_block(kind, dt, st, other, "w")]
        body += ["    }", "  }"]

    def epilogue(state: list[str], indent: str) -> list[str]:
        def epi_load(i, stored):
            return f"{ptr[i]}[k{tix[i]}]"
        em2 = Emitter("e", {f"s{c}": n for c, n in enumerate(state)}, epi_load)
        res = [em2(e) for e in prog.results]
        out = [indent + line for line in em2.lines]
        for j, (m, r) in enumerate(zip(prog.outputs, res)):
            out.append(f"{indent}out{j}[k{j}] = {convert(r, prog.results[j].dtype, m.dtype)};")
        return out

    if split == 1:
        body += ["  if (live && lane == 0) {", *epilogue(st, "    "), "  }", "}"]
    else:
        body += ["  if (live && lane == 0) {"]
        body += [f"    {ws_ptr(c)}[(kf_idx)blockIdx.y * KN + q] = {n};" for c, n in enumerate(st)]
        body += ["  }", "}"]
        fin_params = [p for p in params]
        body += [f'extern "C" __global__ void __launch_bounds__(256) kf_gen_finish({", ".join(fin_params)}) {{',
                 "  const kf_idx q = (kf_idx)blockIdx.x * 256 + threadIdx.x;",
                 "  if (q >= KN) return;",
                 *[f"  {line}" for line in kofs],
                 *[f"  {CTYPE[t]} {n} = {ws_ptr(c)}[q];" for c, (n, t) in enumerate(zip(st, st_types))],
                 f"  for (int s = 1; s < {split}; ++s) {{",
                 *[f"    const {CTYPE[t]} o{c} = {ws_ptr(c)}[(kf_idx)s * KN + q];" for c, t in enumerate(st_types)],
                 *[f"    {line}" for line in _merge_block(kind, dt, st, [f"o{c}" for c in range(ns)], "f")],
                 "  }",
                 *epilogue(st, "  "),
                 "}"]
    src = "\n".join(lines + body)
    grid = (ceil_div(lay.kn, rows), split)
    kernels = [("kf_gen", grid, (nt,), args + ([{"ws": 0}] if split > 1 else []), 0)]
    workspace = []
    if split > 1:
        kernels.append(("kf_gen_finish", (ceil_div(lay.kn, 256),), (256,), args + [{"ws": 0}], 0))
        workspace = [ns * split * lay.kn * 8]
    return Built(_header(src), kernels, workspace)


# ---- scan ------------------------------------------------------------------------------

@dataclass
class _ScanLines:
    """What both scan kernels share: the lines (kept dims coalesced, the offsets of line q
    in every tensor as code), each tensor's stride along the scan dim, the operand's lifted
    state at element i (its statements in `operand`), and the epilogue's stores at i."""
    params: list
    args: list
    idx: str  # the index type
    kn: int
    length: int
    kofs: list[str]
    operand: list[str]
    lifted: str
    epilogue: list[str]  # statements computing the outputs from st0 and storing them at i


def _scan_lines(prog: Program, idx_extra: int) -> _ScanLines:
    scan = prog.scan
    params, args, ptr = _pointers(prog)
    no = len(prog.outputs)
    loaded = sorted(prog.in_strides)
    tix = {i: no + k for k, i in enumerate(loaded)}
    tensors = [list(s) for s in prog.out_strides] + [list(prog.in_strides[i]) for i in loaded]
    kept = [d for d in range(len(prog.domain)) if d != scan.dim]
    ks, kst = coalesce(list(prog.domain), tensors, sorted(kept, key=lambda d: -prog.out_strides[0][d]))
    sd = [t[scan.dim] for t in tensors]
    idx = _index_type(prog, idx_extra)
    kofs = offsets_code("q", ks, kst, [f"k{t}" for t in range(len(tensors))], idx)

    def load(i, stored):
        return f"{ptr[i]}[k{tix[i]} + i * {sd[tix[i]]}]"

    em = Emitter("p", {}, load)
    x = em(scan.operand)
    (lift,) = scan.kind.lift_exprs(Expr.var("x", scan.operand.dtype))
    em.env["x"] = x
    lifted = em(lift)
    epi = Emitter("e", {"s0": "st0"}, load)
    res = [epi(e) for e in prog.results]
    stores = [f"out{j}[k{j} + i * {sd[j]}] = {convert(r, prog.results[j].dtype, m.dtype)};"
              for j, (m, r) in enumerate(zip(prog.outputs, res))]
    return _ScanLines(params, args, idx, math.prod(ks), prog.domain[scan.dim], kofs, em.lines, lifted,
                      epi.lines + stores)


def lower_scan(prog: Program, knobs: dict) -> Built:
    """One thread per line along the scan dim, walking it in order: every layout, no
    cooperation between threads (coalesced when the scan dim is not the innermost)."""
    scan = prog.scan
    kind, dt = scan.kind, scan.operand.dtype
    (st_type,) = kind.state(dt)
    nt, unroll = knobs["threads"], knobs["unroll"]
    sl = _scan_lines(prog, 2 * nt)
    (ident,) = kind.identity_exprs(dt)
    step = _merge_block(kind, dt, ["st0"], [sl.lifted], "u")
    before, after = (sl.epilogue, []) if scan.exclusive else ([], sl.epilogue)
    body = [f"typedef {sl.idx} kf_idx;",
            f"constexpr int NT = {nt}; constexpr kf_idx KN = {sl.kn}; constexpr kf_idx LEN = {sl.length};",
            f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(sl.params)}) {{',
            "  const kf_idx q = (kf_idx)blockIdx.x * NT + threadIdx.x;",
            "  if (q >= KN) return;",
            *[f"  {line}" for line in sl.kofs],
            f"  {CTYPE[st_type]} st0 = {_const(ident)};",
            f"#pragma unroll {unroll}",
            "  for (kf_idx i0 = 0; i0 < LEN; ++i0) {",
            f"    const kf_idx i = {'LEN - 1 - i0' if scan.reverse else 'i0'};",
            *[f"    {line}" for line in sl.operand + before + step + after],
            "  }",
            "}"]
    return Built(_header("\n".join(body)), [("kf_gen", (ceil_div(sl.kn, nt),), (nt,), sl.args, 0)], [])


def scan_is_inner(prog: Program) -> bool:
    """The scanned dim is the innermost in memory for the first output (lines are contiguous)."""
    return prog.out_strides[0][prog.scan.dim] == 1 and prog.domain[prog.scan.dim] > 1


def lower_scan_block(prog: Program, knobs: dict) -> Built:
    """One block per line along the scan dim (for lines contiguous in memory): in chunks of
    threads x items elements, each thread scans its `items` consecutive elements, a warp
    scans its threads' totals with shuffles, warp 0 scans the warps' totals in shared memory,
    and a carry takes the line on to the next chunk. The merge is associative, so the tree
    gives eager's answer; floating sums fold at most `items` elements in sequence per level."""
    scan = prog.scan
    kind, dt = scan.kind, scan.operand.dtype
    (st_type,) = kind.state(dt)
    T = CTYPE[st_type]
    nt, it = knobs["threads"], knobs["items"]
    sl = _scan_lines(prog, 2 * nt * it)
    (ident,) = kind.identity_exprs(dt)
    zero = _const(ident)

    def merged(into: str, other: str, tag: str) -> list[str]:
        return _merge_block(kind, dt, [into], [other], tag)

    element = f"const kf_idx i = {'LEN - 1 - j' if scan.reverse else 'j'};"

    def warp_scan(v: str, tag: str) -> list[str]:  # v = the inclusive scan of v over the warp's lanes
        return ["#pragma unroll", "for (int o = 1; o < 32; o <<= 1) {",
                f"  {T} t{tag} = {_shfl(v, st_type, 'o', 32, 'up')};",
                *[f"  {line}" for line in merged(f"t{tag}", v, tag)],
                f"  if (lane >= o) {v} = t{tag};", "}"]

    # the state each output reads: the elements before this one (exclusive) or up to it
    before = ([f"if (u > 0) {{", *[f"  {line}" for line in merged("st0", "v[u - 1]", "x")], "}"] if scan.exclusive
              else merged("st0", "v[u]", "x"))
    body = [f"typedef {sl.idx} kf_idx;",
            f"constexpr int NT = {nt}; constexpr int IT = {it}; constexpr int NW = NT / 32; "
            f"constexpr kf_idx LEN = {sl.length};",
            f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(sl.params)}) {{',
            "  const kf_idx q = blockIdx.x;",
            *[f"  {line}" for line in sl.kofs],
            "  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;",
            f"  __shared__ {T} sw[NW];",
            f"  {T} carry = {zero};",
            "  for (kf_idx c0 = 0; c0 < LEN; c0 += (kf_idx)NT * IT) {",
            f"    {T} v[IT];",
            f"    {T} tot = {zero};",
            "#pragma unroll",
            "    for (int u = 0; u < IT; ++u) {",
            "      const kf_idx j = c0 + (kf_idx)threadIdx.x * IT + u;",
            f"      {T} xu = {zero};",
            "      if (j < LEN) {",
            f"        {element}",
            *[f"        {line}" for line in sl.operand],
            f"        xu = {sl.lifted};",
            "      }",
            *[f"      {line}" for line in merged("tot", "xu", "a")],
            "      v[u] = tot;",
            "    }",
            f"    {T} winc = tot;",
            *[f"    {line}" for line in warp_scan("winc", "w")],
            f"    {T} wexc = {_shfl('winc', st_type, 1, 32, 'up')};",
            f"    if (lane == 0) wexc = {zero};",
            "    __syncthreads();  // the last chunk's reads of sw are done",
            "    if (lane == 31) sw[warp] = winc;",
            "    __syncthreads();",
            "    if (warp == 0) {",
            f"      {T} s = lane < NW ? sw[lane] : {zero};",
            *[f"      {line}" for line in warp_scan("s", "b")],
            "      if (lane < NW) sw[lane] = s;",
            "    }",
            "    __syncthreads();",
            f"    {T} pre = carry;",
            f"    const {T} wp = warp > 0 ? sw[warp - 1] : {zero};",
            *[f"    {line}" for line in merged("pre", "wp", "p")],
            *[f"    {line}" for line in merged("pre", "wexc", "q")],
            "#pragma unroll",
            "    for (int u = 0; u < IT; ++u) {",
            "      const kf_idx j = c0 + (kf_idx)threadIdx.x * IT + u;",
            "      if (j < LEN) {",
            f"        {element}",
            f"        {T} st0 = pre;",
            *[f"        {line}" for line in before],
            *[f"        {line}" for line in sl.epilogue],
            "      }",
            "    }",
            f"    const {T} bt = sw[NW - 1];",
            *[f"    {line}" for line in merged("carry", "bt", "c")],
            "  }",
            "}"]
    return Built(_header("\n".join(body)), [("kf_gen", (sl.kn,), (nt,), sl.args, 0)], [])


# ---- window (pooling) -------------------------------------------------------------------

def lower_window(prog: Program, knobs: dict) -> Built:
    """One thread per output point folding its window over the last k dims (k = 2 or 3;
    padding skipped), then the epilogue."""
    w = prog.window
    m = prog.inputs[w.input]
    dt = opmath(m.dtype)
    kind = w.kind
    st_types = kind.state(dt)
    nt, unroll = knobs["threads"], knobs["unroll"]
    params, args, ptr = _pointers(prog)
    nd, k = len(prog.domain), len(w.kernel)
    order = sorted(range(nd), key=lambda d: -prog.out_strides[0][d])
    ist = prog.in_strides[w.input]
    size = m.shape[-k:]
    pooled = range(k)  # pooled dim i is domain dim nd - k + i
    idx = _index_type(prog, 2 * nt)
    n_out = math.prod(prog.domain)
    # coordinates of output point q, innermost (in the first output's memory order) first
    coords = [f"  {idx} e_ = q;"]
    for d in reversed(order):
        coords.append(f"  const {idx} c{d} = e_ % {prog.domain[d]}; e_ /= {prog.domain[d]};")
    base = " + ".join([f"c{d} * {ist[d]}" for d in range(nd - k)] or ["0"])
    outs = [" + ".join([f"c{d} * {st[d]}" for d in range(nd)]) for st in prog.out_strides]
    st = [f"st{c}" for c in range(len(st_types))]
    em = Emitter("p", {"ridx": "ri", "x": "xv"}, None)
    lifted = [em(e) for e in kind.lift_exprs(Expr.var("x", dt))]
    span = " * ".join(f"(hi{i} - lo{i})" for i in pooled)
    clipped = " * ".join(f"((hi{i} < N{i} ? hi{i} : N{i}) - (lo{i} > 0 ? lo{i} : 0))" for i in pooled)
    count = str(w.divisor_override) if w.divisor_override else span if w.count_include_pad else clipped
    epi = Emitter("e", {**{f"s{c}": n for c, n in enumerate(st)}, "count": "cnt"}, None)
    res = [epi(e) for e in prog.results]
    loops, pad = [], "  "
    for i in pooled:  # one loop per pooled dim, outermost first; a point in the padding is skipped
        loops += [f"#pragma unroll {unroll}",
                  f"{pad}for (int k{i} = 0; k{i} < {w.kernel[i]}; ++k{i}) {{",
                  f"{pad}  const int i{i} = o{i} * {w.stride[i]} - {w.padding[i]} + k{i} * {w.dilation[i]};",
                  f"{pad}  if (i{i} < 0 || i{i} >= N{i}) continue;"]
        pad += "  "
    at = " + ".join(f"(kf_idx)i{i} * {ist[nd - k + i]}" for i in pooled)
    flat = "(kf_i64)i0"
    for i in pooled[1:]:
        flat = f"({flat} * N{i} + i{i})"
    inner = [f"const {CTYPE[dt]} xv = {convert(f'x[{at}]', m.dtype, dt)};",
             f"const kf_i64 ri = {flat};",
             *em.lines,
             *_merge_block(kind, dt, st, lifted, "u")]
    closing = ["  " * (i + 1) + "}" for i in reversed(pooled)]
    body = [f"typedef {idx} kf_idx;",
            f"constexpr int NT = {nt}; " + " ".join(f"constexpr int N{i} = {size[i]};" for i in pooled),
            f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(params)}) {{',
            "  const kf_idx q = (kf_idx)blockIdx.x * NT + threadIdx.x;",
            f"  if (q >= {n_out}) return;",
            *coords,
            f"  const {CTYPE[m.dtype]}* x = {ptr[w.input]} + ({base});",
            *[f"  const int o{i} = (int)c{nd - k + i};" for i in pooled],
            *[f"  {CTYPE[t]} {n} = {_const(v)};" for n, t, v in zip(st, st_types, kind.identity_exprs(dt))],
            *loops,
            *[f"{pad}{line}" for line in inner],
            *closing,
            # the window's extent along each dim, clipped to the padded input (eager's divisor)
            *[f"  const int lo{i} = o{i} * {w.stride[i]} - {w.padding[i]}, hi{i} = lo{i} + {w.kernel[i]} < N{i} + "
              f"{w.padding[i]} ? lo{i} + {w.kernel[i]} : N{i} + {w.padding[i]};" for i in pooled],
            f"  const kf_i64 cnt = {count};",
            *[f"  {line}" for line in epi.lines],
            *[f"  out{j}[{o}] = {convert(r, prog.results[j].dtype, om.dtype)};"
              for j, (om, r, o) in enumerate(zip(prog.outputs, res, outs))],
            "}"]
    return Built(_header("\n".join(body)), [("kf_gen", (ceil_div(n_out, nt),), (nt,), args, 0)], [])
