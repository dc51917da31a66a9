"""Views of computed values in the builder (build.from_nodes): which views keep a value the
same function of the domain, moving a region's values to the domain a view puts them on (each
load then read through remapped strides; the outputs written through theirs), a reshape that
merges dims kept on the finer domain, and strides over a domain that splits a dim."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..cards import TensorMeta
from .ir import Expr, broadcast_strides


class Decline(Exception):
    """The builder declines the region: str(e) says why."""


def lead_stripped(shape) -> tuple[int, ...]:
    """The shape without its leading size-1 dims (what right-aligned broadcasting sees)."""
    shape = tuple(shape)
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


def reshaped(shape, strides, to: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides of a (shape, strides) tensor viewed with shape `to` (same elements in
    row-major order), 0 on size-1 dims; None if that is not a view."""
    try:
        v = torch.empty(0, device="meta").as_strided(tuple(shape), tuple(strides)).view(to)
    except RuntimeError:
        return None
    return tuple(0 if n == 1 else st for n, st in zip(to, v.stride()))


def moved_to(shape, to, remap, values, moved, stale, inputs, sources, loads, load_frame) -> None:
    """Move every value from domain `shape` to domain `to`, where a view (a permute, a reshape)
    puts it, before any reduction (each value is then a function of the point through its loads):
    each load of an input reads a new input, that input broadcast to `shape` and its strides
    remapped (`remap`: strides over `shape` -> over `to`, None where the view cannot follow them);
    a value that does not broadcast to `shape` goes stale."""
    made: dict[int, int] = {}

    def load_of(i: int) -> int:
        if i not in made:
            st = remapped(inputs[i], shape, remap)
            if st is None:
                raise Decline(f"input {i} of shape {tuple(inputs[i].shape)}, read before a view from {shape} to {to}, "
                               "cannot be read at the view's points through strides")
            inputs.append(replace(inputs[i], shape=to, stride=st))
            sources.append(sources[i])
            made[i] = len(inputs) - 1
        return made[i]

    memo: dict[int, Expr] = {}

    def moved_expr(e: Expr) -> Expr:
        if id(e) not in memo:
            memo[id(e)] = (Expr("load", (), e.dtype, (load_of(e.value[0]), e.value[1])) if e.op == "load" else
                           Expr(e.op, tuple(moved_expr(a) for a in e.args), e.dtype, e.value))
        return memo[id(e)]

    for key, (e, m) in list(values.items()):
        if key in stale or broadcast_strides(tuple(m.shape), (0,) * len(m.shape), shape) is None:
            stale.add(key)
            continue
        before, maps = moved.get(key, (shape, ()))
        moved[key] = (before, maps + (remap,))
        values[key] = (moved_expr(e), replace(m, shape=to, stride=contiguous(to)))
    for i in [i for i in loads if i not in made.values()]:  # read only through the moved inputs now
        del loads[i]
        load_frame.pop(i, None)
    for i in made.values():
        loads[i], load_frame[i] = "pro", 0


def moved_strides(m: TensorMeta, moved, written, frame) -> tuple[int, ...] | None:
    """Strides over the domain of an output whose value a view moved (its elements sit at the
    view's points) or that is a permute written after the reduction."""
    if moved is not None:
        before, maps = moved
        st = broadcast_strides(tuple(m.shape), tuple(m.stride), before) if lead_stripped(m.shape) == lead_stripped(before) else None
        for remap in maps:
            st = remap(st) if st is not None else None
        return st if st is not None and len(st) == len(frame) else None
    dims, src = written  # the permute's dims, and its operand's shape: size 1 where a reduction kept a dim
    if len(m.shape) != len(frame) or len(src) != len(frame):
        return None
    inverse = [0] * len(dims)
    for k, d in enumerate(dims):
        inverse[d] = k
    return tuple(0 if src[e] == 1 else m.stride[inverse[e]] for e in range(len(frame)))


def permute_dims(name: str, args: dict, ndim: int) -> tuple[int, ...] | None:
    """The dims a permute or a transpose puts in each place, or None for another view."""
    if name == "permute":
        return tuple(d % ndim for d in args["dims"])
    if name == "transpose" and ndim:
        dims = list(range(ndim))
        a, b = args["dim0"] % ndim, args["dim1"] % ndim
        dims[a], dims[b] = b, a
        return tuple(dims)
    return None


def contiguous(shape) -> tuple[int, ...]:
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(st))


def merged_groups(shape: tuple[int, ...], to: tuple[int, ...]) -> tuple[tuple[int, ...], ...] | None:
    """For each dim of `to`, the consecutive dims of `shape` it merges, where `to` is `shape`
    with runs of its dims merged (size-1 dims of `shape` go with the run they are in, or the next
    dim); else None. A split of a dim of `shape` is not a merge."""
    groups, k = [], 0
    for n in to:
        run, size = [], 1
        while k < len(shape) and (size < n or not run):
            run.append(shape[k])
            size *= shape[k]
            k += 1
        if size != n:
            return None
        groups.append(tuple(run))
    if k < len(shape):
        if math.prod(shape[k:]) != 1 or not groups:
            return None
        groups[-1] += tuple(shape[k:])
    return tuple(groups) if any(len(g) > 1 for g in groups) else None


def refinement(shape: tuple[int, ...], to: tuple[int, ...]) -> tuple[int, ...] | None:
    """The coarsest shape both `shape` and `to` merge runs of (a view that splits some dims and
    merges others: EfficientFormerV2's (B, heads, d, H*W) to (B, heads*d, H, W) has (B, heads, d,
    H, W)), or None where a dim of one straddles two of the other's."""
    a, b, out, i, j = list(shape), list(to), [], 0, 0
    while i < len(a) and j < len(b):
        x, y = a[i], b[j]
        if x == y:
            out.append(x)
            i, j = i + 1, j + 1
        elif y and x % y == 0:
            out.append(y)
            a[i], j = x // y, j + 1
        elif x and y % x == 0:
            out.append(x)
            b[j], i = y // x, i + 1
        else:
            return None
    if any(n != 1 for n in a[i:] + b[j:]):
        return None
    return tuple(out)


