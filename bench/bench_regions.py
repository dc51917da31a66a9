"""The region cards of a model on the GPU: per card, its eager replay (one aten call per node,
what eager runs) against torch.compile (Inductor, default mode) of the same region's PyTorch
code, both from the card's sample, CUDA events with the L2 flushed, interleaved. That is what a
region kernel must beat, for kforge.optimize and for kforge.compile. With --package, the
model's forward eager, with pkg.apply(), with kforge.optimize and under torch.compile,
interleaved in one process (no flush: as the model runs).

    python bench/bench_regions.py examples/resnet50.py --out bench/results/regions_resnet50_h200.json
    python bench/bench_regions.py examples/sd_vae_decoder.py --package sd_vae.cast --out ...
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import kforge
from kforge import timing
from kforge.capturing import capture
from kforge.card_files import load_sample
from kforge.hardware import current
from kforge.modelspec import load_model_spec
from provenance import provenance


def region_fn(card):
    scope: dict = {}
    exec(card.region.code(card.inputs), scope)  # noqa: S102 (kforge's own generated code)
    return scope["region"]


def per_region(result, run_dir: Path, limit: int) -> list[dict]:
    hw = current(0)
    rows = []
    cards = [c for c in result.cards if c.region is not None][:limit]
    for c in cards:
        ins = load_sample(c, run_dir, device="cuda")[0] if c.samples else c.random_inputs(0, "cuda")
        compiled = torch.compile(region_fn(c))
        with torch.no_grad():
            compiled(*ins)
            eager, inductor = timing.time_fns([lambda: c.call_eager(ins, "cuda"), lambda: compiled(*ins)],
                                              device=torch.device("cuda"))
        rows.append({"id": c.id, "kind": c.region.kind, "ops": c.region.ops, "calls": c.calls, "share": c.share,
                     "module_paths": c.module_paths[:4], "eager_us": eager.median, "eager_iqr_us": eager.iqr,
                     "compile_us": inductor.median, "compile_iqr_us": inductor.iqr,
                     "floor_us": hw.floor_us(c.io_bytes())})
        print(f"{c.region.kind:8s} {'+'.join(c.region.ops)[:60]:60s} calls {c.calls:3d} eager {eager.median:8.1f} us "
              f"compile {inductor.median:8.1f} us floor {rows[-1]['floor_us']:7.1f} us", flush=True)
    return rows


def whole_model(model, args, package: Path) -> dict:
    """Eager, pkg.apply(), kforge.optimize and torch.compile, interleaved as the model calls
    them (kforge.timing.time_as_called)."""
    import contextlib

    pkg = kforge.load(package)
    launcher = pkg.launcher()
    fast = kforge.optimize(model, pkg, launcher=launcher)
    inductor = torch.compile(model)
    applied = lambda: pkg.apply(launcher=launcher)  # noqa: E731
    entries = {"eager": (contextlib.nullcontext, lambda: model(*args)), "apply": (applied, lambda: model(*args)),
               "optimize": (contextlib.nullcontext, lambda: fast(*args)), "compile": (contextlib.nullcontext, lambda: inductor(*args))}
    with torch.no_grad():
        ms = timing.time_as_called(list(entries.values()), device=torch.device("cuda"))
    out = {k: {"median_us": m.median, "iqr_us": m.iqr} for k, m in zip(entries, ms)}
    out["optimize_report"] = fast.report()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--limit", type=int, default=40, help="region cards to time, by share")
    p.add_argument("--package", type=Path, help="a .cast of this model: also time the whole forward four ways")
    a = p.parse_args()
    model, inputs = load_model_spec(a.model)
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    run_dir = Path(tempfile.mkdtemp(prefix="kforge-regions-"))
    result = capture(model, inputs, run_dir, regions=True)
    report = {**provenance(), "model": a.model, "notes": result.notes,
              "regions": per_region(result, run_dir, a.limit)}
    if a.package:
        report["forward"] = whole_model(model.eval(), args, a.package)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
