"""The replayed reply styles on a GPU: what kforge read out of each style (source chosen
among drafts, helper blocks joined, plan synonyms mapped, the compile box's prelude) is the
kernel the model meant, so it validates against PyTorch on the real card."""

from __future__ import annotations

import pytest
import torch

from kforge.capturing import capture
from kforge.evaluate import make_evaluator
from test_llm_replay import replay_all, table

pytestmark = pytest.mark.gpu


def test_every_replayed_style_yields_a_correct_kernel(tmp_path):
    outcomes, _, _ = replay_all(tmp_path / "replay")
    x = torch.randn(4096, 1024, device="cuda")
    card = next(c for c in capture(torch.nn.Softmax(dim=-1), x, tmp_path / "run").cards
                if c.op == "aten::_softmax.default")
    wrong = []
    with make_evaluator(tmp_path / "run", timeout_s=10.0) as evaluator:
        for o in outcomes:
            if o.candidate is None:
                continue
            result = evaluator.evaluate(card, o.candidate)
            if result.verdict.value not in ("valid", "slower"):
                wrong.append(f"{o.style.name}: {result.verdict.value} {result.message}")
    assert not wrong, "\n".join(wrong) + "\n" + table(outcomes)
