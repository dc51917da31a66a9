"""Normalizations: a reduction whose epilogue runs over the reduced elements (`gen_norm`, one
kernel with a group of lanes per row, or `gen_norm_split` for few long rows)."""

from __future__ import annotations

from ...cards import TensorMeta
from ...proposers.builtin.common import ceil_div
from ..ir import Expr, Program
from .emit import (CTYPE, Built, Emitter, _chunk_block, _const, _header, _index_type, _merge_block, _pointers, _shfl, convert,
                   fast_nodes, offsets_code)
from .reduce import lower_reduction, reduction_layout, reduction_vecs


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


def _runs(prog: Program, lay) -> list[tuple[int, TensorMeta]]:
    """(layout index, meta) of the tensors a normalization reads or writes contiguously along
    the reduced elements; a peeled row's head is counted from the first one's offset."""
    return [(t, m) for t, m in _norm_tensors(prog) if lay.rstrides[t][-1] == 1]


def peel_vecs(prog: Program) -> tuple[int, ...]:
    """Vector widths (elements) gen_norm reaches by peeling each row (lower_norm) where norm_vecs
    does not allow them, a row's length or offsets not being whole vectors (softmax over a
    vocabulary of 50257): the reduced elements one contiguous run in memory, and the first tensor
    along it (the output, mostly) aligned to the width."""
    lay = reduction_layout(prog)
    runs = _runs(prog, lay)
    if len(lay.rsizes) != 1 or not runs:
        return ()
    legal, (_, m0) = norm_vecs(prog), runs[0]
    return tuple(v for v in (2, 4, 8, 16) if v not in legal and lay.rn >= 2 * v
                 and v * m0.itemsize <= 16 and m0.align % (v * m0.itemsize) == 0)


def peeled_vectors(prog: Program, v: int) -> set[int]:
    """The tensors (layout indices) a peeled row reads or writes `v` elements at a time: those
    contiguous along it, aligned to the width and at the same offset from it in every row as the
    first (their kept strides its own modulo the width); the others an element at a time (a layer
    norm's weight, whose row starts aligned where the input's does not)."""
    lay = reduction_layout(prog)
    runs = _runs(prog, lay)
    ref = lay.kstrides[runs[0][0]]
    return {t for t, m in runs if v * m.itemsize <= 16 and m.align % (v * m.itemsize) == 0
            and all((a - b) % v == 0 for a, b in zip(lay.kstrides[t], ref))}


