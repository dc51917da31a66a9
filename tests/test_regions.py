"""The region finder on hand-built models: exactly the expected regions, none across a
multi-use value or a graph output."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kforge import contraction, graph, regions
from norm_models import ResidualStream

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

BN = "_native_batch_norm_legit_no_training"



def sites(model: nn.Module, *inputs: torch.Tensor) -> list[regions.Site]:
    with torch.no_grad():
        t = graph.trace(model.eval(), inputs, {})
    assert len(t.graphs) == 1, t.notes
    return regions.find(t.graphs[0].module)


def found(model: nn.Module, *inputs: torch.Tensor) -> dict[str, list[list[str]]]:
    out: dict[str, list[list[str]]] = {"fused": [], "epilogue": []}  # "shared" only where there are some
    for s in sites(model, *inputs):
        out.setdefault(s.kind, []).append(s.subgraph.ops)
    return out


class BasicBlock(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + x)


def test_resnet_basic_block_bn_relu_add():
    assert found(BasicBlock(), torch.randn(2, 4, 8, 8)) == {
        "fused": [[BN, "relu"], [BN, "add", "relu"]],
        "epilogue": [["convolution", BN, "relu"], ["convolution", BN, "add", "relu"]],
    }


class GroupNormSiLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.conv = nn.GroupNorm(2, 8), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.conv(F.silu(self.norm(x)))


def test_group_norm_silu():
    assert found(GroupNormSiLU(), torch.randn(2, 8, 4, 4)) == {"fused": [["native_group_norm", "silu"]], "epilogue": []}


class AddRMSNorm(nn.Module):
    def __init__(self, d=16, keep_residual=False):
        super().__init__()
        self.weight, self.keep = nn.Parameter(torch.randn(d)), keep_residual

    def forward(self, x, y):
        h = x + y
        out = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
        return (out, h) if self.keep else out


def test_add_rms_norm_is_one_region():
    x, y = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    (site,) = sites(AddRMSNorm(), x, y)
    assert site.subgraph.ops == ["add", "pow", "mean", "add", "rsqrt", "mul", "mul"]
    assert len(site.inputs) == 3 and len(site.outputs) == 1  # x, y and the weight in; the norm out


def test_no_region_across_a_multi_use_value():
    # h is the residual too: it leaves the graph, so the norm's region starts after it.
    x, y = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    assert found(AddRMSNorm(keep_residual=True), x, y)["fused"] == [["pow", "mean", "add", "rsqrt", "mul", "mul"]]


class GatedMLP(nn.Module):
    def __init__(self, d=16, h=32):
        super().__init__()
        self.gate, self.up, self.down = (nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False),
                                         nn.Linear(h, d, bias=False))

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def test_silu_times_mul():
    got = found(GatedMLP(), torch.randn(8, 16))
    assert got["fused"] == [["silu", "mul"]]
    assert got["epilogue"] == [["mm", "silu", "mul"]]  # the gate projection and its epilogue


class Attention(nn.Module):
    def forward(self, q, k, v, mask):
        scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5) + mask
        return torch.softmax(scores, dim=-1) @ v


def test_softmax_with_scale_and_mask():
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    got = found(Attention(), q, k, v, torch.randn(8, 8))
    assert got["fused"] == [["mul", "add", "_softmax"]]
    assert got["epilogue"] == [["bmm", "mul", "add"]]


class LinearGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def test_matmul_bias_gelu_is_a_vendor_region():
    (site,) = sites(LinearGelu(), torch.randn(8, 16))
    assert site.kind == "epilogue" and site.subgraph.ops == ["addmm", "gelu"]
    # the weight's transpose is part of it: the kernel reads the weight as stored
    assert [n.target.__name__.split(".")[0] for n in site.nodes] == ["t", "addmm", "gelu"]


class OutputAndUse(nn.Module):
    def forward(self, x):
        y = torch.relu(x)
        return y, torch.exp(y * 2)


def test_one_node_is_a_region_where_it_drops_a_quarter_of_its_bytes_unused():
    """A max pool whose indices nobody reads (they are int64: two thirds of what the op writes) is
    a region of its own, returning the values only; with its indices returned it is not, and
    neither is a norm whose unused statistics are a sliver of its output."""
    (site,) = sites(nn.MaxPool2d(3, 1, 1), torch.randn(2, 3, 9, 9))
    assert site.subgraph.ops == ["max_pool2d_with_indices"] and site.outputs == [(site.nodes[0], 0)]
    (site,) = sites(nn.MaxPool1d(4, 1, 2, 3), torch.randn(2, 3, 40))  # unsqueeze, 2-D pool, squeeze
    assert site.subgraph.ops == ["max_pool2d_with_indices"] and len(site.outputs) == 1
    assert sites(nn.MaxPool2d(3, 1, 1, return_indices=True), torch.randn(2, 3, 9, 9)) == []
    assert sites(nn.LayerNorm(64), torch.randn(8, 64)) == [] and sites(nn.GroupNorm(2, 4), torch.randn(2, 4, 8, 8)) == []


def test_an_inference_batch_norm_alone_is_a_region_as_eager_runs_it_in_two_kernels():
    """CUDA's inference batch norm is two kernels (the inverse deviations, then the transform):
    alone, between two convolutions, it is a region of its own; a lone relu is not."""
    model = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1)).eval()
    (site,) = [s for s in sites(model, torch.randn(2, 4, 5, 5)) if s.kind == "fused"]
    assert site.subgraph.ops == ["_native_batch_norm_legit_no_training"] and len(site.outputs) == 1
    relu = nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 1))
    assert [s for s in sites(relu, torch.randn(2, 4, 5, 5)) if s.kind == "fused"] == []


class NormalisedCDF(nn.Module):
    def forward(self, x, mask):
        return torch.cumsum(x * mask, -1) / x.sum(-1, keepdim=True)


def test_a_scan_is_its_regions_only_fold():
    """cumsum takes its pointwise prologue and epilogue, but no sibling reduction: the generator
    folds nothing beside a scan, so the sum stays outside and the region is mul -> cumsum -> div."""
    assert found(NormalisedCDF(), torch.rand(4, 50), torch.rand(4, 50) > 0.5)["fused"] == [["mul", "cumsum", "div"]]


def test_no_region_across_a_graph_output():
    got = found(OutputAndUse(), torch.randn(4, 4))
    assert got["fused"] == [["mul", "exp"]]  # relu's value leaves the graph: the region starts after it


# ---- region cards -------------------------------------------------------------------------

def test_region_cards_dedup_and_round_trip_through_the_run_directory(tmp_path):
    from kforge.capturing import capture
    from kforge.card_files import load_cards, load_sample
    from kforge.cards import card_id

    model = nn.Sequential(BasicBlock(), BasicBlock())
    r = capture(model, torch.randn(2, 4, 8, 8), tmp_path, regions=True)
    made = {c.id: c for c in r.cards if c.region is not None}
    by_ops = {(c.region.kind, tuple(c.region.ops)): c for c in made.values()}
    assert set(by_ops) == {("fused", (BN, "relu")), ("fused", (BN, "add", "relu")),
                           ("epilogue", ("convolution", BN, "relu")), ("epilogue", ("convolution", BN, "add", "relu"))}
    bn_relu = by_ops[("fused", (BN, "relu"))]
    assert bn_relu.calls == 2 and bn_relu.module_paths == ["0", "1"]  # one card, two call sites
    assert bn_relu.family == "region" and bn_relu.op == f"region::{BN}+relu" and bn_relu.top_calls == 0
    assert bn_relu.eager_us > 0 and 0 < bn_relu.share
    assert all(n.op_card for n in bn_relu.region.nodes)  # each call is also an op card of its own

    loaded = {c.id: c for c in load_cards(tmp_path) if c.region is not None}
    assert set(loaded) == set(made)
    for cid, c in loaded.items():
        assert c.to_json() == made[cid].to_json()
        assert card_id(c.op, c.args, c.arch, c.region) == cid
        ins, outs = load_sample(c, tmp_path)
        got = c.call_eager(ins)
        assert len(got) == len(outs) and all(torch.equal(a, b) for a, b in zip(got, outs))
    code = bn_relu.region.code(bn_relu.inputs)
    assert f"aten.{BN}.default(in0, in1, in2, in3, in4, 0.1, 1e-05)" in code and "aten.relu.default(v0[0])" in code


def test_region_reference_code_runs_like_the_replay():
    (site, *_) = sites(AddRMSNorm(), torch.randn(2, 3, 16), torch.randn(2, 3, 16))
    scope: dict = {}
    exec(site.subgraph.code(site.input_metas), scope)  # noqa: S102 (our own generated text)
    ins = [torch.randn(m.shape) for m in site.input_metas]
    (want,) = site.subgraph.replay(ins)
    assert torch.equal(scope["region"](*ins), want)


def test_region_id_changes_with_structure_metadata_and_arch():
    from dataclasses import replace

    from kforge.cards import REGION_NS, ArgSpec, Card

    (site,) = sites(GroupNormSiLU(), torch.randn(2, 8, 4, 4))

    def card(sub, metas, arch="sm_90"):
        return Card(op=REGION_NS + "+".join(sub.ops), schema="", outputs=[], arch=arch, family="region",
                    args=[ArgSpec(f"in{i}", "tensor", tensor=m) for i, m in enumerate(metas)], region=sub)

    base = card(site.subgraph, site.input_metas)
    assert card(site.subgraph, site.input_metas).id == base.id
    assert card(site.subgraph, site.input_metas, "sm_100").id != base.id
    bf16 = [replace(site.input_metas[0], dtype="bfloat16")] + site.input_metas[1:]
    assert card(site.subgraph, bf16).id != base.id
    gelu = replace(site.subgraph, nodes=[site.subgraph.nodes[0], replace(site.subgraph.nodes[1], op="aten::gelu.default")])
    assert card(gelu, site.input_metas).id != base.id


def test_kforge_capture_writes_region_cards_only_with_the_flag(tmp_path):
    from kforge.card_files import load_cards
    from kforge.cli import main

    spec = tmp_path / "gated.py"
    spec.write_text("import torch\nimport torch.nn.functional as F\n\n"
                    "class M(torch.nn.Module):\n    def forward(self, a, b):\n        return F.silu(a) * b\n\n"
                    "def get_model():\n    return M()\n\n"
                    "def get_inputs():\n    return (torch.randn(8, 16), torch.randn(8, 16))\n")
    assert main(["capture", str(spec), "--run-dir", str(tmp_path / "plain"), "-q"]) == 0
    assert not any(c.region for c in load_cards(tmp_path / "plain"))  # the default path is unchanged
    assert main(["capture", str(spec), "--run-dir", str(tmp_path / "regions"), "--regions", "-q"]) == 0
    assert [c.region.ops for c in load_cards(tmp_path / "regions") if c.region] == [["silu", "mul"]]


def test_region_samples_keep_to_the_sample_budget(tmp_path):
    from kforge.capturing import capture

    r = capture(GroupNormSiLU(), torch.randn(2, 8, 4, 4), tmp_path, regions=True, time_cards=False, max_sample_bytes=0)
    (card,) = [c for c in r.cards if c.region is not None]
    assert card.samples == 0 and any("sample budget was spent" in n for n in card.notes)
    assert not list((tmp_path / "cards" / card.id).glob("sample*.safetensors"))


def test_two_convex_sites_that_would_close_a_cycle_together_keep_the_first():
    """A and B are each convex, but A writes what B reads (a_i -> b_j) and B writes what A reads
    (b_k -> a_l): one call for each would need the other's output first."""
    def f(x, y):
        a_r = x.sin()
        a_i = a_r * 2
        b_c = y.sigmoid()
        b_k = b_c * 3
        a_l = a_r + b_k
        b_j = a_i.cos()
        return a_l, b_j + b_c

    gm = torch.fx.symbolic_trace(f)
    by = {n.name: n for n in gm.graph.nodes}
    a = SimpleNamespace(nodes=[by["sin"], by["mul"], by["add"]])
    b = SimpleNamespace(nodes=[by["sigmoid"], by["mul_1"], by["cos"], by["add_1"]])
    b_head = SimpleNamespace(nodes=[by["sigmoid"], by["mul_1"]])
    assert contraction.without_cycles(gm, [a, b]) == [a]
    assert contraction.without_cycles(gm, [b, a]) == [b]
    assert contraction.without_cycles(gm, [a, b_head]) == [a, b_head]  # B's head alone closes nothing


