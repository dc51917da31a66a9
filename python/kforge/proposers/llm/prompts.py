"""Prompts: pure functions from (card, hardware, search feedback) to chat messages.

Three conversations:
  proposal_messages  a first kernel (ctx.parent is None) or a faster revision of ctx.parent,
                     with its lineage and its siblings' failures;
  repair_messages    fix a candidate that failed to compile, load, run or validate;
  retry_messages     the previous conversation plus the model's unusable reply and why it
                     could not be used (a malformed answer is fed back, not a crash).

Everything long is trimmed to a character budget so a deep lineage cannot blow the context.
"""

from __future__ import annotations

import json
import re
import textwrap

from ... import sourcebox
from ...candidate import Candidate
from ...cards import Card, TensorMeta, decode_value
from ...errors import numbered
from ...hardware import Hardware
from ...verdict import Verdict
from ...tolerance import SLACK, bounds
from ..base import ProposalContext, Tried
from .references import decomposed, reference_code

# Fixed openings of the user turns, so a scripted test endpoint can tell them apart.
PROPOSE_HEADING = "Write a CUDA kernel for this operator call."
REVISE_HEADING = "Write a faster CUDA kernel for this operator call."
REPAIR_HEADING = "The kernel below failed. Fix it."
RETRY_HEADING = "Your answer could not be used:"

UNTIMED = "compiled; not run or timed (no GPU where this search runs), so neither right nor wrong"

LINEAGE_CHARS = 12_000  # sources of best + ancestors shown in a revision prompt
FAILURE_CHARS = 600  # per sibling failure
MAX_FAILURES = 6
COMPILE_LOG_CHARS = 2_500
MAX_COMPILE_ERRORS = 5

def _environment() -> str:
    """What the compile box (kforge.sourcebox) lets through and predefines, so the prompt
    says exactly that."""
    headers = ", ".join(f"<{h}>" for h in sorted(sourcebox.ALLOWED_HEADERS)).rsplit(", ", 1)
    defined = [a or b for a, b in re.findall(r"#define (\w+)|typedef [\w ]+ (\w+);", sourcebox.PRELUDE)]
    bullets = [
        f"Headers: only {' and '.join(headers)}. Host headers written out of habit (<cmath>, <cstdint>, "
        "<cfloat>, <cuda_runtime.h>, ...) are dropped with a note; any other include is refused (no "
        "<cooperative_groups.h>, no files of your own).",
        f"Predefined, no include needed: {', '.join(defined)}. CUDA's device math (expf, rsqrtf, fmaxf, __expf, "
        "...) and intrinsics (__shfl_xor_sync, atomicAdd, ...) are built in.",
        "No host code: no main, no <<<...>>> launches, no cudaMalloc, no printf, no malloc. kforge launches the "
        "kernels itself from the launch plan.",
        'A 64-bit integer parameter is `long long` (what {"i64": v} passes).',
    ]
    return "Compile environment (NVRTC, device code only)\n" + "\n".join(
        textwrap.fill(b, 90, initial_indent="- ", subsequent_indent="  ") for b in bullets)


ANSWER_FORMAT = """\
Answer format, exactly:
1. one ```cuda block with the complete source;
2. one ```json block with the launch plan;
3. a line `kind: custom` (your own CUDA), or `kind: vendor` only if the kernel is a thin
   wrapper over vendor device code (audited separately and rarely wanted).
A short explanation (at most 5 lines) may come before the blocks. Nothing else."""

