"""The house's own rule: no module of ftrun/ is over 500 lines (one module, one idea)."""

from __future__ import annotations

from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ftrun"
MOST_LINES = 500


@pytest.mark.quick
def test_no_module_is_over_500_lines():
    sizes = {p.relative_to(PACKAGE.parent).as_posix(): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
    assert len(sizes) > 40, sorted(sizes)  # the package was found, whole
    over = {name: n for name, n in sizes.items() if n > MOST_LINES}
    assert not over, f"split these modules (at most {MOST_LINES} lines each): {over}"
