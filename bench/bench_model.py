"""One model end to end on the GPU: capture, search with the built-in proposer, package,
then measure in the same process: per card eager vs kforge as dispatched and % of the
HBM floor, and the model's forward latency eager and with the package applied; then the
same forward replayed from CUDA graphs, eager and with the package, which shows what the kernels do in a forward bound by launch overhead. With
--compile the same rounds also time torch.compile and kforge.compile (the package's kernels in
Inductor's graphs), default and mode="reduce-overhead", and kforge.optimize (the traced graphs
with the package's region and op kernels), op by op and replayed from CUDA graphs. With
--regions the search covers region cards too (kforge.run(..., regions=True)) and kforge.optimize
is timed with or without --compile. Outputs with the package must equal eager within tolerance;
the last line says which way is fastest and by how much.

    python bench/bench_model.py examples/sd_vae_decoder.py --iterations 50 --out bench/results/model_sd_vae.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

import torch

import kforge
from kforge import timing
from kforge.shares import shares_by_family
from kforge.card_files import load_cards
from kforge.cards import flatten_outputs
from kforge.hardware import current
from kforge.modelcheck import compiled_forwards
from kforge.replay import time_graphs
from kforge.modelspec import load_model_spec
from provenance import provenance


def forward(model, inputs):
    args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    with torch.inference_mode():
        return model(*args)


def max_rel_err(got, ref) -> float:
    """Largest |got - ref| over the reference's RMS, across every output tensor."""
    worst = 0.0
    for g, r in zip(flatten_outputs(got), flatten_outputs(ref)):
        scale = r.float().pow(2).mean().sqrt().clamp_min(1e-12)
        worst = max(worst, float((g.float() - r.float()).abs().max() / scale))
    return worst


def phase_seconds(run_dir: Path, run_id: str) -> dict:
    """Where the search's evaluation time went: seconds per worker phase, summed over candidates."""
    from kforge.store import SQLiteStore

    totals: dict[str, float] = {}
    with SQLiteStore(run_dir, readonly=True) as log:
        candidates = log.candidates(run_id)
    for c in candidates:
        for name, sec in c.evidence.get("phase_s", {}).items():
            totals[name] = totals.get(name, 0.0) + sec
    eval_s = sum(c.eval_s or 0.0 for c in candidates)
    return {"candidates": len(candidates), "eval_s": round(eval_s, 2), **{k: round(v, 2) for k, v in totals.items()}}


PROFILED = ("eager", "kforge.optimize", "torch.compile")
SLOW_HOST_US = 40.0  # an aten op's host time per call from which its input shapes are recorded


def profiled(fn, forwards: int, activities, sync, **options) -> torch.profiler.profile:
    """torch.profiler over `forwards` calls of fn, each from an idle GPU, after one call under the
    profiler that is not kept, so that the profiler's own start is charged to no op of a kept
    forward. (Round 31's profiles, which kept the first forward, had the first aten op of every
    eager and kforge.optimize forward at 560-875 us a call, and torch.compile's, whose first
    recorded event is its own wrapper, at 42-63: this tells whether that was the profiler.)"""
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=forwards, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, **options) as prof:
        for _ in range(forwards + 1):
            fn()
            sync()
            prof.step()
    return prof


