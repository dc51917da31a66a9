"""Concatenation in generated kernels on the CPU: a cat card, and regions with cats in them, are
one pointwise program per slab of the output along the cat's dim (kforge/codegen/concat.py),
each writing its slab at an offset. Checked against eager through the reference interpreter
and through the generated C itself (g++, tests/cuda_on_cpu.py, outputs NaN-poisoned first, so
a slab left unwritten fails), and compiled by NVRTC for sm_90; what cannot be cut into slabs is
declined with its reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cuda_on_cpu
from builtin_cards import A, BF16, F32, make_card, meta
from kforge import compiler
from kforge.codegen import card_program, interp
from kforge.hardware import H200
from kforge.proposers.builtin import BuiltinProposer, generated
from test_codegen_regions import region_card, rotate_half

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _pieces(dtype):
    """Three pieces along dim 1 of widths 3, 8 and 5 (odd offsets: the slabs after the first are
    not vector-aligned), the middle one transposed in memory."""
    return [meta(4, 3, 6, dtype=dtype), meta(4, 6, 8, dtype=dtype).transpose(1, 2), meta(4, 5, 6, dtype=dtype)]


@pytest.mark.parametrize("dtype", [F32, torch.int64, BF16])
@pytest.mark.parametrize("dim", [1, -1])
def test_a_cat_card_is_one_copy_per_piece_into_its_slab(dtype, dim):
    """(The generated C runs on the CPU for 32- and 64-bit types; bf16 is compiled only.)"""
    pieces = _pieces(dtype) if dim == 1 else [meta(4, 6, 3, dtype=dtype), meta(4, 6, 8, dtype=dtype),
                                              meta(4, 6, 5, dtype=dtype)]
    card = make_card(A.cat.default, pieces, dim)
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    assert [p.out_offsets[0] for p in [prog, *prog.parts]] == ([0, 18, 66] if dim == 1 else [0, 3, 11])
    assert BuiltinProposer().supports(card) == (True, "")
    inputs = card.random_inputs(0, "cpu")
    want = torch.cat(inputs, dim)
    (got,) = interp.run(prog, inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for vec in (1, 4):
        knobs = {**generated.default(card, H200), "vec": vec, "threads": 64}
        cand = generated.build(card, knobs, H200)
        (launch,) = cand.plan.kernels  # one launch: each piece's copy in its own range of blocks
        assert [a for a in launch.args if "in" in a] == [{"in": 0}, {"in": 1}, {"in": 2}]
        assert compiler.compile(cand.source, arch="sm_90").cubin
        if dtype != BF16:
            (ran,) = cuda_on_cpu.run(card, cand, inputs)
            torch.testing.assert_close(ran, want, rtol=0, atol=0, msg=lambda m: f"{knobs}: {m}")


def test_a_cat_of_a_broadcast_class_token_runs_on_fresh_inputs():
    """ViT's cat of its class token, expanded over the batch (stride 0), and the patches: the
    evaluator's fresh inputs are drawn over the token's storage, and the kernel reads it through
    its strides (every sample gets the same token)."""
    token = meta(1, 1, 8).expand(4, 1, 8)
    card = make_card(A.cat.default, [token, meta(4, 5, 8)], 1)
    inputs = card.random_inputs(0, "cpu")
    assert inputs[0].stride() == (0, 8, 1) and inputs[0][0].equal(inputs[0][3]) and inputs[0].std() > 0
    want = torch.cat(inputs, 1)
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    torch.testing.assert_close(interp.run(prog, inputs)[0], want, rtol=0, atol=0)
    cand = generated.build(card, {**generated.default(card, H200), "threads": 64}, H200)
    torch.testing.assert_close(cuda_on_cpu.run(card, cand, inputs)[0], want, rtol=0, atol=0)


def test_a_cat_of_many_pieces_is_declined():
    card = make_card(A.cat.default, [meta(4, 2) for _ in range(65)], 1)
    assert "at most 64" in card_program.program_for_card(card)


def test_a_legacy_empty_piece_is_skipped_as_torch_cat_skips_it():
    """A 1-D empty piece (transformers' caches start as torch.tensor([])) adds nothing: the cat
    of it and one other piece is a copy of that piece."""
    card = make_card(A.cat.default, [meta(0), meta(4, 2, 3), meta(0)], 0)
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    inputs = card.random_inputs(0, "cpu")
    want = torch.cat(inputs, 0)
    torch.testing.assert_close(interp.run(prog, inputs)[0], want, rtol=0, atol=0)
    cand = generated.build(card, {**generated.default(card, H200), "threads": 64}, H200)
    assert len(cand.plan.kernels) == 1 and compiler.compile(cand.source, arch="sm_90").cubin
    torch.testing.assert_close(cuda_on_cpu.run(card, cand, inputs)[0], want, rtol=0, atol=0)


@pytest.mark.parametrize("pieces, dim, reason", [
    ([meta(0), meta(0)], 0, "no elements"), ([meta(4, 0), meta(4, 0)], 1, "no elements"),
    ([meta(0, dtype=torch.int64), meta(4, 3, dtype=torch.int32)], 0, "promotes"),
    ([meta(4, 2, dtype=torch.int32), meta(4, 3, dtype=torch.int64)], 1, "promotes")])
def test_a_cat_of_no_elements_or_of_mixed_dtypes_is_declined(pieces, dim, reason):
    """torch.cat promotes its pieces to one dtype, an empty piece's dtype too: a piece read as it
    is would compute in its own (int32 where eager's product is int64). Declined, as are cats of
    nothing, with the reason."""
    card = make_card(A.cat.default, pieces, dim)
    got = card_program.program_for_card(card)
    assert isinstance(got, str) and reason in got, got
    assert BuiltinProposer().supports(card)[0] is False


class RotaryIntoACache(nn.Module):
    """Llama's attention as transformers runs it with a cache: rotate_half cuts the last dim, and
    the rotated keys are appended to the cache (empty at first: a legacy empty piece) along the
    sequence dim."""

    def forward(self, k, cos, sin):
        cache = torch.tensor([], dtype=k.dtype)
        return torch.cat([cache, k * cos + rotate_half(k) * sin], dim=-2)


class CatsAlongTwoDims(nn.Module):
    """A cat along the last dim feeding one along the middle dim: the slabs of the first cut
    are cut again, four slabs in all, each at its offset in the output."""

    def forward(self, a, b, c):
        return torch.cat((torch.cat((a.sigmoid(), b), -1), c), -2) * 2


class CatThenSum(nn.Module):
    def forward(self, a, b):
        return torch.cat((a.sigmoid(), b.sigmoid()), -1).sum(-1)


class CatThenTranspose(nn.Module):
    def forward(self, a, b):
        return (torch.cat((a.sigmoid(), b), -1).transpose(1, 2) * 2).contiguous()


class TwoCatsCutDifferently(nn.Module):
    """cat(x, b) * cat(b, x) with pieces of widths 3 and 5: cut at 3 and at 5, three slabs, each
    reading one piece of each cat, narrowed."""

    def forward(self, a, b):
        x = a.sigmoid()
        return torch.cat((x, b), -1) * torch.cat((b, x), -1)


@pytest.mark.parametrize("model, reason", [(CatThenSum, "cat beside sum"),
                                           (CatThenTranspose, "does not span the cat's dim")])
def test_what_cannot_be_cut_into_slabs_is_declined_with_its_reason(tmp_path, model, reason):
    card = region_card(tmp_path, model(), torch.randn(4, 5, 3), torch.randn(4, 5, 3))
    assert "cat" in card.region.ops
    got = card_program.program_for_card(card)
    assert isinstance(got, str) and reason in got, got


@pytest.mark.parametrize("model, inputs, offsets", [
    (RotaryIntoACache, lambda: (torch.randn(1, 2, 16, 8), torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8)), [0, 4]),
    (CatsAlongTwoDims, lambda: (torch.randn(2, 5, 3), torch.randn(2, 5, 4), torch.randn(2, 2, 7)), [0, 35, 3, 38])])
def test_cats_along_two_dims_are_cut_slab_within_slab(tmp_path, model, inputs, offsets):
    card = region_card(tmp_path, model(), *inputs())
    assert card.region.ops.count("cat") == 2
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    assert [p.out_offsets[0] for p in [prog, *prog.parts]] == offsets
    ins = card.random_inputs(0, "cpu")
    (want,) = card.region.replay([t.clone() for t in ins])
    torch.testing.assert_close(interp.run(prog, ins)[0], want)
    cand = generated.build(card, {**generated.default(card, H200), "threads": 64}, H200)
    assert compiler.compile(cand.source, arch="sm_90").cubin
    torch.testing.assert_close(cuda_on_cpu.run(card, cand, ins)[0], want)


def test_two_cats_cut_differently_read_each_others_pieces_slab_by_slab(tmp_path):
    card = region_card(tmp_path, TwoCatsCutDifferently(), torch.randn(4, 6, 3), torch.randn(4, 6, 5))
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    assert [p.out_offsets[0] for p in [prog, *prog.parts]] == [0, 3, 5]
    inputs = card.random_inputs(0, "cpu")
    (want,) = card.region.replay([t.clone() for t in inputs])
    (got,) = interp.run(prog, inputs)
    torch.testing.assert_close(got, want)
    for knobs in ({**generated.default(card, H200), "threads": 64}, {**generated.default(card, H200), "vec": 1}):
        cand = generated.build(card, knobs, H200)
        assert compiler.compile(cand.source, arch="sm_90").cubin
        (ran,) = cuda_on_cpu.run(card, cand, inputs)
        torch.testing.assert_close(ran, want)


class DenseLayerInput(nn.Module):
    """A DenseNet layer's input: the cat of every feature map before it, into the layer's batch
    norm (running statistics) and ReLU."""

    def __init__(self, channels: int, dim: int = 1):
        super().__init__()
        self.dim, self.bn = dim, nn.BatchNorm2d(channels).eval()
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-1, 1)

    def forward(self, *features):
        return torch.relu(self.bn(torch.cat(features, self.dim)))


@pytest.mark.parametrize("widths, dim, memory_format", [
    ((3, 8, 5), 1, torch.contiguous_format), ((4,) * 49, 1, torch.contiguous_format), ((2, 3), 2, torch.contiguous_format),
    ((3, 8, 5), 1, torch.channels_last)])
def test_a_batch_norm_after_a_cat_reads_its_slab_of_the_channel_vectors(tmp_path, widths, dim, memory_format):
    """Inference batch norm is an affine map per channel: a slab of the cat's channels reads its
    slab of the weight, bias and running statistics (a slab of another dim, all of them).
    DenseNet-201's deepest cat has 49 pieces: one launch, a range of blocks each. Channels-last
    features (as kforge.optimize's convolutions write them) make each slab a strided one."""
    features = [(torch.randn(2, w, 5, 3) if dim == 1 else torch.randn(2, 6, w, 3)).contiguous(memory_format=memory_format)
                for w in widths]
    card = region_card(tmp_path, DenseLayerInput(sum(widths) if dim == 1 else 6, dim), *features)
    assert "cat" in card.region.ops and "relu" in card.region.ops
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    assert len([prog, *prog.parts]) == len(widths)
    ins = [t.abs() + 0.5 if t.dim() == 1 else t for t in card.random_inputs(0, "cpu")]  # a positive variance
    (want,) = card.region.replay([t.clone() for t in ins])
    torch.testing.assert_close(interp.run(prog, ins)[0], want)
    cand = generated.build(card, {**generated.default(card, H200), "threads": 64}, H200)
    assert len(cand.plan.kernels) == 1 and compiler.compile(cand.source, arch="sm_90").cubin
    torch.testing.assert_close(cuda_on_cpu.run(card, cand, ins)[0], want)


class GhostModuleTail(nn.Module):
    """GhostNet's module end: the cheap features' batch norm, the cat with the primary ones, the
    cat sliced to the output channels (whole here: traced as an alias of the cat), the shortcut added."""

    def __init__(self, channels: int):
        super().__init__()
        self.channels, self.bn = channels, DenseLayerInput(channels).bn

    def forward(self, primary, cheap, shortcut):
        return torch.cat([primary, self.bn(cheap)], 1)[:, :2 * self.channels] + shortcut


def test_a_view_of_a_cat_in_its_slabs_reads_each_piece_through_it(tmp_path):
    """In a slab the cat is the piece the slab falls in: a view of the cat becomes a view of a
    region input there, read through the view's strides (it was declined as a view of no
    computed value)."""
    card = region_card(tmp_path, GhostModuleTail(6), torch.randn(2, 6, 5, 3), torch.randn(2, 6, 5, 3),
                       torch.randn(2, 12, 5, 3))
    assert "cat" in card.region.ops and "add" in card.region.ops
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    ins = [t.abs() + 0.5 if t.dim() == 1 else t for t in card.random_inputs(0, "cpu")]  # a positive variance
    (want,) = card.region.replay([t.clone() for t in ins])
    torch.testing.assert_close(interp.run(prog, ins)[0], want)
    cand = generated.build(card, {**generated.default(card, H200), "threads": 64}, H200)
    assert compiler.compile(cand.source, arch="sm_90").cubin
    torch.testing.assert_close(cuda_on_cpu.run(card, cand, ins)[0], want)


class PermutedCatOfTransposedPieces(nn.Module):
    """A permute of a cat whose pieces are transposed values: in a slab the permute's operand is
    a piece laid out otherwise than the cat, so the strides of the two can agree in order while
    the permute still swaps two dims."""

    def forward(self, x, y):
        return torch.cat([x.transpose(0, 1) * 2, y.transpose(0, 1) * 3], 2).permute(1, 0, 2, 3) + 1


def test_a_permute_in_a_slab_is_never_taken_for_a_view_that_keeps_the_order(tmp_path):
    card = region_card(tmp_path, PermutedCatOfTransposedPieces(), torch.randn(4, 4, 3, 5), torch.randn(4, 4, 2, 5))
    prog = card_program.program_for_card(card)
    if isinstance(prog, str):  # declined is right too; a wrong value is not
        return
    ins = card.random_inputs(0, "cpu")
    (want,) = card.region.replay([t.clone() for t in ins])
    torch.testing.assert_close(interp.run(prog, ins)[0], want)


@pytest.mark.parametrize("shape, shifts, dims, channels_last", [
    ((2, 6, 9, 4), (-3, -3), (1, 2), False),  # Swin's shifted windows: two dims, one launch of four blocks
    ((2, 4, 6, 9), (3, -2), (2, 3), True),    # channels-last, written as eager writes it
    ((8, 5), (7,), (0,), False),              # a shift past the size wraps
    ((3, 4), (4, 1), (1, 0), False),          # whole turns along one dim: only the other is cut
    ((3, 4), (4,), (1,), False),              # whole turns only: a copy
])
def test_a_roll_card_is_a_cat_of_its_inputs_slices(shape, shifts, dims, channels_last):
    """torch.roll (an `other` op) is generated as cats of its input's slices (concat.roll_nodes):
    one launch whose parts copy each block of the input to where the roll puts it, equal to eager
    through the interpreter and through the generated C on the CPU, and compiled by NVRTC."""
    x = meta(*shape)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    card = make_card(A.roll.default, x, list(shifts), list(dims))
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    cut = sum(1 for d, s in zip(dims, shifts) if s % shape[d])
    assert len(prog.parts) + 1 == 2 ** cut
    assert BuiltinProposer().supports(card) == (True, "")
    inputs = card.random_inputs(0, "cpu")
    want = torch.roll(inputs[0], shifts, dims)
    (got,) = interp.run(prog, inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for vec in (1, 4):
        knobs = {**generated.default(card, H200), "vec": vec}
        cand = generated.build(card, knobs, H200)
        assert compiler.compile(cand.source, arch="sm_90").cubin
        (ran,) = cuda_on_cpu.run(card, cand, inputs)
        assert ran.stride() == tuple(card.outputs[0].stride)
        torch.testing.assert_close(ran, want, rtol=0, atol=0, msg=lambda m: f"{knobs}: {m}")


def test_a_roll_of_the_flattened_tensor_is_declined():
    card = make_card(A.roll.default, meta(3, 4), [1], [])
    assert "flattened" in BuiltinProposer().supports(card)[1]
