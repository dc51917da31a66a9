"""bench/slim_wheel.py: a wheel repacked without some members keeps the rest byte for byte and
a RECORD that no longer lists what was dropped."""

import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import slim_wheel  # noqa: E402


def test_dropped_members_leave_the_wheel_and_its_record(tmp_path):
    whl = tmp_path / "pkg-1.0-py3-none-any.whl"
    record = "pkg/__init__.py,sha256=x,1\npkg/jars/big.jar,sha256=y,9\npkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("pkg/__init__.py", "x = 1\n")
        z.writestr("pkg/jars/big.jar", b"\0" * 100_000)
        z.writestr("pkg-1.0.dist-info/RECORD", record)
    before, after = slim_wheel.slim(str(whl), ["pkg/jars/"])
    assert after < before
    with zipfile.ZipFile(whl) as z:
        assert sorted(z.namelist()) == ["pkg-1.0.dist-info/RECORD", "pkg/__init__.py"]
        assert z.read("pkg/__init__.py") == b"x = 1\n"
        assert "jars" not in z.read("pkg-1.0.dist-info/RECORD").decode()
