"""A model's reply -> Candidate, or a ProposerError whose message is written to be sent
back to the model ("your answer could not be used: ...").

Checks here are the ones that need no compiler: one CUDA block and one JSON launch plan,
the plan fits the card, every kernel it launches is defined as `extern "C" __global__` in
the source, and each argument binding matches the kind and width of the kernel parameter
it lands in (a 32-bit int bound to a 64-bit parameter would read garbage, not fail).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...candidate import Candidate, LaunchPlan
from ...cards import Card
from ...errors import PlanError, ProposerError

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.S)
_CUDA_LANGS = {"cuda", "cu", "cpp", "c++", "c", "cxx"}
_KIND = re.compile(r"^\W*kind\W*:\s*\W*(custom|vendor)\b", re.I | re.M)
_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+'
    r"(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)")
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)

# Scalar parameter types by the launch-plan kind they accept; pointers take in/out/ws.
_SCALARS = {
    "i32": {"int", "int32_t", "unsigned", "unsigned int", "uint32_t", "signed int", "signed"},
    "i64": {"long long", "long long int", "int64_t", "unsigned long long", "uint64_t", "size_t", "long",
            "unsigned long", "ptrdiff_t", "long int"},
    "f32": {"float"},
    "f64": {"double"},
}
_QUALIFIERS = re.compile(r"\b(const|volatile|__restrict__|__restrict|restrict)\b")


@dataclass(frozen=True)
class Param:
    text: str
    pointer: bool
    scalar_kind: str | None  # i32/i64/f32/f64 for scalars we recognise


def code_blocks(reply: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, language lower-cased ('' if none)."""
    return [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(reply)]


def kernel_params(source: str) -> dict[str, list[Param]]:
    """Every `extern "C" __global__` kernel in the source and its parameters."""
    kernels = {}
    for m in _KERNEL.finditer(_COMMENTS.sub(" ", source)):
        params = [p.strip() for p in m.group(2).split(",")]
        params = [] if params in ([""], ["void"]) else params
        kernels[m.group(1)] = [_param(p) for p in params]
    return kernels


def _param(text: str) -> Param:
    if "*" in text or "[" in text:
        return Param(text, True, None)
    words = _QUALIFIERS.sub(" ", text).split()
    type_name = " ".join(words[:-1])  # drop the parameter name
    kind = next((k for k, names in _SCALARS.items() if type_name in names), None)
    return Param(text, False, kind)


def _pick_source(blocks: list[tuple[str, str]]) -> str:
    cuda = [b for lang, b in blocks if lang in _CUDA_LANGS]
    if not cuda:
        cuda = [b for lang, b in blocks if not lang and "__global__" in b]
    if len(cuda) != 1:
        found = "no" if not cuda else f"{len(cuda)}"
        raise ProposerError(f"expected exactly one ```cuda block with the whole source, found {found}")
    return cuda[0]


def _pick_plan(blocks: list[tuple[str, str]]) -> LaunchPlan:
    plans = [b for lang, b in blocks if lang == "json"]
    if not plans:
        plans = [b for lang, b in blocks if not lang and b.lstrip().startswith("{")]
    if len(plans) != 1:
        found = "no" if not plans else f"{len(plans)}"
        raise ProposerError(f"expected exactly one ```json block with the launch plan, found {found}")
    try:
        return LaunchPlan.from_json(plans[0])
    except PlanError as e:
        raise ProposerError(f"launch plan: {e}") from e


def check_bindings(plan: LaunchPlan, source: str) -> None:
    """Each launched kernel exists in the source and its parameters take the plan's arguments."""
    kernels = kernel_params(source)
    for k in plan.kernels:
        if k.name not in kernels:
            defined = ", ".join(sorted(kernels)) or "none"
            raise ProposerError(f'the plan launches "{k.name}" but the source defines no `extern "C" __global__ '
                                f'void {k.name}(...)` (extern "C" kernels defined: {defined})')
        params = kernels[k.name]
        if len(params) != len(k.args):
            raise ProposerError(f"kernel {k.name} takes {len(params)} parameters but the plan passes "
                                f"{len(k.args)} arguments; they must match one to one, in order")
        for n, (arg, p) in enumerate(zip(k.args, params)):
            kind = next(iter(arg))
            if kind in ("in", "out", "ws") and not p.pointer:
                raise ProposerError(f"kernel {k.name}, parameter {n} `{p.text}`: the plan binds a buffer "
                                    f"{arg} to it, which needs a pointer parameter")
            if kind in _SCALARS and p.pointer:
                raise ProposerError(f"kernel {k.name}, parameter {n} `{p.text}`: the plan passes scalar {arg} "
                                    "to a pointer parameter")
            if kind in _SCALARS and p.scalar_kind != kind:
                want = " / ".join(sorted(_SCALARS[kind])[:3])
                raise ProposerError(f"kernel {k.name}, parameter {n} `{p.text}`: the plan passes {arg}, which "
                                    f"needs a parameter of type {want}")


def parse_reply(reply: str, card: Card, proposer: str = "llm") -> Candidate:
    """The candidate in a reply; raises ProposerError saying what to change."""
    if not reply.strip():
        raise ProposerError("the reply was empty")
    blocks = code_blocks(reply)
    source = _pick_source(blocks)
    plan = _pick_plan(blocks)
    try:
        plan.validate(len(card.inputs), len(card.outputs))
    except PlanError as e:
        raise ProposerError(f"launch plan: {e}") from e
    check_bindings(plan, source)
    prose = _FENCE.sub("", reply)
    kind = _KIND.search(prose)
    note = " ".join(line.strip() for line in prose.splitlines() if line.strip() and not _KIND.match(line))
    return Candidate(source=source, plan=plan, kind=kind.group(1).lower() if kind else "custom",
                     proposer=proposer, note=note[:300])
