"""bench/kernelbench.py's problem handling on the CPU: the level's files in KernelBench's order,
vendor problems left out on request, a batch halved until the inputs fit (the scale recorded),
and fast_p / geometric means computed as KernelBench defines them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kernelbench as kb  # noqa: E402

PROBLEM = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.softmax(x, dim=self.dim)

batch_size = {batch}
features = 1024

def get_inputs():
    return [torch.rand(batch_size, features)]

def get_init_inputs():
    return [1]
'''


@pytest.fixture
def tree(tmp_path):
    level = tmp_path / "KernelBench" / "level1"
    level.mkdir(parents=True)
    for name, batch in (("10_Softmax", 4096), ("2_ReLU", 16), ("1_Square_matrix_multiplication_", 8),
                        ("54_conv_standard_3D", 8)):
        (level / f"{name}.py").write_text(PROBLEM.format(batch=batch))
    return tmp_path


def test_files_come_in_kernelbench_order_and_vendor_problems_can_be_left_out(tree):
    files = kb.problem_files(tree, 1)
    assert [f.stem for f in files] == ["1_Square_matrix_multiplication_", "2_ReLU", "10_Softmax", "54_conv_standard_3D"]
    assert [f.stem for f in kb.select(files, None, skip_vendor=True)] == ["2_ReLU", "10_Softmax"]
    assert [f.stem for f in kb.select(files, ["10"], skip_vendor=False)] == ["10_Softmax"]
    with pytest.raises(SystemExit, match="no KernelBench level2"):
        kb.problem_files(tree, 2)


def test_a_large_batch_is_halved_until_the_inputs_fit_and_the_scale_is_recorded(tree):
    p = kb.fit(kb.load_problem(tree / "KernelBench/level1/10_Softmax.py"), max_bytes=4 * 1024 * 1024)
    assert p.module.batch_size == 1024 and p.scale == 0.25 and "batch_size 4096 -> 1024" in p.notes[0]
    x, = p.module.get_inputs()
    assert tuple(x.shape) == (1024, 1024)
    small = kb.fit(kb.load_problem(tree / "KernelBench/level1/2_ReLU.py"), max_bytes=1e9)
    assert small.scale == 1.0 and small.notes == []


def test_fast_p_counts_correct_problems_faster_than_p_and_geomean_skips_missing():
    rows = [{"correct": True, "speedup_vs_eager": 2.5, "speedup_vs_compile": 1.2, "kforge_us": 1},
            {"correct": True, "speedup_vs_eager": 1.2, "speedup_vs_compile": 0.8, "kforge_us": 1},
            {"correct": False, "speedup_vs_eager": 9.0, "speedup_vs_compile": 9.0, "kforge_us": 1},
            {"correct": True, "speedup_vs_eager": 0.9, "speedup_vs_compile": 0.5, "kforge_us": 1}]
    assert kb.fast_p(rows, "eager") == {"fast_0": 0.75, "fast_1": 0.5, "fast_1.5": 0.25, "fast_2": 0.25}
    assert kb.fast_p(rows, "compile")["fast_1"] == 0.25
    s = kb.summarize(rows + [{"problem": "x", "error": "too large"}])
    assert s["problems"] == 5 and s["timed"] == 4 and s["correct"] == 3
    assert s["geomean_speedup_vs_eager"] == pytest.approx((2.5 * 1.2 * 9.0 * 0.9) ** 0.25)
