"""KernelBench problems through kforge, against eager and torch.compile, measured KernelBench's
way (fast_p: the fraction of problems that are correct and faster than the baseline by more
than a factor p), in one process with every variant interleaved.

    python bench/kernelbench.py --kernelbench ~/KernelBench --level 1 --skip-vendor \
        --max-bytes 1e9 --out bench/results/kernelbench_l1_h200.json

--kernelbench is a checkout of ScalingIntelligence/KernelBench (not copied into this
repository; bench/README.md says how to get one): the directory holding KernelBench/level1/
or that level directory's parent. Each problem file defines Model, get_inputs() and
get_init_inputs(). A problem whose inputs exceed --max-bytes has its module-level
`batch_size` halved until they fit; the scale
is recorded. Each problem is searched with `kforge run` (built-in proposer unless
--proposer llm), then timed: eager, torch.compile, the package through `pkg.apply()`, and
`kforge.optimize` / `kforge.compile` where the package has kernels for them. Correct means
the package's output matches eager within KernelBench's tolerance (atol = rtol = 1e-2) on
KernelBench's own inputs, after kforge's own checks passed during the search.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

# Matmul, convolution and attention: cuBLAS/cuDNN work that the built-in proposer leaves to
# the vendor (issue scope: the level-1 problems that are not these).
VENDOR = re.compile(r"matmul|matrix_multiplication|matrix_vector|conv|attention|gemm|bmm|linear", re.I)
KB_ATOL = KB_RTOL = 1e-2
FAST_P = (0.0, 1.0, 1.5, 2.0)


@dataclass
class Problem:
    name: str
    path: Path
    module: types.ModuleType
    scale: float = 1.0  # batch scale applied to fit --max-bytes (1.0: as written)
    notes: list[str] = field(default_factory=list)


def problem_files(root: Path, level: int) -> list[Path]:
    """The problem files of a level, in KernelBench's numeric order."""
    for d in (root / "KernelBench" / f"level{level}", root / f"level{level}"):
        if d.is_dir():
            number = re.compile(r"^(\d+)_")
            return sorted(d.glob("*.py"), key=lambda p: (int(number.match(p.name).group(1)) if number.match(p.name)
                                                          else 10**9, p.name))
    raise SystemExit(f"no KernelBench level{level}/ under {root}: pass the KernelBench checkout")


def select(files: list[Path], names: list[str] | None, skip_vendor: bool) -> list[Path]:
    out = []
    for f in files:
        if skip_vendor and VENDOR.search(f.stem):
            continue
        if names and not any(n == f.stem.split("_")[0] or n.lower() in f.stem.lower() for n in names):
            continue
        out.append(f)
    return out


def load_problem(path: Path) -> Problem:
    module = types.ModuleType(f"kernelbench_{path.stem}")
    module.__file__ = str(path)
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)  # noqa: S102 (the user's own checkout)
    for need in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(module, need):
            raise ValueError(f"{path.name} defines no {need}")
    return Problem(path.stem, path, module)


def _bytes(inputs: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))


def _input_meta(problem: Problem) -> list[Any]:
    """get_inputs() evaluated on the meta device: the sizes without allocating them."""
    with torch.device("meta"):
        return list(problem.module.get_inputs())


