"""Correctness checks of one candidate's results: pure torch, any device.

Each check returns None when it passes, else a Failure naming the check and carrying the
evidence (the failing element, its value and the expected one). The evaluation worker
runs them in the order docs/security.md ("The evaluator: what a kernel must prove") lists
the cheats they catch: every element written (partial writes), values within the
scale-aware tolerance and NaN/Inf only where eager has them (silent precision loss), not a
constant when eager is not (constant outputs), inputs unchanged (input mutation), repeated
runs agreeing (races). Speed flags (speed beyond physics) and the vendor-library scan live
here too: they are pure functions of numbers and text.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from .tolerance import Tolerance, chunks
from .verdict import Measurement, Verdict, facing_spread

# 0xFF in every byte is a NaN in every IEEE float format and -1 (or the maximum) in
# every integer format: a written element is unlikely to hold it where eager does not.
POISON_BYTE = 0xFF
# The second kernel run's poison: no element can equal both patterns, so a kernel that
# skips the elements where eager's value is the first (-1 in an int output, 255 in a
# uint8 one) is still caught.
SECOND_POISON_BYTE = 0x7F

# Speedups above this are physically suspicious for the memory-bound ops kforge targets.
SUSPICIOUS_SPEEDUP = 10.0


@dataclass
class Failure:
    check: str  # dtype | shape | stride | unwritten | nonfinite | mismatch | constant | inputs_mutated | nondeterministic
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class Comparison:
    """Result of compare(): the error metrics always, the first failure if any."""

    max_abs_err: float
    max_rel_err: float
    worst: dict[str, Any] | None  # {"index": flat index, "got": ..., "expected": ...}
    failure: Failure | None

    @property
    def ok(self) -> bool:
        return self.failure is None


# ---- element access -------------------------------------------------------------------

def _flat(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Elements in logical (row-major) order, on `device` (default: where t is). The
    checks run where the tensors are: on the GPU, copying them to the host would cost
    more than the whole evaluation."""
    return t.detach().to(device or t.device).reshape(-1)