class AttentionThenGelu(nn.Module):
    def forward(self, q, k, v):
        return F.gelu(F.scaled_dot_product_attention(q, k, v) * 2.0)


def test_a_region_reads_one_output_of_a_node_whose_others_are_not_tensors():
    """CUDA's flash attention returns its RNG seed and offset as integers beside its tensors: a
    region reading its output crashed the finder (ViT and Llama on the GPU). The output read is
    a tensor, so the region stands; a member whose own value is not tensors declines its site."""
    q = torch.randn(1, 2, 8, 16)
    with torch.no_grad():
        t = graph.trace(AttentionThenGelu().eval(), (q, q, q), {})
    gm = t.graphs[0].module
    (attn,) = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert isinstance(attn.meta["val"], (tuple, list))
    attn.meta["val"] = (*attn.meta["val"], None, 7, 8)  # as the CUDA op's value holds them
    (site,) = regions.find(gm, epilogues=False)
    assert site.subgraph.ops == ["mul", "gelu"] and site.inputs[0] == (attn, 0)
    (mul,) = [n for n in gm.graph.nodes if str(n.target).startswith("aten.mul")]
    mul.meta["val"] = None  # a member without a traced value: no site, no error
    assert regions.find(gm, epilogues=False) == []


def test_a_residual_sum_and_the_norm_it_feeds_are_a_shared_candidate():
    """The fused pass stops at a value read outside its region, so a residual sum and its norm are
    apart there (the first sum alone is no region; the later ones are the addmm's epilogues). The
    shared pass offers each sum with its norm as one candidate that writes the sum out too; never
    where the sum leaves the graph (the last one here) or where no reduction follows it."""
    x, y = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    got = found(ResidualStream(), x, y)
    assert got["fused"] == []
    assert got["shared"] == [["add", "native_layer_norm"], ["add", "native_layer_norm"]]
    shared = [s for s in sites(ResidualStream(), x, y) if s.kind == "shared"]
    for s in shared:  # the sum and the norm's output, each read after the region
        assert [n.target.__name__.split(".")[0] for n, _ in s.outputs] == ["add", "native_layer_norm"]
    assert "shared" not in found(AddRMSNorm(keep_residual=True), x, y)  # the sum is a graph output


class ViewedStream(nn.Module):
    """Swin between blocks: the residual stream, an input here, viewed as the image; the view feeds
    the next block's norm (and the permuted copy of its windows) and the residual add after it."""

    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        img = x.view(2, 4, 4, 8)
        windows = self.norm(img).view(2, 2, 2, 2, 2, 8).permute(0, 1, 3, 2, 4, 5).contiguous()
        return img + self.lin(windows).view(2, 4, 4, 8)


def test_no_region_returns_a_view_of_its_own_input():
    """The view stays a graph node that the region reads: as a region output the kernel would have
    to return an alias of its input (the generator declines that), and it is no work."""
    for s in sites(ViewedStream(), torch.randn(2, 16, 8)):
        assert all(n.target not in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
                   for n, _ in s.outputs), (s.kind, s.subgraph.ops)
    assert found(ViewedStream(), torch.randn(2, 16, 8))["fused"] == [["native_layer_norm", "clone"]]
