"""`kforge run --proposer llm` end to end against local endpoints that fail: it fails fast,
loud and non-zero, leaves nothing 'done' that never got an answer, and a cost budget holds
whatever the endpoint replies."""

from __future__ import annotations

import itertools
import json
import time

import pytest

from fakes import logged
from kforge import runner
from kforge.card_files import save_card
from kforge.cli import main
from kforge.errors import ExitCode, LLMError
from kforge.store import SQLiteStore, connect
from kforge.verdict import EvalResult, Verdict
from llm_cards import answer, group_norm_card, softmax_card
from llm_server import ScriptedLLMServer, closed_port_url, error, reply
from test_cli import MODEL

KEY = "sk-run-TEST-4242424242"

@pytest.fixture(autouse=True)
def _llm_env(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("KFORGE_LLM_API_KEY", KEY)
    monkeypatch.setenv("KFORGE_LLM_MODEL", "coder")
    monkeypatch.delenv("KFORGE_LLM_CONFIG", raising=False)
    monkeypatch.setattr(runner, "gpu_devices", lambda requested: [])


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(MODEL)
    return path


def _run(argv, capsys) -> tuple[int, float, str]:
    """(exit code, seconds, what stderr said after the capture's progress lines)."""
    start = time.monotonic()
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, time.monotonic() - start, "\n".join(line for line in err if not line.startswith("capture: "))


def _done_cards(run_dir) -> list[str]:
    if not (run_dir / "search.sqlite").exists():
        return []
    conn = connect(run_dir, readonly=True)
    try:
        return [r[0] for r in conn.execute("SELECT card_id FROM cards WHERE status='done'")]
    finally:
        conn.close()


def test_a_refused_connection_exits_non_zero_in_seconds_with_one_line(model_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, took, err = _run(["run", str(model_file), "--proposer", "llm", "--llm-base-url", closed_port_url(),
                            "--run-dir", str(run_dir), "--no-progress"], capsys)
    assert code == ExitCode.PROPOSER_UNAVAILABLE and took < 30
    assert err.startswith("error: cannot reach the LLM endpoint http://127.0.0.1:") and len(err.splitlines()) == 1
    assert not run_dir.exists() and _done_cards(run_dir) == []  # stopped before the capture


def test_a_401_exits_non_zero_with_the_fix_in_one_line(model_file, tmp_path, capsys):
    with ScriptedLLMServer(api_key="another-key", models={"coder"}) as server:
        code, took, err = _run(["run", str(model_file), "--proposer", "llm", "--llm-base-url", server.base_url,
                                "--run-dir", str(tmp_path / "run"), "--no-progress"], capsys)
    assert code == ExitCode.PROPOSER_UNAVAILABLE and took < 30
    assert "refused the API key (HTTP 401" in err and "KFORGE_LLM_API_KEY" in err and len(err.splitlines()) == 1
    assert KEY not in err  # the server echoed it back
    assert _done_cards(tmp_path / "run") == []


def test_a_key_refused_mid_run_stops_the_run_and_no_card_is_done(model_file, tmp_path, capsys):
    # GET /models answers (the check before the capture passes), then every completion is refused.
    with ScriptedLLMServer(api_key=KEY, models={"coder"}, responder=lambda body: error(403, "key revoked")) as server:
        code, took, err = _run(["run", str(model_file), "--proposer", "llm", "--llm-base-url", server.base_url,
                                "--run-dir", str(tmp_path / "run"), "--no-progress"], capsys)
        chats = [r for r in server.requests if r.path.endswith("/chat/completions")]
    assert code == ExitCode.PROPOSER_UNAVAILABLE and "HTTP 403: key revoked" in err and len(err.splitlines()) == 1
    assert len(chats) == 1 and _done_cards(tmp_path / "run") == []
    log = SQLiteStore(tmp_path / "run")
    assert logged(log, "SELECT status FROM runs")[0][0] == "failed"
    assert [r["status"] for r in logged(log, "SELECT status FROM llm_calls")] == ["error"]  # the failed attempt is a row
    log.close()


def test_an_endpoint_down_on_every_card_stops_each_card_then_the_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    for card in (softmax_card(), group_norm_card()):
        save_card(card, run_dir)
    config = tmp_path / "llm.json"
    config.write_text(json.dumps({"max_retries": 0}))
    with ScriptedLLMServer(api_key=KEY, models={"coder"}, responder=lambda body: error(503, "overloaded")) as server:
        code, took, err = _run(["search", str(run_dir), "--proposer", "llm", "--llm-base-url", server.base_url,
                                "--llm-config", str(config), "--no-progress"], capsys)
    assert code == ExitCode.PROPOSER_UNAVAILABLE and "gave no answer for any card" in err and "HTTP 503" in err
    assert len(err.splitlines()) == 1 and took < 30
    log = SQLiteStore(run_dir)
    assert {r[0] for r in logged(log, "SELECT status FROM cards")} == {"failed"}
    assert len(logged(log, "SELECT * FROM llm_calls WHERE status='error'")) == 2 * 3  # 3 unanswered asks per card
    log.close()


def test_max_cost_with_an_unpriced_model_is_refused_before_the_capture(model_file, tmp_path, capsys):
    with ScriptedLLMServer(api_key=KEY, models={"coder"}) as server:
        code, _, err = _run(["run", str(model_file), "--proposer", "llm", "--llm-base-url", server.base_url,
                             "--max-cost", "1", "--run-dir", str(tmp_path / "run"), "--no-progress"], capsys)
        assert server.requests == []
    assert code == ExitCode.ERROR and not (tmp_path / "run").exists()
    assert "'coder' has no known price" in err and "--llm-price" in err and len(err.splitlines()) == 1


class AlwaysCompileError:
    """Every kernel 'fails to compile', so every candidate goes through the repair loop."""

    def evaluate(self, card, candidate) -> EvalResult:
        return EvalResult(Verdict.COMPILE_ERROR, "NVRTC rejected the kernel", compile_log="error: nope")

    def close(self) -> None:
        pass


def test_spend_stays_under_max_cost_whatever_the_endpoint_replies(tmp_path):
    run_dir = tmp_path / "run"
    for card in (softmax_card(), group_norm_card()):
        save_card(card, run_dir)
    hostile = itertools.cycle([
        lambda: reply("z" * (5 << 20), usage=(100, 50)),  # 5 MB "in 50 tokens"
        lambda: reply(answer("softmax_v1"), usage=(-10**7, -10**7)),  # negative usage
        lambda: reply(answer("softmax_v3_warp"), usage=(10**9, 10**9)),  # absurd usage
        lambda: reply(answer("softmax_v1_broken")),  # compiles nowhere: repairs follow
    ])
    budget = 0.6
    with ScriptedLLMServer(api_key=KEY, models={"coder"}, responder=lambda body: next(hostile)()) as server:
        result = runner.search_run(run_dir, proposer="llm", iterations=50, max_cost_usd=budget, progress=False,
                                   proposer_options={"base_url": server.base_url, "price": (2.5, 10.0)},
                                   evaluator_factory=lambda run_dir, device: AlwaysCompileError())
        chats = [r for r in server.requests if r.path.endswith("/chat/completions")]
    log = SQLiteStore(run_dir)
    tokens, cost = log.llm_spend(result.run_id)
    assert 0 < cost <= budget and set(result.stop_reasons.values()) == {"cost"}
    assert len(logged(log, "SELECT * FROM llm_calls")) == len(chats) > 4  # every attempt is a row
    assert max(len(json.dumps(r.body)) for r in chats) < 200_000  # the 5 MB reply was never sent back
    log.close()


def test_max_cost_reaches_the_client_through_kforge_run(tmp_path, monkeypatch):
    """kforge.run's max_cost_usd is the limit the client checks before its first call."""
    with ScriptedLLMServer(api_key=KEY, models={"coder"}, responder=lambda body: reply(answer("softmax_v1"))) as server:
        with pytest.raises(LLMError, match="no known price"):
            runner.run(object(), (), proposer="llm", max_cost_usd=0.01, progress=False,
                       proposer_options={"base_url": server.base_url})
        run_dir = tmp_path / "run"
        save_card(softmax_card(), run_dir)
        result = runner.search_run(run_dir, proposer="llm", max_cost_usd=0.001, progress=False,
                                   proposer_options={"base_url": server.base_url, "price": (2.5, 10.0)},
                                   evaluator_factory=lambda run_dir, device: AlwaysCompileError())
        assert [r.path for r in server.requests][-1] == "/v1/models"  # one worst case is over $0.001: no call made
    assert result.stop_reasons == {softmax_card().id: "cost"}



def test_llm_flags_reach_the_config_and_the_resume_hint(tmp_path):
    from kforge.cli import build_parser
    from kforge.cli.parser import resume_command, search_kwargs
    from kforge.proposers.llm import LLMConfig

    config = tmp_path / "llm.toml"
    config.write_text('max_retries = 1\n')
    args = build_parser().parse_args([
        "search", str(tmp_path), "--proposer", "llm", "--llm-config", str(config), "--llm-model", "my-coder",
        "--llm-price", "0.5,2", "--llm-reply-tokens", "4096", "--llm-temperature", "none", "--llm-top-p", "0.9",
        "--llm-reasoning-effort", "high", "--llm-header", "X-Team: kernels", "--llm-body", '{"top_k": 20}',
        "--max-cost", "3"])
    cfg = LLMConfig.resolve(environ={}, **search_kwargs(args)["proposer_options"])
    assert (cfg.model, cfg.price(), cfg.max_reply_tokens, cfg.temperature, cfg.top_p) == ("my-coder", (0.5, 2.0), 4096,
                                                                                         None, 0.9)
    assert (cfg.reasoning_effort, cfg.extra_headers, cfg.extra_body, cfg.max_retries) == ("high", {"X-Team": "kernels"},
                                                                                          {"top_k": 20}, 1)
    hint = resume_command(args, tmp_path)
    assert "--llm-price 0.5,2.0" in hint and "--llm-body '{\"top_k\": 20}'" in hint and "X-Team" not in hint
    assert f"--llm-config {config}" in hint and "--llm-temperature none" in hint


def test_doctor_prints_the_price_it_will_use(capsys):
    assert main(["doctor", "--llm-model", "openai/o3-pro"]) == 0
    out = capsys.readouterr().out
    assert "$20 prompt, $80 completion per 1M tokens (kforge's table of" in out
    assert main(["doctor", "--llm-model", "my-coder"]) == 0
    assert "unknown: --max-cost is refused until one is given" in capsys.readouterr().out
    assert main(["doctor", "--llm-model", "my-coder", "--llm-price", "1,2"]) == 0
    assert "$1 prompt, $2 completion per 1M tokens (given)" in capsys.readouterr().out
    assert main(["doctor", "--json", "--llm-model", "gpt-4.1-nano"]) == 0
    assert json.loads(capsys.readouterr().out)["llm"]["llm price"].startswith("$0.1 prompt, $0.4 completion")
