"""Rows picked by an index (codegen/gather.py): embedding, index_select and gather as generated pointwise
kernels, checked against eager through the IR's interpreter and by running the generated C on
the CPU, vector and element-by-element loads alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cuda_on_cpu
from builtin_cards import A, BF16, make_card, meta
from kforge import compiler
from kforge.capturing import capture
from kforge.codegen import card_program, interp
from kforge.hardware import H200
from kforge.proposers.builtin import BuiltinProposer, generated

I64, I32 = torch.int64, torch.int32


def drawn(card, lo: int, hi: int):
    """The card with its integer input's recorded range (what a capture records)."""
    args = [dataclasses.replace(a, tensor=dataclasses.replace(a.tensor, lo=float(lo), hi=float(hi)))
            if a.kind == "tensor" and a.tensor.dtype in ("int64", "int32") else a for a in card.args]
    return dataclasses.replace(card, args=args, id="")


CASES = {
    "embedding": (lambda: drawn(make_card(A.embedding.default, meta(50, 16), meta(2, 7, dtype=I64)), 0, 49),
                  lambda w, i: torch.embedding(w, i)),
    "embedding_odd_rows_float64": (lambda: drawn(make_card(A.embedding.default, meta(30, 5, dtype=torch.float64),
                                                           meta(9, dtype=I64)), 3, 29), lambda w, i: torch.embedding(w, i)),
    "embedding_int32_indices_int_table": (lambda: drawn(make_card(A.embedding.default, meta(20, 8, dtype=I32),
                                                                  meta(3, 4, dtype=I32)), 0, 19),
                                          lambda w, i: torch.embedding(w, i)),
    "index_select_dim0": (lambda: drawn(make_card(A.index_select.default, meta(40, 12), 0, meta(25, dtype=I64)), 0, 39),
                          lambda s, i: torch.index_select(s, 0, i)),
    "index_select_middle_dim": (lambda: drawn(make_card(A.index_select.default, meta(6, 10, 8), 1, meta(5, dtype=I64)), 0, 9),
                                lambda s, i: torch.index_select(s, 1, i)),
    "index_select_last_dim_transposed": (lambda: drawn(make_card(A.index_select.default, meta(12, 7).t(), -1,
                                                                 meta(30, dtype=I64)), 0, 11),
                                         lambda s, i: torch.index_select(s, -1, i)),
    "gather_rows": (lambda: drawn(make_card(A.gather.default, meta(8, 30), 1, meta(8, 5, dtype=I64)), 0, 29),
                    lambda s, i: torch.gather(s, 1, i)),
    "gather_dim0_narrower_index_transposed": (lambda: drawn(make_card(A.gather.default, meta(12, 9).t(), 0,
                                                                      meta(6, 7, dtype=I64)), 0, 8),
                                              lambda s, i: torch.gather(s, 0, i)),
    "gather_transposed_int32_table": (lambda: drawn(make_card(A.gather.default, meta(30, 4, dtype=I32).t(), 1,
                                                              meta(4, 7, dtype=I64)), 0, 29),
                                      lambda s, i: torch.gather(s, 1, i)),
    "embedding_one_element_rows": (lambda: drawn(make_card(A.embedding.default, meta(10, 1), meta(3, 5, dtype=I64)), 0, 9),
                                   lambda w, i: torch.embedding(w, i)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_picked_rows_match_eager(name):
    make, ref = CASES[name]
    card = make()
    assert BuiltinProposer().supports(card) == (True, "")
    prog = card_program.program_for_card(card)
    inputs = card.random_inputs(0, "cpu")
    want = ref(*inputs)
    torch.testing.assert_close(interp.run(prog, inputs)[0], want, rtol=0, atol=0)
    default = generated.default(card, H200)
    for knobs in (default, {**default, "vec": 1, "threads": 64}, {**default, "items": 4, "threads": 64}):
        cand = generated.build(card, knobs, H200)
        assert compiler.compile(cand.source, arch="sm_90").cubin
        torch.testing.assert_close(cuda_on_cpu.run(card, cand, inputs)[0], want, rtol=0, atol=0,
                                   msg=lambda m: f"{knobs}: {m}")


def test_an_embedding_row_is_read_in_vectors_and_bounds_checked():
    """An LLM's embedding (bf16 rows of 2048): each thread reads 16 bytes of a picked row at a time,
    after checking the index against the table's rows, as eager's device-side assert does."""
    card = drawn(make_card(A.embedding.default, meta(32000, 2048, dtype=BF16), meta(1, 2048, dtype=I64)), 0, 31999)
    knobs = generated.default(card, H200)
    assert knobs["vec"] == 8
    src = generated.build(card, knobs, H200).source
    assert ">= 32000ULL) __trap();" in src and "kf_vec<__nv_bfloat16, V>*>(in0 + off[k][1] + g * 2048LL)" in src
    assert compiler.compile(src, arch="sm_90").cubin


def test_picked_rows_are_declined_without_a_known_index_range():
    """Fresh inputs draw indices from the range the capture recorded: with none, or one past the
    table (eager itself would fail), the card is declined, not run on indices out of bounds."""
    plain = make_card(A.embedding.default, meta(50, 16), meta(2, 7, dtype=I64))
    assert "outside the table" in card_program.program_for_card(plain)
    assert "outside the table" in card_program.program_for_card(drawn(plain, 0, 50))
    with pytest.raises(IndexError):
        card = drawn(plain, 0, 49)
        prog = card_program.program_for_card(card)
        inputs = card.random_inputs(0, "cpu")
        inputs[1][0, 0] = 50
        interp.run(prog, inputs)


class RelativePositionBias(torch.nn.Module):
    """Swin's relative position bias, `table[index]` (index.Tensor with one index), and an index
    into the last dim with the others whole (`x[:, :, idx]`)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(169, 3))
        self.register_buffer("index", torch.randint(0, 169, (49 * 49,)))
        self.register_buffer("cols", torch.tensor([4, 0, 48, 7, 7]))

    def forward(self, attn):
        bias = self.table[self.index].view(49, 49, 3).permute(2, 0, 1)
        return attn + bias, attn[:, :, self.cols]


def test_index_with_one_index_tensor_is_a_gather_and_runs_as_eager(tmp_path):
    with torch.no_grad():
        cards = capture(RelativePositionBias().eval(), (torch.randn(2, 3, 49, 49),), tmp_path, time_cards=False).cards
    picked = [c.retarget("cuda", "sm_90") for c in cards if c.op.startswith("aten::index.Tensor")]
    assert len(picked) == 2
    for card in picked:
        assert BuiltinProposer().supports(card) == (True, "")
        cand = generated.build(card, generated.default(card, H200), H200)
        assert compiler.compile(cand.source, arch="sm_90").cubin
        inputs = card.random_inputs(0, "cpu")
        (got,) = cuda_on_cpu.run(card, cand, inputs)
        torch.testing.assert_close(got, card.call_eager([t.clone() for t in inputs], "cpu")[0], rtol=0, atol=0)
