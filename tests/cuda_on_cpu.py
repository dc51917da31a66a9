"""Run a generated candidate's CUDA C on the CPU: g++ compiles the source with a few shims
(CUDA qualifiers, thread and block indices, the device math names libm lacks) and every
(block, thread) of each launch runs one after the other. That is exact for kernels whose
threads do not cooperate (pointwise kernels; reductions with one thread per output,
split or not), so the generated indexing, vector accesses, workspaces and epilogues are
checked on a machine without a GPU. A kernel that waits at __syncthreads runs each block's
threads as OS threads meeting at a barrier (a thread that returns leaves it, as on the GPU), so
what one thread stages in shared memory for the others is checked too; shared memory starts each
block as NaN bytes, so reading a slot nobody wrote shows. Warp shuffles (up, down, xor, indexed, with
their width) exchange values among the warp's threads at the warp's own barrier. fp32, fp64, int and bool tensors only."""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kforge.cards import empty_like_meta

SHIM = r"""
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdlib>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(n)
#define __shared__ static
struct kf_dim3 { unsigned x = 0, y = 0, z = 0; };
static KF_TLS kf_dim3 threadIdx;  // thread_local where a block's threads run at once
static kf_dim3 blockIdx, gridDim, blockDim;
extern "C" void kf_set_ids(unsigned bx, unsigned by, unsigned tx, unsigned gx, unsigned gy, unsigned nx) {
  blockIdx.x = bx; blockIdx.y = by; threadIdx.x = tx; gridDim.x = gx; gridDim.y = gy; blockDim.x = nx;
}
inline void __trap() { std::abort(); }  // an index out of bounds (the tests pass none)
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float cyl_bessel_i0f(float x) { return std::cyl_bessel_i(0.f, std::fabs(x)); }
inline float cyl_bessel_i1f(float x) { return std::copysign(std::cyl_bessel_i(1.f, std::fabs(x)), x); }
inline double __longlong_as_double(long long v) { double d; std::memcpy(&d, &v, 8); return d; }
inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
using std::isnan; using std::isinf; using std::signbit;
"""

# What kernels with __syncthreads or warp shuffles add (their blocks run as threads): the C++20
# thread headers alone cost about 0.8 s of g++ a kernel, so the others go without them.
THREADED = r"""
#include <algorithm>
#include <barrier>
#include <memory>
#include <thread>
#include <utility>
#include <vector>
// Shared memory starts each block as NaN bytes (0xff), not the zeros of static storage or the last
// block's values, so a kernel that reads a slot no thread of its block wrote fails its check.
static std::vector<std::pair<void*, size_t>> kf_shared;
inline bool kf_register(void* p, size_t n) { std::memset(p, 0xff, n); kf_shared.emplace_back(p, n); return true; }
inline void kf_poison() { for (auto& [p, n] : kf_shared) std::memset(p, 0xff, n); }
static std::barrier<>* kf_bar = nullptr;
inline void __syncthreads() { if (kf_bar) kf_bar->arrive_and_wait(); }
// Warp shuffles: the warp's threads meet at the warp's barrier around an exchange of values.
static std::vector<std::unique_ptr<std::barrier<>>> kf_warp_bars;
static unsigned char kf_xbuf[1024 * 8];
template <class T> T kf_exchange(T v, unsigned src) {
  std::barrier<>& b = *kf_warp_bars[threadIdx.x / 32];
  std::memcpy(kf_xbuf + threadIdx.x * 8, &v, sizeof(T));
  b.arrive_and_wait();
  T r;
  std::memcpy(&r, kf_xbuf + src * 8, sizeof(T));
  b.arrive_and_wait();
  return r;
}
template <class T> T __shfl_down_sync(unsigned, T v, unsigned o, int w = 32) {
  const unsigned lane = threadIdx.x % 32;
  return kf_exchange(v, lane % w + o < (unsigned)w ? threadIdx.x + o : threadIdx.x);
}
template <class T> T __shfl_up_sync(unsigned, T v, unsigned o, int w = 32) {
  const unsigned lane = threadIdx.x % 32;
  return kf_exchange(v, lane % w >= o ? threadIdx.x - o : threadIdx.x);
}
template <class T> T __shfl_xor_sync(unsigned, T v, int o, int w = 32) {
  const unsigned lane = threadIdx.x % 32, s = lane ^ o;
  return kf_exchange(v, threadIdx.x - lane + (s / w == lane / w ? s : lane));
}
template <class T> T __shfl_sync(unsigned, T v, int src, int w = 32) {
  const unsigned lane = threadIdx.x % 32;
  return kf_exchange(v, threadIdx.x - lane + (lane / w) * w + src % w);
}
template <class... A, std::size_t... I>
void kf_call(void (*f)(A...), void** p, std::index_sequence<I...>) { f(static_cast<A>(p[I])...); }
template <class... A>  // every block in turn, its threads at once (kernel parameters are all pointers)
void kf_grid(void (*f)(A...), void** p, unsigned gx, unsigned gy, unsigned nt) {
  gridDim.x = gx; gridDim.y = gy; blockDim.x = nt;
  for (unsigned by = 0; by < gy; ++by)
    for (unsigned bx = 0; bx < gx; ++bx) {
      blockIdx.x = bx; blockIdx.y = by;
      kf_poison();
      std::barrier<> bar(nt);
      kf_bar = &bar;
      kf_warp_bars.clear();
      for (unsigned w = 0; w * 32 < nt; ++w) kf_warp_bars.emplace_back(new std::barrier<>(std::min(32u, nt - w * 32)));
      std::vector<std::thread> ts;
      for (unsigned tx = 0; tx < nt; ++tx)
        ts.emplace_back([=, &bar] {
          threadIdx.x = tx;
          kf_call(f, p, std::index_sequence_for<A...>{});
          kf_warp_bars[tx / 32]->arrive_and_drop();
          bar.arrive_and_drop();
        });
      for (auto& t : ts) t.join();
      kf_bar = nullptr;
    }
}
"""


