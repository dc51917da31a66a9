"""Kernels from the code generator (kforge.codegen) for any card its op table covers:
every pointwise op torch tags, copies, one-level reductions, scans (cumsum, cumprod) and
2-D max/avg pooling, and region cards whose subgraph is such a chain. It adds candidates beside
the hand-written templates for the same cards (algorithms "gen_*"), and is the only
built-in source for the rest.
"""

from __future__ import annotations

import json

from ...candidate import Candidate, LaunchPlan
from ...cards import Card
from ...codegen import build as cg_build
from ...codegen import lower
from ...codegen.ir import Program
from ...hardware import Hardware
from .template import Knobs, KnobSpace, Template, launch, pick

_PROGRAMS: dict[str, Program | str] = {}  # card id -> its program (cards are immutable once made)
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def program(card: Card) -> Program | str:
    if card.id not in _PROGRAMS:
        if len(_PROGRAMS) > 4096:
            _PROGRAMS.clear()
        try:
            _PROGRAMS[card.id] = cg_build.program_for_card(card)
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


def spaces(card: Card, hw: Hardware) -> list[KnobSpace]:
    prog = program(card)
    if prog.window is not None:
        return [{"algo": ("gen_window",), "threads": (64, 128, 256, 512), "unroll": (1, 2, 4)}]
    if prog.scan is not None:
        return [{"algo": ("gen_scan",), "threads": (32, 64, 128, 256, 512), "unroll": (1, 2, 4)}]
    if prog.reduction is None:
        return [{"algo": ("gen_flat",), "threads": (64, 128, 256, 512, 1024), "vec": lower.pointwise_vecs(prog),
                 "items": (1, 2, 4, 8), "grid": ("exact", "stride")}]
    splits = _splits(prog)
    return [{"algo": ("gen_rows",), "threads": (128, 256, 512, 1024), "lanes": (8, 32, 128, "block"),
             "items": (1, 2, 4, 8), "split": splits},
            {"algo": ("gen_cols",), "threads": (64, 128, 256, 512), "items": (1, 2, 4, 8), "split": splits}]


def default(card: Card, hw: Hardware) -> Knobs:
    prog = program(card)
    if prog.window is not None:
        return {"algo": "gen_window", "threads": 256 if card.outputs[0].numel >= 256 * 2 * hw.sm_count else 128,
                "unroll": 2}
    if prog.scan is not None:  # enough blocks to fill the GPU before wider blocks
        lines = card.outputs[0].numel // max(1, prog.domain[prog.scan.dim])
        return {"algo": "gen_scan", "threads": pick((32, 64, 128, 256, 512), lines / (2 * hw.sm_count)), "unroll": 2}
    if prog.reduction is None:
        vec = lower.pointwise_vecs(prog)[-1]
        nvec = card.outputs[0].numel // vec
        waves = nvec / (256 * hw.sm_count * 8)
        return {"algo": "gen_flat", "threads": 256 if nvec >= 256 * hw.sm_count else 128, "vec": vec,
                "items": 4 if waves >= 4 else 2 if waves >= 1 else 1, "grid": "exact"}
    lay = lower.reduction_layout(prog)
    splits = _splits(prog)
    if lower.reduced_is_inner(prog):
        lanes = 8 if lay.rn <= 64 else 32 if lay.rn <= 4096 else "block"
        knobs = {"algo": "gen_rows", "threads": 512 if lanes == "block" else 256, "lanes": lanes, "items": 4}
        rows = knobs["threads"] // (knobs["threads"] if lanes == "block" else lanes)
    else:
        knobs = {"algo": "gen_cols", "threads": 256, "items": 4}
        rows = 256
    blocks = -(-lay.kn // rows)
    want = -(-2 * hw.sm_count // blocks)
    knobs["split"] = next((s for s in splits if s >= want), splits[-1]) if want > 1 else 1
    knobs["split"] = pick(splits, knobs["split"])
    return knobs


def build(card: Card, knobs: Knobs, hw: Hardware) -> Candidate:
    prog = program(card)
    if prog.window is not None:
        built = lower.lower_window(prog, knobs)
    elif prog.scan is not None:
        built = lower.lower_scan(prog, knobs)
    elif prog.reduction is None:
        built = lower.lower_pointwise(prog, knobs, hw.sm_count)
    else:
        built = lower.lower_reduction(prog, knobs, hw.sm_count)
    title = f"// kforge builtin: generated {card.op} knobs={json.dumps(knobs, sort_keys=True)}\n"
    kernels = [launch(name, grid, block, args, smem) for name, grid, block, args, smem in built.kernels]
    return Candidate(source=title + built.source, plan=LaunchPlan(kernels, list(built.workspace), []), kind="custom",
                     proposer="builtin", knobs=dict(knobs), note="generated")


TEMPLATE = Template("generated", None, check, spaces, default, build)
