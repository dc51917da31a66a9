"""Reductions (`algo` "rows", "cols", two passes with `split`) and normalizations, a reduction
whose epilogue runs over the reduced elements (one kernel, or `gen_norm_split` for few long rows)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...proposers.builtin.common import ceil_div
from ...cards import TensorMeta
from ..ir import Expr, Program
from .emit import (CTYPE, Built, Emitter, _const, _header, _index_type, _merge_block, _pointers, _shfl, coalesce,
                   convert, offsets_code)

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
    if split > 1 or prog.normalizes:
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
            "  const kf_idx lo = (kf_idx)blockIdx.y * CH, hi = lo + CH < RN ? lo + CH : RN;",
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

    # a normalization's per-element outputs are left to kf_gen_apply (lower_norm_split)
    once = [j for j, m in enumerate(prog.outputs) if m.numel and not any(prog.out_strides[j][d] for d in red.dims)]

    def epilogue(state: list[str], indent: str) -> list[str]:
        def epi_load(i, stored):
            return f"{ptr[i]}[k{tix[i]}]"
        em2 = Emitter("e", {f"s{c}": n for c, n in enumerate(state)}, epi_load)
        res = {j: em2(prog.results[j]) for j in once}
        out = [indent + line for line in em2.lines]
        for j in once:
            out.append(f"{indent}out{j}[k{j}] = {convert(res[j], prog.results[j].dtype, prog.outputs[j].dtype)};")
        if prog.normalizes:  # the row's state, for kf_gen_apply
            out += [f"{indent}{ws_ptr(c)}[q] = {n};" for c, n in enumerate(state)]
        return out

    if split == 1 and not prog.normalizes:
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
    staged = split > 1 or prog.normalizes
    kernels = [("kf_gen", grid, (nt,), args + ([{"ws": 0}] if staged else []), 0)]
    workspace = []
    if staged:
        kernels.append(("kf_gen_finish", (ceil_div(lay.kn, 256),), (256,), args + [{"ws": 0}], 0))
        workspace = [ns * split * lay.kn * 8]
    return Built(_header(src), kernels, workspace)


# ---- normalization (a reduction whose epilogue runs over the reduced elements) ----------

def _shfl_idx(x: str, dtype: str, width: int) -> str:
    """x from lane 0 of this thread's group of `width` lanes."""
    if dtype in ("bool", "int8", "uint8", "int16"):
        return f"({CTYPE[dtype]})__shfl_sync(0xffffffffu, (int){x}, 0, {width})"
    return f"__shfl_sync(0xffffffffu, {x}, 0, {width})"


def _loads_outside(exprs: list[Expr], sub: Expr) -> set[int]:
    """The inputs `exprs` load other than through the subtree `sub`."""
    seen: set[Expr] = set()
    found: set[int] = set()

    def go(e: Expr) -> None:
        if e in seen or e == sub:
            return
        seen.add(e)
        if e.op == "load":
            found.add(e.value[0])
        for a in e.args:
            go(a)

    for e in exprs:
        go(e)
    return found


def _norm_tensors(prog: Program) -> list[tuple[int, TensorMeta]]:
    """(layout index, meta) of every tensor a normalization reads or writes per element."""
    no = len(prog.outputs)
    out = [(j, m) for j, m in enumerate(prog.outputs) if m.numel]
    return out + [(no + k, prog.inputs[i]) for k, i in enumerate(sorted(prog.in_strides))]


def norm_vecs(prog: Program) -> tuple[int, ...]:
    """Legal vector widths (elements) along the innermost reduced dim, narrowest first."""
    lay = reduction_layout(prog)
    out = []
    for v in (1, 2, 4, 8, 16):
        ok = lay.rsizes[-1] % v == 0
        for t, m in _norm_tensors(prog):
            if lay.rstrides[t][-1] == 1 and v > 1:
                ok &= (v * m.itemsize <= 16 and m.align % (v * m.itemsize) == 0
                       and all(s % v == 0 for s in lay.kstrides[t] + lay.rstrides[t][:-1]))
        if ok:
            out.append(v)
    return tuple(out)


