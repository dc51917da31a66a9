"""How a dispatched kernel is launched: the Launcher interface and its two implementations.

RegistryLauncher holds a package's kernels in one C++ registry per device (kforge._C.Registry);
PlanLauncher one resolved plan, as the evaluation worker has it. Both can hand kforge._dispatch
a plain C launch function (native()), so the C++ override launches without Python.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Protocol, Sequence

import torch

from . import runtime
from .candidate import Candidate
from .errors import CudaError, LaunchError, LaunchRefused


class NotPrepared(LaunchError):
    """The kernels could not be loaded on this device (another GPU architecture, ...):
    nothing ran, and calls on that device go to PyTorch."""


class Launcher(Protocol):
    """Runs variant `vid` on `inputs` (Card.inputs order) into `outputs` (Card.outputs order)."""

    def launch(self, vid: int, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
               workspaces: Sequence[torch.Tensor], device: torch.device) -> None: ...


class RegistryLauncher:
    """Launches through the C++ registry (kforge._C.Registry), one registry per device.

    Variant ids are the positions in `entries`. Plans are built for a device on first use;
    call prepare() for the devices you will run on so that loading happens at install
    time, not inside a model's forward (or a CUDA graph capture).
    """

    def __init__(self, entries: Sequence[tuple[Candidate, bytes]]):
        from . import _C

        self._entries = list(entries)
        self._registries: dict[int, Any] = {}
        # One registry per device, built once: kforge._dispatch caches a registry's raw
        # address, so a registry must never be replaced (and freed) once handed out.
        self._lock = threading.Lock()
        self._unprepared: dict[int | None, str] = {}  # device index -> why its kernels could not load
        self._launch_address = _C.Registry.launch_address()

    def prepare(self, device: torch.device | int | str) -> Any:
        from . import _C

        ordinal = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        ordinal = ordinal.index if ordinal.index is not None else torch.cuda.current_device()
        reg = self._registries.get(ordinal)
        if reg is not None:
            return reg
        with self._lock:
            reg = self._registries.get(ordinal)
            if reg is None:
                reg = _C.Registry()
                for i, (candidate, cubin) in enumerate(self._entries):
                    vid = reg.add(runtime.build_plan(candidate, cubin, ordinal))
                    if vid != i:
                        raise LaunchError(f"registry gave id {vid} to entry {i}; a registry must start empty")
                self._registries[ordinal] = reg
        return reg

    def native(self, vid: int) -> tuple[int, int, Callable[[int], int]]:
        """How kforge._dispatch launches variant `vid`: (address of the C launch function, id,
        device index -> launcher context, here the device's registry)."""
        return self._launch_address, vid, self._registry_address

    def _registry_address(self, index: int) -> int:
        return self.prepare(index).address()

    def launch(self, vid, inputs, outputs, workspaces, device) -> None:
        reg = self._registries.get(device.index)
        if reg is None:
            if device.index in self._unprepared:
                raise NotPrepared(self._unprepared[device.index])
            try:
                reg = self.prepare(device)
            except Exception as e:  # nothing has run yet: whatever stopped the load, PyTorch serves the call
                self._unprepared[device.index] = f"kforge could not prepare its kernels on {device}: {e}"
                warnings.warn(self._unprepared[device.index] + "; calls there run PyTorch's kernel", stacklevel=2)
                raise NotPrepared(self._unprepared[device.index]) from e
        try:
            reg.launch(vid, [t.data_ptr() for t in inputs], [t.data_ptr() for t in outputs],
                       [t.data_ptr() for t in workspaces], runtime.current_stream(device.index))
        except LaunchRefused:
            raise  # nothing ran: the override serves the call with eager
        except CudaError as e:
            raise LaunchError.from_cuda(f"dispatched kernel {self._entries[vid][0].plan.kernels[0].name} "
                                        f"(variant {vid}) failed: {e}", e) from e


class PlanLauncher:
    """One resolved plan (kforge.runtime.build_plan), launched through kforge.runtime: what the
    evaluation worker has in hand when it times a candidate as dispatched."""

    def __init__(self, plan: Any, device: int | None = None):
        self._plan = plan
        self._device = device  # the plan's device, when known: other devices are refused
        self._registry: Any = None

    def native(self, vid: int) -> tuple[int, int, Callable[[int], int]] | None:
        """The plan as entry 0 of a registry of its own, for kforge._dispatch (see RegistryLauncher.native)."""
        from . import _C

        if not isinstance(self._plan, _C.Plan):
            return None
        if self._registry is None:
            self._registry = _C.Registry()
            self._registry.add(self._plan)
        return _C.Registry.launch_address(), 0, self._registry_address

    def _registry_address(self, index: int) -> int:
        if self._device is not None and index != self._device:
            raise LaunchError(f"this plan was loaded on cuda:{self._device}, not cuda:{index}")
        return self._registry.address()

    def launch(self, vid, inputs, outputs, workspaces, device) -> None:
        runtime.launch(self._plan, inputs, outputs, workspaces, runtime.current_stream(device.index))
