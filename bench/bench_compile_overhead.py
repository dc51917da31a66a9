"""What a kforge kernel costs per call inside a graph Inductor compiled, against Inductor's own
extern call of the same op and size (issue 23: the pass must add no per-call host work).

Both graphs run `calls` relu's of `n` floats in a chain, compiled by Inductor (default mode):
  kforge_op        each relu is kforge's custom op (customops.kernel_op, an NVRTC relu kernel
                   through the C++ launcher), which Inductor calls as an extern op
  inductor_extern  each relu is aten.relu made an Inductor fallback (lowering.make_fallback, in
                   this process only), which Inductor calls as an extern aten kernel
and, for reference, the custom op called directly, outside any graph. Host time per call (µs:
perf_counter over many forwards, one synchronize at the end, divided by `calls`), and the same
forward replayed from a CUDA graph (GPU time per call, no host work).

    python bench/bench_compile_overhead.py --out bench/results/compile_overhead_h200.json [--n 256] [--calls 32]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench_dispatch import RELU, event_times_us, host_us_per_call
from provenance import provenance
from kforge import compiler, customops
from kforge.candidate import Candidate, LaunchPlan
from kforge.cards import ArgSpec, Card, TensorMeta
from kforge.dispatch import RegistryLauncher, Variant
from kforge.verdict import Measurement


def relu_op(x: torch.Tensor) -> torch.ops.OpOverload:
    major, minor = torch.cuda.get_device_capability()
    arch, n = f"sm_{major}{minor}", x.numel()
    meta = TensorMeta.of(x)
    card = Card(op="aten::relu.default", schema=str(torch.ops.aten.relu.default._schema),
                args=[ArgSpec("self", "tensor", tensor=meta)], outputs=[meta], arch=arch)
    plan = LaunchPlan.from_json({"kernels": [{"name": "relu_k", "grid": [(n + 255) // 256, 1, 1], "block": [256, 1, 1],
                                              "args": [{"in": 0}, {"out": 0}, {"i32": n}]}]})
    cand = Candidate(RELU, plan)
    launcher = RegistryLauncher([(cand, compiler.compile(RELU, arch=arch).cubin)])
    launcher.prepare(torch.cuda.current_device())
    return customops.kernel_op(Variant(card, 0, launcher), cand.digest())


def chain(fn, calls: int):
    def forward(x):
        for _ in range(calls):
            x = fn(x)
        return x
    return forward


def graph_us(fn, x: torch.Tensor, reps: int) -> dict:
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(static)
        fn(static)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(static)
    return Measurement(event_times_us(g.replay, reps)).summary()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=256, help="floats per relu (default 256: host cost dominates)")
    p.add_argument("--calls", type=int, default=32, help="relu calls per forward (default 32)")
    p.add_argument("--forwards", type=int, default=2000, help="forwards per host-time repeat")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    x = torch.randn(args.n, device="cuda")
    op = relu_op(x)
    torch._dynamo.reset()
    kforge_graph = torch.compile(chain(op, args.calls), dynamic=False)
    from torch._inductor import lowering

    lowering.make_fallback(torch.ops.aten.relu.default, warn=False)  # Inductor's extern call of aten.relu
    extern_graph = torch.compile(chain(torch.ops.aten.relu.default, args.calls), dynamic=False)
    with torch.inference_mode():
        want = chain(torch.relu, args.calls)(x)
        for name, fn in (("kforge_op", kforge_graph), ("inductor_extern", extern_graph)):
            assert torch.equal(fn(x), want), f"{name} disagrees with eager"
        host = {"kforge_op": host_us_per_call(lambda: kforge_graph(x), args.forwards) / args.calls,
                "inductor_extern": host_us_per_call(lambda: extern_graph(x), args.forwards) / args.calls,
                "kforge_op_direct": host_us_per_call(lambda: op(x), args.forwards * args.calls)}
        graphs = {name: graph_us(fn, x, 200) for name, fn in (("kforge_op", kforge_graph),
                                                               ("inductor_extern", extern_graph))}
    result = {**provenance(), "n": args.n, "calls": args.calls,
              "host_us_per_call": host, "kforge_over_extern_us": host["kforge_op"] - host["inductor_extern"],
              "cuda_graph_us_per_forward": graphs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
