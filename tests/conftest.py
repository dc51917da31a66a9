"""Test-wide setup: GPU tests skip with a reason where there is no usable CUDA GPU, and
every test gets its own kernel cache so no test sees another's cubins."""

from __future__ import annotations

import pytest


def _gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    from kforge import cuda

    if not cuda.available():
        return "needs the CUDA driver API: " + str(cuda._driver_error())
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [i for i in items if "gpu" in i.keywords]
    if not gpu_items:
        return
    reason = _gpu_skip_reason()
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _isolated_kernel_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("KFORGE_CACHE_DIR", str(tmp_path_factory.mktemp("kforge-cache")))
    from kforge import compiler

    compiler.clear_memory_cache()
    yield
    compiler.clear_memory_cache()


@pytest.fixture
def fresh_dynamo():
    """For tests that trace models (kforge.graph, kforge.optimize): each starts with no
    compiled code, so dynamo's recompile limit never carries over from another test."""
    import torch

    torch.compiler.reset()
    yield
    torch.compiler.reset()