def norm_staging(prog: Program, knobs: dict) -> str:
    """Where pass 1 keeps the row's loaded values for the epilogue: the knob's choice when it
    fits (registers: at most 32 values a thread, 16 from 512 threads up; shared memory: 40 KB
    a block), else the next one down ("reload": the epilogue reads them again, from L2)."""
    lay = reduction_layout(prog)
    nt, v = knobs["threads"], knobs["vec"]
    lanes = nt if knobs["lanes"] == "block" else knobs["lanes"]
    per = ceil_div(lay.rn // v, lanes)
    pro = prog.reduction.loads()
    regs = per * v * len(pro) <= (16 if nt >= 512 else 32)
    smem = nt * per * v * sum(prog.inputs[i].itemsize for i in pro) <= 40 * 1024
    order = ("regs", "smem", "reload")
    for s in order[order.index(knobs["staging"]):]:
        if s == "reload" or (s == "regs" and regs) or (s == "smem" and smem):
            return s
    return "reload"


def _chunk_load(src: str, ct: str, off: str, inner: int, v: int, dest: str, vector: bool = True) -> list[str]:
    """dest[0..v) = the v elements at src + off along a dim of stride `inner` (one vector access
    when they are contiguous, unless not `vector`)."""
    if inner == 1 and v > 1 and vector:
        return [f"*reinterpret_cast<kf_vec<{ct}, {v}>*>({dest}) = *reinterpret_cast<const kf_vec<{ct}, {v}>*>({src} + {off});"]
    return ["#pragma unroll", f"for (int jj = 0; jj < {v}; ++jj) {dest}[jj] = {src}[{off} + jj * {inner}];"]


def _chunk_store(dst: str, ct: str, off: str, inner: int, v: int, src: str, vector: bool = True) -> list[str]:
    if inner == 1 and v > 1 and vector:
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


def _lockstep(a: Expr, b: Expr, into: dict[Expr, Expr]) -> bool:
    """Pairs every subtree of `a` with the same position's in `b` (two trees one function built
    from different leaves); False where their shapes differ."""
    if a.op != b.op or len(a.args) != len(b.args) or a.dtype != b.dtype:
        return a.op == "var" or b.op == "var"  # a leaf replaced by a subtree: paired, not entered
    into[a] = b
    return all(_lockstep(x, y, into) for x, y in zip(a.args, b.args))


def phase_reuse(red, st_types: list[str], results: list[Expr]) -> tuple[Expr, Expr] | None:
    """A subtree the last phase of a staged fold computes at every element and the epilogue
    computes again (softmax's exp(x - max)), where the epilogue reads the operand only through
    it: (the subtree in the epilogue's terms, in the phase's terms). The phase then keeps it in
    place of the held operand, and the epilogue reads it back rather than recomputing it."""
    phases = red.kind.phases
    if not phases:
        return None
    f = len(phases) - 1
    fk, lift = phases[f]
    dt = red.operand.dtype
    ours = fk.lift_exprs(lift(red.operand, tuple(Expr.var(f"s{c}", t) for c, t in enumerate(st_types[:f]))))
    theirs = fk.lift_exprs(lift(Expr.var("x", dt), tuple(Expr.var(f"kf_phase{c}", t) for c, t in enumerate(st_types[:f]))))
    pairs: dict[Expr, Expr] = {}
    if not all(_lockstep(x, y, pairs) for x, y in zip(ours, theirs)):
        return None
    found = _largest(results, lambda e: e == red.operand or (e in pairs and e.op not in ("var", "const", "load")))
    shared = [e for e in found if e != red.operand]
    if red.operand in found or len(shared) != 1:
        return None
    (e,) = shared
    return (e, pairs[e]) if e.dtype == dt else None


def row_invariants(results: list[Expr]) -> list[Expr]:
    """The largest subtrees of the epilogue that read only the fold's state and constants
    (softmax's 1 / sum): computed once a row, not once an element."""
    memo: dict[Expr, bool] = {}

    def invariant(e: Expr) -> bool:
        if e not in memo:
            memo[e] = e.op == "const" or (e.op == "var" and e.value[0] == "s" and e.value[1:].isdigit()) or (
                e.op not in ("load", "var") and bool(e.args) and all(invariant(a) for a in e.args))
        return memo[e]

    return _largest(results, lambda e: bool(e.args) and invariant(e))


def _largest(results: list[Expr], take) -> list[Expr]:
    """The subtrees of `results` that `take` accepts, top down: one taken is not entered; each
    node is looked at once."""
    out: list[Expr] = []
    seen: set[Expr] = set()

    def go(e: Expr) -> None:
        if e in seen:
            return
        seen.add(e)
        if take(e):
            out.append(e)
        else:
            for a in e.args:
                go(a)

    for e in results:
        go(e)
    return out


def lower_norm(prog: Program, knobs: dict) -> Built:
    """A group of `lanes` threads per row (the reduced elements of one kept point): pass 1
    folds the prologue over the row in chunks of `vec` elements, keeping the loaded values
    (registers or shared memory when they fit); the state is merged across the group and
    broadcast to every lane; pass 2 runs the epilogue at every element of the row (from the
    kept values, or reading the row again) and stores it; lane 0 stores the statistics.
    A `vec` that norm_vecs does not allow but peel_vecs does (rows of an odd length) peels each
    row: its elements before the first aligned vector and after the last whole one are taken
    one at a time, the rest as vectors, and both passes read the row (nothing staged)."""
    red = prog.reduction
    kind, dt = red.kind, red.operand.dtype
    st_types = kind.state(dt)
    ns = len(st_types)
    lay = reduction_layout(prog)
    nt, v = knobs["threads"], knobs["vec"]
    peel = v > 1 and v not in norm_vecs(prog)
    assert not peel or v in peel_vecs(prog), f"vector width {v} does not fit these rows"
    lanes = nt if knobs["lanes"] == "block" else knobs["lanes"]
    rows = nt // lanes
    staging = "reload" if peel else norm_staging(prog, knobs)
    nc = lay.rn // v
    per = ceil_div(nc, lanes)
    params, args, ptr = _pointers(prog)
    no = len(prog.outputs)
    loaded = sorted(prog.in_strides)
    tix = {i: no + k for k, i in enumerate(loaded)}
    logical_t = no + len(loaded)
    idx = _index_type(prog, 2 * nt * v)
    dims = red.dims
    pro = red.loads()
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
    reuse = phase_reuse(red, list(st_types), [prog.results[j] for j in full]) if held else None

    def arr(i: int, p: int) -> str:
        """The V values of input i in this chunk (pass p)."""
        if staged and not held and i in pro:
            return f"x{i}[u]" if staging == "regs" else f"sx{i}[threadIdx.x / LANES][c]"
        return f"xv{i}"

    vectors = peeled_vectors(prog, v) if peel else None  # None: every contiguous tensor

    def load_chunk(i: int, dest: str, w: int) -> list[str]:
        t = tix[i]
        return _chunk_load(ptr[i], CTYPE[prog.inputs[i].dtype], f"k{t} + r{t}", lay.rstrides[t][-1], w, dest,
                           vectors is None or t in vectors)

    def loop(body: list[str], count: str) -> list[str]:
        if staged:
            head = ["#pragma unroll", "for (int u = 0; u < P; ++u) {", "  const kf_idx c = (kf_idx)u * LANES + lane;",
                    "  if (c < NC) {"]
            return head + [f"    {line}" for line in body] + ["  }", "}"]
        return [f"for (kf_idx c = lane; c < {count}; c += LANES) {{"] + [f"  {line}" for line in body] + ["}"]

    def offsets(ts: list[int], first: str) -> list[str]:
        return offsets_code(first, lay.rsizes, [lay.rstrides[t] for t in ts], [f"r{t}" for t in ts], idx)

    # pass 1: the fold, in one pass of the kind's merge, or (staged) one pass per phase of it
    phases = kind.phases if staged else ()
    # (kind, state names, their dtypes, the element's value from x and the earlier phases' states)
    folds = ([(kind, st, list(st_types), lambda x, _: x)] if not phases else
             [(k, [st[c]], [st_types[c]], lift) for c, (k, lift) in enumerate(phases)])

    def fold_pass(f: int, w: int, first: str, tag: str) -> list[str]:
        """Pass 1's statements for fold f over `w` elements at element `first` of the row."""
        fk, fst, ftypes, lift = folds[f]
        W = "V" if w == v else str(w)
        p1 = offsets([tix[i] for i in pro] + [logical_t], first)
        for i in pro:
            if not staged or held and f == 0:
                p1.append(f"{CTYPE[prog.inputs[i].dtype]} xv{i}[{W}];")
            if f == 0:
                p1 += load_chunk(i, arr(i, 1), w)

        def ridx(j) -> str:  # the logical index of element j of this chunk
            return f"((kf_i64)r{logical_t} + (kf_i64){j} * {lay.rstrides[logical_t][-1]})"
        if not phases and fk.chunk is not None and w > 1:  # a chunk's V elements folded at once
            return p1 + _chunk_block(fk, dt, fst, red.operand, w, lambda i, stored, j: f"{arr(i, 1)}[{j}]",
                                     lambda j: {"ridx": ridx(j)}, f"{tag}{f}",
                                     after=(lambda j, name: [f"xo[u][{j}] = {name};"]) if held else None)
        earlier = {f"kf_phase{c}": st[c] for c in range(f)}
        em = Emitter(f"{tag}{f}_", {"ridx": ridx("jj"), **earlier},
                     lambda i, stored: f"{arr(i, 1)}[jj]")
        if held and f > 0:
            em.bind(red.operand, "xo[u][jj]")
        x = em(red.operand)
        keep = [f"xo[u][jj] = {x};"] if held and f == 0 else []
        em.env["x"] = x
        value = lift(Expr.var("x", dt), tuple(Expr.var(f"kf_phase{c}", t) for c, t in enumerate(st_types[:f])))
        lifted = [em(e) for e in fk.lift_exprs(value)]
        if reuse and f == len(folds) - 1:  # the epilogue's subtree, computed here, over the operand
            keep = [f"xo[u][jj] = {em.names[reuse[1]]};"]
        return p1 + ["#pragma unroll", f"for (int jj = 0; jj < {W}; ++jj) {{", *[f"  {line}" for line in em.lines + keep],
                     *[f"  {line}" for line in _merge_block(fk, dt, fst, lifted, f"u{f}")], "}"]

    # pass 2: the epilogue at every element
    outs2 = [j for j in full]
    em_row = Emitter("rw", {f"s{c}": n for c, n in enumerate(st)}, None)  # once a row, after the merges

    def epilogue_pass(w: int, first: str) -> list[str]:
        """Pass 2's statements over `w` elements at element `first` of the row."""
        W = "V" if w == v else str(w)
        p2 = offsets(sorted({tix[i] for i in epi} | set(outs2)), first)
        for i in epi:
            if not (staged and i in pro):
                p2.append(f"{CTYPE[prog.inputs[i].dtype]} xv{i}[{W}];")
                p2 += load_chunk(i, f"xv{i}", w)
        p2 += [f"{CTYPE[prog.outputs[j].dtype]} o{j}[{W}];" for j in outs2]
        em2 = Emitter("e", {f"s{c}": n for c, n in enumerate(st)}, lambda i, stored: f"{arr(i, 2)}[jj]",
                      fast_nodes(prog, [prog.results[j] for j in outs2]))
        if held:
            em2.bind(reuse[0] if reuse else red.operand, "xo[u][jj]")
        for e in row_invariants([prog.results[j] for j in outs2]):
            em2.bind(e, em_row(e))
        res = {j: em2(prog.results[j]) for j in outs2}
        p2 += ["#pragma unroll", f"for (int jj = 0; jj < {W}; ++jj) {{", *[f"  {line}" for line in em2.lines],
               *[f"  o{j}[jj] = {convert(res[j], prog.results[j].dtype, prog.outputs[j].dtype)};" for j in outs2], "}"]
        for j in outs2:
            p2 += _chunk_store(f"out{j}", CTYPE[prog.outputs[j].dtype], f"k{j} + r{j}", lay.rstrides[j][-1], w, f"o{j}",
                               vectors is None or j in vectors)
        return p2

    kofs = offsets_code("q", lay.ksizes, lay.kstrides, [f"k{t}" for t in range(len(lay.kstrides))], idx)
    body = [f"typedef {idx} kf_idx;",
            f"constexpr int NT = {nt}; constexpr int LANES = {lanes}; constexpr int ROWS = {rows}; "
            f"constexpr int V = {v}; constexpr int P = {per};",
            f"constexpr kf_idx KN = {lay.kn}; constexpr kf_idx NC = {nc};" + (f" constexpr kf_idx RN = {lay.rn};" if peel else ""),
            f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(params)}) {{',
            "  const int lane = threadIdx.x % LANES;",
            "  const kf_idx q = (kf_idx)blockIdx.x * ROWS + threadIdx.x / LANES;",
            "  const bool live = q < KN;",
            *[f"  {line}" for line in kofs],
            *[f"  {CTYPE[t]} {n} = {val};" for n, t, val in zip(st, st_types, ident)]]
    # the row's vectors: NC of them from its start, or (peeled) NB from element HD, the first
    # aligned one; the other RN - NB * V elements one at a time, the HD before and the rest after
    if peel:
        t0 = _runs(prog, lay)[0][0]
        body += [f"  const kf_idx hd_ = (V - (int)(k{t0} % V)) % V;", "  const kf_idx HD = hd_ < RN ? hd_ : RN;",
                 "  const kf_idx NB = (RN - HD) / V;"]
        chunks, first = "NB", "HD + c * V"
    else:
        chunks, first = "NC", "c * V"
    if held:
        body.append(f"  {CTYPE[dt]} xo[P][V];")
    elif staging == "regs":
        body += [f"  {CTYPE[prog.inputs[i].dtype]} x{i}[P][V];" for i in pro]
    elif staging == "smem":
        body += [f"  __shared__ {CTYPE[prog.inputs[i].dtype]} sx{i}[ROWS][P * LANES][V];" for i in pro]
    single = "(c < HD ? c : c + NB * V)"  # the c-th element taken alone
    for f, (fk, fst, ftypes, _) in enumerate(folds):
        p1 = loop(fold_pass(f, v, first, "p"), chunks)
        if peel:
            p1 += loop(fold_pass(f, 1, single, "s"), "RN - NB * V")
        body += ["  if (live) {", *[f"    {line}" for line in p1], "  }"]
        body += _group_merge(fk, dt, fst, ftypes, lanes, f"{f}_" if phases else "")
    p2 = loop(epilogue_pass(v, first), chunks) + (loop(epilogue_pass(1, single), "RN - NB * V") if peel else [])
    body += [f"  {line}" for line in em_row.lines]
    body += ["  if (live) {", *[f"    {line}" for line in p2], "  }"]
    if kept:
        em3 = Emitter("f", {f"s{c}": n for c, n in enumerate(st)}, lambda i, stored: f"{ptr[i]}[k{tix[i]}]")
        res3 = {j: em3(prog.results[j]) for j in kept}
        body += ["  if (live && lane == 0) {", *[f"    {line}" for line in em3.lines],
                 *[f"    out{j}[k{j}] = {convert(res3[j], prog.results[j].dtype, prog.outputs[j].dtype)};" for j in kept],
                 "  }"]
    body.append("}")
    return Built(_header("\n".join(body)), [("kf_gen", (ceil_div(lay.kn, rows),), (nt,), args, 0)], [])


def _apply_lines(prog: Program, v: int, idx: str, chunk: str) -> list[str]:
    """Statements: the epilogue at the `v` elements of vector `chunk` of row q's reduced
    elements (its kept offsets k0, k1, ... bound), from the row's state st0, st1, ..."""
    red = prog.reduction
    lay = reduction_layout(prog)
    _, _, ptr = _pointers(prog)
    no = len(prog.outputs)
    tix = {i: no + k for k, i in enumerate(sorted(prog.in_strides))}
    full = [j for j, m in enumerate(prog.outputs) if m.numel and any(prog.out_strides[j][d] for d in red.dims)]
    epi = sorted({e.value[0] for j in full for e in prog.results[j].walk() if e.op == "load"})
    ts = sorted({tix[i] for i in epi} | set(full))
    body = offsets_code(f"{chunk} * {v}", lay.rsizes, [lay.rstrides[t] for t in ts], [f"r{t}" for t in ts], idx)
    for i in epi:
        t, ct = tix[i], CTYPE[prog.inputs[i].dtype]
        body.append(f"{ct} xv{i}[{v}];")
        body += _chunk_load(ptr[i], ct, f"k{t} + r{t}", lay.rstrides[t][-1], v, f"xv{i}")
    em = Emitter("e", {f"s{c}": f"st{c}" for c in range(len(red.kind.state(red.operand.dtype)))},
                 lambda i, stored: f"xv{i}[jj]", fast_nodes(prog, [prog.results[j] for j in full]))
    res = {j: em(prog.results[j]) for j in full}
    body += [f"{CTYPE[prog.outputs[j].dtype]} o{j}[{v}];" for j in full]
    body += ["#pragma unroll", f"for (int jj = 0; jj < {v}; ++jj) {{", *[f"  {line}" for line in em.lines],
             *[f"  o{j}[jj] = {convert(res[j], prog.results[j].dtype, prog.outputs[j].dtype)};" for j in full], "}"]
    for j in full:
        body += _chunk_store(f"out{j}", CTYPE[prog.outputs[j].dtype], f"k{j} + r{j}", lay.rstrides[j][-1], v, f"o{j}")
    return body


def _fold_vec(prog: Program, knobs: dict) -> int:
    """The statistics' load width: the widest the fold's layout allows with every chunk whole, at
    most the epilogue's."""
    return max(w for w in reduction_vecs(prog, (knobs["split"],)) if w <= knobs["vec"])


def lower_norm_split(prog: Program, knobs: dict, sm_count: int) -> Built:
    """The two-pass form, for rows too long or too few for a block each (group norm of one
    image): lower_reduction folds each row over `split` blocks and merges the states (writing
    the statistics), then kf_gen_apply runs the epilogue over every element, grid-wide, in
    chunks of `vec`, reading its row's state from the workspace."""
    red = prog.reduction
    st_types = red.kind.state(red.operand.dtype)
    built = lower_reduction(prog, {"algo": "gen_rows", "threads": knobs["threads"], "lanes": "block",
                                   "items": knobs["items"], "split": knobs["split"], "vec": _fold_vec(prog, knobs)},
                            sm_count)
    lay = reduction_layout(prog)
    v, nta = knobs["vec"], 256
    nc = lay.rn // v
    params, args, _ = _pointers(prog)
    idx = "kf_i64" if lay.kn * lay.rn >= 2**31 - 2**20 else "int"
    kofs = offsets_code("q", lay.ksizes, lay.kstrides, [f"k{t}" for t in range(len(lay.kstrides))], idx)
    body = kofs + [f"const {CTYPE[t]} st{c} = reinterpret_cast<const {CTYPE[t]}*>(ws + {c * knobs['split'] * lay.kn * 8}LL)[q];"
                   for c, t in enumerate(st_types)] + _apply_lines(prog, v, idx, "c")
    total = lay.kn * nc
    src = "\n".join([
        f'extern "C" __global__ void __launch_bounds__({nta}) kf_gen_apply({", ".join(params)}, '
        "const unsigned char* __restrict__ ws) {",
        f"  for ({idx} g = ({idx})blockIdx.x * {nta} + threadIdx.x; g < ({idx}){total}; g += ({idx})gridDim.x * {nta}) {{",
        f"    const {idx} q = g / {nc}, c = g % {nc};",
        "    {",
        *[f"      {line}" for line in body],
        "    }",
        "  }",
        "}"])
    blocks = min(ceil_div(total, nta), sm_count * (2048 // nta) * 4)
    source = built.source + "\n" + src + "\n"
    kernels = built.kernels + [("kf_gen_apply", (blocks,), (nta,), args + [{"ws": 0}], 0)]
    return Built(source, kernels, built.workspace)


def coop_split(prog: Program, threads: int, vec: int, sm_count: int) -> int:
    """gen_norm_coop's chunks a row: the most (a power of two) that keep every block resident at
    once with 1024 threads an SM, every chunk whole vectors and a vector a thread at least; 0
    where not even one block a row fits or the row is not whole vectors."""
    lay = reduction_layout(prog)
    s, most = 1, sm_count * max(1, 1024 // threads) // lay.kn
    if most < 1 or lay.rn % vec:
        return 0
    while s * 2 <= most and ceil_div(lay.rn, s * 2) % vec == 0 and lay.rn // (s * 2) >= threads * vec:
        s *= 2
    return s


def lower_norm_coop(prog: Program, knobs: dict, sm_count: int) -> Built:
    """The split form in one cooperative launch: a block per chunk folds it, waits for its row's
    other chunks (lower_reduction's `then`), and runs the epilogue over its own chunk, which it
    has just read (from L2, mostly). One launch instead of three, and no second sweep over the
    whole tensor from a cold start."""
    nt, v = knobs["threads"], knobs["vec"]
    split = coop_split(prog, nt, v, sm_count)
    lay = reduction_layout(prog)
    # IT vectors a thread an iteration, unrolled (their loads independent of the stores before them)
    then = [f"for (kf_idx c0 = lo / {v} + threadIdx.x; c0 < hi / {v}; c0 += (kf_idx)NT * IT) {{",
            "#pragma unroll", "  for (int u = 0; u < IT; ++u) {", "    const kf_idx c = c0 + (kf_idx)u * NT;",
            f"    if (c < hi / {v}) {{", *[f"      {line}" for line in _apply_lines(prog, v, "kf_idx", "c")], "    }",
            "  }", "}"]
    assert split and ceil_div(lay.rn, split) % v == 0 and lay.rn % v == 0
    return lower_reduction(prog, {"algo": "gen_rows", "threads": nt, "lanes": "block", "items": knobs["items"],
                                  "split": split, "vec": _fold_vec(prog, {**knobs, "split": split})}, sm_count, then)
