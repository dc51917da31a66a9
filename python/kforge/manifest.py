"""The .cast manifest's fields, each with its type and range, checked before anything reads them.

A manifest is untrusted input: kforge.package and the dashboard read it only through
read_manifest() or check_manifest(), which refuse (PackageError, one line naming the field)
any field of the wrong type, a number that is not finite or out of range, text over
MAX_TEXT characters, an op name that is not `ns::name.overload`, and any field this format
does not have. Card guards and launch plans get their deeper checks where they are parsed
(kforge.package: Card, LaunchPlan).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

from . import castfile
from .candidate import KINDS, LaunchPlan
from .errors import PackageError, PlanError

# 2: each card carries a second decision, "compile" (into kforge.compile's graphs, against
# torch.compile's time), and a kernel ships where either decision dispatches it. Format 1
# packages load, their kernels in no compiled graph (no torch.compile time to beat).
# 3: "model_check", the whole model under torch.compile and kforge.compile, which kforge.compile
# follows; format 1 and 2 packages load without one (kforge.compile trusts the cards' decisions).
# 4: a region card's "baseline" says its basis ("gpu": each call timed alone on the GPU, or
# "dispatched") and its kernel's time on it; kforge.optimize chooses overlapping regions by them.
# Format 1 to 3 packages load, their overlaps chosen as dispatched.
FORMAT = 4
MAX_TEXT = 4000  # characters in any manifest text (reasons, notes, names); the writer cuts to it
MAX_DEPTH = 8  # nesting of free-form evidence (tolerances, knobs)

# ns::name.overload; a region card's op is "region::" and its ops' names joined by "+".
OP_NAME = re.compile(r"^(?!__)[A-Za-z_]\w*::[A-Za-z_]\w*(\.[A-Za-z_]\w*)?(\+[A-Za-z_]\w*(\.[A-Za-z_]\w*)?)*$")
ARCH = re.compile(r"^sm_(\d+)a?$")
_CARD_ID = re.compile(r"^[0-9a-f]{16}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

Check = Callable[[Any, str], None]


def _bad(where: str, what: str) -> PackageError:
    return PackageError(f"malformed manifest: {where} must be {what}; rebuild the package with `kforge package`")


def _text(v: Any, where: str) -> None:
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        raise _bad(where, f"text of at most {MAX_TEXT} characters")


def _count(v: Any, where: str) -> None:
    if type(v) is not int or not 0 <= v < 2**63:
        raise _bad(where, "a non-negative integer")


def _number(v: Any, where: str) -> None:
    if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
        raise _bad(where, "a finite non-negative number")


def _matching(rx: re.Pattern, what: str) -> Check:
    def check(v: Any, where: str) -> None:
        if not isinstance(v, str) or not rx.match(v):
            raise _bad(where, what)
    return check


def _one_of(*values: str) -> Check:
    def check(v: Any, where: str) -> None:
        if v not in values:
            raise _bad(where, " or ".join(map(repr, values)))
    return check


def _optional(check: Check) -> Check:
    def opt(v: Any, where: str) -> None:
        if v is not None:
            check(v, where)
    return opt


def _list_of(check: Check) -> Check:
    def each(v: Any, where: str) -> None:
        if not isinstance(v, list):
            raise _bad(where, "a list")
        for i, x in enumerate(v):
            check(x, f"{where}[{i}]")
    return each


def _kind(t: type, what: str) -> Check:
    """Only the container type: its contents are checked where they are parsed."""
    def check(v: Any, where: str) -> None:
        if not isinstance(v, t):
            raise _bad(where, what)
    return check


def _plain(v: Any, where: str, depth: int = 0) -> None:
    """Free-form evidence: texts, finite numbers, booleans, null, lists and objects of them."""
    if depth > MAX_DEPTH:
        raise _bad(where, f"nested at most {MAX_DEPTH} deep")
    if isinstance(v, dict):
        for k, x in v.items():
            _text(k, f"{where} key")
            _plain(x, f"{where}.{k}", depth + 1)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _plain(x, f"{where}[{i}]", depth + 1)
    elif isinstance(v, float) and not math.isfinite(v):
        raise _bad(where, "finite")
    elif isinstance(v, str):
        _text(v, where)
    elif v is not None and type(v) not in (bool, int, float):
        raise _bad(where, "plain JSON")


def _record(fields: dict[str, Check], required: tuple[str, ...] = ()) -> Check:
    """An object with only these fields (each checked), `required` ones present."""
    def check(v: Any, where: str) -> None:
        if not isinstance(v, dict):
            raise _bad(where, "an object")
        unknown = sorted(set(v) - set(fields))
        if unknown:
            raise _bad(f"{where}.{unknown[0]}", f"absent (not a field of package format {FORMAT})")
        for name, field_check in fields.items():
            if name in v:
                field_check(v[name], f"{where}.{name}")
            elif name in required:
                raise _bad(f"{where}.{name}", "present")
    return check


def _plan(v: Any, where: str) -> None:
    """A launch plan's own checks (kinds of arguments, workspace sizes); fitting the card is load()'s."""
    try:
        LaunchPlan.from_json(v if isinstance(v, dict) else None)
    except PlanError as e:
        raise _bad(where, f"a launch plan ({e})") from e


_US = _optional(_number)
_CARD = _record({
    "id": _matching(_CARD_ID, "a card id (16 hex digits)"),
    "op": _matching(OP_NAME, "an op name like aten::softmax.int"),
    "schema": _text, "family": _text, "summary": _text, "calls": _count, "share": _optional(_number),
    "module_paths": _list_of(_text),
    "guard": _record({"args": _kind(list, "a list"), "arch": _text}, required=("args", "arch")),
    "outputs": _kind(list, "a list"), "aliases": _kind(dict, "an object"),
    "region": _optional(_kind(dict, "an object")),
    # A region card's baseline: its eager time less what the op kernels inside it save, and its
    # kernel's time, on one basis (GPU times, or as dispatched; packages before it: dispatched).
    "baseline": _optional(_record({"basis": _optional(_one_of("gpu", "dispatched")), "eager_us": _US,
                                   "kernel_us": _US, "op_savings_us": _plain, "baseline_us": _optional(_plain)})),
    "decision": _one_of("dispatched", "fallback"), "reason": _text, "kind": _optional(_one_of(*KINDS)),
    "timing": _optional(_record({k: _US for k in ("eager_us", "kernel_us", "eager_dispatched_us", "dispatched_us",
                                                   "noise_us")})),
    "error": _optional(_record({"max_abs_err": _US, "max_rel_err": _US, "tolerances": _plain})),
    # Format 2: the decision for kforge.compile's graphs (null: no torch.compile time to decide against).
    "compile": _optional(_record({"decision": _optional(_one_of("dispatched", "fallback")), "reason": _text,
                                  "compile_us": _US, "kernel_us": _US, "noise_us": _US},
                                 required=("decision", "reason"))),
    "flags": _list_of(_text),
    "candidate": _optional(_record({"log_id": _optional(_count), "digest": _optional(_text),
                                    "proposer": _optional(_text), "knobs": _plain, "note": _optional(_text)})),
    "plan": _optional(_plan),
    "files": _optional(_record({"source": _text, "cubin": _text}, required=("source", "cubin"))),
    "hashes": _optional(_record({k: _matching(_SHA256, "a sha256 in hex") for k in ("source", "cubin")},
                                required=("source", "cubin"))),
}, required=("id", "decision", "reason"))

_MANIFEST = _record({
    "format": _count, "kforge": _text, "torch": _text,
    "cuda": _record({"nvrtc": _optional(_text), "torch_cuda": _optional(_text)}),
    "gpu": _record({"name": _text, "arch": _matching(ARCH, "an arch like sm_90")}, required=("name", "arch")),
    "run_id": _optional(_text),
    "selection": _record({"noise_factor": _number, "margin": _number}),
    "cards": _list_of(_CARD),
    # Which overlapping region cards were chosen at each captured call site, with the numbers.
    "regions": _record({"sites": _plain}),
    # Format 3: the model check's verdict on kforge.compile against torch.compile (kforge.modelcheck).
    "model_check": _record({
        "verdict": _one_of("faster", "level", "slower"), "use": _one_of("kforge.compile", "torch.compile"),
        "torch_compile_us": _number, "kforge_compile_us": _number, "noise_us": _number, "device": _text,
        "compiled_cards": _list_of(_matching(_CARD_ID, "a card id (16 hex digits)")),
        "drop": _list_of(_matching(_CARD_ID, "a card id (16 hex digits)")),
        "leave_one_out": _list_of(_record({"card": _matching(_CARD_ID, "a card id (16 hex digits)"),
                                           "kforge_compile_us": _number, "verdict": _one_of("faster", "level", "slower")},
                                          required=("card", "kforge_compile_us", "verdict"))),
        # Format 3 too: kforge.optimize against eager, which kforge.optimize follows (absent before).
        "optimize": _record({mode: _record({"verdict": _one_of("faster", "level", "slower"),
                                            "use": _one_of("kforge.optimize", "eager"), "eager_us": _number,
                                            "optimize_us": _number}, required=("verdict", "use"))
                             for mode in ("ops", "cuda_graphs")})},
        required=("verdict", "use", "torch_compile_us", "kforge_compile_us", "noise_us")),
}, required=("format", "kforge", "torch", "gpu", "cards"))


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a finite number")


def check_manifest(path: Path, raw: bytes) -> dict:
    """The manifest in `raw`, parsed and checked field by field; PackageError if any is wrong."""
    try:
        manifest = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deep enough to exhaust the stack
        raise PackageError(f"malformed manifest in {path}: not JSON ({e}); rebuild the package") from e
    if isinstance(manifest, dict) and type(manifest.get("format")) is int and manifest["format"] > FORMAT:
        raise PackageError(f"{path} was written by a newer kforge (package format {manifest['format']}; this kforge "
                           f"reads up to {FORMAT}): upgrade kforge")
    _MANIFEST(manifest, "manifest")
    if manifest["format"] < 1:
        raise _bad("manifest.format", f"1 to {FORMAT}")
    return manifest


class Contents(NamedTuple):
    manifest: dict  # checked field by field
    members: dict[str, bytes]  # every entry, checksums verified
    integrity: str  # what the package's integrity rests on, for the audit (castfile.check_signature)


def read_manifest(path: str | Path, trusted_keys: Iterable[str | Path | bytes] | None = None) -> Contents:
    """The .cast at `path`, read within castfile's limits, its checksums verified, its
    signature checked against `trusted_keys` when given, and its manifest checked. Raises
    PackageError."""
    path = Path(path)
    members = castfile.read_members(path)
    castfile.verify_checksums(path, members)
    integrity = castfile.check_signature(path, members, trusted_keys)
    if castfile.MANIFEST not in members:
        raise PackageError(f"{path} has no {castfile.MANIFEST}; it is not a .cast package")
    return Contents(check_manifest(path, members[castfile.MANIFEST]), members, integrity)


_EM_CUDA = 190


def cubin_sm(image: bytes) -> int | None:
    """The SM number a cubin was built for (90 for sm_90), or None if it is not a CUDA ELF (PTX, junk)."""
    if len(image) < 52 or image[:4] != b"\x7fELF" or image[4] != 2:
        return None
    if int.from_bytes(image[18:20], "little") != _EM_CUDA:
        return None
    flags = int.from_bytes(image[48:52], "little")
    # CUDA 12.8+ cubins (ELF ABI version >= 8) keep the SM in bits 8-15 of e_flags, older ones in bits 0-7.
    return (flags >> 8) & 0xFF if image[8] >= 8 else flags & 0xFF


def arch_sm(arch: str) -> int | None:
    m = ARCH.match(arch or "")
    return int(m.group(1)) if m else None
