"""The data contracts every part shares: launch plans and faithful card tensors."""

from __future__ import annotations

import copy

import pytest
import torch

from kforge.candidate import Candidate, LaunchPlan
from kforge.cards import TensorMeta, empty_like_meta, faithful_clone, pack, pointer_alignment, unpack
from kforge.errors import PlanError

PLAN = {"kernels": [{"name": "softmax_rows", "grid": [4096, 1, 1], "block": [256, 1, 1], "smem": 0,
                     "args": [{"in": 0}, {"out": 0}, {"i32": 4096}]}], "workspace": [], "options": ["-default-device"]}


def test_plan_round_trip_and_validation():
    plan = LaunchPlan.from_json(PLAN)
    plan.validate(n_inputs=1, n_outputs=1)
    assert LaunchPlan.from_json(plan.dumps()).to_json() == plan.to_json()


def test_cooperative_kernels_round_trip_and_ordinary_plans_keep_their_digest():

    coop = copy.deepcopy(PLAN)
    coop["kernels"][0]["cooperative"] = True
    plan = LaunchPlan.from_json(coop)
    assert plan.kernels[0].cooperative and LaunchPlan.from_json(plan.dumps()).kernels[0].cooperative
    plain = LaunchPlan.from_json(PLAN)
    assert not plain.kernels[0].cooperative and "cooperative" not in plain.dumps()  # digests of old plans hold
    assert Candidate("src", plan).digest() != Candidate("src", plain).digest()


def test_cluster_kernels_round_trip_divide_the_grid_and_are_not_cooperative():
    clustered = copy.deepcopy(PLAN)
    clustered["kernels"][0].update(grid=[16, 8, 1], cluster=16)
    plan = LaunchPlan.from_json(clustered)
    assert plan.kernels[0].cluster == 16 and LaunchPlan.from_json(plan.dumps()).kernels[0].cluster == 16
    assert "cluster" not in LaunchPlan.from_json(PLAN).dumps()  # digests of old plans hold
    for bad, match in (({"cluster": 17}, "0 \\(none\\) to 16"), ({"cluster": 3}, "divide grid x"),
                       ({"cluster": 16, "cooperative": True}, "not be cooperative"), ({"cluster": True}, "cluster")):
        k = copy.deepcopy(clustered)
        k["kernels"][0].update(bad)
        with pytest.raises(PlanError, match=match):
            LaunchPlan.from_json(k)


def test_pdl_kernels_round_trip_and_are_not_also_cooperative():

    pdl = copy.deepcopy(PLAN)
    pdl["kernels"][0]["pdl"] = True
    plan = LaunchPlan.from_json(pdl)
    assert plan.kernels[0].pdl and LaunchPlan.from_json(plan.dumps()).kernels[0].pdl
    assert "pdl" not in LaunchPlan.from_json(PLAN).dumps()
    pdl["kernels"][0]["cooperative"] = True
    with pytest.raises(PlanError, match="cooperative or pdl"):
        LaunchPlan.from_json(pdl)


@pytest.mark.parametrize("mutate, message", [
    (lambda p: p["kernels"][0].update(name="not an identifier"), "C identifier"),
    (lambda p: p["kernels"][0].update(block=[2048]), "threads"),
    (lambda p: p["kernels"][0].update(grid=[0]), "grid"),
    (lambda p: p["kernels"][0]["args"].append({"in": 3}), "1 in buffer"),
    (lambda p: p["kernels"][0]["args"].append({"i32": 2**40}), "32 bits"),
    (lambda p: p["kernels"][0]["args"].append({"f32": "x"}), "needs a number"),
    (lambda p: p["kernels"][0]["args"].append({"bogus": 1}), "kind in"),
    (lambda p: p["kernels"][0]["args"].extend([{"in": 0}] * 510), "513 arguments; at most 512"),
    (lambda p: p["kernels"][0].update(args=[{"in": 0}]), "never passed"),
    (lambda p: p["kernels"][0].update(cooperative="yes"), "cooperative"),
])
def test_bad_plans_say_what_is_wrong(mutate, message):

    p = copy.deepcopy(PLAN)
    mutate(p)
    with pytest.raises(PlanError, match=message):
        LaunchPlan.from_json(p).validate(n_inputs=1, n_outputs=1)


def test_candidate_digest_is_what_runs_not_who_proposed_it():
    a = Candidate("src", LaunchPlan.from_json(PLAN), proposer="builtin")
    b = Candidate("src", LaunchPlan.from_json(PLAN), proposer="llm:x", note="other")
    c = Candidate("src2", LaunchPlan.from_json(PLAN))
    assert a.digest() == b.digest() != c.digest()
    with pytest.raises(PlanError):
        Candidate("src", LaunchPlan.from_json(PLAN), kind="library")


@pytest.mark.parametrize("make", [
    lambda: torch.randn(5, 7),
    lambda: torch.randn(6, 9)[1:, 2:7],
    lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    lambda: torch.randn(4, 1).expand(4, 6),
    lambda: torch.randn(8, dtype=torch.bfloat16)[1:],
    lambda: torch.randn(3, 4).t(),
])
def test_faithful_clone_keeps_strides_alignment_and_values(make):
    t = make()
    c = faithful_clone(t)
    assert c.stride() == t.stride() and c.shape == t.shape and c.dtype == t.dtype
    assert pointer_alignment(c.data_ptr()) == pointer_alignment(t.data_ptr())
    assert torch.equal(c, t)
    assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    m = TensorMeta.of(t)
    assert TensorMeta.of(unpack(pack(t), m, "cpu")).key() == m.key()


def test_empty_like_meta_honours_misalignment():
    m = TensorMeta((4,), (1,), "float32", "cpu", align=4)
    assert pointer_alignment(empty_like_meta(m, "cpu").data_ptr()) == 4


def test_io_bytes_counts_in_place_writes_once():
    from kforge.cards import ArgSpec, Card

    m = TensorMeta((1024,), (1,), "float32", "cuda")
    add_ = Card("aten::add_.Tensor", "", [ArgSpec("self", "tensor", tensor=m, written=True),
                                          ArgSpec("other", "tensor", tensor=m), ArgSpec("alpha", "value", value=1)],
                [m], "sm_90", aliases={0: 0})
    add = Card("aten::add.Tensor", "", [ArgSpec("self", "tensor", tensor=m), ArgSpec("other", "tensor", tensor=m),
                                        ArgSpec("alpha", "value", value=1)], [m], "sm_90")
    assert add_.io_bytes() == add.io_bytes() == 3 * 4096


def test_io_bytes_reads_no_destination_whose_old_values_the_op_overwrites():
    """copy_ reads its source and writes its destination (2 passes, not 3); an out= argument
    is written, never read. A floor counting them as reads sat 1.5x above what a copy must
    move, and flagged correct copy kernels on the H200 as beyond the roofline."""
    from test_dispatch import make_card

    aten = torch.ops.aten
    x = torch.randn(64, 32)
    copy_ = make_card(aten.copy_.default, torch.empty(64, 32), x, aliases={0: 0})
    assert copy_.write_only_inputs == {0} and copy_.io_bytes() == 2 * x.nbytes
    mean_out = make_card(aten.mean.out, x, [1], False, out=torch.empty(64), aliases={0: 1})
    assert mean_out.write_only_inputs == {1} and mean_out.io_bytes() == x.nbytes + 64 * 4
    add_ = make_card(aten.add_.Tensor, torch.randn(64, 32), x, aliases={0: 0})
    assert add_.write_only_inputs == set() and add_.io_bytes() == 3 * x.nbytes  # add_ reads self
