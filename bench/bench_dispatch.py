"""What guarded dispatch costs, on the GPU machine.

1. Per-call host overhead on a tiny tensor (relu of 256 floats), in µs of host time per call
   (perf_counter over many calls, then one synchronize): a direct launch through the C++
   registry (the floor), the same kernel dispatched through the torch.library override, eager
   relu with no override, and a guard miss (another shape) with and without the override; and
   the kernel as a kforge:: custom op, as kforge.compile's graphs call it.
2. Model latency with and without a package in the same process (CUDA events, one pair per
   forward, blocks of reps interleaved): the package is built by kforge.run with the builtin
   proposer, or given with --cast.

    python bench/bench_dispatch.py --out bench/results/dispatch_h200.json [--iterations 8] [--cast model.cast]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

import kforge
from kforge import compiler, customops, runtime
from kforge.candidate import Candidate, LaunchPlan
from kforge.cards import ArgSpec, Card, TensorMeta
from kforge.dispatch import Dispatcher, RegistryLauncher, Variant
from kforge.verdict import Measurement

RELU = r"""
extern "C" __global__ void relu_k(const float* __restrict__ x, float* __restrict__ y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = fmaxf(x[i], 0.0f);
}
"""


def host_us_per_call(fn, calls: int, repeats: int = 5) -> float:
    """Median over repeats of host time per call; the device is drained before each repeat."""
    for _ in range(min(calls, 1000)):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per_call)


def overhead(calls: int) -> dict:
    n = 256
    x, other = torch.randn(n, device="cuda"), torch.randn(n + 1, device="cuda")
    y = torch.empty_like(x)
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    meta = TensorMeta.of(x)
    card = Card(op="aten::relu.default", schema=str(torch.ops.aten.relu.default._schema),
                args=[ArgSpec("self", "tensor", tensor=meta)], outputs=[meta], arch=arch)
    plan = LaunchPlan.from_json({"kernels": [{"name": "relu_k", "grid": [1, 1, 1], "block": [n, 1, 1],
                                              "args": [{"in": 0}, {"out": 0}, {"i32": n}]}]})
    cand, cubin = Candidate(RELU, plan), compiler.compile(RELU, arch=arch).cubin
    launcher = RegistryLauncher([(cand, cubin)])
    registry = launcher.prepare(torch.cuda.current_device())
    resolved = runtime.build_plan(cand, cubin, torch.cuda.current_device())
    stream = torch.cuda.current_stream().cuda_stream
    xp, yp = [x.data_ptr()], [y.data_ptr()]

    out = {"eager_hit_shape": host_us_per_call(lambda: torch.relu(x), calls),
           "eager_miss_shape": host_us_per_call(lambda: torch.relu(other), calls),
           "registry_direct": host_us_per_call(lambda: registry.launch(0, xp, yp, [], stream), calls),
           "runtime_launch": host_us_per_call(lambda: runtime.launch(resolved, [x], [y]), calls)}
    dispatcher, owner = Dispatcher.shared("CUDA"), object()
    variant = Variant(card, 0, launcher)
    dispatcher.add(owner, [variant])
    path, why = dispatcher.path(card.op)  # "native" (kforge._dispatch) or "python", and why
    try:
        assert torch.equal(torch.relu(x), x.clamp(min=0)), "dispatched relu disagrees with eager"
        out["dispatched_hit"] = host_us_per_call(lambda: torch.relu(x), calls)
        out["dispatched_miss"] = host_us_per_call(lambda: torch.relu(other), calls)
    finally:
        dispatcher.remove(owner)
    # The kernel as kforge.compile's graphs call it (a kforge:: custom op), against eager relu: an
    # extern aten call of the same size, as Inductor's wrapper makes one.
    op = customops.kernel_op(Variant(card, 0, launcher), cand.digest())
    assert torch.equal(op(x), x.clamp(min=0)), "the custom op disagrees with eager"
    out["custom_op_hit"] = host_us_per_call(lambda: op(x), calls)
    return {"host_us_per_call": out, "calls": calls, "dispatch_path": path, "dispatch_path_why": why,
            "hit_over_direct_us": out["dispatched_hit"] - out["registry_direct"],
            "hit_over_eager_us": out["dispatched_hit"] - out["eager_hit_shape"],
            "miss_over_eager_us": out["dispatched_miss"] - out["eager_miss_shape"],
            "custom_op_over_eager_us": out["custom_op_hit"] - out["eager_hit_shape"],
            "counters": {"hits": variant.counters.hits, "fallbacks": dict(variant.counters.fallbacks)}}


def demo_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(1024), nn.GELU(), nn.Linear(1024, 1024), nn.Softmax(-1)).cuda().eval()
    return model, torch.randn(64, 1024, device="cuda")


def event_times_us(fn, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return samples


def model_latency(cast: Path, model: nn.Module, x: torch.Tensor, reps: int, blocks: int) -> dict:
    pkg = kforge.load(cast)
    eager, dispatched = [], []
    with torch.no_grad():
        want = model(x)
        with pkg.apply():
            got = model(x)
        for _ in range(3):
            model(x)
        for _ in range(blocks):  # interleaved blocks: drift in clocks or temperature hits both alike
            eager += event_times_us(lambda: model(x), reps)
            with pkg.apply():
                dispatched += event_times_us(lambda: model(x), reps)
    e, d = Measurement(eager), Measurement(dispatched)
    return {"package": str(cast), "eager": e.summary(), "with_package": d.summary(), "speedup": e.median / d.median,
            "max_abs_diff": (got - want).abs().max().item(), "report": pkg.report()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--cast", help="a package for the demo model (default: build one with kforge.run)")
    p.add_argument("--iterations", type=int, default=8, help="search iterations per card when building the package")
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--blocks", type=int, default=6)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_dispatch needs a CUDA GPU")

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kforge": kforge.__version__,
              "overhead": overhead(args.calls)}
    model, x = demo_model()
    with tempfile.TemporaryDirectory(prefix="kforge-bench-") as tmp:
        cast = Path(args.cast) if args.cast else kforge.run(
            model, (x,), out=Path(tmp) / "demo.cast", iterations=args.iterations, run_dir=Path(tmp) / "run",
            progress=False).package_path
        result["model"] = model_latency(cast, model, x, args.reps, args.blocks)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    o = result["overhead"]["host_us_per_call"]
    print(f"dispatch path: {result['overhead']['dispatch_path']} ({result['overhead']['dispatch_path_why']})")
    print(f"host µs/call: direct {o['registry_direct']:.2f}, dispatched hit {o['dispatched_hit']:.2f}, "
          f"eager {o['eager_hit_shape']:.2f}, miss {o['dispatched_miss']:.2f} (eager {o['eager_miss_shape']:.2f}), "
          f"custom op {o['custom_op_hit']:.2f}")
    m = result["model"]
    print(f"model: eager {m['eager']['median_us']:.1f} µs, with package {m['with_package']['median_us']:.1f} µs "
          f"({m['speedup']:.2f}x), {m['report']['dispatched']} kernels dispatched")


if __name__ == "__main__":
    main()
