"""LLMClient against a real local HTTP endpoint through the real openai client: accounting,
retries, adapting to what a provider rejects, clear failures, a budget that holds as a hard
limit whatever the server says, and a key that never leaks."""

from __future__ import annotations

import logging
import time

import pytest

from kforge.errors import BudgetExhausted, ProposerUnavailable
from kforge.hardware import H200
from fakes import logged
from kforge.store import SQLiteStore
from kforge.proposers.base import ProposalContext
from kforge.proposers.llm import LLMClient, LLMConfig, LLMProposer
from kforge.proposers.llm.client import MAX_CHARS_PER_TOKEN, prompt_ceiling
from kforge.spend import Spend
from llm_cards import answer, softmax_card
from llm_server import ScriptedLLMServer, closed_port_url, error, reply, slow

KEY = "sk-kforge-TEST-SECRET-0123456789"
MESSAGES = [{"role": "user", "content": "x" * 4000}]
CEILING = prompt_ceiling(MESSAGES)  # 4000 bytes + template overhead


@pytest.fixture
def server():
    with ScriptedLLMServer(api_key=KEY, models={"gpt-4o", "local", "o3", "claude-3-haiku", "qwen"}) as s:
        yield s


@pytest.fixture
def make_client(server):
    clients = []

    def make(*, model="gpt-4o", api_key=KEY, on_call=None, ledger=None, **settings):
        sleeps: list[float] = []
        cfg = LLMConfig(model=model, base_url=server.base_url, api_key=api_key, **settings)
        client = LLMClient(cfg, on_call=on_call, sleep=sleeps.append, ledger=ledger)
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
    assert sent.body["messages"] == MESSAGES and sent.body["max_tokens"] == 8192 and sent.body["temperature"] == 0.7


def test_provider_settings_reach_the_request(server, make_client):
    client = make_client(max_reply_tokens=3000, temperature="none", top_p=0.9, reasoning_effort="high",
                         extra_headers={"X-Team": "kernels"}, extra_body={"top_k": 20})
    server.push(reply("ok"))
    client.chat(MESSAGES)
    sent = server.requests[0]
    assert sent.body["max_tokens"] == 3000 and "temperature" not in sent.body
    assert (sent.body["top_p"], sent.body["reasoning_effort"], sent.body["top_k"]) == (0.9, "high", 20)
    assert sent.headers["x-team"] == "kernels"


def test_reasoning_models_get_a_larger_reply_and_no_temperature(server, make_client):
    client = make_client(model="o3")
    server.push(reply("ok"))
    client.chat(MESSAGES)
    assert server.requests[0].body["max_tokens"] == 32768 and "temperature" not in server.requests[0].body


def test_missing_usage_is_charged_the_worst_case(server, make_client):
    calls = []
    client = make_client(on_call=calls.append)
    server.push(reply("y" * 40, usage=None))
    r = client.chat(MESSAGES)
    assert (r.prompt_tokens, r.completion_tokens) == (CEILING, 8192)
    assert r.cost_usd == pytest.approx(client.config.cost(CEILING, 8192)) and calls[0].estimated


@pytest.mark.parametrize("usage, text", [
    ((-10**9, -10**9), "ok"),  # negative: would drive spend below zero
    ((10**12, 10**12), "ok"),  # absurd
    ((CEILING + 1, 10), "ok"),  # more prompt tokens than bytes sent
    ((100, 8193), "ok"),  # more completion tokens than allowed
    ((100, 50), "z" * (5 << 20)),  # a 5 MB reply "in 50 tokens"
], ids=["negative", "absurd", "prompt-over-bytes", "completion-over-limit", "5MB-in-50-tokens"])
def test_implausible_usage_is_charged_the_worst_case(server, make_client, usage, text):
    calls = []
    client = make_client(on_call=calls.append)
    server.push(reply(text, usage=usage))
    r = client.chat(MESSAGES)
    assert (r.prompt_tokens, r.completion_tokens) == (CEILING, 8192) and calls[0].estimated
    assert r.cost_usd == pytest.approx(client.config.cost(CEILING, 8192))


def test_a_huge_reply_is_cut_before_anything_reads_it(server, make_client):
    client = make_client(max_reply_tokens=1000)
    server.push(reply("z" * (5 << 20), usage=(100, 1000)))
    r = client.chat(MESSAGES)
    assert len(r.text) == 1000 * MAX_CHARS_PER_TOKEN and r.finish_reason == "length"


