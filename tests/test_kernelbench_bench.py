"""bench/kernelbench.py's problem handling on the CPU: the level's files in KernelBench's order,
the default lists and shards, vendor problems left out on request, a batch halved until the
inputs fit (the scale recorded), the time budget shared by the problems, fast_p / geometric
means computed as KernelBench defines them, and whole runs over the hand-written problems in
tests/data/kernelbench (a matmul with its epilogue, a small whole model, one that does not build);
bench/scoreboard.py's tables from result files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kernelbench as kb  # noqa: E402
import scoreboard  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "kernelbench"

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
    # A number names one problem (1 is not 10), other text any problem whose name holds it.
    assert [f.stem for f in kb.select(files, [1], skip_vendor=False)] == ["1_Square_matrix_multiplication_"]
    assert [f.stem for f in kb.select(files, ["relu", "conv"], skip_vendor=False)] == ["2_ReLU", "54_conv_standard_3D"]
    assert kb.select(files, ["all"], skip_vendor=False) == files
    with pytest.raises(SystemExit, match="no KernelBench level2"):
        kb.problem_files(tree, 2)


def test_a_large_batch_is_halved_until_the_inputs_fit_and_the_scale_is_recorded(tree):
    p = kb.fit(kb.load_problem(tree / "KernelBench/level1/10_Softmax.py"), max_bytes=4 * 1024 * 1024)
    assert p.module.batch_size == 1024 and p.scale == 0.25 and "batch_size 4096 -> 1024" in p.notes[0]
    x, = p.module.get_inputs()
    assert tuple(x.shape) == (1024, 1024)
    small = kb.fit(kb.load_problem(tree / "KernelBench/level1/2_ReLU.py"), max_bytes=1e9)
    assert small.scale == 1.0 and small.notes == []


SQUARE = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, predictions, targets):
        return torch.mean(torch.clamp(1 - predictions * targets, min=0))

batch_size = 4096
input_shape = (4096,)

def get_inputs():
    return [torch.rand(batch_size, *input_shape), torch.rand(batch_size)]

def get_init_inputs():
    return []
'''


def test_a_size_that_must_equal_the_batch_is_scaled_with_it(tmp_path):
    """KernelBench's HingeLoss multiplies (batch, n) by (batch,): it runs only where n is the
    batch, so halving the batch alone makes a problem that does not run."""
    (tmp_path / "100_HingeLoss.py").write_text(SQUARE)
    p = kb.fit(kb.load_problem(tmp_path / "100_HingeLoss.py"), max_bytes=4 * 1024 * 1024)
    assert p.module.batch_size == 512 and p.module.input_shape == (512,) and p.scale == 0.125  # 1024: 4 MiB + 4 KiB
    assert "input_shape equal to batch_size and scaled with it" in p.notes[-1]
    predictions, targets = p.module.get_inputs()
    assert p.module.Model()(predictions, targets).shape == ()


POOL3D = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, kernel_size):
        super().__init__()
        self.pool = nn.MaxPool3d(kernel_size)

    def forward(self, x):
        return self.pool(x)

batch_size = 4
channels = 32
dim = 32

def get_inputs():
    return [torch.rand(batch_size, channels, dim, dim, dim)]

def get_init_inputs():
    return [2]
'''


def test_channels_are_halved_too_where_batch_1_is_still_too_large(tmp_path):
    """KernelBench's 3-D poolings hold GBs at batch 1: their channels are halved after the batch."""
    (tmp_path / "43_Max_Pooling_3D.py").write_text(POOL3D)
    p = kb.fit(kb.load_problem(tmp_path / "43_Max_Pooling_3D.py"), max_bytes=600_000)  # 4 MiB at batch 4
    assert p.module.batch_size == 1 and p.module.channels == 4 and p.scale == 1 / 32
    assert "channels 32 -> 4 as well" in p.notes
    (x,) = p.module.get_inputs()
    assert tuple(x.shape) == (1, 4, 32, 32, 32) and p.module.Model(2)(x).shape == (1, 4, 16, 16, 16)
    tiny = kb.fit(kb.load_problem(tmp_path / "43_Max_Pooling_3D.py"), max_bytes=100)
    assert tiny.scale == 0.0 and "skipped" in tiny.notes[-1]


