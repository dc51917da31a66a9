"""Hostile .cast packages: zip bombs, malformed fields, markup in reasons, tampering. Each is
built with the real writer, then changed; each must be refused with a one-line error or
fall back, never a traceback, a crash of the forward, or gigabytes of memory."""

from __future__ import annotations

import io
import json
import time
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from rich.console import Console

from fakes import toy_card
from test_package import RUN, _dispatched, build_run, edit_manifest, relu_candidate, result, rewrite

from kforge import castfile
from kforge.cli import main
from kforge.errors import PackageError
from kforge.castfile import MANIFEST
from kforge.package import PackageFallbackWarning, load, write_package
from kforge.run_report import CardResult, results_table

BOMB_BYTES = 1_500_000_000  # inflated; about 1.5 MB deflated


@pytest.fixture
def run_cast(tmp_path) -> tuple[Path, Path]:
    """(run dir, the package written from it): one relu card dispatched (eager and compiled), one
    that falls back (both)."""
    fast, slow = toy_card(n=1024), toy_card(n=2048)
    run_dir = build_run(tmp_path / "run", [(fast, [(relu_candidate(1024), result())], None),
                                           (slow, [(relu_candidate(2048), result(dispatched=12.0, compiled=4.0))],
                                            None)])
    return run_dir, write_package(run_dir, run_dir / "model.cast")


@pytest.fixture
def cast(run_cast) -> Path:
    return run_cast[1]


def _patch(raw: bytearray, name: bytes, field: str, value: int) -> None:
    """Overwrite a field of entry `name` in both its local and its central header."""
    at = {"method": (8, 10, 2), "size": (22, 24, 4)}[field]
    for signature, offset, name_at in ((b"PK\x03\x04", at[0], 30), (b"PK\x01\x02", at[1], 46)):
        i = raw.find(signature)
        while raw[i + name_at:i + name_at + len(name)] != name:
            i = raw.find(signature, i + 4)
        raw[i + offset:i + offset + at[2]] = value.to_bytes(at[2], "little")


@pytest.fixture(scope="module")
def bomb_entry(tmp_path_factory) -> bytes:
    """A zip holding one manifest.json of 1.5 GB of zeros deflated to ~1.5 MB, declaring 1 MB."""
    # After a full flush deflate starts afresh, so one compressed MB repeats into the whole stream.
    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    mb = z.compress(bytes(1 << 20)) + z.flush(zlib.Z_FULL_FLUSH)
    stream = mb * (BOMB_BYTES >> 20) + z.flush()
    path = tmp_path_factory.mktemp("bomb") / "bomb.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(MANIFEST, stream)
    raw = bytearray(path.read_bytes())
    _patch(raw, MANIFEST.encode(), "method", zipfile.ZIP_DEFLATED)
    _patch(raw, MANIFEST.encode(), "size", 1 << 20)  # the lie: under every limit, so only inflating can tell
    assert 1_000_000 < len(raw) < 2_000_000
    with zipfile.ZipFile(io.BytesIO(raw)) as zf, zf.open(MANIFEST) as f:
        f._left = BOMB_BYTES  # read past the lie: the stream really is 1.5 GB of zeros
        assert f.read(BOMB_BYTES >> 8) == bytes(BOMB_BYTES >> 8)
    return bytes(raw)


