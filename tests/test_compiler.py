"""NVRTC compilation and the kernel cache (no GPU needed)."""

from __future__ import annotations

import io
import pickle

import pytest

import kforge
from kforge import compiler, env
from kforge.errors import CompileError, CudaError, LaunchError, LaunchRefused

MIXED = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
extern "C" __global__ void convert(const __nv_bfloat16* a, __half* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) b[i] = __float2half(__bfloat162float(a[i]) * 2.0f);
}
"""

BROKEN = 'extern "C" __global__ void f(float* x) {\n  x[0] = undefined_name;\n}\n'


def test_import_works_without_gpu_and_status_says_what_is_missing():
    status = kforge.cuda_status()
    assert status["nvrtc"] and status["nvrtc_version"].startswith("13.")
    assert status["include_dirs"], "cuda_fp16.h must be found for NVRTC"
    if not status["devices"]:
        assert any(m.startswith("GPU:") for m in status["missing"])


def test_bf16_and_half_kernel_compiles_to_sm90_cubin():
    k = compiler.compile(MIXED, arch="sm_90")
    assert k.cubin[:4] == b"\x7fELF", "NVRTC must emit a cubin (ELF), not PTX"
    assert k.arch == "sm_90" and not k.cached
    other = compiler.compile(MIXED, arch="sm_80")
    assert other.cubin != k.cubin and other.key != k.key


def test_bad_kernel_raises_compile_error_with_log_and_numbered_source():
    with pytest.raises(CompileError) as info:
        compiler.compile(BROKEN, name="broken.cu", arch="sm_90")
    err = info.value
    assert 'identifier "undefined_name" is undefined' in err.log
    assert "broken.cu(2)" in err.log
    assert "2 |   x[0] = undefined_name;" in str(err)
    assert any(o.startswith("--gpu-architecture=sm_90") for o in err.options)
    out = io.StringIO()
    assert err.dump(out).splitlines()[1] == "2 |   x[0] = undefined_name;" and out.getvalue() == err.dump() + "\n"


def test_errors_keep_their_evidence_across_processes():
    # The worker sends results to its parent and a pool may pickle errors: every field survives.
    err = CompileError("broken.cu(2): error", BROKEN, "broken.cu", ["-arch=sm_90"])
    back = pickle.loads(pickle.dumps(err))
    assert (back.log, back.source, back.name, back.options, str(back)) == (err.log, BROKEN, "broken.cu",
                                                                          ["-arch=sm_90"], str(err))
    refused = pickle.loads(pickle.dumps(LaunchRefused("too large", "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", 720)))
    assert isinstance(refused, CudaError) and (refused.name, refused.code, str(refused)) == (
        "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", 720, "too large")
    launch = pickle.loads(pickle.dumps(LaunchError("boom", "CUDA_ERROR_ILLEGAL_ADDRESS")))
    assert (launch.cuda_error, str(launch)) == ("CUDA_ERROR_ILLEGAL_ADDRESS", "boom")


def test_ptx_architecture_is_refused():
    with pytest.raises(ValueError, match="real architecture"):
        compiler.compile(MIXED, arch="compute_90")


def test_cache_hit_miss_and_memory_layer():
    first = compiler.compile(MIXED, arch="sm_90")
    second = compiler.compile(MIXED, arch="sm_90")
    assert (first.cached, second.cached) == (False, True)
    assert second.cubin == first.cubin
    compiler.clear_memory_cache()
    from_disk = compiler.compile(MIXED, arch="sm_90")
    assert from_disk.cached and from_disk.cubin == first.cubin


def test_corrupt_cache_entry_is_a_miss_not_a_crash():
    first = compiler.compile(MIXED, arch="sm_90")
    compiler.clear_memory_cache()
    path = compiler.DiskCache(env.kernel_cache_dir())._path(first.key)
    raw = path.read_bytes()
    path.write_bytes(raw[:-10] + b"garbage!!!")
    again = compiler.compile(MIXED, arch="sm_90")
    assert not again.cached and again.cubin == first.cubin
    compiler.clear_memory_cache()
    assert compiler.compile(MIXED, arch="sm_90").cached, "the recompiled entry replaces the corrupt one"
    path.write_bytes(b"")
    compiler.clear_memory_cache()
    assert not compiler.compile(MIXED, arch="sm_90").cached


def test_cache_key_changes_with_each_ingredient(monkeypatch):
    opts = compiler.full_options((), "sm_90")
    base = compiler.cache_key(MIXED, opts, "sm_90", "13.0")
    assert compiler.cache_key(MIXED + " ", opts, "sm_90", "13.0") != base
    assert compiler.cache_key(MIXED, opts + ["-lineinfo"], "sm_90", "13.0") != base
    assert compiler.cache_key(MIXED, opts, "sm_89", "13.0") != base
    assert compiler.cache_key(MIXED, opts, "sm_90", "13.1") != base
    monkeypatch.setattr(env, "CACHE_VERSION", env.CACHE_VERSION + 1)
    assert compiler.cache_key(MIXED, opts, "sm_90", "13.0") != base


def test_include_path_is_machine_specific_and_not_in_the_key():
    opts = compiler.full_options((), "sm_90")
    key = compiler.cache_key(MIXED, opts, "sm_90", "13.0")
    moved = [o if not o.startswith("-I") else "-I/somewhere/else" for o in opts]
    assert compiler.cache_key(MIXED, moved, "sm_90", "13.0") == key


def test_unwritable_cache_still_compiles(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KFORGE_CACHE_DIR", str(blocker))
    assert compiler.compile(MIXED, arch="sm_90").cubin[:4] == b"\x7fELF"


def test_launch_without_gpu_gives_a_clear_error():
    from kforge import cuda, runtime
    from kforge.errors import CudaUnavailableError

    if cuda.available():
        pytest.skip("this machine has a GPU")
    k = compiler.compile(MIXED, arch="sm_90")
    with pytest.raises(CudaUnavailableError, match="needs an NVIDIA GPU"):
        runtime.load(k.cubin, 0)


def test_memory_cache_is_bounded_and_keeps_the_recently_used(monkeypatch):
    monkeypatch.setattr(compiler, "_MEMORY_ENTRIES", 2)
    src = [f'extern "C" __global__ void f{i}(float* x) {{ x[0] = {i}; }}' for i in range(3)]
    keys = [compiler.compile(s, arch="sm_90").key for s in src[:2]]
    compiler.compile(src[0], arch="sm_90")  # used again: now the most recent
    keys.append(compiler.compile(src[2], arch="sm_90").key)
    assert list(compiler._memory) == [keys[0], keys[2]]


def test_failed_cache_write_leaves_no_temp_file(monkeypatch, tmp_path):
    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compiler.os, "replace", full_disk)
    cache = compiler.DiskCache(tmp_path)
    cache.put("ab" + "0" * 62, b"cubin")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    assert cache.get("ab" + "0" * 62) is None
