"""Values of a model's weights alone, computed once per weight version in kforge.optimize's graphs
(kforge.fold): what a forward calls and costs on the CPU with and without it.

ECA-NFNet-L0 (timm, random weights) standardizes every convolution's weight on every forward
(ScaledStdConv2d: a batch norm over the weight in training form). kforge.optimize runs with a fake
package, as the tests build it (tests/test_optimize.py): its fused region cards from the CPU
capture, all dispatched, each kernel the region's own eager calls, except those that read a
weight (so the standardization stays graph nodes). Rows: eager; kforge.optimize; the same with
the weight folding off (no graph input taken for a weight). Per row: aten calls in one forward
and the forward's wall time, fastest of --rounds.

    PYTHONPATH=<timm> python bench/bench_fold_weights.py --out bench/results/fold_weights_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the fake package and launcher the tests use

from test_optimize import FakeLauncher, aten_calls, fake_package, region_cards  # noqa: E402

from kforge import graph as graph_mod  # noqa: E402
from kforge.optimize import optimize  # noqa: E402
from provenance import provenance  # noqa: E402


def _fastest_ms(fn, x, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import timm

    torch.manual_seed(0)
    model, x = timm.create_model("eca_nfnet_l0", pretrained=False).eval(), torch.randn(2, 3, 64, 64)
    with tempfile.TemporaryDirectory() as tmp:
        cards = [c for c in region_cards(model, x, Path(tmp), "fused") if "_native_batch_norm_legit" not in c.region.ops]
    rows = []
    with torch.no_grad():
        want = model(x)
        rows.append({"row": "eager", "aten_calls": sum(aten_calls(model, x).values()),
                     "ms": _fastest_ms(model, x, args.rounds)})
        weights = graph_mod._weights
        for name, fold_weights in (("kforge.optimize", True), ("kforge.optimize, weights not folded", False)):
            torch.compiler.reset()
            graph_mod._weights = weights if fold_weights else (lambda: ())
            try:
                fast = optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}),
                                launcher=FakeLauncher(cards), use_verdict=False)
                torch.testing.assert_close(fast(x), want)
                rows.append({"row": name, "aten_calls": sum(aten_calls(fast, x).values()),
                             "ms": _fastest_ms(fast, x, args.rounds)})
            finally:
                graph_mod._weights = weights
    for r in rows:
        print(f"{r['row']:40s} {r['aten_calls']:6d} aten calls  {r['ms']:8.1f} ms")
    if args.out:
        args.out.write_text(json.dumps({"provenance": provenance(), "model": "eca_nfnet_l0, batch 2, 64x64, fp32",
                                        "region_cards": len(cards), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
