"""Replies -> candidates; every malformed reply is a ProposerError written for the model."""

from __future__ import annotations

import json

import pytest

from kforge.errors import ProposerError
from kforge.proposers.llm.parse import kernel_params, parse_reply, strip_reasoning
from llm_cards import answer, group_norm_card, plan, softmax_card, source


def _reply(src: str, plan_obj, kind: str = "custom") -> str:
    body = plan_obj if isinstance(plan_obj, str) else json.dumps(plan_obj)
    return f"```cuda\n{src}\n```\n```json\n{body}\n```\nkind: {kind}"


def test_well_formed_replies_become_candidates():
    c = parse_reply(answer("softmax_v3_warp", prose="One warp per row."), softmax_card(), "llm:m")
    assert c.source == source("softmax_v3_warp") and c.plan.kernels[0].name == "softmax_warp_row"
    assert (c.kind, c.proposer, c.note) == ("custom", "llm:m", "One warp per row.")
    gn = parse_reply(answer("group_norm_v2_split", kind="vendor"), group_norm_card())
    assert [k.name for k in gn.plan.kernels] == ["group_norm_partial", "group_norm_apply"]
    assert gn.kind == "vendor" and gn.plan.workspace == [4096]


def test_kernel_signatures_are_read_through_launch_bounds_and_comments():
    params = kernel_params(source("group_norm_v2_split") + '\n// extern "C" __global__ void ghost(int a)\n')
    assert set(params) == {"group_norm_partial", "group_norm_apply"}
    assert [p.pointer for p in params["group_norm_partial"]] == [True, True, False]
    assert params["group_norm_apply"][-1].scalar_kind == "f32"
    assert kernel_params('extern "C" __global__ void k(void) {}') == {"k": []}


@pytest.mark.parametrize("reply, message", [
    ("I would use a warp per row.", "found no ```cuda block"),
    ("```cuda\nextern \"C\" __global__ void a(){}\n```\n```json\n{}\n```", 'non-empty "kernels"'),
    ("```cuda\n" + source("softmax_v1") + "\n```\nkind: custom", "found no launch plan"),
    (_reply(source("softmax_v1"), '{"kernels": [{"name": "softmax_rows_block",}]}'), "grid must be 1 to 3 integers"),
    (_reply(source("softmax_v1"), '{"kernels": [{"name": "softmax_rows_block" "grid": 1}]}'), "not valid JSON"),
    (_reply(source("softmax_v1"), {"kernels": []}), "non-empty \"kernels\""),
    (_reply(source("softmax_v1"), dict(plan("softmax_v1"), kernels=[dict(plan("softmax_v1")["kernels"][0],
                                                                         name="softmax_rows")])),
     'launches "softmax_rows" but the source defines no'),
    (_reply(source("softmax_v1"), dict(plan("softmax_v1"), kernels=[dict(plan("softmax_v1")["kernels"][0],
                                                                         args=[{"in": 0}, {"out": 0}])])),
     "takes 3 parameters but the plan passes 2"),
    (_reply(source("softmax_v1"), dict(plan("softmax_v1"), kernels=[dict(plan("softmax_v1")["kernels"][0],
                                                                         args=[{"in": 0}, {"in": 0}, {"i32": 1}])])),
     "every output must be written"),
    (_reply(source("softmax_v1"), dict(plan("softmax_v1"), kernels=[dict(plan("softmax_v1")["kernels"][0],
                                                                         args=[{"in": 0}, {"out": 0}, {"i64": 1}])])),
     "passes {'i64': 1}, which needs a parameter of type long long"),
    (_reply(source("softmax_v1"), dict(plan("softmax_v1"), kernels=[dict(plan("softmax_v1")["kernels"][0],
                                                                         args=[{"in": 0}, {"i32": 0}, {"out": 0}])])),
     "passes scalar {'i32': 0} to a pointer parameter"),
    (_reply(source("softmax_v1"), dict(plan("softmax_v1"), kernels=[dict(plan("softmax_v1")["kernels"][0],
                                                                         args=[{"in": 0}, {"out": 0}, {"out": 0}])])),
     "parameter 2 `int cols`: the plan binds a buffer {'out': 0} to it, which needs a pointer parameter"),
    (_reply(source("softmax_v1"), dict(plan("softmax_v1"), kernels=[dict(plan("softmax_v1")["kernels"][0],
                                                                         args=[{"in": 1}, {"out": 0}, {"i32": 1}])])),
     "the card has 1 in buffer"),
    (_reply(source("softmax_v1"), dict(plan("softmax_v1"), kernels=[dict(plan("softmax_v1")["kernels"][0],
                                                                         block=[2048, 1, 1])])),
     "2048 threads"),
    ("   ", "empty"),
])
def test_malformed_replies_raise_messages_for_the_model(reply, message):
    with pytest.raises(ProposerError) as e:
        parse_reply(reply, softmax_card())
    assert message in str(e.value)


