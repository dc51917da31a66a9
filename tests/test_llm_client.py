"""LLMClient against a real local HTTP endpoint through the real openai client: accounting,
retries, clear failures, budgets, and a key that never leaks."""

from __future__ import annotations

import logging

import pytest

from kforge.errors import BudgetExhausted, LLMError
from kforge.log import SearchLog
from kforge.proposers.llm import LLMClient, LLMConfig, LLMProposer
from kforge.proposers.base import ProposalContext
from kforge.hardware import H200
from llm_cards import answer, softmax_card
from llm_server import ScriptedLLMServer, error, reply, slow

KEY = "sk-kforge-TEST-SECRET-0123456789"
MESSAGES = [{"role": "user", "content": "x" * 400}]


@pytest.fixture
def server():
    with ScriptedLLMServer(api_key=KEY, models={"gpt-4o", "local"}) as s:
        yield s


@pytest.fixture
def make_client(server):
    clients = []

    def make(*, model="gpt-4o", api_key=KEY, on_call=None, **settings):
        sleeps: list[float] = []
        cfg = LLMConfig(model=model, base_url=server.base_url, api_key=api_key, **settings)
        client = LLMClient(cfg, on_call=on_call, sleep=sleeps.append)
        client.sleeps = sleeps
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.close()


def test_reply_usage_and_cost(server, make_client):
    calls = []
    client = make_client(on_call=calls.append)
    server.push(reply("hello", usage=(1000, 200)))
    r = client.chat(MESSAGES, card_id="c1")
    assert (r.text, r.prompt_tokens, r.completion_tokens) == ("hello", 1000, 200)
    assert r.cost_usd == pytest.approx((1000 * 2.5 + 200 * 10.0) / 1e6)
    assert client.totals.calls == 1 and client.totals.tokens == 1200
    (rec,) = calls
    assert (rec.status, rec.card_id, rec.model, rec.base_url, rec.estimated) == ("ok", "c1", "gpt-4o", server.base_url,
                                                                                 False)
    sent = server.requests[0]
    assert sent.headers["authorization"] == f"Bearer {KEY}" and sent.body["model"] == "gpt-4o"
    assert sent.body["messages"] == MESSAGES and sent.body["max_tokens"] == 8192


def test_usage_is_estimated_when_the_endpoint_reports_none(server, make_client):
    calls = []
    client = make_client(model="local", on_call=calls.append)
    server.push(reply("y" * 40, usage=None))
    r = client.chat(MESSAGES)
    assert (r.prompt_tokens, r.completion_tokens, r.cost_usd) == (100, 10, 0.0)
    assert calls[0].estimated


def test_429_waits_as_told_then_succeeds(server, make_client):
    calls = []
    client = make_client(on_call=calls.append)
    server.push(error(429, "slow down", headers={"Retry-After": "7"}), error(503, "overloaded"), reply("ok"))
    assert client.chat(MESSAGES).text == "ok"
    assert client.sleeps[0] == 7.0  # Retry-After honoured exactly
    assert 0.5 * 2 <= client.sleeps[1] <= 2  # second retry: backoff 2 s with jitter
    assert [c.status for c in calls] == ["retry", "retry", "ok"]
    assert "HTTP 429: slow down" in calls[0].error and len(server.requests) == 3


def test_reasoning_model_parameters_are_adapted_once(server, make_client):
    calls = []
    client = make_client(on_call=calls.append)
    server.push(error(400, "Unsupported parameter: 'max_tokens' is not supported with this model. "
                           "Use 'max_completion_tokens' instead."),
                error(400, "Unsupported value: 'temperature' does not support 0.7 with this model."),
                reply("first"), reply("second"))
    assert client.chat(MESSAGES).text == "first" and client.chat(MESSAGES).text == "second"
    bodies = [r.body for r in server.requests]
    assert "max_tokens" in bodies[0] and bodies[0]["temperature"] == 0.7
    assert bodies[2]["max_completion_tokens"] == 8192 and "max_tokens" not in bodies[2]
    assert "temperature" not in bodies[2] and bodies[3].keys() == bodies[2].keys()
    assert [c.status for c in calls] == ["retry", "retry", "ok", "ok"]
    server.push(error(400, "context_length_exceeded"))
    with pytest.raises(LLMError, match=r"rejected the request \(HTTP 400: context_length_exceeded\)"):
        client.chat(MESSAGES)


