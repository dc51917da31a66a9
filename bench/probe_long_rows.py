"""Where the time of a long-row softmax goes (run on the GPU): softmax 8x262144 fp32 is at
27 % of its HBM floor, so fixed costs, not bytes, decide it. This times the pieces apart,
all in one interleaved run (GPU time, median, L2 flushed before every rep):

  eager                 torch's softmax
  empty launch          a kernel that does nothing, same grid as split_coop
  copy                  8 MB in, 8 MB out in one launch: the best one kernel can do
  split_regs            both kernels, then kernel 1 alone, then kernel 2 alone
  split_regs, pdl       kernel 2 by programmatic dependent launch (starts as kernel 1 ends)
  split_coop            as shipped (workspace zeroed by a memset, then the kernel)
  split_coop, no memset the same kernel with its counters left at S from the last launch:
                        no memset and no waiting (its output is wrong; timing only)
  split_coop, packed    the same with the rows' counters side by side in one 128-byte line
                        (the default puts each on its own line)
  torch copy            y.copy_(x): torch's own copy kernel, for the copy line above
  copy, cs              the copy with x's loads streaming (ld.global.cs, evict-first in L2): if
                        allocating under the flush's dirty L2 cost write-backs, dropping these
                        clean lines first would save them (measured: it does not)

    python bench/probe_long_rows.py [--out bench/results/probe_long_rows_h200.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests"), str(ROOT / "bench")]

from bench_builtin import Runner  # noqa: E402  (a plan bound to fixed tensors)
from builtin_cards import softmax  # noqa: E402
from kforge import timing  # noqa: E402
from kforge.candidate import Candidate, KernelLaunch, LaunchPlan  # noqa: E402
from kforge.hardware import current  # noqa: E402
from kforge.proposers.builtin import common  # noqa: E402
from kforge.proposers.builtin import softmax as softmax_family  # noqa: E402
from provenance import provenance  # noqa: E402

ROWS, COLS = 8, 262144
_COPY = r"""
extern "C" __global__ void __launch_bounds__(256) kf_copy(const float4* __restrict__ x, float4* __restrict__ y) {
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  if (i < N4) y[i] = x[i];
}
extern "C" __global__ void __launch_bounds__(256) kf_copy_cs(const float4* __restrict__ x, float4* __restrict__ y) {
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  if (i < N4) y[i] = __ldcs(x + i);
}
extern "C" __global__ void kf_empty(const float* x, float* y) {}
"""


def with_plan(cand: Candidate, **changes) -> Candidate:
    return dataclasses.replace(cand, plan=dataclasses.replace(cand.plan, **changes))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "probe_long_rows_h200.json"))
    opts = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    hw = current()
    card = softmax(ROWS, COLS)
    x = torch.randn(ROWS, COLS, device="cuda")

    regs, regs_pdl = (softmax_family.build(card, {"algo": "split_regs", "split": 64, "threads": 256, "vec": 4,
                                                  "pdl": pdl}, hw) for pdl in (False, True))
    coop = softmax_family.build(card, {"algo": "split_coop", "split": 32, "threads": 1024, "vec": 4}, hw)
    n4 = ROWS * COLS // 4
    io = [{"in": 0}, {"out": 0}]
    plain = Candidate(source=f"constexpr long long N4 = {n4};\n" + _COPY, kind="custom", proposer="probe",
                      plan=LaunchPlan([KernelLaunch("kf_copy", ((n4 + 255) // 256, 1, 1), (256, 1, 1), 0, io)]))
    empty = with_plan(plain, kernels=[KernelLaunch("kf_empty", coop.plan.kernels[0].grid, coop.plan.kernels[0].block,
                                                   0, io)])
    (ws_bytes, _), = coop.plan.workspace_bytes()
    no_memset = with_plan(coop, workspace=[{"bytes": ws_bytes, "zero": False}])
    copy_cs = with_plan(plain, kernels=[dataclasses.replace(plain.plan.kernels[0], name="kf_copy_cs")])
    runs = {
        "eager": lambda: torch._softmax(x, -1, False),
        "empty launch": Runner(card, empty, [x]),
        "copy 8 MB -> 8 MB": Runner(card, plain, [x]),
        "split_regs": Runner(card, regs, [x]),
        "split_regs, pdl": Runner(card, regs_pdl, [x]),
        "split_regs kernel 1": Runner(card, with_plan(regs, kernels=regs.plan.kernels[:1]), [x]),
        "split_regs kernel 2": Runner(card, with_plan(regs, kernels=regs.plan.kernels[1:]), [x]),
        "split_coop": Runner(card, coop, [x]),
        "copy, cs": Runner(card, copy_cs, [x]),
    }
    stride, common.COUNTER_STRIDE = common.COUNTER_STRIDE, 1
    packed = softmax_family.build(card, {"algo": "split_coop", "split": 32, "threads": 1024, "vec": 4}, hw)
    common.COUNTER_STRIDE = stride
    runs["split_coop, packed counters"] = Runner(card, packed, [x])
    y = torch.empty_like(x)
    runs["torch copy"] = lambda: y.copy_(x)
    # The counters stay at S after one zeroed launch: every later launch passes its wait at once.
    nm = Runner(card, no_memset, [x])
    for w in nm.ws:
        w.zero_()
    nm()
    torch.cuda.synchronize()
    runs["split_coop, no memset, no wait"] = nm
    ms = timing.time_fns(list(runs.values()))
    rows = {name: {"median_us": m.median, "iqr_us": m.iqr} for name, m in zip(runs, ms)}
    floor = hw.floor_us(2 * ROWS * COLS * 4)
    for name, r in rows.items():
        print(f"{name:32s} {r['median_us']:8.2f} us  (iqr {r['iqr_us']:.2f})")
    print(f"{'HBM floor':32s} {floor:8.2f} us")
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**provenance(), "card": card.summary(), "floor_us": floor, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
