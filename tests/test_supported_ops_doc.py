"""docs/supported-ops.md is what the code supports: regenerate it with `python -m kforge.supported`."""

from pathlib import Path

from kforge import supported


def test_the_supported_ops_page_is_current():
    page = Path(__file__).resolve().parents[1] / "docs" / "supported-ops.md"
    assert page.read_text() == supported.markdown(), "run: python -m kforge.supported > docs/supported-ops.md"