def norm_staging(prog: Program, knobs: dict) -> str:
    """Where pass 1 keeps the row's loaded values for the epilogue: the knob's choice when it
    fits (registers: at most 32 values a thread, 16 from 512 threads up; shared memory: 40 KB
    a block), else the next one down ("reload": the epilogue reads them again, from L2)."""
    lay = reduction_layout(prog)
    nt, v = knobs["threads"], knobs["vec"]
    lanes = nt if knobs["lanes"] == "block" else knobs["lanes"]
    per = ceil_div(lay.rn // v, lanes)
    pro = sorted({e.value[0] for e in prog.reduction.operand.walk() if e.op == "load"})
    regs = per * v * len(pro) <= (16 if nt >= 512 else 32)
    smem = nt * per * v * sum(prog.inputs[i].itemsize for i in pro) <= 40 * 1024
    order = ("regs", "smem", "reload")
    for s in order[order.index(knobs["staging"]):]:
        if s == "reload" or (s == "regs" and regs) or (s == "smem" and smem):
            return s
    return "reload"


def _chunk_load(src: str, ct: str, off: str, inner: int, v: int, dest: str) -> list[str]:
    """dest[0..v) = the v elements at src + off along a dim of stride `inner` (one vector access
    when they are contiguous)."""
    if inner == 1 and v > 1:
        return [f"*reinterpret_cast<kf_vec<{ct}, {v}>*>({dest}) = *reinterpret_cast<const kf_vec<{ct}, {v}>*>({src} + {off});"]
    return ["#pragma unroll", f"for (int jj = 0; jj < {v}; ++jj) {dest}[jj] = {src}[{off} + jj * {inner}];"]


def _chunk_store(dst: str, ct: str, off: str, inner: int, v: int, src: str) -> list[str]:
    if inner == 1 and v > 1:
        return [f"*reinterpret_cast<kf_vec<{ct}, {v}>*>({dst} + {off}) = *reinterpret_cast<const kf_vec<{ct}, {v}>*>({src});"]
    return ["#pragma unroll", f"for (int jj = 0; jj < {v}; ++jj) {dst}[{off} + jj * {inner}] = {src}[jj];"]


def _group_merge(kind, dt: str, st: list[str], st_types: list[str], lanes: int, tag: str) -> list[str]:
    """Statements: the state `st` of each of a row's `lanes` threads merged, and every lane of
    the group holding the merged state (a warp's shuffles, then shared memory across warps)."""
    out: list[str] = []
    w = min(lanes, 32)
    if w > 1:
        other = [f"sh{tag}{c}" for c in range(len(st))]
        out += ["#pragma unroll", f"  for (int o = {w // 2}; o > 0; o >>= 1) {{"]
        out += [f"    const {CTYPE[t]} {o} = {_shfl(n, t, 'o', w)};" for o, n, t in zip(other, st, st_types)]
        out += [f"    {line}" for line in _merge_block(kind, dt, st, other, f"s{tag}")] + ["  }"]
    if lanes > 32:
        nw = lanes // 32
        sm = [f"sm{tag}{c}" for c in range(len(st))]
        out += [f"  __shared__ {CTYPE[t]} {a}[ROWS][{nw}];" for a, t in zip(sm, st_types)]
        out += ["  if (lane % 32 == 0) {", *[f"    {a}[threadIdx.x / LANES][lane / 32] = {n};" for a, n in zip(sm, st)],
                "  }", "  __syncthreads();", *[f"  {n} = {a}[threadIdx.x / LANES][0];" for a, n in zip(sm, st)],
                f"  for (int wi = 1; wi < {nw}; ++wi) {{"]
        out += [f"    {line}" for line in _merge_block(kind, dt, st, [f"{a}[threadIdx.x / LANES][wi]" for a in sm],
                                                    f"w{tag}")] + ["  }"]
    elif w > 1:  # every lane of the group takes lane 0's state
        out += [f"  {n} = {_shfl_idx(n, t, w)};" for n, t in zip(st, st_types)]
    return out


def lower_norm(prog: Program, knobs: dict) -> Built:
    """A group of `lanes` threads per row (the reduced elements of one kept point): pass 1
    folds the prologue over the row in chunks of `vec` elements, keeping the loaded values
    (registers or shared memory when they fit); the state is merged across the group and
    broadcast to every lane; pass 2 runs the epilogue at every element of the row (from the
    kept values, or reading the row again) and stores it; lane 0 stores the statistics."""
    red = prog.reduction
    kind, dt = red.kind, red.operand.dtype
    st_types = kind.state(dt)
    ns = len(st_types)
    lay = reduction_layout(prog)
    nt, v = knobs["threads"], knobs["vec"]
    lanes = nt if knobs["lanes"] == "block" else knobs["lanes"]
    rows = nt // lanes
    staging = norm_staging(prog, knobs)
    nc = lay.rn // v
    per = ceil_div(nc, lanes)
    params, args, ptr = _pointers(prog)
    no = len(prog.outputs)
    loaded = sorted(prog.in_strides)
    tix = {i: no + k for k, i in enumerate(loaded)}
    logical_t = no + len(loaded)
    idx = _index_type(prog, 2 * nt * v)
    dims = red.dims
    pro = sorted({e.value[0] for e in red.operand.walk() if e.op == "load"})
    full = [j for j, m in enumerate(prog.outputs) if m.numel and any(prog.out_strides[j][d] for d in dims)]
    kept = [j for j, m in enumerate(prog.outputs) if m.numel and j not in full]
    epi = sorted({e.value[0] for j in full for e in prog.results[j].walk() if e.op == "load"})
    st = [f"st{c}" for c in range(ns)]
    ident = [_const(e) for e in kind.identity_exprs(dt)]
    staged = staging != "reload"
    # With the row in registers, they keep the reduction's operand (computed once, in pass 1) rather
    # than the inputs it is computed from, where the epilogue reads those only through it: later
    # phases and the epilogue then neither recompute the prologue nor hold its inputs (a mask
    # softmax's scores and mask, added and rounded to bf16 in every pass before).
    held = staging == "regs" and not (_loads_outside([prog.results[j] for j in full], red.operand) & set(pro))

    def arr(i: int, p: int) -> str:
        """The V values of input i in this chunk (pass p)."""
        if held:
            return f"xv{i}"
        if staged and i in pro:
            return f"x{i}[u]" if staging == "regs" else f"sx{i}[threadIdx.x / LANES][c]"
        return f"xv{i}"

    def load_chunk(i: int, dest: str) -> list[str]:
        t = tix[i]
        return _chunk_load(ptr[i], CTYPE[prog.inputs[i].dtype], f"k{t} + r{t}", lay.rstrides[t][-1], v, dest)

    def loop(body: list[str]) -> list[str]:
        if staged:
            head = ["#pragma unroll", "for (int u = 0; u < P; ++u) {", "  const kf_idx c = (kf_idx)u * LANES + lane;",
                    "  if (c < NC) {"]
            return head + [f"    {line}" for line in body] + ["  }", "}"]
        return ["for (kf_idx c = lane; c < NC; c += LANES) {"] + [f"  {line}" for line in body] + ["}"]

    def offsets(ts: list[int]) -> list[str]:
        return offsets_code("c * V", lay.rsizes, [lay.rstrides[t] for t in ts], [f"r{t}" for t in ts], idx)

    # pass 1: the fold, in one pass of the kind's merge, or (staged) one pass per phase of it
    phases = kind.phases if staged else ()
    # (kind, state names, their dtypes, the element's value from x and the earlier phases' states)
    folds = ([(kind, st, list(st_types), lambda x, _: x)] if not phases else
             [(k, [st[c]], [st_types[c]], lift) for c, (k, lift) in enumerate(phases)])
    p1s = []
    for f, (fk, fst, ftypes, lift) in enumerate(folds):
        p1 = offsets([tix[i] for i in pro] + [logical_t])
        for i in pro:
            if not staged or held and f == 0:
                p1.append(f"{CTYPE[prog.inputs[i].dtype]} xv{i}[V];")
            if f == 0:
                p1 += load_chunk(i, arr(i, 1))
        earlier = {f"kf_phase{c}": st[c] for c in range(f)}
        em = Emitter(f"p{f}_", {"ridx": f"((kf_i64)r{logical_t} + (kf_i64)jj * {lay.rstrides[logical_t][-1]})", **earlier},
                     lambda i, stored: f"{arr(i, 1)}[jj]")
        if held and f > 0:
            em.bind(red.operand, "xo[u][jj]")
        x = em(red.operand)
        keep = [f"xo[u][jj] = {x};"] if held and f == 0 else []
        em.env["x"] = x
        value = lift(Expr.var("x", dt), tuple(Expr.var(f"kf_phase{c}", t) for c, t in enumerate(st_types[:f])))
        lifted = [em(e) for e in fk.lift_exprs(value)]
        p1 += ["#pragma unroll", "for (int jj = 0; jj < V; ++jj) {", *[f"  {line}" for line in em.lines + keep],
               *[f"  {line}" for line in _merge_block(fk, dt, fst, lifted, f"u{f}")], "}"]
        p1s.append((fk, fst, ftypes, p1))

    # pass 2: the epilogue at every element
    outs2 = [j for j in full]
    p2 = offsets(sorted({tix[i] for i in epi} | set(outs2)))
    for i in epi:
        if not (staged and i in pro):
            p2.append(f"{CTYPE[prog.inputs[i].dtype]} xv{i}[V];")
            p2 += load_chunk(i, f"xv{i}")
    p2 += [f"{CTYPE[prog.outputs[j].dtype]} o{j}[V];" for j in outs2]
    em2 = Emitter("e", {f"s{c}": n for c, n in enumerate(st)}, lambda i, stored: f"{arr(i, 2)}[jj]")
    if held:
        em2.bind(red.operand, "xo[u][jj]")
    res = {j: em2(prog.results[j]) for j in outs2}
    p2 += ["#pragma unroll", "for (int jj = 0; jj < V; ++jj) {", *[f"  {line}" for line in em2.lines],
           *[f"  o{j}[jj] = {convert(res[j], prog.results[j].dtype, prog.outputs[j].dtype)};" for j in outs2], "}"]
    for j in outs2:
        p2 += _chunk_store(f"out{j}", CTYPE[prog.outputs[j].dtype], f"k{j} + r{j}", lay.rstrides[j][-1], v, f"o{j}")

    kofs = offsets_code("q", lay.ksizes, lay.kstrides, [f"k{t}" for t in range(len(lay.kstrides))], idx)
    body = [f"typedef {idx} kf_idx;",
            f"constexpr int NT = {nt}; constexpr int LANES = {lanes}; constexpr int ROWS = {rows}; "
            f"constexpr int V = {v}; constexpr int P = {per};",
            f"constexpr kf_idx KN = {lay.kn}; constexpr kf_idx NC = {nc};",
            f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(params)}) {{',
            "  const int lane = threadIdx.x % LANES;",
            "  const kf_idx q = (kf_idx)blockIdx.x * ROWS + threadIdx.x / LANES;",
            "  const bool live = q < KN;",
            *[f"  {line}" for line in kofs],
            *[f"  {CTYPE[t]} {n} = {val};" for n, t, val in zip(st, st_types, ident)]]
    if held:
        body.append(f"  {CTYPE[dt]} xo[P][V];")
    elif staging == "regs":
        body += [f"  {CTYPE[prog.inputs[i].dtype]} x{i}[P][V];" for i in pro]
    elif staging == "smem":
        body += [f"  __shared__ {CTYPE[prog.inputs[i].dtype]} sx{i}[ROWS][P * LANES][V];" for i in pro]
    for f, (fk, fst, ftypes, p1) in enumerate(p1s):
        body += ["  if (live) {", *[f"    {line}" for line in loop(p1)], "  }"]
        body += _group_merge(fk, dt, fst, ftypes, lanes, f"{f}_" if phases else "")
    body += ["  if (live) {", *[f"    {line}" for line in loop(p2)], "  }"]
    if kept:
        em3 = Emitter("f", {f"s{c}": n for c, n in enumerate(st)}, lambda i, stored: f"{ptr[i]}[k{tix[i]}]")
        res3 = {j: em3(prog.results[j]) for j in kept}
        body += ["  if (live && lane == 0) {", *[f"    {line}" for line in em3.lines],
                 *[f"    out{j}[k{j}] = {convert(res3[j], prog.results[j].dtype, prog.outputs[j].dtype)};" for j in kept],
                 "  }"]
    body.append("}")
    return Built(_header("\n".join(body)), [("kf_gen", (ceil_div(lay.kn, rows),), (nt,), args, 0)], [])


def lower_norm_split(prog: Program, knobs: dict, sm_count: int) -> Built:
    """The two-pass form, for rows too long or too few for a block each (group norm of one
    image): lower_reduction folds each row over `split` blocks and merges the states (writing
    the statistics), then kf_gen_apply runs the epilogue over every element, grid-wide, in
    chunks of `vec`, reading its row's state from the workspace."""
    red = prog.reduction
    kind, dt = red.kind, red.operand.dtype
    st_types = kind.state(dt)
    built = lower_reduction(prog, {"algo": "gen_rows", "threads": knobs["threads"], "lanes": "block",
                                   "items": knobs["items"], "split": knobs["split"]}, sm_count)
    lay = reduction_layout(prog)
    v, nta = knobs["vec"], 256
    nc = lay.rn // v
    params, args, ptr = _pointers(prog)
    no = len(prog.outputs)
    tix = {i: no + k for k, i in enumerate(sorted(prog.in_strides))}
    full = [j for j, m in enumerate(prog.outputs) if m.numel and any(prog.out_strides[j][d] for d in red.dims)]
    epi = sorted({e.value[0] for j in full for e in prog.results[j].walk() if e.op == "load"})
    idx = "kf_i64" if lay.kn * lay.rn >= 2**31 - 2**20 else "int"
    kofs = offsets_code("q", lay.ksizes, lay.kstrides, [f"k{t}" for t in range(len(lay.kstrides))], idx)
    ts = sorted({tix[i] for i in epi} | set(full))
    rofs = offsets_code(f"c * {v}", lay.rsizes, [lay.rstrides[t] for t in ts], [f"r{t}" for t in ts], idx)
    body = ["      " + line for line in kofs + rofs]
    for c, t in enumerate(st_types):
        body.append(f"      const {CTYPE[t]} st{c} = reinterpret_cast<const {CTYPE[t]}*>(ws + {c * knobs['split'] * lay.kn * 8}LL)[q];")
    for i in epi:
        t, ct = tix[i], CTYPE[prog.inputs[i].dtype]
        body.append(f"      {ct} xv{i}[{v}];")
        body += ["      " + line for line in _chunk_load(ptr[i], ct, f"k{t} + r{t}", lay.rstrides[t][-1], v, f"xv{i}")]
    em = Emitter("e", {f"s{c}": f"st{c}" for c in range(len(st_types))}, lambda i, stored: f"xv{i}[jj]")
    res = {j: em(prog.results[j]) for j in full}
    body += [f"      {CTYPE[prog.outputs[j].dtype]} o{j}[{v}];" for j in full]
    body += ["#pragma unroll", f"      for (int jj = 0; jj < {v}; ++jj) {{", *[f"        {line}" for line in em.lines],
             *[f"        o{j}[jj] = {convert(res[j], prog.results[j].dtype, prog.outputs[j].dtype)};" for j in full],
             "      }"]
    for j in full:
        body += ["      " + line for line in _chunk_store(f"out{j}", CTYPE[prog.outputs[j].dtype], f"k{j} + r{j}",
                                                          lay.rstrides[j][-1], v, f"o{j}")]
    total = lay.kn * nc
    src = "\n".join([
        f'extern "C" __global__ void __launch_bounds__({nta}) kf_gen_apply({", ".join(params)}, '
        "const unsigned char* __restrict__ ws) {",
        f"  for ({idx} g = ({idx})blockIdx.x * {nta} + threadIdx.x; g < ({idx}){total}; g += ({idx})gridDim.x * {nta}) {{",
        f"    const {idx} q = g / {nc}, c = g % {nc};",
        "    {",
        *body,
        "    }",
        "  }",
        "}"])
    blocks = min(ceil_div(total, nta), sm_count * (2048 // nta) * 4)
    source = built.source + "\n" + src + "\n"
    kernels = built.kernels + [("kf_gen_apply", (blocks,), (nta,), args + [{"ws": 0}], 0)]
    return Built(source, kernels, built.workspace)
