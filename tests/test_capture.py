"""Capture on the CPU: real tiny models, real dispatch overrides, real samples on disk."""

from __future__ import annotations

import dataclasses

import json
import tempfile

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

from kforge.capturing import CaptureResult, capture
from kforge.cardtable import SEARCHABLE, cards_table, skip_reason
from kforge.shares import shares_by_family
from kforge.card_files import load_cards, load_sample
from kforge.cards import FAMILIES
from kforge.errors import CaptureError
from kforge.families import family_of


def by_op(result: CaptureResult, op: str) -> list:
    return [c for c in result.cards if c.op == op]


def one(result: CaptureResult, op: str):
    found = by_op(result, op)
    assert len(found) == 1, f"{op}: {len(found)} cards ({[c.summary() for c in found]})"
    return found[0]


def is_nested(card) -> bool:
    return any("run inside" in n for n in card.notes)


# ---- tiny models ------------------------------------------------------------------------

class ConvNet(nn.Module):
    """conv + bn + relu_ twice with an in-place residual add_."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn1(self.conv1(x)).relu_()
        y = self.bn2(self.conv2(y))
        y.add_(x)
        return y.relu_()


class Block(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class GroupNormSiLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(4, 8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.conv(F.silu(self.norm(x)))


class Router(nn.Module):
    def __init__(self, d=16, experts=8, k=2):
        super().__init__()
        self.gate, self.k = nn.Linear(d, experts, bias=False), k

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.k, dim=-1)
        return weights / weights.sum(-1, keepdim=True), experts


# ---- what the cards say -----------------------------------------------------------------

def test_conv_net_cards_inplace_and_aliases(tmp_path):
    x = torch.randn(2, 4, 8, 8)
    r = capture(ConvNet(), x, tmp_path, time_cards=False)

    conv = one(r, "aten::convolution.default")
    assert conv.calls == 2 and conv.family == "vendor"
    assert conv.module_paths == ["conv1", "conv2"]
    assert conv.inputs[0].shape == (2, 4, 8, 8) and conv.inputs[0].stride == x.stride()
    assert conv.inputs[1].shape == (4, 4, 3, 3)

    bn = [c for c in r.cards if c.family == "normalization"]
    assert bn and all("batch_norm" in c.op for c in bn) and sum(c.calls for c in bn) == 2

    relu = one(r, "aten::relu_.default")
    assert relu.calls == 2 and relu.module_paths == ["(root)"]
    assert relu.args[0].written and relu.written_inputs == {0}
    assert relu.aliases == {0: 0} and relu.outputs[0].shape == (2, 4, 8, 8)

    add = one(r, "aten::add_.Tensor")
    assert [a.written for a in add.args] == [True, False, False]
    assert add.aliases == {0: 0}
    assert add.args[2].kind == "value" and add.args[2].value == 1  # alpha, a default the caller left out


def test_transformer_block_counts_shapes_and_module_paths(tmp_path):
    x = torch.randn(2, 5, 16)
    r = capture(Transformer(), x, tmp_path, time_cards=False)

    ln = one(r, "aten::native_layer_norm.default")
    assert ln.calls == 4 and ln.family == "normalization"
    assert ln.module_paths == ["layers.0.norm1", "layers.0.norm2", "layers.1.norm1", "layers.1.norm2"]
    assert ln.inputs[0].shape == (2, 5, 16)

    sm = one(r, "aten::_softmax.default")
    assert sm.calls == 2 and sm.inputs[0].shape == (2, 2, 5, 5) and sm.args[1].value == -1

    gelu = one(r, "aten::gelu.default")
    assert gelu.calls == 2 and gelu.family == "pointwise" and gelu.inputs[0].shape == (2, 5, 32)
    assert {c.family for c in by_op(r, "aten::bmm.default")} == {"vendor"}
    assert sum(c.calls for c in by_op(r, "aten::bmm.default")) == 4  # q @ k and att @ v, twice


def test_group_norm_silu(tmp_path):
    r = capture(GroupNormSiLU(), torch.randn(1, 8, 6, 6), tmp_path, time_cards=False)
    gn = one(r, "aten::native_group_norm.default")
    assert gn.family == "normalization" and gn.module_paths == ["norm"]
    assert [a.value for a in gn.args if a.kind == "value"][:4] == [1, 8, 36, 4]  # N, C, HxW, groups
    silu = one(r, "aten::silu.default")
    assert silu.family == "pointwise" and silu.inputs[0].shape == (1, 8, 6, 6) and silu.module_paths == ["(root)"]


def test_moe_router(tmp_path):
    r = capture(Router(), torch.randn(10, 16), tmp_path, time_cards=False)
    sm = one(r, "aten::_softmax.default")
    assert sm.inputs[0].shape == (10, 8) and sm.outputs[0].dtype == "float32"
    topk = one(r, "aten::topk.default")
    assert topk.family == "reduction"
    assert [m.shape for m in topk.outputs] == [(10, 2), (10, 2)]
    assert [m.dtype for m in topk.outputs] == ["float32", "int64"]
    assert one(r, "aten::mm.default").module_paths == ["gate"]


def test_channels_last_strides_recorded(tmp_path):
    x = torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last)
    r = capture(GroupNormSiLU(), x, tmp_path, time_cards=False)
    gn = one(r, "aten::native_group_norm.default")
    assert gn.inputs[0].stride == (288, 1, 48, 8)
    assert not gn.inputs[0].is_contiguous()


def test_non_contiguous_slice_keeps_stride_offset_and_alignment(tmp_path):
    class Slice(nn.Module):
        def forward(self, x):
            return x[:, 1::2] * 2.0

    r = capture(Slice(), torch.randn(4, 8), tmp_path, time_cards=False)
    mul = one(r, "aten::mul.Tensor")
    m = mul.inputs[0]
    assert (m.shape, m.stride, m.storage_offset, m.align) == ((4, 4), (8, 2), 1, 4)
    ins, outs = load_sample(mul, tmp_path)
    assert ins[0].stride() == (8, 2) and ins[0].data_ptr() % 16 == 4


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_tuple_and_dict_outputs_and_inputs(tmp_path, kind):
    class Two(nn.Module):
        def forward(self, a, b):
            return (a.exp(), b.tanh()) if kind == "tuple" else {"e": a.exp(), "t": b.tanh()}

    inputs = (torch.randn(3), torch.randn(4)) if kind == "tuple" else {"a": torch.randn(3), "b": torch.randn(4)}
    r = capture(Two(), inputs, tmp_path, time_cards=False)
    assert one(r, "aten::exp.default").inputs[0].shape == (3,)
    assert one(r, "aten::tanh.default").inputs[0].shape == (4,)


# ---- samples --------------------------------------------------------------------------------

@pytest.mark.parametrize("model,x", [(ConvNet(), torch.randn(2, 4, 8, 8)), (Transformer(), torch.randn(2, 5, 16))])
def test_stored_samples_replay_to_stored_outputs(tmp_path, model, x):
    r = capture(model, x, tmp_path, time_cards=False)
    replayed = 0
    for card in load_cards(tmp_path):
        if not card.samples or card.op.startswith("aten::empty"):  # uninitialised memory has no reference
            continue
        ins, ref = load_sample(card, tmp_path)
        assert [t.stride() for t in ins] == [m.stride for m in card.inputs]
        got = card.call_eager(ins)
        assert len(got) == len(ref), card.op
        for g, e in zip(got, ref):
            torch.testing.assert_close(g, e, msg=lambda m: f"{card.summary()}: {m}")
        replayed += 1
    assert replayed >= 4, [c.op for c in r.cards]


def test_inplace_sample_inputs_are_taken_before_the_call(tmp_path):
    r = capture(ConvNet(), torch.randn(2, 4, 8, 8), tmp_path, time_cards=False)
    relu = one(r, "aten::relu_.default")
    (before,), (after,) = load_sample(relu, tmp_path)
    assert (before < 0).any() and (after >= 0).all()
    torch.testing.assert_close(after, before.clamp_min(0))


def test_sample_count_and_byte_budget(tmp_path):
    r = capture(Transformer(), torch.randn(2, 5, 16), tmp_path / "a", time_cards=False, max_samples_per_card=3)
    ln = one(r, "aten::native_layer_norm.default")
    assert ln.samples == 3
    assert sorted(p.name for p in (tmp_path / "a" / "cards" / ln.id).glob("sample*")) == [
        "sample0.safetensors", "sample1.safetensors", "sample2.safetensors"]

    r = capture(Transformer(), torch.randn(2, 5, 16), tmp_path / "b", time_cards=False, max_sample_bytes=4096)
    stored = sum(c.samples for c in r.cards)
    assert 0 < stored < sum(1 for c in r.cards if c.family != "view")
    assert any("sample budget" in n for n in r.notes)
    assert any("budget was spent" in n for c in r.cards for n in c.notes)


# ---- timing, shares, files ------------------------------------------------------------------

def test_timing_shares_and_files(tmp_path):
    (tmp_path / "cards" / "stale").mkdir(parents=True)
    (tmp_path / "cards" / "stale" / "card.json").write_text("{}")
    r = capture(GroupNormSiLU(), torch.randn(1, 8, 6, 6), tmp_path)
    assert r.model_us > 0 and r.total_us > 0 and r.coverage > 0
    assert all(c.eager_us is not None and c.eager_us > 0 for c in r.cards)
    assert all(c.total_us == pytest.approx(c.eager_us * c.calls) for c in r.cards)
    assert [c.share for c in r.cards] == sorted((c.share for c in r.cards), reverse=True)
    assert sum(c.share for c in r.cards if not is_nested(c)) == pytest.approx(1.0)
    assert sum(c.total_us for c in r.cards if not is_nested(c)) == pytest.approx(r.total_us)
    by_family = shares_by_family(load_cards(tmp_path))  # from the stored cards: top_calls round-trips
    assert sum(by_family.values()) == pytest.approx(1.0) and set(by_family) == {c.family for c in r.cards}

    assert sorted(c.id for c in load_cards(tmp_path)) == sorted(c.id for c in r.cards)  # stale card removed
    summary = json.loads((tmp_path / "capture.json").read_text())
    assert summary["cards"] == [c.id for c in r.cards] and summary["model_us"] == r.model_us


def test_nested_calls_are_cards_too(tmp_path):
    class Clone(nn.Module):
        def forward(self, x):
            return x.t().clone()

    r = capture(Clone(), torch.randn(3, 4), tmp_path, time_cards=False)
    copy = one(r, "aten::copy_.default")  # clone's kernel calls empty_strided + copy_
    assert is_nested(copy) and copy.args[0].written and copy.inputs[1].stride == (1, 4)
    assert (copy.calls, copy.top_calls) == (1, 0)
    assert not is_nested(one(r, "aten::clone.default")) and one(r, "aten::clone.default").top_calls == 1


def test_calls_with_unrecordable_arguments_are_counted_in_the_notes(tmp_path):
    class SetStorage(nn.Module):
        def forward(self, x):
            y = torch.empty(0).set_(x.untyped_storage(), 0, (4,), (1,))
            return y * 2.0

    r = capture(SetStorage(), torch.randn(64), tmp_path, time_cards=False)
    (note,) = [n for n in r.notes if "not recorded" in n]
    assert note.startswith("aten::set_.source_Storage_storage_offset: 1 call(s) not recorded (") and len(note) < 200
    assert one(r, "aten::mul.Tensor").inputs[0].shape == (4,)


# ---- the dispatch table and the model are left as they were --------------------------------

def dispatch_state(ops):
    """The dispatch table entries of `ops` and the Python aten overrides torch knows of.

    (Other namespaces' registrations come and go as torch imports its own modules lazily.)"""
    return {op: torch._C._dispatch_dump(op) for op in ops}, {k for k in torch.library._impls if k.startswith("aten/")}


OPS = ["aten::relu_", "aten::add_.Tensor", "aten::convolution", "aten::native_batch_norm", "aten::copy_",
       "aten::empty.memory_format", "aten::addmm"]


def test_overrides_removed_after_success(tmp_path):
    before = dispatch_state(OPS)
    capture(ConvNet(), torch.randn(1, 4, 5, 5), tmp_path, time_cards=False)
    assert dispatch_state(OPS) == before
    x = torch.tensor([-1.0, 2.0])
    assert torch.relu_(x).tolist() == [0.0, 2.0]


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(5, 8)))

    def forward(self, x):
        return self.blocks(x)


