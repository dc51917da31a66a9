"""KernelBench problems through kforge, against eager and torch.compile, measured KernelBench's
way (fast_p: the fraction of problems that are correct and faster than the baseline by more
than a factor p), in one process with every variant interleaved.

    python bench/kernelbench.py --kernelbench ~/KernelBench --level 2 --regions --time-budget 390 \
        --out bench/results/kernelbench_l2_h200.json

--kernelbench is a checkout of ScalingIntelligence/KernelBench (not copied into this
repository; bench/README.md says how to get one): the directory holding KernelBench/level1/
or that level directory's parent. Each problem file defines Model, get_inputs() and
get_init_inputs(). Without --problems a level runs its default list (DEFAULT_PROBLEMS);
`--problems all` takes every file of the level. A problem whose inputs exceed --max-bytes has
its module-level `batch_size` halved until they fit; the scale is recorded. Each problem is
searched with `kforge run` (built-in proposer unless --proposer llm; --regions adds fused
region cards, vendor ops with their epilogue among them), then timed in one process,
interleaved: eager, torch.compile, the package through `pkg.apply()`, `kforge.optimize` and
`kforge.compile`. The model check `kforge run` makes for a user runs too, after the search and
counted as the problem's overhead (--no-model-check skips it), so kforge.compile follows its
verdict: plain torch.compile where the problem was slower with the package's kernels in its graphs. Correct means the package's output matches eager within KernelBench's
tolerance (atol = rtol = 1e-2) on KernelBench's inputs and on a second, fresh set of them,
after kforge's own checks passed during the search. --time-budget is shared by the problems
(Budget); the result file is rewritten after every problem, so a run cut short keeps what it
measured, and problems the budget did not reach are rows that say so (they count as not fast).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from provenance import provenance

# Matmul, convolution and attention: cuBLAS/cuDNN work that the built-in proposer leaves to
# the vendor (issue scope: the level-1 problems that are not these).
VENDOR = re.compile(r"matmul|matrix_multiplication|matrix_vector|conv|attention|gemm|bmm|linear", re.I)
KB_ATOL = KB_RTOL = 1e-2
FAST_P = (0.0, 1.0, 1.5, 2.0)

# What a level runs by default (problem numbers). Level 1: every problem that is not a matmul,
# a convolution (50) or attention (97): activations, softmax, norms, pooling, reductions,
# scans, losses. Level 2: a matmul or convolution followed by pointwise work and a
# normalization or reduction (batch/group/instance norm, softmax, logsumexp, sum), with inputs
# of tens to hundreds of MB (the ConvTranspose problems move GBs a call: too long to time here).
# Level 3: the small whole models: MLP, ResNet basic block, ResNet-18, MobileNet V1 and V2,
# MinGPT block.
DEFAULT_PROBLEMS = {
    1: (*range(19, 50), 51, 52, 53, *range(88, 97), 98, 99, 100),
    2: (9, 12, 14, 17, 21, 23, 30, 33, 37, 41, 52, 53, 62, 73, 76, 84, 88, 92, 97),
    3: (1, 8, 9, 19, 20, 44),
}


@dataclass
class Problem:
    name: str
    path: Path
    module: types.ModuleType
    scale: float = 1.0  # the inputs' scale applied to fit --max-bytes (1.0: as written)
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
    """The files named (a number names one problem, any other text the problems whose name
    contains it; None or ["all"]: every file), less the vendor ones with skip_vendor."""
    names = None if names in (None, [], ["all"]) else [str(n) for n in names]
    out = []
    for f in files:
        if skip_vendor and VENDOR.search(f.stem):
            continue
        if names and not any(n == f.stem.split("_")[0] if n.isdigit() else n.lower() in f.stem.lower()
                             for n in names):
            continue
        out.append(f)
    return out


def shard(files: list[Path], spec: str | None) -> list[Path]:
    """Every n-th file from the k-th, for spec "k/n" (k from 0): shards of one list, run on
    several GPUs or in several device calls, that bench/scoreboard.py joins again."""
    if not spec:
        return files
    m = re.fullmatch(r"(\d+)/(\d+)", spec)
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise SystemExit(f"--shard {spec}: give k/n with 0 <= k < n, e.g. 0/2")
    k, n = int(m.group(1)), int(m.group(2))
    return files[k::n]


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
    original, checked, tied = g[knob], not _runs(problem), []
    while size > max_bytes and g[knob] > 1:
        old = g[knob]
        g[knob] = max(1, old // 2)
        _retie(g, tied, old, g[knob])
        if not checked:  # at the first halving: does the model still run?
            checked = True
            if not _runs(problem):  # another size equals the batch by design (a square problem)
                tied = _tied(g, knob, old)
                _retie(g, tied, old, g[knob])
        before, size = size, _bytes(_input_meta(problem))
        if size == before:  # get_inputs() reads a shape computed from batch_size at import
            problem.notes.append(f"inputs {size / 1e6:.0f} MB over the limit and {knob} does not size them: skipped")
            problem.scale = 0.0
            return problem
    problem.scale = g[knob] / original
    problem.notes.append(f"{knob} {original} -> {g[knob]} to fit {max_bytes / 1e6:.0f} MB")
    if tied:
        problem.notes.append(f"{', '.join(tied)} equal to {knob} and scaled with it (the model needs them equal)")
    if size > max_bytes:
        size = _fit_channels(problem, max_bytes, size)
    if size > max_bytes:
        problem.notes.append(f"still {size / 1e6:.0f} MB at {knob}=1: skipped")
        problem.scale = 0.0
    return problem


def _fit_channels(problem: Problem, max_bytes: float, size: int) -> int:
    """At batch 1 (the inputs `size` bytes), halve a `channels` global too (the 3-D and large 2-D
    poolings), where the model still runs with fewer; the inputs' bytes afterwards."""
    g = problem.module.__dict__
    original = g.get("channels")
    if not isinstance(original, int) or isinstance(original, bool):
        return size
    before = size
    while size > max_bytes and g["channels"] > 1:
        g["channels"] //= 2
        size = _bytes(_input_meta(problem))
    if g["channels"] == original or not _runs(problem):
        g["channels"] = original
        return before
    problem.scale *= g["channels"] / original
    problem.notes.append(f"channels {original} -> {g['channels']} as well")
    return size


