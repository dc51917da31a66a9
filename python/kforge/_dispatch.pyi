"""kforge._dispatch: guarded dispatch as a boxed C++ kernel (csrc/torch_dispatch.cpp).

Built only where the build's Python has torch, against that torch: kforge.dispatch uses it
when TORCH_VERSION matches torch.__version__ and falls back to its Python kernel otherwise.
"""

from typing import Sequence

TORCH_VERSION: str
"""torch.__version__ at build time."""

REASONS: tuple[str, ...]
"""Why a call fell back, most fundamental first: kforge.guards.REASONS."""

GUARD_FORMAT: int
"""The guard format set_variants reads: kforge.guards.FORMAT."""

class Counts:
    """What the override did for one card; kept across set_variants."""
    def __init__(self) -> None: ...
    @property
    def hits(self) -> int: ...
    def fallbacks(self) -> dict[str, int]:
        """Fallbacks by reason, the reasons with none left out."""

class Override:
    """The kernel of aten op `op` (e.g. "aten::relu"), overload `overload` ("" for the default),
    at dispatch key `key` ("CUDA" or "CPU"). The kernel registered there before is taken first:
    every miss goes to it, and destroy() (also on deallocation) restores it exactly. `at`: where
    the override is registered, `key` when empty, or "CompositeImplicitAutograd" for a composite
    op (above autograd: a call that needs a backward falls back, reason "autograd")."""
    def __init__(self, op: str, overload: str, key: str, at: str = "") -> None: ...
    def set_variants(self, variants: Sequence[tuple]) -> None:
        """Replace the variants; later ones win on equal guards. A variant is
        (guard, outputs, workspace, launch_address, vid, resolve, counts). The guard is
        kforge.guards.GuardSpec.native(): (GUARD_FORMAT, slots, written, device_slots), written
        the inputs the kernel writes (none may share memory with another input), device_slots
        the Device arguments (each must name the inputs' device), and one slot per schema
        argument, ("tensor", T | None), ("tensors", [T | None]) or ("value", V) with
        T = (sizes, strides, dtype name, device type, alignment) and V = ("none",), ("bool", b),
        ("int", i), ("float", f), ("ints", [i]), ("str", s), ("enum", dtype, memory format or
        layout name) or ("device", type); outputs (aliased input index, None, None, None) or
        (None, sizes, strides, dtype name); workspace bytes per buffer; the C launch function
        (kforge._C.Registry.launch_address()) and its variant id; resolve(device index) -> the
        launcher context (a registry's address), called with the GIL on a device's first hit;
        the Counts to count into. Raises on a guard it cannot express."""
    def counters(self) -> list[tuple[int, dict[str, int]]]:
        """(hits, fallbacks by reason) per variant."""
    def destroy(self) -> None: ...
    @property
    def active(self) -> bool: ...

def current_stream(device_type: str, index: int) -> int:
    """torch's current stream on the device as the C++ path reads it (a raw handle)."""
