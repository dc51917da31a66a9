"""Model specs (file or module:factory) and the bundled examples at their small CPU sizes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from kforge.capturing import capture
from kforge.errors import CaptureError
from kforge.modelspec import load_model_spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def write(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


def test_model_file(tmp_path):
    spec = write(tmp_path / "model.py", """
        import torch
        def get_model():
            return torch.nn.Linear(4, 2)
        def get_inputs():
            return torch.ones(3, 4)
    """)
    model, inputs = load_model_spec(str(spec))
    assert isinstance(model, torch.nn.Linear) and inputs.shape == (3, 4)


def test_module_factory(tmp_path, monkeypatch):
    write(tmp_path / "mymodels.py", """
        import torch
        def tiny():
            return torch.nn.ReLU(), (torch.ones(2),)
        def wrong():
            return torch.nn.ReLU()
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    model, inputs = load_model_spec("mymodels:tiny")
    assert isinstance(model, torch.nn.ReLU) and inputs[0].shape == (2,)
    with pytest.raises(CaptureError, match=r"mymodels:wrong\(\) returned ReLU; it must return a \(model, inputs\)"):
        load_model_spec("mymodels:wrong")
    with pytest.raises(CaptureError, match=r"defines no function missing\(\) \(callables there: tiny, wrong\)"):
        load_model_spec("mymodels:missing")


@pytest.mark.parametrize("spec,match", [
    ("nothing_here", "neither a .py file nor 'package.module:factory'"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("missing/model.py", "does not exist"),
])
def test_bad_specs(spec, match):
    with pytest.raises(CaptureError, match=match):
        load_model_spec(spec)


def test_model_file_without_get_inputs(tmp_path):
    spec = write(tmp_path / "half.py", """
        import torch
        def get_model():
            return torch.nn.ReLU()
    """)
    with pytest.raises(CaptureError, match=r"no function get_inputs\(\) .* must define get_model\(\) and get_inputs\(\)"):
        load_model_spec(str(spec))


def test_model_file_that_fails_to_import(tmp_path):
    spec = write(tmp_path / "broken.py", "import not_a_module_xyz\n")
    with pytest.raises(CaptureError, match="importing model file .*broken.py raised ModuleNotFoundError") as info:
        load_model_spec(str(spec))
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_errors_raised_by_get_model_or_get_inputs_name_the_function_and_line(tmp_path):
    spec = write(tmp_path / "needs.py", """
        import torch
        def get_model():
            import not_installed_xyz
        def get_inputs():
            return torch.randn(2)
    """)
    with pytest.raises(CaptureError, match=r"get_model\(\) raised ModuleNotFoundError: .*not_installed_xyz.* \(at .*needs.py:4\)") as info:
        load_model_spec(str(spec))
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    spec = write(tmp_path / "inputs.py", """
        import torch
        def get_model():
            return torch.nn.ReLU()
        def get_inputs():
            raise ValueError("no data here")
    """)
    with pytest.raises(CaptureError, match=r"get_inputs\(\) raised ValueError: no data here"):
        load_model_spec(str(spec))


def test_a_failing_factory_without_a_name_still_shows_its_error(tmp_path, monkeypatch):
    write(tmp_path / "partials.py", """
        import functools
        def _build(size):
            raise RuntimeError(f"size {size} is not supported")
        factory = functools.partial(_build, 3)
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(CaptureError, match=r"partials:factory: functools.partial.*raised RuntimeError: size 3 is not"):
        load_model_spec("partials:factory")


# ---- examples: small sizes on the CPU, the ops that matter are captured --------------------

@pytest.mark.parametrize("name,ops", [
    ("gemma_decoder", {"aten::_softmax.default", "aten::bmm.default", "aten::gelu.default", "aten::rsqrt.default"}),
    ("sd_vae_decoder", {"aten::native_group_norm.default", "aten::silu.default", "aten::convolution.default"}),
    ("qwen_moe", {"aten::_softmax.default", "aten::topk.default", "aten::silu.default", "aten::index_add_.default"}),
])
def test_examples_capture(tmp_path, name, ops):
    model, inputs = load_model_spec(str(EXAMPLES / f"{name}.py"))
    r = capture(model, inputs, tmp_path, time_cards=False)
    assert ops <= {c.op for c in r.cards}
    assert all(c.device_type == "cpu" for c in r.cards if c.inputs)


def test_resnet50_example():
    pytest.importorskip("torchvision", reason="torchvision is not installed")
    model, inputs = load_model_spec(str(EXAMPLES / "resnet50.py"))
    assert inputs.shape == (2, 3, 64, 64)
    assert model(inputs).shape == (2, 1000)
