"""Prompts are pure functions of the card, the hardware and the search's feedback."""

from __future__ import annotations

import pytest
import torch

from kforge.candidate import Candidate, LaunchPlan
from kforge.callspec import arg_specs
from kforge.cards import Card, TensorMeta, flatten_outputs, qualified_name
from kforge.hardware import H200
from kforge.proposers.base import ProposalContext, Tried
from kforge.proposers.llm import prompts
from kforge.proposers.llm.references import decomposed
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
    assert "(expected = PyTorch's output); atol = 0.001, rtol = 0.001, how = derived" in relu


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



# ---- what every prompt says ---------------------------------------------------------------

def test_the_compile_environment_and_plan_features_are_spelled_out():
    system = prompts.SYSTEM
    flat = " ".join(system.split())
    for fact in ["only <cuda_bf16.h>, <cuda_fp16.h> and <cuda_fp8.h>.", "INFINITY, NAN, FLT_MAX, FLT_MIN",
                 "int8_t, uint8_t, int16_t, uint16_t, int32_t, uint32_t, int64_t, uint64_t.", "no <<<...>>> launches",
                 "kforge launches the kernels itself from the launch plan", "is `long long`",
                 "(no <cooperative_groups.h>, no files of your own)", "-O flags are dropped",
                 'inside an `extern "C" { }`',
                 '"cluster": n', "barrier.cluster.arrive", "ld.shared::cluster", '"pdl": true',
                 "griddepcontrol.wait", "griddepcontrol.launch_dependents"]:
        assert fact in flat, fact
    # Exactly what the compile box gives: a kernel using every predefined name compiles.
    from kforge import compiler

    uses = "INFINITY + NAN + FLT_MAX + FLT_MIN + (int64_t)1 + (uint8_t)1 + (int16_t)1 + (uint32_t)1"
    compiler.compile(f'#include <cmath>\nextern "C" __global__ void k(float* y) {{ y[0] = {uses}; }}', "k.cu",
                     ["-O3"], arch="sm_90")


def test_a_first_proposal_states_the_tolerance_rule():
    text = user_text(prompts.proposal_messages(ProposalContext(softmax_card(), H200)))
    assert ("Tolerance: |got - expected| <= atol + rtol * |expected| per element (expected = PyTorch's output); "
            "out0 (float32): rtol 1e-05, atol 4x PyTorch's own error against float64, between 1e-05 and 0.001 "
            "times the RMS of the expected values.") in text
    gn = prompts.describe_card(group_norm_card(), H200)
    assert "out0, out1, out2 (bfloat16): rtol 0.00781" in gn
    measured = tried("softmax_v1", Verdict.INCORRECT, kernel_us=None, evidence={"tolerance": {"atol": 2e-6, "rtol": 1e-5}})
    ctx = ProposalContext(softmax_card(), H200, sibling_failures=[measured])
    assert "atol = 2e-06, rtol = 1e-05" in user_text(prompts.proposal_messages(ctx))


def test_eager_time_only_from_the_gpu_the_kernel_runs_on():
    from dataclasses import replace

    gpu = softmax_card(eager_us=12.0)
    assert "eager takes 12.00 us per call on this GPU" in prompts.describe_card(gpu, H200, eager_us=12.0)
    cpu = replace(softmax_card(eager_us=950.0), device_name="cpu", arch="cpu", id="").retarget("cuda", "sm_90")
    first = user_text(prompts.proposal_messages(ProposalContext(cpu, H200)))
    assert "eager takes" not in first and "950" not in first
    other_gpu = replace(gpu, device_name="NVIDIA A100-SXM4-80GB")
    assert "eager takes" not in user_text(prompts.proposal_messages(ProposalContext(other_gpu, H200)))
    parent = tried("softmax_v3_warp", kernel_us=11.6)  # its eager time was measured on this GPU: 12.0
    assert "eager takes 12.00 us" in user_text(prompts.proposal_messages(ProposalContext(cpu, H200, parent=parent)))


def test_siblings_carry_their_notes_and_compile_only_results_are_not_failures():
    broken = tried("softmax_v1_broken", Verdict.RUNTIME_ERROR, kernel_us=None, message="illegal address")
    broken.candidate.note = "Two rows per warp with float4 loads."
    compiled = tried("softmax_v1", Verdict.UNTIMED, kernel_us=None)
    compiled.candidate.note = "One block per row, three passes."
    text = user_text(prompts.proposal_messages(ProposalContext(softmax_card(), H200,
                                                               sibling_failures=[broken, compiled])))
    failed, _, rest = text.partition("Earlier attempts that failed (do not repeat):")
    assert "approach: Two rows per warp with float4 loads.\n  runtime_error: illegal address" in rest
    assert "Earlier attempts that compiled but could not be checked here" in rest
    assert "approach: One block per row, three passes.\n  compiled; not run or timed" in rest
    assert "untimed" not in text
    failures_part = rest.split("Earlier attempts that compiled")[0]
    assert "One block per row" not in failures_part
    parent = tried("softmax_v1", Verdict.SLOWER, kernel_us=21.0)
    revision = user_text(prompts.proposal_messages(ProposalContext(softmax_card(), H200, parent=parent,
                                                                   sibling_failures=[compiled])))
    assert "Revisions of the current kernel that failed" not in revision
    assert "compiled but could not be checked here" in revision