# a __shared__ declaration (scalar or array): registered where it is declared, to be poisoned
_SHARED = re.compile(r"__shared__\s+([^;]*?)\s+(\w+)((?:\[[^\]]+\])*)\s*;")


def _library(source: str, threaded: list[str]) -> ctypes.CDLL:
    """The candidate's source built for the CPU; `threaded`: its kernels' names where its blocks
    run as threads (each gets a kf_grid_<name> entry), else empty."""
    if threaded:
        source = _SHARED.sub(lambda m: f"static {m[1]} {m[2]}{m[3]}; static const bool {m[2]}_kf_reg = "
                             f"kf_register(&{m[2]}, sizeof({m[2]}));", source)
    body = ("#define KF_TLS thread_local\n" if threaded else "#define KF_TLS\n") + SHIM + (THREADED if threaded else "") + \
        source.replace('extern "C" __global__', 'extern "C"') + "".join(
            f'\nextern "C" void kf_grid_{n}(void** p, unsigned gx, unsigned gy, unsigned nt) {{ kf_grid({n}, p, gx, gy, nt); }}'
            for n in threaded)
    # -fno-gnu-unique: a function-local static (shared memory) of an inline function is otherwise
    # one object across every library the process loads, sized by the first: a later kernel with
    # the same part signature and a larger tile wrote past it
    flags = ["-O1", *(["-std=c++20", "-pthread"] if threaded else ["-std=c++17"]), "-fno-gnu-unique", "-shared", "-fPIC", "-w"]
    key = hashlib.sha256((" ".join(flags) + body).encode()).hexdigest()[:16]
    d = Path(tempfile.gettempdir()) / "kforge_cuda_on_cpu"
    d.mkdir(exist_ok=True)
    so = d / f"{key}.so"
    if not so.exists():
        src = d / f"{key}.cpp"
        src.write_text(body)
        subprocess.run([shutil.which("g++"), *flags, "-o", str(so), str(src)], check=True, capture_output=True)
    return ctypes.CDLL(str(so))


def run(card, cand, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The candidate's outputs for CPU `inputs` (NaN-poisoned first), after every launch."""
    barriers = "__syncthreads" in cand.source or "__shfl" in cand.source
    lib = _library(cand.source, sorted({k.name for k in cand.plan.kernels}) if barriers else [])
    outs = [inputs[card.aliases[j]] if j in card.aliases else empty_like_meta(m, "cpu") for j, m in enumerate(card.outputs)]
    for j, o in enumerate(outs):
        if j not in card.aliases and o.is_floating_point():
            o.fill_(float("nan"))
    ws = [torch.zeros(b, dtype=torch.uint8) for b, _ in cand.plan.workspace_bytes()]
    if any(k.cooperative for k in cand.plan.kernels):  # its blocks wait for each other: one at a time would hang
        raise ValueError(f"{cand.knobs}: a cooperative kernel cannot run one thread at a time on the CPU")
    for k in cand.plan.kernels:
        fn = getattr(lib, k.name)
        ptrs = []
        for a in k.args:
            kind, i = next(iter(a.items()))
            t = {"in": inputs, "out": outs, "ws": ws}[kind][i]
            ptrs.append(ctypes.c_void_p(t.data_ptr()))
        if barriers:
            getattr(lib, f"kf_grid_{k.name}")((ctypes.c_void_p * len(ptrs))(*ptrs), k.grid[0], k.grid[1], k.block[0])
            continue
        for by in range(k.grid[1]):
            for bx in range(k.grid[0]):
                for tx in range(k.block[0]):
                    lib.kf_set_ids(bx, by, tx, k.grid[0], k.grid[1], k.block[0])
                    fn(*ptrs)
    return outs


def check_fast_forms(cards, exact: str, fast: str) -> None:
    """Each (card, is_16_bit) pair's default kernel uses the `fast` form and not the `exact` call
    where its outputs are 16-bit (emit.fast_nodes), the exact call otherwise; each compiles for sm_90."""
    from kforge import compiler
    from kforge.hardware import H200
    from kforge.proposers.builtin import generated

    for card, sixteen in cards:
        source = generated.build(card, generated.default(card, H200), H200).source
        kernel = source[source.index('extern "C"'):]
        assert (exact not in kernel, fast in kernel) == (sixteen, sixteen), card.summary()
        assert compiler.compile(source, arch="sm_90").cubin


def fast_forms_in_fp32(monkeypatch) -> None:
    """Pointwise kernels take the fast forms of 16-bit outputs whatever their dtype, so that the CPU
    runs those forms in fp32 (it runs no 16-bit type)."""
    from dataclasses import replace

    from kforge.codegen.lower import emit, pointwise

    monkeypatch.setattr(pointwise, "fast_nodes", lambda prog, results: emit.fast_nodes(
        replace(prog, outputs=[replace(m, dtype="bfloat16") for m in prog.outputs]), results))