def _runs(problem: Problem) -> bool:
    """Whether the problem's model runs on its inputs, on the meta device (no memory, no time)."""
    m = problem.module
    try:
        with torch.device("meta"), torch.no_grad():
            m.Model(*m.get_init_inputs())(*m.get_inputs())
        return True
    except Exception:  # noqa: BLE001 (ops without a meta kernel count as not known to run)
        return False


def _tied(g: dict, knob: str, value: int) -> list[str]:
    """The module globals other than `knob` that hold `value`: an int, or a tuple of ints with it."""
    def holds(v: Any) -> bool:
        if isinstance(v, tuple):
            return value in v and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        return isinstance(v, int) and not isinstance(v, bool) and v == value
    return [name for name, v in g.items() if name != knob and not name.startswith("_") and holds(v)]


def _retie(g: dict, names: list[str], old: int, new: int) -> None:
    for name in names:
        v = g[name]
        g[name] = tuple(new if x == old else x for x in v) if isinstance(v, tuple) else new


@dataclass
class Budget:
    """--time-budget shared by the problems: each one's search gets an equal part of what is
    left, less the time a problem spends outside its search (build, capture, torch.compile,
    timing: the mean over the problems done so far, `overhead_s` before the first), at most
    at least `min_search_s` and at most `cap_s` (--wall-time). No budget: every search gets cap_s."""
    total_s: float | None
    cap_s: float
    overhead_s: float = 15.0
    min_search_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    start: float = field(default=0.0)
    overheads: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def overhead(self) -> float:
        return sum(self.overheads) / len(self.overheads) if self.overheads else self.overhead_s

    def search_s(self, left: int) -> float | None:
        """Search seconds for the next problem (`left` problems still to start, this one
        included), or None when what is left would not cover its overhead and a minimal search."""
        if self.total_s is None:
            return self.cap_s
        remaining = self.total_s - (self.clock() - self.start)
        if remaining < self.overhead() + self.min_search_s:
            return None
        return min(self.cap_s, max(self.min_search_s, remaining / left - self.overhead()))

    def record(self, total_s: float, search_s: float) -> None:
        self.overheads.append(max(0.0, total_s - search_s))