def test_default_lists_hold_what_the_scoreboard_must_show_and_shards_split_them():
    level1 = set(kb.DEFAULT_PROBLEMS[1])
    assert {*range(19, 37), 38, 39, 40, 42, 47, 48, 49, 51, 52, 53, *range(88, 97), 98, 99, 100} <= level1
    assert not level1 & {50, 97}  # a convolution and attention
    assert len(set(kb.DEFAULT_PROBLEMS[2])) >= 16 and len(set(kb.DEFAULT_PROBLEMS[3])) >= 5
    files = [Path(f"{i}_p.py") for i in range(7)]
    halves = kb.shard(files, "0/2"), kb.shard(files, "1/2")
    assert [len(h) for h in halves] == [4, 3] and sorted(halves[0] + halves[1]) == sorted(files)
    assert kb.shard(files, None) == files
    with pytest.raises(SystemExit, match="0 <= k < n"):
        kb.shard(files, "2/2")


def test_a_batch_that_does_not_size_the_inputs_is_skipped_with_the_reason():
    p = kb.fit(kb.load_problem(DATA / "level3/1_SmallResidualBlock.py"), max_bytes=1000)
    assert p.scale == 0.0 and "batch_size does not size them" in p.notes[0]


def test_the_time_budget_is_shared_and_learns_what_a_problem_costs_outside_its_search():
    now = [0.0]
    b = kb.Budget(100.0, cap_s=30.0, overhead_s=10.0, clock=lambda: now[0])
    assert b.search_s(left=4) == 15.0  # 100 / 4 - 10
    b.record(total_s=40.0, search_s=15.0)  # it cost 25 s besides its search
    now[0] = 40.0
    assert b.search_s(left=3) == 2.0  # 60 / 3 - 25 < the minimum search
    now[0] = 75.0
    assert b.search_s(left=2) is None  # 25 s left do not cover 25 s of overhead and a search
    assert kb.Budget(None, cap_s=30.0).search_s(left=50) == 30.0
    assert kb.Budget(1000.0, cap_s=30.0, clock=lambda: 0.0).search_s(left=1) == 30.0
    assert kb.Budget(1000.0, cap_s=1.0, clock=lambda: 0.0).search_s(left=1) == 1.0  # the cap wins over the minimum


def test_fast_p_counts_correct_problems_faster_than_p_and_geomean_skips_missing():
    rows = [{"correct": True, "speedup_vs_eager": 2.5, "speedup_vs_compile": 1.2, "kforge_us": 1},
            {"correct": True, "speedup_vs_eager": 1.2, "speedup_vs_compile": 0.8, "kforge_us": 1},
            {"correct": False, "speedup_vs_eager": 9.0, "speedup_vs_compile": 9.0, "kforge_us": 1},
            {"correct": True, "speedup_vs_eager": 0.9, "speedup_vs_compile": 0.5, "kforge_us": 1}]
    assert kb.fast_p(rows, "eager") == {"fast_0": 0.75, "fast_1": 0.5, "fast_1.5": 0.25, "fast_2": 0.25}
    assert kb.fast_p(rows, "compile")["fast_1"] == 0.25
    s = kb.summarize(rows + [{"problem": "x", "error": "too large"}])
    assert s["problems"] == 5 and s["timed"] == 4 and s["correct"] == 3
    # KernelBench's denominator is every problem: the one that failed is not fast.
    assert s["vs_eager"] == {"fast_0": 0.6, "fast_1": 0.4, "fast_1.5": 0.2, "fast_2": 0.2}
    assert s["geomean_speedup_vs_eager"] == pytest.approx((2.5 * 1.2 * 9.0 * 0.9) ** 0.25)