def test_model_error_names_module_and_op_and_restores_dispatch(tmp_path):
    before = dispatch_state(OPS)
    with pytest.raises(CaptureError) as info:
        capture(Broken(), torch.randn(3, 8), tmp_path)
    msg = str(info.value)
    assert "module 'blocks.1.1' (Linear)" in msg and "aten::addmm.default" in msg, msg
    assert isinstance(info.value.__cause__, RuntimeError)
    assert dispatch_state(OPS) == before


def test_failed_capture_leaves_no_temporary_run_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(CaptureError):
        capture(Broken(), torch.randn(3, 8))
    assert not list(tmp_path.glob("kforge-capture-*"))


def test_error_while_overrides_are_installed_restores_dispatch(tmp_path):
    class FailsLater(nn.Module):
        """Runs once (op discovery), then fails inside addmm while capture's overrides are active."""

        def __init__(self):
            super().__init__()
            self.good, self.bad, self.runs = nn.Linear(8, 8), nn.Linear(5, 8), 0

        def forward(self, x):
            self.runs += 1
            return (self.good if self.runs == 1 else self.bad)(x.relu_())

    before = dispatch_state(OPS)
    model = FailsLater()
    with pytest.raises(CaptureError, match=r"module 'bad' \(Linear\) while running aten::addmm.default"):
        capture(model, torch.randn(3, 8), tmp_path)
    assert model.runs == 2
    assert dispatch_state(OPS) == before