def fast_p(rows: list[dict], baseline: str, ps=FAST_P) -> dict[str, float]:
    """KernelBench's fast_p over problems: correct and speedup over `baseline` > p. Every row
    counts: a problem that failed or was not run is not fast."""
    n = len(rows)
    out = {}
    for p in ps:
        ok = [r for r in rows if r.get("correct") and (r.get(f"speedup_vs_{baseline}") or 0.0) > p]
        out[f"fast_{p:g}"] = len(ok) / n if n else 0.0
    return out


def beyond_noise(rows: list[dict], baseline: str) -> float:
    """The share of problems correct and faster than `baseline` by more than the noise: the
    baseline's median less kforge's best exceeds the larger of the two interquartile ranges."""
    def faster(r: dict) -> bool:
        best, base = r.get("best_kforge_us"), r.get(f"{baseline}_us")
        if not r.get("correct") or best is None or base is None:
            return False
        iqr = next((r.get(f"{v}_iqr_us") or 0.0 for v in ("eager", "compile", *VARIANTS) if r.get(f"{v}_us") == best),
                   0.0)
        return base - best > max(iqr, r.get(f"{baseline}_iqr_us") or 0.0)
    return sum(map(faster, rows)) / len(rows) if rows else 0.0


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


VARIANTS = ("kforge", "kforge_optimize", "kforge_compile")  # pkg.apply(), kforge.optimize, kforge.compile


def summarize(rows: list[dict]) -> dict:
    timed = [r for r in rows if "kforge_us" in r]
    return {
        "problems": len(rows), "timed": len(timed),
        "with_dispatched_kernel": sum(1 for r in rows if r.get("dispatched", 0) > 0),
        "correct": sum(1 for r in timed if r.get("correct")),
        "vs_eager": fast_p(rows, "eager"), "vs_compile": fast_p(rows, "compile"),
        "beyond_noise": {"eager": beyond_noise(rows, "eager"), "compile": beyond_noise(rows, "compile")},
        "geomean_speedup_vs_eager": geomean([r.get("speedup_vs_eager") for r in timed]),
        "geomean_speedup_vs_compile": geomean([r.get("speedup_vs_compile") for r in timed]),
        # Each kforge variant on its own against eager (the speedups above take the best correct one).
        "geomean_vs_eager_by_variant": {v: geomean([r["eager_us"] / r[f"{v}_us"] for r in timed
                                                    if f"{v}_us" in r and r.get(f"{v}_correct")]) for v in VARIANTS},
        "search_wall_s": sum(r.get("search_s", 0.0) for r in rows),
        "candidates": sum(r.get("candidates", 0) for r in rows),
        "llm_tokens": sum(r.get("llm_tokens", 0) for r in rows),
        "llm_cost_usd": sum(r.get("llm_cost_usd", 0.0) for r in rows),
    }


def _close(got, ref) -> bool:
    from kforge.cards import flatten_outputs

    return all(torch.allclose(g.float(), r.float(), atol=KB_ATOL, rtol=KB_RTOL)
               for g, r in zip(flatten_outputs(got), flatten_outputs(ref)))


def _inputs(m: types.ModuleType, seed: int, device: str) -> list[Any]:
    torch.manual_seed(seed)
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in m.get_inputs()]


