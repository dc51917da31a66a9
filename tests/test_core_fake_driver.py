"""The C++ core without a GPU: against a fake libcuda (tests/data/fake_libcuda.c) for
context handling, resource lifetimes and the benchmark protocol, each test in a subprocess
because a loaded driver stays loaded for the life of the process; and the .pyi stub
against the bindings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PRELUDE = """
import ctypes, gc, json, os
from kforge import _C as C, cuda, runtime
from kforge.errors import CudaError
cuda.require()
fake = ctypes.CDLL(os.environ["KFORGE_LIBCUDA_PATH"])
fake.fake_log.restype = ctypes.c_char_p
fake.fake_set_elapsed_ms.argtypes = [ctypes.c_float]
DEV0 = 0x1000  # device 0's stream in the fake driver

def log():
    return fake.fake_log().decode()

def c_launch(reg, vid, ins, outs, ws):
    # Registry.launch through its C entry (what kforge._dispatch calls): (code, error text).
    u64 = ctypes.c_uint64
    launch = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(u64), ctypes.c_int,
                              ctypes.POINTER(u64), ctypes.c_int, ctypes.POINTER(u64), ctypes.c_int, u64,
                              ctypes.c_char_p, ctypes.c_size_t)(C.Registry.launch_address())
    err = ctypes.create_string_buffer(256)
    ptrs = lambda p: (u64 * len(p))(*p)
    rc = launch(reg.address(), vid, ptrs(ins), len(ins), ptrs(outs), len(outs), ptrs(ws), len(ws), DEV0, err, 256)
    return rc, err.value.decode()

def plan(module, zero_ws=True):
    fn = module.function("k")
    return C.Plan([(fn, [1], [32], 0, [("in", 0), ("out", 0), ("ws", 0), ("i32", 5)])], [(64, zero_ws)])
