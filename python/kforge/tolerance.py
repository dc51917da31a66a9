"""Per-card tolerances, derived from eager's own error against a float64 reference.

For one input set, eager runs again on the inputs upcast to float64 (on the same
device; ops without float64 kernels fall back to float32 on the CPU, and when even that
fails only the dtype floor is used). Eager's error in its own dtype against that
reference says how exact this op can be in this dtype; a candidate may be somewhat
less exact than eager, never much:

    allowed |got - expected| <= atol + rtol * |expected|        (expected = eager's output)

    rtol = the dtype's floor (about one ulp), times the roundings on a region's chain
    atol = scale * clamp(SLACK * excess / scale, floor, cap)

`excess` is the smallest atol that lets eager itself pass with that rtol against float64's
answer rounded to the output's dtype (what an exact kernel returns); `scale` is the RMS of the float64 reference's finite values. Scaling by the
reference's magnitude is what makes a wrong answer fail at every magnitude: a softmax row
of 4096 holds values near 2.4e-4, where a blanket atol of 1e-2 passes all zeros (a
constant output). SLACK = 4: comparing a candidate with eager adds both their errors, so 4x lets a
candidate be about 3x less exact than eager and still pass. The cap keeps an op whose
eager is itself inexact from loosening the check into meaninglessness. A region card's
output that eager rounds to a half type at several ops in turn (group_norm then silu, in
bf16) gets one ulp of rtol per rounding on its longest chain, at most MAX_ULPS: a fused
kernel that rounds where eager does still sees its intermediates differ by an ulp (another
summation order), and each later op carries that ulp forward and adds its own.

Integer and bool outputs must match exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .cards import Card

SLACK = 4.0
MAX_ULPS = 3

# dtype: (rtol floor, atol floor / scale, atol cap / scale). The half-precision rtol floors
# are one ulp at the bottom of a binade (2^-7 for bf16's 7 stored mantissa bits, 2^-10 for
# fp16's 10): two roundings of the same exact value may differ by that much.
_BOUNDS: dict[torch.dtype, tuple[float, float, float]] = {
    torch.float64: (1e-12, 1e-12, 1e-9),
    torch.float32: (1e-5, 1e-5, 1e-3),
    torch.float16: (2.0**-10, 2.0**-11, 5e-2),
    torch.bfloat16: (2.0**-7, 2.0**-8, 5e-2),
}


CHUNK = 1 << 24  # elements compared at a time: float64 temporaries of 128 MB each, whatever the output's size


def chunks(n: int):
    """(start, stop) of consecutive runs of at most CHUNK of n elements (this module's and
    validate.compare's passes over an output)."""
    step = CHUNK
    return ((a, min(a + step, n)) for a in range(0, n, step))


@dataclass(frozen=True)
class Tolerance:
    """What one output may differ from eager's: |got - expected| <= atol + rtol * |expected|."""

    atol: float
    rtol: float
    how: str

    @property
    def exact(self) -> bool:
        return self.atol == 0.0 and self.rtol == 0.0

    def to_json(self) -> dict:
        return asdict(self)


def bounds(dtype: torch.dtype) -> tuple[float, float, float]:
    """(rtol floor, atol floor, atol cap), the last two relative to the output's scale."""
    if dtype in _BOUNDS:
        return _BOUNDS[dtype]
    if dtype.is_complex:
        return bounds(dtype.to_real())
    eps = torch.finfo(dtype).eps  # fp8 and friends: a few ulps, capped like the half types
    return (2 * eps, eps, max(5e-2, 4 * eps))


def observed(card: Card, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a candidate is judged on: the outputs, then the inputs the op writes that no
    output aliases (e.g. running statistics updated in place)."""
    aliased = set(card.aliases.values())
    return list(outputs) + [inputs[i] for i in sorted(card.written_inputs) if i not in aliased]


def derive(card: Card, inputs: list[torch.Tensor], reference: list[torch.Tensor]) -> list[Tolerance]:
    """One Tolerance per observed tensor (see `observed`), for this input set.

    `inputs` are the values eager ran on (they are not modified); `reference` is
    `observed(card, inputs_after_eager, eager_outputs)`, in the card's dtypes. Derive per
    input set: the scale follows that set's values."""
    precise, how_ref = _precise_reference(card, inputs)
    tols = []
    for j, ref in enumerate(reference):
        if not (ref.is_floating_point() or ref.is_complex()):
            tols.append(Tolerance(0.0, 0.0, f"exact: {ref.dtype} output"))
            continue
        hi = precise[j] if precise is not None and j < len(precise) else None
        ulps = card.region.roundings(card.region.outputs[j]) if card.region is not None and j < len(card.region.outputs) else 1
        tols.append(_from_error(ref, hi, how_ref, min(max(ulps, 1), MAX_ULPS)))
    return tols


def _from_error(ref: torch.Tensor, hi: torch.Tensor | None, how_ref: str, ulps: int = 1) -> Tolerance:
    rtol, floor, cap = bounds(ref.dtype)
    name = str(ref.dtype).removeprefix("torch.")
    if ulps > 1:
        rtol, name = rtol * ulps, f"{name} x {ulps} roundings"
    # in runs of CHUNK elements, as validate.compare: float64 copies of a whole 1 GB output do not
    # fit. One pass gives the scale (the RMS of the finite values) and eager's worst excess.
    src = (hi if hi is not None else ref).detach().reshape(-1)
    refs = ref.detach().reshape(-1)
    squares, count, worst = 0.0, 0, None
    for a, b in chunks(src.numel()):
        basis = _real64(src[a:b])
        finite = basis[torch.isfinite(basis)]
        squares, count = squares + float(finite.square().sum()), count + finite.numel()
        if hi is None:
            continue
        got = _real64(refs[a:b]).to(basis.device)  # the reference may have come from the CPU fallback
        # eager's error against the correctly rounded answer, what an exact kernel returns in this
        # dtype: measured against the unrounded one, an eager just inside its rtol on one side left
        # no room for a kernel's own last rounding on the other (fp16 cumprod, 2 ulps apart)
        exact = _real64(src[a:b].to(ref.dtype)).to(basis.device) if hi.dtype != ref.dtype else basis
        both = torch.isfinite(got) & torch.isfinite(exact)
        excess = (got - exact).abs().sub(rtol * exact.abs()).clamp_min(0.0)[both]
        if excess.numel():
            worst = max(worst or 0.0, float(excess.max()))
    scale = math.sqrt(squares / count) if count else 0.0
    scale = max(scale, torch.finfo(torch.float64).tiny)  # an all-zero output must be matched exactly
    if hi is None:
        return Tolerance(floor * scale, rtol, f"{name} floor x rms {scale:.3g} ({how_ref})")
    measured = worst / scale if worst is not None else 0.0
    rel = min(max(SLACK * measured, floor), cap)
    which = "floor" if rel == floor else "cap" if rel == cap else f"{SLACK:g}x eager's error"
    how = (f"{name}: eager vs {how_ref} needs atol {measured:.3g} x rms {scale:.3g}; "
           f"atol = {rel:.3g} x rms ({which}), rtol = {rtol:.3g} ({name} floor)")
    return Tolerance(rel * scale, rtol, how)


def _real64(t: torch.Tensor) -> torch.Tensor:
    """float64 values on the tensor's own device (the float64 reference already lives
    there; on the CPU these passes over a 100 MB card took seconds per input set);
    complex numbers as (real, imag) pairs."""
    t = t.detach()
    if t.is_complex():
        return torch.view_as_real(t.to(torch.complex128).resolve_conj())
    return t.to(torch.float64)


def _precise_reference(card: Card, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor] | None, str]:
    """Eager on the inputs upcast to float64 on their device, else float32 on the CPU."""
    errors = []
    for dtype, device in ((torch.float64, None), (torch.float32, torch.device("cpu"))):
        try:
            ups = [_upcast(t, dtype, device) for t in inputs]
            outs = card.call_eager(ups, device=device or (inputs[0].device if inputs else None))
        except (RuntimeError, TypeError, NotImplementedError) as e:
            errors.append(f"{dtype} failed: {str(e).splitlines()[0][:120]}")
            continue
        where = (device or (inputs[0].device if inputs else torch.device("cpu"))).type
        return observed(card, ups, outs), f"{str(dtype).removeprefix('torch.')} eager on {where}"
    return None, "no precise reference: " + "; ".join(errors)


def _upcast(t: torch.Tensor, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    # Copies always, so an in-place op never touches the caller's tensors.
    if t.is_floating_point():
        return t.detach().to(device=device or t.device, dtype=dtype, copy=True)
    if t.is_complex():
        return t.detach().to(device=device or t.device, dtype=torch.complex128 if dtype == torch.float64 else torch.complex64, copy=True)
    return t.detach().to(device=device or t.device, copy=True)
