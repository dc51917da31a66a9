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

from ...candidate import Candidate
from ...cards import Card, TensorMeta, decode_value
from ...errors import numbered
from ...hardware import Hardware
from ..base import ProposalContext, Tried

# Fixed openings of the user turns, so a scripted test endpoint can tell them apart.
PROPOSE_HEADING = "Write a CUDA kernel for this operator call."
REVISE_HEADING = "Write a faster CUDA kernel for this operator call."
REPAIR_HEADING = "The kernel below failed. Fix it."
RETRY_HEADING = "Your answer could not be used:"

LINEAGE_CHARS = 12_000  # sources of best + ancestors shown in a revision prompt
FAILURE_CHARS = 600  # per sibling failure
MAX_FAILURES = 6
COMPILE_LOG_CHARS = 2_500
MAX_COMPILE_ERRORS = 5

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

Kernel ABI
- Every kernel is `extern "C" __global__ void name(...)`. Only device code: no host code,
  no main, no printf, no malloc. Include nothing but <cuda_fp16.h> and <cuda_bf16.h>; use
  int / long long / unsigned / float / double rather than <cstdint> types.
- Write the kernel yourself in CUDA C++. Do not call cuBLAS, cuDNN, CUTLASS, Thrust, CUB
  or PyTorch; nothing outside your source runs.
- Kernels are launched by kforge from a launch plan (JSON, data not code). Several kernels
  may run in sequence on one stream. Each plan argument binds one kernel parameter, in
  order, one to one:
    {"in": i}    const T*  pointer to element 0 of input i (index it with its strides)
    {"out": j}   T*        pointer to element 0 of output j (kforge allocates it with the
                           listed shape, strides and dtype; an in-place output is the input)
    {"ws": k}    void*     workspace k: "workspace" lists byte counts, or
                           {"bytes": n, "zero": true} to have it zeroed before the first kernel
    {"i32": v} int   {"i64": v} long long   {"f32": v} float   {"f64": v} double
- "grid" and "block" are [x, y, z]; at most 1024 threads per block; "smem" is dynamic
  shared memory in bytes. "options" are extra NVRTC flags (may be empty). A kernel with
  "cooperative": true is launched with every block resident at once, so its blocks may
  wait for each other (a grid-wide barrier on a zeroed workspace counter); a grid too
  large to be resident is refused, so keep it to a few blocks per SM.

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
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n4) {
        float4 x = a[i], y = b[i];
        out[i] = make_float4(x.x * y.x, x.y * y.y, x.z * y.z, x.w * y.w);
    }
}
```
```json
{"kernels": [{"name": "mul_f32x4", "grid": [1024, 1, 1], "block": [256, 1, 1], "smem": 0,
              "args": [{"in": 0}, {"in": 1}, {"out": 0}, {"i32": 262144}]}],
 "workspace": [], "options": []}
```
kind: custom

""" + ANSWER_FORMAT


# ---- the card, the hardware, the reference ----------------------------------------------

def _tensor_line(label: str, m: TensorMeta, note: str = "") -> str:
    layout = "contiguous" if m.is_contiguous() else "NOT contiguous"
    return (f"  {label}: shape {list(m.shape)}, stride {list(m.stride)} (elements), {m.dtype}, {layout}, "
            f"{m.align}-byte aligned{note}")


def reference_code(card: Card) -> str:
    """The call as PyTorch code, tensors named in0.. and out0.. like the launch plan; a
    region card's is a function of its aten calls, returning out0.. in order."""
    if card.region is not None:
        return card.region.code(card.inputs)
    it = iter(range(len(card.inputs)))
    args = []
    for a in card.args:
        if a.kind == "tensor":
            v = f"in{next(it)}"
        elif a.kind == "tensors":
            v = "[" + ", ".join(f"in{next(it)}" if m is not None else "None" for m in a.tensors) + "]"
        else:
            v = repr(decode_value(a.value, card.device_type))
        args.append(f"{a.name}={v}" if a.kwarg_only else v)
    outs = ", ".join(f"out{j}" for j in range(len(card.outputs))) or "_"
    return f"{outs} = torch.ops.{card.op.replace('::', '.')}({', '.join(args)})"


def _input_names(card: Card) -> list[str]:
    names: list[str] = []
    for a in card.args:
        if a.kind == "tensor":
            names.append(a.name)
        elif a.kind == "tensors":
            names += [f"{a.name}[{k}]" for k, m in enumerate(a.tensors) if m is not None]
    return names


def describe_card(card: Card, hw: Hardware, tolerance: dict | None = None) -> str:
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
    nbytes = card.io_bytes()
    lines.append(f"Minimum traffic: {nbytes / 1e6:.3f} MB, so no kernel beats {hw.floor_us(nbytes):.2f} us "
                 "on this GPU (HBM floor).")
    if card.eager_us:
        lines.append(f"PyTorch eager takes {card.eager_us:.2f} us per call.")
    if tolerance:
        lines.append("Tolerance: " + ", ".join(f"{k} = {v}" for k, v in tolerance.items()
                                               if isinstance(v, (int, float, str))))
    return "\n".join(lines)


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
    if not r.kernel_us:  # failed, untimed, or a bogus zero: no ratio to show
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


def _failures(ctx: ProposalContext) -> str:
    items = [f"- {trim(failure_feedback(t), FAILURE_CHARS)}" for t in ctx.sibling_failures[-MAX_FAILURES:]]
    return "\n".join(items)


def _tolerance(ctx: ProposalContext) -> dict | None:
    for t in (ctx.parent, ctx.best):
        if t is not None and isinstance(t.result.evidence.get("tolerance"), dict):
            return t.result.evidence["tolerance"]
    return None


# ---- conversations ------------------------------------------------------------------------

def _system() -> dict[str, str]:
    return {"role": "system", "content": SYSTEM}


def proposal_messages(ctx: ProposalContext) -> list[dict[str, str]]:
    card, hw = ctx.card, ctx.hardware
    facts = f"{describe_card(card, hw, _tolerance(ctx))}\n{describe_hardware(hw)}"
    if ctx.parent is None:
        body = f"{PROPOSE_HEADING}\n\n{facts}"
        failures = _failures(ctx)
        if failures:
            body += f"\n\nEarlier attempts that failed (do not repeat):\n{failures}"
        return [_system(), {"role": "user", "content": f"{body}\n\n{ANSWER_FORMAT}"}]
    sections = [REVISE_HEADING, facts,
                f"Current kernel, to improve: {_timing(ctx.parent, hw, card)}\n{_code(ctx.parent.candidate)}"]
    lineage = _lineage(ctx)
    if lineage:
        sections.append(f"Earlier versions:\n{lineage}")
    failures = _failures(ctx)
    if failures:
        sections.append(f"Revisions of the current kernel that failed (do not repeat):\n{failures}")
    sections.append("Make it faster. If it is far from the HBM floor, change the approach (parallelism, "
                    "memory access pattern, vector width, work per thread) rather than a constant.\n\n"
                    + ANSWER_FORMAT)
    return [_system(), {"role": "user", "content": "\n\n".join(sections)}]


def repair_messages(ctx: ProposalContext, failed: Tried) -> list[dict[str, str]]:
    card, hw = ctx.card, ctx.hardware
    body = "\n\n".join([
        REPAIR_HEADING,
        f"{describe_card(card, hw, _tolerance(ctx))}\n{describe_hardware(hw)}",
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
