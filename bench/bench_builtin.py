"""Built-in templates vs eager and torch.compile on the benchmark shapes (run on the GPU).

For each card: a hill-climbing knob sweep with the BuiltinProposer (default first, then
revisions of the best so far, at most --budget candidates, each checked against eager
before it is timed), then eager, torch.compile and the best kernel timed together with
kforge.timing.time_fns (L2 flushed before every rep, one event pair per rep), and the
HBM floor (bytes a kernel must move / 4.27 TB/s).

    python bench/bench_builtin.py [--out bench/results/builtin_h200.json] [--budget 50] [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests")]

from builtin_cards import (A, BF16, F16, F32, bn, fresh_inputs, gn, ln, make_card, meta, rms, softmax,  # noqa: E402
                           softmax_to)
from kforge import baseline, compiler, runtime, timing, tolerance, validate  # noqa: E402
from kforge.cards import empty_like_meta, faithful_clone  # noqa: E402
from kforge.errors import KforgeError, ProposerError  # noqa: E402
from kforge.hardware import current  # noqa: E402
from kforge.proposers.base import ProposalContext, Tried  # noqa: E402
from kforge.proposers.builtin import TEMPLATES, BuiltinProposer  # noqa: E402
from kforge.proposers.builtin.proposer import template_for  # noqa: E402
from kforge.verdict import EvalResult, Verdict  # noqa: E402
from provenance import provenance  # noqa: E402

BIG = (8192, 11008)
# name -> (card factory, target): ("speedup", x) vs eager, or ("floor", fraction of the HBM floor).
CASES = {
    # The targets and the paper's ops first: a run cut short by its time limit keeps them.
    "group_norm 1x512x128x128 bf16": (lambda: gn(1, 512, 128, 128, 32, BF16), ("speedup", 8.0)),
    "group_norm 1x128x512x512 fp32": (lambda: gn(1, 128, 512, 512, 32, F32), ("speedup", 6.0)),
    "adaptive_avg_pool2d 32x2048x7x7 fp32": (lambda: make_card(A._adaptive_avg_pool2d.default, meta(32, 2048, 7, 7), [1, 1]), ("speedup", 3.0)),
    "softmax 8x262144 fp32": (lambda: softmax(8, 262144), ("speedup", 8.0)),
    "softmax 1x8x2048x2048 bf16": (lambda: softmax(1, 8, 2048, 2048, dtype=BF16), ("speedup", 2.0)),
    "layer_norm 8192x4096 bf16": (lambda: ln(8192, 4096, BF16), ("floor", 0.8)),
    "rms_norm 8192x4096 bf16": (lambda: rms(8192, 4096, BF16), ("floor", 0.8)),
    "softmax 1x8x2048x2048 fp32 (gemma attention)": (lambda: softmax(1, 8, 2048, 2048), None),
    "softmax 1024x128 fp32 (qwen-moe router)": (lambda: softmax(1024, 128), None),
    # The paper's two softmax ops as the models call them: F.softmax(bf16, dtype=torch.float32),
    # one card for eager's cast and softmax (kforge.composite).
    "softmax.int 1x8x2048x2048 bf16->fp32 (gemma attention)": (lambda: softmax_to(1, 8, 2048, 2048), None),
    "softmax.int 1024x128 bf16->fp32 (qwen-moe router)": (lambda: softmax_to(1024, 128), None),
    # ResNet-50 in bf16: cuDNN does not take bf16 batch norm, so eager runs its own kernels.
    "batch_norm 32x64x112x112 bf16 (resnet-50)": (lambda: bn(meta(32, 64, 112, 112, dtype=BF16)), None),
    "batch_norm 32x256x56x56 bf16 (resnet-50)": (lambda: bn(meta(32, 256, 56, 56, dtype=BF16)), None),
    "batch_norm 32x2048x7x7 bf16 (resnet-50)": (lambda: bn(meta(32, 2048, 7, 7, dtype=BF16)), None),
    # fp32 batch norm goes to cuDNN.
    "batch_norm 32x256x56x56 fp32 (resnet-50, cudnn_batch_norm)": (
        lambda: bn(meta(32, 256, 56, 56), op=A.cudnn_batch_norm.default), None),
    "batch_norm 32x2048x7x7 fp32 (resnet-50, cudnn_batch_norm)": (
        lambda: bn(meta(32, 2048, 7, 7), op=A.cudnn_batch_norm.default), None),
    # The casts around Gemma's fp32 softmax (F.softmax(x, dtype=torch.float32).to(bf16)).
    "_to_copy 1x8x2048x2048 bf16->fp32": (lambda: make_card(A._to_copy.default, meta(1, 8, 2048, 2048, dtype=BF16), dtype=F32), None),
    "_to_copy 1x8x2048x2048 fp32->bf16": (lambda: make_card(A._to_copy.default, meta(1, 8, 2048, 2048), dtype=BF16), None),
    "group_norm 2x512x64x64 fp16": (lambda: gn(2, 512, 64, 64, 32, F16), None),
    "adaptive_avg_pool2d 1x2048x7x7 fp32": (lambda: make_card(A._adaptive_avg_pool2d.default, meta(1, 2048, 7, 7), [1, 1]), None),
    "adaptive_avg_pool2d 128x2048x7x7 bf16": (lambda: make_card(A._adaptive_avg_pool2d.default, meta(128, 2048, 7, 7, dtype=BF16), [1, 1]), None),
    "softmax 1x8x1024x1024 fp32": (lambda: softmax(1, 8, 1024, 1024), None),
    "softmax 4096x256 fp32": (lambda: softmax(4096, 256), None),
    "softmax 16384x128 fp32": (lambda: softmax(16384, 128), None),
    "silu 8192x11008 bf16": (lambda: make_card(A.silu.default, meta(*BIG, dtype=BF16)), None),
    "mul 8192x11008 bf16": (lambda: make_card(A.mul.Tensor, meta(*BIG, dtype=BF16), meta(*BIG, dtype=BF16)), None),
    "gelu tanh 8192x11008 bf16": (lambda: make_card(A.gelu.default, meta(*BIG, dtype=BF16), approximate="tanh"), None),
    "add_ 8192x11008 bf16": (lambda: make_card(A.add_.Tensor, meta(*BIG, dtype=BF16), meta(*BIG, dtype=BF16)), None),
    "relu 32x256x56x56 fp32": (lambda: make_card(A.relu.default, meta(32, 256, 56, 56)), None),
}
SWEEP_TIMING = dict(min_reps=20, min_ms=10.0, warmup_ms=3.0)  # cheap ranking; the finalists are re-timed


class Runner:
    """A candidate bound to fixed inputs and outputs: `fn()` launches it."""

    def __init__(self, card, cand, inputs):
        dev = inputs[0].device
        cubin = compiler.compile(cand.source, options=cand.plan.options).cubin
        self.plan = runtime.build_plan(cand, cubin, dev.index or 0)
        self.inputs = inputs
        self.outputs = [inputs[card.aliases[j]] if j in card.aliases else empty_like_meta(m, dev)
                        for j, m in enumerate(card.outputs)]
        self.ws = runtime.alloc_workspaces(cand.plan, dev)

    def __call__(self):
        runtime.launch(self.plan, self.inputs, self.outputs, self.ws)


def correct(card, cand, inputs) -> bool:
    mine = [faithful_clone(t) for t in inputs]
    run = Runner(card, cand, mine)
    for t in run.outputs:
        if not any(t is x for x in mine) and t.is_floating_point():  # not cuDNN's uint8 reserve
            t.fill_(float("nan"))
    run()
    ref_inputs = [faithful_clone(t) for t in inputs]
    ref = card.call_eager(ref_inputs, "cuda")
    # The product's own rule (kforge.tolerance): eager's error against float64 sets the bound.
    tols = tolerance.derive(card, [faithful_clone(t) for t in inputs], tolerance.observed(card, ref_inputs, ref))
    for j, (got, want, tol) in enumerate(zip(run.outputs, ref, tols)):
        cmp = validate.compare(got, want, tol)
        if not cmp.ok:
            print(f"    incorrect {cand.knobs}: output {j}: {cmp.failure.message}")
            return False
    return True


def survey(card, hw, templates=TEMPLATES) -> list[dict]:
    """One setting of each algorithm besides the default's, as near the default as its knob
    space allows (the widest vector, else the middle value), so a short sweep measures every
    algorithm once before it climbs from the best."""
    template = template_for(card, templates)
    first = template.default(card, hw)
    out = []
    for sp in template.spaces(card, hw):
        if sp["algo"][0] == first["algo"]:
            continue
        out.append({n: first[n] if first.get(n) in vals else vals[-1] if n == "vec" else vals[len(vals) // 2]
                    for n, vals in sp.items()})
    return out


def sweep(card, hw, inputs, budget: int, templates=TEMPLATES):
    """Hill climbing over knobs: (best candidate, its sweep time, candidates tried, what
    each measured). The default comes first, then one setting of every other algorithm,
    then revisions of the best so far. `templates`: the built-in templates to draw from."""
    proposer = BuiltinProposer(templates)
    rng = random.Random(0)
    tried: set[str] = set()
    best, best_us, n = None, float("inf"), 0
    failures: list[Tried] = []
    log: list[dict] = []
    queued = survey(card, hw, templates)
    while n < budget:
        ctx = ProposalContext(card=card, hardware=hw, parent=best and Tried(best, EvalResult(Verdict.VALID)),
                              sibling_failures=failures, tried_digests=tried, rng=rng)
        try:
            surveyed = bool(n and queued)
            if surveyed:
                cand = template_for(card, templates).build(card, queued.pop(0), hw)
                cand.plan.validate(len(card.inputs), len(card.outputs))
                if cand.digest() in tried:
                    continue
            else:
                cand = proposer.propose(ctx).candidate
        except ProposerError:
            break
        tried.add(cand.digest())
        n += 1
        try:
            ok = correct(card, cand, inputs)
            us = timing.time_fns([Runner(card, cand, [faithful_clone(t) for t in inputs])], **SWEEP_TIMING)[0].median if ok else None
            log.append({"knobs": cand.knobs, "us": us, "error": None if ok else "incorrect"})
        except KforgeError as e:
            print(f"    failed {cand.knobs}: {str(e).splitlines()[0]}")
            ok, us = False, None
            log.append({"knobs": cand.knobs, "us": None, "error": str(e).splitlines()[0][:200]})
        if not ok:
            if not surveyed:  # a failed survey entry is not a neighbour of the best: it prunes nothing
                failures.append(Tried(cand, EvalResult(Verdict.INCORRECT)))
            continue
        if us < best_us:
            best, best_us, failures = cand, us, []
    return best, best_us, n, log


def best_per_algo(tried: list[dict]) -> dict:
    """algorithm -> its fastest sweep time (None where every setting of it failed)."""
    out: dict = {}
    for t in tried:
        a, us = t["knobs"].get("algo"), t["us"]
        if us is not None and (out.get(a) is None or us < out[a]):
            out[a] = us
        out.setdefault(a, None)
    return out


def eager_fn(card, inputs):
    if card.region is not None:
        return lambda: card.call_eager(inputs, "cuda")
    args, kwargs = card.build_call(inputs, "cuda")
    op = card.overload()
    return lambda: op(*args, **kwargs)


def compiled_fn(card, inputs):
    if card.region is not None:
        torch._dynamo.reset()
        fn = baseline.compiled_reference(card, torch.device("cuda"), "inductor")
        fn(inputs)
        return lambda: fn(inputs)
    op = card.overload()
    args, kwargs = card.build_call(inputs, "cuda")
    tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def f(*ts):
        full = list(args)
        for i, t in zip(tensor_pos, ts):
            full[i] = t
        return op(*full, **kwargs)

    # A fresh dynamo cache per card: `f`'s code object is shared by every card, and past
    # dynamo's recompile limit a compiled call silently runs eager.
    torch._dynamo.reset()
    fn = torch.compile(f, dynamic=False)
    ts = [args[i] for i in tensor_pos]
    fn(*ts)
    return lambda: fn(*ts)


def main(argv=None, cases=None, templates=TEMPLATES, out_name: str = "builtin_h200.json", budget: int = 50,
         title: str = "builtin templates vs eager and torch.compile (GPU time, median)", doc: str = __doc__) -> int:
    """The benchmark over `cases` (default CASES) with the built-in `templates`; bench_codegen.py
    runs it with the generated template alone."""
    cases = CASES if cases is None else cases
    opts = options(argv, doc, out_name, budget)
    if opts is None:
        return 2
    hw = current()
    rows = []
    start = time.perf_counter()
    only = [part for part in opts.only.split("|") if part]
    out = Path(opts.out)
    for name, (make, target) in cases.items():
        if only and not any(part in name for part in only):
            continue
        rows.append(run_case(name, make(), target, hw, opts.budget, not opts.no_compile, templates))
        # Written after every case, so a run cut short by its time limit keeps what it measured.
        out = save(opts.out, rows, opts.budget, hw, start)
    print_table(rows, title)
    print(f"wrote {out} in {time.perf_counter() - start:.0f} s")
    return 0


def options(argv, doc: str, out_name: str, budget: int):
    """The benchmarks' shared command line (None, with a message, without a GPU)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / out_name))
    ap.add_argument("--budget", type=int, default=budget, help=f"candidates per card (default {budget})")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (saves its compile time)")
    ap.add_argument("--only", default="", help="run only cases whose name contains one of these '|'-separated strings")
    opts = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return None
    return opts


