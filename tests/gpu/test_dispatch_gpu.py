"""A real .cast on a real GPU: known-good kernels for layer_norm and in-place relu, packaged
from a search log and applied to an unmodified model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from test_dispatch import make_card
from test_package import build_run, result

from kforge.candidate import Candidate, LaunchPlan
from kforge.dispatch import Dispatcher
from kforge.modelcheck import check_model
from kforge.replay import GraphUnsupported, graphed
from kforge.package import load, write_package

pytestmark = pytest.mark.gpu

ROWS, D = 64, 512

LAYER_NORM = r"""
extern "C" __global__ void ln_rows(const float* x, const float* w, const float* b, float* y, float* mean,
                                   float* rstd, int d, float eps) {
  __shared__ float s1[256], s2[256];
  const float* xr = x + (long)blockIdx.x * d;
  float a = 0.f, q = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) { float v = xr[i]; a += v; q += v * v; }
  s1[threadIdx.x] = a; s2[threadIdx.x] = q;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) { s1[threadIdx.x] += s1[threadIdx.x + s]; s2[threadIdx.x] += s2[threadIdx.x + s]; }
    __syncthreads();
  }
  float m = s1[0] / d, r = rsqrtf(fmaxf(s2[0] / d - m * m, 0.f) + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) y[(long)blockIdx.x * d + i] = (xr[i] - m) * r * w[i] + b[i];
  if (threadIdx.x == 0) { mean[blockIdx.x] = m; rstd[blockIdx.x] = r; }
}
"""

RELU_INPLACE = r"""
extern "C" __global__ void relu_inplace(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = fmaxf(x[i], 0.f);
}
"""


def arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.LayerNorm(D), nn.ReLU(inplace=True)).cuda()
    with torch.no_grad():
        m[0].weight.uniform_(0.5, 1.5)
        m[0].bias.uniform_(-0.2, 0.2)
    return m


def cards_and_candidates(m: nn.Module, x: torch.Tensor):
    ln = m[0]
    ln_card = make_card(torch.ops.aten.native_layer_norm.default, x, [D], ln.weight.detach(), ln.bias.detach(),
                        ln.eps, arch=arch())
    h = torch.nn.functional.layer_norm(x, (D,), ln.weight, ln.bias).detach()
    relu_card = make_card(torch.ops.aten.relu_.default, h, aliases={0: 0}, arch=arch())
    ln_plan = LaunchPlan.from_json({"kernels": [{"name": "ln_rows", "grid": [ROWS, 1, 1], "block": [256, 1, 1], "args": [
        {"in": 0}, {"in": 1}, {"in": 2}, {"out": 0}, {"out": 1}, {"out": 2}, {"i32": D}, {"f32": ln.eps}]}]})
    n = ROWS * D
    relu_plan = LaunchPlan.from_json({"kernels": [{"name": "relu_inplace", "grid": [(n + 255) // 256, 1, 1],
                                                   "block": [256, 1, 1], "args": [{"out": 0}, {"i32": n}]}]})
    return (ln_card, Candidate(LAYER_NORM, ln_plan)), (relu_card, Candidate(RELU_INPLACE, relu_plan))


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Path]:
    """'both': layer_norm and relu_; 'ln' and 'relu': one each (for two packages at once)."""
    root = tmp_path_factory.mktemp("casts")
    x = torch.randn(ROWS, D, device="cuda")
    (ln_card, ln_cand), (relu_card, relu_cand) = cards_and_candidates(model(), x)
    out = {}
    for name, pairs in {"both": [(ln_card, ln_cand), (relu_card, relu_cand)], "ln": [(ln_card, ln_cand)],
                        "relu": [(relu_card, relu_cand)]}.items():
        run = build_run(root / name, [(card, [(cand, result())], None) for card, cand in pairs], arch=arch())
        out[name] = write_package(run, root / f"{name}.cast")
    return out


def eager(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x.clone())


def test_package_dispatches_and_matches_eager(packages):
    m, x = model(), torch.randn(ROWS, D, device="cuda")
    want = eager(m, x)
    pkg = load(packages["both"])
    assert all(c.dispatched for c in pkg.cards), pkg.report()
    with torch.no_grad(), pkg.apply():
        got = m(x.clone())
        m(torch.randn(ROWS + 1, D, device="cuda"))  # another shape: falls back
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    rows = {r["op"]: r for r in pkg.report()["cards"]}
    assert rows["aten::native_layer_norm.default"]["hits"] == 1
    assert rows["aten::native_layer_norm.default"]["fallbacks"] == {"shape": 1}
    assert rows["aten::relu_.default"]["hits"] == 1


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_grad_modes(packages, mode):
    m, x = model(), torch.randn(ROWS, D, device="cuda")
    want = eager(m, x).detach()
    pkg = load(packages["both"])
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx, pkg.apply():
        got = m(x.clone())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert all(c.counters.hits == 1 for c in pkg.cards)


def test_autograd_forward_returns_mean_and_rstd_backward_uses(packages):
    m, x = model(), torch.randn(ROWS, D, device="cuda")
    xe = x.clone().requires_grad_()
    m(xe).square().sum().backward()
    want_x, want_w = xe.grad.clone(), m[0].weight.grad.clone()
    m.zero_grad()
    pkg = load(packages["both"])
    xk = x.clone().requires_grad_()
    with pkg.apply():
        y = m(xk)
    y.square().sum().backward()
    torch.testing.assert_close(xk.grad, want_x, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(m[0].weight.grad, want_w, atol=1e-4, rtol=1e-4)
    assert all(c.counters.hits == 1 for c in pkg.cards)


def test_cuda_graph_capture_and_replay(packages):
    m = model()
    static_x = torch.randn(ROWS, D, device="cuda")
    pkg = load(packages["both"])
    with torch.no_grad(), pkg.apply():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m(static_x.clone())  # warm-up off the default stream, as torch.cuda.graph asks
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = m(static_x)
        hits = [c.counters.hits for c in pkg.cards]
    for _ in range(3):
        fresh = torch.randn(ROWS, D, device="cuda")
        want = eager(m, fresh)
        static_x.copy_(fresh)
        graph.replay()
        torch.testing.assert_close(static_y, want, atol=1e-4, rtol=1e-4)
    assert hits == [2, 2], "warm-up and capture both went through the kernels"


def test_the_cpp_path_dispatches_on_the_current_stream_and_records_into_a_cuda_graph(packages):
    from kforge import dispatch

    m = model()
    native, why = dispatch.native_status("CUDA")
    if not native:
        pytest.skip(f"guarded dispatch runs in Python here: {why}")
    from kforge import _dispatch

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert _dispatch.current_stream("cuda", torch.cuda.current_device()) == side.cuda_stream
    static_x = torch.randn(ROWS, D, device="cuda")
    pkg = load(packages["both"])
    with torch.no_grad(), pkg.apply():
        shared = Dispatcher.shared("CUDA")
        paths = {op: shared.path(op)[0] for op in shared.ops}
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m(static_x.clone())
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = m(static_x)
        hits = [c.counters.hits for c in pkg.cards]
    assert paths == {"aten::native_layer_norm.default": "native", "aten::relu_.default": "native"}
    fresh = torch.randn(ROWS, D, device="cuda")
    want = eager(m, fresh)
    static_x.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(static_y, want, atol=1e-4, rtol=1e-4)
    assert hits == [2, 2]


def test_the_python_path_still_serves_packages(packages, monkeypatch):
    monkeypatch.setenv("KFORGE_DISPATCH", "python")
    m, x = model(), torch.randn(ROWS, D, device="cuda")
    want = eager(m, x)
    pkg = load(packages["both"])
    with torch.no_grad(), pkg.apply():
        assert Dispatcher.shared("CUDA").path("aten::relu_.default") == ("python", "KFORGE_DISPATCH=python")
        got = m(x.clone())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert all(c.counters.hits == 1 for c in pkg.cards)


def test_two_packages_at_once_and_uninstall_in_any_order(packages):
    dumps = {op: torch._C._dispatch_dump(op) for op in ("aten::native_layer_norm", "aten::relu_")}
    m, x = model(), torch.randn(ROWS, D, device="cuda")
    want = eager(m, x)
    ln, relu = load(packages["ln"]), load(packages["relu"])
    with torch.no_grad():
        ln.install()
        relu.install()
        assert Dispatcher.shared("CUDA").ops == ["aten::native_layer_norm.default", "aten::relu_.default"]
        torch.testing.assert_close(m(x.clone()), want, atol=1e-4, rtol=1e-4)
        ln.uninstall()
        torch.testing.assert_close(m(x.clone()), want, atol=1e-4, rtol=1e-4)
        relu.uninstall()
    assert (ln.cards[0].counters.hits, relu.cards[0].counters.hits) == (1, 2)
    assert {op: torch._C._dispatch_dump(op) for op in dumps} == dumps


def test_fresh_process_loads_and_applies_the_package(packages, tmp_path):
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parent.parent)]!r}
        import kforge
        from test_dispatch_gpu import model, eager, ROWS, D
        m, x = model(), torch.randn(ROWS, D, device="cuda")
        want = eager(m, x)
        pkg = kforge.load({str(packages["both"])!r})
        with torch.no_grad(), pkg.apply():
            got = m(x.clone())
        print(json.dumps({{"err": (got - want).abs().max().item(), "hits": [c["hits"] for c in pkg.report()["cards"]]}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["hits"] == [1, 1] and out["err"] < 1e-4


def test_verify_revalidates_on_this_gpu(packages):
    pytest.importorskip("kforge.evaluate")
    pkg = load(packages["both"])
    results = pkg.verify()
    assert set(results) == {c.id for c in pkg.cards}
    assert not any(r.verdict.failed for r in results.values()), {k: r.message for k, r in results.items()}
    assert all(c.dispatched for c in pkg.cards)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_an_index_less_device_argument_means_the_current_device():
    """_to_copy(x on cuda:1, device="cuda") with cuda:0 current: the result must land where
    eager puts it. A kernel runs on x's device, so when eager's result is elsewhere, eager serves."""
    from test_dispatch import FakeLauncher, to_copy_card
    from kforge.dispatch import Variant

    x0 = torch.randn(4, 8, device="cuda:0")
    x1 = x0.to("cuda:1")
    with torch.cuda.device(0):
        want = torch.ops.aten._to_copy.default(x1, dtype=x1.dtype, device=torch.device("cuda")).device
    launcher = FakeLauncher(lambda ins, outs: outs[0].copy_(ins[0]))
    v = Variant(to_copy_card(x0, torch.device("cuda")), 0, launcher)
    d = Dispatcher("CUDA")
    d.add("pkg", [v])
    try:
        with torch.cuda.device(0):
            y = torch.ops.aten._to_copy.default(x1, dtype=x1.dtype, device=torch.device("cuda"))
            got = (y.device, v.counters.hits, dict(v.counters.fallbacks))
            assert got[0] == want, (got, want)
            if want != x1.device:
                assert got[1:] == (0, {"device": 1}), (got, want)
            z = torch.ops.aten._to_copy.default(x1, dtype=x1.dtype, device=torch.device("cuda", 1))
            assert z.device == torch.device("cuda", 1), z.device
        assert torch.equal(y.cpu(), x0.cpu()) and torch.equal(z.cpu(), x0.cpu())
    finally:
        d.remove("pkg")



def test_the_model_check_replays_the_forward_from_cuda_graphs(packages):
    x = torch.randn(ROWS, D, device="cuda")
    pkg = load(packages["both"])
    check = check_model(model(), x, pkg, rounds=3, calls=2)
    assert check.hits > 0 and check.graphed and not check.graph_error, check.message()
    assert check.graph_eager_us > 0 and check.graph_package_us > 0 and check.graph_verdict in ("faster", "level", "slower")
    assert "replayed from a CUDA graph: eager" in check.message()
    assert not pkg.installed


class Syncing(nn.Module):
    """Reads a value back on the host mid-forward: a CUDA graph cannot hold it."""

    def __init__(self):
        super().__init__()
        self.inner = model()

    def forward(self, x):
        y = self.inner(x)
        return y * 2 if y.sum().item() > 0 else y


def process_is_as_before(stream) -> None:
    """After a forward a graph could not hold: the same stream is current, no capture is
    under way, and the CUDA generator still serves random ops (torch leaves it in capture
    mode after a failed capture unless kforge puts it back)."""
    assert torch.cuda.current_stream() == stream and not torch.cuda.is_current_stream_capturing()
    torch.randn(4, device="cuda").uniform_()
    torch.cuda.synchronize()


def test_a_forward_that_syncs_is_reported_by_the_model_check_not_raised(packages):
    x, stream = torch.randn(ROWS, D, device="cuda"), torch.cuda.current_stream()
    pkg = load(packages["both"])
    check = check_model(Syncing(), x, pkg, rounds=3, calls=2)
    assert check.hits > 0 and check.eager_us > 0 and not check.graphed, check.message()
    assert "synchronizes with the host" in check.graph_error
    assert "not replayed from a CUDA graph" in check.message()
    assert not pkg.installed
    process_is_as_before(stream)
    m = model()  # the package's kernels still serve the next forward
    with torch.no_grad(), pkg.apply():
        got = m(x.clone())
    torch.testing.assert_close(got, eager(m, x), atol=1e-4, rtol=1e-4)


def test_a_failed_capture_is_undone():
    x, stream = torch.randn(ROWS, D, device="cuda"), torch.cuda.current_stream()

    def forward():  # legal outside a capture (so the warm-up passes), illegal inside one
        y = torch.rand_like(x) + x  # a random op inside the capture: the generator enters capture mode
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().synchronize()
        return y

    with pytest.raises(Exception) as failed:
        graphed(forward)
    assert not isinstance(failed.value, GraphUnsupported)  # the warm-up passed; the capture itself failed
    process_is_as_before(stream)
    assert graphed(lambda: x * 2) is not None  # and the next capture works
