"""Guarded dispatch: route exact matches of a card's guard to its kernel, everything else to PyTorch.

One torch.library override per aten op, at the backend key (CUDA; CPU stands in for tests),
below autograd, so autograd, no_grad and inference_mode behave as in eager and the op's
saved outputs (mean/rstd of layer_norm, ...) are the ones we return. A composite op
(softmax with dtype=, kforge.composite) has no backend kernel: its override sits above
autograd and sends calls that need a backward to eager's decomposition. The override
multiplexes every installed package's variants of the op, each checked against its card's
guard specification (kforge.guards: per tensor argument shape, stride, dtype, device type and
pointer alignment; every other argument's value). A hit allocates outputs from the caching
allocator and launches on the current stream, so the path records into CUDA graphs; a miss
calls the kernel that was registered before the override (taken with torch.library.get_kernel)
and counts why it missed (kforge.guards.REASONS). Removing the last variant of an op destroys
its override, which restores the dispatcher's previous kernel exactly.

The modules, in the order a call meets them:
  guards.py           the guard specification, its keys, its C++ format, the fallback reasons
  variant.py          Variant (one card's kernel and guard), Counters, dispatch_blocker
  launchers.py        Launcher, RegistryLauncher (the C++ registry), PlanLauncher
  python_override.py  the override as a Python torch.library kernel
  native_override.py  the override as kforge._dispatch's boxed C++ kernel
  dispatch.py         Dispatcher: which override each op has, shared by the installed packages

Two implementations of the override, the same guards and counts: the C++ kernel wherever
kforge._dispatch is built, every variant of the op launches through the C++ registry (a
launcher with native()) and every card argument has a C++ guard; else the Python kernel.
KFORGE_DISPATCH=python forces Python, KFORGE_DISPATCH=native makes a missing C++ path an
error; native_status() says which path an override at a key takes and why.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Sequence

from . import env
from .cards import Card
from .guards import REASONS, differences
from .launchers import Launcher, NotPrepared, PlanLauncher, RegistryLauncher
from .native_override import NativeOverride, native_status, native_variants
from .python_override import PythonOverride
from .variant import Counters, DispatchError, Variant, dispatch_blocker

__all__ = ["REASONS", "Counters", "DispatchError", "Dispatcher", "Launcher", "NotPrepared", "PlanLauncher",
           "RegistryLauncher", "Variant", "differences", "dispatch_blocker", "installed", "native_status"]

log = logging.getLogger("kforge.dispatch")


class Dispatcher:
    """Every override kforge holds at one dispatch key, shared by all installed packages.

    Owners (packages) add their variants together and remove them together; an op keeps
    one override while any owner has a variant of it.
    """

    _shared: dict[str, "Dispatcher"] = {}

    def __init__(self, key: str = "CUDA"):
        self.key = key
        self._owners: list[tuple[object, list[Variant]]] = []
        self._ops: dict[str, PythonOverride | NativeOverride] = {}
        self._why: dict[str, str] = {}

    @classmethod
    def shared(cls, key: str = "CUDA") -> "Dispatcher":
        """The process-wide dispatcher for `key` (what CastPackage.install uses by default)."""
        if key not in cls._shared:
            cls._shared[key] = cls(key)
        return cls._shared[key]

    @property
    def ops(self) -> list[str]:
        """Ops overridden right now."""
        return sorted(self._ops)

    def path(self, op: str) -> tuple[str, str] | None:
        """("native" or "python", why) for an overridden op, None if it is not overridden."""
        override = self._ops.get(op)
        return None if override is None else (override.path, self._why[op])

    def owns(self, owner: object) -> bool:
        return any(o is owner for o, _ in self._owners)

    def add(self, owner: object, variants: Sequence[Variant]) -> None:
        if self.owns(owner):
            raise DispatchError(f"{owner!r} is already installed at {self.key}; uninstall it first")
        self._owners.append((owner, list(variants)))
        try:
            self._sync({v.card.op for v in variants})
        except Exception:
            self.remove(owner)
            raise

    def remove(self, owner: object) -> None:
        gone = [vs for o, vs in self._owners if o is owner]
        self._owners = [(o, vs) for o, vs in self._owners if o is not owner]
        self._sync({v.card.op for vs in gone for v in vs}, removing=True)

    def _sync(self, ops: set[str], removing: bool = False) -> None:
        """Bring each op's override in line with the owners' variants. Every op is synced
        even when one fails (the first error is raised after), so a package being removed
        never leaves kernels of its own installed."""
        errors: list[BaseException] = []
        for name in sorted(ops):
            try:
                self._sync_op(name, removing)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _sync_op(self, name: str, removing: bool) -> None:
        variants = [v for _, vs in self._owners for v in vs if v.card.op == name]
        override = self._ops.get(name)
        descriptions, why = native_variants(variants, self.key) if variants else (None, "")
        if override is not None and (not variants or override.path != ("native" if descriptions else "python")):
            override.destroy()  # gone, or moving between C++ and Python: the original kernel comes back first
            del self._ops[name]
            override = None
        if not variants:
            self._why.pop(name, None)
            return
        if descriptions is not None:
            try:
                override = override or NativeOverride(variants[0].card.overload(), self.key)
                override.set_variants(descriptions)
            except Exception as e:  # the C++ side refused a guard: the Python path serves the op
                if override is not None:
                    override.destroy()
                self._ops.pop(name, None)  # never keep a destroyed override
                override, descriptions = None, None
                why = f"kforge._dispatch refused the variants ({type(e).__name__}: {e})"
                log.warning("%s dispatches in Python: %s", name, why)
        if descriptions is None:
            if env.dispatch_path() == "native" and not removing:
                raise DispatchError(f"KFORGE_DISPATCH=native, but {name} cannot dispatch in C++: {why}")
            override = override or PythonOverride(variants[0].card.overload(), self.key)
            override.set_variants(variants)
        self._ops[name] = override
        self._why[name] = why


@contextlib.contextmanager
def installed(card: Card, launcher: Launcher, *, vid: int = 0, workspace: Sequence[int] = (),
              key: str = "CUDA") -> Iterator[Variant]:
    """One card's kernel dispatched through the real override while the block runs: calling
    the op (card.call_eager) inside takes the guard path exactly as a package would, so its
    latency is the latency as dispatched. Eager timed inside the block would hit the kernel
    too: time eager outside it."""
    variant = Variant(card, vid, launcher, tuple(workspace))
    dispatcher = Dispatcher(key)
    dispatcher.add(variant, [variant])
    try:
        yield variant
    finally:
        dispatcher.remove(variant)