def test_a_problem_without_a_kernel_scores_as_eager_and_noise_is_no_speedup():
    """No kernel shipped: pkg.apply() runs eager's calls, so a 1 % faster median is noise, not fast_1."""
    none = kb.score({"dispatched": 0, "compiled": 0, "eager_us": 100.0, "kforge_us": 99.0, "kforge_correct": True,
                     "compile_us": 150.0})
    assert none["speedup_vs_eager"] == 1.0 and none["speedup_vs_compile"] == 1.5
    some = kb.score({"dispatched": 1, "compiled": 1, "eager_us": 100.0, "kforge_us": 80.0, "kforge_correct": True,
                     "kforge_compile_us": 50.0, "kforge_compile_correct": True, "kforge_optimize_us": 40.0,
                     "kforge_optimize_correct": False, "compile_us": 60.0})
    assert some["best_kforge_us"] == 50.0 and some["speedup_vs_eager"] == 2.0
    assert not kb.fast_p([{**none, "correct": True}], "eager")["fast_1"]
    # the model check found kforge.compile slower: kforge.compile is plain torch.compile, timed once
    plain = kb.score({"dispatched": 1, "compiled": 1, "eager_us": 100.0, "kforge_us": 90.0, "kforge_correct": True,
                      "compile_us": 60.0, "compile_correct": True, "model_check": {"use": "torch.compile"}})
    assert plain["best_kforge_us"] == 60.0 and plain["speedup_vs_compile"] == 1.0
    # its only kernel was for compiled graphs and the check sent those to torch.compile: nothing
    # of kforge runs, so pkg.apply()'s 3 % is noise
    unused = kb.score({"dispatched": 0, "compiled": 1, "eager_us": 100.0, "kforge_us": 97.0, "kforge_correct": True,
                       "compile_us": 120.0, "compile_correct": True, "model_check": {"use": "torch.compile"}})
    assert unused["best_kforge_us"] == 100.0 and unused["speedup_vs_eager"] == 1.0


def test_card_decisions_give_each_searched_cards_reasons_largest_share_first():
    from types import SimpleNamespace as NS
    card = lambda op, share, family="pointwise", ops=None: NS(op=op, share=share, family=family,  # noqa: E731
                                                               region=NS(ops=ops) if ops else None)
    pkg = NS(cards=[
        NS(card=card("aten::relu.default", 0.1), decision="fallback", reason="slower than eager",
           compile_decision=None, compile_reason=""),
        NS(card=card("aten::view.default", 0.5, "view"), decision="fallback", reason="a view", compile_decision=None,
           compile_reason=""),
        NS(card=card("region::add+relu", 0.6, "region", ["aten::add.Tensor", "aten::relu.default"]),
           decision="dispatched", reason="1.8x eager", compile_decision="fallback", compile_reason="slower than Inductor")])
    got = kb.card_decisions(pkg)
    assert [d["card"] for d in got] == ["add.Tensor > relu.default", "relu.default"]
    assert got[0]["eager"] == "dispatched" and got[0]["compile_reason"] == "slower than Inductor"


def test_faster_beyond_noise_needs_a_margin_wider_than_either_interquartile_range():
    def row(best, best_iqr, base_iqr, correct=True):
        return kb.score({"dispatched": 1, "compiled": 0, "eager_us": 100.0, "eager_iqr_us": base_iqr, "kforge_us": best,
                         "kforge_iqr_us": best_iqr, "kforge_correct": True, "compile_us": 100.0, "correct": correct})
    rows = [row(90.0, 2.0, 3.0),          # 10 µs faster, noise 3: beyond it
            row(99.0, 0.5, 2.0),          # 1 µs faster, the baseline's IQR is 2: noise
            row(95.0, 6.0, 1.0),          # kforge's own IQR is wider than the margin
            row(50.0, 1.0, 1.0, correct=False)]
    assert kb.fast_p(rows, "eager")["fast_1"] == 0.75
    assert kb.beyond_noise(rows, "eager") == 0.25 and kb.summarize(rows)["beyond_noise"]["eager"] == 0.25


