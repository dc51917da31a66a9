"""Scans (`gen_scan`, `gen_scan_block`) and windows (`gen_window`: 2-D and 3-D pooling)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...proposers.builtin.common import ceil_div
from ..ir import Expr, Program
from .emit import (CTYPE, Built, Emitter, _const, _header, _index_type, _merge_block, _pointers, _shfl, coalesce,
                   convert, offsets_code, vector_fits)

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
    before = (["if (u > 0) {", *[f"  {line}" for line in merged("st0", "v[u - 1]", "x")], "}"] if scan.exclusive
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

def _window_inner(prog: Program) -> int:
    """The domain dim the first output is contiguous along (else dim 0)."""
    return min(range(len(prog.domain)), key=lambda d: (prog.out_strides[0][d] != 1, d))


def window_vecs(prog: Program) -> tuple[int, ...]:
    """Legal vector widths (output points a thread) along the first output's innermost dim,
    narrowest first: more than 1 where that dim is not pooled (channels-last pooling), every
    output is contiguous along it and every loaded input contiguous or broadcast along it."""
    nd, k, inner = len(prog.domain), len(prog.window.kernel), _window_inner(prog)
    tensors = [(m, st, 0) for m, st in zip(prog.outputs, prog.out_strides)] + [
        (prog.inputs[i], prog.in_strides[i], prog.offset(i)) for i in prog.in_strides]
    if inner >= nd - k or any(st[inner] not in (0, 1) for _, st, _ in tensors) or \
            any(st[inner] != 1 for st in prog.out_strides):
        return (1,)
    return (1,) + tuple(v for v in (2, 4, 8, 16) if prog.domain[inner] % v == 0 and all(
        vector_fits(v, m, st, inner, off) for m, st, off in tensors if st[inner] == 1))


def lower_window(prog: Program, knobs: dict) -> Built:
    """One thread per `vec` output points along the innermost dim (1 unless that dim is not
    pooled, as channels are in channels-last) folding their windows over the last k dims (k = 2
    or 3; padding skipped; the operand, a prologue over loads, evaluated at each window point,
    16-byte loads where the inputs allow), then the epilogue."""
    w = prog.window
    dt = w.operand.dtype
    kind = w.kind
    st_types = kind.state(dt)
    nt, unroll, v = knobs["threads"], knobs["unroll"], knobs.get("vec", 1)
    params, args, ptr = _pointers(prog)
    nd, k = len(prog.domain), len(w.kernel)
    order = sorted(range(nd), key=lambda d: -prog.out_strides[0][d])
    inner = _window_inner(prog) if v > 1 else None
    size = w.frame[-k:]
    pooled = range(k)  # pooled dim i is domain dim nd - k + i
    idx = _index_type(prog, 2 * nt * v)
    n_out = math.prod(prog.domain) // v
    # coordinates of output point q, innermost (in the first output's memory order) first
    coords = [f"  {idx} e_ = q;"]
    for d in reversed(order):
        n = prog.domain[d] // v if d == inner else prog.domain[d]
        coords.append(f"  const {idx} c{d} = (e_ % {n}){f' * {v}' if d == inner else ''}; e_ /= {n};")
    loaded = sorted({e.value[0] for e in w.operand.walk() if e.op == "load"})  # the rest: the epilogue's, over the domain
    # each loaded input's start for this output point's leading dims, then its offset at a window point
    bases = [f"  const {CTYPE[prog.inputs[i].dtype]}* x{i} = {ptr[i]} + ("
             + " + ".join([f"c{d} * {prog.in_strides[i][d]}" for d in range(nd - k)] or ["0"]) + ");" for i in loaded]
    at = {i: " + ".join([f"(kf_idx)i{j} * {prog.in_strides[i][nd - k + j]}" for j in range(k)]) for i in loaded}
    along = {i: inner is not None and prog.in_strides[i][inner] == 1 for i in loaded}
    window_loads = [f"const kf_vec<{CTYPE[prog.inputs[i].dtype]}, V> l{i} = "
                    f"*reinterpret_cast<const kf_vec<{CTYPE[prog.inputs[i].dtype]}, V>*>(x{i} + {at[i]});"
                    if along[i] else f"const {CTYPE[prog.inputs[i].dtype]} l{i} = x{i}[{at[i]}];" for i in loaded]
    pe = Emitter("q", {}, lambda i, stored: f"l{i}.v[j]" if along[i] else f"l{i}")
    xval = pe(w.operand)
    outs = [" + ".join([f"c{d} * {st[d]}" for d in range(nd)]) for st in prog.out_strides]
    st = [f"st{c}" for c in range(len(st_types))]
    em = Emitter("p", {"ridx": "ri", "x": "xv"}, None)
    lifted = [em(e) for e in kind.lift_exprs(Expr.var("x", dt))]
    span = " * ".join(f"(hi{i} - lo{i})" for i in pooled)
    clipped = " * ".join(f"((hi{i} < N{i} ? hi{i} : N{i}) - (lo{i} > 0 ? lo{i} : 0))" for i in pooled)
    count = str(w.divisor_override) if w.divisor_override else span if w.count_include_pad else clipped
    def epi_load(i, stored):  # at this output point (the j-th along the inner dim)
        at_out = " + ".join([f"c{d} * {prog.in_strides[i][d]}" for d in range(nd)])
        return f"{ptr[i]}[{at_out}{f' + j * {prog.in_strides[i][inner]}' if inner is not None else ''}]"

    epi = Emitter("e", {**{f"s{c}": f"{n}[j]" for c, n in enumerate(st)}, "count": "cnt"}, epi_load)
    res = [epi(e) for e in prog.results]
    loops, pad = [], "  "
    for i in pooled:  # one loop per pooled dim, outermost first; a point in the padding is skipped
        loops += [f"#pragma unroll {unroll}",
                  f"{pad}for (int k{i} = 0; k{i} < {w.kernel[i]}; ++k{i}) {{",
                  f"{pad}  const int i{i} = o{i} * {w.stride[i]} - {w.padding[i]} + k{i} * {w.dilation[i]};",
                  f"{pad}  if (i{i} < 0 || i{i} >= N{i}) continue;"]
        pad += "  "
    flat = "(kf_i64)i0"
    for i in pooled[1:]:
        flat = f"({flat} * N{i} + i{i})"
    inner_lines = [*window_loads, f"const kf_i64 ri = {flat};", "#pragma unroll", "for (int j = 0; j < V; ++j) {",
                   *[f"  {line}" for line in pe.lines], f"  const {CTYPE[dt]} xv = {xval};",
                   *[f"  {line}" for line in em.lines],
                   *[f"  {line}" for line in _merge_block(kind, dt, [f"{n}[j]" for n in st], lifted, "u")], "}"]
    closing = ["  " * (i + 1) + "}" for i in reversed(pooled)]
    cts = [CTYPE[om.dtype] for om in prog.outputs]
    stores = [*[f"  {ct} r{j}[V];" for j, ct in enumerate(cts)], "#pragma unroll", "  for (int j = 0; j < V; ++j) {",
              *[f"    {line}" for line in epi.lines],
              *[f"    r{j}[j] = {convert(r, prog.results[j].dtype, om.dtype)};"
                for j, (om, r) in enumerate(zip(prog.outputs, res))], "  }",
              *[f"  *reinterpret_cast<kf_vec<{ct}, V>*>(out{j} + {o}) = *reinterpret_cast<const kf_vec<{ct}, V>*>(r{j});"
                for j, (ct, o) in enumerate(zip(cts, outs))]]
    body = [f"typedef {idx} kf_idx;",
            f"constexpr int NT = {nt}; constexpr int V = {v}; " + " ".join(f"constexpr int N{i} = {size[i]};" for i in pooled),
            f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(params)}) {{',
            "  const kf_idx q = (kf_idx)blockIdx.x * NT + threadIdx.x;",
            f"  if (q >= {n_out}) return;",
            *coords,
            *bases,
            *[f"  const int o{i} = (int)c{nd - k + i};" for i in pooled],
            *[f"  {CTYPE[t]} {n}[V];" for n, t in zip(st, st_types)],
            "#pragma unroll",
            "  for (int j = 0; j < V; ++j) {",
            *[f"    {n}[j] = {_const(val)};" for n, val in zip(st, kind.identity_exprs(dt))],
            "  }",
            *loops,
            *[f"{pad}{line}" for line in inner_lines],
            *closing,
            # the window's extent along each dim, clipped to the padded input (eager's divisor)
            *[f"  const int lo{i} = o{i} * {w.stride[i]} - {w.padding[i]}, hi{i} = lo{i} + {w.kernel[i]} < N{i} + "
              f"{w.padding[i]} ? lo{i} + {w.kernel[i]} : N{i} + {w.padding[i]};" for i in pooled],
            f"  const kf_i64 cnt = {count};",
            *stores,
            "}"]
    return Built(_header("\n".join(body)), [("kf_gen", (ceil_div(n_out, nt),), (nt,), args, 0)], [])
