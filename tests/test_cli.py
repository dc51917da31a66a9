"""The `kforge` command on a CPU model: capture, run (compile-only here), inspect, Ctrl-C, errors.

The proposer is the fake one (through kforge.proposers.get_proposer); evaluation is the real
compile-only path (NVRTC, no GPU) unless a test says otherwise.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from fakes import FakeEvaluator, FakeProposer, toy_card

from kforge import cuda, proposers, run_report, runner
from kforge.card_files import load_cards, save_card
from kforge.cli import build_parser, main
from kforge.cli.parser import resume_command
from kforge.errors import CudaUnavailableError, ExitCode
from kforge.store import connect

MODEL = textwrap.dedent("""
    import torch

    class Tiny(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(torch.relu(x) * 2.0, dim=-1)

    def get_model():
        return Tiny()

    def get_inputs():
        return (torch.randn(8, 64),)
""")


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich tables then fit on one line per card


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(MODEL)
    return path


@pytest.fixture
def cpu_only(monkeypatch):
    """A CPU-only machine with the fake proposer standing in for the builtin one."""
    monkeypatch.setattr(runner, "gpu_devices", lambda requested: [])
    monkeypatch.setattr(proposers, "get_proposer", lambda name, **options: FakeProposer())


def _nvrtc_or_skip():
    try:
        cuda.load_nvrtc()
    except CudaUnavailableError as e:
        pytest.skip(f"needs NVRTC for compile-only evaluation: {e}")


def test_capture_prints_the_table_and_writes_cards(model_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["capture", str(model_file), "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    cards = load_cards(run_dir)
    assert cards and f"{len(cards)} cards written to" in out
    assert {"relu", "softmax"} <= {c.name.split(".")[0].lstrip("_") for c in cards}
    assert "softmax" in out


def test_run_on_a_cpu_machine_compiles_candidates_and_says_validation_needs_a_gpu(model_file, tmp_path, capsys,
                                                                                   cpu_only):
    _nvrtc_or_skip()
    run_dir = tmp_path / "run"
    rc = main(["run", str(model_file), "--run-dir", str(run_dir), "--out", str(tmp_path / "m.cast"),
               "--iterations", "5", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Validation, timing and packaging need a GPU" in " ".join(out.split())
    assert not (tmp_path / "m.cast").exists()
    conn = connect(run_dir, readonly=True)
    verdicts = {r[0] for r in conn.execute("SELECT verdict FROM candidates")}
    assert "untimed" in verdicts  # really compiled by NVRTC
    assert conn.execute("SELECT status FROM runs").fetchone()[0] == "done"

    assert main(["inspect", str(run_dir)]) == 0
    shown = capsys.readouterr().out
    assert "(done)" in shown and "untimed" in shown and "softmax" in shown
    # Packaging it anyway is refused: nothing in a compile-only run was checked or timed.
    assert main(["package", str(run_dir), "--out", str(tmp_path / "m.cast")]) == 1
    assert "ran without a GPU (compile-only)" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "m.cast").exists()


def test_inspect_a_captured_but_unsearched_directory(model_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    main(["capture", str(model_file), "--run-dir", str(run_dir)])
    capsys.readouterr()
    assert main(["inspect", str(run_dir)]) == 0
    assert f"kforge search {run_dir}" in " ".join(capsys.readouterr().out.split())


def test_ctrl_c_exits_130_with_how_to_resume_and_resume_finishes(model_file, tmp_path, capsys, cpu_only,
                                                                 monkeypatch):
    class Interrupting(FakeEvaluator):
        def evaluate(self, card, cand):
            if len(self.calls) == 2:
                raise KeyboardInterrupt
            return super().evaluate(card, cand)

    monkeypatch.setattr(runner, "default_evaluator", lambda run_dir, device: Interrupting(untimed=True))
    run_dir = tmp_path / "run"
    assert main(["run", str(model_file), "--run-dir", str(run_dir), "--iterations", "3", "--seed", "7"]) == 130
    err = " ".join(capsys.readouterr().err.split())
    # The hint repeats the options that differ from the defaults: a plain resume would change the budget.
    assert f"kforge run --resume --run-dir {run_dir} --iterations 3 --seed 7" in err

    monkeypatch.setattr(runner, "default_evaluator", lambda run_dir, device: FakeEvaluator(untimed=True))
    assert main(["run", "--resume", "--run-dir", str(run_dir), "--iterations", "3", "--no-progress"]) == 0
    capsys.readouterr()
    main(["inspect", str(run_dir)])
    assert "(done)" in capsys.readouterr().out


def test_resume_hint_of_a_search_keeps_its_cards_and_options(tmp_path):
    args = build_parser().parse_args(["search", "r", "--cards", "a", "b", "--devices", "0,1", "--include-vendor",
                                      "--proposer", "llm:coder", "--max-cost", "5", "--ops", "softmax,add_"])
    assert resume_command(args, tmp_path / "r") == (f"kforge search {tmp_path / 'r'} --cards a b --proposer llm:coder "
                                                     "--max-cost 5.0 --include-vendor --ops softmax,add_ --devices 0,1")


def test_progress_rows_are_shown_per_card(model_file, tmp_path, capsys, cpu_only, monkeypatch):
    monkeypatch.setattr(runner, "default_evaluator", lambda run_dir, device: FakeEvaluator(untimed=True))
    assert main(["run", str(model_file), "--run-dir", str(tmp_path / "run"), "--iterations", "2"]) == 0
    captured = capsys.readouterr()
    assert "best" in captured.out + captured.err
    assert "capture: running the model on cpu" in captured.err  # the capture's stages, before the search
    assert main(["run", str(model_file), "--run-dir", str(tmp_path / "quiet"), "--iterations", "2", "-q"]) == 0
    assert capsys.readouterr().err == ""


def _fake_gpu_run_dir(tmp_path, monkeypatch):
    """A captured run directory whose search runs on a pretend GPU (fake evaluator and
    proposer): (run dir, package path, its card)."""
    monkeypatch.setattr(runner, "gpu_devices", lambda requested: [0])
    monkeypatch.setattr(runner, "default_evaluator", lambda run_dir, device: FakeEvaluator())
    monkeypatch.setattr(proposers, "get_proposer", lambda name, **options: FakeProposer())
    card = toy_card()
    save_card(card, tmp_path / "run")
    return tmp_path / "run", tmp_path / "m.cast", card


def test_package_then_inspect_and_verify_the_cast(tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour of verify")
    run_dir, cast, card = _fake_gpu_run_dir(tmp_path, monkeypatch)
    assert main(["search", str(run_dir), "--iterations", "4", "--no-progress"]) == 0
    assert main(["package", str(run_dir), "--out", str(cast)]) == 0 and cast.exists()
    capsys.readouterr()
    assert main(["inspect", str(cast)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "cards dispatched as packaged" in out and card.id in out
    assert main(["verify", str(cast)]) == 0  # the fake search dispatched nothing: nothing to re-run
    assert "checksums and format ok; 0 of 1 cards dispatched" in " ".join(capsys.readouterr().out.split())


def test_inspect_shows_the_eager_and_the_compiled_graphs_decision_of_each_card(tmp_path, capsys):
    import json

    from test_package import build_run, relu_candidate, result

    from kforge.package import write_package

    wins, loses = toy_card(n=1024), toy_card(n=2048)
    build_run(tmp_path / "run", [(wins, [(relu_candidate(1024), result())], None),
                                 (loses, [(relu_candidate(2048), result(compiled=4.0))], None)])
    cast = write_package(tmp_path / "run", tmp_path / "m.cast")
    assert main(["inspect", str(cast)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "decision" in line)
    assert [c.strip() for c in header.split("┃")][3:5] == ["decision", "compile"], header
    assert "why (compile)" in " ".join(out.split())  # here, with no GPU, both fall back and say why
    assert main(["inspect", str(cast), "--json"]) == 0
    cards = {c["id"]: c for c in json.loads(capsys.readouterr().out)["cards"]}
    assert (cards[wins.id]["decision"], cards[wins.id]["compile"]["decision"]) == ("dispatched", "dispatched")
    assert (cards[loses.id]["decision"], cards[loses.id]["compile"]["decision"]) == ("dispatched", "fallback")
    assert cards[loses.id]["compile"]["compile_us"] == 4.0 and cards[loses.id]["compile"]["kernel_us"] == 5.0


def test_inspect_shows_the_model_checks_verdict_on_kforge_compile(tmp_path, capsys):
    import json

    from test_package import build_run, relu_candidate, result

    from kforge.package import record_model_check, write_package

    card = toy_card(n=1024)
    build_run(tmp_path / "run", [(card, [(relu_candidate(1024), result())], None)])
    cast = write_package(tmp_path / "run", tmp_path / "m.cast")
    assert main(["inspect", str(cast)]) == 0
    assert "kforge.compile not checked against torch.compile" in " ".join(capsys.readouterr().out.split())
    verdict = {"verdict": "level", "use": "torch.compile", "torch_compile_us": 946.0, "kforge_compile_us": 950.0,
               "noise_us": 9.5, "device": "cuda:0", "compiled_cards": [card.id], "drop": []}
    record_model_check(cast, verdict)
    assert main(["inspect", str(cast)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("model check on cuda:0: torch.compile 946.0 µs, kforge.compile 950.0 µs, level: kforge.compile runs "
            "plain torch.compile for this package") in out
    assert main(["inspect", str(cast), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_check"] == verdict


def test_verify_without_a_gpu_checks_the_package_then_says_the_kernels_need_one(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour of verify")
    from test_package import build_run, relu_candidate, result

    from kforge.package import write_package

    card = toy_card(n=1024)
    build_run(tmp_path / "run", [(card, [(relu_candidate(1024), result())], None)])
    cast = write_package(tmp_path / "run", tmp_path / "m.cast")
    assert main(["verify", str(cast)]) == ExitCode.NO_GPU  # re-validation needs the GPU the package is for
    captured = capsys.readouterr()
    assert "no CUDA GPU" in captured.err
    assert "checksums and format ok; 1 of 1 cards dispatched" in " ".join(captured.out.split())


def test_kforge_errors_exit_1_with_a_message_and_no_traceback(tmp_path, capsys):
    assert main(["search", str(tmp_path / "nothing-here"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "kforge capture" in err and "Traceback" not in err
    assert main(["run", "--resume"]) == 1
    assert "--run-dir" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "x.txt")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["dash", str(tmp_path / "no-such-run")]) == 1
    assert "no such run directory" in capsys.readouterr().err


def test_bad_devices_are_a_usage_error_that_shows_the_format(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["search", "run", "--devices", "0,gpu1"])
    assert exit_info.value.code == 2
    assert "like 0,1 (got '0,gpu1')" in capsys.readouterr().err


def test_dash_without_dash_installed_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "dash", None)  # import dash now fails as if it were not installed
    for name in [m for m in sys.modules if m in ("dash_app", "kforge.dash_app") or m.startswith("dash_app.")]:
        monkeypatch.delitem(sys.modules, name)
    assert main(["dash"]) == 1
    assert "pip install 'kforge[dash]'" in capsys.readouterr().err


def test_doctor_reports_what_it_finds(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "nvrtc" in out and "driver" in out


@pytest.mark.parametrize("flag, checked", [([], True), (["--no-model-check"], False)])
def test_run_prints_the_model_check_and_the_flag_turns_it_off(model_file, tmp_path, capsys, monkeypatch, flag, checked):
    from kforge.modelcheck import ModelCheck

    seen = {}

    def fake_run(model, inputs, **kw):
        seen.update(kw)
        check = ModelCheck(100.0, 2.0, 120.0, 2.0, "cuda:0") if kw["check_model"] else None
        return run_report.RunResult("r1", tmp_path, [], tmp_path / "m.cast", True, model_check=check)

    monkeypatch.setattr(runner, "run", fake_run)
    assert main(["run", str(model_file), "--no-progress", *flag]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert seen["check_model"] is checked
    assert ("0.833x, slower" in out and "do not apply the package" in out) is checked


# ---- for scripts: --version, --json; for people: short tables that do not wrap when piped ----

def test_version(capsys):
    import kforge

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"kforge {kforge.__version__}"


def test_capture_json_is_the_only_thing_on_stdout_and_progress_goes_to_stderr(model_file, tmp_path, capsys):
    import json

    run_dir = tmp_path / "run"
    assert main(["capture", str(model_file), "--run-dir", str(run_dir), "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["run_dir"] == str(run_dir) and {c["id"] for c in doc["cards"]} == {c.id for c in load_cards(run_dir)}
    assert {"calls", "share", "module_paths", "searchable"} <= set(doc["cards"][0])
    assert "capture: running the model" in captured.err and "capture: done in" in captured.err
    assert main(["capture", str(model_file), "--run-dir", str(tmp_path / "quiet"), "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_inspect_json_of_a_capture_a_run_and_a_package(tmp_path, capsys, monkeypatch):
    import json

    run_dir, cast, card = _fake_gpu_run_dir(tmp_path, monkeypatch)
    assert main(["inspect", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "capture"
    assert main(["search", str(run_dir), "--iterations", "4", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(run_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "run" and doc["run"]["status"] == "done" and doc["cards"][0]["card_id"] == card.id
    assert doc["proposer_errors"] == {"count": 0, "top": []}
    assert main(["package", str(run_dir), "--out", str(cast)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(cast), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "package" and doc["cards"][0]["id"] == card.id and doc["cards"][0]["decision"]


def test_run_json_and_doctor_json(model_file, tmp_path, capsys, cpu_only, monkeypatch):
    import json

    monkeypatch.setattr(runner, "default_evaluator", lambda run_dir, device: FakeEvaluator(untimed=True))
    assert main(["run", str(model_file), "--run-dir", str(tmp_path / "run"), "--iterations", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)  # the progress display went to stderr
    assert doc["validated"] is False and doc["package"] is None and "need a GPU" in doc["message"]
    assert main(["doctor", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "devices" in doc and "dispatch" in doc
    if not doc["devices"]:
        assert any("What works: `kforge capture`" in line for line in doc["without_gpu"])


def test_tables_show_the_top_searchable_cards_one_line_each_and_all_with_the_flag(tmp_path, capsys):
    from kforge.capturing import capture
    from kforge.cardtable import skip_reason

    class Many(torch.nn.Module):
        def forward(self, x):
            for _ in range(3):
                x = torch.relu(x.view(-1, 64).t().t()) + 1.0
            return torch.softmax(x, dim=-1)

    run_dir = tmp_path / "run"
    cards = capture(Many(), (torch.randn(8, 64),), run_dir).cards
    skipped = [c for c in cards if skip_reason(c)]
    assert skipped
    assert main(["inspect", str(run_dir)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == len(cards) - len(skipped)  # one line per searchable card, none wrapped
    for c in cards:
        assert (skip_reason(c) is None) == any(c.id in r and c.summary() in r for r in rows)
    assert f"{len(skipped)} more cards not shown (--all lists them)" in out
    assert main(["inspect", str(run_dir), "--all"]) == 0
    assert sum(line.startswith("│") for line in capsys.readouterr().out.splitlines()) == len(cards)


def test_inspect_names_the_proposer_errors_of_a_run(tmp_path, capsys):
    import json

    from conftest_dash import make_llm_error_run

    run = make_llm_error_run(tmp_path)
    assert main(["inspect", str(run.run_dir)]) == 0
    out = capsys.readouterr().out
    assert "proposer error(s)" in out and "gave no usable answer" in out and "failed)" in out
    assert main(["inspect", str(run.run_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["proposer_errors"]["count"] > 0 and doc["llm"]["cost_usd"] > 0


def test_inspect_json_pipes_into_json_load_for_a_run_and_a_package(tmp_path):
    """`kforge inspect RUN --json | python -c 'import json,sys; json.load(sys.stdin)'`, as a user types it."""
    import subprocess

    from conftest_dash import write_demo_run

    run = write_demo_run(tmp_path)
    for target in (run.run_dir, run.run_dir / "model.cast"):
        inspect = subprocess.run([sys.executable, "-m", "kforge", "inspect", str(target), "--json"],
                                 capture_output=True, text=True, timeout=300)
        assert inspect.returncode == 0, inspect.stderr
        load = subprocess.run([sys.executable, "-c", "import json,sys; print(json.load(sys.stdin)['kind'])"],
                              input=inspect.stdout, capture_output=True, text=True, timeout=60)
        assert load.returncode == 0 and load.stdout.strip() in ("run", "package"), (load.stderr, inspect.stdout[:300])
