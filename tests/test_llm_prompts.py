"""Prompts are pure functions of the card, the hardware and the search's feedback."""

from __future__ import annotations

from kforge.candidate import Candidate, LaunchPlan
from kforge.hardware import H200
from kforge.proposers.base import ProposalContext, Tried
from kforge.proposers.llm import prompts
from kforge.verdict import EvalResult, Verdict
from llm_cards import group_norm_card, inplace_relu_card, plan, softmax_card, source


def tried(name: str, verdict: Verdict = Verdict.VALID, kernel_us: float | None = 10.0, **kw) -> Tried:
    cand = Candidate(source(name), LaunchPlan.from_json(plan(name)), proposer="llm:m")
    return Tried(cand, EvalResult(verdict, kernel_us=kernel_us, eager_us=12.0 if kernel_us else None, **kw))


def user_text(messages) -> str:
    assert [m["role"] for m in messages] == ["system", "user"]
    return messages[1]["content"]


def test_first_prompt_states_everything_the_kernel_depends_on():
    card = softmax_card()
    text = user_text(prompts.proposal_messages(ProposalContext(card, H200)))
    assert text.startswith(prompts.PROPOSE_HEADING)
    for fact in ["aten::_softmax.default", "_softmax(Tensor self, int dim, bool half_to_float) -> Tensor",
                 "in0 (self): shape [4096, 1024], stride [1024, 1] (elements), float32, contiguous, 16-byte aligned",
                 "out0: shape [4096, 1024]", "dim = -1, half_to_float = False",
                 "out0 = torch.ops.aten._softmax.default(in0, -1, False)",
                 "NVIDIA H200 (sm_90), 132 SMs, L2 60 MiB, up to 227 KiB", "4.27 TB/s",
                 f"no kernel beats {H200.floor_us(card.io_bytes()):.2f} us", "eager takes 12.00 us",
                 "kind: custom"]:
        assert fact in text, fact
    system = prompts.proposal_messages(ProposalContext(card, H200))[0]["content"]
    for rule in ['extern "C" __global__', '{"in": i}', '{"ws": k}', '{"i64": v} long long', "Do not call cuBLAS",
                 "```json", "Write every element of every output"]:
        assert rule in system, rule


def test_multi_output_and_in_place_cards():
    gn = prompts.describe_card(group_norm_card(), H200)
    assert "out0, out1, out2 = torch.ops.aten.native_group_norm.default(in0, in1, in2, 1, 128, 4096, 32, 1e-05)" in gn
    assert "in1 (weight): shape [128]" in gn and "out2: shape [1, 32], stride [32, 1] (elements), bfloat16" in gn
    relu = prompts.describe_card(inplace_relu_card(), H200, {"atol": 1e-3, "rtol": 1e-3, "how": "derived"})
    assert "WRITTEN by the op (in-place)" in relu and "the same memory as in0 (in-place)" in relu
    assert "Tolerance: atol = 0.001, rtol = 0.001, how = derived" in relu


def test_revision_shows_parent_timing_lineage_and_sibling_failures():
    card = softmax_card()
    root = tried("softmax_v1", Verdict.SLOWER, kernel_us=21.0)
    parent = tried("softmax_v3_warp", kernel_us=11.6)
    broken = tried("softmax_v1_broken", Verdict.COMPILE_ERROR, kernel_us=None,
                   compile_log='softmax.cu(14): error: identifier "lane" is undefined\n      if (lane == 0)\n          ^\n')
    ctx = ProposalContext(card, H200, parent=parent, lineage=[root], best=parent, sibling_failures=[broken])
    text = user_text(prompts.proposal_messages(ctx))
    assert text.startswith(prompts.REVISE_HEADING)
    floor = H200.floor_us(card.io_bytes())
    assert (f"Current kernel, to improve: 11.60 us, eager 12.00 us (speedup 1.03x), HBM floor {floor:.2f} us "
            f"({100 * floor / 11.6:.0f}% of the floor's speed)") in text
    assert source("softmax_v3_warp").strip() in text
    assert "ancestor -1: 21.00 us" in text and source("softmax_v1").strip() in text
    assert 'do not repeat' in text and 'identifier "lane" is undefined' in text


def test_long_lineages_are_trimmed_to_the_budget():
    card = softmax_card()
    lineage = [tried("softmax_v3_warp", kernel_us=40.0 - i) for i in range(30)]
    failures = [tried("softmax_v1", Verdict.RUNTIME_ERROR, kernel_us=None, message="x" * 5000) for _ in range(20)]
    ctx = ProposalContext(card, H200, parent=lineage[-1], lineage=lineage[:-1], sibling_failures=failures)
    text = user_text(prompts.proposal_messages(ctx))
    assert "(source omitted)" in text and "ancestor -29" in text
    assert len(text) < prompts.LINEAGE_CHARS + 3 * len(source("softmax_v3_warp")) + 12_000
    assert text.count("runtime_error") == prompts.MAX_FAILURES


def test_repair_prompt_points_at_the_failing_lines():
    card = softmax_card()
    log = ("kernel.cu(14): error: identifier \"lane\" is undefined\n      if (lane == 0) red[warp] = m;\n          ^\n\n"
           + "".join(f"kernel.cu({20 + i}): error: identifier \"warp\" is undefined\n  x\n  ^\n\n" for i in range(8))
           + "9 errors detected in the compilation of \"kernel.cu\".\n")
    failed = tried("softmax_v1_broken", Verdict.COMPILE_ERROR, kernel_us=None, compile_log=log)
    text = user_text(prompts.repair_messages(ProposalContext(card, H200), failed))
    assert text.startswith(prompts.REPAIR_HEADING)
    assert 'identifier "lane" is undefined' in text and "14 |     if (lane == 0) red[warp] = m;" in text
    assert "[... 4 more errors]" in text


def test_repair_prompt_for_wrong_numbers_carries_the_evidence():
    failed = tried("softmax_v1", Verdict.INCORRECT, kernel_us=None, message="out0 differs at 3 elements",
                   max_abs_err=0.25, max_rel_err=0.5, evidence={"worst": {"index": [17, 3], "got": 0.5, "expected": 0.25}})
    text = prompts.failure_feedback(failed)
    assert "incorrect: out0 differs at 3 elements" in text and "max abs error 0.25" in text
    assert '"index": [17, 3]' in text


def test_retry_continues_the_conversation():
    first = prompts.proposal_messages(ProposalContext(softmax_card(), H200))
    again = prompts.retry_messages(first, "no code, sorry", "expected exactly one ```cuda block")
    assert again[:2] == first and again[2] == {"role": "assistant", "content": "no code, sorry"}
    assert again[3]["content"].startswith(f"{prompts.RETRY_HEADING} expected exactly one ```cuda block")
