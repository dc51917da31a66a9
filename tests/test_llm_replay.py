"""Replayed reply styles of real models through the real path: LLMProposer -> openai client ->
local HTTP server -> parse -> NVRTC (sm_90). Each style wraps the same correct kernel; it must
end compiled on the first ask or after one feedback turn (a parse problem sent back, or a
compile error sent back through repair), and every ask must be a row in llm_calls."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from fakes import logged
from kforge import compiler
from kforge.candidate import Candidate
from kforge.errors import CompileError, ProposerError
from kforge.hardware import H200
from kforge.store import SQLiteStore
from kforge.proposers.base import ProposalContext, Tried
from kforge.proposers.llm import LLMConfig, LLMProposer
from kforge.spend import Spend
from kforge.verdict import EvalResult, Verdict
from llm_cards import softmax_card
from llm_reply_styles import STYLES, Style
from llm_server import ScriptedLLMServer, Step, reply

MODEL = "replay"
PRICE = (1.0, 2.0)  # $ per million prompt / completion tokens, so every row has a cost
THRESHOLD = 0.9


@dataclass
class Outcome:
    style: Style
    compiled: bool
    asks: int
    problem: str = ""
    candidate: Candidate | None = None  # the one that compiled


def _compile(candidate) -> None:
    """The compile step candidates go through (kforge's compile path, NVRTC for sm_90)."""
    compiler.compile(candidate.source, "kernel.cu", candidate.plan.options, arch="sm_90")


def _drive(proposer: LLMProposer, server: ScriptedLLMServer, steps: list[Step], style: Style) -> Outcome:
    """One style: propose; if the kernel does not compile and the model has a corrected answer,
    one repair. At most two asks in all."""
    steps[:] = style.replies
    before = len(server.requests)
    ctx = ProposalContext(softmax_card(), H200)
    try:
        candidate = proposer.propose(ctx).candidate
        try:
            _compile(candidate)
        except CompileError as e:
            asks = len(server.requests) - before
            if asks >= 2 or asks >= style.turns:  # no turn left, or the model has nothing more to say
                return Outcome(style, False, asks, f"compile error: {str(e).splitlines()[0]}")
            failed = Tried(candidate, EvalResult(Verdict.COMPILE_ERROR, "NVRTC rejected it", compile_log=e.log), id=1)
            candidate = proposer.repair(ctx, failed).candidate
            _compile(candidate)
    except (ProposerError, CompileError) as e:  # a failure with a message, not a crash
        return Outcome(style, False, len(server.requests) - before, str(e).splitlines()[0])
    return Outcome(style, True, len(server.requests) - before, candidate=candidate)


def replay_all(run_dir: Path) -> tuple[list[Outcome], int, list]:
    """Every style once, through one proposer recording into one search log: the outcomes,
    the requests the server saw, and the llm_calls rows."""
    log = SQLiteStore(run_dir)
    log.start_run("replay")
    steps: list = []

    def model(body: dict) -> Step:  # past its script, the model has nothing better to offer
        return steps.pop(0) if steps else reply("Sorry, I cannot improve on my previous answer.")

    with ScriptedLLMServer(api_key="k", models={MODEL}, responder=model) as server:
        proposer = LLMProposer(LLMConfig(model=MODEL, base_url=server.base_url, api_key="k", max_repair_attempts=1,
                                         prices={MODEL: PRICE}))
        proposer.bind(log, "replay", Spend())
        try:
            outcomes = [_drive(proposer, server, steps, s) for s in STYLES]
            requests = len(server.requests)
        finally:
            proposer.close()
    rows = logged(log, "SELECT status, cost_usd FROM llm_calls WHERE run_id='replay'")
    log.close()
    return outcomes, requests, rows


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    return replay_all(tmp_path_factory.mktemp("replay"))


def table(outcomes: list[Outcome]) -> str:
    return "\n".join(f"{'ok ' if o.compiled else 'NO '} {o.asks} ask(s)  {o.style.model:<34} {o.style.name}"
                     f"{'  -- ' + o.problem if o.problem else ''}" for o in outcomes)


def test_there_are_enough_distinct_styles():
    assert len(STYLES) >= 40
    assert len({s.name for s in STYLES}) == len(STYLES)
    assert len({s.model for s in STYLES}) >= 20


def test_replies_compile_on_the_first_ask_or_after_one_turn(replay):
    outcomes, _, _ = replay
    compiled = [o for o in outcomes if o.compiled]
    assert len(compiled) >= THRESHOLD * len(outcomes), table(outcomes)
    assert all(o.asks <= 2 for o in outcomes), table(outcomes)
    # A style that needs no second turn must not take one.
    assert all(o.asks == 1 for o in compiled if o.style.turns == 1), table(outcomes)


def test_reasoning_models_yield_candidates(replay):
    outcomes, _, _ = replay
    by_name = {o.style.name: o for o in outcomes}
    for name in ("deepseek-r1 think with drafts", "deepseek-r1 template-opened think",
                 "deepseek-r1 reasoning_content field", "qwen3 think then answer"):
        assert by_name[name].compiled and by_name[name].asks == 1, table(outcomes)
    for name in ("o3 hidden reasoning used the budget", "deepseek-r1 reasoning used the budget"):
        assert by_name[name].compiled and by_name[name].asks == 2, table(outcomes)


def test_every_ask_is_a_row_in_llm_calls_with_its_cost(replay):
    outcomes, requests, rows = replay
    assert len(rows) == requests == sum(o.asks for o in outcomes)
    assert all(r["status"] == "ok" and r["cost_usd"] > 0 for r in rows)


def test_what_the_compile_prelude_provides_compiles_on_the_first_ask(replay):
    outcomes, _, _ = replay
    prelude = [o for o in outcomes if o.style.needs_prelude]
    assert prelude and all(o.compiled and o.asks == 1 for o in prelude), table(outcomes)


def test_a_reasoning_model_drives_kforge_run_to_compiled_candidates(tmp_path):
    """`kforge.run` with an R1-style model (drafts inside <think>) on a CPU capture: its kernels
    are compiled (untimed here), and every ask is a row in llm_calls."""
    import sqlite3

    import torch

    import kforge
    from llm_cards import source
    from llm_reply_styles import THINK_DRAFTS

    def think_then_answer(body: dict) -> Step:
        think_then_answer.n += 1
        block = 32 << (think_then_answer.n % 4)  # a new launch each time, so no answer repeats an earlier one
        plan = {"kernels": [{"name": "softmax_rows_block", "grid": [8, 1, 1], "block": [block, 1, 1],
                             "args": [{"in": 0}, {"out": 0}, {"i32": 64}]}]}
        return reply(f"{THINK_DRAFTS}```cuda\n{source('softmax_v1')}```\n```json\n{json.dumps(plan)}\n```\n"
                     "kind: custom")

    think_then_answer.n = -1
    with ScriptedLLMServer(api_key="k", models={MODEL}, responder=think_then_answer) as server:
        result = kforge.run(torch.nn.Softmax(dim=-1), (torch.randn(8, 64),), proposer="llm", iterations=3,
                            run_dir=tmp_path / "run", progress=False, ops=["softmax"],
                            proposer_options={"model": MODEL, "base_url": server.base_url, "api_key": "k",
                                              "prices": {MODEL: PRICE}})
        asks = sum(r.path.endswith("/chat/completions") for r in server.requests)  # not the endpoint check
    conn = sqlite3.connect(Path(result.run_dir) / "search.sqlite")
    verdicts = [v for (v,) in conn.execute("SELECT verdict FROM candidates")]
    calls = conn.execute("SELECT COUNT(*), MIN(cost_usd) FROM llm_calls").fetchone()
    conn.close()
    assert verdicts and set(verdicts) == {"untimed"}, verdicts
    assert calls[0] == asks and calls[1] > 0
