"""Windows (2-D and 3-D pooling, with a pointwise prologue and epilogue): `gen_window`, one
thread per output point (or `vec` of them along channels-last's channels) folding its window
straight from global memory, evaluating the prologue at every window point it visits; and
`gen_window_tile`, a block per tile of output points of the last two pooled dims that first
evaluates the prologue once per input point of the tile's window span into shared memory, then
folds each output's window from there (3-D pooling: one input plane staged per step of the
depth window, the steps' folds into the same state).

A 3x3 stride-2 max pool visits each input point 2.25 times: with batch norm and relu before it
(ResNet's stem) that is 2.25 evaluations of the prologue and 2.25 loads per input point (100 us
for 32x64x112x112 bf16 NCHW on the H100 one thread an output, 81 tiled; the input's bytes once
take 22). Channels-last pooling stages a vector of `cg` x `vec` channels at each span point."""

from __future__ import annotations

import math

from ...proposers.builtin.common import ceil_div
from ..ir import Expr, Program
from .emit import CTYPE, Built, Emitter, _const, _header, _index_type, _merge_block, _pointers, convert, vector_fits

SMEM_MAX = 48 * 1024  # static shared memory a block may declare


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


def _span(prog: Program, th: int, tw: int) -> tuple[int, int]:
    """The input rows and columns (the last two pooled dims) a th x tw tile of output points reads."""
    w = prog.window
    return tuple((t - 1) * s + (kk - 1) * d + 1
                 for t, s, kk, d in zip((th, tw), w.stride[-2:], w.kernel[-2:], w.dilation[-2:]))


def window_tiles(prog: Program) -> dict[str, tuple[int, ...]]:
    """gen_window_tile's knobs: tile rows (`th`) and columns (`tw`) of output points and, where the
    channels are innermost (channels-last), `vec` channels a thread and `cg` such groups a block
    (a staged point holds cg x vec channels); every setting's staged span within SMEM_MAX and 16
    points a thread, and no taller than the output plane. A 3-D pooling tiles its last two pooled
    dims and stages one input plane per step of its first. Empty where the form does not apply: a
    1-D pooling (also one run as a 2-D pooling of one-row planes, as eager's max_pool1d does: a
    tile taller than its plane idles most of its threads; KernelBench's 1-D max pool, 8 wide
    at stride 1, ran 430 us tiled 4 x 64 on the H100, 222 one thread an output), or neither the
    last pooled dim nor a vectorizable non-pooled dim innermost."""
    nd = len(prog.domain)
    rows = prog.domain[nd - 2]  # of the output plane
    if len(prog.window.kernel) not in (2, 3) or rows < 2:
        return {}
    size = 8 if prog.window.operand.dtype in ("float64", "int64") else 4  # a half type's value is staged as float

    def fits(th: int, tw: int, lanes: int = 1) -> bool:  # in shared memory, and at most 16 span points a thread
        ih, iw = _span(prog, th, tw)
        return ih * iw * lanes * size <= SMEM_MAX and ih * iw <= 16 * th * tw
    if prog.out_strides[0][nd - 1] != 1:  # channels-last: a vector of channels a staged point
        vecs = tuple(x for x in window_vecs(prog) if x > 1)
        cgs = tuple(c for c in (1, 2, 4, 8) if vecs and fits(2, 4) and fits(4, 8, c * vecs[-1]))
        return {"th": tuple(th for th in (2, 4) if th <= rows), "tw": (4, 8), "cg": cgs, "vec": vecs} if cgs else {}
    tws = tuple(tw for tw in (16, 32, 64) if fits(2, tw))
    ths = tuple(th for th in (2, 4, 8, 16) if tws and fits(th, tws[-1]) and th <= rows)
    return {"th": ths, "tw": tws} if ths else {}


