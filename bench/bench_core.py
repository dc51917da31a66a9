"""Foundation benchmark: NVRTC compile time (cold, cached), cached module load, and host
overhead per launch of our launch path vs a torch op on a tiny tensor.

    python bench/bench_core.py --out bench/results/core_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def softmax_source(tag: int) -> str:
    """A ~100-line kernel; `tag` makes each cold compile a different source."""
    body = "\n".join(f"  acc += __expf(v * {i + 1}.0f) * 1e-{tag % 7 + 1}f;" for i in range(60))
    return f"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
// variant {tag}
__device__ __forceinline__ float warp_max(float v) {{
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
  return v;
}}
__device__ __forceinline__ float warp_sum(float v) {{
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}}
extern "C" __global__ void softmax_rows(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {{
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* xr = x + (long)row * cols;
  float m = __int_as_float(0xff800000);  // -inf: NVRTC has no <math.h> macros
  for (int c = lane; c < cols; c += 32) m = fmaxf(m, xr[c]);
  m = warp_max(m);
  float s = 0.f;
  for (int c = lane; c < cols; c += 32) s += __expf(xr[c] - m);
  s = warp_sum(s);
  float acc = 0.f, v = s;
{body}
  for (int c = lane; c < cols; c += 32) y[(long)row * cols + c] = __expf(xr[c] - m) / s + acc * 0.f;
}}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/core.json")
    ap.add_argument("--cold", type=int, default=5)
    args = ap.parse_args()

    import os

    os.environ["KFORGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="kforge-bench-")
    import torch

    from kforge import compiler, cuda, runtime
    from kforge.candidate import Candidate, LaunchPlan

    arch = compiler.default_arch()
    compiler.compile(softmax_source(999), arch=arch)  # load NVRTC once; not part of a compile
    cold = []
    for i in range(args.cold):
        t0 = time.perf_counter()
        compiler.compile(softmax_source(i), arch=arch)
        cold.append((time.perf_counter() - t0) * 1e3)
    cached_mem, cached_disk = [], []
    for i in range(args.cold):
        t0 = time.perf_counter()
        compiler.compile(softmax_source(i), arch=arch)
        cached_mem.append((time.perf_counter() - t0) * 1e3)
        compiler.clear_memory_cache()
        t0 = time.perf_counter()
        compiler.compile(softmax_source(i), arch=arch)
        cached_disk.append((time.perf_counter() - t0) * 1e3)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "nvrtc": compiler.nvrtc_version(),
        "arch": arch,
        "source_lines": softmax_source(0).count("\n"),
        "compile_cold_ms": statistics.median(cold),
        "compile_cached_memory_ms": statistics.median(cached_mem),
        "compile_cached_disk_ms": statistics.median(cached_disk),
    }
    if cuda.available():
        result["device"] = torch.cuda.get_device_name()
        # Cached load: cubin from the disk cache + module load into the primary context.
        loads = []
        for i in range(args.cold):
            compiler.clear_memory_cache()
            runtime.clear_modules()
            t0 = time.perf_counter()
            k = compiler.compile(softmax_source(i), arch=arch)
            runtime.load(k.cubin, 0)
            loads.append((time.perf_counter() - t0) * 1e3)
        result["cached_load_ms"] = statistics.median(loads)
        # Host overhead per call: launches back to back, no sync, on a tiny tensor.
        x = torch.randn(32, 32, device="cuda")
        y = torch.empty_like(x)
        src = softmax_source(0)
        cand = Candidate(src, LaunchPlan.from_json({"kernels": [{"name": "softmax_rows", "grid": [4], "block": [256],
                                                                 "args": [{"in": 0}, {"out": 0}, {"i32": 32},
                                                                          {"i32": 32}]}]}))
        plan = runtime.build_plan(cand, compiler.compile(src, arch=arch).cubin, 0)
        stream = torch.cuda.current_stream().cuda_stream
        ins, outs = [x.data_ptr()], [y.data_ptr()]
        n = 20000

        def per_call(fn) -> float:
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            dt = time.perf_counter() - t0
            torch.cuda.synchronize()
            return dt / n * 1e6

        result["launch_raw_plan_us"] = per_call(lambda: plan.launch(ins, outs, [], stream))
        result["launch_runtime_py_us"] = per_call(lambda: runtime.launch(plan, [x], [y]))
        result["torch_softmax_us"] = per_call(lambda: torch.softmax(x, -1))
        result["torch_add_us"] = per_call(lambda: torch.add(x, x))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for k, v in result.items():
        print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")


if __name__ == "__main__":
    main()