def _rows_of_bytes(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """[numel, itemsize] uint8: each element's bit pattern."""
    flat = _flat(t, device).contiguous()
    return flat.view(torch.uint8).reshape(flat.numel(), t.element_size())


def _as_f64(flat: torch.Tensor) -> torch.Tensor:
    if flat.is_complex():
        return torch.view_as_real(flat.to(torch.complex128).resolve_conj()).reshape(-1)
    return flat.to(torch.float64)


def _item(x: torch.Tensor) -> Any:
    v = x.item()
    return repr(v) if isinstance(v, float) and not math.isfinite(v) else v


def poison(t: torch.Tensor, byte: int = POISON_BYTE) -> torch.Tensor:
    """Fill every byte of t's whole storage with `byte` (in place); returns t.
    Meant for buffers kforge allocated for one output: the storage is t's alone."""
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    raw.fill_(byte)
    return t


# ---- checks ---------------------------------------------------------------------------

def check_meta(out: torch.Tensor, ref: torch.Tensor) -> Failure | None:
    """Dtype, shape and stride of the output equal the reference's (strides of size-1
    dims do not matter)."""
    if out.dtype != ref.dtype:
        return Failure("dtype", f"output dtype {out.dtype} but eager returns {ref.dtype}",
                       {"got": str(out.dtype), "expected": str(ref.dtype)})
    if out.shape != ref.shape:
        return Failure("shape", f"output shape {tuple(out.shape)} but eager returns {tuple(ref.shape)}",
                       {"got": list(out.shape), "expected": list(ref.shape)})
    for d, n in enumerate(out.shape):
        if n > 1 and out.stride(d) != ref.stride(d):
            return Failure("stride", f"output strides {out.stride()} but eager returns {ref.stride()}",
                           {"got": list(out.stride()), "expected": list(ref.stride())})
    return None


def check_written(out: torch.Tensor, ref: torch.Tensor, byte: int = POISON_BYTE) -> Failure | None:
    """Every element was written: none still holds the poison (`out` was filled with
    `byte`) where eager's does not."""
    if not out.numel():
        return None
    left = _rows_of_bytes(out).eq(byte).all(1) & ~_rows_of_bytes(ref, out.device).eq(byte).all(1)
    n = int(left.sum())
    if not n:
        return None
    first = int(left.nonzero()[0, 0])
    return Failure("unwritten", f"{n} of {out.numel()} output elements were never written (first at flat index {first})",
                   {"count": n, "numel": out.numel(), "index": first})


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> Comparison:
    """Values of `out` against eager's `ref`: |got - expected| <= atol + rtol * |expected|
    where both are finite, NaN and Inf exactly where eager has them. In runs of CHUNK elements:
    over a whole 16384x16384 output, the float64 temporaries held more than an 80 GB GPU."""
    meta = check_meta(out, ref)
    if meta:
        return Comparison(math.inf, math.inf, None, meta)
    if not out.numel():
        return Comparison(0.0, 0.0, None, None)
    per = 2 if out.is_complex() else 1  # complex values compare as (real, imag) pairs
    gs, es = _flat(out), _flat(ref, out.device)
    max_abs = max_rel = 0.0
    special_n = over_n = 0
    first_special = worst = None
    worst_over = -math.inf
    for a, b in chunks(gs.numel()):
        g, e = _as_f64(gs[a:b]), _as_f64(es[a:b])
        finite = torch.isfinite(g) & torch.isfinite(e)
        err = torch.where(finite, (g - e).abs(), torch.zeros_like(g))
        mag = e.abs()
        rel = torch.where(finite & (mag > 0), err / mag.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(g))
        max_abs, max_rel = max(max_abs, float(err.max())), max(max_rel, float(rel.max()))
        special = ~finite & ~(g == e) & ~(g.isnan() & e.isnan())
        if special.any():
            special_n += int(special.sum())
            if first_special is None:
                i = int(special.nonzero()[0, 0])
                first_special = {"index": (a * per + i) // per, "got": _item(g[i]), "expected": _item(e[i])}
        over = torch.where(finite, err - (tol.atol + tol.rtol * mag), torch.full_like(g, -math.inf))
        i = int(over.argmax())  # the first of the largest, as over the whole
        if worst is None or float(over[i]) > worst_over:
            worst_over = float(over[i])
            worst = {"index": (a * per + i) // per, "got": _item(g[i]), "expected": _item(e[i])}
        over_n += int((over > 0).sum())
    if first_special is not None:
        w = first_special
        return Comparison(max_abs, max_rel, w, Failure(
            "nonfinite", f"{special_n} element(s) are NaN/Inf where eager's are not (or the reverse); "
            f"first at flat index {w['index']}: got {w['got']}, expected {w['expected']}",
            {"count": special_n, "worst": w}))
    if worst_over <= 0:
        return Comparison(max_abs, max_rel, worst, None)
    return Comparison(max_abs, max_rel, worst, Failure(
        "mismatch", f"{over_n} of {out.numel()} elements outside tolerance (atol {tol.atol:.3g}, rtol {tol.rtol:.3g}); "
        f"worst at flat index {worst['index']}: got {worst['got']!r}, expected {worst['expected']!r}",
        {"count": over_n, "atol": tol.atol, "rtol": tol.rtol, "max_abs_err": max_abs, "max_rel_err": max_rel,
         "worst": worst}))


def check_not_constant(out: torch.Tensor, ref: torch.Tensor) -> Failure | None:
    """Canary: a constant output (all zeros included) fails when eager's is not constant."""
    if out.numel() < 2:
        return None
    e = _flat(ref)
    e = e[torch.isfinite(_as_f64(e)).reshape(e.numel(), -1).all(1)] if e.is_floating_point() or e.is_complex() else e
    if e.numel() < 2 or bool((e == e[0]).all()):
        return None
    rows = _rows_of_bytes(out)
    if bool((rows == rows[0]).all()):
        value = _item(_flat(out)[0])
        return Failure("constant", f"every output element equals {value!r} while eager's output varies",
                       {"value": value})
    return None


def check_inputs_unchanged(before: list[torch.Tensor], after: list[torch.Tensor], written: set[int]) -> Failure | None:
    """Inputs the op does not write are bit-for-bit what they were before the kernel ran."""
    for i, (b, a) in enumerate(zip(before, after)):
        if i in written or not b.numel():
            continue
        changed = (_rows_of_bytes(b) != _rows_of_bytes(a, b.device)).any(1)
        if changed.any():
            first = int(changed.nonzero()[0, 0])
            return Failure("inputs_mutated", f"the kernel changed input {i} ({int(changed.sum())} elements, first at flat "
                           f"index {first}), which the op only reads",
                           {"input": i, "count": int(changed.sum()), "index": first,
                            "before": _item(_flat(b)[first]), "after": _item(_flat(a)[first])})
    return None


def check_repeatable(first: list[torch.Tensor], second: list[torch.Tensor], tols: list[Tolerance] | None) -> Failure | None:
    """Two runs on the same inputs agree: bit for bit, or within tolerance when the
    candidate declares atomics (tols given)."""
    for j, (a, b) in enumerate(zip(first, second)):
        if not a.numel():
            continue
        if tols is None:
            differ = (_rows_of_bytes(a) != _rows_of_bytes(b, a.device)).any(1)
            if differ.any():
                i = int(differ.nonzero()[0, 0])
                return Failure("nondeterministic", f"output {j} differs between two runs on the same inputs in "
                               f"{int(differ.sum())} elements (first at flat index {i}); declare atomics in the "
                               "candidate's knobs if the op allows reordering",
                               {"output": j, "count": int(differ.sum()), "index": i,
                                "first": _item(_flat(a)[i]), "second": _item(_flat(b)[i])})
        else:
            c = compare(b, a, tols[j])
            if c.failure:
                return Failure("nondeterministic", f"output {j} of a second run is outside tolerance of the first: "
                               f"{c.failure.message}", {"output": j, **c.failure.evidence})
    return None


# ---- speed ----------------------------------------------------------------------------

def speed_flags(kernel_us: float, eager_us: float, floor_us: float) -> list[str]:
    """Results to review: faster than moving the card's bytes at copy bandwidth allows, or
    more than SUSPICIOUS_SPEEDUP times faster than eager (speed beyond physics)."""
    flags = []
    if kernel_us < floor_us:
        flags.append("beyond_roofline")
    if kernel_us * SUSPICIOUS_SPEEDUP < eager_us:
        flags.append("over_10x")
    return flags


def speed_verdict(kernel: Measurement, eager: Measurement) -> tuple[Verdict, str]:
    """VALID only when the kernel's median beats eager's by more than the timing noise
    (verdict.facing_spread of the two); a tie within noise is SLOWER (never ship a maybe)."""
    margin = facing_spread(eager.summary(), kernel.summary())
    gain = eager.median - kernel.median
    if gain > margin:
        return Verdict.VALID, f"{eager.median / kernel.median:.2f}x faster than eager ({kernel.median:.2f} vs {eager.median:.2f} us)"
    return Verdict.SLOWER, (f"not faster than eager beyond noise: {kernel.median:.2f} vs {eager.median:.2f} us, "
                            f"margin needed {margin:.2f} us")


# ---- candidate kind -------------------------------------------------------------------

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_VENDOR = re.compile(
    r"#\s*include\s*[<\"](?P<header>(?:cublas|cudnn|cutlass|cute|cub|thrust|cufft|curand|cusparse|cusolver)[\w/.]*)[>\"]"
    r"|\b(?P<ns>cub|thrust|cutlass|cute)\s*::"
    r"|\b(?P<call>(?:cublas|cudnn|cufft|cusparse|cusolver)\w*)\s*\(",
)


def vendor_uses(source: str) -> list[str]:
    """Vendor-library headers, namespaces and calls in CUDA source (comments ignored)."""
    found = []
    for m in _VENDOR.finditer(_COMMENTS.sub(" ", source)):
        what = m.group("header") or (m.group("ns") and m.group("ns") + "::") or m.group("call")
        if what not in found:
            found.append(what)
    return found