def lower_window(prog: Program, knobs: dict) -> Built:
    """The fold of each output point's window over the last k pooled dims (padding skipped;
    the operand evaluated at each window point, or read from the staged tile), then the
    epilogue. gen_window: one thread per `vec` output points along the innermost dim (1 unless
    that dim is not pooled, as channels are in channels-last), 16-byte loads where the inputs
    allow. gen_window_tile: see the module's docstring."""
    w = prog.window
    dt = w.operand.dtype
    kind = w.kind
    st_types = kind.state(dt)
    tiled = knobs["algo"] == "gen_window_tile"
    params, args, ptr = _pointers(prog)
    nd, k = len(prog.domain), len(w.kernel)
    order = sorted(range(nd), key=lambda d: -prog.out_strides[0][d])
    size = w.frame[-k:]
    pooled = range(k)  # pooled dim i is domain dim nd - k + i
    v = knobs.get("vec", 1)
    inner = _window_inner(prog) if v > 1 else None
    if tiled:  # a block: th x tw output points, for cg x vec channels (channels-last) or one plane
        th, tw, cg, unroll = knobs["th"], knobs["tw"], knobs.get("cg", 1), max(w.kernel)
        pts = th * tw
        nt = pts * cg
        ih, iw = _span(prog, th, tw)
        lead = {d: ceil_div(prog.domain[d], cg * v) if d == inner else prog.domain[d] for d in range(nd - 2)}
        n_ty, n_tx = ceil_div(prog.domain[nd - 2], th), ceil_div(prog.domain[nd - 1], tw)  # tiles a plane
        grid = (math.prod(lead.values()) * n_ty * n_tx,)
        ragged = inner is not None and prog.domain[inner] % (cg * v) != 0  # the last chunk of channels is partial
    else:
        nt, unroll = knobs["threads"], knobs["unroll"]
        grid = (ceil_div(math.prod(prog.domain) // v, nt),)
    idx = _index_type(prog, 2 * nt * v)
    loaded = sorted({e.value[0] for e in w.operand.walk() if e.op == "load"})  # the rest: the epilogue's, over the domain
    if tiled:  # block b: tile column, tile row, then the leading dims in the output's memory order
        coords = [f"  {idx} e_ = blockIdx.x;",
                  f"  const int tx_ = (int)(e_ % {n_tx}); e_ /= {n_tx};",
                  f"  const int ty_ = (int)(e_ % {n_ty}); e_ /= {n_ty};"]
        coords.append(f"  const int g_ = threadIdx.x % {cg}, p_ = threadIdx.x / {cg};" if inner is not None
                      else "  const int p_ = threadIdx.x;")  # channel group, output point of the tile
        coords += [f"  const {idx} c{d} = (e_ % {lead[d]}) * {cg * v} + g_ * {v}; e_ /= {lead[d]};" if d == inner
                   else f"  const {idx} c{d} = e_ % {lead[d]}; e_ /= {lead[d]};" for d in reversed(order) if d < nd - 2]
    else:  # coordinates of output point q, innermost (in the first output's memory order) first
        coords = ["  const kf_idx q = (kf_idx)blockIdx.x * NT + threadIdx.x;",
                  f"  if (q >= {math.prod(prog.domain) // v}) return;", f"  {idx} e_ = q;"]
        for d in reversed(order):
            n = prog.domain[d] // v if d == inner else prog.domain[d]
            coords.append(f"  const {idx} c{d} = (e_ % {n}){f' * {v}' if d == inner else ''}; e_ /= {n};")
    # each loaded input's start for this output point's leading dims, then its offset at a window point
    bases = [f"  const {CTYPE[prog.inputs[i].dtype]}* x{i} = {ptr[i]} + ("
             + " + ".join([f"c{d} * {prog.in_strides[i][d]}" for d in range(nd - k)] or ["0"]) + ");" for i in loaded]
    at = {i: " + ".join([f"(kf_idx)i{j} * {prog.in_strides[i][nd - k + j]}" for j in range(k)]) for i in loaded}
    along = {i: inner is not None and prog.in_strides[i][inner] == 1 for i in loaded}
    # what a thread holds of each loaded input at a window point: a vector of V along the inner dim, or a value
    held = {i: f"kf_vec<{CTYPE[prog.inputs[i].dtype]}, V>" if along[i] else CTYPE[prog.inputs[i].dtype] for i in loaded}
    window_loads = [f"const {held[i]} l{i} = *reinterpret_cast<const {held[i]}*>(x{i} + {at[i]});" for i in loaded]
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
    ra, rb = k - 2, k - 1  # the tile form's pooled dims: rows and columns of its tile
    loops, closing, pad = [], [], "    " if tiled else "  "
    for i in (range(ra, k) if tiled else pooled):  # a loop per pooled dim, outermost first; a point in the padding is skipped
        loops += [f"#pragma unroll {unroll}",
                  f"{pad}for (int k{i} = 0; k{i} < {w.kernel[i]}; ++k{i}) {{",
                  f"{pad}  const int i{i} = o{i} * {w.stride[i]} - {w.padding[i]} + k{i} * {w.dilation[i]};",
                  f"{pad}  if (i{i} < 0 || i{i} >= N{i}) continue;"]
        closing.insert(0, f"{pad}}}")
        pad += "  "
    flat = "(kf_i64)i0"
    for i in pooled[1:]:
        flat = f"({flat} * N{i} + i{i})"
    def tile_at(point: str) -> str:  # the staged value of span point `point` (channel j of this thread's group)
        return point if inner is None else f"(({point}) * {cg} + g_) * V + j"
    if tiled:  # the operand at this window point, from the tile (row, column relative to its span)
        at_point = (f"(ly_ * {w.stride[ra]} + k{ra} * {w.dilation[ra]}) * {iw} + lx_ * {w.stride[rb]} + k{rb} * "
                    f"{w.dilation[rb]}")
        operand, value = [], [f"  const {CTYPE[dt]} xv = kf_tile[{tile_at(at_point)}];"]
    else:
        pe = Emitter("q", {}, lambda i, stored: f"l{i}.v[j]" if along[i] else f"l{i}")
        xval = pe(w.operand)
        operand, value = window_loads, [f"  {line}" for line in pe.lines] + [f"  const {CTYPE[dt]} xv = {xval};"]
    fold = [f"const kf_i64 ri = {flat};", "#pragma unroll", "for (int j = 0; j < V; ++j) {", *value,
            *[f"  {line}" for line in em.lines],
            *[f"  {line}" for line in _merge_block(kind, dt, [f"{n}[j]" for n in st], lifted, "u")], "}"]
    folds = [*loops, *[f"{pad}{line}" for line in [*operand, *fold]], *closing]  # every window point of this output
    cts = [CTYPE[om.dtype] for om in prog.outputs]
    stores = [*[f"  {ct} r{j}[V];" for j, ct in enumerate(cts)], "#pragma unroll", "  for (int j = 0; j < V; ++j) {",
              *[f"    {line}" for line in epi.lines],
              *[f"    r{j}[j] = {convert(r, prog.results[j].dtype, om.dtype)};"
                for j, (om, r) in enumerate(zip(prog.outputs, res))], "  }",
              *[f"  *reinterpret_cast<kf_vec<{ct}, V>*>(out{j} + {o}) = *reinterpret_cast<const kf_vec<{ct}, V>*>(r{j});"
                for j, (ct, o) in enumerate(zip(cts, outs))]]
    if tiled:
        # stage: the prologue once per input point of the tile's span (points in the padding are
        # never read back: the fold skips them as gen_window does), then this thread's output point
        # every load of the thread's share of the span first (in flight together; a load per
        # point and iteration left one DRAM latency a point: 100 us for ResNet's stem on the H100),
        # an input read the same at every point (batch norm's parameters) once, then the prologue
        n_it = ceil_div(ih * iw, pts)
        once = [i for i in loaded if not any(prog.in_strides[i][nd - k:])]

        def staged_load(i, stored):
            return f"l{i}{'' if i in once else '[u_]'}{'.v[j]' if along[i] else ''}"
        spe = Emitter("q", {}, staged_load)
        sval = spe(w.operand)
        live = f" && c{inner} < {prog.domain[inner]}" if ragged else ""
        outer = range(ra)  # 3-D pooling's depth: a plane staged per step of its window
        prelude = [f"  __shared__ {CTYPE[dt]} kf_tile[{ih * iw * cg * v}];",
                   f"  const int y0_ = ty_ * {th} * {w.stride[ra]} - {w.padding[ra]}, "
                   f"x0_ = tx_ * {tw} * {w.stride[rb]} - {w.padding[rb]};",
                   # (a thread past the last channel of a partial chunk reads nothing)
                   *[f"  const {held[i]} l{i} = {f'c{inner} >= {prog.domain[inner]} ? {held[i]}{{}} : ' if ragged else ''}"
                     f"*reinterpret_cast<const {held[i]}*>(x{i});" for i in once],
                   f"  const int ly_ = p_ / {tw}, lx_ = p_ % {tw};",
                   *[f"  const int o{i} = (int)c{nd - k + i};" for i in outer],
                   f"  const int o{ra} = ty_ * {th} + ly_, o{rb} = tx_ * {tw} + lx_;",
                   # a thread past the plane's edge (or the channels) stages its share and meets the
                   # barriers, but folds and writes nothing
                   f"  const bool live_ = o{ra} < {prog.domain[nd - 2]} && o{rb} < {prog.domain[nd - 1]}"
                   f"{f' && c{inner} < {prog.domain[inner]}' if ragged else ''};",
                   f"  const {idx} c{nd - 2} = o{ra}, c{nd - 1} = o{rb};"]
        staged = [*[f"  {held[i]} l{i}[{n_it}];" for i in loaded if i not in once],
                  f"  bool in_[{n_it}];",
                  "#pragma unroll",
                  f"  for (int u_ = 0; u_ < {n_it}; ++u_) {{",
                  f"    const int t_ = p_ + u_ * {pts}, i{ra} = y0_ + t_ / {iw}, i{rb} = x0_ + t_ % {iw};",
                  f"    in_[u_] = t_ < {ih * iw} && i{ra} >= 0 && i{ra} < N{ra} && i{rb} >= 0 && i{rb} < N{rb}{live};",
                  *[f"    if (in_[u_]) l{i}[u_] = *reinterpret_cast<const {held[i]}*>(x{i} + {at[i]});"
                    for i in loaded if i not in once], "  }",
                  "#pragma unroll",
                  f"  for (int u_ = 0; u_ < {n_it}; ++u_) {{",
                  "    if (!in_[u_]) continue;",
                  "#pragma unroll",
                  "    for (int j = 0; j < V; ++j) {",
                  *[f"      {line}" for line in spe.lines],
                  f"      kf_tile[{tile_at(f'p_ + u_ * {pts}')}] = {sval};", "    }", "  }",
                  "  __syncthreads();",
                  # with no depth steps to come a thread with no output leaves (the form measured on the H100)
                  *(["  if (live_) {", *folds, "  }"] if ra else ["  if (!live_) return;", *folds])]
        for i in reversed(outer):  # the plane of this step (the same for the whole block: the barriers hold)
            staged = [f"  for (int k{i} = 0; k{i} < {w.kernel[i]}; ++k{i}) {{",
                      f"  const int i{i} = o{i} * {w.stride[i]} - {w.padding[i]} + k{i} * {w.dilation[i]};",
                      f"  if (i{i} < 0 || i{i} >= N{i}) continue;",
                      "  __syncthreads();  // the last step's folds have read the tile",
                      *staged, "  }"]
        fold_all = [*staged, "  if (!live_) return;"] if ra else staged
    else:
        prelude = [f"  const int o{i} = (int)c{nd - k + i};" for i in pooled]
        fold_all = folds
    body = [f"typedef {idx} kf_idx;",
            f"constexpr int NT = {nt}; constexpr int V = {v}; " + " ".join(f"constexpr int N{i} = {size[i]};" for i in pooled),
            f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(params)}) {{',
            *coords,
            *bases,
            *prelude,
            *[f"  {CTYPE[t]} {n}[V];" for n, t in zip(st, st_types)],
            "#pragma unroll",
            "  for (int j = 0; j < V; ++j) {",
            *[f"    {n}[j] = {_const(val)};" for n, val in zip(st, kind.identity_exprs(dt))],
            "  }",
            *fold_all,
            # the window's extent along each dim, clipped to the padded input (eager's divisor)
            *[f"  const int lo{i} = o{i} * {w.stride[i]} - {w.padding[i]}, hi{i} = lo{i} + {w.kernel[i]} < N{i} + "
              f"{w.padding[i]} ? lo{i} + {w.kernel[i]} : N{i} + {w.padding[i]};" for i in pooled],
            f"  const kf_i64 cnt = {count};",
            *stores,
            "}"]
    return Built(_header("\n".join(body)), [("kf_gen", grid, (nt,), args, 0)], [])