def test_python_error_outside_ops_names_the_module(tmp_path):
    class Raises(nn.Module):
        def forward(self, x):
            raise ValueError("bad routing table")

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Raises()

        def forward(self, x):
            return self.inner(x.exp())

    with pytest.raises(CaptureError, match=r"ValueError in module 'inner' \(Raises\) \(outside any aten op\)"):
        capture(Outer(), torch.randn(2), tmp_path)


def test_training_flags_restored(tmp_path):
    model = ConvNet().train()
    model.bn2.eval()
    capture(model, torch.randn(1, 4, 5, 5), tmp_path, time_cards=False)
    assert model.training and model.bn1.training and not model.bn2.training


@pytest.mark.parametrize("inputs,match", [
    ([1, 2], r"tuple/list of tensors .* got list of \(int, int\)"),
    ({"x": 3.0}, r"dict of tensors .* got dict of \('x': float\)"),
    ("image.png", "got str"),
])
def test_bad_inputs_say_what_to_pass(tmp_path, inputs, match):
    with pytest.raises(CaptureError, match=match):
        capture(ConvNet(), inputs, tmp_path)


def test_inputs_on_another_device_than_the_model(tmp_path):
    with pytest.raises(CaptureError, match=r"input 0 is on meta but the model's parameters are on cpu.*device="):
        capture(ConvNet(), torch.empty(1, 4, 5, 5, device="meta"), tmp_path)


