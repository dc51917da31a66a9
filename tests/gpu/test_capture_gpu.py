"""Capture on the GPU: overrides at the CUDA key, bf16 cards with the device's arch, samples replayed on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kforge.capturing import capture
from kforge.card_files import load_cards, load_sample
from kforge.modelspec import load_model_spec

pytestmark = pytest.mark.gpu  # tests/conftest.py skips these, with the reason, where there is no GPU

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(8, 32)
        self.conv = nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x):
        y = self.conv(F.silu(self.norm(x)))
        return torch.softmax(y.flatten(2), dim=-1).add_(1.0)


def arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def test_cuda_cards_replay_and_dispatch_is_restored(tmp_path):
    ops = ["aten::native_group_norm", "aten::silu", "aten::_softmax", "aten::add_.Tensor", "aten::copy_"]
    before = {op: torch._C._dispatch_dump(op) for op in ops}
    model = Net().cuda().to(torch.bfloat16)
    x = torch.randn(2, 32, 16, 16, device="cuda", dtype=torch.bfloat16)
    r = capture(model, x, tmp_path, time_cards=False)

    assert {op: torch._C._dispatch_dump(op) for op in ops} == before
    names = {c.op for c in r.cards}
    assert {"aten::native_group_norm.default", "aten::silu.default", "aten::_softmax.default"} <= names
    assert all(c.arch == arch() and c.device_type == "cuda" for c in r.cards if c.inputs)
    gn = next(c for c in r.cards if c.op == "aten::native_group_norm.default")
    assert gn.inputs[0].dtype == "bfloat16" and gn.inputs[0].shape == (2, 32, 16, 16)
    add = next(c for c in r.cards if c.op == "aten::add_.Tensor")
    assert add.aliases == {0: 0} and add.args[0].written

    replayed = 0
    for card in load_cards(tmp_path):
        if card.samples and not card.op.startswith("aten::empty") and card.family != "vendor":
            ins, ref = load_sample(card, tmp_path, device="cuda")
            for got, want in zip(card.call_eager(ins), ref):
                torch.testing.assert_close(got, want, msg=lambda m: f"{card.summary()}: {m}")
            replayed += 1
    assert replayed >= 3


def test_cuda_timing(tmp_path):
    pytest.importorskip("kforge.timing", reason="kforge.timing is not built yet")
    model = Net().cuda()
    r = capture(model, torch.randn(2, 32, 16, 16, device="cuda"), tmp_path)
    assert r.model_us > 0 and r.total_us > 0
    assert all(c.eager_us is not None and c.eager_us > 0 for c in r.cards), [c.notes for c in r.cards]


@pytest.mark.parametrize("name,ops", [
    ("sd_vae_decoder", {"aten::native_group_norm.default", "aten::silu.default"}),
    ("gemma_decoder", {"aten::_softmax.default", "aten::gelu.default"}),
    ("qwen_moe", {"aten::_softmax.default", "aten::topk.default"}),
])
def test_examples_full_size(tmp_path, name, ops):
    model, inputs = load_model_spec(str(EXAMPLES / f"{name}.py"))
    r = capture(model, inputs, tmp_path, time_cards=False)
    assert ops <= {c.op for c in r.cards}
    assert any(m.dtype == "bfloat16" for c in r.cards for m in c.inputs)


def test_gemma_under_inference_mode_captures_what_no_grad_captures(tmp_path):
    # Composite ops reach the dispatch mode whole under inference_mode; capture decomposes
    # them so the backend's calls (the casts, the softmax with dtype=) are recorded on CUDA too.
    model, inputs = load_model_spec(str(EXAMPLES / "gemma_decoder.py"))
    with torch.no_grad():
        ref = capture(model, inputs, tmp_path / "no_grad", time_cards=False)
    with torch.inference_mode():
        got = capture(model, inputs, tmp_path / "inference", time_cards=False)
    searchable = {"aten::_to_copy.default", "aten::softmax.int", "aten::gelu.default", "aten::mul.Tensor"}

    def calls(r):
        return sorted((c.summary(), c.calls) for c in r.cards if c.op in searchable)

    assert calls(got) == calls(ref)
    assert {"aten::_to_copy.default", "aten::softmax.int"} <= {c.op for c in got.cards}


def test_fresh_inputs_are_drawn_on_the_gpu_with_the_cards_metadata(tmp_path):
    x = torch.randn(2, 32, 8, 8, device="cuda", dtype=torch.bfloat16)
    cards = capture(Net().cuda().to(torch.bfloat16), x, tmp_path, time_cards=False).cards
    card = next(c for c in cards if c.op == "aten::native_group_norm.default")
    a, b, other = card.random_inputs(3, "cuda"), card.random_inputs(3, "cuda"), card.random_inputs(4, "cuda")
    for t, m in zip(a, card.inputs):
        assert t.is_cuda and t.dtype == m.torch_dtype and tuple(t.shape) == tuple(m.shape)
        assert tuple(t.stride()) == tuple(m.stride) and torch.isfinite(t.float()).all()
    assert all(torch.equal(s, t) for s, t in zip(a, b))  # one seed, one set
    assert not torch.equal(a[0], other[0])
    assert a[0].float().std() > 0.5  # drawn like the samples: normal values, not a constant
