"""A model's reply -> Candidate, or a ProposerError whose message is written to be sent
back to the model ("your answer could not be used: ...").

Models write the same answer in many ways, so reading is lenient where the meaning is
plain and strict where a guess could run the wrong thing:
- reasoning (`<think>...</think>`, also when only the closing tag survives a chat template)
  is dropped first, with the drafts it holds;
- fenced blocks are read line by line, so a ```json block nested inside the ```cuda block
  is a block of its own; the plan may also sit in a comment of the source (`/* plan: {...} */`),
  in a jsonc/json5/javascript block, or bare in the prose;
- the plan's JSON may carry comments, trailing commas, single quotes and bare keys, and the
  usual synonyms (`blocks`/`threads`, `gridDim`/`blockDim`, `shared_mem`, ...) are mapped;
  a key that means nothing to kforge is named in the message, never silently ignored (a
  dropped `dyn_smem` would launch with no shared memory);
- of several CUDA blocks (drafts, a fixed version), the last one that defines every kernel
  the plan launches is the source, with any block of `__device__` helpers it calls;
- whatever else goes wrong while reading is a message too: a reply never crashes the search.
Checks that need no compiler follow: the plan fits the card, every kernel it launches is
`extern "C" __global__` in the source (directly or inside an `extern "C" { }` block), and each
argument matches the kind and width of its parameter (a 32-bit int bound to a 64-bit
parameter would read garbage, not fail).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ...candidate import Candidate, LaunchPlan
from ...cards import Card
from ...errors import PlanError, ProposerError

_CUDA_LANGS = {"cuda", "cu", "cuh", "cpp", "c++", "cc", "cxx", "c", "h", "hpp"}
_JSON_LANGS = {"json", "jsonc", "json5", "javascript", "js", "jsonl", "hjson"}
_FENCE_OPEN = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([\w+#.-]*)[^\n`]*$")
_KIND = re.compile(r"^\W*kind\W*:\s*\W*(custom|vendor)\b", re.I | re.M)
_COMMENTS = re.compile(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|/\*.*?\*/', re.S)  # strings kept, comments matched
_LB = r"(?:__launch_bounds__\s*\([^)]*\)\s*)?"
_GLOBAL = re.compile(r"(extern\s+\"C\"\s+)?" + _LB + r"__global__\s+" + _LB + r"void\s+" + _LB + r"(\w+)\s*\(([^)]*)\)")
_EXTERN_C_BLOCK = re.compile(r'extern\s+"C"\s*\{')
_THINK = re.compile(r"<(think|thinking|reasoning)>.*?(?:</\1>|\Z)", re.S | re.I)
_THINK_END = re.compile(r"</(?:think|thinking|reasoning)>", re.I)

# Scalar parameter types by the launch-plan kind they accept; pointers take in/out/ws.
_SCALARS = {
    "i32": {"int", "int32_t", "unsigned", "unsigned int", "uint32_t", "signed int", "signed"},
    "i64": {"long long", "long long int", "int64_t", "unsigned long long", "uint64_t", "size_t", "long",
            "unsigned long", "ptrdiff_t", "long int"},
    "f32": {"float"},
    "f64": {"double"},
}
_C_TYPE = {"i32": "int", "i64": "long long", "f32": "float", "f64": "double"}  # what to suggest
_QUALIFIERS = re.compile(r"\b(const|volatile|__restrict__|__restrict|restrict)\b")

# Plan keys as models write them, compared lower-case without '_' / '-' / ' '.
_KERNEL_KEYS = {
    "name": "name", "kernel": "name", "kernelname": "name", "function": "name", "entry": "name",
    "grid": "grid", "blocks": "grid", "griddim": "grid", "gridsize": "grid", "numblocks": "grid",
    "block": "block", "threads": "block", "blockdim": "block", "blocksize": "block", "threadsperblock": "block",
    "numthreads": "block",
    "smem": "smem", "sharedmem": "smem", "sharedmemory": "smem", "dynamicsmem": "smem", "dynsmem": "smem",
    "sharedmembytes": "smem", "smembytes": "smem", "shmem": "smem", "dynamicsharedmemory": "smem",
    "dynamicsharedmem": "smem", "sharedmemorybytes": "smem",
    "args": "args", "arguments": "args", "params": "args", "parameters": "args",
    "cooperative": "cooperative", "pdl": "pdl", "cluster": "cluster", "clustersize": "cluster",
}
_PLAN_KEYS = {"kernels": "kernels", "launches": "kernels", "workspace": "workspace", "workspaces": "workspace",
              "options": "options", "nvrtcoptions": "options", "compileoptions": "options", "flags": "options"}
_ARG_KINDS = {"in": "in", "input": "in", "out": "out", "output": "out", "ws": "ws", "workspace": "ws",
              "i32": "i32", "int": "i32", "int32": "i32", "i64": "i64", "int64": "i64", "longlong": "i64",
              "f32": "f32", "float": "f32", "float32": "f32", "f64": "f64", "double": "f64", "float64": "f64"}
_NOTE_KEYS = {"comment", "comments", "description", "note", "notes", "purpose", "explanation"}  # prose, dropped
_PYTHON_WORDS = {"True": "true", "False": "false", "None": "null"}
_WORD = re.compile(r"([A-Za-z_$][\w$]*)(\s*:)?")  # a bare key when a colon follows
_ARG_NAME = re.compile(r"^(in|out|ws)(\d+)$")
_DEVICE_FN = re.compile(r"__device__\b[^;{}()]*?\b(\w+)\s*\(")
_PLAN_COMMENT = re.compile(r"/\*.*?\*/|(?:^[ \t]*//[^\n]*(?:\n|$))+", re.S | re.M)


@dataclass(frozen=True)
class Param:
    text: str
    pointer: bool
    scalar_kind: str | None  # i32/i64/f32/f64 for scalars we recognise


@dataclass(frozen=True)
class Kernel:
    params: list[Param]
    extern_c: bool  # unmangled, so the plan can launch it by name


# ---- the reply's parts -------------------------------------------------------------------

def strip_reasoning(reply: str) -> str:
    """The answer without its reasoning: `<think>...</think>` blocks (an unclosed one runs to
    the end), and everything before a lone `</think>` (templates that open the block in the
    prompt leave only the closing tag)."""
    text = _THINK.sub("", reply)
    ends = list(_THINK_END.finditer(text))
    return text[ends[-1].end():] if ends else text


def _scan(reply: str) -> tuple[list[tuple[str, str]], str]:
    """Fenced blocks and the prose around them, line by line. A fence with a language inside
    a block opens a nested block; a bare fence closes the innermost; a block still open at
    the end (a cut-off reply, a forgotten fence) ends there."""
    blocks: list[tuple[str, str]] = []
    prose: list[str] = []
    stack: list[tuple[str, str, list[str]]] = []  # (fence, language, lines)
    for line in reply.splitlines():
        m = _FENCE_OPEN.match(line)
        if m and stack and not m.group(2) and line.strip().startswith(stack[-1][0]):
            _, lang, lines = stack.pop()
            blocks.append((lang, "\n".join(lines) + "\n"))
        elif m and (not stack or m.group(2)):
            stack.append((m.group(1), m.group(2).lower(), []))
        else:
            (stack[-1][2] if stack else prose).append(line)
    while stack:
        _, lang, lines = stack.pop()
        blocks.append((lang, "\n".join(lines) + "\n"))
    return blocks, "\n".join(prose)


def _uncomment(source: str) -> str:
    return _COMMENTS.sub(lambda m: m.group(0) if m.group(0).startswith('"') else " ", source)


def kernel_params(source: str) -> dict[str, list[Param]]:
    """Every `extern "C"` kernel in the source and its parameters."""
    return {name: k.params for name, k in kernels_in(source).items() if k.extern_c}


def kernels_in(source: str) -> dict[str, Kernel]:
    """Every `__global__` function in the source, and whether its name is unmangled."""
    code = _uncomment(source)
    spans = [(m.start(), _matching_brace(code, m.end() - 1)) for m in _EXTERN_C_BLOCK.finditer(code)]
    kernels = {}
    for m in _GLOBAL.finditer(code):
        params = [p.strip() for p in m.group(3).split(",")]
        params = [] if params in ([""], ["void"]) else params
        extern_c = bool(m.group(1)) or any(a < m.start() < b for a, b in spans)
        kernels[m.group(2)] = Kernel([_param(p) for p in params], extern_c)
    return kernels


def _matching_brace(text: str, open_at: int) -> int:
    """Index of the brace closing the one at `open_at` (comments already removed), or the end."""
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def _param(text: str) -> Param:
    if "*" in text or "[" in text:
        return Param(text, True, None)
    words = _QUALIFIERS.sub(" ", text).split()
    type_name = " ".join(words[:-1])  # drop the parameter name
    kind = next((k for k, names in _SCALARS.items() if type_name in names), None)
    return Param(text, False, kind)


# ---- the launch plan -----------------------------------------------------------------------

def lenient_json(text: str) -> Any:
    """The first JSON object (or list of objects) in `text`, read as JSON5-ish: // and /* */
    comments, trailing commas, single-quoted strings, bare keys, Python's True/False/None.
    Raises ValueError."""
    first = re.search(r"\{|\[\s*\{", text)
    if first is None:
        raise ValueError("no JSON object found")
    out, i, depth = [], first.start(), 0
    while i < len(text):
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < len(text) and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            body = text[i + 1:j]
            out.append(json.dumps(body.replace("\\'", "'").replace('\\"', '"')) if c == "'" else text[i:j + 1])
            i = j + 1
            continue
        if text.startswith("//", i) or text.startswith("#", i):
            end = text.find("\n", i)
            i = end if end >= 0 else len(text)
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = end + 2 if end >= 0 else len(text)
            continue
        m = _WORD.match(text, i)
        if m:
            word = m.group(1)
            out.append(json.dumps(word) if m.group(2) else _PYTHON_WORDS.get(word, word))
            i = m.end(1)
            continue
        if c in "}]":
            while out and out[-1].strip() == "":
                out.pop()
            if out and out[-1] == ",":
                out.pop()  # a trailing comma
        out.append(c)
        depth += {"{": 1, "[": 1, "}": -1, "]": -1}.get(c, 0)
        i += 1
        if depth == 0:
            break
    return json.loads("".join(out))


def _plan_texts(blocks: list[tuple[str, str]], prose: str) -> list[str]:
    """Everything that may hold the plan, in reply order: JSON-like blocks, plan comments in
    code blocks, then an object in the prose."""
    texts = []
    for lang, body in blocks:
        if lang in _JSON_LANGS or body.lstrip().startswith("{"):
            texts.append(body)
        elif "kernels" in body:
            texts += [_comment_text(m.group(0)) for m in _PLAN_COMMENT.finditer(body) if "kernels" in m.group(0)]
    if not texts and "kernels" in prose:
        texts.append(prose[prose.rfind("{", 0, prose.find("kernels")):])
    return [t for t in texts if "{" in t]


def _comment_text(comment: str) -> str:
    """A comment's text without its markers: `//` runs and `/* ... */` with ` * ` margins."""
    if comment.lstrip().startswith("//"):
        return re.sub(r"^[ \t]*//", "", comment, flags=re.M)
    return re.sub(r"^[ \t]*\*(?!/)", "", comment[2:-2], flags=re.M)


