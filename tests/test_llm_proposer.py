"""LLMProposer end to end on the CPU: a scripted model over real sockets, real NVRTC
compiles, and a fake clock for timing."""

from __future__ import annotations

import pytest

from fakes import logged
from kforge import compiler
from kforge.errors import CompileError, ProposerError, ProposerUnavailable
from kforge.hardware import H200
from kforge.proposers import get_proposer
from kforge.proposers.base import ProposalContext, Tried
from kforge.proposers.llm import LLMConfig, LLMProposer, prompts
from kforge.proposers.llm.parse import parse_reply
from kforge.proposers.llm.proposer import EXCERPT_CHARS
from kforge.verdict import EvalResult, Verdict
from llm_cards import answer, plan, softmax_card, source
from llm_server import ScriptedLLMServer, error, reply

# What the fake evaluator "measures" for each kernel (us); eager takes 14 us.
KERNEL_US = {"softmax_rows_block": 21.0, "softmax_thread_per_row": 360.0, "softmax_warp_row": 11.6}
EAGER_US = 14.0


class CompileAndClock:
    """Compiles with NVRTC for real; correctness is assumed and time comes from KERNEL_US."""

    def evaluate(self, card, candidate) -> EvalResult:
        try:
            compiler.compile(candidate.source, "kernel.cu", candidate.plan.options, arch="sm_90")
        except CompileError as e:
            return EvalResult(Verdict.COMPILE_ERROR, "NVRTC rejected the kernel", compile_log=e.log)
        us = KERNEL_US[candidate.plan.kernels[0].name]
        return EvalResult(Verdict.VALID if us < EAGER_US else Verdict.SLOWER, eager_us=EAGER_US, kernel_us=us)


@pytest.fixture
def server():
    with ScriptedLLMServer(api_key="k", models={"coder"}) as s:
        yield s


@pytest.fixture
def proposer(server):
    p = LLMProposer(LLMConfig(model="coder", base_url=server.base_url, api_key="k", max_repair_attempts=2,
                              prices={"coder": (1.0, 2.0)}))
    yield p
    p.close()


def test_compile_failure_repaired_then_revised_faster(server, proposer):
    card, evaluator = softmax_card(), CompileAndClock()
    server.push(reply(answer("softmax_v1_broken"), usage=(3000, 900)), reply(answer("softmax_v1"), usage=(3500, 900)),
                reply(answer("softmax_v3_warp"), usage=(5000, 800)))
    ctx = ProposalContext(card, H200)

    first = proposer.propose(ctx)
    broken = Tried(first.candidate, evaluator.evaluate(card, first.candidate), id=1)
    assert broken.result.verdict is Verdict.COMPILE_ERROR and 'identifier "lane" is undefined' in broken.result.compile_log
    assert proposer.client.totals.cost_usd == pytest.approx(0.0048)

    fixed = proposer.repair(ctx, broken)
    repaired = Tried(fixed.candidate, evaluator.evaluate(card, fixed.candidate), id=2)
    assert repaired.result.verdict is Verdict.SLOWER and fixed.candidate.note.startswith("repair of #1")
    repair_prompt = server.requests[1].last_user
    assert repair_prompt.startswith(prompts.REPAIR_HEADING)
    assert 'identifier "lane" is undefined' in repair_prompt and "14 |     if (lane == 0)" in repair_prompt

    revision = proposer.propose(ProposalContext(card, H200, parent=repaired, best=None,
                                                tried_digests={broken.candidate.digest(), repaired.candidate.digest()}))
    faster = evaluator.evaluate(card, revision.candidate)
    assert faster.verdict is Verdict.VALID and faster.kernel_us < repaired.result.kernel_us
    revise_prompt = server.requests[2].last_user
    assert revise_prompt.startswith(prompts.REVISE_HEADING) and "21.00 us, eager 14.00 us" in revise_prompt
    assert proposer.client.totals.calls == 3 and proposer.client.totals.prompt_tokens == 11500
    assert revision.candidate.knobs == {"model": "coder", "asks": 1} and revision.candidate.proposer == "llm:coder"


@pytest.mark.parametrize("bad, problem", [
    ("I'd use one warp per row; shall I write it?", "found no ```cuda block"),
    (answer("softmax_v3_warp").replace('"grid": [512, 1, 1]', '"grid": [512, 1, 1],,'), "not valid JSON"),
    (answer("softmax_v3_warp").replace('"name": "softmax_warp_row"', '"name": "softmax_warp"'),
     'launches "softmax_warp" but the source defines no'),
    (answer("softmax_v3_warp").replace('{"i32": 4096}', '{"i32": 4096}, {"i32": 1024}'),
     "takes 3 parameters but the plan passes 4"),
])
def test_malformed_replies_are_fed_back_and_recovered(server, proposer, bad, problem):
    server.push(reply(bad), reply(answer("softmax_v3_warp")))
    proposal = proposer.propose(ProposalContext(softmax_card(), H200))
    assert proposal.candidate.plan.kernels[0].name == "softmax_warp_row"
    assert proposer.client.totals.prompt_tokens == 200 and proposal.candidate.knobs["asks"] == 2
    second = server.requests[1].messages
    assert second[-2] == {"role": "assistant", "content": bad}
    assert second[-1]["content"].startswith(prompts.RETRY_HEADING) and problem in second[-1]["content"]


