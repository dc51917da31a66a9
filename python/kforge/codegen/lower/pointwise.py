"""Pointwise lowering (`algo` "flat"): items vectors of vec elements a thread, loads issued
before any math."""

from __future__ import annotations

import math

from ...proposers.builtin.common import ceil_div
from ..ir import Program
from .emit import (CTYPE, Built, Emitter, _header, _index_type, _pointers, coalesce, convert, fast_nodes, offsets_code,
                   vector_copy, vector_fits)
from .tile import SMEM, tile_kernel, tiled_vecs, transposed_dim, transposed_share

# ---- pointwise -----------------------------------------------------------------------

def pointwise_layout(prog: Program):
    tensors = [list(s) for s in prog.out_strides] + [list(prog.in_strides[i]) for i in sorted(prog.in_strides)]
    nd = len(prog.domain)
    order = sorted(range(nd), key=lambda d: -prog.out_strides[0][d])
    return coalesce(list(prog.domain), tensors, order)


def pointwise_vecs(prog: Program, wide: bool = True) -> tuple[int, ...]:
    """Vector widths (elements) along the inner coalesced dim legal in some kernel of the plan
    (a program and its parts), narrowest first: each kernel runs at the widest it allows up to
    the knob's (_vecs). With `wide`, a tensor's vector may be several 16-byte pieces (its
    elements wider than another tensor's); without, every access is one of 16 bytes at most."""
    return tuple(sorted(set().union(*(_vecs(p, wide) for p in [prog, *prog.parts]))))


def _vecs(prog: Program, wide: bool = True) -> tuple[int, ...]:
    sizes, strides = pointwise_layout(prog)
    metas = list(prog.outputs) + [prog.inputs[i] for i in sorted(prog.in_strides)]
    loaded = sorted(prog.in_strides)
    no = len(prog.outputs)
    out = []
    for v in (1, 2, 4, 8, 16):
        ok = sizes[-1] % v == 0
        for m, st in zip(metas, strides):
            if st[-1] == 1 and v > 1:
                ok &= vector_fits(v, m, st, -1, wide=wide)
        for i, (j, stride, _) in prog.gathers.items():  # a picked row starts at a whole vector
            ok &= v == 1 or strides[no + loaded.index(i)][-1] != 1 or stride % v == 0
        if ok:
            out.append(v)
    return tuple(out)


def tile_vecs(prog: Program) -> tuple[int, ...]:
    """Tile vector widths (knob `tvec`) some tiled kernel of the plan takes (lower/tile.py)."""
    return tuple(sorted(set().union(*(tiled_vecs(p, pointwise_layout(p)) for p in [prog, *prog.parts]))))


def tileable(prog: Program) -> float:
    """The largest share of a kernel's bytes that tiles would stage, over the plan's kernels: 0
    where none reads an input transposed to its outputs (lower/tile.py)."""
    return max(transposed_share(p, pointwise_layout(p)) for p in [prog, *prog.parts])