def normalize_plan(d: Any) -> Any:
    """A plan as models write it -> the plan's own keys and forms; raises ProposerError
    naming any key that has no meaning here."""
    if isinstance(d, dict) and len(d) == 1 and isinstance(inner := next(iter(d.values())), dict) and "kernels" in inner:
        d = inner  # {"launch_plan": {...}}
    if isinstance(d, dict) and "kernels" not in d and any(_norm(k) in _KERNEL_KEYS for k in d):
        d = {"kernels": [d]}  # a single kernel's launch, without the list around it
    if isinstance(d, list) and d and all(isinstance(k, dict) and "name" in k for k in d):
        d = {"kernels": d}  # the kernels' list alone
    if not isinstance(d, dict):
        return d
    plan = _rename(d, _PLAN_KEYS, "the plan", ("kernels", "workspace", "options"))
    if isinstance(plan.get("kernels"), dict):
        plan["kernels"] = [plan["kernels"]]
    if isinstance(plan.get("kernels"), list):
        plan["kernels"] = [_kernel(k, i) for i, k in enumerate(plan["kernels"])]
    if isinstance(plan.get("workspace"), list):
        plan["workspace"] = [_rename(w, {"bytes": "bytes", "size": "bytes", "nbytes": "bytes", "sizebytes": "bytes",
                                         "zero": "zero", "zeroed": "zero", "zeroinit": "zero"},
                                     "a workspace entry", ("bytes", "zero")) if isinstance(w, dict) else w
                             for w in plan["workspace"]]
    return plan