SYSTEM = """\
You write CUDA kernels that replace one PyTorch aten operator call with exact, known
shapes, strides and dtypes. Your kernel is compiled with NVRTC, checked against PyTorch on
fresh random inputs, timed against PyTorch with the L2 cache flushed, and kept only if it
is correct and faster.

{environment}

Kernel ABI
- Every kernel is `extern "C" __global__ void name(...)` (or inside an `extern "C" {{ }}`
  block): templates and C++ names are mangled and cannot be launched by name.
- Write the kernel yourself in CUDA C++. Do not call cuBLAS, cuDNN, CUTLASS, Thrust, CUB
  or PyTorch; nothing outside your source runs.
- Kernels are launched by kforge from a launch plan (JSON, data not code). Several kernels
  may run in sequence on one stream. Each plan argument binds one kernel parameter, in
  order, one to one:
    {{"in": i}}    const T*  pointer to element 0 of input i (index it with its strides)
    {{"out": j}}   T*        pointer to element 0 of output j (kforge allocates it with the
                           listed shape, strides and dtype; an in-place output is the input)
    {{"ws": k}}    void*     workspace k: "workspace" lists byte counts, or
                           {{"bytes": n, "zero": true}} to have it zeroed before the first kernel
    {{"i32": v}} int   {{"i64": v}} long long   {{"f32": v}} float   {{"f64": v}} double
- "grid" and "block" are [x, y, z]; at most 1024 threads per block; "smem" is dynamic
  shared memory in bytes. "options" are extra NVRTC flags, usually none: code
  generation and math flags only (--use_fast_math, --ftz=true, --maxrregcount=N, -DNAME);
  -O flags are dropped (NVRTC optimizes fully by default). A kernel with
  "cooperative": true is launched with every block resident at once, so its blocks may
  wait for each other (a grid-wide barrier on a zeroed workspace counter); a grid too
  large to be resident is refused, so keep it to a few blocks per SM.
- "cluster": n (2 to 8; 16 where the GPU allows it; n divides grid x; not with
  cooperative) makes every n consecutive blocks along x one thread block cluster (sm_90+):
  they run at the same time and may barrier together and read each other's shared memory,
  with inline PTX (no cooperative_groups here):
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
    `mapa.shared::cluster.u32` maps a shared address to another block's, `ld.shared::cluster` reads it.
- "pdl": true (programmatic dependent launch, sm_90+) lets a kernel start before the
  previous kernel of the plan finishes: it must run `asm volatile("griddepcontrol.wait;" :::
  "memory")` before reading anything that kernel wrote; the previous kernel may run
  `asm volatile("griddepcontrol.launch_dependents;")` once its remaining work is stores.

Correctness rules
- Write every element of every output on every call; never modify an input unless the
  output is declared in-place on it.
- Same result on every run: no races, no floating-point atomics unless the op needs them.
- Accumulate in float32 (or wider) for half and bfloat16 data, like PyTorch.
- Do not depend on the sample values: you are checked on several fresh random inputs.

Worked example: out = torch.ops.aten.mul.Tensor(in0, in1) with two contiguous float32
tensors of shape [1048576], 16-byte aligned:

```cuda
extern "C" __global__ void __launch_bounds__(256)
mul_f32x4(const float4* __restrict__ a, const float4* __restrict__ b, float4* __restrict__ out, int n4)
{{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n4) {{
        float4 x = a[i], y = b[i];
        out[i] = make_float4(x.x * y.x, x.y * y.y, x.z * y.z, x.w * y.w);
    }}
}}
```
```json
{{"kernels": [{{"name": "mul_f32x4", "grid": [1024, 1, 1], "block": [256, 1, 1], "smem": 0,
              "args": [{{"in": 0}}, {{"in": 1}}, {{"out": 0}}, {{"i32": 262144}}]}}],
 "workspace": [], "options": []}}
```
kind: custom

""".format(environment=_environment()) + ANSWER_FORMAT


# ---- the card, the hardware, the reference ----------------------------------------------

def _tensor_line(label: str, m: TensorMeta, note: str = "") -> str:
    layout = "contiguous" if m.is_contiguous() else "NOT contiguous"
    return (f"  {label}: shape {list(m.shape)}, stride {list(m.stride)} (elements), {m.dtype}, {layout}, "
            f"{m.align}-byte aligned{note}")


