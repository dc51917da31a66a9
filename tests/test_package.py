"""The .cast package: choosing winners from a search log, the zip, and loading it as untrusted input."""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path

import pytest
import torch
from rich.console import Console

from fakes import toy_card
from test_dispatch import FakeLauncher, make_card, relu_kernel

from kforge import castfile, winners
from kforge.candidate import Candidate, LaunchPlan
from kforge.card_files import save_card
from kforge.dispatch import Dispatcher
from kforge.errors import CudaUnavailableError, PackageError
from kforge.store import SQLiteStore
from kforge.castfile import CHECKSUMS, MANIFEST
from kforge.manifest import FORMAT, cubin_sm
from kforge.package import PackageFallbackWarning, load, write_package
from kforge.verdict import EvalResult, Verdict

RUN = "run1"
RELU = r"""
extern "C" __global__ void relu_k(const float* __restrict__ x, float* __restrict__ y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = fmaxf(x[i], 0.0f);
}
"""


def relu_candidate(n: int, block: int = 256) -> Candidate:
    plan = LaunchPlan.from_json({"kernels": [{"name": "relu_k", "grid": [(n + block - 1) // block, 1, 1],
                                              "block": [block, 1, 1], "args": [{"in": 0}, {"out": 0}, {"i32": n}]}]})
    return Candidate(RELU, plan, knobs={"block": block})


def result(verdict: str = "valid", *, eager: float = 10.0, kernel: float = 5.0, dispatched: float | None = 6.0,
           iqr: tuple[float, float] | None = (0.2, 0.1), flags: tuple[str, ...] = (), compiled: float | None = 8.0,
           compile_iqr: float = 0.1, compile_error: str | None = None, message: str = "") -> EvalResult:
    """A verdict as the worker writes it; `compiled`: the card under torch.compile (None: not timed)."""
    evidence = {"tolerances": {"seed1": [{"atol": 1e-6, "rtol": 1e-5}]}}
    if iqr:
        evidence.update(eager={"median_us": eager, "iqr_us": iqr[0]}, kernel={"median_us": kernel, "iqr_us": iqr[1]})
    if compiled is not None:
        evidence["compiled"] = {"median_us": compiled, "iqr_us": compile_iqr}
    if compile_error:
        evidence["compile_error"] = compile_error
    return EvalResult(Verdict(verdict), message, evidence=evidence, eager_us=eager, kernel_us=kernel, dispatched_us=dispatched,
                      compile_us=compiled, max_abs_err=1e-7, max_rel_err=1e-6, flags=list(flags))


def build_run(run_dir: Path, cards: list[tuple], arch: str = "sm_90") -> Path:
    """cards: (card, [(candidate, EvalResult), ...], skip_reason or None)."""
    log = SQLiteStore(run_dir)
    log.start_run(RUN, model="toy", device="NVIDIA H200", arch=arch, torch=torch.__version__)
    for card, tried, skip in cards:
        save_card(card, run_dir)
        log.upsert_card(RUN, card)
        if skip:
            log.set_card_status(RUN, card.id, "skipped", skip)
        for i, (cand, res) in enumerate(tried):
            log.add_candidate(RUN, card.id, cand, res, parent_id=None, iteration=i)
    log.close()
    return run_dir


def entries_by_id(pkg_path: Path) -> dict[str, dict]:
    with zipfile.ZipFile(pkg_path) as z:
        return {e["id"]: e for e in json.loads(z.read(MANIFEST))["cards"]}


@pytest.fixture
def cast(tmp_path) -> Path:
    """A package of one relu card dispatched (eager and compiled) and one that falls back (both)."""
    fast, slow = toy_card(n=1024), toy_card(n=2048)
    build_run(tmp_path / "run", [(fast, [(relu_candidate(1024), result())], None),
                                 (slow, [(relu_candidate(2048), result(dispatched=12.0, compiled=4.0))], None)])
    return write_package(tmp_path / "run", tmp_path / "model.cast")


def rewrite(path: Path, edit, *, checksums: bool = True, infos: dict[str, zipfile.ZipInfo] | None = None) -> Path:
    """Copy a package through `edit(members)`, recomputing checksums unless told not to."""
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    edit(members)
    if checksums:
        body = {n: b for n, b in members.items() if n != CHECKSUMS}
        members[CHECKSUMS] = "".join(f"{castfile.sha256(b)}  {n}\n" for n, b in sorted(body.items())).encode()
    out = path.with_name("edited.cast")
    with zipfile.ZipFile(out, "w") as z:
        for n, b in members.items():
            z.writestr((infos or {}).get(n, zipfile.ZipInfo(n)), b)
    return out


def edit_manifest(fn):
    def edit(members):
        m = json.loads(members[MANIFEST])
        fn(m)
        members[MANIFEST] = json.dumps(m).encode()
    return edit


# ---- choosing winners -------------------------------------------------------------------

def test_winners_only_when_faster_as_dispatched_beyond_noise(tmp_path):
    cards = [toy_card(n=1024 * (i + 1)) for i in range(9)]
    a, b, c, d, e, f, g1, g2, h = cards
    two_fast = [(relu_candidate(f.inputs[0].numel), result(dispatched=7.0)),
                (relu_candidate(f.inputs[0].numel, 128), result(dispatched=6.5))]
    build_run(tmp_path / "run", [
        (a, [(relu_candidate(1024), result())], None),
        (b, [(relu_candidate(2048), result(kernel=5.0, dispatched=11.0))], None),
        (c, [(relu_candidate(3072), result(dispatched=9.8, iqr=(0.4, 0.4)))], None),
        (d, [(relu_candidate(4096), result("incorrect")), (relu_candidate(4096, 128),
                                                                 result("compile_error", message="k.cu(3): error: x is undefined\n1 error"))], None),
        (e, [], "view op"),
        (f, two_fast, None),
        (g1, [(relu_candidate(7168), result(dispatched=9.8, iqr=None))], None),
        (g2, [(relu_candidate(8192), result(dispatched=9.6, iqr=None))], None),
        (h, [(relu_candidate(9216), result(dispatched=None))], None),
    ])
    out = write_package(tmp_path / "run", tmp_path / "m.cast")
    got = entries_by_id(out)
    assert {cid for cid, x in got.items() if x["decision"] == "dispatched"} == {a.id, f.id, g2.id}
    assert got[b.id]["reason"] == "slower than eager as dispatched (11.00 µs vs 10.00 µs)"
    assert got[c.id]["reason"].startswith("within timing noise of eager as dispatched (9.80 µs vs 10.00 µs, noise 0.40")
    assert got[d.id]["reason"] == ("no valid candidate (2 tried: 1 incorrect, 1 compile_error); "
                                   "the last failure: k.cu(3): error: x is undefined")  # what to fix, first line
    assert got[e.id]["reason"] == "not searched: view op"
    assert got[f.id]["candidate"]["knobs"] == {"block": 128} and got[f.id]["timing"]["dispatched_us"] == 6.5
    assert got[g1.id]["decision"] == "fallback" and got[g1.id]["timing"]["noise_us"] == pytest.approx(0.3)
    assert got[h.id]["reason"].startswith("valid, but never timed as dispatched")


def test_noise_is_the_facing_halves_of_the_two_interquartile_ranges():
    """Seen on a busy H100: a bn+add+relu region's kernel ran 38 µs as dispatched against eager's
    126 µs, whose reps had a few host hiccups (IQR 230 µs); half the sum of the IQRs called that
    noise. The baseline's spread below its median and the kernel's above it do not overlap."""
    eager = {"median_us": 125.7, "iqr_us": 230.0, "q1_us": 120.0, "q3_us": 350.0}
    kernel = {"median_us": 38.0, "iqr_us": 3.0, "q1_us": 37.0, "q3_us": 40.0}
    assert winners.noise(125.7, eager, kernel) == pytest.approx(5.7 + 2.0)
    assert winners.beats(38.0, 125.7, winners.noise(125.7, eager, kernel), "eager").dispatched
    even = {"median_us": 10.0, "iqr_us": 0.4}  # no quartiles recorded: half of each IQR
    assert winners.noise(10.0, even, {"median_us": 9.8, "iqr_us": 0.4}) == pytest.approx(0.4)
    assert winners.noise(10.0, {"median_us": 10.0}, kernel, margin=0.03) == pytest.approx(0.3)  # no IQR: the margin
    slow_kernel = {"median_us": 100.0, "q1_us": 99.0, "q3_us": 130.0, "iqr_us": 31.0}
    assert not winners.beats(100.0, 125.7, winners.noise(125.7, eager, slow_kernel), "eager").dispatched


@pytest.mark.parametrize("eager, dispatched, compiled, kernel, want", [
    (10.0, 6.0, 8.0, 5.0, (True, True)),     # beats both
    (10.0, 6.0, 5.05, 5.0, (True, False)),   # beats eager; torch.compile's time is within the noise
    (10.0, 6.0, 4.0, 5.0, (True, False)),    # Inductor's code is faster: the graph keeps it
    (10.0, 11.0, 8.0, 5.0, (False, True)),   # the guard's host cost loses eager, the GPU time beats Inductor
    (10.0, 6.0, None, 5.0, (True, None)),    # no torch.compile time: no compile decision
])
def test_the_packager_decides_twice_against_eager_and_against_torch_compile(eager, dispatched, compiled, kernel, want):
    on_eager, on_compile = winners.decide(eager_us=eager, dispatched_us=dispatched, eager_noise_us=0.2,
                                          kernel_us=kernel, compile_us=compiled, no_compile="torch.compile failed",
                                          compile_noise_us=None if compiled is None else 0.1)
    assert (on_eager.dispatched, on_compile.dispatched) == want
    assert on_eager.baseline_us == eager and on_eager.kernel_us == dispatched
    if compiled is None:
        assert on_compile.reason == "torch.compile failed" and on_compile.baseline_us is None
    else:
        assert (on_compile.baseline_us, on_compile.kernel_us, on_compile.noise_us) == (compiled, kernel, 0.1)
        assert "torch.compile" in on_compile.reason


def test_the_manifest_records_both_decisions_with_their_numbers_and_ships_a_kernel_for_either(tmp_path):
    both, eager_only, compile_only, failed, untimed, neither = (toy_card(n=1024 * (i + 1)) for i in range(6))
    build_run(tmp_path / "run", [
        (both, [(relu_candidate(1024), result())], None),
        (eager_only, [(relu_candidate(2048), result(compiled=4.0))], None),
        (compile_only, [(relu_candidate(3072), result(dispatched=11.0, compiled=7.0))], None),
        (failed, [(relu_candidate(4096), result(compiled=None, compile_error="torch.compile cannot compile "
                                                "aten::relu.default alone: BackendCompilerFailed: boom"))], None),
        (untimed, [(relu_candidate(5120), result(compiled=None))], None),
        (neither, [(relu_candidate(6144), result(dispatched=11.0, compiled=4.0))], None),
    ])
    out = write_package(tmp_path / "run", tmp_path / "m.cast")
    got = entries_by_id(out)
    decisions = {cid: (e["decision"], e["compile"]["decision"]) for cid, e in got.items()}
    assert decisions == {both.id: ("dispatched", "dispatched"), eager_only.id: ("dispatched", "fallback"),
                         compile_only.id: ("fallback", "dispatched"), failed.id: ("dispatched", None),
                         untimed.id: ("dispatched", None), neither.id: ("fallback", "fallback")}
    assert got[both.id]["compile"] == {"decision": "dispatched", "reason": "1.60x faster than torch.compile "
                                       "(5.00 µs vs 8.00 µs)", "compile_us": 8.0, "kernel_us": 5.0,
                                       "noise_us": pytest.approx(0.1)}
    assert got[eager_only.id]["compile"]["reason"] == "slower than torch.compile (5.00 µs vs 4.00 µs)"
    assert "BackendCompilerFailed: boom" in got[failed.id]["compile"]["reason"]
    assert "without the compile baseline" in got[untimed.id]["compile"]["reason"]
    assert got[compile_only.id]["files"] is not None and got[neither.id]["files"] is None

    pkg = load(out, arch="sm_90")
    cards = {c.id: c for c in pkg.cards}
    assert {cid: (c.decision, c.compile_decision) for cid, c in cards.items()} == decisions
    assert cards[compile_only.id].compiled and not cards[compile_only.id].dispatched
    assert cards[compile_only.id].candidate.source == RELU
    assert cards[failed.id].compile_reason == got[failed.id]["compile"]["reason"]
    assert [c.id for c in pkg.kernel_cards()] == [c.id for c in pkg.cards if c.id != neither.id]


def test_a_format_1_package_loads_with_no_compile_decisions(cast):
    def to_format_1(m):
        m["format"] = 1
        for e in m["cards"]:
            del e["compile"]
    pkg = load(rewrite(cast, edit_manifest(to_format_1)), arch="sm_90")
    assert sorted(c.decision for c in pkg.cards) == ["dispatched", "fallback"]
    assert all(c.compile_decision is None and "package format 1" in c.compile_reason for c in pkg.cards)


def test_manifest_records_guard_evidence_and_an_exact_arch_cubin(cast):
    with zipfile.ZipFile(cast) as z:
        names = set(z.namelist())
        manifest = json.loads(z.read(MANIFEST))
        (entry,) = [e for e in manifest["cards"] if e["decision"] == "dispatched"]
        cubin = z.read(entry["files"]["cubin"])
        sums = dict(reversed(line.split("  ")) for line in z.read(CHECKSUMS).decode().splitlines())
    cid = entry["id"]
    assert names == {MANIFEST, CHECKSUMS, f"kernels/{cid}.cu", f"kernels/{cid}.sm_90.cubin"}
    assert set(sums) == names - {CHECKSUMS}
    assert manifest["format"] == FORMAT and manifest["gpu"] == {"name": "NVIDIA H200", "arch": "sm_90"}
    assert manifest["cuda"]["nvrtc"].startswith("13.") and manifest["torch"] == torch.__version__
    assert cubin_sm(cubin) == 90, "the cubin must be for sm_90 exactly, not PTX"
    assert entry["hashes"]["cubin"] == castfile.sha256(cubin)
    assert entry["guard"]["args"][0]["tensor"] == {"shape": [1024], "stride": [1], "dtype": "float32", "device": "cuda",
                                                   "align": 16, "storage_offset": 0, "lo": None, "hi": None}
    assert entry["kind"] == "custom" and entry["plan"]["kernels"][0]["name"] == "relu_k"
    assert entry["timing"] == {"eager_us": 10.0, "kernel_us": 5.0, "eager_dispatched_us": 10.0, "dispatched_us": 6.0,
                               "noise_us": pytest.approx(0.15)}
    assert entry["error"]["max_abs_err"] == 1e-7 and entry["error"]["tolerances"]["seed1"][0]["atol"] == 1e-6


def test_packaging_is_reproducible(cast, tmp_path):
    again = write_package(tmp_path / "run", tmp_path / "again.cast")
    assert again.read_bytes() == cast.read_bytes()


def test_packaging_needs_a_log_and_a_known_run(tmp_path):
    with pytest.raises(PackageError, match="no search log"):
        write_package(tmp_path, tmp_path / "x.cast")
    build_run(tmp_path / "run", [])
    with pytest.raises(PackageError, match="no run 'nope'"):
        write_package(tmp_path / "run", tmp_path / "x.cast", run_id="nope")


def test_cubin_sm_reads_elf_and_rejects_ptx():
    from kforge import compiler

    assert cubin_sm(compiler.compile(RELU, arch="sm_80").cubin) == 80
    assert cubin_sm(b"//\n// Generated by NVIDIA NVVM Compiler\n.version 8.0\n.target sm_90\n" + b" " * 64) is None


# ---- loading -------------------------------------------------------------------------------

def test_round_trip(cast):
    pkg = load(cast, arch="sm_90")
    entries = entries_by_id(cast)
    assert pkg.arch == "sm_90" and pkg.gpu == "NVIDIA H200"
    assert {c.id: c.decision for c in pkg.cards} == {cid: e["decision"] for cid, e in entries.items()}
    (c,) = [c for c in pkg.cards if c.dispatched]
    assert c.candidate.source == RELU and c.candidate.plan.to_json() == entries[c.id]["plan"]
    assert c.card.inputs[0].shape == (1024,) and c.card.arch == "sm_90" and c.kind == "custom"
    assert pkg.manifest["cards"] == list(entries.values())


@pytest.mark.parametrize("arch, words", [("sm_80", ["built for sm_90", "this GPU is sm_80"]),
                                         (None, ["no CUDA GPU"])])
def test_wrong_arch_or_no_gpu_loads_with_everything_falling_back_loudly(cast, arch, words, caplog):
    if arch is None and torch.cuda.is_available():
        pytest.skip("checks the no-GPU path")
    with pytest.warns(PackageFallbackWarning) as warned:
        pkg = load(cast, arch=arch)
    assert not any(c.dispatched for c in pkg.cards)
    (c,) = [c for c in pkg.cards if c.entry["decision"] == "dispatched"]
    for w in words:
        assert w in c.reason and w in str(warned[0].message) and w in caplog.text


def test_corrupt_zip_is_a_package_error(cast, tmp_path):
    bad = tmp_path / "bad.cast"
    bad.write_bytes(cast.read_bytes()[: len(cast.read_bytes()) // 2])
    with pytest.raises(PackageError, match="corrupt"):
        load(bad, arch="sm_90")
    bad.write_bytes(b"not a zip at all")
    with pytest.raises(PackageError, match="corrupt zip"):
        load(bad, arch="sm_90")
    with pytest.raises(PackageError, match="no package"):
        load(tmp_path / "missing.cast")


def test_flipped_byte_in_an_entry_is_caught(cast, tmp_path):
    raw = bytearray(cast.read_bytes())
    with zipfile.ZipFile(cast) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(".cubin"))
    raw[info.header_offset + 30 + len(info.filename) + 5] ^= 0xFF  # inside its compressed data
    bad = tmp_path / "flipped.cast"
    bad.write_bytes(bytes(raw))
    with pytest.raises(PackageError, match="corrupt|checksum"):
        load(bad, arch="sm_90")


def test_wrong_checksum(cast):
    def edit(m):
        name = next(n for n in m if n.endswith(".cu"))
        m[name] = m[name].replace(b"fmaxf(x[i], 0.0f)", b"x[i]")
    with pytest.raises(PackageError, match="checksum mismatch for 'kernels/.*\\.cu'"):
        load(rewrite(cast, edit, checksums=False), arch="sm_90")


def test_edited_source_with_fresh_checksums_still_fails_the_manifest_hash(cast):
    def edit(m):
        name = next(n for n in m if n.endswith(".cu"))
        m[name] = m[name].replace(b"fmaxf(x[i], 0.0f)", b"x[i]")
    with pytest.raises(PackageError, match="does not match its hash"):
        load(rewrite(cast, edit), arch="sm_90")


def test_newer_format_says_upgrade(cast):
    with pytest.raises(PackageError, match="upgrade kforge"):
        load(rewrite(cast, edit_manifest(lambda m: m.update(format=FORMAT + 1))), arch="sm_90")


@pytest.mark.parametrize("name", ["../evil.cu", "/etc/evil.cu", "kernels/../../evil.cu", "C:/evil.cu"])
def test_path_traversal_entry_is_refused(cast, name):
    with pytest.raises(PackageError, match="absolute path or '..'"):
        load(rewrite(cast, lambda m: m.update({name: b"x"})), arch="sm_90")


@pytest.mark.parametrize("name", ["kernels/hook.py", "model.pkl", "weights.pt"])
def test_host_code_or_pickle_entry_is_refused(cast, name):
    with pytest.raises(PackageError, match="host code or a pickle"):
        load(rewrite(cast, lambda m: m.update({name: b"import os"})), arch="sm_90")


def test_unexpected_and_unreferenced_entries_are_refused(cast):
    with pytest.raises(PackageError, match="unexpected entry 'notes.txt'"):
        load(rewrite(cast, lambda m: m.update({"notes.txt": b"hi"})), arch="sm_90")
    with pytest.raises(PackageError, match="not referenced by the manifest"):
        load(rewrite(cast, lambda m: m.update({"kernels/0123456789abcdef.cu": b"//"})), arch="sm_90")


def test_symlink_entry_is_refused(cast):
    link = zipfile.ZipInfo("kernels/0123456789abcdef.cu")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    with pytest.raises(PackageError, match="symlink"):
        load(rewrite(cast, lambda m: m.update({link.filename: b"/etc/passwd"}), infos={link.filename: link}),
             arch="sm_90")


def test_oversized_entry_is_refused(cast, monkeypatch):
    monkeypatch.setattr(castfile, "MAX_ENTRY_BYTES", 512)
    with pytest.raises(PackageError, match="over the 512-byte limit"):
        load(cast, arch="sm_90")
    monkeypatch.setattr(castfile, "MAX_ENTRY_BYTES", 64 << 20)
    small = cast.stat().st_size + 1  # the zip passes, its entries inflated do not
    monkeypatch.setattr(castfile, "MAX_TOTAL_BYTES", small)
    with pytest.raises(PackageError, match=f"add up to more than {small} bytes"):
        load(cast, arch="sm_90")
    monkeypatch.setattr(castfile, "MAX_TOTAL_BYTES", 1024)
    with pytest.raises(PackageError, match="the file is .* over the 1024-byte limit"):
        load(cast, arch="sm_90")


def _dispatched(m):
    return next(e for e in m["cards"] if e["decision"] == "dispatched")


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(gpu="sm_90"), "manifest.gpu must be an object"),
    (lambda m: m.update(format="1"), "manifest.format must be a non-negative integer"),
    (lambda m: m.pop("cards"), "manifest.cards must be present"),
    (lambda m: _dispatched(m).update(decision="maybe"), r"decision must be 'dispatched' or 'fallback'"),
    (lambda m: _dispatched(m)["guard"]["args"][0]["tensor"].update(shape=[2048]), "does not hash to its id"),
    (lambda m: _dispatched(m).update(outputs="x"), r"cards\[\d\]\.outputs must be a list"),
    (lambda m: _dispatched(m).update(kind="magic"), r"kind must be 'custom' or 'vendor'"),
    (lambda m: _dispatched(m)["plan"]["kernels"][0]["args"].append({"in": 5}), "kernel is unusable"),
    # Fields only install() reads must fail the load too, as a PackageError.
    (lambda m: _dispatched(m).update(aliases={"0": "x"}), "must map output indices"),
    (lambda m: _dispatched(m)["outputs"][0].update(shape=["a"], stride=[1]), "metadata .* is malformed"),
    (lambda m: _dispatched(m)["outputs"][0].update(dtype="nope"), "unknown dtype"),
    (lambda m: _dispatched(m)["guard"]["args"].append({"name": "v", "kind": "value", "value": {"memory_format": "load"}}),
     "unknown encoded value"),
    (lambda m: _dispatched(m)["guard"]["args"].append({"name": "t", "kind": "tensor"}), "no tensor metadata"),
])
def test_malformed_manifest_is_a_package_error(cast, edit, words):
    with pytest.raises(PackageError, match=words):
        load(rewrite(cast, edit_manifest(edit)), arch="sm_90")
    with pytest.raises(PackageError, match="not JSON"):
        load(rewrite(cast, lambda m: m.update({MANIFEST: b"{"})), arch="sm_90")
    with pytest.raises(PackageError, match="not JSON"):
        load(rewrite(cast, lambda m: m.update({MANIFEST: b"[" * 100_000 + b"]" * 100_000})), arch="sm_90")


