"""Region cards in a package: per call site the non-overlapping set that saves the most ships,
with the evidence in the manifest; the loader checks a region card's id against its subgraph."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kforge.capturing import capture
from kforge.card_files import load_cards
from kforge.castfile import MANIFEST
from kforge.package import load, write_package
from kforge.region_capture import SITES
from test_package import build_run, relu_candidate, result

BN = "_native_batch_norm_legit_no_training"


class Block(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)) + x)


@pytest.fixture
def run(tmp_path, fresh_dynamo):
    return region_run(tmp_path)


def region_run(tmp_path, epilogue_result=None):
    """A GPU-side run directory of the block's two overlapping region cards (a CPU capture
    retargeted to sm_90), each with one valid kernel."""
    captured = tmp_path / "captured"
    capture(Block().eval(), torch.randn(2, 4, 8, 8), captured, regions=True, time_cards=False)
    regions = {tuple(c.region.ops): c for c in load_cards(captured) if c.region is not None}
    fused, epilogue = regions[(BN, "add", "relu")], regions[("convolution", BN, "add", "relu")]
    gpu = {c.id: c.retarget("cuda", "sm_90") for c in (fused, epilogue)}
    run_dir = build_run(tmp_path / "run", [
        (gpu[fused.id], [(relu_candidate(128), result(eager=10.0, kernel=5.0, dispatched=6.0))], None),
        (gpu[epilogue.id], [(relu_candidate(128), epilogue_result or result(eager=20.0, kernel=17.0, dispatched=18.0))],
         None)])
    sites = json.loads((captured / SITES).read_text())["sites"]
    (run_dir / SITES).write_text(json.dumps({"sites": [dict(s, card=gpu[s["card"]].id) for s in sites if s["card"] in gpu]}))
    return run_dir, gpu[fused.id], gpu[epilogue.id]


def test_overlapping_regions_ship_the_larger_saving_with_evidence(run, tmp_path):
    run_dir, fused, epilogue = run
    path = write_package(run_dir, tmp_path / "m.cast")
    manifest = json.loads(zipfile.ZipFile(path).read(MANIFEST))
    entries = {e["id"]: e for e in manifest["cards"]}
    assert entries[fused.id]["decision"] == "dispatched"  # saves 4 µs against eager
    assert entries[epilogue.id]["decision"] == "fallback"  # would save 2 µs, and overlaps it
    assert "overlapping regions" in entries[epilogue.id]["reason"]
    assert entries[fused.id]["baseline"] == {"basis": "gpu", "eager_us": 10.0, "kernel_us": 5.0, "op_savings_us": {},
                                             "baseline_us": 10.0}
    (site,) = manifest["regions"]["sites"]
    assert {o["card"]: o["chosen"] for o in site["options"]} == {fused.id: True, epilogue.id: False}

    pkg = load(path, arch="sm_90")
    (shipped,) = [c for c in pkg.cards if c.dispatched]
    assert shipped.card.region.ops == [BN, "add", "relu"] and shipped.card.id == fused.id


def test_overlapping_regions_are_chosen_by_gpu_time_where_they_have_it(tmp_path, fresh_dynamo):
    """As dispatched, the epilogue region saves more (20 µs against 12, host time included); each
    timed alone on the GPU it saves 3 µs to the fused region's 5: the GPU times decide."""
    run_dir, fused, epilogue = region_run(tmp_path, result(eager=20.0, kernel=17.0, dispatched=12.0))
    manifest = json.loads(zipfile.ZipFile(write_package(run_dir, tmp_path / "m.cast")).read(MANIFEST))
    entries = {e["id"]: e for e in manifest["cards"]}
    assert entries[fused.id]["decision"] == "dispatched" and entries[epilogue.id]["decision"] == "fallback"
    assert entries[epilogue.id]["baseline"]["basis"] == "gpu" and entries[epilogue.id]["baseline"]["kernel_us"] == 17.0


def test_an_edited_subgraph_no_longer_hashes_to_its_id(run, tmp_path):
    from test_package import edit_manifest, rewrite

    from kforge.errors import PackageError

    run_dir, fused, _ = run
    path = write_package(run_dir, tmp_path / "m.cast")

    def relu_to_gelu(m):  # the same id over another computation
        entry = next(e for e in m["cards"] if e["id"] == fused.id)
        entry["region"]["nodes"][-1]["op"] = "aten::gelu.default"

    with pytest.raises(PackageError, match="does not hash to its id"):
        load(rewrite(path, edit_manifest(relu_to_gelu)), arch="sm_90")


def test_a_region_that_loses_the_eager_overlap_still_ships_for_compiled_graphs_where_it_beat_torch_compile(
        tmp_path, fresh_dynamo):
    """Eager dispatch picks the non-overlapping set by its savings against eager; kforge.compile's
    pass picks its own set, by each region's time against torch.compile of that region alone."""
    run_dir, fused, epilogue = region_run(tmp_path, result(eager=20.0, kernel=17.0, dispatched=18.0, compiled=30.0))
    pkg = load(write_package(run_dir, tmp_path / "m.cast"), arch="sm_90")
    by_id = {c.id: c for c in pkg.cards}
    assert not by_id[epilogue.id].dispatched and "overlapping regions" in by_id[epilogue.id].reason
    assert by_id[epilogue.id].compiled and by_id[epilogue.id].candidate is not None  # its kernel ships
    assert by_id[fused.id].dispatched and by_id[fused.id].compiled  # 5 µs against torch.compile's 8