def _input_names(card: Card) -> list[str]:
    names: list[str] = []
    for a in card.args:
        if a.kind == "tensor":
            names.append(a.name)
        elif a.kind == "tensors":
            names += [f"{a.name}[{k}]" for k, m in enumerate(a.tensors) if m is not None]
    return names


def describe_card(card: Card, hw: Hardware, tolerance: dict | None = None, eager_us: float | None = None) -> str:
    """The card as the model needs it. `tolerance` is a measured one (else the rule is
    stated); `eager_us` is eager's time on this GPU, when known (a CPU capture's is not)."""
    written = card.written_inputs
    lines = [f"Operator: {card.op}", f"Schema: {card.schema}", "Inputs (numbered as in the launch plan):"]
    names = _input_names(card)
    for i, m in enumerate(card.inputs):
        lines.append(_tensor_line(f"in{i} ({names[i]})", m, ", WRITTEN by the op (in-place)" if i in written else ""))
    values = [f"{a.name} = {decode_value(a.value, card.device_type)!r}" for a in card.args if a.kind == "value"]
    if values:
        lines.append("Scalar arguments: " + ", ".join(values))
    lines.append("Outputs:")
    for j, m in enumerate(card.outputs):
        alias = f", the same memory as in{card.aliases[j]} (in-place)" if j in card.aliases else ""
        lines.append(_tensor_line(f"out{j}", m, alias))
    lines += ["Reference semantics (PyTorch):", *(f"  {line}" for line in reference_code(card).splitlines())]
    steps = decomposed(card)
    if steps:
        lines += ["  which computes, step by step:"] + [f"    {line}" for line in steps]
    nbytes = card.io_bytes()
    lines.append(f"Minimum traffic: {nbytes / 1e6:.3f} MB, so no kernel beats {hw.floor_us(nbytes):.2f} us "
                 "on this GPU (HBM floor).")
    if eager_us:
        lines.append(f"PyTorch eager takes {eager_us:.2f} us per call on this GPU.")
    lines.append(tolerance_text(card, tolerance))
    return "\n".join(lines)


def tolerance_text(card: Card, measured: dict | None) -> str:
    """How outputs are compared: the measured tolerance when the search has one, else the
    rule kforge derives it by (kforge.tolerance), with each output dtype's bounds."""
    head = "Tolerance: |got - expected| <= atol + rtol * |expected| per element (expected = PyTorch's output)"
    if measured:
        return head + "; " + ", ".join(f"{k} = {v}" for k, v in measured.items() if isinstance(v, (int, float, str)))
    by_dtype: dict[str, list[int]] = {}
    for j, m in enumerate(card.outputs):
        by_dtype.setdefault(m.dtype, []).append(j)
    rules = []
    for dtype, js in by_dtype.items():
        outs, t = ", ".join(f"out{j}" for j in js), card.outputs[js[0]].torch_dtype
        if not (t.is_floating_point or t.is_complex):
            rules.append(f"{outs} ({dtype}): exact")
            continue
        rtol, floor, cap = bounds(t)
        rules.append(f"{outs} ({dtype}): rtol {rtol:.3g}, atol {SLACK:g}x PyTorch's own error against float64, "
                     f"between {floor:.3g} and {cap:.3g} times the RMS of the expected values")
    return f"{head}; {'; '.join(rules)}."


def describe_hardware(hw: Hardware) -> str:
    return (f"GPU: {hw.name} ({hw.arch}), {hw.sm_count} SMs, L2 {hw.l2_bytes / 2**20:.0f} MiB, "
            f"up to {hw.smem_per_block // 1024} KiB shared memory per block, "
            f"copy bandwidth {hw.bandwidth / 1e12:.2f} TB/s, {hw.mem_bytes / 1e9:.0f} GB memory.")


# ---- feedback -----------------------------------------------------------------------------

def trim(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit].rstrip() + f"\n[... {len(text) - limit} more characters]"


