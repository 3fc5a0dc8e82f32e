"""The diffs the guides show between two files of the repository, kept in the pages so that they
read in a clone, and kept true by a test. A marker, alone on a line, names the two files:

    <!-- diff: tests/ported/ddp_tutorial.py tests/ported/ddp_tutorial_ft.py -->

and the ```diff block right after it is `diff -u` between them (paths as written, relative to the
repository). fill() writes or rewrites that block (scripts/docs_reference.py --write);
tests/test_docs.py fails while a page's block is not what fill() gives. As an mkdocs hook
(mkdocs.yml `hooks:`) it refreshes the blocks of the site being built the same way."""

import difflib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The marker, and the diff block that follows it when there is one already.
MARKER = re.compile(r"^<!-- diff: (\S+) (\S+) -->\n(?:```diff\n.*?^```\n)?", re.MULTILINE | re.DOTALL)


def diff(a: str, b: str) -> str:
    left = (ROOT / a).read_text().splitlines(keepends=True)
    right = (ROOT / b).read_text().splitlines(keepends=True)
    body = "".join(difflib.unified_diff(left, right, fromfile=a, tofile=b, n=2))
    return f"```diff\n{body.rstrip()}\n```\n"


def fill(markdown: str) -> str:
    """The page with every marker's diff block as the files give it now."""
    return MARKER.sub(lambda m: f"<!-- diff: {m.group(1)} {m.group(2)} -->\n" + diff(m.group(1), m.group(2)),
                      markdown)


def on_page_markdown(markdown: str, **_kwargs) -> str:
    return fill(markdown)
