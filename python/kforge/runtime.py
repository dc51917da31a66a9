"""Python side of the launcher: cubins -> modules -> resolved launch plans -> launches."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import torch

from .candidate import Candidate, LaunchPlan
from .errors import CudaError, LaunchError, LaunchRefused

_MAX_MODULES = 256  # bounded so a worker that loads hundreds of candidates keeps flat memory
_modules: OrderedDict[tuple[str, int], object] = OrderedDict()
_lock = threading.Lock()


def _C():
    from . import cuda

    cuda.require()
    from . import _C

    return _C


def load(cubin: bytes, device: int):
    """Load a cubin into the device's primary context (cached per device and content)."""
    C = _C()
    key = (hashlib.sha256(cubin).hexdigest(), device)
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            _modules.move_to_end(key)
            return mod
    try:
        mod = C.Module(cubin, device)
    except CudaError as e:
        raise LaunchError.from_cuda(f"could not load the cubin on device {device}: {e}", e) from e
    with _lock:
        _modules[key] = mod
        while len(_modules) > _MAX_MODULES:
            _modules.popitem(last=False)
    return mod


def clear_modules() -> None:
    with _lock:
        _modules.clear()


def resolve(plan: LaunchPlan, module):
    """A _C.Plan: every kernel name looked up in `module`, arguments as (kind, value) pairs."""
    C = _C()
    kernels = []
    for k in plan.kernels:
        try:
            fn = module.function(k.name)
        except CudaError as e:
            raise LaunchError.from_cuda(f"kernel '{k.name}' named in the launch plan is not in the compiled module "
                                        f"(declare it extern \"C\" __global__): {e}", e) from e
        args = [next(iter(a.items())) for a in k.args]
        kernels.append((fn, list(k.grid), list(k.block), k.smem, args, k.cooperative, k.pdl, k.cluster))
    try:
        return C.Plan(kernels, plan.workspace_bytes())
    except CudaError as e:
        raise LaunchError.from_cuda(f"could not prepare the launch plan: {e}", e) from e


def build_plan(candidate: Candidate, cubin: bytes, device: int):
    return resolve(candidate.plan, load(cubin, device))


def alloc_workspaces(plan: LaunchPlan, device):
    return [torch.empty(max(n, 1), dtype=torch.uint8, device=device) for n, _ in plan.workspace_bytes()]


# The raw getter skips building a Stream object: ~2 us less on the dispatch hot path.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int | None) -> int:
    """torch's current stream on the device, as a raw handle (the fast path: no Stream object)."""
    idx = torch.cuda.current_device() if device_index is None else device_index
    return _RAW_STREAM(idx) if _RAW_STREAM is not None else torch.cuda.current_stream(idx).cuda_stream


def launch(plan, inputs, outputs, workspaces=(), stream=None) -> None:
    """Launch a resolved plan with torch tensors on `stream` (default: torch's current stream)."""
    _C()  # the extension, loaded before the first launch
    if stream is None:
        stream = current_stream((inputs or outputs)[0].device.index)
    try:
        plan.launch([t.data_ptr() for t in inputs], [t.data_ptr() for t in outputs],
                    [t.data_ptr() for t in workspaces], int(stream))
    except LaunchRefused:
        raise  # nothing ran: the caller may serve the call another way
    except CudaError as e:
        raise LaunchError.from_cuda(str(e), e) from e
