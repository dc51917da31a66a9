"""Finding the CUDA driver, a GPU and NVRTC, and saying plainly what is missing."""

from __future__ import annotations

import functools

from . import env
from .errors import CudaError, CudaUnavailableError


def _core():
    from . import _C

    return _C


@functools.lru_cache(maxsize=1)
def _driver_error() -> str | None:
    """None when the driver loaded and sees a device, else why not."""
    C = _core()
    try:
        C.cuda_load(env.libcuda_path())
        if C.device_count() == 0:
            return "the CUDA driver loaded but sees no GPU (check CUDA_VISIBLE_DEVICES and nvidia-smi)"
    except CudaError as e:
        return str(e)
    return None


def available() -> bool:
    """A CUDA GPU is usable through the driver (what validation, timing and dispatch need)."""
    return _driver_error() is None


def require() -> None:
    """Raise CudaUnavailableError saying what is missing when there is no usable GPU."""
    err = _driver_error()
    if err:
        raise CudaUnavailableError(
            f"this needs an NVIDIA GPU: {err}. Capture, kernel generation and NVRTC compilation work without one; "
            "validation, timing and dispatch do not."
        )


def device_attributes(ordinal: int = 0) -> dict:
    require()
    return _core().device_attributes(ordinal)


def _preload_builtins(nvrtc_path: str) -> None:
    """Load libnvrtc-builtins from NVRTC's own directory first. NVRTC dlopens it by soname
    at the first compile and some wheels' NVRTC does not look beside itself; unless torch was
    imported first (it loads the library as a side effect), every compile would fail with
    "failed to open libnvrtc-builtins". A library already loaded is found by its soname."""
    import ctypes
    import glob
    import os

    if not os.path.isabs(nvrtc_path):
        return
    for lib in sorted(glob.glob(os.path.join(os.path.dirname(nvrtc_path), "libnvrtc-builtins.so.*"))):
        try:
            ctypes.CDLL(lib)
        except OSError:
            continue
        return


@functools.lru_cache(maxsize=1)
def load_nvrtc() -> str:
    """dlopen NVRTC from the first working candidate path; returns the path used."""
    C = _core()
    errors = []
    for path in env.nvrtc_candidates():
        try:
            _preload_builtins(path)
            C.nvrtc_load(path)
            return path
        except C.NvrtcError as e:
            errors.append(str(e))
    raise CudaUnavailableError(
        "NVRTC (the CUDA runtime compiler) was not found. Install it with "
        "`pip install 'nvidia-cuda-nvrtc>=13,<14' 'nvidia-cuda-runtime>=13,<14'` or set KFORGE_NVRTC_PATH "
        "to a libnvrtc.so. Tried:\n  " + "\n  ".join(errors)
    )


def cuda_status() -> dict:
    """What kforge can do on this machine, and what to install for the rest."""
    status: dict = {"driver": None, "devices": [], "nvrtc": None, "nvrtc_version": None, "include_dirs": [],
                    "missing": []}
    C = _core()
    err = _driver_error()
    if err is None:
        status["driver"] = C.driver_version()
        status["devices"] = [C.device_attributes(i) for i in range(C.device_count())]
    else:
        status["missing"].append(f"GPU: {err} -> validation, timing and dispatch are unavailable")
    try:
        status["nvrtc"] = load_nvrtc()
        status["nvrtc_version"] = "%d.%d" % C.nvrtc_version()
    except CudaUnavailableError as e:
        status["missing"].append(f"NVRTC: {e}")
    status["include_dirs"] = env.cuda_include_dirs()
    if not status["include_dirs"]:
        status["missing"].append("CUDA headers (cuda_fp16.h): `pip install 'nvidia-cuda-runtime>=13,<14'`")
    return status
