"""Kernels from the code generator (kforge.codegen) for any card its op table covers:
every pointwise op torch tags, copies, one-level reductions, normalizations (softmax,
log_softmax, layer/rms/group/batch norm, with their prologue and epilogue), scans (cumsum,
cumprod) and 2-D max/avg pooling, and region cards whose subgraph is such a chain. It adds candidates beside
the hand-written templates for the same cards (algorithms "gen_*"), and is the only
built-in source for the rest.
"""

from __future__ import annotations

import json

from ...candidate import Candidate, LaunchPlan
from ...cards import Card
from ...codegen import card_program, lower
from ...codegen.ir import FLOATS, Program
from ...hardware import Hardware
from .space import space_of
from .template import Knobs, KnobSpace, Template, launch, pick

_PROGRAMS: dict[str, Program | str] = {}  # card id -> its program (cards are immutable once made)
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TILE_SHARE = 0.25  # of a kernel's bytes in a transposed input: gen_tile by default


def program(card: Card) -> Program | str:
    if card.id not in _PROGRAMS:
        if len(_PROGRAMS) > 4096:
            _PROGRAMS.clear()
        try:
            _PROGRAMS[card.id] = card_program.program_for_card(card)
        except (ValueError, TypeError, ArithmeticError) as e:
            # An entry that cannot express this dtype (e.g. a NaN constant in an integer
            # op) declines the card; a search must not die on one card.
            _PROGRAMS[card.id] = f"the generator cannot express {card.op} for these dtypes: {e}"
    return _PROGRAMS[card.id]


def check(card: Card) -> str | None:
    p = program(card)
    return p if isinstance(p, str) else None


def _splits(prog: Program) -> tuple[int, ...]:
    lay = lower.reduction_layout(prog)
    return tuple(s for s in SPLITS if s == 1 or (lay.rn >= s * 256 and s * lay.kn <= 2**24))


# Accuracy of the reduction knobs. One thread folds about RN / (lanes x split) elements, in
# `items` interleaved chains (one partial state per unrolled item), then the states merge as a
# tree; where rounding accumulates (floating sums,
# products, Welford, logsumexp), a long sequential chain loses what eager's tree keeps:
# an fp32 sum of 16M uniform values folded 2M at a time by 8 lanes misses by 2e-5 relative,
# twice the evaluator's fp32 floor; 2048 at a time misses by 6e-7. So the reduction spaces
# only hold settings whose chains are at most CHAIN long.
CHAIN = 2048
EXACT_KINDS = frozenset({"max", "min", "any", "all", "argmax", "argmin"})  # any order gives the same answer
ROW_THREADS, ROW_LANES = (128, 256, 512, 1024), (8, 32, 128, "block")


