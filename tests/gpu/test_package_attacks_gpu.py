"""Hostile packages on the GPU: a cubin the driver refuses falls back at install instead of
failing the program, and a signed package loads and dispatches with its trusted key."""

from __future__ import annotations

import json

import pytest
import torch

from test_dispatch_gpu import model, packages  # noqa: F401 (packages is a fixture)
from test_package import rewrite
from test_package_attacks import _key_pair

from kforge import castfile
from kforge.castfile import MANIFEST
from kforge.package import PackageFallbackWarning, load, write_package

pytestmark = pytest.mark.gpu


def test_a_cubin_the_driver_refuses_falls_back_at_install(packages):  # noqa: F811
    def garble(m):
        name = next(n for n in m if n.endswith(".cubin"))
        m[name] = m[name][:64] + bytes(len(m[name]) - 64)  # the ELF header says sm_xx, the rest is zeros
        manifest = json.loads(m[MANIFEST])
        next(e for e in manifest["cards"] if e["files"] and e["files"]["cubin"] == name)["hashes"]["cubin"] = \
            castfile.sha256(m[name])
        m[MANIFEST] = json.dumps(manifest).encode()
    pkg = load(rewrite(packages["relu"], garble))
    m, x = model(), torch.randn(64, 512, device="cuda")
    want = m(x.clone())
    with pytest.warns(PackageFallbackWarning, match="cannot be loaded here"), torch.no_grad(), pkg.apply():
        got = m(x.clone())
    torch.testing.assert_close(got, want)
    assert pkg.report()["dispatched"] == 0


def test_a_signed_package_dispatches_with_its_trusted_key(packages, tmp_path):  # noqa: F811
    pytest.importorskip("cryptography")
    private, public = _key_pair(tmp_path)
    signed = write_package(packages["relu"].parent / "relu", tmp_path / "signed.cast", sign_key=private)
    pkg = load(signed, trusted_keys=[public])
    assert pkg.integrity.startswith("signed by trusted key") and all(c.dispatched for c in pkg.cards)
    m, x = model(), torch.randn(64, 512, device="cuda")
    with torch.no_grad(), pkg.apply():
        m(x.clone())
    assert pkg.report()["cards"][0]["hits"] == 1