# ---- what models actually write -------------------------------------------------------------

V1_PLAN = plan("softmax_v1")
V1_KERNEL = V1_PLAN["kernels"][0]


def _same_as_canonical(reply: str) -> None:
    c = parse_reply(reply, softmax_card())
    assert c.source.startswith(source("softmax_v1").strip())  # a plan comment may follow
    assert c.plan.dumps() == parse_reply(_reply(source("softmax_v1"), V1_PLAN), softmax_card()).plan.dumps()


JSONC = """{
  // one block per row
  "kernels": [{"name": "softmax_rows_block", "grid": [4096, 1, 1], "block": [256, 1, 1], /* no smem */ "smem": 0,
               "args": [{"in": 0}, {"out": 0}, {"i32": 1024},],},],
  "workspace": [],
  "options": [],
}"""


@pytest.mark.parametrize("reply", [
    f"```cuda\n{source('softmax_v1')}```\n```jsonc\n{JSONC}\n```",
    f"```cuda\n{source('softmax_v1')}```\n```json5\n{{kernels: [{{name: 'softmax_rows_block', grid: [4096], "
    f"block: [256], args: [{{in: 0}}, {{out: 0}}, {{i32: 1024}}]}}]}}\n```",
    f"```cuda\n{source('softmax_v1')}```\n```javascript\nconst plan = {json.dumps(V1_PLAN)};\n```",
    f"```cuda\n{source('softmax_v1')}```\n```json\n{json.dumps({'launch_plan': V1_PLAN})}\n```",
    f"```cuda\n{source('softmax_v1')}/* plan: {json.dumps(V1_PLAN)} */\n```",
    f"```cuda\n{source('softmax_v1')}/*\n * launch plan:\n * {json.dumps(V1_PLAN)}\n */\n```",
    f"```cuda\n{source('softmax_v1')}// plan: {{\"kernels\": [{{\"name\": \"softmax_rows_block\",\n"
    f"//   \"grid\": [4096, 1, 1], \"block\": [256, 1, 1], \"args\": [{{\"in\": 0}}, {{\"out\": 0}}, {{\"i32\": 1024}}]}}]}}\n```",
    f"```cuda\n{source('softmax_v1')}\n```json\n{json.dumps(V1_PLAN)}\n```\n```",  # json fence nested in the cuda one
    f"Launch plan: {json.dumps(V1_PLAN)}\n\n```cuda\n{source('softmax_v1')}```",
    "```cuda\n" + source("softmax_v1") + "```\n```json\n" + json.dumps(V1_KERNEL) + "\n```",  # one kernel, no list
    "```cuda\n" + source("softmax_v1") + "```\n```json\n// the launches\n" + json.dumps([V1_KERNEL]) + "\n```",
    f"<think>\nA first draft:\n```cuda\nextern \"C\" __global__ void softmax_rows_block(float* y) {{}}\n```\n"
    f"that is wrong.\n</think>\n\n{_reply(source('softmax_v1'), V1_PLAN)}",
    f"Let me think. ```cuda\n``` drafts...\n</think>\n{_reply(source('softmax_v1'), V1_PLAN)}",  # template-opened <think>
    f"~~~cuda\n{source('softmax_v1')}~~~\n~~~json\n{json.dumps(V1_PLAN)}\n~~~",
    f"   ```cuda\n{source('softmax_v1')}   ```\n   ```json\n{json.dumps(V1_PLAN)}\n   ```",
    f"```cuda\n{source('softmax_v1')}```\n```json\n{json.dumps(V1_PLAN)}",  # the last fence forgotten
])
def test_lenient_forms_read_as_the_canonical_answer(reply):
    _same_as_canonical(reply)