# ---- families, skip reasons, table -----------------------------------------------------------

@pytest.mark.parametrize("op,family", [
    (torch.ops.aten.add.Tensor, "pointwise"), (torch.ops.aten.relu_.default, "pointwise"),
    (torch.ops.aten.copy_.default, "pointwise"), (torch.ops.aten.sum.dim_IntList, "reduction"),
    (torch.ops.aten.topk.default, "reduction"), (torch.ops.aten.native_group_norm.default, "normalization"),
    (torch.ops.aten._softmax.default, "normalization"), (torch.ops.aten.max_pool2d_with_indices.default, "pooling"),
    (torch.ops.aten._adaptive_avg_pool2d.default, "pooling"), (torch.ops.aten.addmm.default, "vendor"),
    (torch.ops.aten.convolution.default, "vendor"), ("aten::cudnn_convolution.default", "vendor"),
    ("aten::_scaled_dot_product_flash_attention.default", "vendor"), (torch.ops.aten.view.default, "view"),
    (torch.ops.aten.permute.default, "view"), (torch.ops.aten._unsafe_view.default, "view"),
    (torch.ops.aten.empty_strided.default, "view"), (torch.ops.aten.index.Tensor, "other"),
    (torch.ops.aten.cat.default, "other"), ("aten::not_an_op.default", "other"),
])
def test_family_of(op, family):
    assert family_of(op) == family and family in FAMILIES


