"""The LLM proposer end to end on a GPU: a scripted OpenAI-compatible endpoint replays
realistic replies (real CUDA kernels from tests/data/llm_replies/: one that does not
compile, its repair, one slower than eager, faster ones), and the real capture, search,
compile, validation, timing and tree take them from there."""

from __future__ import annotations

import re

import pytest
import torch

from fakes import logged
from kforge import hardware
from kforge.capturing import capture
from kforge.evaluate import make_evaluator
from kforge.store import SQLiteStore
from kforge.proposers.llm import LLMConfig, LLMProposer, prompts
from kforge.search.mcts import Budget, search_card
from llm_cards import answer
from llm_server import ScriptedLLMServer, Step, reply

pytestmark = pytest.mark.gpu

# Per op: first versions and revisions in the order the model "writes" them, and the fix it
# gives when shown a failed kernel (keyed by the kernel's name).
SCRIPTS = {
    "aten::_softmax.default": {"fresh": ["softmax_v1_broken", "softmax_v2_slow", "softmax_v3_warp"],
                               "repair": {"softmax_rows_block": "softmax_v1"}},
    "aten::native_group_norm.default": {"fresh": ["group_norm_v1_block", "group_norm_v2_split"], "repair": {}},
}


class ScriptedModel:
    """Answers by what the prompt asks: the next fresh kernel for the op, or the fix of the
    failed kernel it shows."""

    def __init__(self):
        self.fresh = {op: list(s["fresh"]) for op, s in SCRIPTS.items()}
        self.asked: list[tuple[str, str]] = []

    def __call__(self, body: dict) -> Step:
        text = body["messages"][-1]["content"]
        op = re.search(r"^Operator: (\S+)$", text, re.M).group(1)
        if text.startswith(prompts.REPAIR_HEADING):
            name = next(n for k, n in SCRIPTS[op]["repair"].items() if f'"name": "{k}"' in text)
            self.asked.append(("repair", name))
            return reply(answer(name))
        name = self.fresh[op].pop(0)
        self.asked.append(("propose", name))
        return reply(answer(name))


@pytest.fixture
def endpoint():
    model = ScriptedModel()
    with ScriptedLLMServer(api_key="k", models={"scripted-coder"}, responder=model) as server:
        yield server, model


def _by_kernel(rows) -> dict:
    """Stored candidates keyed by their first kernel's name, ":broken" appended for compile errors."""
    out = {}
    for r in rows:
        name = r.plan["kernels"][0]["name"]
        out[name + (":broken" if r.verdict == "compile_error" else "")] = r
    return out


def _search(tmp_path, module, x, op, server, iterations):
    cards = capture(module, x, tmp_path / "run").cards
    card = next(c for c in cards if c.op == op)
    log = SQLiteStore(tmp_path / "run")
    log.start_run("r", model=op)
    proposer = LLMProposer(LLMConfig(model="scripted-coder", base_url=server.base_url, api_key="k"))
    try:
        with make_evaluator(tmp_path / "run", timeout_s=10.0) as evaluator:
            outcome = search_card(card, proposer, evaluator, log, "r", budget=Budget(iterations=iterations),
                                  hardware=hardware.current())
        return outcome, _by_kernel(log.candidates("r", card.id)), log
    finally:
        proposer.close()


def test_softmax_search_repairs_a_compile_error_and_keeps_the_fastest(tmp_path, endpoint):
    server, model = endpoint
    x = torch.randn(4096, 1024, device="cuda")
    outcome, by_kernel, log = _search(tmp_path, torch.nn.Softmax(dim=-1), x, "aten::_softmax.default", server, 3)

    assert model.asked == [("propose", "softmax_v1_broken"), ("repair", "softmax_v1"),
                           ("propose", "softmax_v2_slow"), ("propose", "softmax_v3_warp")]
    broken, fixed = by_kernel["softmax_rows_block:broken"], by_kernel["softmax_rows_block"]
    assert 'identifier "lane" is undefined' in broken.compile_log
    assert fixed.repair_of == broken.id and fixed.verdict in ("slower", "valid")
    slow, fast = by_kernel["softmax_thread_per_row"], by_kernel["softmax_warp_row"]
    assert slow.verdict == "slower" and slow.kernel_us > 5 * fast.kernel_us
    assert fast.verdict == "valid" and fast.kernel_us < fixed.kernel_us
    assert outcome.best is not None and outcome.best.id == fast.id and outcome.best_speedup > 1.0
    calls = logged(log, "SELECT status, prompt_tokens FROM llm_calls")  # every attempt, as the server counted it
    assert [(c["status"], c["prompt_tokens"]) for c in calls] == [("ok", 100)] * len(server.requests)
    log.close()


def test_group_norm_search_finds_the_split_kernel(tmp_path, endpoint):
    server, model = endpoint
    gn = torch.nn.GroupNorm(32, 128).to("cuda", torch.bfloat16)
    with torch.no_grad():
        gn.weight.normal_()
        gn.bias.normal_()
    x = torch.randn(1, 128, 64, 64, device="cuda", dtype=torch.bfloat16)
    outcome, by_kernel, log = _search(tmp_path, gn, x, "aten::native_group_norm.default", server, 2)

    assert [name for _, name in model.asked] == ["group_norm_v1_block", "group_norm_v2_split"]
    one_block, split = by_kernel["group_norm_block"], by_kernel["group_norm_partial"]
    assert one_block.verdict in ("slower", "valid") and split.verdict == "valid"
    assert split.kernel_us < one_block.kernel_us
    assert outcome.best is not None and outcome.best.id == split.id and outcome.best_speedup > 1.2
    log.close()
