"""The Ray backend against the local path on one GPU: the same model searched both ways.

1. The model is captured once; the run directory is copied, so both searches see the same cards.
2. `kforge.run`'s search on the local worker, and the same search through a Ray head started
   in this process on this machine (`cluster="ray"`: one actor holding the GPU).
3. The dispatched cards of both packages are compared (the target: the same set).
4. The Ray path's overhead per candidate: the first candidates the local search evaluated are
   evaluated again through the local worker and through the Ray actor, alternating which goes
   first, with a warm kernel cache; the overhead is the median of the paired differences
   (target <= 50 ms per candidate).

    python bench/bench_ray.py examples/resnet50.py --min-share 0.003 --out $OUT/ray_h200.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import kforge  # noqa: E402
from kforge import runner  # noqa: E402
from kforge.capturing import capture  # noqa: E402
from kforge.card_files import load_cards  # noqa: E402
from kforge.modelspec import load_model_spec  # noqa: E402
from kforge.store import SQLiteStore  # noqa: E402
from provenance import provenance  # noqa: E402

TARGET_MS = 50.0


def dispatched(path: Path | None) -> list[str]:
    return sorted(c.id for c in kforge.load(path).cards if c.dispatched) if path else []


def search(run_dir: Path, args, **kw):
    t0 = time.perf_counter()
    result = runner.search_run(run_dir, out=run_dir / "model.cast", iterations=args.iterations, min_share=args.min_share,
                               ops=[o for o in args.ops.split(",") if o] or None, seed=0, progress=False,
                               resume=False, **kw)
    return result, time.perf_counter() - t0


def overhead_ms(local_run: Path, run_id: str, ray_pool, count: int) -> list[float]:
    """Paired (Ray - local) wall times, in ms, of `count` candidates of the local run."""
    from kforge.evaluate import make_evaluator

    cards = {c.id: c for c in load_cards(local_run)}
    with SQLiteStore(local_run, readonly=True) as log:
        rows = [r for r in log.candidates(run_id) if r.verdict in ("valid", "slower")][:count]
    local, remote = make_evaluator(local_run, devices=[0]), ray_pool.evaluator(0)
    diffs = []
    try:
        first = rows[0]
        for ev in (local, remote):  # workers started, the card's inputs prepared: not the candidates' time
            ev.evaluate(cards[first.card_id], first.tried().candidate)
        for i, row in enumerate(rows):
            card, cand = cards[row.card_id], row.tried().candidate
            took = {}
            for name, ev in ((("local", local), ("ray", remote)) if i % 2 == 0 else (("ray", remote), ("local", local))):
                t0 = time.perf_counter()
                ev.evaluate(card, cand)
                took[name] = time.perf_counter() - t0
            diffs.append(1e3 * (took["ray"] - took["local"]))
    finally:
        local.close()
    return diffs


def main(argv=None) -> None:
    import ray

    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="model.py (get_model/get_inputs) or pkg.module:factory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--min-share", type=float, default=0.0)
    ap.add_argument("--ops", default="")
    ap.add_argument("--pairs", type=int, default=16, help="candidates timed both ways for the overhead")
    args = ap.parse_args(argv)

    model, inputs = load_model_spec(args.model)
    root = Path(tempfile.mkdtemp(prefix="kforge-ray-bench-"))
    local_run, ray_run = root / "local", root / "ray"
    capture(model, inputs, local_run)
    shutil.copytree(local_run, ray_run)

    local, local_s = search(local_run, args)
    ray.init(num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    try:
        remote, ray_s = search(ray_run, args, cluster="ray")
        from kforge.cluster.ray_pool import RayPool

        pool = RayPool("auto", "ray", ray_run, load_cards(ray_run), runner.default_evaluator)
        try:
            diffs = overhead_ms(local_run, local.run_id, pool, args.pairs)
        finally:
            pool.close()
    finally:
        ray.shutdown()
    same = dispatched(local.package_path) == dispatched(remote.package_path)
    median = statistics.median(diffs) if diffs else None
    out = {
        **provenance(), "ray_version": ray.__version__, "model": args.model, "iterations": args.iterations,
        "local": {"search_s": local_s, "dispatched": dispatched(local.package_path)},
        "ray": {"search_s": ray_s, "dispatched": dispatched(remote.package_path)},
        "same_dispatched": same,
        "overhead_ms": {"pairs": len(diffs), "median": median, "p90": sorted(diffs)[int(0.9 * (len(diffs) - 1))]
                        if diffs else None, "all": [round(d, 2) for d in diffs]},
        "target_ms": TARGET_MS, "overhead_ok": median is not None and median <= TARGET_MS,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("same_dispatched", "overhead_ms", "overhead_ok")}, indent=1))


if __name__ == "__main__":
    main()
