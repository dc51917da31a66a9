"""A real .cast inside torch.compile on a real GPU: the layer_norm kernel of test_dispatch_gpu in
Inductor's graphs, default and reduce-overhead (cudagraph trees). A linear layer follows the norm:
a pointwise op after it would fuse with it in Inductor, and the pass leaves fused chains to Inductor."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import kforge
from kforge.package import load
from test_dispatch_gpu import D, ROWS, packages  # noqa: F401 (packages is a fixture)

pytestmark = pytest.mark.gpu


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D)).cuda().eval()
    with torch.no_grad():
        m[0].weight.uniform_(0.5, 1.5)
        m[0].bias.uniform_(-0.2, 0.2)
    return m


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def hits(pkg) -> int:
    return sum(c.counters.hits for c in pkg.cards)


def test_kforge_compile_runs_the_kernel_inside_inductors_graph(packages):  # noqa: F811
    m, x = model(), torch.randn(ROWS, D, device="cuda")
    pkg = load(packages["ln"])
    compiled = kforge.compile(m, pkg)
    with torch.inference_mode():
        want = m(x)
        got = compiled(x)
        other = torch.randn(ROWS, D, device="cuda")
        got_other = compiled(other)
        want_other = m(other)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got_other, want_other, atol=1e-3, rtol=1e-3)
    assert hits(pkg) == 2


def test_reduce_overhead_records_the_kernel_into_cudagraph_trees(packages):  # noqa: F811
    m = model()
    pkg = load(packages["ln"])
    compiled = kforge.compile(m, pkg, mode="reduce-overhead")
    with torch.inference_mode():
        for _ in range(3):  # warm-up, record, replay
            x = torch.randn(ROWS, D, device="cuda")
            got = compiled(x).clone()
            torch.testing.assert_close(got, m(x), atol=1e-3, rtol=1e-3)
    assert hits(pkg) >= 1  # replays launch the recorded kernel without calling the op


def test_the_options_alone_install_the_pass_and_stay_correct(packages):  # noqa: F811
    m, x = model(), torch.randn(ROWS, D, device="cuda")
    pkg = load(packages["ln"])
    compiled = torch.compile(m, options=pkg.inductor_options())
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), m(x), atol=1e-3, rtol=1e-3)
    # Inductor decomposes layer_norm before any post-grad pass: only kforge.compile keeps it whole.
    assert hits(pkg) == 0


def test_a_call_the_guard_misses_is_inductors(packages):  # noqa: F811
    m, x = model(), torch.randn(ROWS + 1, D, device="cuda")
    pkg = load(packages["ln"])
    with torch.inference_mode():
        torch.testing.assert_close(kforge.compile(m, pkg)(x), m(x), atol=1e-3, rtol=1e-3)
    assert hits(pkg) == 0


def test_the_model_check_times_torch_compile_and_kforge_compile_in_the_same_rounds(packages):  # noqa: F811
    from kforge.modelcheck import COMPILED, check_model

    m, x = model(), torch.randn(ROWS, D, device="cuda")
    pkg = load(packages["ln"])
    check = check_model(m, x, pkg, rounds=3, calls=2, with_compile=True)
    assert not check.compile_error and set(check.compiled) == set(COMPILED)
    assert check.compile_hits == (pkg.cards[0].id,)
    assert check.compile_verdict() in ("faster", "level", "slower") and "kforge.compile" in check.message()
    assert check.hits > 0  # the eager package's own hits, counted apart from the compiled graphs'
    # the check's compiles are gone: the user's compiles afterwards run the kernel, not eager (with the
    # check's six entries left in dynamo's cache, the third of these would be past its limit of eight)
    for _ in range(3):
        before = hits(pkg)
        with torch.inference_mode():
            fn = kforge.compile(m, pkg, use_verdict=False)
            for _ in range(3):
                fn(x)
        assert hits(pkg) > before


def test_a_norm_inside_a_fused_chain_stays_inductors(packages):  # noqa: F811
    m = nn.Sequential(nn.LayerNorm(D), nn.GELU()).cuda().eval()
    x = torch.randn(ROWS, D, device="cuda")
    pkg = load(packages["ln"])
    with torch.inference_mode():
        torch.testing.assert_close(kforge.compile(m, pkg)(x), m(x), atol=1e-3, rtol=1e-3)
    assert hits(pkg) == 0  # layer_norm -> gelu is one Inductor kernel: the card stays out


def test_the_check_records_a_verdict_and_leave_one_out_times_the_model_without_the_card(packages):  # noqa: F811
    from kforge.modelcheck import check_model

    m, x = model(), torch.randn(ROWS, D, device="cuda")
    pkg = load(packages["ln"])
    check = check_model(m, x, pkg, rounds=3, calls=2, with_compile=True, leave_one_out=1)
    record = check.compile_record()
    assert record is not None and record["compiled_cards"] == [pkg.cards[0].id]
    if "faster" in (check.compile_verdict(), check.compile_verdict("reduce-overhead")):
        assert record["use"] == "kforge.compile" and not check.leave_one_out
    else:  # without its one card kforge.compile is torch.compile: never "faster" beyond the noise but by chance
        assert set(check.leave_one_out) == {"torch.compile", "kforge.compile", pkg.cards[0].id}
        assert [r["card"] for r in record["leave_one_out"]] == [pkg.cards[0].id]
