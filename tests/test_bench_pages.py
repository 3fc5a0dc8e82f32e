"""scripts/bench_pages.py: a benchmark's table goes between its page's markers, the rest kept."""

from __future__ import annotations

import sys

import pytest

from conftest import SCRIPTS

sys.path.insert(0, str(SCRIPTS))

from bench_pages import write_between  # noqa: E402

BEGIN, END = "<!-- x:begin -->", "<!-- x:end -->"


@pytest.mark.quick
def test_the_table_replaces_the_old_one_and_the_page_is_kept(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nbefore\n\n{BEGIN}\nold table\n{END}\n\nafter\n")
    write_between(page, "| new |", BEGIN, END)
    assert page.read_text() == f"# Title\n\nbefore\n\n{BEGIN}\n| new |\n{END}\n\nafter\n"
    write_between(page, "| newer |", BEGIN, END)
    assert page.read_text().count(BEGIN) == 1 and "| new |\n" not in page.read_text()


@pytest.mark.quick
def test_a_page_without_markers_gets_the_block_appended_and_a_missing_one_is_made(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\ntext\n\n")
    write_between(page, "| t |", BEGIN, END)
    assert page.read_text() == f"# Title\n\ntext\n\n{BEGIN}\n| t |\n{END}\n"
    fresh = tmp_path / "fresh.md"
    write_between(fresh, "| t |", BEGIN, END, "# Made\n\n")
    assert fresh.read_text() == f"# Made\n\n{BEGIN}\n| t |\n{END}\n"
