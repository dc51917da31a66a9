"""Where the host time of one aten call goes, alone and as the first call of a queued forward
(run on the GPU).

The unseen models' runs (round 27, H100) showed one call per forward taking most of a
launch-bound forward's host time, in eager and kforge.optimize but not under torch.compile:
Llama's embedding (aten::gather under index_select, 128-584 us a forward) and ViT's patch
convolution (cudnn_convolution, 616 us, against 48 us for the same shapes in torch.compile's
graph). This probe times each call's return on the host, three ways:

  idle      the GPU idle before the call (synchronized)
  queued    after 2 ms of GPU work queued (the call's host time, unless it waits for the GPU)
  profiled  torch.profiler's self time of the call's aten ops and CUDA runtime calls, queued

and the same for the variants a compiler may choose instead (the convolution without its bias,
channels-last; the embedding as a generated kernel is kforge's own and not timed here).

    python bench/probe_host.py --out probe_host.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402


def _busy(ms: float = 2.0) -> None:
    torch.cuda._sleep(int(ms * 1e6 / 0.6))  # about 0.6 ns a cycle on a 1.7 GHz clock: ~`ms` of GPU time


def host_us(fn, queued: bool, reps: int = 30) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if queued:
            _busy()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def profiled(fn, reps: int = 5) -> list[dict]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            _busy()
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:8]
    return [{"op": a.key, "calls": a.count / reps, "self_us": a.self_cpu_time_total / reps} for a in rows]


def cases() -> dict:
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(32, 3, 224, 224, **bf16)
    w, b = torch.randn(768, 3, 16, 16, **bf16), torch.randn(768, **bf16)
    xl, wl = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    table = torch.randn(32000, 2048, **bf16)
    ids = torch.randint(0, 32000, (1, 2048), device="cuda")
    return {
        "conv vit patch bias": lambda: F.conv2d(x, w, b, stride=16),
        "conv vit patch no bias": lambda: F.conv2d(x, w, None, stride=16),
        "conv vit patch channels-last bias": lambda: F.conv2d(xl, wl, b, stride=16),
        "conv vit patch channels-last no bias": lambda: F.conv2d(xl, wl, None, stride=16),
        "embedding llama": lambda: F.embedding(ids, table),
        "index_select llama": lambda: torch.index_select(table, 0, ids.view(-1)),
        "relu (a plain launch)": lambda: torch.relu(table),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows = {}
    with torch.no_grad():
        for name, fn in cases().items():
            for _ in range(3):
                fn()
            rows[name] = {"idle_us": host_us(fn, False), "queued_us": host_us(fn, True), "profiled": profiled(fn)}
            r = rows[name]
            print(f"{name:40s} idle {r['idle_us']:7.1f} us  queued {r['queued_us']:7.1f} us  "
                  + ", ".join(f"{p['op']} {p['self_us']:.0f}" for p in r["profiled"][:4]))
    Path(args.out).write_text(json.dumps({**provenance(), "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