def _search_counts(run_dir: Path) -> dict:
    from kforge.store import LLMUsage, SQLiteStore

    with SQLiteStore(run_dir, readonly=True) as log:  # one run: the problem's own directory
        run_id = log.latest_run()
        llm = sum(log.llm_usage(run_id).values(), LLMUsage())
        # Each candidate's verdict and times: why a card fell back, without the run directory.
        tried = [{"card": c.card_id[:12], "knobs": c.knobs, "verdict": c.verdict, "eager_us": c.eager_us,
                  "kernel_us": c.kernel_us, "dispatched_us": c.dispatched_us,
                  "eager_dispatched_us": ((c.evidence or {}).get("eager_dispatched") or {}).get("median_us"),
                  "message": c.message[:160]}
                 for c in log.candidates(run_id)]
        return {"candidates": log.activity(run_id)[0], "llm_cost_usd": llm.cost_usd, "llm_tokens": llm.tokens,
                "tried": tried}


def run_problem(problem: Problem, args, device: str, search_s: float, workers=None) -> dict:
    """Build, search (search_s seconds at most), check and time one problem: its result row.
    workers: kforge.run's evaluator_factory (main() keeps one worker process for every problem)."""
    import kforge
    from kforge import timing

    m = problem.module
    row: dict[str, Any] = {"problem": problem.name, "scale": problem.scale, "notes": problem.notes,
                           "search_budget_s": round(search_s, 1)}
    try:
        torch.manual_seed(0)
        model = m.Model(*m.get_init_inputs()).to(device).eval()
        inputs = _inputs(m, 0, device)
    except Exception as e:  # noqa: BLE001 (a problem that does not build is a result row)
        row["error"] = f"does not build: {type(e).__name__}: {str(e)[:300]}"
        return row
    fresh = _inputs(m, 1, device)  # KernelBench checks on inputs the search never saw
    row["input_mb"] = _bytes(inputs) / 1e6
    t0 = time.perf_counter()

    def search(regions: bool):
        run_dir = Path(tempfile.mkdtemp(prefix=f"kb-{problem.name[:20]}-"))
        row["run_dir"] = str(run_dir)  # the search log and cards, for kforge inspect / the dashboard
        return run_dir, kforge.run(model, tuple(inputs), out=run_dir / "p.cast", run_dir=run_dir,
                                   proposer=args.proposer, iterations=args.iterations, wall_time_s=search_s,
                                   progress=False, check_model=False, model_name=problem.name,
                                   include_vendor=args.include_vendor, regions=regions, evaluator_factory=workers)
    try:
        run_dir, result = search(args.regions)
    except Exception as e:  # noqa: BLE001 (a model the region tracer cannot take still has its op cards)
        if not args.regions:
            raise
        row["notes"].append(f"regions left out: {type(e).__name__}: {str(e)[:200]}")
        run_dir, result = search(False)
    row["search_s"] = time.perf_counter() - t0
    row.update(_search_counts(run_dir))
    if result.package_path is None:
        row["error"] = result.message or "no package written"
        return row
    pkg = kforge.load(result.package_path)
    if args.model_check and any(c.compiled for c in pkg.cards):
        pkg = _check_model(model, inputs, pkg, row)
    regions = [c for c in pkg.cards if c.card.region is not None]
    row["cards"], row["region_cards"] = len(pkg.cards), len(regions)
    row["dispatched"] = sum(1 for c in pkg.cards if c.dispatched)  # region cards run through kforge.optimize
    row["regions_dispatched"] = sum(1 for c in regions if c.dispatched)
    row["compiled"] = sum(1 for c in pkg.cards if c.compiled)
    row["card_decisions"] = card_decisions(pkg)
    check = (pkg.manifest or {}).get("model_check") or {}
    if check:  # kforge.compile follows it: plain torch.compile where it found the kernels slower
        row["model_check"] = {k: check.get(k) for k in ("verdict", "use", "torch_compile_us", "kforge_compile_us", "drop")}

    def fwd(mod, xs=inputs):
        with torch.inference_mode():
            return mod(*xs)

    refs = (fwd(model), fwd(model, fresh))

    def correct(mod, ctx=contextlib.nullcontext) -> bool:
        with ctx():
            return all(_close(fwd(mod, xs), ref) for xs, ref in zip((inputs, fresh), refs))

    row["correct"] = row["kforge_correct"] = correct(model, pkg.apply)
    entries = [("eager", contextlib.nullcontext, lambda: fwd(model)),
               ("kforge", pkg.apply, lambda: fwd(model))]
    makers = [("compile", lambda: torch.compile(model))]
    # Without a kernel to put in, kforge.optimize is the traced model and kforge.compile is
    # torch.compile: their build and timing time goes to the other problems' searches instead.
    if row["dispatched"]:
        makers.append(("kforge_optimize", lambda: kforge.optimize(model, pkg)))
    if row["compiled"] and check.get("use") != "torch.compile":  # else kforge.compile is torch.compile (score)
        makers.append(("kforge_compile", lambda: kforge.compile(model, pkg)))
    for name, make in makers:
        t1 = time.perf_counter()
        try:
            variant = make()
            for _ in range(3):  # compiled on the first call; warm afterwards
                fwd(variant)
            row[f"{name}_correct"] = correct(variant)
            entries.append((name, contextlib.nullcontext, lambda v=variant: fwd(v)))
        except Exception as e:  # noqa: BLE001 (recorded: a variant that fails is a result)
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row[f"{name}_build_s"] = round(time.perf_counter() - t1, 2)
    ms = timing.time_as_called([(ctx, fn) for _, ctx, fn in entries], calls=3, rounds=10)
    for (name, _, _), meas in zip(entries, ms):
        row[f"{name}_us"] = meas.median
        row[f"{name}_iqr_us"] = meas.iqr
    return score(row)