def test_ptx_in_place_of_the_cubin_is_refused(cast):
    ptx = b"//\n.version 8.0\n.target sm_90\n.address_size 64\n"

    def edit(m):
        name = next(n for n in m if n.endswith(".cubin"))
        m[name] = ptx
        manifest = json.loads(m[MANIFEST])
        _dispatched(manifest)["hashes"]["cubin"] = castfile.sha256(ptx)
        m[MANIFEST] = json.dumps(manifest).encode()
    with pytest.raises(PackageError, match="not a cubin for sm_90"):
        load(rewrite(cast, edit), arch="sm_90")


# ---- installing on the CPU stand-in --------------------------------------------------------

@pytest.fixture
def cpu_cast(tmp_path) -> tuple[Path, torch.Tensor]:
    """A package whose one dispatched card is relu on a CPU (4, 8) tensor."""
    x = torch.randn(4, 8)
    card = make_card(torch.ops.aten.relu.default, x)
    build_run(tmp_path / "cpu-run", [(card, [(relu_candidate(32), result())], None)])
    return write_package(tmp_path / "cpu-run", tmp_path / "cpu.cast"), x


def test_apply_dispatches_hits_counts_and_restores(cpu_cast):
    path, x = cpu_cast
    before = torch._C._dispatch_dump("aten::relu")
    pkg, launcher = load(path, arch="sm_90"), FakeLauncher(relu_kernel)
    with pkg.apply(dispatcher=Dispatcher("CPU"), launcher=launcher):
        assert pkg.installed
        torch.relu(x), torch.relu(x), torch.relu(torch.randn(5, 8))
    assert not pkg.installed and torch._C._dispatch_dump("aten::relu") == before
    torch.relu(x)
    assert len(launcher.calls) == 2
    (row,) = pkg.report()["cards"]
    assert row["decision"] == "dispatched" and row["hits"] == 2 and row["fallbacks"] == {"shape": 1}
    assert row["kind"] == "custom" and row["reason"].startswith("1.67x faster than eager as dispatched")
    console = Console(record=True, width=200)
    console.print(pkg.report("table"))
    assert "shape: an input has another shape" in console.export_text()  # each counted reason, explained once


