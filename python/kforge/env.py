"""Every KFORGE_* environment variable and every path kforge uses, in one place.

Variables:
  KFORGE_CACHE_DIR     compiled-kernel cache root (default: $XDG_CACHE_HOME/kforge or ~/.cache/kforge)
  KFORGE_NVRTC_PATH    a libnvrtc.so to use instead of the one found automatically
  KFORGE_CUDA_INCLUDE  extra include directories for NVRTC (os.pathsep separated)
  KFORGE_LIBCUDA_PATH  the CUDA driver library (default: libcuda.so.1)
  KFORGE_LOG_LEVEL     logging level of the `kforge` logger, shown on stderr (default: WARNING, Python's)
  KFORGE_ARCH          the arch kernels compile for where no GPU is visible (default: sm_90)
  KFORGE_DISPATCH      python: dispatch in Python only; native: fail where an op cannot dispatch in C++
  KFORGE_LAYOUT        keep: traced graphs keep their convolutions' layout (default: channels-last, kforge.layout)
  KFORGE_LLM_CONFIG    the LLM proposer's config file (TOML or JSON)
  KFORGE_LLM_BASE_URL  its OpenAI-compatible endpoint (else OPENAI_BASE_URL)
  KFORGE_LLM_MODEL     its model
  KFORGE_LLM_API_KEY   its API key (else OPENAI_API_KEY); never logged or stored
"""

from __future__ import annotations

import glob
import logging
import os
import sys
from pathlib import Path
from typing import Mapping

# Bump when anything that feeds a cached cubin changes meaning (options, headers we inject).
CACHE_VERSION = 1


def cache_root() -> Path:
    if os.environ.get("KFORGE_CACHE_DIR"):
        return Path(os.environ["KFORGE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kforge"


def kernel_cache_dir() -> Path:
    return cache_root() / f"kernels-v{CACHE_VERSION}"


def _site_dirs() -> list[str]:
    dirs = [p for p in sys.path if p and os.path.isdir(p)]
    try:
        import site

        dirs += site.getsitepackages() + [site.getusersitepackages()]
    except Exception:  # site may be stripped in embedded interpreters
        pass
    seen: list[str] = []
    for d in dirs:
        if d not in seen:
            seen.append(d)
    return seen


def _nvidia_dirs(sub: str) -> list[str]:
    """Directories of NVIDIA's pip wheels (nvidia/cu13/<sub>, nvidia/cuda_nvrtc/<sub>, ...)."""
    found = []
    for site_dir in _site_dirs():
        for pattern in ("nvidia/cu1[0-9]", "nvidia/cuda_nvrtc", "nvidia/cuda_runtime"):
            for d in sorted(glob.glob(os.path.join(site_dir, pattern, sub)), reverse=True):
                if d not in found:
                    found.append(d)
    return found


def _toolkit_dirs(sub: str) -> list[str]:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    roots += sorted(glob.glob("/usr/local/cuda-1[0-9]*"), reverse=True)
    out = []
    for r in roots:
        if r and os.path.isdir(os.path.join(r, sub)):
            out.append(os.path.join(r, sub))
        if r and sub == "lib" and os.path.isdir(os.path.join(r, "lib64")):
            out.append(os.path.join(r, "lib64"))
    return out


def nvrtc_candidates() -> list[str]:
    """Paths to try for libnvrtc, most specific first."""
    if os.environ.get("KFORGE_NVRTC_PATH"):
        return [os.environ["KFORGE_NVRTC_PATH"]]
    out = []
    for d in _nvidia_dirs("lib") + _toolkit_dirs("lib"):
        out += sorted(glob.glob(os.path.join(d, "libnvrtc.so.1[0-9]*")), reverse=True)
    # Bare sonames last: the dynamic loader's own search path.
    out += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    return out


def configure_logging() -> None:
    """Apply KFORGE_LOG_LEVEL to the `kforge` logger, with a stderr handler so the level shows."""
    name = os.environ.get("KFORGE_LOG_LEVEL", "").strip().upper()
    if not name:
        return
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise ValueError(f"KFORGE_LOG_LEVEL={name!r} is not a logging level: use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    logger = logging.getLogger("kforge")
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


def default_arch() -> str:
    return os.environ.get("KFORGE_ARCH", "sm_90")


def layout_mode() -> str:
    """KFORGE_LAYOUT: "keep", or "" (channels-last convolutions where kforge.layout applies)."""
    return os.environ.get("KFORGE_LAYOUT", "").strip().lower()


def attention_mode() -> str:
    """KFORGE_ATTENTION: "keep", "decompose", or "" (matmul-softmax-matmul where measured faster: kforge.attention)."""
    return os.environ.get("KFORGE_ATTENTION", "").strip().lower()


def dispatch_path() -> str:
    """KFORGE_DISPATCH: "python", "native", or "" (C++ where it can, else Python)."""
    return os.environ.get("KFORGE_DISPATCH", "").strip().lower()


def llm_environment(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The LLM proposer's settings the environment gives: config (file), base_url, model, api_key."""
    env = os.environ if environ is None else environ
    return {"config": env.get("KFORGE_LLM_CONFIG"),
            "base_url": env.get("KFORGE_LLM_BASE_URL") or env.get("OPENAI_BASE_URL"),
            "model": env.get("KFORGE_LLM_MODEL"),
            "api_key": env.get("KFORGE_LLM_API_KEY") or env.get("OPENAI_API_KEY")}


def libcuda_path() -> str:
    return os.environ.get("KFORGE_LIBCUDA_PATH", "libcuda.so.1")


def cuda_include_dirs() -> list[str]:
    """Include directories holding cuda_fp16.h / cuda_bf16.h for NVRTC."""
    dirs = [d for d in os.environ.get("KFORGE_CUDA_INCLUDE", "").split(os.pathsep) if d]
    # One header tree only: mixing two CUDA versions' headers breaks compiles. The pip
    # wheels come first because they match the pip-installed NVRTC.
    for d in _nvidia_dirs("include") + _toolkit_dirs("include"):
        if os.path.exists(os.path.join(d, "cuda_fp16.h")):
            return dirs + [d]
    return dirs
