"""Host time per forward on the CPU: eager, pkg.apply() and kforge.optimize, on small models whose
kernels cost next to nothing, so what is left is what each path adds on the host (a forward bound
by launch overhead on the GPU pays exactly that). The package is a fake one, as the tests build
it (tests/test_optimize.py): its region and op cards from the CPU capture, all dispatched, each
kernel a stand-in that writes nothing, launched from C++ where kforge._dispatch is built with its
test launcher (as a package's kernels launch). Rows: eager; the package applied (its op cards
through the aten overrides); kforge.optimize with the package (regions and op cards in the
graphs); the same with every kernel launched from Python (no native() launcher: RegionCall);
and kforge.optimize with an empty package (a graph with no hits must cost what eager costs),
each optimized model timed in rounds of its own with eager again.

    python bench/bench_optimize_host.py --out bench/results/optimize_host_cpu.json

Times are the thread's CPU time (time.thread_time), so other processes on a shared machine do
not inflate them, over interleaved rounds: the fastest round and the median.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the fake package and launcher the tests use

from test_optimize import fake_package, resnet  # noqa: E402

import kforge  # noqa: E402
from kforge.capturing import capture  # noqa: E402
from kforge.dispatch import Dispatcher, dispatch_blocker  # noqa: E402
from kforge.families import family_of  # noqa: E402
from kforge.modelspec import load_model_spec  # noqa: E402
from provenance import provenance  # noqa: E402


class NullLauncher:
    """Launches nothing: a hit costs what the host path around a kernel costs, launched from Python."""

    def launch(self, vid, inputs, outputs, workspaces, device):
        pass


class NativeNullLauncher(NullLauncher):
    """The same from C++, where kforge._dispatch is built with its test launcher (copies 0 bytes):
    kforge._dispatch guards and launches op cards and, in kforge.optimize, region cards."""

    def native(self, vid):
        from kforge import _dispatch_test

        return _dispatch_test.test_launcher_address(), 0, lambda index: 0


def launchers() -> dict:
    if importlib.util.find_spec("kforge._dispatch_test") is None:
        return {"": NullLauncher()}
    return {"": NativeNullLauncher(), ", Python launches": NullLauncher()}


def models() -> dict:
    gemma, gemma_x = load_model_spec(str(ROOT / "examples" / "gemma_decoder.py"))  # SMALL on the CPU
    return {"resnet_blocks": (resnet(), (torch.randn(1, 4, 4, 4),)), "gemma_small": (gemma.eval(), (gemma_x,))}


def interleaved(entries: dict, *, calls: int, rounds: int) -> dict:
    samples: dict[str, list[float]] = {k: [] for k in entries}
    for r in range(rounds + 1):  # the first round warms up
        for name, (ctx, fn) in entries.items():
            with ctx():
                t0 = time.thread_time()
                for _ in range(calls):
                    fn()
                if r:
                    samples[name].append((time.thread_time() - t0) / calls * 1e6)
    # Contention only adds time: the fastest round is the best estimate of a path's own cost.
    return {k: {"best_us": min(v), "median_us": statistics.median(v), "iqr_us": _iqr(v)} for k, v in samples.items()}


def _iqr(v: list[float]) -> float:
    q = statistics.quantiles(v, n=4)
    return q[2] - q[0]


def bench(model, args, *, calls: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cards = capture(model, args, Path(tmp), regions=True, time_cards=False).cards
    # Fused regions (an epilogue overlaps them) and the memory-bound op cards an override can serve.
    cards = [c for c in cards if (c.region.kind == "fused" if c.region else dispatch_blocker(c) is None
                                  and family_of(c.op) in ("pointwise", "reduction", "normalization"))]
    pkg = fake_package(cards, {c.id: (1.0, 5.0) for c in cards})
    cpu = Dispatcher("CPU")
    rows: dict = {}
    report: dict = {}
    # Two optimized models of one class share its code objects, so dynamo would check the other's
    # guards on every call too: each optimized model is timed in rounds of its own, with eager again.
    with torch.inference_mode():
        for suffix, launcher in launchers().items():
            torch.compiler.reset()
            fast = kforge.optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=launcher)
            fast(*args)
            group = {"eager" + (f", timed with kforge.optimize{suffix}" if suffix else ""):
                     (contextlib.nullcontext, lambda: model(*args)),
                     "kforge.optimize" + suffix: (contextlib.nullcontext, lambda: fast(*args))}
            if not suffix:
                group["pkg.apply()"] = (lambda: pkg.apply(dispatcher=cpu, launcher=launcher), lambda: model(*args))
                report = fast.report()
            rows.update(interleaved(group, calls=calls, rounds=rounds))
        torch.compiler.reset()
        empty = kforge.optimize(model, fake_package([], {}))
        empty(*args)
        apart = interleaved({"eager": (contextlib.nullcontext, lambda: model(*args)),
                             "kforge.optimize, no hits": (contextlib.nullcontext, lambda: empty(*args))},
                            calls=calls, rounds=rounds)
        rows["eager, timed with no hits"] = apart["eager"]
        rows["kforge.optimize, no hits"] = apart["kforge.optimize, no hits"]
    return {"us": rows, "regions_replaced": len(report["replaced"]), "ops_replaced": report["ops_replaced"],
            "cards": len(cards)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = {**provenance(), "device": "cpu", "clock": "thread_time", "models": {}}  # host time, whatever GPU there is
    for name, (model, inputs) in models().items():
        out["models"][name] = r = bench(model, inputs, calls=args.calls, rounds=args.rounds)
        print(f"{name}: {r['regions_replaced']} regions, {r['ops_replaced']} op nodes replaced")
        for row, m in r["us"].items():
            print(f"  {row:28s} best {m['best_us']:8.1f} us, median {m['median_us']:8.1f} (iqr {m['iqr_us']:.1f})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
