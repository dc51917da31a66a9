"""IR -> CUDA C for NVRTC plus a launch plan, for one point of the knob space: emit (what every
lowering shares), pointwise, reduce (reductions and normalizations), scan (scans), window (pooling).

Layout: the domain's dims are reduced the way TensorIterator does it (size-1 dims dropped,
dims ordered by the first output's strides, neighbours merged where every tensor is
contiguous across them); a reduction does this separately for its kept and reduced dims.
Shapes and strides are compile-time constants, so the index arithmetic folds.

Pointwise (`algo` "flat"): each thread handles `items` vectors of `vec` elements, loads
issued for all items before any math (16-byte accesses where a tensor is contiguous along
the inner dim), values computed in the compute dtype and rounded once on store.

Pointwise with costly work on inputs read the same along the outermost dim (`grid` "heads": a rotary
embedding's sines and cosines per position, beside its heads): each thread takes `items` indices of
that dim, computing that work once.

Pointwise with an input contiguous along another dim than the outputs (`algo` "gen_tile"):
square tiles of those two dims (32 x `tvec` a side) staged through shared memory, read along
one and written along the other, `tvec` consecutive elements a thread (lower/tile.py).

Reduction: a group of `lanes` threads folds each output's reduced elements (`items` loads
of `vec` consecutive elements in flight per thread), merges through warp shuffles and, for groups wider than a warp,
shared memory; `algo` "rows" puts whole warps on an output (reduced dims contiguous), "cols"
one thread per output (kept dims contiguous: the loads coalesce across outputs), "cols_block"
a vector of neighbouring outputs per thread and several threads per column, each folding a slice
of the reduced elements (merged through shared memory). `split` > 1
divides the reduced elements over that many blocks, which write their states to a workspace
that a second kernel merges in order (two passes) before the epilogue. A normalization's split
form may instead be one cooperative launch ("gen_norm_coop"): each block publishes its chunk's
state, waits for its row's other chunks, merges them all and normalizes its own chunk. Rows
whose length or offsets are not whole vectors ("gen_norm" with a `vec` from peel_vecs) are
peeled: each row's elements before its first aligned vector and after its last whole one are
taken one at a time, the rest as vectors.

Scan (`algo` "gen_scan"): one thread per line along the scanned dim, walking it in order;
`algo` "gen_scan_block" (lines contiguous in memory): one block per line, a parallel scan of
chunks of threads x items elements carried from chunk to chunk (`stage` "smem": the chunk read
and written at consecutive elements through shared memory).
Window (`algo` "gen_window", 2-D and 3-D pooling): one thread per output point folding its
window (`vec` output points along a non-pooled innermost dim, channels-last's channels);
`algo` "gen_window_tile" (2-D, pooled dims innermost): a block per th x tw tile of output points
stages the prologue's value at each input point of the tile's span in shared memory once, then
folds every window from there.
"""

from __future__ import annotations

from .pointwise import heads_items, lower_pointwise, pointwise_vecs, tile_vecs, tileable
from .norm import coop_split, lower_norm, lower_norm_coop, lower_norm_split, norm_staging, norm_vecs, peel_vecs
from .reduce import (cols_block_vecs, lower_cols_block, lower_reduction, prologue_outputs, reduced_is_inner, reduction_layout,
                     reduction_vecs)
from .scan import lower_scan, lower_scan_block, scan_is_inner
from .window import lower_window, window_tiles, window_vecs

__all__ = ["cols_block_vecs", "prologue_outputs", "heads_items", "coop_split", "lower_cols_block", "lower_norm", "lower_norm_coop", "lower_norm_split", "lower_pointwise", "lower_reduction", "lower_scan", "lower_scan_block",
           "lower_window", "norm_staging", "norm_vecs", "peel_vecs", "pointwise_vecs", "reduced_is_inner", "reduction_layout",
           "reduction_vecs", "scan_is_inner", "tile_vecs", "tileable", "window_tiles", "window_vecs"]
