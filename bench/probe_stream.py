"""How close a streaming pointwise kernel gets to the copy floor on this GPU, and which way of
moving the bytes gets closest (run on the GPU). KernelBench level 1's elementwise problems
(ReLU at 64 x 393216 fp32, 100 MB in and out) run at the copy floor in eager already, so a
generated kernel beats eager there only if it moves bytes better than eager's kernel does.

Rows, each timed flushed and as called, interleaved with eager's relu and torch's copy:
  generated   kforge.codegen's default and its items=2 setting
  copy        a float4 copy kernel (what an ordinary kernel's loads and stores can reach)
  l2_256      relu with 256-byte L2 prefetch hints on the loads
  bulk C/S    relu through the bulk copy engine: C-byte chunks, S stages in shared memory,
              a persistent grid; loads and stores are cp.async.bulk, math in shared memory

    python bench/probe_stream.py [--out bench/results/probe_stream_h200.json]

On the H100 (2026-12-06) every way ties the copy or loses: eager's relu, torch's copy, the
generated kernel and plain loads 70.0-70.3 us as called at 100 MB; the bulk copy engine
73.6-74.5 hand-written and 74.3-76.1 generated (that form was removed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests"), str(ROOT / "bench")]

from bench_builtin import Runner  # noqa: E402
from builtin_cards import A, make_card, meta  # noqa: E402
from kforge import timing  # noqa: E402
from kforge.candidate import Candidate, KernelLaunch, LaunchPlan  # noqa: E402
from kforge.hardware import current  # noqa: E402
from kforge.proposers.builtin import generated  # noqa: E402
from provenance import provenance  # noqa: E402

SHAPE = (64, 393216)

FLAT = r"""
extern "C" __global__ void __launch_bounds__(256) kf_k(float4* __restrict__ out, const float4* __restrict__ in, int n4) {
  const int i = blockIdx.x * 256 + threadIdx.x;
  if (i >= n4) return;
  float4 x = LOAD(in + i);
  OP
  out[i] = x;
}
"""
L2_256 = r"""
__device__ __forceinline__ float4 ld256(const float4* p) {
  float4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
"""
RELU = "x.x = x.x < 0.f ? 0.f : x.x; x.y = x.y < 0.f ? 0.f : x.y; x.z = x.z < 0.f ? 0.f : x.z; x.w = x.w < 0.f ? 0.f : x.w;"

BULK = r"""
constexpr int NT = 256, S = STAGES, CB = CHUNK_BYTES, CF = CB / 4;
__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bulk_load(unsigned dst, const float* src, unsigned bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(CB) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(CB), "r"(bar) : "memory");
}
extern "C" __global__ void __launch_bounds__(NT) kf_k(float* __restrict__ out, const float* __restrict__ in, int nchunks) {
  extern __shared__ __align__(128) float buf[];
  __shared__ __align__(8) unsigned long long bar[S];
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(&bar[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int s = 0; s < S; ++s) {
      const int c = blockIdx.x + s * gridDim.x;
      if (c < nchunks) bulk_load(sa(buf + s * CF), in + (long long)c * CF, sa(&bar[s]));
    }
  }
  __syncthreads();
  int j = 0;
  for (int c = blockIdx.x; c < nchunks; c += gridDim.x, ++j) {
    const int s = j % S;
    const unsigned phase = (j / S) & 1;
    unsigned done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(sa(&bar[s])), "r"(phase) : "memory");
    float4* v = reinterpret_cast<float4*>(buf + s * CF);
#pragma unroll 4
    for (int i = tid; i < CF / 4; i += NT) { float4 x = v[i]; OP v[i] = x; }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (tid == 0) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   :: "l"(out + (long long)c * CF), "r"(sa(buf + s * CF)), "r"(CB) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      // Refill the stage stored one chunk ago (its store may still be reading it: wait for that one only).
      const int ps = (j + S - 1) % S, pc = c + (S - 1) * gridDim.x;
      if (j > 0 && pc < nchunks) {
        asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        bulk_load(sa(buf + ps * CF), in + (long long)pc * CF, sa(&bar[ps]));
      }
    }
  }
  if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


