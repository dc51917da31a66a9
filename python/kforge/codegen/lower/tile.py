"""Pointwise work with a transposed operand (`algo` "gen_tile"): tiles staged in shared memory.

A pointwise kernel walks its domain in the order of the first output's memory, so each
warp writes consecutive addresses. An input contiguous along another dim of that domain (ViT's
patches, NCHW convolution output read as tokens; a permute made contiguous; NCHW <-> NHWC)
is then read an element per 32-byte sector by a warp: a quarter to an eighth of each sector
it fetches is used. Here a block takes a T x T tile of the two dims (a: the outputs' inner dim,
b: the transposed input's), reads each transposed input's tile along b (coalesced) into
shared memory, and after a barrier computes and writes the tile along a, taking those inputs
from shared memory and the rest from memory as the flat kernel does.
"""

from __future__ import annotations

import math

from ...proposers.builtin.common import ceil_div
from ..ir import Program
from .emit import CTYPE, Emitter, _index_type, _pointers, convert, fast_nodes, offsets_code, vector_fits

T = 32  # tile side: a warp's width along either dim
MIN_SIDE = 16  # both dims at least this long: a tile mostly used
SMEM = 47 * 1024  # static shared memory a kernel may declare (48 KB), with room to spare


def transposed_dim(prog: Program, layout) -> int | None:
    """The dim (of the coalesced layout, not the last) along which the largest loaded input
    that is not read along the last dim is contiguous, if the program can be tiled; else None."""
    sizes, strides = layout
    if len(sizes) < 2 or prog.gathers or prog.aliases or prog.reduction is not None or sizes[-1] < MIN_SIDE:
        return None
    no, best = len(prog.outputs), None
    if any(st[-1] != 1 for st in strides[:no]):
        return None  # an output strided along the inner dim: the flat kernel's layout already fails it
    for k, i in enumerate(sorted(prog.in_strides)):
        st = strides[no + k]
        if st[-1] == 1 or not st[-1]:
            continue  # read along the inner dim, or broadcast along it
        inner = [d for d in range(len(sizes) - 1) if st[d] == 1 and sizes[d] >= MIN_SIDE]
        if inner and (best is None or _bytes(prog, i) > best[0]):
            best = (_bytes(prog, i), inner[0])
    return None if best is None else best[1]


def _bytes(prog: Program, i: int) -> int:
    return prog.inputs[i].span() * prog.inputs[i].itemsize


def _transposed(prog: Program, layout, b: int) -> list[int]:
    """The inputs contiguous along b and strided along the last dim: read transposed to the outputs."""
    sizes, strides = layout
    a, no = len(sizes) - 1, len(prog.outputs)
    return [i for k, i in enumerate(sorted(prog.in_strides)) if strides[no + k][b] == 1 and strides[no + k][a] not in (0, 1)]


def _tile_bytes(prog: Program, i: int, v: int) -> int:
    return T * v * (T * v + 1) * prog.inputs[i].itemsize


def staged_inputs(prog: Program, layout, b: int, budget: int = SMEM, v: int = 1) -> list[int]:
    """The inputs contiguous along b (and read along the last dim) whose tiles (T*v a side) a
    kernel stages, largest first while they fit in `budget` bytes of shared memory; the rest are read flat."""
    out, used = [], 0
    for i in sorted(_transposed(prog, layout, b), key=lambda i: -_bytes(prog, i)):
        if used + _tile_bytes(prog, i, v) <= budget:
            out.append(i)
            used += _tile_bytes(prog, i, v)
    return sorted(out)


def tiled_vecs(prog: Program, layout) -> tuple[int, ...]:
    """Vector widths v a tiled kernel of this program may take (1 where it has no tile): a
    thread reads v consecutive elements of each transposed input along b and writes v of each
    output along the last dim, so both dims are whole vectors and every such access is aligned."""
    b = transposed_dim(prog, layout)
    if b is None:
        return (1,)
    sizes, strides = layout
    a, no = len(sizes) - 1, len(prog.outputs)
    loaded = sorted(prog.in_strides)
    out = [1]
    for v in (2, 4):
        ok = sizes[a] % v == 0 and sizes[b] % v == 0
        ok &= all(vector_fits(v, m, strides[j], a, prog.out_offset(j)) for j, m in enumerate(prog.outputs))
        ok &= all(vector_fits(v, prog.inputs[i], strides[no + loaded.index(i)], b, prog.offset(i))
                  for i in _transposed(prog, layout, b))
        if ok:
            out.append(v)
    return tuple(out)