def _check_model(model, inputs: list, pkg, row: dict):
    """kforge run's model check, run here so that its time counts as the problem's overhead and
    not as search: the whole problem with the package's kernels under kforge.compile against
    torch.compile; the verdict goes into the package, which kforge.compile then follows."""
    import kforge
    from kforge.package import check_package

    t0 = time.perf_counter()
    try:
        if check_package(model, tuple(inputs), pkg).compile_record() is not None:
            pkg = kforge.load(pkg.path)  # with the verdict it now records
    except Exception as e:  # noqa: BLE001 (the problem is still timed, with kforge.compile unchecked)
        row["notes"].append(f"model check failed: {type(e).__name__}: {str(e)[:200]}")
    row["model_check_s"] = round(time.perf_counter() - t0, 2)
    return pkg


def card_decisions(pkg, most: int = 24) -> list[dict]:
    """Why each card that is not a view ships or not, in the package's own words, largest share
    first: the evidence for what to improve next, kept next to the numbers."""
    cards = sorted((c for c in pkg.cards if c.card.family != "view"), key=lambda c: -(c.card.share or 0.0))
    return [{"card": " > ".join(op.split("::")[-1] for op in (c.card.region.ops if c.card.region else [c.card.op])),
             "share": c.card.share, "eager": c.decision, "reason": c.reason[:200],
             "compiled": c.compile_decision, "compile_reason": (c.compile_reason or "")[:200]} for c in cards[:most]]


