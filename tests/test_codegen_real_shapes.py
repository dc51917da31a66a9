"""Generated kernels at the sizes real models run them, run on the CPU (tests/cuda_on_cpu.py).

The other codegen tests use toy shapes, where every offset is small and every part of a
multi-part launch is a block or two. These are the cards of a Llama-3.2-1B layer and of
ViT-B/16 at the sizes bench/unseen_models.py runs on the GPU (fp32 here: the CPU runner takes
no bf16): the rotary region with its grouped keys repeated first (one launch of several parts,
thousands of blocks each), the embedding of a 32000-row table, and ViT's class token cat
beside the patches. Each candidate is the generator's default, compared with eager (a tiled transpose in
its flat form: its blocks run as OS threads on the CPU, too slow at this size; test_codegen_regions.py
checks the tiles at a smaller batch).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cuda_on_cpu
from norm_models import ClassTokenOfPatches
from test_codegen_regions import RotaryKeysRepeatedFirst
from kforge.capturing import capture
from kforge.hardware import H200
from kforge.proposers.builtin import BuiltinProposer, generated


class LlamaEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32000, 2048)

    def forward(self, ids):
        return self.embed(ids)


CASES = {
    # Llama-3.2-1B over 2048 tokens: 32 query heads and 8 key heads of 64, each the transposed view
    # of its projection's output
    "llama_rotary": (RotaryKeysRepeatedFirst, lambda: (torch.randn(1, 32, 2048), torch.randn(1, 2048, 32, 64).transpose(1, 2),
                                                       torch.randn(1, 2048, 8, 64).transpose(1, 2)),
                     {"region::cat+cos+sin+mul+neg+cat+mul+add+clone+mul+neg+cat+mul+add"}),
    "llama_embedding": (LlamaEmbedding, lambda: (torch.randint(0, 32000, (1, 2048)),),
                        {"aten::embedding.default", "aten::index_select.default"}),
    "vit_class_token": (lambda: ClassTokenOfPatches(768, 196), lambda: (torch.randn(32, 768, 14, 14),), {"region::cat+add", "aten::cat.default"}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_generated_kernels_at_real_model_sizes_match_eager(tmp_path, name):
    model, make_inputs, expected = CASES[name]
    with torch.no_grad():
        cards = capture(model(), make_inputs(), tmp_path, regions=True, time_cards=False, max_sample_bytes=0).cards
    checked = set()
    for card in cards:
        card = card.retarget("cuda", "sm_90")
        name_of = card.op.split("(")[0]
        if name_of not in expected:
            continue
        assert BuiltinProposer().supports(card) == (True, ""), name_of
        knobs = generated.default(card, H200)
        if knobs["algo"] == "gen_tile":  # its blocks run as OS threads here: checked at a smaller batch
            knobs["algo"] = "gen_flat"  # (test_codegen_regions.py), its flat parts at this size
        cand = generated.build(card, knobs, H200)
        inputs = card.random_inputs(0, "cpu")
        clones = [t.clone() for t in inputs]
        want = card.region.replay(clones) if card.region is not None else card.call_eager(clones, "cpu")
        for got, w in zip(cuda_on_cpu.run(card, cand, inputs), want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name_of}: {m}")
        checked.add(name_of)
    assert checked == expected
