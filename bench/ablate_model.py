"""Which dispatched card makes a model faster or slower (run on the GPU): capture and search
one model as bench_model.py does, then time its forward, interleaved in one process, eager,
with the whole package, with the package less each dispatched card, with each card alone,
with every card's op overridden but no call matching (the cost of the override alone:
boxing, the guard, the redispatch to PyTorch), and last the forward replayed from a CUDA
graph, eager and with the package (no host overhead: what the kernels alone do). Every card is faster than eager as dispatched on its own; this shows what it does
inside the model (L2 state, the cost of overriding its op on calls that miss, ...).

    python bench/ablate_model.py examples/gemma_decoder.py --wall-time 45 --out $OUT/ablate_gemma.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

import kforge
from kforge import timing
from kforge.replay import time_graphs
from kforge.modelspec import load_model_spec
from kforge.package import CastPackage

from bench_model import forward  # bench/ is the script's directory (and the tests put it on the path)


def fresh(c, **changes):
    """A copy of a packaged card with its own hit counters."""
    return dataclasses.replace(c, counters=type(c.counters)(), **changes)


def subset(pkg: CastPackage, keep) -> CastPackage:
    """The package with only the dispatched cards `keep(card_id)` says to keep."""
    cards = [fresh(c) if not c.dispatched or keep(c.id) else fresh(c, decision="fallback", reason="ablated")
             for c in pkg.cards]
    return CastPackage(pkg.path, pkg.manifest, cards)


def unmatchable(pkg: CastPackage) -> CastPackage:
    """The package with every dispatched card's guard changed (its first tensor recorded with
    another dtype), so the ops are overridden but every call misses and runs PyTorch's kernel.
    A card without a plain tensor argument keeps its guard."""
    def miss(card):
        i = next((i for i, a in enumerate(card.args) if a.kind == "tensor" and a.tensor is not None), None)
        if i is None:
            return card
        other = "float16" if card.args[i].tensor.dtype == "float64" else "float64"
        args = list(card.args)
        args[i] = dataclasses.replace(args[i], tensor=dataclasses.replace(args[i].tensor, dtype=other))
        return dataclasses.replace(card, args=args)

    return CastPackage(pkg.path, pkg.manifest, [fresh(c, card=miss(c.card)) if c.dispatched else fresh(c)
                                                for c in pkg.cards])


def rows_of(names, ms) -> dict:
    """One JSON row per timed variant, its speedup against the first (the eager one)."""
    return {name: {"median_us": m.median, "iqr_us": m.iqr, "vs_eager": ms[0].median / m.median,
                   "samples_us": m.samples_us} for name, m in zip(names, ms)}


def graph_rows(pkg: CastPackage, fn, calls: int, rounds: int) -> dict:
    """Eager and the package, each replayed from a CUDA graph (vs_eager: against the eager graph)."""
    ms = time_graphs(fn, pkg, calls=calls, rounds=rounds)
    return rows_of(("eager, CUDA graph", "package, CUDA graph"), ms)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="model.py (get_model/get_inputs) or pkg.module:factory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--min-share", type=float, default=0.02)
    ap.add_argument("--wall-time", type=float, default=45)
    ap.add_argument("--calls", type=int, default=10, help="forwards per timed sample")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)

    model, inputs = load_model_spec(args.model)
    run_dir = Path(tempfile.mkdtemp(prefix="kforge-ablate-"))
    result = kforge.run(model, inputs, out=run_dir / "model.cast", iterations=args.iterations, run_dir=run_dir,
                        min_share=args.min_share, wall_time_s=args.wall_time, progress=False, check_model=False)
    pkg = kforge.load(result.package_path)
    ids = {c.id: c.card.summary() for c in pkg.cards if c.dispatched}
    variants = {"eager": None, "package": pkg, "overrides only (every call misses)": unmatchable(pkg)}
    for cid, name in ids.items():
        variants[f"without {name}"] = subset(pkg, lambda k, cid=cid: k != cid)
        variants[f"only {name}"] = subset(pkg, lambda k, cid=cid: k == cid)
    entries = [(p.apply if p is not None else contextlib.nullcontext, lambda: forward(model, inputs))
               for p in variants.values()]
    ms = timing.time_as_called(entries, calls=args.calls, rounds=args.rounds)
    rows = rows_of(variants, ms)
    try:
        rows.update(graph_rows(pkg, lambda: forward(model, inputs), args.calls, args.rounds))
    except Exception as e:  # a model that cannot be captured still has the rows above
        print(f"  CUDA graph rows skipped: {type(e).__name__}: {e}")
    for name, r in rows.items():
        print(f"  {name[:80]:80s} {r['median_us']:9.1f} us (iqr {r['iqr_us']:6.1f})  {r['vs_eager']:.3f}x eager")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "model": args.model, "wall_time_s": args.wall_time, "calls": args.calls,
        "rounds": args.rounds, "dispatched": ids, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