def _code(candidate: Candidate) -> str:
    return f"```cuda\n{candidate.source.strip()}\n```\n```json\n{json.dumps(candidate.plan.to_json())}\n```"


def _timing(t: Tried, hw: Hardware, card: Card) -> str:
    r = t.result
    if r.verdict is Verdict.UNTIMED:
        return UNTIMED
    if not r.kernel_us:  # failed, or a bogus zero: no ratio to show
        return f"verdict {r.verdict.value}"
    floor = hw.floor_us(card.io_bytes())
    parts = [f"{r.kernel_us:.2f} us"]
    if r.eager_us:
        parts.append(f"eager {r.eager_us:.2f} us (speedup {r.eager_us / r.kernel_us:.2f}x)")
    parts.append(f"HBM floor {floor:.2f} us ({100 * floor / r.kernel_us:.0f}% of the floor's speed)")
    return ", ".join(parts)


_COMPILE_DIAG = re.compile(r"\((\d+)\): (error|warning)")


def compile_feedback(log: str, source: str) -> str:
    """The first few errors of an NVRTC log, each with the source lines it points at."""
    lines = log.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if _COMPILE_DIAG.search(line) and "error" in line]
    if not starts:
        return trim(log, COMPILE_LOG_CHARS)
    blocks = []
    for n, i in enumerate(starts[:MAX_COMPILE_ERRORS]):
        end = starts[n + 1] if n + 1 < len(starts) else min(len(lines), i + 4)
        block = "\n".join(lines[i:end])
        lineno = int(_COMPILE_DIAG.search(lines[i]).group(1))
        blocks.append(f"{block}\n{numbered(source, around=lineno, context=2)}")
    more = len(starts) - MAX_COMPILE_ERRORS
    if more > 0:
        blocks.append(f"[... {more} more errors]")
    return trim("\n\n".join(blocks), COMPILE_LOG_CHARS)


def failure_feedback(t: Tried) -> str:
    """What went wrong with a failed candidate, as evidence the model can act on."""
    r = t.result
    if r.compile_log and r.verdict.value == "compile_error":
        return f"compile error:\n{compile_feedback(r.compile_log, t.candidate.source)}"
    parts = [f"{r.verdict.value}: {r.message}".rstrip(": ")]
    if r.max_abs_err is not None:
        parts.append(f"max abs error {r.max_abs_err:.3g}, max rel error {r.max_rel_err or 0:.3g}")
    if r.evidence:
        parts.append("evidence: " + json.dumps(r.evidence, default=str, sort_keys=True))
    return trim("\n".join(parts), COMPILE_LOG_CHARS)


def _lineage(ctx: ProposalContext) -> str:
    """The best candidate (if it is not the parent) and the parent's ancestors, nearest
    first, with sources while the budget lasts and one line each after that."""
    shown, budget = [], LINEAGE_CHARS
    others = [] if ctx.best is None or ctx.best is ctx.parent else [("best so far", ctx.best)]
    others += [(f"ancestor -{n}", t) for n, t in enumerate(reversed(ctx.lineage), 1) if t is not ctx.best]
    for label, t in others:
        head = f"{label}: {_timing(t, ctx.hardware, ctx.card)}"
        code = _code(t.candidate)
        if len(code) <= budget:
            shown.append(f"{head}\n{code}")
            budget -= len(code)
        else:
            shown.append(head + " (source omitted)")
    return "\n\n".join(shown)


def _sibling(t: Tried) -> str:
    """One earlier attempt: what its author said it does, then what happened to it."""
    approach = f"approach: {trim(t.candidate.note, 200)}\n  " if t.candidate.note else ""
    what = UNTIMED if t.result.verdict is Verdict.UNTIMED else trim(failure_feedback(t), FAILURE_CHARS)
    return f"- {approach}{what}"