def host_side(entries, reps: int = 15, forwards: int = 3) -> dict:
    """Where a forward's host time goes, per entry: the median time its call takes to return
    (the GPU idle before it, so nothing queued ahead slows the host or hides it), and for the
    PROFILED entries the host ops that take longest, by self CPU time per forward
    (torch.profiler over `forwards` forwards, CPU activity only). A forward slower than its
    CUDA-graph replay by about its host time is bound by these."""
    per_forward, top = {}, {}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for name, ctx, fn in entries:
        with ctx():
            fn()
            times = []
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            sync()
            per_forward[name] = sorted(times)[len(times) // 2]
            if name in PROFILED:
                prof = profiled(fn, forwards, [torch.profiler.ProfilerActivity.CPU], sync, record_shapes=True)
                rows = sorted((a for a in prof.key_averages() if not a.key.startswith("ProfilerStep")),
                              key=lambda a: -a.self_cpu_time_total)[:20]
                top[name] = [{"op": a.key, "calls": a.count / forwards, "self_us": a.self_cpu_time_total / forwards}
                             for a in rows]
                # an aten op slow per call on the host (a sync, a pageable copy, a heuristic search):
                # the shapes it was called with say which of the model's calls it is
                slow = [a for a in prof.key_averages(group_by_input_shape=True)
                        if a.key.startswith("aten::") and a.count and a.self_cpu_time_total / a.count >= SLOW_HOST_US]
                for a in sorted(slow, key=lambda a: -a.self_cpu_time_total / a.count)[:8]:
                    top[name].append({"op": a.key, "calls": a.count / forwards, "self_us": a.self_cpu_time_total / forwards,
                                      "slow_per_call_us": a.self_cpu_time_total / a.count, "shapes": str(a.input_shapes)[:300]})
    return {"per_forward_us": per_forward, "top_ops": top}


VENDOR_KERNELS = ("gemm", "cutlass", "xmma", "cudnn", "conv", "fmha", "flash", "attention", "cublas", "nchw", "nhwc")


def gpu_side(entries, forwards: int = 3, top: int = 25) -> dict:
    """Where a forward's GPU time goes, per PROFILED entry: its kernels by GPU time per forward
    (torch.profiler, CUDA activity), and that time split into vendor kernels (cuBLAS, cuDNN, the
    attention kernels: by name) and the rest (what kforge or Inductor generate, and eager's own).
    Two entries' lists side by side say which kernels one loses on."""
    if not torch.cuda.is_available():
        return {}
    out = {}
    for name, ctx, fn in entries:
        if name not in PROFILED:
            continue
        with ctx():
            fn()
            torch.cuda.synchronize()
            prof = profiled(fn, forwards, [torch.profiler.ProfilerActivity.CUDA], torch.cuda.synchronize)
        kernels = [(e.key, e.count / forwards, getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)))
                   for e in prof.key_averages()]
        kernels = sorted(((k, n, us / forwards) for k, n, us in kernels if us > 0), key=lambda r: -r[2])
        vendor = sum(us for k, _, us in kernels if any(v in k.lower() for v in VENDOR_KERNELS))
        out[name] = {"total_us": sum(us for _, _, us in kernels), "vendor_us": vendor,
                     "kernels": [{"kernel": k[:160], "calls": n, "us": us} for k, n, us in kernels[:top]]}
        if name.startswith("kforge"):  # its kernels by card: the GPU time under each kforge op
            with ctx():
                prof = profiled(fn, forwards, [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                torch.cuda.synchronize)
            out[name]["cards"] = by_card(host_ops(prof.events()), forwards)
    return out


def host_ops(events) -> list[tuple[str, int, float]]:
    """(name, calls, GPU µs of the kernels it launched) of each op or range the host recorded.
    Events on the device side are left out: a record_function range has a GPU-side twin of the
    same name spanning its kernels (pytorch#130730), which key_averages() would add to it, so a
    region card's range would count twice what an op card's op counts once."""
    from torch.autograd import DeviceType

    rows: dict[str, list] = {}
    for e in events:
        if e.device_type == DeviceType.CPU:
            row = rows.setdefault(e.key, [0, 0.0])
            row[0] += 1
            row[1] += getattr(e, "device_time_total", 0) or 0
    return [(key, n, us) for key, (n, us) in rows.items()]


def by_card(events, forwards: int) -> list[dict]:
    """GPU time per forward under each kforge op (`kforge::k_<card id>_<kernel digest>`, an op
    card's custom op; `kforge::k_<card id>_region`, a region's launch under the profiler), most
    first, from (profiler key, calls, GPU µs of the kernels it launched) rows."""
    rows = []
    for key, calls, us in events:
        if key.startswith("kforge::k_") and us > 0:
            rows.append({"card": key[len("kforge::k_"):].split("_")[0], "op": key, "calls": calls / forwards,
                         "us": us / forwards})
    return sorted(rows, key=lambda r: -r["us"])


def fastest(model_us: dict) -> tuple[str, float, str]:
    """(the fastest row, how many times faster than the runner-up, the runner-up)."""
    (best, b), (second, t) = sorted(((k, m["median_us"]) for k, m in model_us.items()), key=lambda kv: kv[1])[:2]
    return best, t / b, second


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="model.py (get_model/get_inputs) or pkg.module:factory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--min-share", type=float, default=0.0)
    ap.add_argument("--ops", default="", help="only search cards of these ops (comma-separated name parts)")
    ap.add_argument("--wall-time", type=float, default=None, help="search wall-time budget in seconds")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile and kforge.compile, default and reduce-overhead")
    ap.add_argument("--regions", action="store_true", help="capture and search region cards too; time kforge.optimize")
    ap.add_argument("--run-dir", default=None)
    args = ap.parse_args(argv)

    model, inputs = load_model_spec(args.model)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="kforge-bench-"))
    cast = run_dir / "model.cast"
    t0 = time.perf_counter()
    result = kforge.run(model, inputs, out=cast, iterations=args.iterations, run_dir=run_dir,
                        min_share=args.min_share, wall_time_s=args.wall_time, progress=False,
                        ops=[o for o in args.ops.split(",") if o] or None,
                        model_name=Path(args.model).stem, check_model=False, regions=args.regions)  # timed below (and, with --compile, under torch.compile)
    wall_s = time.perf_counter() - t0
    pkg = kforge.load(result.package_path)
    decisions = {c.id: c for c in pkg.cards}
    hw = current()

    ref = forward(model, inputs)
    with pkg.apply():
        got = forward(model, inputs)
    err = max_rel_err(got, ref)

    entries = [("eager", contextlib.nullcontext, lambda: forward(model, inputs)),
               ("kforge", pkg.apply, lambda: forward(model, inputs))]
    compile_s = compile_err = None
    compile_hits: dict[str, int] = {}
    if args.compile:
        # torch.compile and kforge.compile, default and reduce-overhead, timed in the same rounds.
        t1 = time.perf_counter()
        before = {c.id: c.counters.hits for c in pkg.cards}
        compiled = compiled_forwards(model, pkg, lambda m: lambda: forward(m, inputs))
        compile_s = time.perf_counter() - t1
        compile_hits = {c.id: c.counters.hits - before[c.id] for c in pkg.cards if c.counters.hits > before[c.id]}
        compile_err = max_rel_err(compiled["kforge.compile"](), ref)
        entries += [(name, contextlib.nullcontext, fn) for name, fn in compiled.items()]
    elif args.regions:
        for name, cuda_graphs in (("kforge.optimize", False), ("kforge.optimize cuda_graphs", True)):
            fast = kforge.optimize(model, pkg, cuda_graphs=cuda_graphs)
            for _ in range(3):  # traced, kernels loaded, graphs captured
                forward(fast, inputs)
            entries.append((name, contextlib.nullcontext, lambda fast=fast: forward(fast, inputs)))
    optimize_err = {name: max_rel_err(fn(), ref) for name, _, fn in entries if name.startswith("kforge.optimize")}
    ms = timing.time_as_called([(ctx, fn) for _, ctx, fn in entries], calls=3, rounds=15)
    model_us = {name: m.summary() for (name, _, _), m in zip(entries, ms)}
    host = host_side(entries)
    try:
        gpu = gpu_side(entries)
    except Exception as e:  # noqa: BLE001 (a profiler that fails keeps the timings above)
        print(f"  GPU kernels not profiled: {type(e).__name__}: {e}")
        gpu = {}
    # The same forward replayed from CUDA graphs: no host overhead, so what the kernels do in a
    # forward bound by launch overhead (torch.compile's own graphs are the reduce-overhead rows above).
    graph_errors = {}
    try:
        g_eager, g_pkg = time_graphs(lambda: forward(model, inputs), pkg, calls=3, rounds=15)
        model_us["eager, CUDA graph"], model_us["kforge, CUDA graph"] = g_eager.summary(), g_pkg.summary()
    except Exception as e:  # noqa: BLE001 (a model a graph cannot hold keeps the rows above)
        graph_errors["kforge"] = f"{type(e).__name__}: {e}"
    report = pkg.report()

    captured = {c.id: c for c in load_cards(run_dir)}
    by_family = shares_by_family(list(captured.values()))
    phases = phase_seconds(run_dir, result.run_id)
    cards = []
    for row in result.table:
        c = decisions.get(row.card_id)
        entry = c.entry if c is not None else {}
        timing_ = entry.get("timing", {}) if isinstance(entry, dict) else {}
        cards.append({
            "card": row.card_id, "op": row.summary, "family": row.family, "status": row.status,
            "calls": getattr(captured.get(row.card_id), "calls", None),
            "share": getattr(captured.get(row.card_id), "share", None),
            "iterations": row.iterations, "search_s": row.search_s, "eager_us": row.eager_us, "best_kernel_us": row.best_us,
            "best_speedup": row.speedup, "decision": c.decision if c else "not searched",
            "reason": c.reason if c else row.note, "timing": timing_,
            # the card's kernel against the card compiled alone by torch.compile, and what kforge.compile decided
            "compile": entry.get("compile", {}) if isinstance(entry, dict) else {},
            "compile_decision": c.compile_decision if c else None, "compile_reason": c.compile_reason if c else None,
        })
    out = {
        **provenance(), "model": args.model,
        "iterations": args.iterations, "search_wall_s": wall_s, "run_dir": str(run_dir),
        "dispatched": report["dispatched"], "cards_total": len(result.table),
        "model_us": model_us, "host": host, "gpu_kernels": gpu, "compile_s": compile_s, "kforge_compile_max_rel_err_vs_eager": compile_err,
        "kforge_compile_speedup_vs_torch_compile": (
            model_us["torch.compile"]["median_us"] / model_us["kforge.compile"]["median_us"] if args.compile else None),
        "kforge_compile_graph_speedup_vs_torch_compile": (
            model_us["torch.compile reduce-overhead"]["median_us"] / model_us["kforge.compile reduce-overhead"]["median_us"]
            if args.compile else None),
        "compile_hits": compile_hits,
        "speedup_vs_eager": model_us["eager"]["median_us"] / model_us["kforge"]["median_us"],
        "graph_speedup_vs_eager": (model_us["eager, CUDA graph"]["median_us"] / model_us["kforge, CUDA graph"]["median_us"]
                                   if "kforge, CUDA graph" in model_us else None),
        "graph_errors": graph_errors, "regions": args.regions, "optimize_max_rel_err_vs_eager": optimize_err,
        "fastest": fastest(model_us),
        "max_rel_err_vs_eager": err, "hits": {r["id"]: r["hits"] for r in report["cards"] if r["hits"]},
        # calls a kernel's guard sent to eager instead, by reason (a region's C++ guard checks strides too)
        "fallbacks": {r["id"]: r["fallbacks"] for r in report["cards"] if r["fallbacks"]},
        "hbm_bw": hw.bandwidth, "share_by_family": by_family, "eval_phase_s": phases, "cards": cards, "stop_reasons": result.stop_reasons,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"{args.model}: {len(result.table)} cards, {report['dispatched']} dispatched, search {wall_s:.0f} s")
    for name, m in model_us.items():
        h = host["per_forward_us"].get(name)
        print(f"  {name:28s} {m['median_us']:10.1f} us  (iqr {m['iqr_us']:.1f})"
              + (f", host {h:.0f} us to return" if h is not None else ""))
    for name, rows in host["top_ops"].items():
        print(f"  host ops of {name}: " + ", ".join(f"{r['op']} x{r['calls']:g} {r['self_us']:.0f} us" for r in rows[:8]))
        for r in rows:
            if "shapes" in r:
                print(f"    slow on the host: {r['op']} {r['slow_per_call_us']:.0f} us a call, inputs {r['shapes'][:120]}")
    for name, g in gpu.items():
        print(f"  GPU kernels of {name}: {g['total_us']:.0f} us a forward, {g['vendor_us']:.0f} in vendor kernels; "
              + ", ".join(f"{r['kernel'][:48]} x{r['calls']:g} {r['us']:.1f}" for r in g["kernels"][:12]))
        ops = {c["card"]: c["op"] for c in cards}
        for r in g.get("cards", [])[:12]:
            print(f"    {r['us']:7.1f} us x{r['calls']:g}  {ops.get(r['card'], r['card'])[:100]}")
    for name, why in graph_errors.items():
        print(f"  {name} not replayed from a CUDA graph: {why[:200]}")
    print(f"  speedup vs eager {out['speedup_vs_eager']:.3f}x, max rel err {err:.2e}")
    best, ratio, second = out["fastest"]
    print(f"  fastest: {best}, {ratio:.3f}x the runner-up ({second}); kforge.optimize max rel err {optimize_err}")
    print(f"  evaluation: {phases}")
    print("  share by family: " + ", ".join(f"{f} {100 * v:.1f}%" for f, v in by_family.items()))
    for c in cards:
        if c["decision"] == "dispatched" or (c["best_speedup"] or 0) > 1:
            print(f"  {c['op'][:60]:60s} {c['decision']:10s} {c['best_speedup'] or 0:.2f}x  {c['reason'][:60]}")


if __name__ == "__main__":
    main()