def lower_pointwise(prog: Program, knobs: dict, sm_count: int) -> Built:
    """One kernel, kf_gen. A program with parts (one per output shape, or per slab of a cat) is
    one launch too: each part is a device function in a namespace of its own, at the widest
    vector width it allows up to the knob's (in 16-byte pieces only where the knob's width is
    one no part reaches in 16-byte accesses), and kf_gen gives each its own range of blocks (the
    parts are small pieces of one region: a rotary's two slabs, a cat's pieces, where a launch
    each cost more than their bytes). A program with an in-place part runs a launch per part, in order.
    With `algo` "gen_tile", a part reading an input transposed to its outputs is tiled (lower/tile.py)."""
    progs = [prog, *prog.parts]
    one = len(progs) > 1 and not any(p.aliases for p in progs)  # the parts in one launch
    narrow = [_vecs(p, wide=False) for p in progs]
    wide = all(knobs["vec"] not in n for n in narrow)  # else every part keeps to 16-byte accesses
    bodies, launches, params, calls, args, start, smem = [], [], [], [], [], 0, SMEM
    for n, part in enumerate(progs):
        vec = max(w for w in (_vecs(part) if wide else narrow[n]) if w <= knobs["vec"])
        name = "kf_part" if one else f"kf_gen_p{n}" if n else "kf_gen"
        layout = pointwise_layout(part)
        b = transposed_dim(part, layout) if knobs["algo"] == "gen_tile" else None
        tiled = tile_kernel(part, layout, b, knobs["threads"], name, one, smem, knobs.get("tvec", 1)) if b is not None else None
        if tiled:
            src, launch, used = tiled
            smem -= used if one else 0  # one launch: every block declares every part's tiles
        else:
            src, launch = _kernel(part, {**knobs, "vec": vec}, sm_count, name, device=one)
        bodies.append(f"namespace kf_p{n} {{\n{src}\n}}" if n or one else src)
        if not one:
            launches.append(launch)
            continue
        (blocks,), part_args = launch[1], launch[3]
        names = [f"p{n}_{k}" for k in range(len(part_args))]
        params += [f"{t.rsplit(' ', 1)[0]} {p}" for t, p in zip(_pointers(part)[0], names)]
        calls.append(f"  {'else ' if n else ''}if (blockIdx.x < {start + blocks}u) "
                     f"kf_p{n}::kf_part({', '.join(names)}, blockIdx.x - {start}u, {blocks}u);")
        args += part_args
        start += blocks
    if one:
        bodies.append("\n".join([f'extern "C" __global__ void __launch_bounds__({knobs["threads"]}) kf_gen('
                                 f'{", ".join(params)}) {{', *calls, "}"]))
        launches = [("kf_gen", (start,), (knobs["threads"],), args, 0)]
    return Built(_header("\n".join(bodies)), launches, [])


EXPENSIVE = frozenset({"sin", "cos", "tan", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "pow", "tanh",
                       "sinh", "cosh", "erf", "erfc", "erfinv", "atan", "atan2", "asin", "acos", "lgamma"})


def _outer_invariants(prog: Program, sizes, strides, ins_of) -> tuple[set, list]:
    """Where results compute something costly from inputs read the same at every index of the
    layout's outermost dim (stride 0 there, not everywhere): those inputs and the largest
    subexpressions of the results computed from them alone; else nothing."""
    if len(sizes) < 2 or not sizes[0] or prog.aliases:
        return set(), []
    picks = {j for j, _, _ in prog.gathers.values()}  # gathers and their indices are read at every item
    free = [i for i in prog.in_strides if i not in prog.gathers and i not in picks]
    inv = {i for i in free if any(strides[ins_of[i]]) and not strides[ins_of[i]][0]}
    same = inv | {i for i in free if not any(strides[ins_of[i]])}
    memo: dict = {}

    def fixed(e) -> bool:
        if e not in memo:
            memo[e] = e.value[0] in same if e.op == "load" else e.op != "var" and all(fixed(a) for a in e.args)
        return memo[e]

    roots: list = []
    seen: set = set()

    def walk(e) -> None:
        if e in seen:
            return
        seen.add(e)
        if fixed(e):
            if e.op not in ("load", "const"):
                roots.append(e)
            return
        for a in e.args:
            walk(a)
    for r in prog.results:
        walk(r)
    return (inv, roots) if any(_costly(r) for r in roots) else (set(), [])


def _costly(e) -> bool:
    return e.op in EXPENSIVE or any(_costly(a) for a in e.args)


def heads_items(prog: Program) -> int:
    """Items a thread takes along the outermost dim where results compute something costly (a
    transcendental) from inputs read the same at each of its indices (a rotary embedding's angles,
    per position, beside its heads): the most of 8, 4, 2 dividing that dim in every kernel of the
    plan that has such work; 0 where none does."""
    outer = []
    for part in [prog, *prog.parts]:
        sizes, strides = pointwise_layout(part)
        ins_of = {i: len(part.outputs) + k for k, i in enumerate(sorted(part.in_strides))}
        if _outer_invariants(part, sizes, strides, ins_of)[1]:
            outer.append(sizes[0])
    return next((n for n in (8, 4, 2) if outer and all(h % n == 0 for h in outer)), 0)