def transposed_share(prog: Program, layout) -> float:
    """The share of the bytes a kernel moves that its tiles would stage (0 if none)."""
    b = transposed_dim(prog, layout)
    if b is None:
        return 0.0
    moved = sum(m.numel * m.itemsize for m in prog.outputs) + sum(_bytes(prog, i) for i in prog.in_strides)
    return sum(_bytes(prog, i) for i in staged_inputs(prog, layout, b)) / max(1, moved)


def tile_kernel(prog: Program, layout, b: int, threads: int, name: str, device: bool,
                budget: int = SMEM, vec: int = 1) -> tuple[str, tuple, int] | None:
    """The tiled kernel `name` (or device function, as pointwise._kernel) over dims a (the
    last) and b of `layout`, `threads` a block (4, 8 or 16 rows of the tile a step), `vec`
    elements a thread along the dim it reads or writes (the widest of tiled_vecs up to it whose
    tiles fit; the tile is 32*vec a side), and the shared memory it declares; None where no
    tile fits in `budget` bytes."""
    assert threads % 32 == 0 and T % (threads // 32) == 0, threads
    sizes, strides = layout
    a = len(sizes) - 1
    rows = threads // 32
    # the widest vector up to `vec` whose tiles fit (a tile 4 wide is 128 x 129 elements)
    fits = [(w, staged_inputs(prog, layout, b, budget, w)) for w in tiled_vecs(prog, layout) if w <= vec]
    fits = [(w, staged) for w, staged in fits if staged]
    if not fits:
        return None
    v, staged = fits[-1]
    side = T * v
    params, args, ptr = _pointers(prog)
    no = len(prog.outputs)
    loaded = sorted(prog.in_strides)
    ins_of = {i: no + k for k, i in enumerate(loaded)}
    outer = [d for d in range(len(sizes)) if d not in (a, b)]
    nta, ntb = ceil_div(sizes[a], side), ceil_div(sizes[b], side)
    blocks = max(1, nta * ntb * math.prod(sizes[d] for d in outer))
    idx = _index_type(prog, blocks)

    def at(t: int, av: str, bv: str) -> str:
        st = strides[t]
        terms = [f"o{t}"] + [f"({idx})({v_}) * {st[d]}" if " " in v_ else f"({idx}){v_} * {st[d]}"
                             for v_, d in ((av, a), (bv, b)) if st[d]]
        return " + ".join(terms)

    ct = {i: CTYPE[prog.inputs[i].dtype] for i in loaded}
    hoist = [f"  const {ct[i]} h{i} = {ptr[i]}[0];" for i in loaded if not any(strides[ins_of[i]])]
    smem = [f"  __shared__ {ct[i]} s{i}[{side}][{side + 1}];" for i in staged]
    # read along the outputs' dim a vector at a time: the others contiguous along it, aligned
    wide = [i for i in loaded if v > 1 and i not in staged and strides[ins_of[i]][a] == 1
            and vector_fits(v, prog.inputs[i], strides[ins_of[i]], a, prog.offset(i))]
    ea = "ea + j_" if v > 1 else "ea"

    def load(i, stored):
        if i in staged:
            return f"s{i}[tx * {v} + j_][ty + r_]" if v > 1 else f"s{i}[tx][ty + r_]"
        if not any(strides[ins_of[i]]):
            return f"h{i}"
        if i in wide:
            return f"x{i}[j_]"
        return f"{ptr[i]}[{at(ins_of[i], ea, 'eb')}]"

    em = Emitter("v", {}, load, fast_nodes(prog, prog.results))
    res = [em(e) for e in prog.results]
    written = [j for j, m in enumerate(prog.outputs) if m.numel]
    if v == 1:
        stage = [f"        s{i}[ty + r_][tx] = {ptr[i]}[{at(ins_of[i], 'ea', 'eb')}];" for i in staged]
        compute = [*[f"          {line}" for line in em.lines],
                   *[f"          out{j}[{at(j, 'ea', 'eb')}] = {convert(res[j], prog.results[j].dtype, prog.outputs[j].dtype)};"
                     for j in written]]
    else:
        stage = []
        for i in staged:
            stage += [f"        {{ const kf_vec<{ct[i]}, {v}> t_ = *reinterpret_cast<const kf_vec<{ct[i]}, {v}>*>("
                      f"{ptr[i]} + {at(ins_of[i], 'ea', 'eb')});",
                      f"          for (int j_ = 0; j_ < {v}; ++j_) s{i}[ty + r_][tx * {v} + j_] = t_.v[j_]; }}"]
        compute = [*[f"          kf_vec<{ct[i]}, {v}> x{i}v = *reinterpret_cast<const kf_vec<{ct[i]}, {v}>*>("
                     f"{ptr[i]} + {at(ins_of[i], 'ea', 'eb')}); const {ct[i]}* x{i} = x{i}v.v;" for i in wide],
                   *[f"          kf_vec<{CTYPE[prog.outputs[j].dtype]}, {v}> r{j};" for j in written],
                   "#pragma unroll",
                   f"          for (int j_ = 0; j_ < {v}; ++j_) {{",
                   *[f"            {line}" for line in em.lines],
                   *[f"            r{j}.v[j_] = {convert(res[j], prog.results[j].dtype, prog.outputs[j].dtype)};" for j in written],
                   "          }",
                   *[f"          *reinterpret_cast<kf_vec<{CTYPE[prog.outputs[j].dtype]}, {v}>*>(out{j} + {at(j, 'ea', 'eb')}) = r{j};"
                     for j in written]]
    outer_sizes = [sizes[d] for d in outer] or [1]
    outer_strides = [[st[d] for d in outer] or [0] for st in strides]
    offs = offsets_code("rest_", outer_sizes, outer_strides, [f"o{t}" for t in range(len(strides))], idx)
    lane = f"tx * {v}" if v > 1 else "tx"
    src = "\n".join([
        f"typedef {idx} kf_idx;",
        (f'__device__ __forceinline__ void {name}({", ".join(params + ["unsigned kf_bid", "unsigned kf_nblk"])}) {{'
         if device else f'extern "C" __global__ void __launch_bounds__({threads}) {name}({", ".join(params)}) {{'),
        *([] if device else ["  const unsigned kf_bid = blockIdx.x, kf_nblk = gridDim.x;"]),
        *hoist,
        *smem,
        *[f"  out{j} += {prog.out_offset(j)};" for j in range(no) if prog.out_offset(j)],
        "  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;",
        f"  for (kf_idx bid = kf_bid; bid < {blocks}; bid += kf_nblk) {{",
        f"    const kf_idx a0 = (bid % {nta}) * {side};",
        f"    const kf_idx b0 = ((bid / {nta}) % {ntb}) * {side};",
        f"    const kf_idx rest_ = bid / {nta * ntb};",
        *[f"    {line}" for line in offs],
        f"    for (int r_ = 0; r_ < {side}; r_ += {rows}) {{",  # the staged tiles, read along b
        f"      const kf_idx ea = a0 + ty + r_, eb = b0 + {lane};",
        f"      if (ea < {sizes[a]} && eb < {sizes[b]}) {{",
        *stage,
        "      }",
        "    }",
        "    __syncthreads();",
        f"    for (int r_ = 0; r_ < {side}; r_ += {rows}) {{",  # the outputs, written along a
        f"      const kf_idx ea = a0 + {lane}, eb = b0 + ty + r_;",
        f"      if (ea < {sizes[a]} && eb < {sizes[b]}) {{",
        *compute,
        "      }",
        "    }",
        "    __syncthreads();",  # the tiles are read before the next ones land
        "  }",
        "}",
    ])
    args = [{"out": prog.card_output(a_["out"])} if "out" in a_ else a_ for a_ in args]
    return src, (name, (blocks,), (threads,), args, 0), sum(_tile_bytes(prog, i, v) for i in staged)