def test_apply_restores_on_exception(cpu_cast):
    path, x = cpu_cast
    before = torch._C._dispatch_dump("aten::relu")
    pkg = load(path, arch="sm_90")
    with pytest.raises(ZeroDivisionError):
        with pkg.apply(dispatcher=Dispatcher("CPU"), launcher=FakeLauncher(relu_kernel)):
            torch.relu(x)
            1 / 0
    assert not pkg.installed and torch._C._dispatch_dump("aten::relu") == before


def test_two_packages_applied_in_turn(cpu_cast):
    path, x = cpu_cast
    before = torch._C._dispatch_dump("aten::relu")
    cpu = Dispatcher("CPU")
    first, second = load(path, arch="sm_90"), load(path, arch="sm_90")
    la, lb = FakeLauncher(relu_kernel), FakeLauncher(relu_kernel)
    with first.apply(dispatcher=cpu, launcher=la):
        with second.apply(dispatcher=cpu, launcher=lb):
            torch.relu(x)
            with pytest.raises(PackageError, match="already installed"):
                second.install(dispatcher=cpu, launcher=lb)
        torch.relu(x)
        assert cpu.ops == ["aten::relu.default"]
    assert (len(la.calls), len(lb.calls)) == (1, 1) and not cpu.ops
    assert torch._C._dispatch_dump("aten::relu") == before