@pytest.mark.parametrize("kernel", [
    {"name": "softmax_rows_block", "blocks": [4096, 1, 1], "threads": [256, 1, 1], "args": V1_KERNEL["args"]},
    {"kernel": "softmax_rows_block", "gridDim": [4096, 1, 1], "blockDim": 256, "arguments": V1_KERNEL["args"]},
    {"name": "softmax_rows_block", "grid_dim": {"x": 4096}, "block_dim": {"x": 256, "y": 1}, "shared_mem": 0,
     "args": ["in0", "out0", {"int": 1024}]},
    {"name": "softmax_rows_block", "grid": [4096], "block": [256], "dynamic_smem": 0, "description": "row softmax",
     "args": [{"input": 0}, {"kind": "out", "index": 0}, {"type": "i32", "value": 1024}]},
])
def test_synonyms_map_to_the_plan_keys(kernel):
    _same_as_canonical(_reply(source("softmax_v1"), {"kernels": [kernel]}))


def test_shared_memory_synonyms_are_not_dropped():
    for key in ("shared_mem", "shared_memory", "dynamic_smem", "sharedMemBytes"):
        k = dict(V1_KERNEL, smem=None)
        del k["smem"]
        k[key] = 4096
        assert parse_reply(_reply(source("softmax_v1"), {"kernels": [k]}), softmax_card()).plan.kernels[0].smem == 4096


@pytest.mark.parametrize("plan_obj, message", [
    ({"kernels": [dict(V1_KERNEL, dyn_smem_kb=4)]}, 'kernel 0 has key(s) "dyn_smem_kb" that kforge does not know'),
    (dict(V1_PLAN, stream=0), 'the plan has key(s) "stream"'),
    ({"kernels": [dict(V1_KERNEL, shared_mem=64)]}, 'gives "smem" twice'),
    (dict(V1_PLAN, workspace=[{"size_kb": 64}]), 'a workspace entry has key(s) "size_kb"'),
    (dict(V1_PLAN, workspace=["64 bytes"]), 'workspace entry "64 bytes" must be a byte count'),
    (dict(V1_PLAN, workspace=[None]), "workspace entry null must be a byte count"),
    (dict(V1_PLAN, workspace=[-8]), "workspace entry -8 must be a byte count"),
    (dict(V1_PLAN, workspace=[{"bytes": "64"}]), 'workspace entry {"bytes": "64"} must be a byte count'),
    (dict(V1_PLAN, workspace=[{"bytes": 64, "zero": "yes"}]), "must be a byte count"),
    (dict(V1_PLAN, workspace={"bytes": 64}), '"workspace" must be a list'),
    (dict(V1_PLAN, options="-O3"), '"options" a list of strings'),
    ({"kernels": [dict(V1_KERNEL, grid=[True, 1, 1])]}, "grid must be 1 to 3 integers"),
    ({"kernels": [dict(V1_KERNEL, smem=True)]}, "smem must be a non-negative integer"),
    ({"kernels": [dict(V1_KERNEL, args=[{"in": 0}, {"out": 0}, 1024])]}, "argument 1024 must be one of"),
    ({"kernels": [dict(V1_KERNEL, args={"in": 0})]}, '"args" must be a list'),
    ({"kernels": "softmax_rows_block"}, 'non-empty "kernels" list'),
    ([None], "found no launch plan"),
    ({"kernels": [None]}, 'needs a "name"'),
    ({"kernels": [dict(V1_KERNEL, name=["softmax_rows_block"])]}, 'needs a "name"'),
])
def test_odd_plans_are_feedback_never_a_crash(plan_obj, message):
    with pytest.raises(ProposerError) as e:
        parse_reply(_reply(source("softmax_v1"), plan_obj), softmax_card())
    assert message in str(e.value)