def fit(problem: Problem, max_bytes: float) -> Problem:
    """Halve the problem's batch until its inputs fit in max_bytes (recorded in .scale)."""
    g = problem.module.__dict__
    knob = "batch_size" if isinstance(g.get("batch_size"), int) else None
    size = _bytes(_input_meta(problem))
    if size <= max_bytes:
        return problem
    if knob is None:
        problem.notes.append(f"inputs {size / 1e6:.0f} MB over the limit and no batch global to scale: skipped")
        problem.scale = 0.0
        return problem
    original = g[knob]
    while size > max_bytes and g[knob] > 1:
        g[knob] = max(1, g[knob] // 2)
        size = _bytes(_input_meta(problem))
    problem.scale = g[knob] / original
    problem.notes.append(f"{knob} {original} -> {g[knob]} to fit {max_bytes / 1e6:.0f} MB")
    if size > max_bytes:
        problem.notes.append(f"still {size / 1e6:.0f} MB at {knob}=1: skipped")
        problem.scale = 0.0
    return problem


def fast_p(rows: list[dict], baseline: str, ps=FAST_P) -> dict[str, float]:
    """KernelBench's fast_p over problems: correct and speedup over `baseline` > p."""
    n = len(rows)
    out = {}
    for p in ps:
        ok = [r for r in rows if r.get("correct") and (r.get(f"speedup_vs_{baseline}") or 0.0) > p]
        out[f"fast_{p:g}"] = len(ok) / n if n else 0.0
    return out


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(rows: list[dict]) -> dict:
    timed = [r for r in rows if "kforge_us" in r]
    return {
        "problems": len(rows), "timed": len(timed),
        "with_dispatched_kernel": sum(1 for r in rows if r.get("dispatched", 0) > 0),
        "correct": sum(1 for r in timed if r.get("correct")),
        "vs_eager": fast_p(timed, "eager"), "vs_compile": fast_p(timed, "compile"),
        "geomean_speedup_vs_eager": geomean([r.get("speedup_vs_eager") for r in timed]),
        "geomean_speedup_vs_compile": geomean([r.get("speedup_vs_compile") for r in timed]),
        "search_wall_s": sum(r.get("search_s", 0.0) for r in rows),
        "candidates": sum(r.get("candidates", 0) for r in rows),
        "llm_cost_usd": sum(r.get("llm_cost_usd", 0.0) for r in rows),
    }


def _close(got, ref) -> bool:
    from kforge.cards import flatten_outputs

    return all(torch.allclose(g.float(), r.float(), atol=KB_ATOL, rtol=KB_RTOL)
               for g, r in zip(flatten_outputs(got), flatten_outputs(ref)))


def run_problem(problem: Problem, args, device: str) -> dict:
    import kforge
    from kforge import timing
    from kforge.store import LLMUsage, SQLiteStore

    m = problem.module
    torch.manual_seed(0)
    model = m.Model(*m.get_init_inputs()).to(device).eval()
    inputs = [t.to(device) if isinstance(t, torch.Tensor) else t for t in m.get_inputs()]
    row: dict[str, Any] = {"problem": problem.name, "scale": problem.scale, "notes": problem.notes,
                           "input_mb": _bytes(inputs) / 1e6}
    run_dir = Path(tempfile.mkdtemp(prefix=f"kb-{problem.name[:20]}-"))
    t0 = time.perf_counter()
    result = kforge.run(model, tuple(inputs), out=run_dir / "p.cast", run_dir=run_dir, proposer=args.proposer,
                        iterations=args.iterations, wall_time_s=args.wall_time, progress=False, check_model=False,
                        model_name=problem.name, include_vendor=args.include_vendor)
    row["search_s"] = time.perf_counter() - t0
    with SQLiteStore(run_dir, readonly=True) as log:  # one run: the problem's own directory
        llm = sum(log.llm_usage(result.run_id).values(), LLMUsage())
        row["candidates"] = log.activity(result.run_id)[0]
    row["llm_cost_usd"], row["llm_tokens"] = llm.cost_usd, llm.tokens
    if result.package_path is None:
        row["error"] = result.message or "no package written"
        return row
    pkg = kforge.load(result.package_path)
    row["dispatched"] = sum(1 for c in pkg.cards if c.dispatched)
    row["cards"] = len(pkg.cards)

    def fwd(mod):
        with torch.inference_mode():
            return mod(*inputs)

    ref = fwd(model)
    with pkg.apply():
        got = fwd(model)
    row["correct"] = _close(got, ref)
    compiled = torch.compile(model)
    fwd(compiled)
    entries = [("eager", contextlib.nullcontext, lambda: fwd(model)),
               ("compile", contextlib.nullcontext, lambda: fwd(compiled)),
               ("kforge", pkg.apply, lambda: fwd(model))]
    for name, make in (("kforge_optimize", lambda: kforge.optimize(model, pkg)),
                       ("kforge_compile", lambda: kforge.compile(model, pkg))):
        try:
            variant = make()
            out = fwd(variant)
            row[f"{name}_correct"] = _close(out, ref)
            entries.append((name, contextlib.nullcontext, lambda v=variant: fwd(v)))
        except Exception as e:  # noqa: BLE001 (recorded: a variant that fails is a result)
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    ms = timing.time_as_called([(ctx, fn) for _, ctx, fn in entries], calls=3, rounds=10)
    for (name, _, _), meas in zip(entries, ms):
        row[f"{name}_us"] = meas.median
        row[f"{name}_iqr_us"] = meas.iqr
    best = min(row["kforge_us"], *(row[f"{n}_us"] for n in ("kforge_optimize", "kforge_compile")
                                   if f"{n}_us" in row and row.get(f"{n}_correct")))
    row["best_kforge_us"] = best
    row["speedup_vs_eager"] = row["eager_us"] / best
    row["speedup_vs_compile"] = row["compile_us"] / best
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernelbench", type=Path, required=True, help="a KernelBench checkout")
    ap.add_argument("--level", type=int, choices=(1, 2, 3), required=True)
    ap.add_argument("--problems", nargs="*", help="problem numbers or name parts (default: all)")
    ap.add_argument("--skip-vendor", action="store_true", help="leave out matmul, convolution and attention problems")
    ap.add_argument("--include-vendor", action="store_true", help="let kforge search vendor-backed cards too")
    ap.add_argument("--max-bytes", type=float, default=1e9, help="input bytes per problem; larger batches are halved")
    ap.add_argument("--proposer", default="builtin")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--wall-time", type=float, default=30.0, help="search seconds per problem")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    files = select(problem_files(args.kernelbench, args.level), args.problems, args.skip_vendor)
    head = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "level": args.level, "proposer": args.proposer, "iterations": args.iterations,
            "wall_time_s": args.wall_time, "max_bytes": args.max_bytes, "command": " ".join(sys.argv)}
    rows: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for f in files:
        try:
            problem = fit(load_problem(f), args.max_bytes)
            row = run_problem(problem, args, device) if problem.scale > 0 else {
                "problem": problem.name, "notes": problem.notes, "error": "too large"}
        except Exception as e:  # noqa: BLE001 (one problem's failure is a row, not the end of the run)
            row = {"problem": f.stem, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("problem", "dispatched", "correct", "speedup_vs_eager",
                                                   "speedup_vs_compile", "error")}), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        # Written after every problem: a run cut short by its time limit keeps what it measured.
        out = {**head, "summary": summarize(rows), "problems": rows, "of": len(files)}
        args.out.write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps(summarize(rows), indent=1))


if __name__ == "__main__":
    main()