def test_report_table_says_what_runs_and_why(cast):
    pkg = load(cast, arch="sm_90")
    console = Console(record=True, width=200)
    console.print(pkg.report("table"))
    text = console.export_text()
    assert "dispatched" in text and "slower than eager as dispatched" in text
    assert "why (compile)" in text and "1.60x faster than torch.compile" in text
    assert all(c.id in text for c in pkg.cards)


def test_verify_without_a_gpu_says_so(cast):
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU path")
    pkg = load(cast, arch="sm_90")
    with pytest.raises(CudaUnavailableError, match="no CUDA GPU"):
        pkg.verify()


def test_install_of_an_all_fallback_package_overrides_nothing(cast):
    with pytest.warns(PackageFallbackWarning):
        pkg = load(cast, arch="sm_80")
    cpu = Dispatcher("CPU")
    with pkg.apply(dispatcher=cpu):
        assert pkg.installed and not cpu.ops
    assert pkg.report()["dispatched"] == 0


def test_package_files_are_plain_zip_entries(cast):
    with zipfile.ZipFile(cast) as z:
        for info in z.infolist():
            assert stat.S_ISREG(info.external_attr >> 16) and not info.is_dir()


def test_the_model_check_is_recorded_in_the_package_and_shown(cast):
    from kforge.package import record_model_check

    card = load(cast, arch="sm_90").cards[0].id
    record_model_check(cast, {"verdict": "slower", "use": "torch.compile", "torch_compile_us": 946.0,
                              "kforge_compile_us": 1124.0, "noise_us": 9.5, "device": "cuda:0",
                              "compiled_cards": [card], "drop": []})
    pkg = load(cast, arch="sm_90")
    assert pkg.manifest["format"] == FORMAT >= 3 and pkg.manifest["model_check"]["use"] == "torch.compile"
    assert pkg.report()["model_check"]["kforge_compile_us"] == 1124.0
    assert pkg.compile_verdict() == ("model check on cuda:0: torch.compile 946.0 µs, kforge.compile 1124.0 µs, slower: "
                                     "kforge.compile runs plain torch.compile for this package")
    with pytest.raises(PackageError, match=r"manifest.model_check.use must be 'kforge.compile' or 'torch.compile'"):
        record_model_check(cast, {**pkg.manifest["model_check"], "use": "eager"})