def _kernel(k: Any, i: int) -> Any:
    if not isinstance(k, dict):
        return k
    k = _rename(k, _KERNEL_KEYS, f"kernel {i}", ("name", "grid", "block", "smem", "args", "cooperative", "pdl",
                                                 "cluster"))
    for dim in ("grid", "block"):
        v = k.get(dim)
        if isinstance(v, dict) and v and set(v) <= {"x", "y", "z"}:  # dim3 written as {"x": ..}
            k[dim] = [v.get("x", 1), v.get("y", 1), v.get("z", 1)]
    if isinstance(k.get("args"), list):
        k["args"] = [_arg(a) for a in k["args"]]
    return k


def _arg(a: Any) -> Any:
    """{"input": 0}, {"kind": "in", "index": 0}, "in0" -> {"in": 0}; anything else unchanged
    (the plan's own check says what is wrong with it)."""
    if isinstance(a, str) and _ARG_NAME.match(a):
        kind, n = _ARG_NAME.match(a).groups()
        return {kind: int(n)}
    if not isinstance(a, dict):
        return a
    if len(a) == 2 and {"kind", "type"} & set(a) and {"value", "index"} & set(a):
        kind = a.get("kind", a.get("type"))
        value = a.get("value", a.get("index"))
        a = {kind: value} if isinstance(kind, str) else a
    if len(a) == 1:
        kind, v = next(iter(a.items()))
        kind = _ARG_KINDS.get(_norm(kind), kind) if isinstance(kind, str) else kind
        return {kind: v}
    return a