def cand(source: str, grid: int, args: list, smem: int = 0, block: int = 256) -> Candidate:
    return Candidate(source=source, plan=LaunchPlan(kernels=[KernelLaunch("kf_k", (grid, 1, 1), (block, 1, 1), smem, args)],
                                                    workspace=[], options=[]))


def variants(card, hw, n: int) -> dict[str, Candidate]:
    n4 = n // 4
    out = {"generated": generated.build(card, generated.default(card, hw), hw)}
    k2 = dict(generated.default(card, hw), items=2)
    out["generated items=2"] = generated.build(card, k2, hw)
    plain = "#define LOAD(p) (*(p))\n"
    out["copy"] = cand(plain + FLAT.replace("OP", ""), -(-n4 // 256), [{"out": 0}, {"in": 0}, {"i32": n4}])
    out["relu plain"] = cand(plain + FLAT.replace("OP", RELU), -(-n4 // 256), [{"out": 0}, {"in": 0}, {"i32": n4}])
    out["relu l2_256"] = cand(L2_256 + "#define LOAD(p) ld256(p)\n" + FLAT.replace("OP", RELU), -(-n4 // 256),
                              [{"out": 0}, {"in": 0}, {"i32": n4}])
    for cb, st in ((8192, 4), (16384, 3), (16384, 4), (32768, 3)):
        nch = n * 4 // cb
        per_sm = max(1, min(8, (hw.smem_per_block + 1024) // (cb * st + 1024)))
        resident = hw.sm_count * per_sm
        grid = -(-nch // -(-nch // resident))  # balanced: every block gets the same count, give or take one
        src = BULK.replace("STAGES", str(st)).replace("CHUNK_BYTES", str(cb)).replace("OP", RELU)
        out[f"bulk {cb // 1024}K/{st}"] = cand(src, grid, [{"out": 0}, {"in": 0}, {"i32": nch}], smem=cb * st)
    return out


def probe(shape, hw, variants_of) -> tuple[list[str], list]:
    """The rows that ran correctly at `shape`: eager, torch's copy, then `variants_of(card, n)`."""
    card = make_card(A.relu.default, meta(*shape))
    x = torch.randn(*shape, device="cuda")
    want = torch.relu(x)
    y = torch.empty_like(x)
    names, runs = ["eager relu", "torch copy_"], [lambda: torch.relu(x), lambda: y.copy_(x)]
    for name, c in variants_of(card, x.numel()).items():
        try:
            r = Runner(card, c, [x])
            r.outputs[0].fill_(float("nan"))
            r()
            torch.cuda.synchronize()
            if name != "copy" and not torch.equal(r.outputs[0], want):
                print(f"{name}: WRONG ({(r.outputs[0] != want).sum().item()} elements differ)")
                continue
            names.append(name)
            runs.append(r)
        except Exception as e:  # noqa: BLE001 - a probe reports what failed and goes on
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return names, runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "probe_stream_h200.json"))
    opts = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    hw = current()
    rows = []
    # KernelBench's size with every variant; then 4 and 16 MB with the generator's forms only
    small = lambda card, n: {k: v for k, v in variants(card, hw, n).items() if k.startswith("gen")}  # noqa: E731
    for shape, variants_of in ((SHAPE, lambda card, n: variants(card, hw, n)), ((4, 262144), small), ((16, 262144), small)):
        names, runs = probe(shape, hw, variants_of)
        for rep in range(2):  # twice: the second pass shows how much the first moved
            flushed = timing.time_fns(runs, min_reps=50, min_ms=50.0)
            called = timing.time_as_called([(contextlib.nullcontext, f) for f in runs])
            for nm, f, c in zip(names, flushed, called):
                rows.append({"shape": list(shape), "pass": rep, "name": nm, "flushed_us": f.median,
                             "flushed_iqr_us": f.iqr, "as_called_us": c.median, "as_called_iqr_us": c.iqr,
                             "floor_us": hw.floor_us(2 * 4 * shape[0] * shape[1])})
                print(f"{shape} pass {rep} {nm:>24}: flushed {f.median:7.2f} (iqr {f.iqr:5.2f})  as called "
                      f"{c.median:7.2f} (iqr {c.iqr:5.2f})")
        out = Path(opts.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**provenance(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