def run_case(name: str, card, target, hw, budget: int, with_compile: bool, templates=TEMPLATES) -> dict:
    """Sweep the card's knobs, then time eager, the best kernel and torch.compile together."""
    inputs = fresh_inputs(card, 0)
    print(f"{name}: sweeping")
    best, sweep_us, n, tried = sweep(card, hw, inputs, budget, templates)
    fns = [eager_fn(card, [faithful_clone(t) for t in inputs])]
    if best is not None:
        fns.append(Runner(card, best, [faithful_clone(t) for t in inputs]))
    if with_compile:
        fns.append(compiled_fn(card, [faithful_clone(t) for t in inputs]))
    ms = timing.time_fns(fns)
    eager_us = ms[0].median
    kernel_us = ms[1].median if best is not None else None
    compile_us = ms[-1].median if with_compile else None
    floor = hw.floor_us(card.io_bytes())
    row = {"name": name, "card": card.summary(), "eager_us": eager_us, "compile_us": compile_us,
           "kernel_us": kernel_us, "kernel_iqr_us": ms[1].iqr if best is not None else None,
           "floor_us": floor, "eager_frac": floor / eager_us,
           "kernel_frac": floor / kernel_us if kernel_us else None,
           "speedup": eager_us / kernel_us if kernel_us else None,
           "speedup_vs_compile": compile_us / kernel_us if kernel_us and compile_us else None,
           "knobs": best.knobs if best else None, "candidates": n, "target": target,
           "best_per_algo": best_per_algo(tried), "tried": tried}
    if target and kernel_us:
        kind, value = target
        row["target_met"] = (row["speedup"] if kind == "speedup" else row["kernel_frac"]) >= value
    print(f"  eager {eager_us:.1f} us, kernel {kernel_us or float('nan'):.1f} us, floor {floor:.1f} us, "
          f"{n} candidates, best {row['knobs']}")
    print("  best per algorithm (sweep us): " + ", ".join(f"{a} {'failed' if u is None else f'{u:.1f}'}"
                                                      for a, u in row["best_per_algo"].items()))
    return row


def save(path, rows, budget: int, hw, start: float) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**provenance(), "budget": budget, "bandwidth_Bps": hw.bandwidth,
                               "seconds": time.perf_counter() - start, "rows": rows}, indent=1))
    return out


def print_table(rows, title: str = "builtin templates vs eager and torch.compile (GPU time, median)") -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for col in ("case", "eager us", "compile us", "kernel us", "x eager", "x compile", "% floor", "target"):
        t.add_column(col, justify="left" if col == "case" else "right")
    f = lambda v, fmt: format(v, fmt) if v is not None else "-"  # noqa: E731
    for r in rows:
        target = "-" if not r["target"] else f"{'ok' if r.get('target_met') else 'MISS'} ({r['target'][0]} {r['target'][1]})"
        t.add_row(r["name"], f(r["eager_us"], ".1f"), f(r["compile_us"], ".1f"), f(r["kernel_us"], ".1f"),
                  f(r["speedup"], ".2f"), f(r["speedup_vs_compile"], ".2f"),
                  f(r["kernel_frac"] and 100 * r["kernel_frac"], ".0f"), target)
    Console().print(t)


if __name__ == "__main__":
    raise SystemExit(main())