def _chain_floor(prog: Program) -> int:
    """The fewest threads (lanes x split) one output's reduced elements must be spread over."""
    red = prog.reduction
    if red.kind.name in EXACT_KINDS or all(t not in FLOATS for t in red.kind.state(red.operand.dtype)):
        return 1
    return -(-lower.reduction_layout(prog).rn // CHAIN)


def _reduction_spaces(prog: Program) -> list[KnobSpace]:
    """gen_rows and gen_cols with only the accurate settings: every lanes value at least some
    width and every split at least what that width needs (all combinations then hold); the
    narrowest width that some split can serve keeps the most settings. gen_cols (one thread
    per output) is left out where no split is enough. `vec`: the prologue's load width, every
    one legal with every split of the space (lower.reduction_vecs)."""
    splits, need = _splits(prog), _chain_floor(prog)
    rows = {"algo": ("gen_rows",), "threads": (1024,), "lanes": ("block",), "items": (1, 2, 4, 8),
            "split": splits[-1:]}  # past every floor (over 10^9 elements): the most accurate there is
    for width in (8, 32, 128, 256, 512, 1024):
        ok = tuple(s for s in splits if s * width >= need)
        if ok:
            rows.update(threads=tuple(t for t in ROW_THREADS if t >= width), split=ok,
                        lanes=tuple(n for n in ROW_LANES if n == "block" or n >= width))
            break
    rows["vec"] = lower.reduction_vecs(prog, rows["split"])
    cols = tuple(s for s in splits if s >= need)
    return [rows] + ([{"algo": ("gen_cols",), "threads": (64, 128, 256, 512), "items": (1, 2, 4, 8), "split": cols,
                       "vec": lower.reduction_vecs(prog, cols)}] if cols else []) + _cols_block_space(prog)


def _cols_block_space(prog: Program) -> list[KnobSpace]:
    """gen_cols_block where its layout holds and every slice's chain is short: at most CHAIN
    elements a thread at its fewest slices (2) of a run; `split` cuts the reduced elements into
    that many runs of 64 at least, a block each."""
    vecs, rn = lower.cols_block_vecs(prog), lower.reduction_layout(prog).rn
    splits = tuple(s for s in (1, 2, 4, 8, 16, 32) if -(-rn // s) <= 2 * CHAIN and (s == 1 or rn // s >= 64))
    if not vecs or not splits:
        return []
    return [{"algo": ("gen_cols_block",), "threads": (128, 256), "ty": (2, 4, 8, 16, 32, 64), "items": (1, 2, 4),
             "vec": vecs, "split": splits}]


def _within(knobs: Knobs, spaces: list[KnobSpace]) -> Knobs:
    """The heuristic default moved into the accurate space: each knob to the nearest legal
    value at or above it (the most aggressive one where none is); gen_rows with a block per
    output where gen_cols was left out."""
    space = space_of(spaces, knobs)
    if space is None:
        knobs, space = {"algo": "gen_rows", "threads": 512, "lanes": "block", "items": 4,
                        "split": knobs["split"]}, spaces[0]
    # gen_rows starts at the widest legal vector (on the H200, var fp32 rows ran in 79 us with
    # 4-wide loads against 113 us scalar, and half-type rows 8-wide 44 against 51); the column
    # forms read a vector across neighbouring outputs, which the search tries from scalar
    widest = space.get("vec", (1,))[-1] if knobs["algo"] == "gen_rows" else 1
    out = {"vec": widest, **knobs}
    for name, values in space.items():
        if name != "algo" and out[name] not in values:
            order = [v for v in values if v != "block"]
            at_least = [v for v in order if out[name] != "block" and v >= out[name]]
            out[name] = at_least[0] if at_least else values[-1]
    return out


# A thread folding a floating-point line in sequence loses accuracy as the line grows: on the
# H200, an fp32 cumsum of 131072-element lines walked by one thread each was 0.008 off eager's
# tree scan (tolerance 0.0027). Past this length a contiguous float line is scanned by a block.
SERIAL_FLOAT_SCAN_MAX = 8192


def _scan_spaces(prog: Program) -> list[KnobSpace]:
    """A thread per line (coalesced where lines are strided), and a block per line where lines
    are contiguous (one thread walking a contiguous line reads it a sector at a time)."""
    serial = {"algo": ("gen_scan",), "threads": (32, 64, 128, 256, 512), "unroll": (1, 2, 4)}
    if not lower.scan_is_inner(prog):
        return [serial]
    # staged chunks for 4-byte states (every setting's stage fits; 8-byte ones would not at 1024 x 8)
    block = {"algo": ("gen_scan_block",), "threads": (32, 64, 128, 256, 512, 1024), "items": (1, 2, 4, 8),
             "stage": ("none",) if _wide_scan(prog) else ("none", "smem")}
    if prog.scan.operand.dtype in FLOATS and prog.domain[prog.scan.dim] > SERIAL_FLOAT_SCAN_MAX:
        return [block]
    return [serial, block]


def _wide_scan(prog: Program) -> bool:
    """The scan's state is 8 bytes a value (float64, int64): not staged."""
    return any(t in ("float64", "int64") for t in prog.scan.kind.state(prog.scan.operand.dtype))


def _scan_default(prog: Program, card: Card, hw: Hardware) -> Knobs:
    """A block per contiguous line of at least a warp's worth of 4-element chunks; otherwise a
    thread per line, with enough blocks to fill the GPU before wider blocks. 4-byte states go
    through the shared-memory stage, 8 elements a thread, threads sized to the line: KernelBench's
    cumsum (1024 lines of 32768 fp32) on the H100 ran 100.9 us that way at 512 threads (101.7 at
    128), against 120.6 at 2 elements a thread unstaged and 169-349 at 4-8 unstaged, where a
    thread's consecutive elements make each warp's loads and stores strided. 8-byte states (never
    staged: 1024 x 8 of them would not fit) keep 2 elements a thread."""
    length = prog.domain[prog.scan.dim]
    lines = card.outputs[0].numel // max(1, length)
    if lower.scan_is_inner(prog) and length >= 128:
        if not _wide_scan(prog):
            return {"algo": "gen_scan_block", "threads": pick((32, 64, 128, 256, 512), length / 64), "items": 8,
                    "stage": "smem"}
        return {"algo": "gen_scan_block", "threads": pick((32, 64, 128, 256, 512, 1024), length / 8), "items": 2,
                "stage": "none"}
    return {"algo": "gen_scan", "threads": pick((32, 64, 128, 256, 512), lines / (2 * hw.sm_count)), "unroll": 2}


def spaces(card: Card, hw: Hardware) -> list[KnobSpace]:
    prog = program(card)
    if prog.window is not None:
        tiles = lower.window_tiles(prog)
        return [{"algo": ("gen_window",), "threads": (64, 128, 256, 512), "unroll": (1, 2, 4),
                 "vec": lower.window_vecs(prog)}] + ([{"algo": ("gen_window_tile",), **tiles}] if tiles else [])
    if prog.scan is not None:
        return _scan_spaces(prog)
    if prog.normalizes:
        coop, peel = _coop_space(prog, hw), lower.peel_vecs(prog)
        # rows of an odd length: vectors from each row's first aligned element, both passes reading it
        peeled = {"algo": ("gen_norm",), "threads": (64, 128, 256, 512, 1024), "lanes": (32, "block"), "vec": peel,
                  "staging": ("reload",)}
        return [{"algo": ("gen_norm",), "threads": (32, 64, 128, 256, 512, 1024), "lanes": (1, 8, 32, "block"),
                 "vec": lower.norm_vecs(prog), "staging": ("regs", "smem", "reload")},
                {"algo": ("gen_norm_split",), "threads": (128, 256, 512, 1024), "items": (1, 2, 4, 8),
                 "split": _splits(prog), "vec": lower.norm_vecs(prog)}] + ([coop] if coop else []) + ([peeled] if peel else []) \
            + _cols_block_space(prog)
    if prog.reduction is None:
        flat = {"algo": ("gen_flat",), "threads": (64, 128, 256, 512, 1024), "vec": lower.pointwise_vecs(prog),
                "items": (1, 2, 4, 8), "grid": ("exact", "stride") + (("heads",) if lower.heads_items(prog) else ())}
        # an input transposed to the outputs: its parts tiled (their other parts as gen_flat's)
        tile = {**flat, "algo": ("gen_tile",), "threads": (128, 256, 512), "items": (1, 2), "grid": ("exact",),
                "tvec": lower.tile_vecs(prog)}
        return [flat] + ([tile] if lower.tileable(prog) else [])
    return _reduction_spaces(prog)


def default(card: Card, hw: Hardware) -> Knobs:
    prog = program(card)
    if prog.window is not None:
        tiles, w, ow = lower.window_tiles(prog), prog.window, prog.domain[-1]
        # Overlapping 2-D windows take the tile: each input point's prologue once. 3-D pooling's
        # tile (a plane staged per depth step) is searched, not the default: KernelBench's dilated
        # 3x3x3 pool reuses too little of a plane to beat one thread an output.
        if tiles and len(w.kernel) == 2 and any(kk * d > s for kk, d, s in zip(w.kernel, w.dilation, w.stride)):
            if "vec" in tiles:
                # channels-last: 4 x 8 points of up to 8 x 8 channels a block. ResNet's stem (bn ->
                # relu -> max pool, 32x64x112x112 bf16) on the H100: 45 us, one thread an output 64,
                # torch.compile 67 (bench_norms.py)
                vec = tiles["vec"][-1]
                return {"algo": "gen_window_tile", "th": tiles["th"][-1], "tw": tiles["tw"][-1],
                        "cg": pick(tiles["cg"], prog.domain[len(prog.domain) - 3] / vec), "vec": vec}
            if ow >= 16:  # NCHW planes: a tile about as wide as the output row, ~256 threads
                tw = pick(tiles["tw"], ow)
                return {"algo": "gen_window_tile", "th": pick(tiles["th"], 256 / tw), "tw": tw}
        vec = lower.window_vecs(prog)[-1]  # 16-byte accesses across channels where the layout allows
        # 4 window points unrolled (a 3-wide window whole): on the H100, level 1's average pools ran
        # 60.2 us against 62.7 at 2 (3x3, 1x8x2048x2048) and 146.0 against 159.4 (1-D, 8 wide), and
        # its 1-D max pool with indices 179.8 against 191.8 (probe_knobs, round 26)
        return {"algo": "gen_window", "threads": 256 if card.outputs[0].numel // vec >= 256 * 2 * hw.sm_count else 128,
                "unroll": 4, "vec": vec}
    if prog.scan is not None:
        return _scan_default(prog, card, hw)
    if prog.reduction is None:
        vec = lower.pointwise_vecs(prog, wide=False)[-1]  # wider vectors of narrow tensors: the search's to try
        nvec = card.outputs[0].numel // vec
        # One vector a thread: on the H200 at 100 MB of fp32 (KernelBench's relu, sigmoid, gelu and
        # hardtanh), items 1 at 128-256 threads ran 50.8-52.5 us as called against eager's
        # 51.9-52.1 and items 4 at 256 threads 53.3-53.7 (bench/probe_knobs.py); batch norm ->
        # relu -> add (six tensors read, 8-wide) ran 41 us at 1 item and 63 at 4.
        # A transposed input read flat uses a quarter to an eighth of each sector a warp fetches
        # (ViT's class token beside its NCHW patches, half the bytes: 21.5 us on the H100 against
        # Inductor's tiled 12.5, round 27): tiled by default where it is a quarter of the bytes
        # or more. Llama's angles (256 KB beside 20 MB of heads, read from L2) stay flat.
        # A tiled thread reads and writes 4 bytes at a time where the layout allows (bf16 pairs:
        # 128 bytes a warp instead of 64).
        tiled = lower.tileable(prog) >= TILE_SHARE
        knobs = {"algo": "gen_tile" if tiled else "gen_flat",
                 "threads": 256 if nvec >= 256 * hw.sm_count or tiled else 128, "vec": vec, "items": 1, "grid": "exact"}
        if tiled:
            wide = [t for t in lower.tile_vecs(prog) if t * min(m.itemsize for m in prog.outputs) <= 4]
            knobs["tvec"] = wide[-1] if wide else 1
        # A rotary region computing its angles' sines and cosines for every head: 51.2 us on the
        # H100 against 20 MB of traffic (round 29); a thread takes several heads, the sines once.
        heads = lower.heads_items(prog)
        return {**knobs, "algo": "gen_flat", "items": heads, "grid": "heads"} if heads and not tiled else knobs
    lay = lower.reduction_layout(prog)
    if prog.normalizes:
        return _norm_default(prog, lay, hw)
    splits = _splits(prog)
    if lower.reduced_is_inner(prog):
        lanes = 8 if lay.rn <= 64 else 32 if lay.rn <= 4096 else "block"
        knobs = {"algo": "gen_rows", "threads": 512 if lanes == "block" else 256, "lanes": lanes, "items": 4}
        rows = knobs["threads"] // (knobs["threads"] if lanes == "block" else lanes)
    else:
        block = _cols_block_space(prog)
        if block and block[0]["vec"][-1] > 1 and lay.kn // block[0]["vec"][-1] >= 32 * hw.sm_count:
            # a column of the widest vector a thread, ~8 elements a slice: 256 blocks of 32 columns
            # for ResNet-50's channels-last global pool (32x2048 outputs of 7x7). Scalar columns (an
            # odd kept dim) stay with gen_cols, whose split measured well on KernelBench's sums.
            # Runs as few as the space allows (one, up to 2 * CHAIN reduced elements).
            split = block[0]["split"][0]
            return {"algo": "gen_cols_block", "threads": 256, "ty": pick(block[0]["ty"], lay.rn / split / 8), "items": 2,
                    "vec": block[0]["vec"][-1], "split": split}
        knobs = {"algo": "gen_cols", "threads": 256, "items": 4}
        rows = 256
    blocks = -(-lay.kn // rows)
    want = -(-2 * hw.sm_count // blocks)
    knobs["split"] = next((s for s in splits if s >= want), splits[-1]) if want > 1 else 1
    knobs["split"] = pick(splits, knobs["split"])
    return _within(knobs, _reduction_spaces(prog))


def _coop_space(prog: Program, hw: Hardware) -> KnobSpace | None:
    """gen_norm_coop where every thread count gives a row two chunks at least, each thread's
    chain at most CHAIN long, and the fold's state is floating point (what its wait publishes)."""
    red = prog.reduction
    if any(t not in FLOATS for t in red.kind.state(red.operand.dtype)):
        return None
    rn, vecs = lower.reduction_layout(prog).rn, lower.norm_vecs(prog)

    def ok(t: int) -> bool:
        return all(s >= 2 and rn // (s * t) <= CHAIN for s in (lower.coop_split(prog, t, v, hw.sm_count) for v in vecs))
    threads = tuple(t for t in (256, 512, 1024) if ok(t))
    return {"algo": ("gen_norm_coop",), "threads": threads, "items": (1, 2, 4, 8), "vec": vecs} if threads else None


def _norm_default(prog: Program, lay, hw: Hardware) -> Knobs:
    """The widest vector; a warp per row up to 256 chunks of it where the row fits the warp's
    registers, else a block with the fewest threads that keep it there; a thread per row where the
    reduced elements are strided and the kept ones are not (the loads coalesce across rows);
    the two-pass split form where long rows are too few for a block each."""
    block = _cols_block_space(prog)
    if block and block[0]["vec"][-1] > 1 and lay.rn > 64:
        # The prologue's values written beside a reduction over strided elements (EfficientNet's
        # SiLU beside its squeeze-and-excite mean, channels-last): a block per row would read its
        # row's elements a channel apart, 2 bytes of each sector; columns of channels read 16.
        # Its rows are long and few (64x144 over 56x56): up to 16 slices a block (16 columns of
        # 16 bytes, 256 contiguous bytes a pixel), then runs enough for two blocks an SM.
        vec, space = block[0]["vec"][-1], block[0]
        ty = min(16, pick(space["ty"], lay.rn / 8))
        blocks = -(-(lay.kn // vec) // (256 // ty))
        split = next((s for s in space["split"] if blocks * s >= 2 * hw.sm_count), space["split"][-1])
        return {"algo": "gen_cols_block", "threads": 256, "items": 2, "vec": vec, "ty": ty, "split": split}
    vec = lower.norm_vecs(prog)[-1]
    nc = lay.rn // vec
    if lay.kn < 2 * hw.sm_count and lay.rn >= 16384:  # too few rows to fill the GPU a block each
        coop = _coop_space(prog, hw)
        if coop and lay.kn <= hw.sm_count:
            # as the group-norm template's one cooperative launch, which beat its own split form at
            # batch 1 on the H200 (1x512x128x128 bf16: 23.4 us against 31.4)
            return {"algo": "gen_norm_coop", "threads": pick(coop["threads"], 512), "items": 4, "vec": vec}
        splits = _splits(prog)
        want = -(-4 * hw.sm_count // lay.kn)
        return {"algo": "gen_norm_split", "threads": 512, "items": 4, "vec": vec,
                "split": next((s for s in splits if s >= want), splits[-1])}
    if not lower.reduced_is_inner(prog) and lay.rn <= 64:
        return {"algo": "gen_norm", "threads": 128, "lanes": 1, "vec": vec, "staging": "regs"}
    if nc <= 256:
        lanes = 8 if nc <= 16 else 32
        knobs = {"algo": "gen_norm", "threads": 128 if lay.kn >= 4 * hw.sm_count else 64, "lanes": lanes, "vec": vec,
                 "staging": "regs"}
        if lower.norm_staging(prog, knobs) == "regs":
            return knobs
        least = pick((32, 64, 128, 256), nc / 4)  # a row that does not fit a warp's registers
    else:
        least = pick((128, 256, 512, 1024), nc / 8)
    # A block per row, with the fewest threads from `least` up that keep the row in registers,
    # else `least` threads reading the row again from L2 in the epilogue: shared-memory staging
    # measured slower than both wherever it was tried (a mask softmax, 8x2048x2048 bf16 scores
    # and mask: 118 us staged by 128 threads, 84 us reloaded by 64, 131 us for a warp; SD-VAE's
    # 16384-long fp32 rows: 853-872 us staged, 565 us in the registers of 1024).
    knobs = {"algo": "gen_norm", "lanes": "block", "vec": vec, "staging": "regs"}
    fits = next((t for t in (32, 64, 128, 256, 512, 1024)
                 if t >= least and lower.norm_staging(prog, {**knobs, "threads": t}) == "regs"), None)
    if fits:
        return {**knobs, "threads": fits}
    peel = lower.peel_vecs(prog)
    if vec == 1 and peel:  # a long row of an odd length: peeled to its widest aligned vectors
        return {**knobs, "threads": pick((128, 256, 512, 1024), lay.rn / peel[-1] / 8), "vec": peel[-1], "staging": "reload"}
    return {**knobs, "threads": least, "staging": "reload"}


def build(card: Card, knobs: Knobs, hw: Hardware) -> Candidate:
    prog = program(card)
    if prog.window is not None:
        built = lower.lower_window(prog, knobs)
    elif prog.scan is not None:
        built = (lower.lower_scan_block if knobs["algo"] == "gen_scan_block" else lower.lower_scan)(prog, knobs)
    elif knobs["algo"] == "gen_cols_block" and prog.reduction is not None:  # its prologue's values written beside it too
        built = lower.lower_cols_block(prog, knobs)
    elif prog.normalizes:
        built = (lower.lower_norm_split(prog, knobs, hw.sm_count) if knobs["algo"] == "gen_norm_split" else
                 lower.lower_norm_coop(prog, knobs, hw.sm_count) if knobs["algo"] == "gen_norm_coop"
                 else lower.lower_norm(prog, knobs))
    elif prog.reduction is None:
        built = lower.lower_pointwise(prog, knobs, hw.sm_count)
    else:
        built = lower.lower_reduction(prog, knobs, hw.sm_count)
    title = f"// kforge builtin: generated {card.op} knobs={json.dumps(knobs, sort_keys=True)}\n"
    kernels = [launch(*k) for k in built.kernels]  # (name, grid, block, args, smem[, cooperative])
    return Candidate(source=title + built.source, plan=LaunchPlan(kernels, list(built.workspace), []), kind="custom",
                     proposer="builtin", knobs=dict(knobs), note="generated")


TEMPLATE = Template("generated", None, check, spaces, default, build)