# ---- decomposed references ------------------------------------------------------------------

def _card(op, *args, **kwargs) -> tuple[Card, list[torch.Tensor]]:
    """A card for one real call on the CPU, with its inputs."""
    specs, tensors = arg_specs(op, args, kwargs)
    outs = flatten_outputs(op(*args, **kwargs))
    return Card(op=qualified_name(op), schema=str(op._schema), args=specs,
                outputs=[TensorMeta.of(t) for t in outs], arch="cpu"), tensors


aten = torch.ops.aten
g = torch.Generator().manual_seed(0)
x3 = torch.randn(4, 8, 64, generator=g)
w64, b64 = torch.randn(64, generator=g), torch.randn(64, generator=g)
img = torch.randn(2, 16, 8, 8, generator=g).bfloat16()
w16, b16 = torch.randn(16, generator=g).bfloat16(), torch.randn(16, generator=g).bfloat16()
masked = x3.masked_fill(torch.rand(4, 8, 64, generator=g) < 0.3, float("-inf"))
masked[0, 0] = float("-inf")

CALLS = [
    (aten.native_layer_norm.default, (x3, [64], w64, b64, 1e-5), {}),
    (aten.native_layer_norm.default, (x3.bfloat16(), [8, 64], None, None, 1e-6), {}),
    (aten.native_group_norm.default, (img, w16, b16, 2, 16, 64, 4, 1e-5), {}),
    (aten._fused_rms_norm.default, (x3, [64], w64, 1e-6), {}),
    (aten._fused_rms_norm.default, (x3.bfloat16(), [64], None, None), {}),
    (aten._softmax.default, (x3, -1, False), {}),
    (aten._log_softmax.default, (x3.double(), 1, False), {}),
    (aten.softmax.int, (x3.bfloat16(), -1, torch.float32), {}),
    (aten.log_softmax.int, (x3, -1, torch.bfloat16), {}),
    (aten._safe_softmax.default, (masked, -1), {}),
    (aten.var_mean.correction, (x3, [2]), {"correction": 0, "keepdim": True}),
    (aten.std_mean.correction, (x3.bfloat16(), None), {}),
]


@pytest.mark.parametrize("op, args, kwargs", CALLS, ids=lambda v: getattr(v, "__name__", None))
def test_decomposed_references_compute_what_the_op_computes(op, args, kwargs):
    card, inputs = _card(op, *args, **kwargs)
    lines = decomposed(card)
    assert lines and prompts.describe_card(card, H200).count("which computes, step by step:") == 1
    scope = {"torch": torch, **{f"in{i}": t for i, t in enumerate(inputs)}}
    exec("\n".join(lines), scope)  # noqa: S102 - our own generated code, on the test's tensors
    for j, want in enumerate(flatten_outputs(op(*args, **kwargs))):
        got = scope[f"out{j}"]
        assert got.dtype == want.dtype and got.shape == want.shape, (j, got.dtype, got.shape)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, equal_nan=True)


def test_layer_norm_outputs_are_named():
    card, _ = _card(aten.native_layer_norm.default, x3, [64], w64, b64, 1e-5)
    text = prompts.describe_card(card, H200)
    assert "out0, out1, out2 = torch.ops.aten.native_layer_norm.default(in0, [64], in1, in2, 1e-05)" in text
    assert "out0 = normalized input, out1 = mean, out2 = rstd = 1/sqrt(biased var + eps)" in text
    values, _ = _card(aten.max.dim, x3, 1)
    assert decomposed(values) == ["# out0 = values, out1 = indices"]
    assert decomposed(_card(aten.relu.default, x3)[0]) == []


def test_a_card_from_another_torch_gets_the_call_without_steps():
    from dataclasses import replace

    card, _ = _card(aten.native_layer_norm.default, x3, [64], w64, b64, 1e-5)
    renamed = replace(card, args=[replace(a, name="x" if a.name == "input" else a.name) for a in card.args])
    assert decomposed(renamed) == []
    missing = replace(card, op="aten::native_layer_norm_v9.default", outputs=card.outputs)
    assert decomposed(missing) == [] and "torch.ops.aten.native_layer_norm_v9.default" in prompts.describe_card(
        missing, H200)