def _norm(key: Any) -> str:
    return re.sub(r"[\s_-]", "", key).lower() if isinstance(key, str) else ""


def _rename(d: dict, names: dict[str, str], where: str, accepted: tuple[str, ...]) -> dict:
    out, unknown = {}, []
    for key, value in d.items():
        name = names.get(_norm(key))
        if name is None:
            if _norm(key) not in _NOTE_KEYS:
                unknown.append(key)
        elif name in out:
            raise ProposerError(f'launch plan: {where} gives "{name}" twice (as {key!r} too); give it once')
        else:
            out[name] = value
    if unknown:
        raise ProposerError(f"launch plan: {where} has key(s) {', '.join(map(json.dumps, unknown))} that kforge does "
                            f"not know; the keys are {', '.join(accepted)}")
    return out


# ---- putting them together -------------------------------------------------------------------

def _read_plans(texts: list[str]) -> tuple[list[LaunchPlan], str | None]:
    """The plans that read cleanly, and the problem with the last one that did not."""
    plans, problem = [], None
    for text in texts:
        try:
            plans.append(LaunchPlan.from_json(normalize_plan(lenient_json(text))))
        except (ValueError, RecursionError) as e:
            problem = f"launch plan is not valid JSON: {e}"
        except PlanError as e:
            problem = f"launch plan: {e}"
        except ProposerError as e:
            problem = str(e)
    return plans, problem