def _siblings(ctx: ProposalContext) -> tuple[str, str]:
    """(failed attempts, compile-only attempts) among the siblings, newest last."""
    untimed = [t for t in ctx.sibling_failures if t.result.verdict is Verdict.UNTIMED]
    failed = [t for t in ctx.sibling_failures if t.result.verdict is not Verdict.UNTIMED]
    return ("\n".join(_sibling(t) for t in failed[-MAX_FAILURES:]),
            "\n".join(_sibling(t) for t in untimed[-MAX_FAILURES:]))


def _sibling_sections(ctx: ProposalContext, failed_heading: str) -> list[str]:
    failed, untimed = _siblings(ctx)
    sections = [f"{failed_heading}\n{failed}"] if failed else []
    if untimed:
        sections.append(f"Earlier attempts that compiled but could not be checked here (try a different "
                        f"approach, not a fix):\n{untimed}")
    return sections


def _searched(ctx: ProposalContext) -> list[Tried]:
    return [t for t in (ctx.parent, ctx.best, *reversed(ctx.lineage), *ctx.sibling_failures) if t is not None]


def _tolerance(ctx: ProposalContext) -> dict | None:
    """The tolerance the evaluator measured for this card, from any result that carries it."""
    for t in _searched(ctx):
        if isinstance(t.result.evidence.get("tolerance"), dict):
            return t.result.evidence["tolerance"]
    return None


def _eager_us(ctx: ProposalContext) -> float | None:
    """Eager's time on the GPU the kernel will run on: as the evaluator measured it, else
    the capture's when it ran on this GPU (a CPU capture's time would mislead)."""
    for t in _searched(ctx):
        if t.result.eager_us:
            return t.result.eager_us
    return ctx.card.eager_us if ctx.card.device_name == ctx.hardware.name else None


def _facts(ctx: ProposalContext) -> str:
    card = describe_card(ctx.card, ctx.hardware, _tolerance(ctx), _eager_us(ctx))
    return f"{card}\n{describe_hardware(ctx.hardware)}"


# ---- conversations ------------------------------------------------------------------------

def _system() -> dict[str, str]:
    return {"role": "system", "content": SYSTEM}


def proposal_messages(ctx: ProposalContext) -> list[dict[str, str]]:
    card, hw = ctx.card, ctx.hardware
    if ctx.parent is None:
        sections = [PROPOSE_HEADING, _facts(ctx), *_sibling_sections(ctx, "Earlier attempts that failed (do not "
                                                                            "repeat):"), ANSWER_FORMAT]
        return [_system(), {"role": "user", "content": "\n\n".join(sections)}]
    sections = [REVISE_HEADING, _facts(ctx),
                f"Current kernel, to improve: {_timing(ctx.parent, hw, card)}\n{_code(ctx.parent.candidate)}"]
    lineage = _lineage(ctx)
    if lineage:
        sections.append(f"Earlier versions:\n{lineage}")
    sections += _sibling_sections(ctx, "Revisions of the current kernel that failed (do not repeat):")
    sections.append("Make it faster. If it is far from the HBM floor, change the approach (parallelism, "
                    "memory access pattern, vector width, work per thread) rather than a constant.\n\n"
                    + ANSWER_FORMAT)
    return [_system(), {"role": "user", "content": "\n\n".join(sections)}]


def repair_messages(ctx: ProposalContext, failed: Tried) -> list[dict[str, str]]:
    body = "\n\n".join([
        REPAIR_HEADING,
        _facts(ctx),
        f"Failed kernel:\n{_code(failed.candidate)}",
        f"What went wrong:\n{failure_feedback(failed)}",
        "Fix the cause. Keep the approach unless it cannot work.\n\n" + ANSWER_FORMAT,
    ])
    return [_system(), {"role": "user", "content": body}]


def retry_messages(messages: list[dict[str, str]], reply: str, error: str) -> list[dict[str, str]]:
    return messages + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": f"{RETRY_HEADING} {error}\n\n{ANSWER_FORMAT}"},
    ]