def test_a_level_run_reports_each_problem_and_a_problem_that_does_not_build_is_a_row(tmp_path):
    out = tmp_path / "l2.json"
    kb.main(["--kernelbench", str(DATA), "--level", "2", "--problems", "all", "--regions", "--iterations", "1",
             "--wall-time", "1", "--time-budget", "300", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["level"] == 2 and d["regions"] and d["problem_list"] == ["1_Gemm_Multiply_LeakyReLU",
                                                                      "2_Conv2d_Groups_GroupNorm"]
    assert {"date", "device", "torch", "commit", "command"} <= set(d)
    gemm, broken = d["problems"]
    # Searched (with region cards: the matmul's epilogue among them); no GPU here to validate a package.
    from kforge.card_files import load_cards
    from kforge.cards import REGION_NS

    assert gemm["candidates"] > 0 and gemm["search_budget_s"] == 1.0 and "No CUDA GPU" in gemm["error"]
    assert any(c.op.startswith(REGION_NS) for c in load_cards(Path(gemm["run_dir"])))
    assert broken["error"].startswith("does not build: ValueError: in_channels must be divisible by groups")
    assert d["summary"]["problems"] == 2 and d["summary"]["vs_eager"]["fast_0"] == 0.0


def test_a_model_the_region_tracer_cannot_take_is_searched_without_regions(tmp_path, monkeypatch):
    import kforge

    calls = []
    real = kforge.run

    def run(*a, regions=False, **kw):
        calls.append(regions)
        if regions:
            raise RuntimeError("cannot trace this model")
        return real(*a, regions=regions, **kw)
    monkeypatch.setattr(kforge, "run", run)
    out = tmp_path / "l2.json"
    kb.main(["--kernelbench", str(DATA), "--level", "2", "--problems", "1", "--regions", "--iterations", "1",
             "--wall-time", "1", "--out", str(out)])
    (row,) = json.loads(out.read_text())["problems"]
    assert calls == [True, False] and row["candidates"] > 0
    assert row["notes"] == ["regions left out: RuntimeError: cannot trace this model"]


def test_problems_the_time_budget_does_not_reach_are_rows_that_say_so(tmp_path):
    out = tmp_path / "l3.json"
    kb.main(["--kernelbench", str(DATA), "--level", "3", "--problems", "all", "--time-budget", "1",
             "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["problems"] == [{"problem": "1_SmallResidualBlock", "error": "not run: time budget spent"}]


def _result(path: Path, **fields) -> None:
    path.write_text(json.dumps({"device": "NVIDIA H200", "torch": "2.11.0", "commit": "abc1234",
                                "command": "python x", **fields}))


def test_the_scoreboard_joins_a_levels_shards_and_later_runs_and_keeps_the_newest_model_run(tmp_path):
    names = ["1_a", "2_b", "3_c"]
    fast = {"correct": True, "kforge_us": 1.0, "eager_us": 2.0, "speedup_vs_eager": 2.5, "speedup_vs_compile": 1.2}
    _result(tmp_path / "kernelbench_l1_s0of2_h200.json", date="2026-12-02T00:00", shard="0/2", problem_list=names,
            problems=[{"problem": "1_a", **fast}, {"problem": "3_c", "error": "no package written"}])
    _result(tmp_path / "kernelbench_l1_s1of2_h200.json", date="2026-12-02T00:01", shard="1/2", problem_list=names,
            problems=[{"problem": "2_b", **fast, "speedup_vs_eager": 1.2}])
    _result(tmp_path / "kernelbench_l1_old_h200.json", date="2026-11-01T00:00", shard="0/2", problem_list=["9_z"],
            problems=[{"problem": "9_z", **fast}])
    files, s = scoreboard.kernelbench_level(tmp_path, 1)
    assert sorted(p.name for p, _ in files) == ["kernelbench_l1_s0of2_h200.json", "kernelbench_l1_s1of2_h200.json"]
    assert s["problems"] == 3 and s["vs_eager"]["fast_1"] == pytest.approx(2 / 3)
    assert s["vs_eager"]["fast_2"] == pytest.approx(1 / 3) and s["vs_compile"]["fast_1"] == pytest.approx(2 / 3)
    # a later run of some of the list's problems (--problems) replaces their rows, and only theirs
    _result(tmp_path / "kernelbench_l1_s1_h200.json", date="2026-12-03T00:00", problem_list=["2_b", "3_c"],
            problems=[{"problem": "2_b", **fast, "speedup_vs_eager": 3.0}, {"problem": "3_c", "error": "not run: time budget spent"}])
    files, s = scoreboard.kernelbench_level(tmp_path, 1)
    assert sorted(p.name for p, _ in files) == ["kernelbench_l1_s0of2_h200.json", "kernelbench_l1_s1_h200.json"]
    assert s["problems"] == 3 and s["vs_eager"]["fast_2"] == pytest.approx(2 / 3)
    (tmp_path / "kernelbench_l1_s1_h200.json").unlink()
    # ... but not a run on another GPU, or with another proposer
    _result(tmp_path / "kernelbench_l1_a100.json", date="2026-12-04T00:00", problem_list=["2_b"], device="NVIDIA A100",
            problems=[{"problem": "2_b", **fast, "speedup_vs_eager": 3.0}])
    files, _ = scoreboard.kernelbench_level(tmp_path, 1)
    assert "kernelbench_l1_a100.json" not in [p.name for p, _ in files]
    (tmp_path / "kernelbench_l1_a100.json").unlink()
    us = {"eager": {"median_us": 100.0}, "kforge": {"median_us": 80.0}}
    _result(tmp_path / "ab_resnet50_bf16_s8_h200.json", date="2026-12-01", model_us={**us, "torch.compile": {"median_us": 50.0}})
    _result(tmp_path / "model_resnet50_bf16_s9_h200.json", date="2026-12-02", model_us=us)  # newer, no torch.compile
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nOlder rounds.\n")
    scoreboard.main(["--results", str(tmp_path), "--write", str(page)])
    scoreboard.main(["--results", str(tmp_path), "--write", str(page)])  # replaces its block, once
    text = page.read_text()
    assert text.count(scoreboard.BEGIN) == 1 and text.index(scoreboard.END) < text.index("Older rounds.")
    assert "| 1 | 3 | 2 | 0 | 67 % / 67 % / 33 % / 33 % |" in text and "| 2 | not measured yet |" in text
    assert "| resnet50_bf16 | 100 | 50 (2.00×) | — | 80 (1.25×) |" in text and "model_resnet50_bf16_s9" not in text
    assert "commit abc1234; `python x`" in text
    # a newer run with a row whose timings spread over more than 10 % of its median does not replace a quiet one
    loud = {"eager": {"median_us": 100.0, "iqr_us": 3.0}, "torch.compile": {"median_us": 40.0, "iqr_us": 12.0}}
    _result(tmp_path / "ab_resnet50_bf16_s10_h200.json", date="2026-12-03", model_us=loud)
    assert scoreboard.example_models(tmp_path)["resnet50_bf16"][0].name == "ab_resnet50_bf16_s8_h200.json"
    _result(tmp_path / "ab_gemma_s10_h200.json", date="2026-12-03", model_us=loud)  # the only run: shown, marked
    assert "`ab_gemma_s10_h200.json` (noisy: an IQR of 30 % of its median) |" in scoreboard.models_table(tmp_path)


def test_a_result_measured_on_a_changed_tree_says_so(tmp_path):
    """provenance counts the tracked files that differ from the checkout's commit (a device may
    run a copy of the working tree over an older .git), and the scoreboard names them."""
    import shutil
    import subprocess

    import provenance

    if shutil.which("git") is None:
        pytest.skip("needs git")

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "a")
    assert provenance.uncommitted(tmp_path) == 0 and provenance.commit(tmp_path)
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "untracked.py").write_text("")
    assert provenance.uncommitted(tmp_path) == 1
    assert provenance.uncommitted(tmp_path / "no-such-dir") is None
    _result(tmp_path / "ab_m_s1_h200.json", date="2026-12-03", uncommitted_files=3,
            model_us={"eager": {"median_us": 2.0}, "kforge": {"median_us": 1.0}})
    _result(tmp_path / "ab_n_s1_h200.json", date="2026-12-03", uncommitted_files=0,
            model_us={"eager": {"median_us": 2.0}, "kforge": {"median_us": 1.0}})
    text = scoreboard.render(tmp_path)
    assert "commit abc1234 with 3 tracked files changed since it; `python x`" in text
    assert text.count("commit abc1234; `python x`") == 1  # the clean one


def test_the_commit_sent_to_a_device_is_recorded_over_its_older_git(tmp_path, monkeypatch):
    """A device's copy of the tree may carry an older .git: KFORGE_COMMIT, set in the command
    that runs there, is the commit recorded, and the local count of changed files is dropped."""
    import shutil
    import subprocess

    import provenance

    if shutil.which("git") is None:
        pytest.skip("needs git")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    monkeypatch.setenv("KFORGE_COMMIT", "5495318")
    assert provenance.commit(tmp_path) == "5495318" and provenance.uncommitted(tmp_path) is None
    monkeypatch.delenv("KFORGE_COMMIT")
    assert provenance.uncommitted(tmp_path) == 0