@pytest.mark.parametrize("bad", ["5MB", "negative", "absurd", "none"])
def test_spend_never_passes_the_run_budget(server, make_client, bad):
    steps = {"5MB": lambda: reply("z" * (5 << 20), usage=(100, 50)),
             "negative": lambda: reply("ok", usage=(-10**6, -10**6)),
             "absurd": lambda: reply("ok", usage=(10**9, 10**9)),
             "none": lambda: reply("ok", usage=None)}
    budget = 0.5
    ledger = Spend(max_cost_usd=budget)
    calls = []
    client = make_client(ledger=ledger, on_call=calls.append)
    server.responder = lambda body: steps[bad]()
    with pytest.raises(BudgetExhausted) as stop:
        for _ in range(1000):
            client.chat(MESSAGES)
    assert stop.value.reason == "cost"
    assert 0 < ledger.cost_usd <= budget and sum(c.cost_usd for c in calls) == pytest.approx(ledger.cost_usd)
    assert budget - ledger.cost_usd < client.config.cost(CEILING, 8192)  # it stopped only when one more could pass


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
    with pytest.raises(ProposerUnavailable, match=r"rejected the request \(HTTP 400: context_length_exceeded\)") as e:
        client.chat(MESSAGES)
    assert not e.value.transient


@pytest.mark.parametrize("model, message, limit", [
    ("qwen", "This model's maximum context length is 8192 tokens. However, you requested 9200 tokens "
             "(1008 in the messages, 8192 in the completion). Please reduce the length of the messages or completion.",
     8192 - 1008 - 16),
    ("qwen", "'max_tokens' or 'max_completion_tokens' is too large: 8192. This model's maximum context length is "
             "8192 tokens and your request has 1008 input tokens (8192 > 8192 - 1008).", 8192 - 1008 - 16),
    ("claude-3-haiku", "max_tokens: 8192 > 4096, which is the maximum allowed number of output tokens for "
                       "claude-3-haiku-20240307", 4096),
    ("gpt-4o", "max_tokens is too large: 8192. This model supports at most 4096 completion tokens, whereas you "
               "provided 8192.", 4096),
], ids=["vllm-context", "vllm-context-new", "anthropic-output", "openai-output"])
def test_a_reply_limit_above_what_the_model_allows_is_lowered_once(server, make_client, model, message, limit):
    calls = []
    client = make_client(model=model, on_call=calls.append)
    server.push(error(400, message), reply("ok"), error(400, message))
    assert client.chat(MESSAGES).text == "ok"
    assert server.requests[1].body["max_tokens"] == limit == client.reply_limit
    assert [c.status for c in calls] == ["retry", "ok"] and f"at most {limit}" in calls[0].error
    with pytest.raises(ProposerUnavailable):  # adapted once: the same error again is not a loop
        client.chat(MESSAGES)


def test_a_prompt_that_fills_the_context_says_so(server, make_client):
    client = make_client(model="qwen")
    server.push(error(400, "This model's maximum context length is 2048 tokens. However, you requested 10000 tokens "
                           "(1808 in the messages, 8192 in the completion)."))
    with pytest.raises(ProposerUnavailable, match="no room for a reply.*longer context"):
        client.chat(MESSAGES)


@pytest.mark.parametrize("body", [
    [{"error": {"code": 400, "message": "Gemini says: invalid argument top_p", "status": "INVALID_ARGUMENT"}}],
    {"error": "Gemini says: invalid argument top_p"},
    {"detail": [{"loc": ["body", "top_p"], "msg": "Gemini says: invalid argument top_p"}]},
    "Gemini says: invalid argument top_p",
], ids=["list", "string", "fastapi", "text"])
def test_the_providers_message_is_kept_whatever_the_body_shape(server, make_client, body):
    client = make_client()
    server.push(error(400, body=body))
    with pytest.raises(ProposerUnavailable, match="HTTP 400: Gemini says: invalid argument top_p"):
        client.chat(MESSAGES)


def test_timeout_then_success_and_timeouts_exhausted(server, make_client):
    calls = []
    client = make_client(on_call=calls.append, timeout_s=0.3, max_retries=1)
    server.push(slow(2.0), reply("late but fine"))
    assert client.chat(MESSAGES).text == "late but fine"
    assert [c.status for c in calls] == ["retry", "ok"] and "timed out after 0.3 s" in calls[0].error
    assert calls[0].estimated and calls[0].cost_usd == pytest.approx(client.config.cost(CEILING, 8192))  # may be billed
    server.push(slow(2.0), slow(2.0))
    with pytest.raises(ProposerUnavailable, match=r"gave no reply after 2 attempts \(last: timed out after 0.3 s\)"
                                                  r".*timeout") as e:
        client.chat(MESSAGES)
    assert e.value.transient and [c.status for c in calls[2:]] == ["retry", "error"]


