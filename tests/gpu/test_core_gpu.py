"""The C++ core on a real GPU: launches on torch's stream, CUDA graphs, the harness."""

from __future__ import annotations

import pytest
import torch

from kforge import compiler, runtime, timing
from kforge.candidate import Candidate, LaunchPlan

pytestmark = pytest.mark.gpu

VADD = r"""
extern "C" __global__ void vadd(const float* a, const float* b, float* c, long n) {
  long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}
"""

BF16_AXPY = r"""
#include <cuda_bf16.h>
extern "C" __global__ void axpy(const __nv_bfloat16* x, const __nv_bfloat16* y, __nv_bfloat16* out, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __float2bfloat16(a * __bfloat162float(x[i]) + __bfloat162float(y[i]));
}
"""

COPY = r"""
extern "C" __global__ void copy4(const float4* __restrict__ src, float4* __restrict__ dst, long n4) {
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}
"""


def _plan(source, name, grid, block, args, device=0):
    cand = Candidate(source, LaunchPlan.from_json({"kernels": [{"name": name, "grid": grid, "block": block,
                                                                  "args": args}]}))
    return runtime.build_plan(cand, compiler.compile(source).cubin, device)


def test_vector_add_on_current_stream_matches_torch():
    n = 1_000_003
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    c = torch.full_like(a, float("nan"))
    plan = _plan(VADD, "vadd", [(n + 255) // 256], [256], [{"in": 0}, {"in": 1}, {"out": 0}, {"i64": n}])
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # our launch must follow torch's current stream, not the default one
        side.wait_stream(torch.cuda.default_stream())
        runtime.launch(plan, [a, b], [c])
    torch.cuda.synchronize()
    torch.testing.assert_close(c, a + b, rtol=0, atol=0)


def test_bf16_kernel_matches_torch():
    n = 4097
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    plan = _plan(BF16_AXPY, "axpy", [(n + 127) // 128], [128],
                 [{"in": 0}, {"in": 1}, {"out": 0}, {"f32": 0.5}, {"i32": n}])
    runtime.launch(plan, [x, y], [out])
    ref = (0.5 * x.float() + y.float()).bfloat16()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_launch_inside_cuda_graph_replays():
    n = 65536
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    c = torch.zeros_like(a)
    plan = _plan(VADD, "vadd", [n // 256], [256], [{"in": 0}, {"in": 1}, {"out": 0}, {"i64": n}])
    runtime.launch(plan, [a, b], [c])  # warm: module loaded outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        runtime.launch(plan, [a, b], [c])
    a.copy_(torch.randn(n, device="cuda"))
    c.zero_()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(c, a + b, rtol=0, atol=0)


def test_illegal_address_becomes_a_named_error_in_a_subprocess():
    import subprocess
    import sys

    code = r"""
import torch, kforge
from kforge import compiler, runtime
from kforge.candidate import Candidate, LaunchPlan
src = 'extern "C" __global__ void bad(float* p) { p[threadIdx.x] = 1.0f; }'
c = Candidate(src, LaunchPlan.from_json({"kernels": [{"name": "bad", "grid": [1], "block": [32], "args": [{"out": 0}]}]}))
plan = runtime.build_plan(c, compiler.compile(src).cubin, 0)
torch.cuda.init()
try:
    plan.launch([], [16], [], torch.cuda.current_stream().cuda_stream)
    kforge._C.synchronize(0)
except kforge.errors.CudaError as e:
    print("ERR", e.name)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR CUDA_ERROR_ILLEGAL_ADDRESS" in out.stdout, out.stdout + out.stderr


def test_harness_agrees_with_triton_do_bench_on_a_2gb_copy():
    triton_testing = pytest.importorskip("triton.testing")
    nbytes = 1 << 30  # 1 GiB read + 1 GiB written = a 2 GB device-to-device copy
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    n4 = src.numel() // 4
    plan = _plan(COPY, "copy4", [132 * 8], [512], [{"in": 0}, {"out": 0}, {"i64": n4}])
    ours = timing.bench_plan(plan, [[src]], [dst], min_reps=50, min_ms=100)
    theirs_ms = triton_testing.do_bench(lambda: runtime.launch(plan, [src], [dst]), warmup=25, rep=200,
                                        return_mode="median")
    ratio = ours.median / (theirs_ms * 1e3)
    assert 0.9 <= ratio <= 1.1, f"harness {ours.median:.1f} us vs do_bench {theirs_ms * 1e3:.1f} us"
    torch.testing.assert_close(dst, src, rtol=0, atol=0)


def test_gpu_time_leaves_out_the_host_time_of_issuing_the_work():
    """A callable that spends 3 ms on the host before a µs kernel is timed at the kernel's µs,
    as torch.compile's guards must not be counted as its kernels' time."""
    import time

    x = torch.zeros(1024, device="cuda")

    def slow_host():
        time.sleep(0.003)
        x.add_(1)

    def fast_host():
        x.add_(1)

    slow, fast = timing.time_fns([slow_host, fast_host], min_reps=20, min_ms=10, warmup_ms=5)
    assert slow.median < 100, f"{slow.median:.1f} µs: the host's 3 ms are in the sample"
    assert abs(slow.median - fast.median) < 50
