"""Reductions (`algo` "rows", "cols", two passes with `split`); their layout, shared with the
normalizations of kforge.codegen.lower.norm."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...proposers.builtin.common import ceil_div
from ..ir import Program
from .emit import (CTYPE, Built, Emitter, _chunk_block, _const, _header, _index_type, _merge_block, _pointers, _shfl, coalesce,
                   convert, offsets_code, vector_fits)

# ---- reduction -----------------------------------------------------------------------

@dataclass
class RedLayout:
    ksizes: list[int]
    kstrides: list[list[int]]  # per tensor: outputs, loaded inputs, then the logical index
    rsizes: list[int]
    rstrides: list[list[int]]
    kn: int
    rn: int


def reduction_layout(prog: Program, fold: bool = False) -> RedLayout:
    """The kept and reduced dims, each coalesced where every tensor allows. With `fold`, the
    reduced dims only as the fold reads them (the prologue's loads and the logical index): a group
    norm's per-channel weight, read by its epilogue alone, then no longer splits a group's
    channels from its pixels, and the fold reads them as one contiguous run; the other tensors'
    reduced strides are then not theirs (zeros) and must not be used."""
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
    pro = prog.reduction.loads()
    ref = list(prog.in_strides[pro[0]]) if pro else logical
    rorder = sorted(dims, key=lambda d: -ref[d])
    ks, kst = coalesce(dom, tensors, korder)
    if fold:
        no, read = len(prog.out_strides), set(pro)
        loaded = sorted(prog.in_strides)
        tensors = [[0] * nd for _ in prog.out_strides] + [
            t if loaded[k] in read else [0] * nd for k, t in enumerate(tensors[no:no + len(loaded)])] + [logical]
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
    offsets and alignment a multiple of the width, and every split's chunk whole vectors (the
    last chunk of a row too, so the row itself)."""
    lay = reduction_layout(prog, fold=True)
    red = prog.reduction
    loads = red.loads()
    no = len(prog.outputs)
    tix = {i: no + k for k, i in enumerate(sorted(prog.in_strides))}
    out = [1]
    if len(lay.rsizes) != 1 or not loads:
        return tuple(out)
    for v in (2, 4, 8, 16):
        ok = lay.rn % v == 0 and all(-(-lay.rn // s) % v == 0 for s in splits)  # every chunk, the last too
        for i in loads:
            m, t = prog.inputs[i], tix[i]
            ok &= (lay.rstrides[t][-1] == 1 and v * m.itemsize <= 16 and m.align % (v * m.itemsize) == 0
                   and all(st % v == 0 for st in lay.kstrides[t]))
        if ok:
            out.append(v)
    return tuple(out)


def _ws_state(st_types: list[str], c: int, split: int, kn: int, base: int = 0) -> str:
    """State c's array in the workspace: `split` runs of `kn` states, 8 bytes a slot, `base` bytes in."""
    return f"reinterpret_cast<{CTYPE[st_types[c]]}*>(ws + {base + c * split * kn * 8}LL)"


def _finish(params: list[str], kind, dt: str, st: list[str], st_types: list[str], split: int, kn: int,
            kofs: list[str], epilogue: list[str]) -> list[str]:
    """kf_gen_finish: a thread a kept output q (kofs: its offsets), the runs' states merged in
    order from the workspace, then `epilogue` (which writes the outputs from the states `st`)."""
    ws = [_ws_state(st_types, c, split, kn) for c in range(len(st))]
    return [f'extern "C" __global__ void __launch_bounds__(256) kf_gen_finish({", ".join(params)}) {{',
            "  const kf_idx q = (kf_idx)blockIdx.x * 256 + threadIdx.x;",
            f"  if (q >= {kn}) return;",
            *[f"  {line}" for line in kofs],
            *[f"  {CTYPE[t]} {n} = {w}[q];" for n, t, w in zip(st, st_types, ws)],
            f"  for (int s = 1; s < {split}; ++s) {{",
            *[f"    const {CTYPE[t]} o{c} = {w}[(kf_idx)s * {kn} + q];" for c, (t, w) in enumerate(zip(st_types, ws))],
            *[f"    {line}" for line in _merge_block(kind, dt, st, [f"o{c}" for c in range(len(st))], "f")],
            "  }", *epilogue, "}"]


def lower_reduction(prog: Program, knobs: dict, sm_count: int, then: list[str] | None = None) -> Built:
    """With `then` (a normalization's per-element epilogue over the block's chunk, in statements
    that read the row's state st0, st1, ... and the chunk's bounds lo and hi), one cooperative
    launch of a block per chunk (lanes "block"): each block publishes its chunk's state, waits
    for its row's other chunks, merges all of the row's states in chunk order (every block the
    same state), then runs `then`. Otherwise partial states go to a workspace that kf_gen_finish
    merges."""
    red = prog.reduction
    kind, dt = red.kind, red.operand.dtype
    st_types = kind.state(dt)
    ns = len(st_types)
    lay = reduction_layout(prog, fold=True)
    nt, it, split, vec = knobs["threads"], knobs["items"], knobs["split"], knobs.get("vec", 1)
    lanes = 1 if knobs["algo"] == "gen_cols" else (nt if knobs["lanes"] == "block" else knobs["lanes"])
    rows = nt // lanes
    params, args, ptr = _pointers(prog)
    no = len(prog.outputs)
    loaded = sorted(prog.in_strides)
    tix = {i: no + k for k, i in enumerate(loaded)}
    logical_t = no + len(loaded)
    idx = _index_type(prog, 2 * nt * it * vec)
    pro_loads = set(red.loads())
    ch = ceil_div(lay.rn, split)
    ident = [_const(e) for e in kind.identity_exprs(dt)]
    st = [f"st{c}" for c in range(ns)]
    lines = [f"typedef {idx} kf_idx;",
             f"constexpr int NT = {nt}; constexpr int LANES = {lanes}; constexpr int ROWS = {rows}; "
             f"constexpr int IT = {it}; constexpr int V = {vec};",
             f"constexpr kf_idx KN = {lay.kn}; constexpr kf_idx RN = {lay.rn}; constexpr kf_idx CH = {ch};"]
    if split > 1 or prog.normalizes:
        params = params + ["unsigned char* __restrict__ ws"]
    # cooperative: a counter per row first (a 128-byte line each, zeroed before the launch)
    counters = 0 if then is None else lay.kn * 128

    def ws_ptr(c: int) -> str:
        return _ws_state(st_types, c, split, lay.kn, counters)

    # kept offsets of every tensor for output q
    kofs = offsets_code("q", lay.ksizes, lay.kstrides, [f"k{t}" for t in range(len(lay.kstrides))], idx)
    rofs = offsets_code("r", lay.rsizes, [lay.rstrides[tix[i]] for i in sorted(pro_loads)] + [lay.rstrides[logical_t]],
                        [f"ro{i}" for i in sorted(pro_loads)] + ["rl"], idx)
    body = [f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(params)}) {{',
            "  const int lane = threadIdx.x % LANES;",
            "  const kf_idx q = (kf_idx)blockIdx.x * ROWS + threadIdx.x / LANES;",
            "  const bool live = q < KN;",
            *[f"  {line}" for line in kofs],
            "  const kf_idx lo = (kf_idx)blockIdx.y * CH, hi = lo + CH < RN ? lo + CH : RN;",
            # one state per unrolled item u, merged after the loop: chains IT times shorter, so a
            # long row's sum rounds about as eager's reduction (several accumulators a thread) does
            *[f"  {CTYPE[t]} {n}u[IT];" for n, t in zip(st, st_types)],
            "#pragma unroll",
            "  for (int u = 0; u < IT; ++u) {",
            *[f"    {n}u[u] = {v};" for n, v in zip(st, ident)],
            "  }",
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
             "        if (r0 + (kf_idx)u * LANES * V < hi) {"]
    into = [f"{n}u[u]" for n in st]
    if kind.chunk is not None and vec > 1 and not red.siblings:
        # the V elements of a vector (always whole: reduction_vecs) folded as one chunk, then merged
        def element_load(i, stored, j):
            return f"x{i}[u][{j}]" if i in pro_loads else f"{ptr[i]}[k{tix[i]}]"
        body += [f"          {line}" for line in _chunk_block(
            kind, dt, into, red.operand, vec, element_load, lambda j: {"ridx": f"(ri[u] + (kf_i64){j} * {lstride})"}, "p")]
        body += ["        }", "      }", "    }", "  }"]
    else:
        def pro_load(i, stored):
            return f"x{i}[u][j]" if i in pro_loads else f"{ptr[i]}[k{tix[i]}]"

        em = Emitter("p", {"ridx": f"(ri[u] + (kf_i64)j * {lstride})"}, pro_load)
        xs, lift = red.lifted()
        values = [em(o) for o in red.operands]
        for x, v in zip(xs, values):
            em.env[x.value] = v
        lifted = [em(e) for e in lift]
        body += ["#pragma unroll", "        for (int j = 0; j < V; ++j) {"]
        body += [f"          {line}" for line in em.lines]
        body += [f"          {line}" for line in _merge_block(kind, dt, into, lifted, "u")]
        body += ["        }", "        }", "      }", "    }", "  }"]
    body += [f"  {CTYPE[t]} {n} = {n}u[0];" for n, t in zip(st, st_types)]
    body += ["#pragma unroll", "  for (int u = 1; u < IT; ++u) {",
             *[f"    {line}" for line in _merge_block(kind, dt, st, [f"{n}u[u]" for n in st], "i")], "  }"]
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

    def epilogue(state: list[str], indent: str, to_ws: bool = prog.normalizes) -> list[str]:
        def epi_load(i, stored):
            return f"{ptr[i]}[k{tix[i]}]"
        em2 = Emitter("e", {f"s{c}": n for c, n in enumerate(state)}, epi_load)
        res = {j: em2(prog.results[j]) for j in once}
        out = [indent + line for line in em2.lines]
        for j in once:
            out.append(f"{indent}out{j}[k{j}] = {convert(res[j], prog.results[j].dtype, prog.outputs[j].dtype)};")
        if to_ws:  # the row's state, for kf_gen_apply
            out += [f"{indent}{ws_ptr(c)}[q] = {n};" for c, n in enumerate(state)]
        return out

    if then is not None:
        assert lanes == nt, "a cooperative fold takes a block per chunk"
        part = "(kf_idx)blockIdx.y * KN + q"
        body += [*[f"  __shared__ {CTYPE[t]} row{c};" for c, t in enumerate(st_types)],
                 "  if (live && lane == 0) {",
                 *[f"    __stcg(&{ws_ptr(c)}[{part}], {n});" for c, n in enumerate(st)],
                 "    __threadfence();  // the state is visible before the count says so",
                 "    unsigned* count = reinterpret_cast<unsigned*>(ws + (kf_i64)q * 128);",
                 "    atomicAdd(count, 1u);",
                 f"    while (*reinterpret_cast<volatile unsigned*>(count) < {split}u) __nanosleep(64);",
                 "    __threadfence();",
                 *[f"    {n} = __ldcg(&{ws_ptr(c)}[q]);" for c, n in enumerate(st)],
                 f"    for (int s = 1; s < {split}; ++s) {{",
                 *[f"      const {CTYPE[t]} o{c} = __ldcg(&{ws_ptr(c)}[(kf_idx)s * KN + q]);" for c, t in enumerate(st_types)],
                 *[f"      {line}" for line in _merge_block(kind, dt, st, [f"o{c}" for c in range(ns)], "f")],
                 "    }",
                 *[f"    row{c} = {n};" for c, n in enumerate(st)],
                 "  }",
                 "  __syncthreads();",
                 "  if (!live) return;",
                 *[f"  {n} = row{c};" for c, n in enumerate(st)]]
        if once:
            body += ["  if (blockIdx.y == 0 && lane == 0) {", *epilogue(st, "    ", to_ws=False), "  }"]
        body += [f"  {line}" for line in then] + ["}"]
        minb = max(1, 1024 // nt)  # every block resident at once: 64 registers a thread at most
        body[0] = body[0].replace("__launch_bounds__(NT)", f"__launch_bounds__(NT, {minb})")
    elif split == 1 and not prog.normalizes:
        body += ["  if (live && lane == 0) {", *epilogue(st, "    "), "  }", "}"]
    else:
        body += ["  if (live && lane == 0) {"]
        body += [f"    {ws_ptr(c)}[(kf_idx)blockIdx.y * KN + q] = {n};" for c, n in enumerate(st)]
        body += ["  }", "}"]
        body += _finish(params, kind, dt, st, st_types, split, lay.kn, kofs, epilogue(st, "  "))
    src = "\n".join(lines + body)
    grid = (ceil_div(lay.kn, rows), split)
    staged = split > 1 or prog.normalizes
    kernels = [("kf_gen", grid, (nt,), args + ([{"ws": 0}] if staged else []), 0)]
    workspace = []
    if then is not None:
        kernels = [("kf_gen", grid, (nt,), args + [{"ws": 0}], 0, True)]
        workspace = [{"bytes": counters + ns * split * lay.kn * 8, "zero": True}]
    elif staged:
        kernels.append(("kf_gen_finish", (ceil_div(lay.kn, 256),), (256,), args + [{"ws": 0}], 0))
        workspace = [ns * split * lay.kn * 8]
    return Built(_header(src), kernels, workspace)


# ---- columns a block: reduced elements strided, kept ones contiguous ------------------

def prologue_outputs(prog: Program) -> tuple[int, ...] | None:
    """The outputs written at every reduced element (they vary over the reduced dims), where each
    is a value of the prologue, reading no state of the reduction: a shared region's value
    written beside the reduction it feeds (EfficientNet's SiLU beside its squeeze-and-excite
    mean). None where one reads the state (a normalization's epilogue) or an input the reduction
    does not read (silu(x) * z beside the mean of silu(x))."""
    dims = prog.reduce_dims
    full = tuple(j for j, st in enumerate(prog.out_strides) if any(st[d] for d in dims))
    read = set(prog.reduction.loads())
    if any(e.op == "var" and e.value != "ridx" or e.op == "load" and e.value[0] not in read
           for j in full for e in prog.results[j].walk()):
        return None  # the state, or an input the fold does not read (the kernel loads only those)
    return full


def cols_block_vecs(prog: Program) -> tuple[int, ...]:
    """Legal widths (kept outputs a thread) for gen_cols_block, narrowest first; () where its
    layout does not hold: a reduction whose innermost kept dim every tensor reads or writes
    contiguously or not at all (a channels-last global pool: channels), and whose outputs over
    the reduced dims, if any, are values of its prologue (prologue_outputs)."""
    red = prog.reduction
    if red is None or (prog.normalizes and prologue_outputs(prog) is None):
        return ()
    lay = reduction_layout(prog)
    no = len(prog.outputs)
    loaded = sorted(prog.in_strides)
    metas = [(t, m) for t, m in enumerate(prog.outputs) if m.numel] + [(no + k, prog.inputs[i]) for k, i in enumerate(loaded)]
    inner = [lay.kstrides[t][-1] for t, _ in metas]
    if any(s not in (0, 1) for s in inner) or not any(inner[k] for k, (t, _) in enumerate(metas) if t >= no):
        return ()
    if any(lay.kstrides[t][-1] != 1 for t, m in metas if t < no):  # outputs written across the kept dim
        return ()
    # the slices' states in static shared memory: 256 threads x v outputs x the state's bytes
    state_bytes = sum(getattr(torch, t).itemsize for t in red.kind.state(red.operand.dtype))
    return tuple(v for v in (1, 2, 4, 8) if lay.ksizes[-1] % v == 0 and 256 * v * state_bytes <= 40 * 1024 and all(
        v == 1 or lay.kstrides[t][-1] == 0 or vector_fits(v, m, lay.kstrides[t] + lay.rstrides[t], len(lay.kstrides[t]) - 1)
        for t, m in metas))


def lower_cols_block(prog: Program, knobs: dict) -> Built:
    """A block of `threads` threads: `threads / ty` columns of `vec` neighbouring kept outputs
    (one vector load a tensor each, along the contiguous kept dim) by `ty` slices of the reduced
    elements; each thread folds its slice (every ty-th element, `items` in flight, one state per
    item), then the slices merge in order through shared memory and the last writes the outputs.
    A channels-last global pool reads 16 bytes of channels a load, where a thread per output
    (gen_cols) reads 2. Outputs of the prologue's values (prologue_outputs) are written as the
    slice reads: one vector store a tensor a reduced element. With `split` > 1 the reduced
    elements are cut into that many runs, a block each (a grid row each): each block writes its
    columns' states to a workspace, and a second kernel merges them in order and writes the
    outputs, for reductions too few columns would leave most SMs idle on (EfficientNet's first
    squeeze-and-excite: 64x32 channels over 112x112 pixels)."""
    red = prog.reduction
    kind, dt = red.kind, red.operand.dtype
    st_types = kind.state(dt)
    lay = reduction_layout(prog)
    nt, ty, it, v = knobs["threads"], knobs["ty"], knobs["items"], knobs["vec"]
    split = knobs.get("split", 1)
    tx = nt // ty
    params, args, ptr = _pointers(prog)
    if split > 1:
        params = params + ["unsigned char* __restrict__ ws"]
    no = len(prog.outputs)
    loaded = sorted(prog.in_strides)
    tix = {i: no + k for k, i in enumerate(loaded)}
    logical_t = no + len(loaded)
    idx = _index_type(prog, 2 * nt * it * v)
    ident = [_const(e) for e in kind.identity_exprs(dt)]
    ns = len(st_types)
    kofs = offsets_code(f"q * {v}", lay.ksizes, lay.kstrides, [f"k{t}" for t in range(len(lay.kstrides))], idx)
    # a tensor read the same at every reduced element (batch norm's per-channel parameters) is
    # loaded once, before the loop
    once_read = [i for i in sorted(red.loads()) if not any(lay.rstrides[tix[i]])]
    pro = [i for i in sorted(red.loads()) if i not in once_read]
    written = prologue_outputs(prog) or ()
    rofs = offsets_code("r", lay.rsizes, [lay.rstrides[tix[i]] for i in pro] + [lay.rstrides[logical_t]]
                        + [lay.rstrides[j] for j in written], [f"ro{i}" for i in pro] + ["rl"]
                        + [f"rw{j}" for j in written], idx)
    wide = {i: lay.kstrides[tix[i]][-1] == 1 and v > 1 for i in red.loads()}  # else one value for the whole column

    def load(i: int, dest: str, off: str) -> str:
        ct = CTYPE[prog.inputs[i].dtype]
        if not wide[i]:
            return f"{dest}[0] = {ptr[i]}[k{tix[i]}{off}];"
        return (f"*reinterpret_cast<kf_vec<{ct}, {v}>*>({dest}) = "
                f"*reinterpret_cast<const kf_vec<{ct}, {v}>*>({ptr[i]} + k{tix[i]}{off});")

    em = Emitter("p", {"ridx": "ri[u]"},
                 lambda i, stored: f"x{i}{'v' if i in once_read else '[u]'}[{'j' if wide[i] else '0'}]")
    xs, lift = red.lifted()
    for x, o in zip(xs, red.operands):
        em.env[x.value] = em(o)
    lifted = [em(e) for e in lift]
    wvals = {j: convert(em(prog.results[j]), prog.results[j].dtype, prog.outputs[j].dtype) for j in written}

    def store(j: int) -> str:
        ct = CTYPE[prog.outputs[j].dtype]
        if v == 1:
            return f"out{j}[k{j} + rw{j}u[u]] = w{j}[0];"
        return (f"*reinterpret_cast<kf_vec<{ct}, {v}>*>(out{j} + k{j} + rw{j}u[u]) = "
                f"*reinterpret_cast<const kf_vec<{ct}, {v}>*>(w{j});")

    st = [f"st{c}" for c in range(ns)]
    body = [f"typedef {idx} kf_idx;",
            f"constexpr int NT = {nt}; constexpr int TX = {tx}; constexpr int TY = {ty}; constexpr int IT = {it}; "
            f"constexpr int V = {v};",
            f"constexpr kf_idx KQ = {lay.kn // v}; constexpr kf_idx RN = {lay.rn}; "
            f"constexpr kf_idx CH = {ceil_div(lay.rn, split)};  // reduced elements a grid row",
            f'extern "C" __global__ void __launch_bounds__(NT) kf_gen({", ".join(params)}) {{',
            "  const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;",
            "  const kf_idx q = (kf_idx)blockIdx.x * TX + tx;  // the column of V kept outputs",
            "  const bool live = q < KQ;",
            "  const kf_idx rb = (kf_idx)blockIdx.y * CH, re = rb + CH < RN ? rb + CH : RN;  // this row's run",
            *[f"  {line}" for line in kofs],
            *[f"  {CTYPE[t]} {n}u[IT][V];" for n, t in zip(st, st_types)],
            "#pragma unroll", "  for (int u = 0; u < IT; ++u)", "#pragma unroll", "    for (int j = 0; j < V; ++j) {",
            *[f"      {n}u[u][j] = {val};" for n, val in zip(st, ident)], "    }",
            "  if (live) {",
            *[f"    {CTYPE[prog.inputs[i].dtype]} x{i}v[V];" for i in once_read],
            *[f"    {load(i, f'x{i}v', '')}" for i in once_read],
            "    for (kf_idx r0 = rb + ty; r0 < re; r0 += (kf_idx)TY * IT) {",
            *[f"      {CTYPE[prog.inputs[i].dtype]} x{i}[IT][V];" for i in pro],
            "      kf_i64 ri[IT];", *[f"      kf_i64 rw{j}u[IT];" for j in written],
            "#pragma unroll", "      for (int u = 0; u < IT; ++u) {", "        const kf_idx r = r0 + (kf_idx)u * TY;",
            "        if (r < re) {", *[f"          {line}" for line in rofs],
            *[f"          {load(i, f'x{i}[u]', f' + ro{i}')}" for i in pro],
            "          ri[u] = rl;", *[f"          rw{j}u[u] = rw{j};" for j in written], "        }", "      }",
            "#pragma unroll", "      for (int u = 0; u < IT; ++u) {", "        if (r0 + (kf_idx)u * TY < re) {",
            *[f"          {CTYPE[prog.outputs[j].dtype]} w{j}[V];" for j in written],
            "#pragma unroll", "          for (int j = 0; j < V; ++j) {", *[f"            {line}" for line in em.lines],
            *[f"            w{j}[j] = {val};" for j, val in wvals.items()],
            *[f"            {line}" for line in _merge_block(kind, dt, [f"{n}u[u][j]" for n in st], lifted, "u")],
            "          }", *[f"          {store(j)}" for j in written], "        }", "      }", "    }", "  }",
            # items, then slices in order (shared memory), each column's V outputs apart
            *[f"  __shared__ {CTYPE[t]} sm{c}[TY][TX][V];" for c, t in enumerate(st_types)],
            "#pragma unroll", "  for (int j = 0; j < V; ++j) {",
            *[f"    {CTYPE[t]} {n} = {n}u[0][j];" for n, t in zip(st, st_types)],
            "#pragma unroll", "    for (int u = 1; u < IT; ++u) {",
            *[f"      {line}" for line in _merge_block(kind, dt, st, [f"{n}u[u][j]" for n in st], "i")], "    }",
            *[f"    sm{c}[ty][tx][j] = {n};" for c, n in enumerate(st)], "  }",
            "  __syncthreads();",
            "  if (!live || ty != TY - 1) return;  // the last slice's threads: the others' states are all written"]
    once = [j for j, m in enumerate(prog.outputs) if m.numel and j not in written]

    def epilogue(pad: str, at: str) -> list[str]:  # the outputs of kept point `at` (j: its place in the column)
        em2 = Emitter("e", {f"s{c}": n for c, n in enumerate(st)},
                      lambda i, stored: f"{ptr[i]}[k{tix[i]} + {at} * {lay.kstrides[tix[i]][-1]}]")
        res = {j: em2(prog.results[j]) for j in once}
        return [*[f"{pad}{line}" for line in em2.lines],
                *[f"{pad}out{j}[k{j} + {at}] = {convert(res[j], prog.results[j].dtype, prog.outputs[j].dtype)};"
                  for j in once]]

    body += ["#pragma unroll", "  for (int j = 0; j < V; ++j) {",
             *[f"    {CTYPE[t]} {n} = sm{c}[0][tx][j];" for c, (n, t) in enumerate(zip(st, st_types))],
             "    for (int y = 1; y < TY; ++y) {",
             *[f"      {line}" for line in _merge_block(kind, dt, st, [f"sm{c}[y][tx][j]" for c in range(ns)], "y")],
             "    }",
             *(epilogue("    ", "j") if split == 1 else
               [f"    {_ws_state(st_types, c, split, lay.kn)}[(kf_idx)blockIdx.y * {lay.kn} + q * V + j] = {n};"
                for c, n in enumerate(st)]),
             "  }", "}"]
    grid = (ceil_div(lay.kn // v, tx), split)
    if split == 1:
        return Built(_header("\n".join(body)), [("kf_gen", grid, (nt,), args, 0)], [])
    kept = offsets_code("q", lay.ksizes, lay.kstrides, [f"k{t}" for t in range(len(lay.kstrides))], idx)
    body += _finish(params, kind, dt, st, st_types, split, lay.kn, kept, epilogue("  ", "0"))
    return Built(_header("\n".join(body)), [("kf_gen", grid, (nt,), args + [{"ws": 0}], 0),
                                            ("kf_gen_finish", (ceil_div(lay.kn, 256),), (256,), args + [{"ws": 0}], 0)],
                 [ns * split * lay.kn * 8])