"""


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the fake driver")
    out = tmp_path_factory.mktemp("fake-cuda") / "libcuda_fake.so"
    src = Path(__file__).parent / "data" / "fake_libcuda.c"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(src)], check=True)
    return out


def _run(fake_driver: Path, body: str) -> dict:
    env = dict(os.environ, KFORGE_LIBCUDA_PATH=str(fake_driver))
    code = PRELUDE + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_loading_and_launching_on_another_device_keep_the_callers_context(fake_driver):
    # PyTorch's current device is the current context: a launch for device 0 while the
    # caller is on device 1 must not move the caller to device 0.
    out = _run(fake_driver, """
    fake.fake_set_current(1)
    mod = runtime.load(b"cubin", 0)
    after_load = fake.fake_current()
    p = plan(mod)
    after_plan = fake.fake_current()
    p.launch([11], [12], [13], DEV0)  # the workspace memset, too, must run in device 0's context
    after_launch = fake.fake_current()
    C.synchronize(0)
    print(json.dumps({"load": after_load, "plan": after_plan, "launch": after_launch,
                      "sync": fake.fake_current(), "log": log()}))
    """)
    assert out == {"load": 1, "plan": 1, "launch": 1, "sync": 1, "log": "ZL"}


def test_a_thread_without_a_context_keeps_the_one_made_current(fake_driver):
    out = _run(fake_driver, """
    fake.fake_set_current(-1)
    plan(runtime.load(b"cubin", 0)).launch([1], [2], [3], DEV0)
    print(json.dumps({"current": fake.fake_current()}))
    """)
    assert out == {"current": 0}


def test_module_is_unloaded_in_its_context_when_the_last_reference_goes(fake_driver):
    out = _run(fake_driver, """
    p = plan(C.Module(b"cubin", 0))
    loaded = fake.fake_live_modules()
    fake.fake_set_current(1)
    del p
    gc.collect()
    print(json.dumps({"loaded": loaded, "left": fake.fake_live_modules(), "current": fake.fake_current()}))
    """)
    assert out == {"loaded": 1, "left": 0, "current": 1}


def test_bench_protocol_warms_up_by_time_and_flushes_before_each_rep(fake_driver):
    out = _run(fake_driver, """
    p = plan(C.Module(b"cubin", 0))
    fake.fake_set_current(1)
    times = C.bench(p, [[1], [2]], [3], [4], DEV0, 0xf1, 4096, warmup_ms=3.0, min_reps=2, min_ms=5.0, max_reps=10)
    print(json.dumps({"times": times, "log": log(), "events": fake.fake_live_events(),
                      "current": fake.fake_current()}))
    """)
    # The fake times every launch at 1 ms: one untimed launch, one timed probe, then
    # 3 warm-up launches for warmup_ms=3 and 5 reps for min_ms=5, each after a flush.
    untimed, probe = "ZLS", "FRZLRE"
    warmup = "FZL" * 3 + "S"
    reps = "FRZLR" * 5 + "E"
    assert out["log"] == untimed + probe + warmup + reps
    assert out["times"] == [1.0] * 5
    assert out["events"] == 0 and out["current"] == 1


def test_bench_rep_count_is_clamped_and_never_zero(fake_driver):
    out = _run(fake_driver, """
    p = plan(C.Module(b"cubin", 0))
    fake.fake_set_elapsed_ms(0.0)  # est floors at 1e-4 ms: min_ms / est overflows an int
    many = C.bench(p, [[1]], [2], [3], DEV0, 0, 0, warmup_ms=0.0, min_reps=1, min_ms=1e9, max_reps=7)
    none = C.bench(p, [[1]], [2], [3], DEV0, 0, 0, warmup_ms=0.0, min_reps=0, min_ms=0.0, max_reps=0)
    print(json.dumps({"many": len(many), "none": len(none), "events": fake.fake_live_events()}))
    """)
    assert out == {"many": 7, "none": 1, "events": 0}


def test_a_failing_launch_in_bench_leaks_no_events(fake_driver):
    out = _run(fake_driver, """
    p = plan(C.Module(b"cubin", 0))
    fake.fake_fail_launch_after(6)
    try:
        C.bench(p, [[1]], [2], [3], DEV0, 0xf1, 4096, warmup_ms=2.0, min_reps=4, min_ms=4.0, max_reps=10)
        err = None
    except CudaError as e:
        err = [type(e).__name__, e.name, e.code, str(e)]
    print(json.dumps({"err": err, "events": fake.fake_live_events()}))
    """)
    assert out["err"][:3] == ["CudaError", "CUDA_ERROR_LAUNCH_FAILED", 719] and "launching kernel 'k'" in out["err"][3]
    assert out["events"] == 0


def test_registry_refuses_none_and_names_missing_ids(fake_driver):
    out = _run(fake_driver, """
    reg = C.Registry()
    try:
        reg.add(None)
        added = "accepted"
    except ValueError as e:
        added = str(e)
    vid = reg.add(plan(C.Module(b"cubin", 0)))
    reg.launch(vid, [1], [2], [3], DEV0)
    try:
        reg.launch(vid + 1, [1], [2], [3], DEV0)
        missing = "launched"
    except IndexError as e:
        missing = str(e)
    print(json.dumps({"added": added, "len": len(reg), "missing": missing, "log": log()}))
    """)
    assert out == {"added": "Registry.add needs a Plan, got None", "len": 1,
                   "missing": "no launch plan with id 1 in the registry", "log": "ZL"}


def test_registry_c_entry_launches_and_reports_errors_as_codes(fake_driver):
    # What kforge._dispatch calls: Registry.launch behind a C ABI that never throws.
    out = _run(fake_driver, """
    reg = C.Registry()
    reg.add(plan(C.Module(b"cubin", 0)))
    call = lambda vid: c_launch(reg, vid, [1], [2], [3])
    ok = call(0)
    missing = call(1)
    fake.fake_fail_launch_after(0)
    failed = call(0)
    print(json.dumps({"ok": ok, "missing": missing, "failed": failed, "log": log()}))
    """)
    assert out["ok"] == [0, ""] and out["missing"] == [2, "no launch plan with id 1 in the registry"]
    assert out["failed"][0] == 1 and out["failed"][1].startswith("CUDA_ERROR_LAUNCH_FAILED")
    assert out["log"].startswith("ZL")


def test_plan_kernels_must_share_one_device(fake_driver):
    out = _run(fake_driver, """
    a, b = C.Module(b"cubin", 0).function("k"), C.Module(b"cubin", 1).function("k")
    try:
        C.Plan([(a, [1], [1], 0, []), (b, [1], [1], 0, [])])
        err = None
    except ValueError as e:
        err = str(e)
    print(json.dumps({"err": err}))
    """)
    assert out["err"] == "kernel 'k' is loaded on another device than 'k': a plan runs on one device"


def _pybind_params(doc: str) -> list[tuple[str, bool]]:
    """(name, has default) of a pybind11 signature line, self left out."""
    sig = doc.splitlines()[0]
    inner = sig[sig.index("(") + 1:sig.rindex(") ->")]
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    params = [(p.split(":")[0].strip(), " = " in p) for p in parts if p.strip()]
    return [p for p in params if p[0] != "self"]


def _stub_params(fn) -> list[tuple[str, bool]]:
    args = fn.args.args
    defaults = [False] * (len(args) - len(fn.args.defaults)) + [True] * len(fn.args.defaults)
    return [(a.arg, d) for a, d in zip(args, defaults) if a.arg != "self"]


def test_stub_matches_the_bindings():
    import ast

    import kforge
    from kforge import _C

    tree = ast.parse((Path(kforge.__file__).parent / "_C.pyi").read_text())
    stubbed = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    public = {n for n in dir(_C) if not n.startswith("_")}
    assert set(stubbed) == public
    for name, node in stubbed.items():
        obj = getattr(_C, name)
        if isinstance(node, ast.FunctionDef):
            assert _stub_params(node) == _pybind_params(obj.__doc__), name
            continue
        members = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
        members.update({m.target.id: None for m in node.body if isinstance(m, ast.AnnAssign)})
        if issubclass(obj, BaseException):
            continue
        bound = {n for n in vars(obj) if not n.startswith("_") or n == "__len__"}
        if "__init__" in vars(obj) and (obj.__init__.__doc__ or "").startswith("__init__("):
            bound.add("__init__")  # a constructor bound with py::init, not pybind's refusing default
        assert set(members) == bound, name
        for mname, m in members.items():
            if m is None or any(isinstance(d, ast.Name) and d.id == "property" for d in m.decorator_list):
                continue
            assert _stub_params(m) == _pybind_params(getattr(obj, mname).__doc__), f"{name}.{mname}"


def test_a_cooperative_kernel_goes_through_cu_launch_cooperative_kernel(fake_driver):
    # After its workspace is zeroed (the counters of a grid-wide barrier), like any plan.
    out = _run(fake_driver, """
    mod = runtime.load(b"cubin", 0)
    fn = mod.function("k")
    args = [("in", 0), ("out", 0), ("ws", 0)]
    p = C.Plan([(fn, [4, 2], [128], 0, args, True), (fn, [1], [32], 0, args, False), (fn, [1], [32], 0, args)],
               [(64, True)])
    p.launch([1], [2], [3], DEV0)
    print(json.dumps({"log": log()}))
    """)
    assert out == {"log": "ZCLL"}


def test_a_refused_cooperative_first_kernel_is_a_refusal_later_ones_are_errors(fake_driver):
    # The driver refusing a cooperative grid before anything ran lets dispatch hand the
    # call to eager (code 3); once an earlier kernel of the plan ran, it is a CUDA error.
    out = _run(fake_driver, """
    mod = C.Module(b"cubin", 0)
    fn = mod.function("k")
    args = [("in", 0), ("out", 0)]
    reg = C.Registry()
    reg.add(C.Plan([(fn, [4], [128], 0, args, True)]))
    reg.add(C.Plan([(fn, [1], [32], 0, args), (fn, [4], [128], 0, args, True)]))
    call = lambda vid: c_launch(reg, vid, [1], [2], [])
    fake.fake_refuse_cooperative(1)
    first, later = call(0), call(1)
    try:
        reg.launch(0, [1], [2], [], DEV0)
        raised = None
    except CudaError as e:
        raised = [type(e).__name__, e.name, e.code, str(e)]
    print(json.dumps({"first": first, "later": later, "raised": raised, "log": log()}))
    """)
    assert out["first"][0] == 3 and "refused before any kernel ran" in out["first"][1]
    assert out["later"][0] == 1 and out["later"][1].startswith("CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE")
    assert "refused before any kernel ran" not in out["later"][1]
    # Typed across the boundary: the Python side tells a refusal by its class, not its text.
    assert out["raised"][:3] == ["LaunchRefused", "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", 720] and out["log"] == "L"


def test_shared_memory_over_48_kb_with_the_static_part_is_opted_into(fake_driver):
    # Exactly 48 KB of dynamic shared memory plus a few hundred static bytes cannot launch
    # without the opt-in (the H200 refused such a cooperative grid as too large).
    out = _run(fake_driver, """
    mod = runtime.load(b"cubin", 0)
    fn = mod.function("k")
    raised = {}
    for static, dynamic in [(0, 48 * 1024), (400, 48 * 1024), (0, 100 * 1024), (400, 0)]:
        fake.fake_set_static_smem(static)
        C.Plan([(fn, [1], [32], dynamic, [("in", 0)])])
        raised[f"{static}+{dynamic}"] = fake.fake_max_dynamic_smem()
    print(json.dumps(raised))
    """)
    assert out == {"0+49152": -1, "400+49152": 49152, "0+102400": 102400, "400+0": -1}


def test_a_pdl_kernel_goes_through_cu_launch_kernel_ex_with_programmatic_serialization(fake_driver):
    out = _run(fake_driver, """
    mod = runtime.load(b"cubin", 0)
    fn = mod.function("k")
    args = [("in", 0), ("out", 0)]
    p = C.Plan([(fn, [4], [128], 0, args), (fn, [4], [128], 0, args, False, True)])
    p.launch([1], [2], [], DEV0)
    try:
        C.Plan([(fn, [4], [128], 0, args, True, True)])
        both = None
    except ValueError as e:
        both = str(e)
    print(json.dumps({"log": log(), "both": both}))
    """)
    assert out["log"] == "LP" and "cooperative or pdl, not both" in out["both"]



def test_a_cluster_kernel_goes_through_cu_launch_kernel_ex_and_a_refused_cluster_is_a_refusal(fake_driver):
    # Clusters over 8 blocks opt into Hopper's non-portable sizes; a cluster the GPU cannot
    # place, refused before anything ran, lets dispatch hand the call to eager (code 3).
    out = _run(fake_driver, """
    mod = C.Module(b"cubin", 0)
    fn = mod.function("k")
    args = [("in", 0), ("out", 0)]
    C.Plan([(fn, [8, 4], [256], 0, args, False, False, 8)]).launch([1], [2], [], DEV0)
    portable = fake.fake_nonportable_cluster()
    C.Plan([(fn, [16, 4], [256], 0, args, False, True, 16)]).launch([1], [2], [], DEV0)
    wide, x, yz = fake.fake_nonportable_cluster(), fake.fake_cluster_x(), fake.fake_cluster_yz()
    bad = []
    for spec in ([12, 1], 0, args, False, False, 8), ([16], 0, args, True, False, 16):
        try:
            C.Plan([(fn, spec[0], [32]) + spec[1:]])
        except ValueError as e:
            bad.append(str(e))
    reg = C.Registry()
    reg.add(C.Plan([(fn, [16], [32], 0, args, False, False, 16)]))
    fake.fake_refuse_cluster(1)
    refused = c_launch(reg, 0, [1], [2], [])
    print(json.dumps({"log": log(), "portable": portable, "wide": wide, "x": x, "yz": yz, "bad": bad,
                      "refused": refused}))
    """)
    assert out["log"] == "QB" and out["portable"] == 0 and out["wide"] == 1 and out["x"] == 16 and out["yz"] == 101
    assert len(out["bad"]) == 2 and all("cluster" in b for b in out["bad"])
    assert out["refused"][0] == 3 and "refused before any kernel ran" in out["refused"][1]