def test_skip_reasons_and_table(tmp_path):
    r = capture(GroupNormSiLU(), torch.randn(1, 8, 6, 6), tmp_path)
    gn, conv = one(r, "aten::native_group_norm.default"), one(r, "aten::convolution.default")
    assert gn.family in SEARCHABLE and skip_reason(gn) is None
    assert "vendor-backed" in skip_reason(conv)
    assert all(skip_reason(c) for c in r.cards if c.family == "view")
    # No family but views and vendor ops is skipped wholesale: proposers decide (cumsum, cat, ...).
    other = dataclasses.replace(gn, op="aten::cumsum.default", family="other", id="")
    assert skip_reason(other) is None

    console = Console(record=True, width=250)
    console.print(cards_table(r.cards, limit=3))
    text = console.export_text()
    assert r.cards[0].summary() in text and "3 of" not in text
    assert f"{len(r.cards) - 3} more cards not shown" in text
    assert sum(line.startswith("│") for line in text.splitlines()) == 3


class MeanAbs(torch.nn.Module):
    def forward(self, x):
        return x / torch.mean(torch.abs(x), dim=1, keepdim=True)


def test_a_call_that_resizes_the_tensor_it_writes_is_not_searched(tmp_path):
    # abs(x) runs as abs.out into an empty tensor the op resizes: a kernel handed that empty
    # tensor wrote past its end (an illegal address on the GPU). Writes into tensors of the
    # output's size stay searchable: abs.default, and in-place ops.
    r = capture(MeanAbs(), torch.randn(8, 1023), tmp_path, time_cards=False)
    resized = one(r, "aten::abs.out")
    assert "resizes the tensor it writes (0 before, 8x1023 after)" in skip_reason(resized)
    assert skip_reason(one(r, "aten::abs.default")) is None
    assert skip_reason(one(r, "aten::div_.Tensor")) is None


def test_the_table_marks_cards_whose_calls_all_run_inside_another_card(tmp_path):
    # On the CPU a cast is _to_copy -> empty_strided + copy_: those two are nested in it.
    r = capture(CastsAndNorms(), torch.randn(8, 32, dtype=torch.bfloat16), tmp_path, time_cards=False)
    console = Console(record=True, width=300)
    console.print(cards_table(r.cards))
    text = console.export_text()
    rows = {line.split("│")[2].strip(): line.split("│")[7].strip() for line in text.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()}
    assert rows["empty_strided.default()"].endswith("; inside _to_copy.default")
    assert not any("inside" in status for op, status in rows.items() if op.startswith("addmm"))
    assert "its share is also in that card's share" in text


class ScalarArith(nn.Module):
    """Python scalars in Tensor slots (wrapped numbers) at the backend key."""

    def forward(self, x, i):
        return (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt() * x, i + 2, i * 0.5


def test_python_scalars_in_tensor_slots_are_captured_and_replay(tmp_path):
    x, i = torch.randn(3, 8, dtype=torch.bfloat16), torch.arange(6, dtype=torch.int32)
    want = ScalarArith()(x, i)
    res = capture(ScalarArith(), (x, i), tmp_path / "run")
    got = ScalarArith()(x, i)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))
    assert any(c.op == "aten::add.Tensor" for c in res.cards)


def test_vendor_calls_keep_no_sample_and_a_big_call_does_not_starve_later_ones(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x, small):
            return self.lin(x).relu(), small.exp()

    x, small = torch.randn(512, 64), torch.randn(8)
    # Room for the small exp sample, not for the 512x64 relu one that runs first.
    r = capture(Net(), (x, small), tmp_path, time_cards=False, max_sample_bytes=4096)
    assert all(c.samples == 0 for c in r.cards if c.family == "vendor")
    assert any("vendor op" in n for c in r.cards if c.family == "vendor" for n in c.notes)
    assert one(r, "aten::relu.default").samples == 0
    assert one(r, "aten::exp.default").samples == 1


# ---- composite ops captured whole (kforge.composite) ----------------------------------------

class ScoresSoftmax(nn.Module):
    """Attention-style softmax: bf16 scores, softmax in fp32 (dtype=), back to bf16; then a
    plain softmax and a log_softmax with dtype=."""

    def forward(self, x):
        p = F.softmax(x, dim=-1, dtype=torch.float32).to(x.dtype)
        return p + torch.softmax(x, -1), F.log_softmax(x, dim=-1, dtype=torch.float32)