def test_timeout_then_success_and_timeouts_exhausted(server, make_client):
    calls = []
    client = make_client(on_call=calls.append, timeout_s=0.3, max_retries=1)
    server.push(slow(2.0), reply("late but fine"))
    assert client.chat(MESSAGES).text == "late but fine"
    assert [c.status for c in calls] == ["retry", "ok"] and "timed out after 0.3 s" in calls[0].error
    server.push(slow(2.0), slow(2.0))
    with pytest.raises(LLMError, match=r"gave no reply after 2 attempts \(last: timed out after 0.3 s\).*timeout"):
        client.chat(MESSAGES)
    assert [c.status for c in calls[2:]] == ["retry", "error"]


def test_auth_failure_names_the_variable_and_not_the_key(server, make_client):
    wrong = "sk-wrong-key-9876543210"
    client = make_client(api_key=wrong)
    with pytest.raises(LLMError, match=r"refused the API key \(HTTP 401.*check KFORGE_LLM_API_KEY") as e:
        client.chat(MESSAGES)
    assert wrong not in str(e.value) and "***" in str(e.value)  # the server echoed it; we scrubbed it
    assert len(server.requests) == 1  # not retried


def test_unknown_model_is_named(server, make_client):
    client = make_client(model="gpt-9")
    with pytest.raises(LLMError, match=r"model 'gpt-9' not found at .*check KFORGE_LLM_MODEL.*/models"):
        client.chat(MESSAGES)
    assert len(server.requests) == 1


def test_budgets_stop_before_the_call_that_could_pass_them(server, make_client):
    # Worst case of one call: 100 prompt tokens + 1000 reply tokens at gpt-4o prices = $0.01025.
    client = make_client(max_reply_tokens=1000, max_cost_usd=0.015)
    server.push(reply("a", usage=(100, 1000)))
    client.chat(MESSAGES)
    with pytest.raises(BudgetExhausted, match=r"\$0.0103 spent.*raise max_cost_usd"):
        client.chat(MESSAGES)
    assert len(server.requests) == 1

    tokens = make_client(model="local", max_reply_tokens=500, max_tokens=1400)
    server.push(reply("a", usage=(100, 800)))
    tokens.chat(MESSAGES)
    with pytest.raises(BudgetExhausted, match="900 used.*limit of 1400"):
        tokens.chat(MESSAGES)
    assert len(server.requests) == 2


def test_the_key_appears_nowhere(server, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    log = SearchLog(tmp_path / "run")
    log.start_run("r1", config=LLMConfig(model="gpt-4o", base_url=server.base_url, api_key=KEY).public())
    proposer = LLMProposer(LLMConfig(model="gpt-4o", base_url=server.base_url, api_key=KEY), sleep=lambda s: None)
    proposer.record_calls(log, "r1")
    server.push(error(429, f"rate limited for key {KEY}"), error(500, "boom"), reply(answer("softmax_v1")))
    proposal = proposer.propose(ProposalContext(softmax_card(), H200))
    assert proposal.candidate.plan.kernels[0].name == "softmax_rows_block"
    messages = []
    bad = LLMProposer(LLMConfig(model="gpt-4o", base_url=server.base_url, api_key=KEY + "x"))
    with pytest.raises(LLMError) as e:
        bad.propose(ProposalContext(softmax_card(), H200))
    messages += [str(e.value), repr(e.value)]
    bad.close()
    proposer.close()

    rows = log.rows("SELECT status, error FROM llm_calls ORDER BY id")
    assert [r["status"] for r in rows] == ["retry", "retry", "ok"] and "***" in rows[0]["error"]
    log.close()
    stored = b"".join(p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file())
    assert KEY.encode() not in stored
    assert all(KEY not in r.getMessage() and KEY not in str(r.args) for r in caplog.records)
    assert caplog.records  # the retries were logged, without the key
    assert all(KEY not in m for m in messages)
    assert KEY not in repr(proposer.config) and KEY not in repr(proposal) and KEY not in repr(proposer.client.totals)