def test_auth_failure_names_the_variable_and_not_the_key(server, make_client):
    wrong = "sk-wrong-key-9876543210"
    client = make_client(api_key=wrong)
    with pytest.raises(ProposerUnavailable, match=r"refused the API key \(HTTP 401.*check KFORGE_LLM_API_KEY") as e:
        client.chat(MESSAGES)
    assert wrong not in str(e.value) and "***" in str(e.value)  # the server echoed it; we scrubbed it
    assert not e.value.transient and len(server.requests) == 1  # not retried


def test_unknown_model_is_named(server, make_client):
    client = make_client(model="gpt-9")
    with pytest.raises(ProposerUnavailable, match=r"model 'gpt-9' not found at .*KFORGE_LLM_MODEL.*/models"):
        client.chat(MESSAGES)
    assert len(server.requests) == 1


def test_own_budgets_stop_before_the_call_that_could_pass_them(server, make_client):
    worst = LLMConfig(model="gpt-4o").cost(CEILING, 1000)
    client = make_client(max_reply_tokens=1000, max_cost_usd=1.5 * worst)
    server.push(reply("a", usage=(100, 1000)))
    client.chat(MESSAGES)
    with pytest.raises(BudgetExhausted, match=r"\$0.0103 spent.*over the limit") as e:
        client.chat(MESSAGES)
    assert e.value.reason == "cost" and len(server.requests) == 1

    tokens = make_client(model="local", max_reply_tokens=500, max_tokens=CEILING + 999)
    server.push(reply("a", usage=(100, 400)))
    tokens.chat(MESSAGES)
    with pytest.raises(BudgetExhausted, match="500 used.*limit of") as e:
        tokens.chat(MESSAGES)
    assert e.value.reason == "tokens" and len(server.requests) == 2


def test_check_endpoint_fails_fast_and_in_one_line(server, make_client):
    make_client().check_endpoint()  # listed by GET /models: no completion made
    assert [r.path for r in server.requests] == ["/v1/models"]

    start = time.monotonic()
    down = LLMClient(LLMConfig(model="gpt-4o", base_url=closed_port_url(), api_key=KEY))
    with pytest.raises(ProposerUnavailable, match="cannot reach the LLM endpoint .*start the server") as e:
        down.check_endpoint()
    down.close()
    assert time.monotonic() - start < 5 and "\n" not in str(e.value)

    with pytest.raises(ProposerUnavailable, match="refused the API key") as e:
        make_client(api_key="sk-wrong-1234567890").check_endpoint()
    assert "sk-wrong-1234567890" not in str(e.value)

    with pytest.raises(ProposerUnavailable, match=r"model 'gpt-9' not found.*\(it lists: claude-3-haiku, gpt-4o"):
        make_client(model="gpt-9").check_endpoint()


def test_check_endpoint_without_a_model_list_makes_a_one_token_completion(make_client):
    with ScriptedLLMServer(api_key=KEY, models={"local"}, list_models=False) as bare:
        client = LLMClient(LLMConfig(model="local", base_url=bare.base_url, api_key=KEY))
        bare.push(reply("OK", usage=(5, 1)))
        client.check_endpoint()
        client.close()
        assert [r.path for r in bare.requests] == ["/v1/models", "/v1/chat/completions"]
        assert bare.requests[1].body["max_tokens"] == 1


def test_the_key_appears_nowhere(server, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    log = SQLiteStore(tmp_path / "run")
    log.start_run("r1", config=LLMConfig(model="gpt-4o", base_url=server.base_url, api_key=KEY).public())
    proposer = LLMProposer(LLMConfig(model="gpt-4o", base_url=server.base_url, api_key=KEY), sleep=lambda s: None)
    proposer.bind(log, "r1", Spend())
    server.push(error(429, f"rate limited for key {KEY}"), error(500, "boom"), reply(answer("softmax_v1")))
    proposal = proposer.propose(ProposalContext(softmax_card(), H200))
    assert proposal.candidate.plan.kernels[0].name == "softmax_rows_block"
    messages = []
    bad = LLMProposer(LLMConfig(model="gpt-4o", base_url=server.base_url, api_key=KEY + "x"))
    with pytest.raises(ProposerUnavailable) as e:
        bad.propose(ProposalContext(softmax_card(), H200))
    messages += [str(e.value), repr(e.value)]
    bad.close()
    proposer.close()

    rows = logged(log, "SELECT status, error FROM llm_calls ORDER BY id")
    assert [r["status"] for r in rows] == ["retry", "retry", "ok"] and "***" in rows[0]["error"]
    log.close()
    stored = b"".join(p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file())
    assert KEY.encode() not in stored
    assert all(KEY not in r.getMessage() and KEY not in str(r.args) for r in caplog.records)
    assert caplog.records  # the retries were logged, without the key
    assert all(KEY not in m for m in messages)
    assert KEY not in repr(proposer.config) and KEY not in repr(proposal) and KEY not in repr(proposer.client.totals)