def test_softmax_with_dtype_is_one_card_over_its_cast_and_softmax(tmp_path):
    before = dispatch_state(["aten::softmax.int", "aten::log_softmax.int"])
    x = torch.randn(6, 40, dtype=torch.bfloat16)
    r = capture(ScoresSoftmax(), x, tmp_path)
    sm = one(r, "aten::softmax.int")
    assert sm.family == "normalization" and sm.top_calls == 1 and not is_nested(sm)
    assert sm.inputs[0].dtype == "bfloat16" and sm.outputs[0].dtype == "float32"
    assert sm.samples == 1 and sm.share > 0
    # Its parts are nested in it; the plain softmax (no dtype=) is only its _softmax.
    parts = [c for c in r.cards if any("softmax.int" in n for n in c.notes)]
    assert {c.op for c in parts} >= {"aten::_to_copy.default", "aten::_softmax.default"}
    plain = [c for c in by_op(r, "aten::_softmax.default") if not is_nested(c)]
    assert len(plain) == 1 and plain[0].inputs[0].dtype == "bfloat16"
    assert one(r, "aten::log_softmax.int").outputs[0].dtype == "float32"
    # The stored sample replays to the stored output through the op itself.
    (ins, outs) = load_sample(sm, tmp_path, 0)
    torch.testing.assert_close(torch.ops.aten.softmax.int(ins[0], -1, torch.float32), outs[0])
    assert dispatch_state(["aten::softmax.int", "aten::log_softmax.int"]) == before



def test_capture_with_grad_on_records_the_model_and_keeps_autograd(tmp_path):
    # Under grad mode, detach's kernel re-enters detach (through the Python key): the
    # re-entered call is part of the outer one, not a new recording (it used to recurse).
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    x = torch.randn(4, 16, requires_grad=True)
    r = capture(m, x, tmp_path, no_grad=False, time_cards=False)
    assert one(r, "aten::addmm.default").calls == 1 and one(r, "aten::relu.default").calls == 1
    y = m(x)  # after capture, the backward is recorded as ever
    y.sum().backward()
    assert x.grad is not None and m[0].weight.grad is not None


def test_softmax_with_dtype_is_recorded_with_grad_on(tmp_path):
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    r = capture(ScoresSoftmax(), x, tmp_path, no_grad=False, time_cards=False)
    assert one(r, "aten::softmax.int").calls == 1


def test_softmax_with_dtype_under_inference_mode_records_its_parts(tmp_path):
    # Under inference_mode the composite reaches the dispatch mode whole: the mode decomposes
    # it with itself on, so its cast and its softmax are seen inside it.
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        r = capture(ScoresSoftmax(), x, tmp_path, time_cards=False)
    assert one(r, "aten::softmax.int").calls == 1
    parts = {c.summary() for c in r.cards if any("inside aten::softmax.int" in n for n in c.notes)}
    assert {"_softmax.default(4x16:float32)", "_to_copy.default(4x16:bfloat16)"} <= parts


class CastsAndNorms(nn.Module):
    """What reaches the backend through composite ops: casts (to.dtype -> _to_copy), layer_norm
    (-> native_layer_norm), linear (-> addmm), softmax (-> _softmax), gelu."""

    def __init__(self):
        super().__init__()
        self.ln, self.lin = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x):
        h = self.lin(self.ln(x.float()))
        return torch.softmax(h, -1).to(torch.bfloat16) + F.gelu(h).half().to(torch.bfloat16)