def score(row: dict) -> dict:
    """The row's best kforge time and its speedups. The fastest correct way kforge runs the
    problem (pkg.apply() when none is correct: the row says incorrect); where the package
    ships no kernel at all, kforge runs eager's own calls, so its time is eager's: timing the
    same calls twice would count noise as a speedup (fast_1) or a slowdown. Likewise, where the
    model check sent kforge.compile to plain torch.compile, its time is torch.compile's."""
    plain = (row.get("model_check") or {}).get("use") == "torch.compile"
    if not row.get("dispatched") and (not row.get("compiled") or plain):
        times = [row["eager_us"]]  # no kernel runs: pkg.apply() is eager's calls
    else:
        times = [row[f"{v}_us"] for v in VARIANTS if f"{v}_us" in row and row.get(f"{v}_correct")]
    if row.get("compiled") and plain and row.get("compile_correct"):
        times.append(row["compile_us"])  # the model check sent kforge.compile to plain torch.compile
    best = min(times, default=row["kforge_us"])
    row["best_kforge_us"] = best
    row["speedup_vs_eager"] = row["eager_us"] / best
    row["speedup_vs_compile"] = row["compile_us"] / best if "compile_us" in row else None
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernelbench", type=Path, required=True, help="a KernelBench checkout")
    ap.add_argument("--level", type=int, choices=(1, 2, 3), required=True)
    ap.add_argument("--problems", nargs="*", help="problem numbers or name parts, or 'all' (default: the level's list)")
    ap.add_argument("--shard", help="k/n: run every n-th problem of the list from the k-th (k from 0)")
    ap.add_argument("--skip-vendor", action="store_true", help="leave out matmul, convolution and attention problems")
    ap.add_argument("--include-vendor", action="store_true", help="let kforge search vendor-backed cards too")
    ap.add_argument("--regions", action="store_true", help="also search fused regions (kforge.run(regions=True))")
    ap.add_argument("--no-model-check", dest="model_check", action="store_false",
                    help="skip kforge run's model check (kforge.compile then places every kernel, even where the "
                         "whole problem is slower with them than under plain torch.compile)")
    ap.add_argument("--max-bytes", type=float, default=1e9, help="input bytes per problem; larger batches are halved")
    ap.add_argument("--proposer", default="builtin")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--wall-time", type=float, default=30.0, help="search seconds per problem, at most")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the whole run, shared by the problems (their searches shrink to fit)")
    ap.add_argument("--overhead", type=float, default=15.0,
                    help="first guess at a problem's seconds outside its search (then measured)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    listed = select(problem_files(args.kernelbench, args.level),
                    args.problems if args.problems else list(DEFAULT_PROBLEMS[args.level]), args.skip_vendor)
    files = shard(listed, args.shard)
    head = {**provenance(), "level": args.level, "proposer": args.proposer, "regions": args.regions,
            "iterations": args.iterations, "wall_time_s": args.wall_time, "time_budget_s": args.time_budget,
            "max_bytes": args.max_bytes, "shard": args.shard, "problem_list": [f.stem for f in listed]}
    budget = Budget(args.time_budget, args.wall_time, overhead_s=args.overhead)
    rows: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        out = {**head, "summary": summarize(rows), "problems": rows, "of": len(files)}
        args.out.write_text(json.dumps(out, indent=1, default=str))

    from kforge.evaluate import KeptEvaluators

    # One worker process for every problem: a fresh one per problem cost its Python start, CUDA
    # context and Inductor's first compile (the per-card torch.compile baseline) each time.
    with KeptEvaluators() as workers:
        for i, f in enumerate(files):
            if not _one(i, f, files, args, device, budget, rows, workers):
                break
            write()  # after every problem: a run cut short by its time limit keeps what it measured
    write()
    print(json.dumps(summarize(rows), indent=1))


def _one(i: int, f: Path, files: list[Path], args, device: str, budget: Budget, rows: list[dict], workers) -> bool:
    """Run problem `f` (the i-th of `files`) into `rows`; False when the time budget is spent."""
    search_s = budget.search_s(len(files) - i)
    if search_s is None:
        rows += [{"problem": g.stem, "error": "not run: time budget spent"} for g in files[i:]]
        return False
    t0 = time.monotonic()
    try:
        problem = fit(load_problem(f), args.max_bytes)
        row = run_problem(problem, args, device, search_s, workers) if problem.scale > 0 else {
            "problem": problem.name, "notes": problem.notes, "error": "too large"}
    except Exception as e:  # noqa: BLE001 (one problem's failure is a row, not the end of the run)
        row = {"problem": f.stem, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    row["wall_s"] = round(time.monotonic() - t0, 1)
    budget.record(row["wall_s"], row.get("search_s", 0.0))
    rows.append(row)
    print(json.dumps({k: row.get(k) for k in ("problem", "wall_s", "dispatched", "correct", "speedup_vs_eager",
                                               "speedup_vs_compile", "error")}), flush=True)
    if device == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()  # the problem's compiled graphs go with it
    return True


if __name__ == "__main__":
    main()
