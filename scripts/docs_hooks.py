"""mkdocs hook (mkdocs.yml `hooks:`): a page may show the diff between two files of the repository,
made at build time so it cannot drift from the files. The marker, alone on a line:

    <!-- diff: tests/ported/ddp_tutorial.py tests/ported/ddp_tutorial_ft.py -->

becomes a ```diff block of `diff -u` between them (paths as written, relative to the repository)."""

import difflib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- diff: (\S+) (\S+) -->$", re.MULTILINE)


def _diff(match: "re.Match[str]") -> str:
    a, b = match.group(1), match.group(2)
    left = (ROOT / a).read_text().splitlines(keepends=True)
    right = (ROOT / b).read_text().splitlines(keepends=True)
    body = "".join(difflib.unified_diff(left, right, fromfile=a, tofile=b, n=2))
    return f"```diff\n{body.rstrip()}\n```"


def on_page_markdown(markdown: str, **_kwargs) -> str:
    return MARKER.sub(_diff, markdown)
