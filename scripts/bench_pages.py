"""Where a benchmark script writes its table into its docs page: between the page's two marker
comments, the rest of the page kept. The benchmarks under scripts/ share it; it never runs or
measures anything.
"""

from __future__ import annotations

from pathlib import Path


def write_between(path: Path, text: str, begin: str, end: str, new_page: str = "") -> None:
    """`text` between `begin` and `end` in the page at `path`, the rest kept. A page without the
    markers gets the block appended; a missing one is made (`new_page` above the block)."""
    block = f"{begin}\n{text}\n{end}"
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        path.write_text(old[:old.index(begin)] + block + old[old.index(end) + len(end):])
    elif old:
        path.write_text(old.rstrip() + "\n\n" + block + "\n")
    else:
        path.write_text(new_page + block + "\n")
