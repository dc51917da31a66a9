"""Replies -> candidates; every malformed reply is a ProposerError written for the model."""

from __future__ import annotations

import json

import pytest

from kforge.errors import ProposerError
from kforge.proposers.llm.parse import kernel_params, parse_reply
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
    ("I would use a warp per row.", "exactly one ```cuda block"),
    ("```cuda\nextern \"C\" __global__ void a(){}\n```\n```cuda\nint b;\n```\n```json\n{}\n```", "found 2"),
    ("```cuda\n" + source("softmax_v1") + "\n```\nkind: custom", "exactly one ```json block"),
    (_reply(source("softmax_v1"), '{"kernels": [{"name": "softmax_rows_block",}]}'), "not valid JSON"),
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
     "passes {'i64': 1}, which needs a parameter of type"),
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