def _choose(sources: list[str], plans: list[LaunchPlan], problem: str | None) -> tuple[str, LaunchPlan]:
    """The last plan whose kernels the CUDA blocks define, with its source: the last block that
    defines them all (earlier ones are drafts), else the last block defining each; plus the
    blocks of `__device__` helpers that source calls and does not define."""
    if not sources:
        raise ProposerError("found no ```cuda block with the kernel source; put the whole source in one ```cuda block")
    if not plans:
        raise ProposerError(problem or 'found no launch plan; put it in one ```json block: {"kernels": [...], '
                                       '"workspace": [], "options": []}')
    defined = [set(kernel_params(s)) for s in sources]
    for plan in reversed(plans):
        names = {k.name for k in plan.kernels}
        whole = [i for i, d in enumerate(defined) if names <= d]
        picked = {whole[-1]} if whole else {max((i for i, d in enumerate(defined) if n in d), default=-1)
                                            for n in names}
        if -1 in picked:
            continue
        code = "\n".join(sources[i] for i in sorted(picked))
        helpers = {i for i, s in enumerate(sources) if i not in picked and not kernels_in(s) and _helps(s, code)}
        return "\n".join(sources[i] for i in sorted(picked | helpers)), plan
    return sources[-1], plans[-1]  # nothing matches: check_bindings says why


def _helps(block: str, code: str) -> bool:
    """`block` defines a device function that `code` calls but does not define."""
    own = set(_DEVICE_FN.findall(_uncomment(code)))
    return any(re.search(rf"\b{n}\b", code) for n in set(_DEVICE_FN.findall(_uncomment(block))) - own)


def check_bindings(plan: LaunchPlan, source: str) -> None:
    """Each launched kernel exists in the source and its parameters take the plan's arguments."""
    kernels = kernels_in(source)
    for k in plan.kernels:
        found = kernels.get(k.name)
        if found is not None and not found.extern_c:
            raise ProposerError(f'kernel {k.name} is not extern "C": its name is mangled and kforge cannot find it; '
                                f'declare it `extern "C" __global__ void {k.name}(...)` (no templates)')
        if found is None:
            defined = ", ".join(sorted(n for n, x in kernels.items() if x.extern_c)) or "none"
            raise ProposerError(f'the plan launches "{k.name}" but the source defines no `extern "C" __global__ '
                                f'void {k.name}(...)` (extern "C" kernels defined: {defined})')
        params = found.params
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
                raise ProposerError(f"kernel {k.name}, parameter {n} `{p.text}`: the plan passes {arg}, which "
                                    f"needs a parameter of type {_C_TYPE[kind]}")


def parse_reply(reply: str, card: Card, proposer: str = "llm") -> Candidate:
    """The candidate in a reply; raises ProposerError saying what to change, whatever is wrong."""
    answer = strip_reasoning(reply)
    if not answer.strip():
        raise ProposerError("the reply was empty" if not reply.strip() else
                            "the reply held only reasoning, no answer after it")
    try:
        blocks, prose = _scan(answer)
        sources = [b for lang, b in blocks if lang in _CUDA_LANGS or (lang not in _JSON_LANGS and "__global__" in b)]
        plans, problem = _read_plans(_plan_texts(blocks, prose))
        source, plan = _choose(sources, plans, problem)
        plan.validate(len(card.inputs), len(card.outputs))
        check_bindings(plan, source)
    except PlanError as e:
        raise ProposerError(f"launch plan: {e}") from e
    except ProposerError:
        raise
    except Exception as e:  # noqa: BLE001 - a reply is untrusted input: any surprise is feedback, never a crash
        raise ProposerError(f"the answer could not be read ({type(e).__name__}: {e}); use the answer format") from e
    kind = _KIND.search(prose)
    note = " ".join(line.strip() for line in prose.splitlines() if line.strip() and not _KIND.match(line))
    return Candidate(source=source, plan=plan, kind=kind.group(1).lower() if kind else "custom",
                     proposer=proposer, note=note[:300])