def composed(fine: tuple[tuple[int, ...], ...], groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The factors of each dim of a second merging reshape over the fine shape of the first
    (`fine`: each merged dim's factors; `groups`: the merged dims each new dim joins)."""
    out, k = [], 0
    for g in groups:
        out.append(sum(fine[k:k + len(g)], ()))
        k += len(g)
    return tuple(out)


def read_fine(loads: dict, inputs: list[TensorMeta], fine_inputs: set[int], merge) -> None:
    """From a second merging reshape on, the inputs read over the first one's merged shape are
    read over its fine shape, their strides split to it (merge: (fine, merged, factors))."""
    fine, shape, groups = merge
    for i in loads:
        if i not in fine_inputs:
            st = broadcast_strides(tuple(inputs[i].shape), tuple(inputs[i].stride), shape)
            if st is None:
                raise Decline(f"input {i} of shape {tuple(inputs[i].shape)} does not broadcast to {shape}")
            inputs[i] = replace(inputs[i], shape=fine, stride=split_merged(st, groups))


def remapped(m: TensorMeta, shape: tuple[int, ...], remap) -> tuple[int, ...] | None:
    """The strides an input read over domain `shape` has at a view's points (`remap`: strides over
    `shape` -> over the view's shape), or None where strides cannot say them."""
    st = broadcast_strides(tuple(m.shape), tuple(m.stride), shape)
    return remap(st) if st is not None else None


def remappable(loads: dict, inputs: list[TensorMeta], shape: tuple[int, ...], remap) -> bool:
    """Whether every input read so far can be read at a view's points through strides."""
    return all(remapped(inputs[i], shape, remap) is not None for i in loads)


def split_merged(strides: tuple[int, ...], groups: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Strides over the merged shape -> over the fine one (each dim split into its factors)."""
    out = []
    for st, group in zip(strides, groups):
        inner = math.prod(group)
        for n in group:
            inner //= n
            out.append(0 if n == 1 else st * inner)
    return tuple(out)


def split_strides(strides: tuple[int, ...], frame: tuple[int, ...], split) -> tuple[int, ...]:
    """Strides over `frame` -> over the domain, where dim d of the frame is split in (g, size // g)."""
    if split is None:
        return strides
    d, g = split
    return strides[:d] + (strides[d] * (frame[d] // g), strides[d]) + strides[d + 1:]


def split_domain(frame: tuple[int, ...], split) -> tuple[int, ...]:
    if split is None:
        return frame
    d, g = split
    return frame[:d] + (g, frame[d] // g) + frame[d + 1:]


def widened(frame: tuple[int, ...], shapes, fixed: tuple[int, ...]) -> tuple[int, ...]:
    """`frame` with its size-1 dims outside `fixed` grown to the sizes `shapes` (right-aligned)
    have there: a keepdim reduction's result read by pointwise work over a larger shape
    (ConvNeXt-V2's global response norm: the mean over the channels of a per-channel norm, then
    the feature map times it). Each kept point of the wider frame folds the same elements. The
    frame as it is where a shape has more dims, or a size other than 1 or the frame's."""
    out = list(frame)
    for shape in shapes:
        lead = len(frame) - len(shape)
        if lead < 0:
            return frame
        for d, n in enumerate(shape, lead):
            if n != 1 and n != out[d]:
                if frame[d] != 1 or out[d] != 1 or d in fixed:
                    return frame
                out[d] = n
    return tuple(out)


def overlaps(m: TensorMeta) -> bool:
    """Two indices of `m` name one element: some dim's stride is less than the extent of the
    dims inside it."""
    extent = 1
    for size, st in sorted(((sz, abs(st)) for sz, st in zip(m.shape, m.stride) if sz > 1), key=lambda d: d[1]):
        if st < extent:
            return True
        extent = st * size
    return False


ORDER_KEEPING = frozenset({"view", "_unsafe_view", "reshape", "alias", "unsqueeze", "squeeze", "flatten", "unflatten"})


def keeps_element_order(name: str, args: dict, m: TensorMeta, out: TensorMeta) -> bool:
    """Whether view `name` of a value `m` gives its elements in the same (row-major) order: a view
    of the ORDER_KEEPING kind always does, whatever its strides (a cat's slab of it has gaps); a
    permute where it moves only size-1 dims; any other view (t, as_strided, ...) where it leaves
    the strides as they were (a permute of equal sizes does not)."""
    dims = permute_dims(name, args, len(m.shape))
    if dims is not None:
        moved = [d for d in dims if m.shape[d] != 1]
        return moved == sorted(moved)
    if name in ORDER_KEEPING:
        return True
    to = tuple(out.shape)
    return reshaped(m.shape, m.stride, to) == reshaped(to, out.stride, to)


def viewed_strides(m: TensorMeta, name: str, args: dict, out: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides of `m` seen through view `name` to shape `out` (a permute, an expand, or a view
    that keeps the order of its elements), or None."""
    dims = permute_dims(name, args, len(m.shape))
    if dims is not None:
        return tuple(m.stride[d] for d in dims)
    if name == "expand":
        return broadcast_strides(tuple(m.shape), tuple(m.stride), out)
    if name in ORDER_KEEPING and math.prod(out) == m.numel:
        return reshaped(m.shape, m.stride, out)
    return None
