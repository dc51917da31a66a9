"""The whole job on a real GPU: capture, MCTS with the builtin proposer and the real evaluator,
package, load; then a resumed run that evaluates nothing twice."""

from __future__ import annotations

import pytest
import torch

import kforge
from kforge import runner
from kforge.store import connect

pytestmark = pytest.mark.gpu


class Block(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(torch.relu(x) * 2.0, dim=-1)


def test_run_searches_validates_and_packages(tmp_path):
    x = torch.randn(64, 4096, device="cuda")
    result = kforge.run(Block(), (x,), out=tmp_path / "block.cast", iterations=6, run_dir=tmp_path / "run",
                        progress=False)
    assert result.validated and result.package_path == tmp_path / "block.cast" and result.package_path.exists()
    searched = [r for r in result.table if r.status == "done"]
    assert searched, f"nothing was searched: {[(r.op, r.note) for r in result.table]}"
    assert all(r.iterations == 6 for r in searched)
    conn = connect(tmp_path / "run", readonly=True)
    verdicts = {v for (v,) in conn.execute("SELECT verdict FROM candidates")}
    assert verdicts & {"valid", "slower"}, f"no candidate was correct: {verdicts}"
    assert "untimed" not in verdicts
    report = kforge.load(result.package_path).report()
    assert len(report["cards"]) == len(result.table)
    # With a kernel for eager dispatch or compiled graphs, the run ends by timing the model
    # eager, with the package, and (for compiled graphs' kernels) under both compiles.
    pkg = kforge.load(result.package_path)
    if any(c.dispatched or c.compiled for c in pkg.cards):
        check = result.model_check
        assert check is not None and not result.model_check_error and check.device == "cuda:0"
        assert check.eager_us > 0 and check.package_us > 0
        if any(c.dispatched for c in pkg.cards):
            assert check.verdict in ("faster", "level", "slower")
        else:  # kernels for compiled graphs only: the eager forward never reaches them, kforge.compile's does
            assert check.verdict == "unused" and not check.compile_error
            assert check.compile_verdict() in ("faster", "level", "slower"), check.compiled
    else:
        assert result.model_check is None

    # Resuming with a larger budget continues the same run and evaluates nothing twice.
    before = {(c, d) for c, d in conn.execute("SELECT card_id, digest FROM candidates")}
    again = runner.run(resume=True, run_dir=tmp_path / "run", out=tmp_path / "block2.cast", iterations=9,
                       progress=False)
    assert again.run_id == result.run_id
    pairs = [(c, d) for c, d in conn.execute("SELECT card_id, digest FROM candidates")]
    assert len(pairs) == len(set(pairs)) and before <= set(pairs)
    assert all(r.iterations == 9 for r in again.table if r.status == "done")


class Scores(torch.nn.Module):
    """Attention-style: bf16 scores, softmax in fp32 (dtype=), back to bf16."""

    def forward(self, x):
        return torch.nn.functional.softmax(x * 0.125, dim=-1, dtype=torch.float32).to(x.dtype)


def test_softmax_with_dtype_is_searched_packaged_and_dispatched_above_autograd(tmp_path):
    x = torch.randn(4, 8, 512, 512, device="cuda", dtype=torch.bfloat16)
    result = kforge.run(Scores(), (x,), out=tmp_path / "scores.cast", iterations=8, run_dir=tmp_path / "run",
                        progress=False, ops=["softmax.int"], check_model=False)
    (row,) = [r for r in result.table if r.op == "aten::softmax.int"]
    assert row.status == "done", row.note
    pkg = kforge.load(result.package_path)
    (card,) = [c for c in pkg.cards if c.card.op == "aten::softmax.int"]
    if not card.dispatched:
        pytest.skip(f"the search found no kernel faster than eager as dispatched: {card.reason}")
    want = Scores()(x)
    with pkg.apply():
        with torch.inference_mode():
            a = Scores()(x)
        with torch.no_grad():
            b = Scores()(x)
        xr = x.clone().requires_grad_()
        c = Scores()(xr)
        c.float().sum().backward()
    assert card.counters.hits == 2 and card.counters.fallbacks == {"autograd": 1}
    for got in (a, b, c.detach()):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-2)
    assert xr.grad is not None