def test_duplicates_and_truncation_are_explained_and_asks_are_bounded(server, proposer):
    seen = parse_reply(answer("softmax_v1"), softmax_card(), "llm:coder")
    server.push(reply(answer("softmax_v1")), reply("```cuda\nextern", finish_reason="length"), reply("no idea"))
    with pytest.raises(ProposerError, match=r"no usable answer in 3 asks.*the last problem: found no ```cuda block"):
        proposer.propose(ProposalContext(softmax_card(), H200, tried_digests={seen.digest()}))
    feedback = [r.last_user for r in server.requests[1:]]
    assert "identical to a kernel already evaluated" in feedback[0]
    assert "cut off at 8192 tokens" in feedback[1]


def test_a_conversation_without_a_candidate_is_still_accounted_and_a_refusal_stops_it(server, proposer, tmp_path):
    from kforge.store import SQLiteStore
    from kforge.spend import Spend

    log = SQLiteStore(tmp_path)
    log.start_run("r")
    spend = Spend()
    proposer.bind(log, "r", spend)
    server.push(reply("no idea"), reply("still none"), reply("nothing"))
    with pytest.raises(ProposerError, match="no usable answer in 3 asks"):
        proposer.propose(ProposalContext(softmax_card(), H200))
    assert (spend.tokens, spend.cost_usd) == (450, pytest.approx(0.0006))  # $1 / $2 per million tokens
    assert log.llm_spend("r") == (450, pytest.approx(0.0006))

    server.push(reply("no idea"), error(401, "bad key"))  # the endpoint gives up after a paid ask
    with pytest.raises(ProposerUnavailable, match="refused the API key"):
        proposer.propose(ProposalContext(softmax_card(), H200))
    assert [r["status"] for r in logged(log, "SELECT status FROM llm_calls ORDER BY id")] == ["ok"] * 4 + ["error"]
    log.close()


def test_an_unusable_reply_goes_back_as_an_excerpt_never_whole(server, proposer):
    huge = "I will think aloud. " * 5000 + answer("softmax_v3_warp").replace('"name": "softmax_warp_row"', '"name": "nope"')
    server.push(reply(huge, usage=(100, 8000)), reply(answer("softmax_v3_warp")))
    proposer.propose(ProposalContext(softmax_card(), H200))
    sent_back = server.requests[1].messages[-2]["content"]
    assert len(huge) > 8 * EXCERPT_CHARS and len(sent_back) < EXCERPT_CHARS + 100
    assert "characters of the reply left out" in sent_back and sent_back.endswith(huge[-100:])


def test_get_proposer_builds_it_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("KFORGE_LLM_BASE_URL", server.base_url)
    monkeypatch.setenv("KFORGE_LLM_API_KEY", "k")
    p = get_proposer("llm:coder")
    try:
        assert p.name == "llm:coder" and p.supports(softmax_card()) == (True, "")
        server.push(reply(answer("softmax_v3_warp")))
        assert p.propose(ProposalContext(softmax_card(), H200)).candidate.source == source("softmax_v3_warp")
        assert plan("softmax_v3_warp")["kernels"][0]["grid"] == [512, 1, 1]
    finally:
        p.close()


def test_a_reply_that_is_all_reasoning_is_asked_for_the_code_not_brevity(server, proposer):
    server.push(reply("", finish_reason="length", reasoning="Let me consider the row length... " * 50),
                reply("<think>\nrows of 1024, so one warp per row, and", finish_reason="length"),
                reply("<think>short</think>\n" + answer("softmax_v3_warp")))
    proposal = proposer.propose(ProposalContext(softmax_card(), H200))
    assert proposal.candidate.plan.kernels[0].name == "softmax_warp_row" and proposal.candidate.knobs["asks"] == 3
    assert [m["content"] for m in server.requests[2].messages if m["role"] == "assistant"] == [
        "(no answer)"] * 2  # the thoughts are not sent back, nor an empty turn
    for r in server.requests[1:]:
        assert "the reasoning used the whole reply budget" in r.last_user
        assert "write the ```cuda and ```json blocks directly" in r.last_user and "briefly" not in r.last_user


def test_every_ask_is_a_row_in_llm_calls_with_its_cost(server, proposer, tmp_path):
    from kforge.store import SQLiteStore
    from kforge.spend import Spend

    log = SQLiteStore(tmp_path)
    log.start_run("r1")
    spend = Spend()
    proposer.bind(log, "r1", spend)
    bad = [answer("softmax_v3_warp").replace('"workspace": []', f'"workspace": [{w}]') for w in ('"64 bytes"', "null")]
    server.push(*(reply(b, usage=(1000, 500)) for b in bad), reply(answer("softmax_v3_warp"), usage=(1000, 500)))
    proposal = proposer.propose(ProposalContext(softmax_card(), H200))
    assert proposal.candidate.knobs["asks"] == 3
    assert "workspace entry \"64 bytes\" must be a byte count" in server.requests[1].last_user
    rows = logged(log, "SELECT status, prompt_tokens, completion_tokens, cost_usd FROM llm_calls WHERE run_id='r1'")
    assert [tuple(r) for r in rows] == [("ok", 1000, 500, pytest.approx(0.002))] * 3
    assert log.llm_spend("r1") == (4500, pytest.approx(spend.cost_usd)) and spend.cost_usd == pytest.approx(0.006)
    log.close()