class PythonDecomposed(nn.Module):
    """Composite ops for which torch also registers a Python decomposition that makes other
    calls than eager's C++ kernel: eval dropout (eager: none), matmul with out=, one_hot."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x, idx):
        out = torch.empty(4, 4)
        torch.matmul(x, x.t(), out=out)
        return self.drop(x).relu(), out, F.one_hot(idx, 5)


def test_capture_under_inference_mode_runs_eagers_decompositions_not_pythons(tmp_path):
    m, x, idx = PythonDecomposed().eval(), torch.randn(4, 4), torch.tensor([0, 3, 4])
    with torch.no_grad():
        ref = capture(m, (x, idx), tmp_path / "no_grad", time_cards=False)
    with torch.inference_mode():
        got = capture(m, (x, idx), tmp_path / "inference", time_cards=False)
    assert sorted((c.summary(), c.calls) for c in got.cards) == sorted((c.summary(), c.calls) for c in ref.cards)
    ops = {c.op for c in got.cards}
    assert "aten::mm.out" in ops and "aten::clone.default" not in ops  # eval dropout is the input itself


def test_capture_under_inference_mode_finds_what_no_grad_finds(tmp_path):
    # Under inference_mode no autograd key decomposes composite ops before the dispatch mode:
    # capture used to see only to.dtype, layer_norm and linear whole, and record none of the
    # backend calls they make (_to_copy, native_layer_norm, addmm).
    torch.manual_seed(0)
    m, x = CastsAndNorms(), torch.randn(8, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = capture(m, x, tmp_path / "no_grad", time_cards=False)
    with torch.inference_mode():
        got = capture(m, x, tmp_path / "inference", time_cards=False)

    def calls(r):
        return sorted((c.summary(), c.calls) for c in r.cards)

    assert calls(got) == calls(ref)
    ops = {c.op for c in got.cards}
    assert {"aten::_to_copy.default", "aten::native_layer_norm.default", "aten::addmm.default",
            "aten::_softmax.default", "aten::gelu.default"} <= ops
    casts = [c for c in got.cards if c.op == "aten::_to_copy.default"]
    assert len(casts) == 4  # bf16 -> fp32, fp32 -> bf16, fp32 -> fp16, fp16 -> bf16


def test_a_run_dir_holding_a_search_log_or_a_file_is_refused_before_the_model_runs(tmp_path):
    runs = []

    class Counting(nn.Module):
        def forward(self, x):
            runs.append(1)
            return x.relu()

    searched = tmp_path / "searched"
    searched.mkdir()
    (searched / "search.sqlite").write_bytes(b"")
    with pytest.raises(CaptureError, match=r"already holds the search log .*kforge run --resume --run-dir"):
        capture(Counting(), torch.randn(4), searched)
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    with pytest.raises(CaptureError, match="is a file: give a directory"):
        capture(Counting(), torch.randn(4), a_file)
    assert not runs and list(searched.iterdir()) == [searched / "search.sqlite"]
    # A directory of cards without a search log is captured again (its cards replaced).
    r = capture(Counting(), torch.randn(4), tmp_path / "cards_only", time_cards=False)
    capture(Counting(), torch.randn(4), r.run_dir, time_cards=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_capture_on_cuda_without_a_gpu_says_so(tmp_path):
    with pytest.raises(CaptureError, match="torch sees no CUDA GPU here"):
        capture(nn.ReLU(), torch.randn(4), tmp_path / "r", device="cuda")


def test_kforge_capture_stays_the_function_after_the_capture_modules_are_imported(tmp_path):
    import kforge
    lazy = kforge.capture  # before or after the capture modules' import: the same function
    import kforge.capturing
    import kforge.cardtable
    import kforge.op_capture  # noqa: F401

    assert kforge.capture is lazy is kforge.capturing.capture
    r = kforge.capture(nn.ReLU(), torch.randn(4), tmp_path / "r", time_cards=False)
    assert isinstance(r, CaptureResult) and one(r, "aten::relu.default").calls == 1


class ScalarFirst(torch.nn.Module):
    """Composite ops whose parts take a scalar as a tensor: `idx % 49` (remainder.Scalar ->
    remainder.Tensor) and `2 ** x` (pow.Scalar -> pow.Tensor_Tensor_out)."""

    def forward(self, idx, x):
        return idx % 49, torch.pow(2, x)


def test_a_composites_scalar_handed_on_as_a_tensor_is_captured(tmp_path):
    # The composite is decomposed with the capture's mode on; its part's wrapped number reached the
    # mode as a plain int, which the part's schema refused: the model failed under capture alone.
    idx, x = torch.randint(0, 169, (6,)), torch.randn(6)
    with torch.inference_mode():
        r = capture(ScalarFirst(), (idx, x), tmp_path, time_cards=False)
    assert one(r, "aten::remainder.Tensor").call_eager([idx, torch.tensor(49)])[0].equal(idx % 49)
    assert by_op(r, "aten::pow.Scalar")
