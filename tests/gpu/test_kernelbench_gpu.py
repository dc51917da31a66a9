"""bench/kernelbench.py on a real GPU over the hand-written problems of tests/data/kernelbench:
a matmul with its epilogue (level 2, fused regions on) and a small whole model (level 3) are
searched, checked and timed eager / torch.compile / pkg.apply() in one process; the problem
that does not build stays a row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kernelbench as kb  # noqa: E402

pytestmark = pytest.mark.gpu
DATA = Path(__file__).resolve().parents[1] / "data" / "kernelbench"


@pytest.mark.parametrize("level", [2, 3])
def test_a_level_is_searched_checked_and_timed_against_eager_and_torch_compile(level, tmp_path):
    out = tmp_path / f"l{level}.json"
    kb.main(["--kernelbench", str(DATA), "--level", str(level), "--problems", "all", "--regions",
             "--iterations", "4", "--wall-time", "10", "--time-budget", "150", "--out", str(out)])
    d = json.loads(out.read_text())
    timed = [r for r in d["problems"] if "kforge_us" in r]
    assert len(timed) == 1, d["problems"]
    row = timed[0]
    assert row["correct"] and row["eager_us"] > 0 and row["compile_us"] > 0 and row["cards"] > 0
    assert row["speedup_vs_eager"] == pytest.approx(row["eager_us"] / row["best_kforge_us"])
    plain = (row.get("model_check") or {}).get("use") == "torch.compile"  # the check found the kernels slower
    for variant in ("kforge_optimize", "kforge_compile"):  # timed whenever there is a kernel for them
        assert (f"{variant}_us" in row or f"{variant}_error" in row) == bool(
            row["dispatched"] if variant == "kforge_optimize" else row["compiled"] and not plain)
    assert d["summary"]["timed"] == 1 and d["summary"]["problems"] == len(d["problem_list"])
    if level == 2:
        assert d["problems"][1]["error"].startswith("does not build")
