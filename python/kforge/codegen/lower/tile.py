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
from .emit import CTYPE, Emitter, _index_type, _pointers, convert, fast_nodes, offsets_code

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


def staged_inputs(prog: Program, layout, b: int, budget: int = SMEM) -> list[int]:
    """The inputs contiguous along b (and read along the last dim) whose tiles a kernel stages,
    largest first while their tiles fit in `budget` bytes of shared memory; the rest are read flat."""
    sizes, strides = layout
    a, no = len(sizes) - 1, len(prog.outputs)
    cands = [i for k, i in enumerate(sorted(prog.in_strides)) if strides[no + k][b] == 1 and strides[no + k][a] not in (0, 1)]
    out, used = [], 0
    for i in sorted(cands, key=lambda i: -_bytes(prog, i)):
        if used + T * (T + 1) * prog.inputs[i].itemsize <= budget:
            out.append(i)
            used += T * (T + 1) * prog.inputs[i].itemsize
    return sorted(out)


def transposed_share(prog: Program, layout) -> float:
    """The share of the bytes a kernel moves that its tiles would stage (0 if none)."""
    b = transposed_dim(prog, layout)
    if b is None:
        return 0.0
    moved = sum(m.numel * m.itemsize for m in prog.outputs) + sum(_bytes(prog, i) for i in prog.in_strides)
    return sum(_bytes(prog, i) for i in staged_inputs(prog, layout, b)) / max(1, moved)


def tile_kernel(prog: Program, layout, b: int, threads: int, name: str, device: bool,
                budget: int = SMEM) -> tuple[str, tuple, int] | None:
    """The tiled kernel `name` (or device function, as pointwise._kernel) over dims a (the
    last) and b of `layout`, `threads` a block (4, 8 or 16 rows of the tile a step), and the
    shared memory it declares; None where no tile fits in `budget` bytes."""
    assert threads % 32 == 0 and T % (threads // 32) == 0, threads
    sizes, strides = layout
    a = len(sizes) - 1
    rows = threads // 32
    params, args, ptr = _pointers(prog)
    no = len(prog.outputs)
    loaded = sorted(prog.in_strides)
    ins_of = {i: no + k for k, i in enumerate(loaded)}
    staged = staged_inputs(prog, layout, b, budget)
    if not staged:
        return None
    outer = [d for d in range(len(sizes)) if d not in (a, b)]
    nta, ntb = ceil_div(sizes[a], T), ceil_div(sizes[b], T)
    blocks = max(1, nta * ntb * math.prod(sizes[d] for d in outer))
    idx = _index_type(prog, blocks)

    def at(t: int, av: str, bv: str) -> str:
        st = strides[t]
        terms = [f"o{t}"] + [f"({idx}){v} * {st[d]}" for v, d in ((av, a), (bv, b)) if st[d]]
        return " + ".join(terms)

    hoist = [f"  const {CTYPE[prog.inputs[i].dtype]} h{i} = {ptr[i]}[0];" for i in loaded if not any(strides[ins_of[i]])]
    smem = [f"  __shared__ {CTYPE[prog.inputs[i].dtype]} s{i}[{T}][{T + 1}];" for i in staged]

    def load(i, stored):
        if i in staged:
            return f"s{i}[tx][ty + r_]"
        if not any(strides[ins_of[i]]):
            return f"h{i}"
        return f"{ptr[i]}[{at(ins_of[i], 'ea', 'eb')}]"

    em = Emitter("v", {}, load, fast_nodes(prog, prog.results))
    res = [em(e) for e in prog.results]
    stores = [f"          out{j}[{at(j, 'ea', 'eb')}] = {convert(r, prog.results[j].dtype, m.dtype)};"
              for j, (m, r) in enumerate(zip(prog.outputs, res)) if m.numel]
    outer_sizes = [sizes[d] for d in outer] or [1]
    outer_strides = [[st[d] for d in outer] or [0] for st in strides]
    offs = offsets_code("rest_", outer_sizes, outer_strides, [f"o{t}" for t in range(len(strides))], idx)
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
        f"    const kf_idx a0 = (bid % {nta}) * {T};",
        f"    const kf_idx b0 = ((bid / {nta}) % {ntb}) * {T};",
        f"    const kf_idx rest_ = bid / {nta * ntb};",
        *[f"    {line}" for line in offs],
        *([f"    for (int r_ = 0; r_ < {T}; r_ += {rows}) {{",  # the staged tiles, read along b
           "      const kf_idx ea = a0 + ty + r_, eb = b0 + tx;",
           f"      if (ea < {sizes[a]} && eb < {sizes[b]}) {{",
           *[f"        s{i}[ty + r_][tx] = {ptr[i]}[{at(ins_of[i], 'ea', 'eb')}];" for i in staged],
           "      }",
           "    }",
           "    __syncthreads();"] if staged else []),
        f"    for (int r_ = 0; r_ < {T}; r_ += {rows}) {{",  # the outputs, written along a
        "      const kf_idx ea = a0 + tx, eb = b0 + ty + r_;",
        f"      if (ea < {sizes[a]} && eb < {sizes[b]}) {{",
        *[f"          {line}" for line in em.lines],
        *stores,
        "      }",
        "    }",
        *(["    __syncthreads();"] if staged else []),  # the tiles are read before the next ones land
        "  }",
        "}",
    ])
    args = [{"out": prog.card_output(a_["out"])} if "out" in a_ else a_ for a_ in args]
    return src, (name, (blocks,), (threads,), args, 0), sum(T * (T + 1) * prog.inputs[i].itemsize for i in staged)
