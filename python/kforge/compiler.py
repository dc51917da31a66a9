"""CUDA source -> cubin for one exact arch, through NVRTC in-process, with a disk cache.

Flow: compile box -> memory cache -> disk cache -> compile -> atomic write. Every source
passes the compile box first (sourcebox.py: allowed includes and options only, a small
prelude); what it refuses is a CompileError like any other, so a proposer gets it back. The cache key hashes the
source, the options, the arch, the NVRTC version and kforge's CACHE_VERSION, so changing
any one of them is a miss. A corrupt entry (its stored hash does not match) is a miss,
never a crash. Only `compile` raises: CompileError for a kernel NVRTC rejects,
CudaUnavailableError when NVRTC itself is missing, ValueError for an arch that is not sm_XY.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from . import env, sourcebox
from .cuda import load_nvrtc
from .errors import CompileError

DEFAULT_OPTIONS = ("--std=c++17", "-default-device")
_ARCH = re.compile(r"^sm_\d+a?$")


@dataclass(frozen=True)
class CompiledKernel:
    cubin: bytes
    log: str
    arch: str
    key: str
    cached: bool


def default_arch() -> str:
    """The current GPU's sm_XY; else $KFORGE_ARCH; else sm_90 (the H200 we target)."""
    from . import cuda

    if cuda.available():
        import torch

        ordinal = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return f"sm_{cuda.device_attributes(ordinal)['cc']}"
    return env.default_arch()


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> str:
    from . import _C

    load_nvrtc()
    return "%d.%d" % _C.nvrtc_version()


def full_options(options: tuple[str, ...] | list[str], arch: str) -> list[str]:
    """What NVRTC really gets: ours, the caller's, the arch and the header path."""
    opts = [o for o in DEFAULT_OPTIONS if o not in options] + list(options)
    opts = [o for o in opts if not o.startswith(("-arch", "--gpu-architecture"))]
    opts.append(f"--gpu-architecture={arch}")
    opts += [f"-I{d}" for d in env.cuda_include_dirs()]
    return opts


def cache_key(source: str, options: list[str], arch: str, nvrtc: str) -> str:
    # Include paths are machine-specific; what they hold is pinned by the NVRTC version.
    stable = [o for o in options if not o.startswith("-I")]
    blob = "\0".join([f"kforge-cache-v{env.CACHE_VERSION}", nvrtc, arch, *stable, source])
    return hashlib.sha256(blob.encode()).hexdigest()


class DiskCache:
    """One file per key: a 64-hex sha256 of the payload, a newline, then the cubin."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.cubin"

    def get(self, key: str) -> bytes | None:
        try:
            raw = self._path(key).read_bytes()
        except OSError:
            return None
        digest, sep, payload = raw.partition(b"\n")
        if not sep or hashlib.sha256(payload).hexdigest().encode() != digest:
            return None  # corrupt or truncated: recompile and overwrite
        return payload

    def put(self, key: str, payload: bytes) -> None:
        path = self._path(key)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
            os.replace(tmp, path)
        except OSError:
            # A read-only or full cache only costs a recompile next time; a half-written
            # temp file must not stay behind to fill the disk further.
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


_MEMORY_ENTRIES = 512  # bounded: a long search compiles thousands of candidates
_memory: OrderedDict[str, bytes] = OrderedDict()
_memory_lock = threading.Lock()


def _remember(key: str, cubin: bytes) -> None:
    with _memory_lock:
        _memory[key] = cubin
        _memory.move_to_end(key)
        while len(_memory) > _MEMORY_ENTRIES:
            _memory.popitem(last=False)


def compile(source: str, name: str = "kernel.cu", options: tuple[str, ...] | list[str] = (),
            arch: str | None = None, use_cache: bool = True) -> CompiledKernel:
    """Compile CUDA source to a cubin for `arch` (default: this GPU's, else sm_90)."""
    from . import _C

    arch = arch or default_arch()
    if not _ARCH.match(arch):
        raise ValueError(f"arch must look like sm_90 (a real architecture, so a cubin is emitted), got {arch!r}")
    try:
        box = sourcebox.prepare(source, options)
    except sourcebox.SourceRefused as e:
        raise CompileError(f"kforge refused to compile this source: {e}", source, name, list(options)) from None
    notes = "".join(f"kforge: {n}\n" for n in box.notes)
    opts = full_options(tuple(box.options), arch)
    key = cache_key(box.source, opts, arch, nvrtc_version())
    if use_cache:
        with _memory_lock:
            hit = _memory.get(key)
        if hit is None:
            hit = DiskCache(env.kernel_cache_dir()).get(key)
        if hit is not None:
            _remember(key, hit)
            return CompiledKernel(hit, notes, arch, key, True)
    ok, image, raw_log = _C.nvrtc_compile(box.source, name, opts, True)
    # NVRTC's log may quote bytes of the source that are not UTF-8.
    log = notes + raw_log.decode("utf-8", "replace")
    if not ok:
        raise CompileError(log, source, name, opts)
    if use_cache:
        _remember(key, image)
        DiskCache(env.kernel_cache_dir()).put(key, image)
    return CompiledKernel(image, log, arch, key, False)


def clear_memory_cache() -> None:
    with _memory_lock:
        _memory.clear()