def _bounded(fn) -> None:
    """Run fn within 1 s and 100 MB of Python allocations."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert elapsed < 1.0, f"took {elapsed:.1f} s"
    assert peak < 100 << 20, f"peaked at {peak >> 20} MB"


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "Traceback" not in err
    return err


# ---- zip bombs ------------------------------------------------------------------------------

def test_zip_bomb_is_refused_quickly_by_load_inspect_verify_and_the_dashboard(run_cast, bomb_entry, capsys):
    run_dir, cast = run_cast
    cast.write_bytes(bomb_entry)

    def refused_by_load():
        with pytest.raises(PackageError, match="corrupt|inflates past"):
            load(cast, arch="sm_90")
    _bounded(refused_by_load)
    _bounded(lambda: main(["inspect", str(cast)]) == 1 or pytest.fail("inspect did not fail"))
    _one_line_error(capsys)
    _bounded(lambda: main(["verify", str(cast)]) == 1 or pytest.fail("verify did not fail"))
    _one_line_error(capsys)

    pytest.importorskip("dash")
    from conftest_dash import import_dash_app

    import_dash_app()
    from dash_app.data import Catalog

    view = {}
    _bounded(lambda: view.update(Catalog([run_dir], ttl_s=0).package(RUN)))
    assert view["path"] is None and "cannot read model.cast" in view["error"]


def test_an_entry_that_inflates_past_the_limit_is_refused_while_inflating(cast, monkeypatch):
    # The declared sizes are true here: the limit is lowered under them after the declared
    # check would have passed, so only the streaming count can refuse.
    monkeypatch.setattr(castfile, "_check_entry", lambda path, info: None)
    monkeypatch.setattr(castfile, "MAX_ENTRY_BYTES", 1000)
    with pytest.raises(PackageError, match="inflates past the 1000-byte limit"):
        load(cast, arch="sm_90")


def test_bzip2_and_lzma_entries_are_refused(cast, tmp_path):
    with zipfile.ZipFile(cast) as z:
        members = {n: z.read(n) for n in z.namelist()}
    out = tmp_path / "bz.cast"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_BZIP2) as z:
        for n, b in members.items():
            z.writestr(n, b)
    with pytest.raises(PackageError, match="compression method 12"):
        load(out, arch="sm_90")


# ---- malformed fields -----------------------------------------------------------------------

def _workspace(ws):
    def edit(m):
        _dispatched(m)["plan"]["workspace"] = [ws]
    return edit


MALFORMED = [
    (_workspace({"bytes": "x"}), "workspace entry"),
    (_workspace({"zero": True}), "workspace entry"),
    (_workspace(None), "workspace entry"),
    (_workspace(-5), "workspace entry"),
    (_workspace(10**15), "workspace entry"),
    (_workspace(1.5), "workspace entry"),
    (lambda m: _dispatched(m).update(op="relu"), r"\.op must be an op name"),
    (lambda m: _dispatched(m).update(op="__class__::__init__.__call__"), r"\.op must be an op name"),
    (lambda m: _dispatched(m)["timing"].update(eager_us="x"), r"timing\.eager_us must be a finite"),
    (lambda m: _dispatched(m)["timing"].update(kernel_us=-1.0), r"timing\.kernel_us must be a finite non-negative"),
    (lambda m: _dispatched(m).update(share="all"), r"\.share must be a finite"),
    (lambda m: _dispatched(m).update(timing="fast"), r"\.timing must be an object"),
    (lambda m: _dispatched(m).update(reason="x" * 100_000), r"\.reason must be text of at most"),
    (lambda m: _dispatched(m).update(reason=["x"]), r"\.reason must be text"),
    (lambda m: _dispatched(m).update(calls=-1), r"\.calls must be a non-negative integer"),
    (lambda m: _dispatched(m).update(calls=True), r"\.calls must be a non-negative integer"),
    (lambda m: _dispatched(m).update(module_paths=[1]), r"module_paths\[0\] must be text"),
    (lambda m: _dispatched(m).update(candidate="x"), r"\.candidate must be an object"),
    (lambda m: _dispatched(m)["candidate"].update(knobs={"k": [[[[[[[[[[1]]]]]]]]]]}), r"nested at most"),
    (lambda m: _dispatched(m).update(extra=1), r"\.extra must be absent"),
    (lambda m: m.update(cuda="13.0"), r"manifest\.cuda must be an object"),
    (lambda m: m["selection"].update(margin="x"), r"selection\.margin must be a finite"),
    (lambda m: m["gpu"].update(arch="[blink]sm_90[/blink]"), r"gpu\.arch must be an arch"),
]


@pytest.mark.parametrize("edit, words", MALFORMED)
def test_every_malformed_field_is_a_one_line_package_error(cast, edit, words, capsys):
    bad = rewrite(cast, edit_manifest(edit))
    with pytest.raises(PackageError, match=words) as e:
        load(bad, arch="sm_90")
    assert "\n" not in str(e.value)
    assert main(["inspect", str(bad)]) == 1 and main(["verify", str(bad)]) == 1
    _one_line_error(capsys)


@pytest.mark.parametrize("literal, words", [("Infinity", "Infinity is not a finite number"),
                                             ("NaN", "NaN is not a finite number"),
                                             ("1e999", r"eager_us must be a finite")])
def test_non_finite_numbers_are_refused(cast, literal, words):
    def edit(m):
        raw = json.loads(m[MANIFEST])
        _dispatched(raw)["timing"]["eager_us"] = 12345.5
        m[MANIFEST] = json.dumps(raw).encode().replace(b"12345.5", literal.encode())
    with pytest.raises(PackageError, match=words):
        load(rewrite(cast, edit), arch="sm_90")


@pytest.mark.parametrize("edit, words", [MALFORMED[0], MALFORMED[6], MALFORMED[8], MALFORMED[11]])
def test_the_dashboard_shows_a_malformed_package_as_an_error(run_cast, edit, words):
    pytest.importorskip("dash")
    from conftest_dash import import_dash_app

    import_dash_app()
    from dash_app.data import Catalog

    run_dir, cast = run_cast
    rewrite(cast, edit_manifest(edit)).replace(cast)
    view = Catalog([run_dir], ttl_s=0).package(RUN)
    assert view["path"] is None and "malformed manifest" in view["error"] and view["cards"] == []


def test_apply_without_a_driver_falls_back_loudly(cast):
    if torch.cuda.is_available():
        pytest.skip("checks the no-driver path")
    pkg = load(cast, arch="sm_90")  # arch given: nothing here says there is no GPU until install
    assert pkg.report()["dispatched"] == 1
    with pytest.warns(PackageFallbackWarning, match="no CUDA GPU or driver"):
        with pkg.apply():
            torch.relu(torch.randn(8))
    assert pkg.report()["dispatched"] == 0
    assert all("cannot be loaded here" in c.reason for c in pkg.cards if c.entry["decision"] == "dispatched")


# ---- package text is plain text ------------------------------------------------------------

HOSTILE_REASONS = ["[/]", "[link=https://evil.example]click[/link]", "[blink]urgent[/blink]", "[bold red]ok[/]"]


@pytest.mark.parametrize("reason", HOSTILE_REASONS)
def test_reasons_are_shown_as_plain_text(cast, reason, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # the reason on one line of the table
    def edit(m):
        next(e for e in m["cards"] if e["decision"] == "fallback")["reason"] = reason
    bad = rewrite(cast, edit_manifest(edit))
    assert main(["inspect", str(bad)]) == 0
    assert reason in " ".join(capsys.readouterr().out.split())
    console = Console(record=True, width=300, color_system="truecolor")
    console.print(load(bad, arch="sm_90").report("table"))
    assert reason in console.export_text()
    assert "\x1b]8;" not in console.export_text(styles=True)  # no hyperlink escape
    assert "\x1b[5m" not in console.export_text(styles=True)  # no blink


def test_log_notes_are_shown_as_plain_text():
    row = CardResult("0123456789abcdef", "aten::relu.default", "pointwise", "relu(8:float32)", "done", 1, 1.0, 0.5,
                     2.0, "[/] [link=https://evil.example]x[/link]")
    console = Console(record=True, width=300)
    console.print(results_table([row], "cards"))
    assert "[/] [link=https://evil.example]x[/link]" in console.export_text()


# ---- signatures -----------------------------------------------------------------------------

def _key_pair(tmp_path: Path, name: str = "key") -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private, public = tmp_path / f"{name}.pem", tmp_path / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def _replace_kernel(m):
    """The tampering checksums cannot see: a new kernel, its manifest hash and checksums recomputed."""
    name = next(n for n in m if n.endswith(".cu"))
    m[name] = m[name].replace(b"fmaxf(x[i], 0.0f)", b"x[i]")
    manifest = json.loads(m[MANIFEST])
    _dispatched(manifest)["hashes"]["source"] = castfile.sha256(m[name])
    m[MANIFEST] = json.dumps(manifest).encode()


def test_signed_package_with_a_modified_kernel_is_refused(run_cast, tmp_path, capsys):
    pytest.importorskip("cryptography")
    run_dir, _ = run_cast
    private, public = _key_pair(tmp_path)
    _, stranger = _key_pair(tmp_path, "stranger")
    signed = tmp_path / "signed.cast"
    assert main(["package", str(run_dir), "--out", str(signed), "--sign", str(private)]) == 0
    pkg = load(signed, arch="sm_90", trusted_keys=[public])
    assert pkg.integrity.startswith("signed by trusted key") and pkg.report()["integrity"] == pkg.integrity
    assert load(signed, arch="sm_90", trusted_keys=[public.read_bytes()]).integrity == pkg.integrity
    assert load(signed, arch="sm_90").integrity.startswith("signed, signature not checked")
    with pytest.raises(PackageError, match="does not match any trusted key"):
        load(signed, arch="sm_90", trusted_keys=[stranger])

    tampered = rewrite(signed, _replace_kernel)  # keeps the old signature entry
    with pytest.raises(PackageError, match="does not match any trusted key") as e:
        load(tampered, arch="sm_90", trusted_keys=[public])
    assert "\n" not in str(e.value)
    assert main(["inspect", str(tampered), "--trusted-key", str(public)]) == 1
    assert "does not match any trusted key" in _one_line_error(capsys)
    assert main(["inspect", str(signed), "--trusted-key", str(public)]) == 0
    assert "signed by trusted key" in capsys.readouterr().out


def test_unsigned_package_loads_and_says_so(cast, tmp_path, capsys):
    tampered = rewrite(cast, _replace_kernel)
    pkg = load(tampered, arch="sm_90")  # checksums alone cannot tell
    assert pkg.integrity.startswith("unsigned") and "not tampering" in pkg.integrity
    assert main(["inspect", str(tampered)]) == 0
    assert "unsigned" in capsys.readouterr().out
    pytest.importorskip("cryptography")
    _, public = _key_pair(tmp_path)
    with pytest.raises(PackageError, match="is not signed, and trusted keys were given"):
        load(tampered, arch="sm_90", trusted_keys=[public])


def test_a_bad_signing_key_is_a_one_line_error(run_cast, tmp_path, capsys):
    pytest.importorskip("cryptography")
    run_dir, _ = run_cast
    _, public = _key_pair(tmp_path)
    assert main(["package", str(run_dir), "--out", str(tmp_path / "x.cast"), "--sign", str(public)]) == 1
    assert "openssl genpkey -algorithm ed25519" in _one_line_error(capsys)


def test_dashboard_link_text_adds_no_markdown(monkeypatch):
    pytest.importorskip("dash")
    from conftest_dash import import_dash_app

    import_dash_app()
    from dash_app import components

    monkeypatch.setattr(components, "href", lambda page, **params: f"/{page}")
    link = components.md_link("relu(8:float32)](javascript:alert(1)) [x](https://evil.example) **b**", "card")
    # One link, to kforge's page: every bracket, parenthesis and star of the text is escaped.
    assert link.startswith("[") and link.endswith("](/card)")
    assert "](javascript" not in link and "](https" not in link and "\\*\\*b\\*\\*" in link
