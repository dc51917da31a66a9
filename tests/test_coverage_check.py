"""bench/coverage_models.py --check on a card of its own: each template's default for a taken card
is built, compiled by NVRTC for sm_90 and (generated ones) run on the CPU against eager; a failure
at any step is reported with its stage, card and knobs, not raised."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import coverage_models  # noqa: E402
from kforge.capturing import capture  # noqa: E402
from kforge.proposers.builtin import generated  # noqa: E402


def squeeze_excite_cards(tmp_path):
    model = nn.Sequential(nn.Conv2d(4, 8, 1), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 4, 1)).eval()
    with torch.no_grad():
        cards = capture(model, (torch.randn(2, 4, 5, 7),), tmp_path, regions=True, time_cards=False, max_sample_bytes=0).cards
    return [c.retarget("cuda", "sm_90") for c in cards if c.region is not None and c.region.kind == "fused"]


def test_a_taken_region_builds_compiles_and_runs_equal_to_eager(tmp_path):
    (card,) = squeeze_excite_cards(tmp_path)
    counts = collections.Counter()
    assert coverage_models.check(card, coverage_models._cpu_runner(), counts) == []
    assert counts["compiled"] >= 1 and counts["ran on the CPU, equal to eager"] >= 1


def test_a_wrong_kernel_is_reported_with_its_stage(tmp_path, monkeypatch):
    (card,) = squeeze_excite_cards(tmp_path)
    one_off = lambda card, cand, inputs: [o + 1 for o in card.region.replay(inputs)]  # noqa: E731
    (failure,) = coverage_models.check(card, one_off, collections.Counter())
    assert failure["stage"] == "wrong" and failure["template"] == "generated" and "silu" in failure["what"]

    class Unbuildable:
        name = "generated"
        default = staticmethod(generated.TEMPLATE.default)

        def build(self, card, knobs, hw):
            raise ValueError("no lowering")

    monkeypatch.setattr(coverage_models, "templates_for", lambda card: [Unbuildable()])
    counts = collections.Counter()
    (failure,) = coverage_models.check(card, None, counts)
    assert failure["stage"] == "build" and "no lowering" in failure["message"] and counts["failed: build"] == 1
