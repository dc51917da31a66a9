"""Repack a wheel without some of its files, for carrying it to a GPU machine that has no
network and a cap on what one command can take along (Ray's wheel is ~80 MB, of which 32 MB
is the Java worker's jar that a Python-only run never loads):

    python bench/slim_wheel.py .whl/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl ray/jars/

The wheel is rewritten in place; RECORD loses the dropped files' lines so pip installs it."""

from __future__ import annotations

import argparse
import os
import tempfile
import zipfile


def slim(path: str, prefixes: list[str]) -> tuple[int, int]:
    """(bytes before, bytes after) of the wheel at `path` with every member under `prefixes` left out."""
    before = os.path.getsize(path)
    fd, tmp = tempfile.mkstemp(suffix=".whl", dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            name = info.filename
            if any(name.startswith(p) for p in prefixes):
                continue
            data = src.read(info)
            if name.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(ln for ln in lines if not any(ln.startswith(p) for p in prefixes)) + "\n").encode()
            dst.writestr(info, data)
    os.replace(tmp, path)
    return before, os.path.getsize(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel")
    ap.add_argument("prefixes", nargs="+", help="member path prefixes to leave out, e.g. ray/jars/")
    a = ap.parse_args()
    before, after = slim(a.wheel, a.prefixes)
    print(f"{a.wheel}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