def _kernel(prog: Program, knobs: dict, sm_count: int, name: str, device: bool = False) -> tuple[str, tuple]:
    """The kernel `name`, or with `device` a device function of the same body that runs as block
    kf_bid of kf_nblk (lower_pointwise's parts in one launch)."""
    nt, v, it = knobs["threads"], knobs["vec"], knobs["items"]
    sizes, strides = pointwise_layout(prog)
    numel = math.prod(sizes)
    nv = numel // v
    params, args, ptr = _pointers(prog)
    no = len(prog.outputs)
    loaded = sorted(prog.in_strides)
    idx = _index_type(prog, 2 * nt * it * v)
    ins_of = {i: no + k for k, i in enumerate(loaded)}
    inv, roots = _outer_invariants(prog, sizes, strides, ins_of) if knobs.get("grid") == "heads" else (set(), [])
    heads = bool(roots) and sizes[0] % it == 0
    if not heads:
        inv, roots = set(), []
    ni = nv // sizes[0] if heads else nv  # vectors in one index of the outermost dim
    hoist, decl, loads, body = [], [], [], []
    for i in sorted(loaded, key=lambda i: i in prog.gathers):  # an index before the rows it picks
        t = ins_of[i]
        st = strides[t]
        ct = CTYPE[prog.inputs[i].dtype]
        if i in prog.gathers:
            decl.append(f"    {ct} x{i}[IT][V];")
            loads += _gathered_loads(prog, i, strides, ins_of, ptr, v)
            continue
        if not any(st):
            hoist.append(f"  const {ct} h{i} = {ptr[i]}[0];")
            continue
        decl.append(f"    {ct} x{i}[IT][V];")
        first = "if (k == 0) " if i in inv else ""  # the same at every item: read once
        if st[-1] == 1 and v > 1:
            loads.append(f"        {first}" + vector_copy(ct, prog.inputs[i].itemsize, v, f"x{i}[k]", f"{ptr[i]} + off[k][{t}]"))
        else:
            loads.append(f"        {first}for (int j = 0; j < V; ++j) x{i}[k][j] = {ptr[i]}[off[k][{t}] + j * {st[-1]}];")

    def load(i, stored):
        if not any(strides[ins_of[i]]) and i not in prog.gathers:
            return f"h{i}"
        return f"x{i}[0][j]" if i in inv else f"x{i}[k][j]"

    fast = fast_nodes(prog, prog.results)
    once = Emitter("u", {}, load, fast)  # the outer dim's invariant work, once a thread (grid "heads")
    for e in roots:
        once(e)
    pre = [f"      {line}" for line in once.lines] + [f"      hv{m}[j] = {once.names[e]};" for m, e in enumerate(roots)]
    em = Emitter("v", {}, load, fast)
    for m, e in enumerate(roots):
        em.bind(e, f"hv{m}[j]")
    res = [em(e) for e in prog.results]
    body += [f"          {line}" for line in em.lines]
    stores = []
    for j, (m, r) in enumerate(zip(prog.outputs, res)):
        if not m.numel:  # passed (every output is) but never written: an empty tensor
            continue
        ct = CTYPE[m.dtype]
        body.append(f"          r{j}[j] = {convert(r, prog.results[j].dtype, m.dtype)};")
        if strides[j][-1] == 1 and v > 1:
            stores.append("        " + vector_copy(ct, m.itemsize, v, f"out{j} + off[k][{j}]", f"r{j}"))
        else:
            stores.append(f"        for (int j = 0; j < V; ++j) out{j}[off[k][{j}] + j * {strides[j][-1]}] = r{j}[j];")
    rdecl = [f"        {CTYPE[m.dtype]} r{j}[V];" for j, m in enumerate(prog.outputs) if m.numel]
    item = "((base / NI) * IT + k) * NI + base % NI" if heads else "base + k * NT"
    offs = offsets_code(f"({item}) * V", sizes, strides, [f"off[k][{t}]" for t in range(len(strides))], idx, False)
    valid = "base < NB" if heads else "base + k * NT < NV"
    step = "NT" if heads else "(NT * IT)"
    hvs = [f"    {CTYPE[e.dtype]} hv{m}[V];" for m, e in enumerate(roots)]
    once_loop = ["#pragma unroll", "    for (int j = 0; j < V; ++j) {", *pre, "    }"] if roots else []
    src = "\n".join([
        f"typedef {idx} kf_idx;",
        f"constexpr int NT = {nt}; constexpr int V = {v}; constexpr int IT = {it}; constexpr kf_idx NV = {nv};",
        *([f"constexpr kf_idx NI = {ni}; constexpr kf_idx NB = NI * {sizes[0] // it};"] if heads else []),
        (f'__device__ __forceinline__ void {name}({", ".join(params + ["unsigned kf_bid", "unsigned kf_nblk"])}) {{'
         if device else f'extern "C" __global__ void __launch_bounds__(NT) {name}({", ".join(params)}) {{'),
        *([] if device else ["  const unsigned kf_bid = blockIdx.x, kf_nblk = gridDim.x;"]),
        *hoist,
        *[f"  out{j} += {prog.out_offset(j)};" for j in range(no) if prog.out_offset(j)],
        f"  for (kf_idx base = (kf_idx)kf_bid * {step} + threadIdx.x; base < {'NB' if heads else 'NV'};"
        f" base += (kf_idx)kf_nblk * {step}) {{",
        f"    kf_idx off[IT][{len(strides)}];",
        *decl,
        *hvs,
        "#pragma unroll",
        "    for (int k = 0; k < IT; ++k) {",
        f"      if ({valid}) {{",
        *[f"        {line}" for line in offs],
        *loads,
        "      }",
        "    }",
        *once_loop,
        "#pragma unroll",
        "    for (int k = 0; k < IT; ++k) {",
        f"      if ({valid}) {{",
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
    blocks = max(1, ceil_div(ni * sizes[0] // it, nt) if heads else ceil_div(nv, nt * it))
    if knobs.get("grid") == "stride":
        blocks = min(blocks, sm_count * max(1, 2048 // nt))
    args = [{"out": prog.card_output(a["out"])} if "out" in a else a for a in args]
    return src, (name, (blocks,), (nt,), args, 0)


def _gathered_loads(prog: Program, i: int, strides, ins_of: dict[int, int], ptr: dict[int, str], v: int) -> list[str]:
    """Loads of input i at the rows its index input picks (ir.Program.gathers): one vector per
    item where the index is constant along the inner dim, else element by element. An index
    outside the rows traps, as eager's device-side assert does."""
    j, stride, rows = prog.gathers[i]
    st, t, ct = strides[ins_of[i]], ins_of[i], CTYPE[prog.inputs[i].dtype]
    index = (lambda e: f"h{j}") if not any(strides[ins_of[j]]) else (lambda e: f"x{j}[k][{e}]")
    check = f"if ((unsigned long long)g >= {rows}ULL) __trap();"
    if st[-1] == 1 and v > 1 and strides[ins_of[j]][-1] == 0:
        return [f"        {{ const kf_i64 g = (kf_i64){index(0)}; {check}",
                "          " + vector_copy(ct, prog.inputs[i].itemsize, v, f"x{i}[k]", f"{ptr[i]} + off[k][{t}] + g * {stride}LL")
                + " }"]
    return [f"        for (int j = 0; j < V; ++j) {{ const kf_i64 g = (kf_i64){index('j')}; {check}",
            f"          x{i}[k][j] = {ptr[i]}[off[k][{t}] + g * {stride}LL + j * {st[-1]}]; }}"]