@pytest.mark.parametrize("value", [None, 1, "x", [], [1], [None], {"kernels": [{}]}, {"kernels": [{"name": 1}]},
                                   {"kernels": [{"name": "k", "grid": {"x": 1}, "block": [1], "args": [[]]}]},
                                   {"kernels": [{"name": "k", "grid": [1], "block": [1], "args": [{"in": None}]}]},
                                   {"kernels": [{"name": "k", "grid": [1], "block": [1], "cluster": "2"}]},
                                   {"kernels": [{"name": "k", "grid": [1], "block": [1]}], "workspace": [{"size": 64}]},
                                   {"kernels": [{"name": "k", "grid": [1], "block": [1]}], "workspace": [[64]]},
                                   {"kernels": [{"name": "k", "grid": [1], "block": [1]}], "options": [None]}])
def test_launch_plan_from_json_raises_plan_error_for_any_json_value(value):
    from kforge.candidate import LaunchPlan
    from kforge.errors import PlanError

    with pytest.raises(PlanError):
        LaunchPlan.from_json(json.dumps(value))


def test_workspace_size_synonym_reads_as_bytes():
    c = parse_reply(_reply(source("group_norm_v2_split"), dict(plan("group_norm_v2_split"), workspace=[{"size": 4096}])),
                    group_norm_card())
    assert c.plan.workspace_bytes() == [(4096, False)]


EXTERN_BLOCK = """#include <cuda_fp16.h>
extern "C" {
__device__ float twice(float x) { return 2.f * x; }   // helpers may sit in the block too

__global__ void __launch_bounds__(256) softmax_rows_block(const float* __restrict__ x, float* __restrict__ y, int cols)
{
    if (threadIdx.x < cols) y[threadIdx.x] = twice(x[threadIdx.x]);
}
}  // extern "C"
"""


def test_extern_c_blocks_define_unmangled_kernels():
    c = parse_reply(_reply(EXTERN_BLOCK, V1_PLAN), softmax_card())
    assert c.source == EXTERN_BLOCK + "\n"
    assert set(kernel_params(EXTERN_BLOCK + '__global__ void mangled(int n) {}\n')) == {"softmax_rows_block"}


def test_a_mangled_kernel_is_named_with_the_fix():
    mangled = source("softmax_v1").replace('extern "C" ', "")
    with pytest.raises(ProposerError, match='kernel softmax_rows_block is not extern "C"'):
        parse_reply(_reply(mangled, V1_PLAN), softmax_card())


def test_of_several_cuda_blocks_the_one_defining_the_plans_kernels_is_the_source():
    draft = 'extern "C" __global__ void softmax_draft(const float* x, float* y, int cols) {}\n'
    final = source("softmax_v1")
    fixed_later = source("softmax_v1").replace("three passes", "three passes (fixed)")
    reply = f"Draft:\n```cuda\n{draft}```\nFinal:\n```cuda\n{final}```\nUsage:\n```cpp\n{draft}```\n```json\n" \
            f"{json.dumps(V1_PLAN)}\n```"
    assert parse_reply(reply, softmax_card()).source == final
    # Two versions of the same kernel: the later one is the answer.
    two = f"```cuda\n{final}```\nOn second thought:\n```cuda\n{fixed_later}```\n```json\n{json.dumps(V1_PLAN)}\n```"
    assert parse_reply(two, softmax_card()).source == fixed_later


