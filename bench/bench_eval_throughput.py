"""Evaluation throughput: candidates judged per minute by one worker on one GPU.

A ~100-line fp32 softmax kernel on a 12288x1024 fp32 card (48 MB in, 48 MB out), every
candidate a different source (a knob changes), through the full evaluation: compile,
load, 4 input sets x (kernel, eager, kernel) with every check, timing (>= 100 reps or
>= 200 ms, L2 flushed), and the held-out run. Two passes over the same sources: "cold"
(an empty kernel cache, NVRTC runs for each) and "cached" (the disk/memory cache hits).
The first evaluation also pays for starting the worker and preparing the card's input
sets and tolerances; it is reported apart.

    python bench/bench_eval_throughput.py [--candidates 12] [--out bench/results/eval_throughput_h200.json]

Writes JSON to --out, else to $OUT/eval_throughput.json when $OUT is set, else to
bench/results/eval_throughput.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests")]

from evalkit import make_card  # noqa: E402
from kforge import __version__  # noqa: E402
from kforge.candidate import Candidate, LaunchPlan  # noqa: E402
from kforge.evaluate import make_evaluator  # noqa: E402

ROWS, COLS = 12288, 1024

SOFTMAX = r"""
// Row softmax, fp32: one block per row, float4 loads, online max/sum per thread, then a
// block-wide merge of (max, sum) pairs through warp shuffles and shared memory.
#define THREADS %(threads)d
#define UNROLL %(unroll)d
#define NEG_INF __int_as_float(0xff800000)

struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  float m = fmaxf(a.m, b.m);
  if (m == NEG_INF) return {m, 0.f};
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

__device__ __forceinline__ MaxSum push(MaxSum acc, float x) {
  if (x > acc.m) {
    acc.s = acc.s * __expf(acc.m - x) + 1.f;
    acc.m = x;
  } else {
    acc.s += __expf(x - acc.m);
  }
  return acc;
}

__device__ __forceinline__ MaxSum warp_merge(MaxSum v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum w;
    w.m = __shfl_xor_sync(0xffffffff, v.m, o);
    w.s = __shfl_xor_sync(0xffffffff, v.s, o);
    v = merge(v, w);
  }
  return v;
}

__device__ MaxSum block_merge(MaxSum v) {
  __shared__ float ms[32], ss[32];
  v = warp_merge(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    ms[warp] = v.m;
    ss[warp] = v.s;
  }
  __syncthreads();
  MaxSum r = {NEG_INF, 0.f};
  if (lane < THREADS / 32) r = {ms[lane], ss[lane]};
  r = warp_merge(r);
  return r;
}

extern "C" __global__ void __launch_bounds__(THREADS)
softmax_rows(const float* __restrict__ x, float* __restrict__ y, int cols) {
  const float4* row = reinterpret_cast<const float4*>(x + (long)blockIdx.x * cols);
  float4* out = reinterpret_cast<float4*>(y + (long)blockIdx.x * cols);
  const int n4 = cols / 4;
  MaxSum acc = {NEG_INF, 0.f};
#pragma unroll UNROLL
  for (int i = threadIdx.x; i < n4; i += THREADS) {
    float4 v = row[i];
    acc = push(acc, v.x);
    acc = push(acc, v.y);
    acc = push(acc, v.z);
    acc = push(acc, v.w);
  }
  for (int i = 4 * n4 + threadIdx.x; i < cols; i += THREADS)
    acc = push(acc, x[(long)blockIdx.x * cols + i]);
  MaxSum total = block_merge(acc);
  const float m = total.m, inv = 1.f / total.s;
#pragma unroll UNROLL
  for (int i = threadIdx.x; i < n4; i += THREADS) {
    float4 v = row[i];
    v.x = __expf(v.x - m) * inv;
    v.y = __expf(v.y - m) * inv;
    v.z = __expf(v.z - m) * inv;
    v.w = __expf(v.w - m) * inv;
    out[i] = v;
  }
  for (int i = 4 * n4 + threadIdx.x; i < cols; i += THREADS) {
    long j = (long)blockIdx.x * cols + i;
    y[j] = __expf(x[j] - m) * inv;
  }
}
"""


def candidates(n: int) -> list[Candidate]:
    """n distinct sources: every (threads, unroll) pair, then a salt so none repeats."""
    out = []
    knobs = [(t, u) for t in (128, 256, 512, 1024) for u in (1, 2, 4, 8)]
    for i in range(n):
        threads, unroll = knobs[i % len(knobs)]
        source = SOFTMAX % {"threads": threads, "unroll": unroll} + f"// variant {i}\n"
        plan = LaunchPlan.from_json({"kernels": [{"name": "softmax_rows", "grid": [ROWS], "block": [threads],
                                                  "args": [{"in": 0}, {"out": 0}, {"i32": COLS}]}]})
        out.append(Candidate(source, plan, proposer="bench", knobs={"threads": threads, "unroll": unroll}))
    return out


def run_pass(pool, card, cands) -> dict:
    times, verdicts, phases = [], {}, {}
    t0 = time.perf_counter()
    for c in cands:
        s = time.perf_counter()
        r = pool.evaluate(card, c)
        times.append(time.perf_counter() - s)
        verdicts[r.verdict.value] = verdicts.get(r.verdict.value, 0) + 1
        for name, secs in r.evidence.get("phase_s", {}).items():
            phases.setdefault(name, []).append(secs)
    wall = time.perf_counter() - t0
    return {"candidates": len(cands), "wall_s": round(wall, 3), "per_minute": round(60 * len(cands) / wall, 2),
            "median_eval_s": round(statistics.median(times), 4), "max_eval_s": round(max(times), 4), "verdicts": verdicts,
            "median_phase_s": {k: round(statistics.median(v), 4) for k, v in phases.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidates", type=int, default=12)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")

    os.environ["KFORGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="kforge-bench-cache-")  # cold: nothing cached
    run_dir = Path(tempfile.mkdtemp(prefix="kforge-bench-run-"))
    card = make_card(torch.ops.aten._softmax.default, torch.randn(ROWS, COLS, device="cuda"), -1, False,
                     family="normalization", arch="sm_90")
    warm = Candidate(SOFTMAX % {"threads": 256, "unroll": 1} + "// warm-up\n",
                     LaunchPlan.from_json({"kernels": [{"name": "softmax_rows", "grid": [ROWS], "block": [256],
                                                        "args": [{"in": 0}, {"out": 0}, {"i32": COLS}]}]}))
    cands = candidates(args.candidates)
    with make_evaluator(run_dir, devices=[0], restart_every=10_000) as pool:
        t0 = time.perf_counter()
        first = pool.evaluate(card, warm)  # starts the worker and prepares the card
        first_s = time.perf_counter() - t0
        cold = run_pass(pool, card, cands)
        cached = run_pass(pool, card, cands)

    result = {
        "bench": "eval_throughput",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "kforge": __version__,
        "card": f"_softmax {ROWS}x{COLS} fp32 (dim -1), {card.io_bytes() / 1e6:.1f} MB moved per call",
        "source_lines": SOFTMAX.count("\n"),
        "first_eval_s": round(first_s, 3),
        "first_verdict": first.verdict.value,
        "cold": cold,
        "cached": cached,
        "note": "per_minute counts full evaluations (compile, 4 input sets x 3 runs with every check, "
                "timing >= 100 reps or >= 200 ms with L2 flush, held-out run); first_eval_s includes the "
                "worker's start and the card's preparation",
    }
    if args.out:
        out = args.out
    elif os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "eval_throughput.json"
    else:
        out = ROOT / "bench" / "results" / "eval_throughput.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