def test_helper_blocks_and_split_kernels_are_joined():
    helper = "__device__ __forceinline__ float warp_max(float v) { return v; }\n"
    kernel = source("softmax_v1")
    reply = f"Helpers:\n```cuda\n{helper}```\nKernel:\n```cuda\n{kernel}```\n```json\n{json.dumps(V1_PLAN)}\n```"
    assert parse_reply(reply, softmax_card()).source == kernel  # the kernel calls no helper of that block
    calls = kernel.replace("m = fmaxf(m, row[i]);", "m = warp_max(fmaxf(m, row[i]));")
    reply = f"Helpers:\n```cuda\n{helper}```\nKernel:\n```cuda\n{calls}```\n```json\n{json.dumps(V1_PLAN)}\n```"
    assert parse_reply(reply, softmax_card()).source == f"{helper}\n{calls}"
    own = calls + helper  # the kernel block has its own copy: the helper block would define it twice
    reply = f"```cuda\n{helper}```\n```cuda\n{own}```\n```json\n{json.dumps(V1_PLAN)}\n```"
    assert parse_reply(reply, softmax_card()).source == own
    gn = plan("group_norm_v2_split")
    partial, apply = source("group_norm_v2_split").split("\nextern \"C\"", 1)
    split = f"```cuda\n{partial}\n```\n```cuda\nextern \"C\"{apply}```\n```json\n{json.dumps(gn)}\n```"
    c = parse_reply(split, group_norm_card())
    assert set(kernel_params(c.source)) == {"group_norm_partial", "group_norm_apply"}


def test_reasoning_is_stripped_before_parsing():
    thinking = "<think>\nThe plan could be {\"kernels\": []}\n```cuda\nint draft;\n```\n</think>\n"
    c = parse_reply(thinking + answer("softmax_v1", prose="One block per row."), softmax_card())
    assert c.note == "One block per row." and c.source == source("softmax_v1")
    assert strip_reasoning("<think>only thoughts, cut off") == ""
    with pytest.raises(ProposerError, match="only reasoning, no answer"):
        parse_reply("<think>\nlong deliberation ...", softmax_card())


def test_the_parser_turns_any_exception_into_feedback(monkeypatch):
    from kforge.proposers.llm import parse

    def boom(*a):
        raise IndexError("list index out of range")

    monkeypatch.setattr(parse, "normalize_plan", boom)
    with pytest.raises(ProposerError, match=r"could not be read \(IndexError: list index out of range\)"):
        parse_reply(answer("softmax_v1"), softmax_card())


def _random_json(rng, depth: int = 0):
    keys = ["kernels", "name", "grid", "block", "smem", "args", "in", "out", "ws", "i32", "i64", "f32", "bytes",
            "zero", "workspace", "options", "cluster", "pdl", "cooperative", "blocks", "threads", "shared_mem", "x"]
    leaves = [None, True, False, 0, -1, 1, 64, 2**40, 1.5, float("nan"), "", "64 bytes", "softmax_rows_block", "in0"]
    r = rng.random()
    if depth > 3 or r < 0.4:
        return rng.choice(leaves)
    if r < 0.7:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def test_random_plans_and_mangled_replies_are_feedback_from_the_checks_themselves():
    """Nothing reaches the parser's last-resort net: every odd input gets a specific message."""
    import random

    from kforge.candidate import LaunchPlan
    from kforge.errors import PlanError

    rng = random.Random(27)
    canonical = _reply(source("softmax_v1"), V1_PLAN)
    for n in range(500):
        value = _random_json(rng)
        if n % 3 == 0:
            value = {"kernels": [dict(V1_KERNEL, **(value if isinstance(value, dict) else {"args": value}))]}
        try:
            LaunchPlan.from_json(json.dumps(value))
        except PlanError:
            pass
        text = canonical if n % 2 else _reply(source("softmax_v1"), json.dumps(value))
        for _ in range(rng.randrange(4)):  # cut, duplicate or drop a piece of the reply
            i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
            text = rng.choice([text[:i] + text[j:], text[:j] + text[i:j] + text[j:], text[:i] + "```" + text[i:]])
        try:
            parse_reply(text, softmax_card())
        except ProposerError as e:
            assert "could not be read" not in str(e), (text, str(e))
